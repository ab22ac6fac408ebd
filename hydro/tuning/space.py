"""Search spaces: which hyperparameters Hydro knows, and how a config file states them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from hydro.errors import ConfigError

# name -> what it does; every one transfers from the surrogate to the target unchanged
HYPERPARAMETERS: dict[str, str] = {
    "lr": "base learning rate (muP scales it per parameter)",
    "momentum": "SGD momentum",
    "beta1": "Adam beta1",
    "beta2": "Adam beta2",
    "eps": "Adam epsilon",
    "weight_decay": "weight decay (decoupled for AdamW)",
    "warmup": "linear warm-up steps in front of the schedule",
    "dropout": "the p of every nn.Dropout",
    "batch_size": "batch size (trials with different batch sizes train in separate groups)",
    "grad_clip": "per-trial gradient-norm clipping threshold",
    "init_scale": "multiplier of the initial weights of every matrix",
    "output_mult": "muP output multiplier: scales the readout layer's input",
}

Space = Mapping[str, BaseDistribution] | Callable[[optuna.Trial], Any]


def check_space(space: Any, model_args: set[str] | None, steps: int | None = None) -> None:
    """Raise a ConfigError naming an unknown hyperparameter, with the known ones, or (given the
    task's ``steps``) a warm-up range the run cannot hold (:func:`check_warmup`)."""
    if callable(space) and not isinstance(space, Mapping):
        return  # checked when the trial's parameters are known
    if not isinstance(space, Mapping):
        raise ConfigError("space must be a dict of Optuna distributions or a function of a trial")
    for name, dist in space.items():
        if not isinstance(dist, BaseDistribution):
            raise ConfigError(
                f"space[{name!r}] is {type(dist).__name__}, not an Optuna distribution; use e.g. "
                "optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)"
            )
    if model_args is not None:  # None: any name (your own training function reads them)
        check_names(space.keys(), model_args)
    if steps is not None:
        check_warmup(space, steps)


def check_warmup(
    space: Mapping[str, BaseDistribution], steps: int, steps_name: str = "Task(steps=...)"
) -> None:
    """Refuse a ``warmup`` distribution that can draw a value outside ``[0, steps)``.

    The recipe (:mod:`hydro.tuning.recipe`) needs each warm-up shorter than the run; checked
    here, a range such as 0-50 with 16 steps is one error before the first trial instead of a
    trial failing mid-run whenever the sampler draws 16 or more. ``steps_name`` names the
    setting to raise (``task.steps``, ``--steps``). A space function's values are checked by
    the recipe when its group is built.
    """
    dist = space.get("warmup")
    if dist is None:
        return
    if isinstance(dist, (IntDistribution, FloatDistribution)):
        # the recipe trains int(warmup) steps of warm-up; both ends of a range are drawn
        low, high, shown = int(dist.low), int(dist.high), f"ranges {dist.low:g} to {dist.high:g}"
    elif isinstance(dist, CategoricalDistribution):
        try:
            values = [int(c) for c in dist.choices]
        except (TypeError, ValueError):
            raise ConfigError(f"space['warmup'] choices {list(dist.choices)} must be numbers of "
                              "steps") from None
        low, high, shown = min(values), max(values), f"has choices {list(dist.choices)}"
    else:
        return  # suggest() names an unsupported distribution
    if low < 0:
        raise ConfigError(f"space['warmup'] {shown}: a warm-up is a number of steps >= 0; "
                          "raise its low end to 0 or more")
    if high >= steps:
        raise ConfigError(
            f"space['warmup'] {shown}, but each trial trains {steps} steps and a warm-up must "
            f"be shorter than the run: lower warmup's upper end to at most {steps - 1}, or "
            f"raise {steps_name} above {high}"
        )


def check_names(names: Any, model_args: set[str]) -> None:
    for name in names:
        if name not in HYPERPARAMETERS and name not in model_args:
            known = ", ".join(sorted(HYPERPARAMETERS))
            extra = (
                f"; model factory arguments: {', '.join(sorted(model_args))}" if model_args else ""
            )
            raise ConfigError(
                f"unknown hyperparameter {name!r} in the search space. Known: {known}{extra}"
            )


# user attribute holding every value a trial trains with, where that is more than its params
TRAINED = "hydro_params"


def sample(trial: optuna.Trial, space: Space) -> dict[str, Any]:
    """Draw a trial's hyperparameters from ``space``.

    A space function may return values it did not suggest (``{"lr": trial.suggest_float(...),
    "warmup": 20}``) or suggest under other names (``{"lr": 10 ** trial.suggest_float("log_lr",
    ...)}``); ``trial.params`` then differ from what trains, so the returned values are recorded
    with the trial (:func:`trained_params` reads them back).
    """
    if isinstance(space, Mapping):
        return {name: suggest(trial, name, dist) for name, dist in space.items()}
    result = space(trial)
    if result is None:
        return dict(trial.params)
    params = dict(result)
    trial.set_user_attr(TRAINED, {k: _storable(k, v) for k, v in params.items()})
    return params


def trained_params(trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    """Every value ``trial`` trained with: its params, plus the fixed values a space function
    returned beside them (the export, verification and ``best_params`` read this)."""
    recorded = trial.user_attrs.get(TRAINED)
    return dict(recorded) if isinstance(recorded, Mapping) else dict(trial.params)


def _storable(name: str, value: Any) -> Any:
    """``value`` as the study's storage keeps it (JSON), or a ConfigError naming it."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_storable(name, v) for v in value]
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a NumPy or torch scalar
        return value.item()
    raise ConfigError(
        f"the space function returned {name}={value!r} ({type(value).__name__}), which the "
        "study cannot store with the trial; return numbers, strings, booleans, None or lists "
        "of them, and build other objects from them in the model factory"
    )


def suggest(trial: optuna.Trial, name: str, dist: BaseDistribution) -> Any:
    """``trial.suggest_*`` for a distribution object."""
    if isinstance(dist, FloatDistribution):
        return trial.suggest_float(name, dist.low, dist.high, log=dist.log, step=dist.step)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, log=dist.log, step=dist.step)
    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(name, dist.choices)
    raise ConfigError(f"unsupported distribution for {name!r}: {type(dist).__name__}")


def from_config(spec: Mapping[str, Any], where: str = "space") -> dict[str, BaseDistribution]:
    """Distributions from a config mapping such as ``{lr: {type: float, low: 1e-4, ...}}``."""
    if not isinstance(spec, Mapping) or not spec:
        raise ConfigError(f"{where} must be a non-empty mapping of hyperparameter -> distribution")
    space: dict[str, BaseDistribution] = {}
    for name, d in spec.items():
        key = f"{where}.{name}"
        if not isinstance(d, Mapping) or "type" not in d:
            raise ConfigError(f"{key} must be a mapping with a 'type' (float, int, categorical)")
        kind = d["type"]
        allowed = {"float": {"low", "high", "log", "step"}, "int": {"low", "high", "log", "step"},
                   "categorical": {"choices"}}.get(kind)
        if allowed is None:
            raise ConfigError(f"{key}.type is {kind!r}; use float, int or categorical")
        unknown = set(d) - allowed - {"type"}
        if unknown:
            raise ConfigError(
                f"{key} has unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}"
            )
        try:
            if kind == "categorical":
                space[name] = CategoricalDistribution(list(d["choices"]))
            elif kind == "float":
                log = bool(d.get("log", False))
                space[name] = FloatDistribution(
                    float(d["low"]), float(d["high"]), log=log, step=d.get("step")
                )
            else:
                log = bool(d.get("log", False))
                space[name] = IntDistribution(
                    int(d["low"]), int(d["high"]), log=log, step=int(d.get("step", 1))
                )
        except (KeyError, ValueError, TypeError) as exc:
            raise ConfigError(f"{key}: {exc}") from exc
    return space

"""Train the full model with what a study found: :func:`recipe` reads an export (``best.yaml``)
and builds the full model's optimizer and learning-rate schedule, the ones every surrogate trial
trained with.

The export's ``training`` section names the optimizer (``adamw``, ``adam`` or ``sgd``) and its
``torch.optim`` arguments (the searched values, else the study's defaults), the schedule
(``cosine``, ``linear``, ``step`` or ``none``), the warm-up and the steps. muP relative to the
target makes the surrogate's hyperparameters the full model's own numbers, in standard
parametrization: nothing is rescaled here.

:func:`recipe` builds the optimizer and the schedule and hands back what is left to your loop
(the steps, the batch size, the gradient clipping) and to your model (``dropout``,
``init_scale``, ``output_mult``, when they were searched): it never changes the model.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from hydro._version import __version__
from hydro.errors import ConfigError

__all__ = ["OPTIMIZERS", "SCHEDULERS", "LRFactor", "Recipe", "read_export", "recipe"]

OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULERS = ("cosine", "linear", "step", "none")
# what a trial's model had set besides the optimizer and schedule: the recipe returns them
MODEL_SETTINGS = ("dropout", "init_scale", "output_mult")


class LRFactor:
    """A trial's learning-rate multiplier at ``step``: a linear warm-up from ``lr / (warmup +
    1)`` to ``lr`` over ``warmup`` steps, then the decay over the remaining steps (``cosine`` to
    0, ``linear`` to ``lr / 1000``, ``step``: divided by 10 at each third, ``none``: constant).

    It is the ``lr_lambda`` of the :class:`torch.optim.lr_scheduler.LambdaLR` that
    :func:`recipe` returns; an object rather than a closure so that the scheduler's
    ``state_dict`` keeps it.

    Example:
        >>> f = LRFactor("cosine", steps=10, warmup=2)
        >>> [round(f(s), 3) for s in (0, 1, 2, 6, 10)]
        [0.333, 0.667, 1.0, 0.5, 0.0]
    """

    def __init__(self, kind: str, steps: int, warmup: int) -> None:
        self.kind, self.steps, self.warmup = kind, int(steps), int(warmup)

    def __call__(self, step: int) -> float:
        warmup, rest = self.warmup, self.steps - max(self.warmup, 1)
        if step < warmup:
            return (step + 1) / (warmup + 1)
        t = min(step - warmup, rest)
        if self.kind == "cosine":
            return 0.5 * (1 + math.cos(math.pi * t / rest))
        if self.kind == "linear":
            return 1 - (1 - 1e-3) * t / rest
        if self.kind == "step":
            return 0.1 ** ((step - warmup) // max(1, rest // 3))
        return 1.0

    def __repr__(self) -> str:
        return f"LRFactor({self.kind!r}, steps={self.steps}, warmup={self.warmup})"


class Recipe(tuple):
    """What :func:`recipe` builds: unpacks as ``optimizer, scheduler``, and names the rest of
    the export's training recipe, which your loop and model apply.

    Attributes:
        optimizer: the ``torch.optim`` optimizer over the model's parameters.
        scheduler: a :class:`torch.optim.lr_scheduler.LambdaLR` (:class:`LRFactor`); call its
            ``step()`` once after each ``optimizer.step()``.
        steps: the training steps the schedule spans.
        warmup: its warm-up steps.
        batch_size: the batch size the trials trained with (your data loader's).
        grad_clip: the gradient-norm clipping threshold, or ``None`` (your loop's:
            ``torch.nn.utils.clip_grad_norm_`` before ``optimizer.step()``).
        model_settings: ``dropout``, ``init_scale`` and ``output_mult`` where the study searched
            them: the trials set them on their models; the recipe does not touch yours.
        training: the export's whole ``training`` section.
    """

    optimizer: Any
    scheduler: Any
    steps: int
    warmup: int
    batch_size: int | None
    grad_clip: float | None
    model_settings: dict[str, Any]
    training: dict[str, Any]

    def __new__(cls, optimizer: Any, scheduler: Any, **rest: Any) -> Recipe:
        made = super().__new__(cls, (optimizer, scheduler))
        made.__dict__.update(optimizer=optimizer, scheduler=scheduler, **rest)
        return made

    def __repr__(self) -> str:
        kind = type(self.optimizer).__name__
        return (
            f"Recipe({kind}, {self.training.get('scheduler')} over {self.steps} steps, "
            f"warmup {self.warmup}, batch size {self.batch_size})"
        )


def recipe(best: Any, model: Any, steps: int | None = None) -> Recipe:
    """The full model's optimizer and learning-rate scheduler, as the export ``best`` says:
    exactly the recipe each surrogate trial trained with.

    Args:
        best: a path to an export (``best.yaml``, or ``.json``), the dict read from one, or the
            :class:`hydro.TuneResult` a run returned.
        model: the full model (an ``nn.Module``: its parameters, one group), or the parameters
            or parameter groups to optimize, as ``torch.optim`` takes them.
        steps: the training steps the schedule spans (default: the export's ``steps``, the
            trials' own). The warm-up keeps its number of steps; the decay spans the rest.

    Returns:
        A :class:`Recipe`: ``optimizer, scheduler = recipe(...)``; its attributes name the
        steps, batch size, gradient clipping and model settings your loop applies.

    Raises:
        ConfigError: ``best`` is not a readable Hydro export (a missing file, bad YAML, a
            missing or malformed key, one written by a newer Hydro, or the export of your own
            training function, whose optimizer Hydro does not know), or ``steps`` does not
            hold the warm-up; the message names the file and the key.

    Example:
        >>> import torch
        >>> best = {"training": {"optimizer": "adamw", "scheduler": "cosine", "warmup": 2,
        ...         "steps": 10, "batch_size": 32, "grad_clip": None,
        ...         "optimizer_args": {"lr": 0.01, "weight_decay": 0.1,
        ...                            "betas": [0.9, 0.99], "eps": 1e-8}}}
        >>> opt, sched = recipe(best, torch.nn.Linear(4, 2))
        >>> type(opt).__name__, round(opt.param_groups[0]["lr"], 6)  # warm-up: lr / 3
        ('AdamW', 0.003333)
    """
    import torch

    data, where = read_export(best)
    train = data["training"]
    kind, args = train["optimizer"], dict(train["optimizer_args"])
    if "betas" in args:
        args["betas"] = tuple(args["betas"])
    total = train["steps"] if steps is None else steps
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ConfigError(f"steps must be a positive integer, got {total!r}")
    if train["warmup"] >= total:
        raise ConfigError(
            f"{where}: training.warmup {train['warmup']} must be shorter than the "
            f"steps ({total}): train more steps"
        )
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[kind]
    try:
        optimizer = cls(params, **args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{where}: training.optimizer_args do not fit torch.optim.{cls.__name__}: {exc}"
        ) from exc
    schedule = LRFactor(train["scheduler"], total, train["warmup"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    settings = {k: train[k] for k in MODEL_SETTINGS if train.get(k) is not None}
    return Recipe(
        optimizer,
        scheduler,
        steps=total,
        warmup=train["warmup"],
        batch_size=train.get("batch_size"),
        grad_clip=train.get("grad_clip"),
        model_settings=settings,
        training=dict(train),
    )


def read_export(best: Any) -> tuple[dict[str, Any], str]:
    """An export as a checked dict, and how messages name it (its path, or ``the export``).

    ``best``: a path (YAML, or JSON by its ``.json`` suffix), a dict, or a
    :class:`hydro.TuneResult`. The ``training`` section is checked key by key.

    Raises:
        ConfigError: what is wrong, naming the file and key.
    """
    if isinstance(best, (str, os.PathLike)):
        where = os.fspath(best)
        data = _load(where)
    elif isinstance(best, Mapping):
        where, data = "the export", dict(best)
    elif hasattr(best, "study") and hasattr(best, "export"):  # a TuneResult
        from hydro.tuning.outputs import export_data

        where = f"study {best.study.study_name!r}"
        data = export_data(best.study, getattr(best, "verification", None))
    else:
        raise ConfigError(
            f"hydro.recipe reads an export: a path to best.yaml, the dict loaded "
            f"from it or a TuneResult, got {type(best).__name__}"
        )
    _check(data, where)
    return data, where


def _load(path: str) -> Any:
    import yaml

    try:
        with open(path) as f:
            if path.endswith(".json"):
                return json.load(f)
            return yaml.safe_load(f)
    except FileNotFoundError as exc:
        raise ConfigError(
            f"export file {path!r} does not exist: write it with `hydro export "
            "-o best.yaml` or result.export('best.yaml')"
        ) from exc
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not a readable export (invalid YAML/JSON): {exc}") from exc


def _version(text: Any) -> tuple[int, ...] | None:
    try:
        return tuple(int(p) for p in str(text).split("+")[0].split(".")[:3])
    except ValueError:
        return None


def _check(data: Any, where: str) -> None:
    """Refuse what is not an export this Hydro can read, naming the key."""
    hint = "write it with `hydro export` or result.export(path)"
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{where} is not a Hydro export: it holds {type(data).__name__}, not "
            f"a mapping with 'training'; {hint}"
        )
    prov = data.get("provenance")
    written = prov.get("hydro_version") if isinstance(prov, Mapping) else None
    if written is not None:
        ours, theirs = _version(__version__), _version(written)
        if theirs is None or (ours is not None and theirs[:2] > ours[:2]):
            raise ConfigError(
                f"{where}: provenance.hydro_version {written!r}: written by a "
                f"newer or unknown Hydro than this one ({__version__}); upgrade "
                "Hydro to read it"
            )
    train = data.get("training")
    if not isinstance(train, Mapping):
        raise ConfigError(
            f"{where} has no 'training' section (keys: "
            f"{', '.join(map(str, data)) or 'none'}): not a Hydro export; "
            f"{hint}"
        )
    if "loop" in train and "optimizer" not in train:
        raise ConfigError(
            f"{where}: this export comes from your own training function "
            f"({train['loop']}), which chose its optimizer and schedule itself: "
            "read its 'hyperparameters' and train as that function does"
        )
    missing = [
        k for k in ("optimizer", "optimizer_args", "scheduler", "warmup", "steps") if k not in train
    ]
    if missing:
        raise ConfigError(f"{where}: training lacks {', '.join(missing)}; {hint}")
    if train["optimizer"] not in OPTIMIZERS:
        raise ConfigError(
            f"{where}: training.optimizer {train['optimizer']!r} is not one of "
            f"{', '.join(OPTIMIZERS)}"
        )
    if train["scheduler"] not in SCHEDULERS:
        raise ConfigError(
            f"{where}: training.scheduler {train['scheduler']!r} is not one of "
            f"{', '.join(SCHEDULERS)}"
        )
    args = train["optimizer_args"]
    if not isinstance(args, Mapping) or not _number(args.get("lr")):
        raise ConfigError(
            f"{where}: training.optimizer_args must be a mapping with a number 'lr', got {args!r}"
        )
    for key in ("warmup", "steps"):
        value = train[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where}: training.{key} must be an integer >= 0, got {value!r}")
    clip = train.get("grad_clip")
    if clip is not None and not _number(clip):
        raise ConfigError(f"{where}: training.grad_clip must be a number or null, got {clip!r}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

"""What defines a study, kept with it, so that a rerun of another definition is refused.

``hydro.tune`` and ``hydro tune`` resume a study by its name in its storage. Without a check,
a second script (another model, data or space) on the default ``sqlite:///hydro.db`` and study
``"hydro"`` finds the first script's trials, counts them towards its ``n_trials`` and answers
with the first script's best. So the study keeps a *fingerprint* of its definition (user attr
``hydro_fingerprint``), a dict of named parts:

- ``model``: the module's class, or the factory's name and bound arguments, and its
  architecture (parameter count and a digest of module types, parameter and buffer shapes and
  dtypes);
- ``data``: shapes and dtypes of the tensors (not their values: a script drawing unseeded
  random data must still resume), a ``Dataset``'s type and length, a callable's name; from a
  config also the data callable and its ``data_args``;
- ``loss``, ``metric``: names and bound arguments;
- ``recipe``: direction, optimizer, scheduler, steps, eval_every, batch_size, target_key,
  ``eval_samples`` when set, ``precision`` when not fp32, and ``data_mode`` when it is
  ``"shared"`` (a trial's batches then come from its group);
- ``space``: every distribution; for a space function, its name, the distributions and fixed
  values it gives a few probe trials of a throw-away in-memory study (seeded, so the same in
  every process);
- ``ratio``: the surrogate's width ratio and depth ratio (and depth_alpha when depth is cut).

What only says how to run (``n_trials``, timeout, fuse, executor, device, policy, sampler,
pruner, seed, checkpoints, progress) is not part of it: changing it resumes the study.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
import warnings
from collections.abc import Mapping
from typing import Any

import optuna
import torch
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hydro.errors import ConfigError, HydroWarning
from hydro.tuning.task import LOSSES, MODEL_LOSS, Task

FINGERPRINT = "hydro_fingerprint"  # study user attr: {"version", "parts"}
EARLIER = "hydro_earlier_definitions"  # study user attr: what a forced resume replaced
VERSION = 1
PROBES = 4  # probe trials of a space function (random draws may take different branches)
PARTS = ("model", "data", "loss", "metric", "recipe", "space", "ratio")


def fingerprint(
    task: Task,
    space: Any,
    *,
    ratio: int,
    depth_ratio: int = 1,
    depth_alpha: float = 1.0,
    model: nn.Module | None = None,
    data_source: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The definition of a study tuning ``task`` over ``space`` at ``ratio``, as plain JSON.

    Args:
        model: the target model already built from ``task`` (its architecture is recorded);
            ``None`` leaves a factory's architecture out (only its name and arguments count).
        data_source: where a config's data came from: ``{"name": "mod:fn", "args": {...}}``.
    """
    scale: dict[str, Any] = {"ratio": int(ratio), "depth_ratio": int(depth_ratio)}
    if depth_ratio > 1:  # depth_alpha changes nothing while no block is cut
        scale["depth_alpha"] = float(depth_alpha)
    data: dict[str, Any] = {"train_data": _data(task.train_data),
                            "val_data": _data(task.val_data)}
    if data_source is not None:
        data["source"] = _plain(dict(data_source))
    if not hasattr(task, "loss"):  # your own training function: its name and its source
        parts = {
            "model": _model(task, model),
            "data": data,
            "loss": {"name": "train", "train": _loop(task.train)},
            "metric": {"name": None},
            "recipe": {"direction": task.direction, "steps": task.steps,
                       "eval_every": task.eval_every, "batch_size": task.batch_size},
            "space": _space(space),
            "ratio": scale,
        }
        return json.loads(json.dumps({"version": VERSION, "parts": parts}, sort_keys=True))
    parts = {
        "model": _model(task, model),
        "data": data,
        "loss": {"name": task.loss_name} if task.loss_name in (*LOSSES, MODEL_LOSS)
        else _callable(task.loss),
        "metric": {"name": None} if task.metric is None else _callable(task.metric),
        "recipe": {"direction": task.direction, "optimizer": task.optimizer,
                   "scheduler": task.scheduler, "steps": task.steps,
                   "eval_every": task.eval_every, "batch_size": task.batch_size,
                   "target_key": task.target_key,
                   # shared data only: studies recorded before the option keep their fingerprint
                   **({"data_mode": task.data_mode} if task.data_mode != "per_trial" else {}),
                   **({"eval_samples": task.eval_samples} if task.eval_samples else {}),
                   **({"precision": task.precision} if task.precision != "fp32" else {})},
        "space": _space(space),
        "ratio": scale,
    }
    # a JSON round trip: what is compared is exactly what the storage gives back
    return json.loads(json.dumps({"version": VERSION, "parts": parts}, sort_keys=True))


def check_study(
    study: optuna.Study,
    definition: dict[str, Any],
    *,
    where: str,
    force: bool = False,
    new_name: str = "study='NAME'",
    force_hint: str = "force_resume=True",
) -> None:
    """Record ``definition`` in a new study, or check it against the one the study holds.

    A study without one (created by an older hydro, or by you) is resumed: with a
    :class:`HydroWarning` when it already has trials, which cannot be checked; the definition is
    recorded for later runs. With ``force`` a changed definition is resumed with a warning; it
    replaces the recorded one, and the old recipe is kept for the trials trained before
    (:func:`recipe_for`), so the export of such a trial says how it trained.

    Raises:
        ConfigError: the definition changed (one line naming the parts and both ways out).
    """
    stored = study.user_attrs.get(FINGERPRINT)
    if not isinstance(stored, Mapping) or stored.get("version") != VERSION:
        if study.get_trials(deepcopy=False):
            warnings.warn(HydroWarning(
                f"{where} has no definition this hydro can compare (it was created by an older "
                "hydro, or outside hydro): its trials cannot be checked against this model, "
                "data and space; resuming it, and recording this definition for later runs"),
                stacklevel=3)
        study.set_user_attr(FINGERPRINT, definition)
        return
    changed = differences(stored["parts"], definition["parts"])
    if not changed:
        return
    if not force:
        raise ConfigError(
            f"{where} was created with another definition (changed: {', '.join(changed)}); use "
            f"a new study name ({new_name}) or pass {force_hint} to continue it anyway"
        )
    trials = study.get_trials(deepcopy=False)
    # trials numbered from here train with the new definition; a WAITING one (an interrupted
    # trial asked again) has the lowest number that this run will train
    waiting = [t.number for t in trials if t.state == optuna.trial.TrialState.WAITING]
    before = min(waiting) if waiting else len(trials)
    earlier = list(study.user_attrs.get(EARLIER, []))
    earlier.append({"before_trial": before, "task": study.user_attrs.get("hydro_task", {}),
                    "changed": changed, "definition": stored})
    study.set_user_attr(EARLIER, earlier)
    study.set_user_attr(FINGERPRINT, definition)
    warnings.warn(HydroWarning(
        f"{where}: continuing it with another definition, as forced (changed: "
        f"{', '.join(changed)}); its trials before number {before} trained with the old one"),
        stacklevel=3)


def recipe_for(study: optuna.Study, number: int) -> dict[str, Any]:
    """The training recipe (``hydro_task``) trial ``number`` trained with: the study's, or,
    for a trial before a forced change of definition, the one it replaced."""
    for entry in sorted(study.user_attrs.get(EARLIER, []), key=lambda e: e["before_trial"]):
        if number < entry["before_trial"]:
            return dict(entry.get("task") or {})
    return dict(study.user_attrs.get("hydro_task", {}))


def differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """What changed from ``old`` to ``new`` (fingerprint parts), as short phrases such as
    ``model args width 256→128``, ``recipe steps 20→10`` or ``space lr``."""
    out: list[str] = []
    for part in PARTS:
        a, b = old.get(part), new.get(part)
        if a == b:
            continue
        if part == "model":
            out += _model_changes(a or {}, b or {})
        elif part == "data":
            out += _data_changes(a or {}, b or {})
        elif part == "space":
            out += _space_changes(a or {}, b or {})
        elif part == "recipe":  # a recipe without data_mode reads per-trial streams
            a, b = ({"data_mode": "per_trial", **(x or {})} for x in (a, b))
            out += _leaves(a, b, "recipe ")
        elif part in ("loss", "metric"):
            a, b = a or {}, b or {}
            if a.get("name") != b.get("name"):
                out.append(f"{part} {_text(a.get('name'))}→{_text(b.get('name'))}")
            else:
                out += _leaves(a.get("args") or {}, b.get("args") or {}, f"{part} args ")
        elif part == "ratio":
            out += _leaves(a or {}, b or {}, "")
        else:
            out += _leaves(a or {}, b or {}, f"{part} ")
    return out


# -- the parts ---------------------------------------------------------------------------------


def _model(task: Task, built: nn.Module | None) -> dict[str, Any]:
    if isinstance(task.model, nn.Module):
        part = {"name": _type_name(task.model)}
        built = task.model
    else:
        part = _callable(task.model)
    if built is not None:
        part["architecture"] = _architecture(built)
    return part


def _architecture(model: nn.Module) -> dict[str, Any]:
    """Parameter count and a digest of module types and tensor shapes (never their values)."""
    rows = [["module", name, _type_name(m)] for name, m in model.named_modules()]
    rows += [["parameter", name, _tensor(p)] for name, p in model.named_parameters()]
    rows += [["buffer", name, _tensor(b)] for name, b in model.named_buffers()]
    digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]
    return {"parameters": sum(p.numel() for p in model.parameters()), "digest": digest}


def _data(data: Any) -> Any:
    if data is None:
        return None
    if isinstance(data, DataLoader):  # what trains: its dataset (each trial its own loader)
        return {"loader": _type_name(data), "dataset": _data(data.dataset)}
    if isinstance(data, tuple):
        inputs, targets = data
        return {"inputs": _plain(inputs), "targets": _plain(targets)}
    if isinstance(data, Mapping):
        return _plain(data)
    if isinstance(data, Dataset):
        size = len(data) if hasattr(data, "__len__") else None
        return {"type": _type_name(data), "length": size}
    return _callable(data)


def _space(space: Any) -> dict[str, Any]:
    if isinstance(space, Mapping):
        return {"function": None, "params": {k: _dist(d) for k, d in space.items()}, "fixed": {}}
    params, fixed = _probe(space)
    return {"function": _callable(space)["name"], "params": params, "fixed": fixed}


def _probe(space: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The distributions a space function suggests, and the values it returns unchanged,
    over :data:`PROBES` seeded random trials of an in-memory study (``None`` if it raises)."""
    dists: dict[str, set[str]] = {}
    returned: list[dict[str, Any]] = []
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "a new study created" lines
    try:
        for seed in range(PROBES):
            probe = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
            trial = probe.ask()
            result = space(trial)
            for name, dist in trial.distributions.items():
                dists.setdefault(name, set()).add(_dist(dist))
            returned.append({k: _plain(v) for k, v in dict(result or {}).items()})
    except Exception:  # user code; the run itself will say what is wrong
        return None, None
    finally:
        optuna.logging.set_verbosity(level)
    params = {k: v.pop() if len(v) == 1 else sorted(v) for k, v in dists.items()}
    # a value returned the same by every probe is fixed; one derived from a draw varies
    fixed = {k: v for k, v in returned[0].items()
             if k not in dists and all(r.get(k, ...) == v for r in returned)}
    return params, fixed


def _dist(dist: BaseDistribution) -> str:
    """A distribution as a short, stable text: ``float 0.0001..0.1 log``."""
    if isinstance(dist, (FloatDistribution, IntDistribution)):
        kind = "float" if isinstance(dist, FloatDistribution) else "int"
        text = f"{kind} {dist.low!r}..{dist.high!r}"
        if dist.log:
            text += " log"
        if dist.step is not None and not (kind == "int" and dist.step == 1):
            text += f" step {dist.step!r}"
        return text
    if isinstance(dist, CategoricalDistribution):
        return f"categorical {json.dumps([_plain(c) for c in dist.choices])}"
    return f"{_type_name(dist)} {json.dumps(_plain(vars(dist)), sort_keys=True)}"


# -- plain values ------------------------------------------------------------------------------


def callable_name(fn: Any) -> str:
    """``module:qualname`` of a function (a partial's, a method's), or a callable's class."""
    return _callable(fn)["name"]


def _loop(fn: Any) -> dict[str, Any]:
    """A training function: its name and a digest of its source (a change to the loop is a
    change of definition; a function without source: its name alone)."""
    part = _callable(fn)
    while isinstance(fn, functools.partial):
        fn = fn.func
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return part
    part["source"] = hashlib.sha256(source.encode()).hexdigest()[:16]
    return part


def _callable(fn: Any) -> dict[str, Any]:
    """``{"name": "module:qualname", "args": {...}}``; a partial's bound arguments as args."""
    args: dict[str, Any] = {}
    positional: list[Any] = []
    while isinstance(fn, functools.partial):
        args = {**fn.keywords, **args}
        positional = [*fn.args, *positional]
        fn = fn.func
    if inspect.ismethod(fn):
        fn = fn.__func__
    if inspect.isfunction(fn) or inspect.isclass(fn) or inspect.isbuiltin(fn):
        name = f"{fn.__module__}:{fn.__qualname__}"
    else:  # a callable object: its class (its attributes may be counters, not definition)
        name = _type_name(fn)
    part: dict[str, Any] = {"name": name}
    if args or positional:
        part["args"] = _plain({**{str(i): v for i, v in enumerate(positional)}, **args})
    return part


def _type_name(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}:{kind.__qualname__}"


def _tensor(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}[{', '.join(str(s) for s in t.shape)}]"


def _plain(value: Any) -> Any:
    """``value`` as JSON that is the same in every process: no ``id()``, no set order, no
    tensor values (their dtype and shape), objects by their type."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a NumPy scalar
        return _plain(value.item())
    if isinstance(value, nn.Module):
        return _type_name(value)
    if callable(value):
        return _callable(value)["name"]
    return _type_name(value)


def _text(value: Any) -> str:
    if value is None:
        return "none"
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


# -- naming what changed -----------------------------------------------------------------------


_UNSET = object()


def _leaves(old: Any, new: Any, prefix: str, path: str = "") -> list[str]:
    """``prefix + path old→new`` for each differing leaf of two JSON values."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        out: list[str] = []
        for key in sorted(set(old) | set(new)):
            a, b = old.get(key, _UNSET), new.get(key, _UNSET)
            if a != b:
                out += _leaves(a, b, prefix, f"{path}.{key}" if path else str(key))
        return out
    a = "unset" if old is _UNSET else _text(old)
    b = "unset" if new is _UNSET else _text(new)
    return [f"{prefix}{path} {a}→{b}".rstrip()]


def _model_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    if old.get("name") != new.get("name"):
        return [f"model {_text(old.get('name'))}→{_text(new.get('name'))}"]
    if old.get("args") != new.get("args"):
        return _leaves(old.get("args") or {}, new.get("args") or {}, "model args ")
    a, b = old.get("architecture"), new.get("architecture")
    if a and b and a != b:
        count = (f" ({a['parameters']}→{b['parameters']} parameters)"
                 if a["parameters"] != b["parameters"] else "")
        return [f"model architecture{count}"]
    return []  # one side could not build its model: name and arguments agree


def _data_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    a, b = old.get("source"), new.get("source")
    if a is not None and b is not None and a != b:  # a config's data callable and its args
        if a.get("name") != b.get("name"):
            out.append(f"data {_text(a.get('name'))}→{_text(b.get('name'))}")
        else:
            out += _leaves(a.get("args") or {}, b.get("args") or {}, "data args ")
    if out:
        return out  # the tensors' shapes follow from a changed source
    for key in ("train_data", "val_data"):
        if old.get(key) != new.get(key):
            out += _leaves(old.get(key), new.get(key), "data ", key)
    return out


def _space_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    if old.get("function") != new.get("function"):
        out.append(f"space function {_text(old.get('function'))}→{_text(new.get('function'))}")
    a, b = old.get("params"), new.get("params")
    if a is not None and b is not None:
        for name in sorted(set(a) | set(b)):
            if name not in b:
                out.append(f"space {name} removed")
            elif name not in a:
                out.append(f"space {name} added")
            elif a[name] != b[name]:
                out.append(f"space {name} {_text(a[name])}→{_text(b[name])}")
    fa, fb = old.get("fixed"), new.get("fixed")
    if fa is not None and fb is not None and fa != fb:
        out += _leaves(fa, fb, "space fixed ")
    return out

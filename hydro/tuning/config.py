"""The ``hydro tune`` config file: YAML in, a Task, a space, a sampler and a pruner out.

Every mistake is a :class:`hydro.ConfigError` naming the file and the key.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
import yaml

from hydro.errors import ConfigError, HydroError
from hydro.tuning.options import TuneOptions
from hydro.tuning.space import check_names, check_warmup, from_config
from hydro.tuning.task import LOSSES, MODEL_LOSS, Task
from hydro.tuning.trackers import from_config as trackers_from_config
from hydro.tuning.trust import check_trust, resolve_callable
from hydro_fluid.policies import check_policy

# the run's options (hydro.tuning.options: their config keys), what to train, and the space
TOP_KEYS = {*TuneOptions.config_keys(), "sampler_args", "pruner_args", "task", "space", "trust",
            "trackers"}
TASK_KEYS = {"model", "model_args", "data", "data_args", "loss", "metric", "direction",
             "optimizer", "scheduler", "steps", "eval_every", "eval_samples",
             "precision", "batch_size", "target_key", "checkpoint_every", "dynamic", "data_mode",
             "cache", "train"}
# what only Hydro's own recipe reads: refused beside your own training function (task.train)
RECIPE_KEYS = (
    "loss",
    "metric",
    "optimizer",
    "scheduler",
    "target_key",
    "data_mode",
    "eval_samples",
)
SAMPLERS = {
    "tpe": lambda seed, **kw: optuna.samplers.TPESampler(
        seed=seed, **{"constant_liar": True, **kw}
    ),
    "random": lambda seed, **kw: optuna.samplers.RandomSampler(seed=seed, **kw),
    "cmaes": lambda seed, **kw: optuna.samplers.CmaEsSampler(seed=seed, **kw),
    "gp": lambda seed, **kw: optuna.samplers.GPSampler(seed=seed, **kw),
    "qmc": lambda seed, **kw: optuna.samplers.QMCSampler(seed=seed, **kw),
}
PRUNERS = {
    "median": optuna.pruners.MedianPruner,
    "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
    "successive-halving": optuna.pruners.SuccessiveHalvingPruner,
    "asha": optuna.pruners.SuccessiveHalvingPruner,  # asynchronous successive halving
    "hyperband": optuna.pruners.HyperbandPruner,
    "none": optuna.pruners.NopPruner,
}


@dataclass
class TuneConfig:
    """A parsed config file."""

    path: str
    study: str
    storage: str | None
    trials: int
    ratio: int | str  # 'auto' until cmd_tune resolves it
    fuse: int | str  # 'auto': sized per key to the device's memory (hydro.tuning.sizing)
    seed: int
    verify_top_k: int
    task: Task
    space: dict
    sampler: optuna.samplers.BaseSampler
    pruner: optuna.pruners.BasePruner
    device: str = "cpu"
    depth_ratio: int = 1
    depth_alpha: float = 1.0
    first_group: int | str = "auto"  # 'auto': the pruner's start-up on the CPU (driver)
    policy: str = "dynamic"
    deadline: float | None = None
    checkpoint_dir: str | None = None  # trial checkpoints (default: beside the SQLite file)
    fuse_memory: float | None = None  # GiB per fused group for fuse 'auto'
    timeout: float | None = None  # seconds after which no new trial is asked
    compile: bool | str = False  # torch.compile the fused groups: True, False, 'auto' or a mode
    data_source: dict | None = None  # task.data and its data_args: part of the study's fingerprint
    extra: dict = field(default_factory=dict)  # the other options the file sets, by name
    # callbacks logging each finished trial (the trackers key: hydro.tuning.trackers)
    trackers: list = field(default_factory=list)

    def options(self, **changes: Any) -> TuneOptions:
        """The run's :class:`TuneOptions` as this file (and its overrides) set them."""
        return TuneOptions(
            n_trials=self.trials, ratio=self.ratio, fuse=self.fuse, study=self.study,
            storage=self.storage, sampler=self.sampler, pruner=self.pruner, seed=self.seed,
            verify_top_k=self.verify_top_k, device=self.device, depth_ratio=self.depth_ratio,
            depth_alpha=self.depth_alpha, first_group=self.first_group, policy=self.policy,
            deadline=self.deadline, checkpoint_dir=self.checkpoint_dir,
            fuse_memory=self.fuse_memory, timeout=self.timeout, compile=self.compile,
            callbacks=list(self.trackers),
        ).replace(**{**self.extra, **changes})


def import_object(spec: str, key: str, path: str, trust: Sequence[str] = ()) -> Any:
    """``package.module:attribute``, if the config may name it (:mod:`hydro.tuning.trust`); the
    config's directory and the working directory import."""
    folders = (os.getcwd(), os.path.dirname(os.path.abspath(path)))
    return resolve_callable(spec, f"{path}: {key}", folders, trust)


def load(path: str, trust: Sequence[str] = (), **overrides: Any) -> TuneConfig:
    """Read and check a config file; ``overrides`` (from the command line) win when not None.

    ``trust`` (``--trust``) adds to the packages the config's ``trust`` key names: the installed
    packages whose callables the config may name besides your own code (:mod:`hydro.tuning.trust`).
    """
    try:
        with open(path) as f:
            raw = yaml.load(f, Loader=_UniqueKeys)  # a SafeLoader subclass
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path!r} does not exist") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path} must hold a mapping with 'task' and 'space'")
    _unknown(raw, TOP_KEYS, path, "")
    for key in ("task", "space"):
        if key not in raw:
            raise ConfigError(f"{path}: missing key '{key}'")
    given = {k: v for k, v in overrides.items() if v is not None}
    # --steps and --no-cache set keys of the task: its training steps, its capture cache
    in_task = {k: given.pop(k) for k in ("steps", "cache") if k in given}
    if in_task:
        if not isinstance(raw["task"], Mapping):
            raise ConfigError(f"{path}: task must be a mapping")
        raw = {**raw, "task": {**raw["task"], **in_task}}
    for key in ("sampler", "pruner"):  # a sampler named on the command line: not the
        if key in given and given[key] != raw.get(key):  # config's sampler's arguments
            raw = {k: v for k, v in raw.items() if k != f"{key}_args"}
    flags = {k: f"--{k}" for k in ("sampler", "pruner") if k in given}
    raw = {**raw, **given}
    try:  # before the task is built: a typo here should not wait for the data
        check_policy(raw.get("policy", "dynamic"), raw.get("deadline"))
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    trusted = (*check_trust(raw.get("trust"), f"{path}: trust"), *check_trust(trust, "--trust"))
    task = _task(raw["task"], path, trusted)
    space = from_config(raw["space"], where=f"{path}: space")
    try:
        if isinstance(task, Task):  # your own training function reads any name
            check_names(space, task.model_args())
        # the steps after --steps: a warm-up range the run cannot hold fails here, not mid-run
        check_warmup(space, task.steps, "--steps" if "steps" in in_task else "task.steps")
    except ConfigError as exc:
        raise ConfigError(f"{path}: space: {exc}") from exc
    seed = _int(raw.get("seed", 0), "seed", path, minimum=0)
    cfg = TuneConfig(
        path=path,
        study=_study(raw.get("study", "hydro"), path),
        storage=raw.get("storage"),
        trials=_int(raw.get("trials", 32), "trials", path),
        ratio=_ratio(raw.get("ratio", "auto"), path),
        fuse=_fuse(raw.get("fuse", "auto"), path),
        seed=seed,
        verify_top_k=_int(raw.get("verify_top_k", 0), "verify_top_k", path, minimum=0),
        task=task,
        space=space,
        sampler=_sampler(raw, space, seed, path, flags.get("sampler")),
        pruner=_pruner(raw, path, flags.get("pruner")),
        device=_device(raw.get("device", "cpu"), path),
        depth_ratio=_int(raw.get("depth_ratio", 1), "depth_ratio", path),
        depth_alpha=_alpha(raw.get("depth_alpha", 1.0), path),
        first_group=_first_group(raw.get("first_group", "auto"), path),
        policy=raw.get("policy", "dynamic"),
        deadline=raw.get("deadline"),
        checkpoint_dir=_directory(raw.get("checkpoint_dir"), "checkpoint_dir", path),
        fuse_memory=_fuse_memory(raw.get("fuse_memory"), path),
        timeout=_timeout(raw.get("timeout"), path),
        compile=_compile(raw.get("compile", False), path),
        data_source={"name": raw["task"]["data"], "args": dict(raw["task"].get("data_args") or {})},
        trackers=trackers_from_config(raw.get("trackers"), f"{path}: trackers"),
    )
    handled = {f for f in TuneConfig.__dataclass_fields__} | {"trials", "sampler_args",
                                                               "pruner_args"}
    names = TuneOptions.config_keys()
    cfg.extra = {names[k]: v for k, v in raw.items() if k in names and k not in handled}
    if isinstance(cfg.fuse, int) and isinstance(cfg.first_group, int) \
            and cfg.first_group > cfg.fuse:
        raise ConfigError(f"{path}: first_group ({cfg.first_group}) must not exceed fuse "
                          f"({cfg.fuse}): it is the size of the first fused group")
    try:  # the options the file sets beyond those above, checked as hydro.tune checks them
        cfg.options().validate()
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return cfg


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last
    value without a word: ``trials: 4`` ... ``trials: 2`` would run 2)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = lines.setdefault(key, line)
            except TypeError:  # an unhashable key: the constructor below says so
                continue
            if first != line:
                raise ConfigError(f"key {key!r} is given twice (lines {first} and {line}); "
                                  "keep one")
        return super().construct_mapping(node, deep=deep)


def _study(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{path}: study must be a name (a string), got {value!r}; quote it "
                          "if YAML reads it as something else (study: 'yes')")
    return value


def _compile(value: Any, path: str) -> bool | str:
    from hydro.tuning.compiling import check_compile

    return check_compile(value, where=f"{path}: compile")


def _directory(value: Any, key: str, path: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}: {key} must be a directory path (a string), got {value!r}")
    return value


def _task(spec: Any, path: str, trust: Sequence[str] = ()) -> Any:
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{path}: task must be a mapping")
    _unknown(spec, TASK_KEYS, path, "task.")
    for key in ("model", "data"):
        if key not in spec:
            raise ConfigError(f"{path}: missing key 'task.{key}'")
    model = import_object(spec["model"], "task.model", path, trust)
    model_args = _mapping(spec.get("model_args", {}), "task.model_args", path)
    _check_arguments(model, model_args, f"{path}: task.model_args", spec["model"])
    data_fn = import_object(spec["data"], "task.data", path, trust)
    data_args = _mapping(spec.get("data_args", {}), "task.data_args", path)
    _check_arguments(data_fn, data_args, f"{path}: task.data_args", spec["data"])
    # every name is resolved (and refused) before the first call into the config's code
    loss = spec.get("loss", "cross_entropy")
    if loss not in LOSSES and loss != MODEL_LOSS:
        loss = import_object(loss, "task.loss", path, trust)
    metric = spec.get("metric")
    if metric is not None:
        metric = import_object(metric, "task.metric", path, trust)
    train = None
    if "train" in spec:
        mixed = [k for k in RECIPE_KEYS if k in spec]
        if mixed:
            raise ConfigError(f"{path}: task.train names your own training function, which "
                              f"does its own {', '.join(mixed)}: remove "
                              f"task.{mixed[0]}")
        train = import_object(spec["train"], "task.train", path, trust)
    try:
        data = data_fn(**data_args)
    except Exception as exc:  # user code: say which call failed
        raise ConfigError(f"{path}: task.data: {spec['data']}(**data_args) raised "
                          f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(data, Mapping) or not {"train", "val"} <= set(data):
        raise ConfigError(f"{path}: task.data {spec['data']} must return a dict with 'train' "
                          "and 'val'")

    # a partial pickles (worker processes need it) and keeps the factory's signature, whose
    # keyword arguments are the searchable architecture choices
    factory = functools.partial(model, **model_args)
    kwargs = {k: spec[k] for k in ("direction", "optimizer", "scheduler", "steps", "eval_every",
                                   "eval_samples", "precision",
                                   "batch_size", "target_key", "checkpoint_every", "dynamic",
                                   "data_mode", "cache")
              if k in spec}
    try:
        if train is not None:
            from hydro.tuning.loop import Loop

            if "steps" not in spec:
                raise ConfigError("task.steps is required with task.train (the steps of "
                                  "each trial)")
            example = {k: data[k] for k in ("example_inputs", "example_kwargs") if k in data}
            return Loop(train=train, model=factory, train_data=_data(data["train"]),
                        val_data=_data(data["val"]), **example, **kwargs)
        return Task(model=factory, train_data=_data(data["train"]), val_data=_data(data["val"]),
                    loss=loss, metric=metric, **kwargs)
    except HydroError as exc:
        raise type(exc)(f"{path}: task: {exc}") from exc


def _data(value: Any) -> Any:
    # lists from YAML-minded code become the (inputs, targets) tuple; dicts stay keyword data
    return tuple(value) if isinstance(value, list) else value


def _check_arguments(fn: Any, args: Mapping, where: str, spec: str) -> None:
    """Name an argument the callable does not take (unless it takes ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return
    known = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for name in args:
        if name not in known:
            raise ConfigError(f"{where}: {spec} takes no argument {name!r}; it takes "
                              f"{', '.join(known) or 'no arguments'}")


def _sampler(raw: Mapping, space: dict, seed: int, path: str,
             flag: str | None = None) -> optuna.samplers.BaseSampler:
    """The config's ``sampler`` (or ``flag``'s, from the command line), seeded by ``seed``."""
    name = raw.get("sampler", "tpe")
    where = flag or f"{path}: sampler"
    args = _mapping(raw.get("sampler_args", {}), "sampler_args", path)
    if name == "grid":
        grid = {}
        for key, dist in space.items():
            if not isinstance(dist, optuna.distributions.CategoricalDistribution):
                raise ConfigError(f"{where} 'grid' needs categorical distributions; "
                                  f"space.{key} is not one")
            grid[key] = list(dist.choices)
        return optuna.samplers.GridSampler(grid, seed=seed)
    if name not in SAMPLERS:
        raise ConfigError(f"{where} {name!r} is unknown; use one of "
                          f"{', '.join(sorted([*SAMPLERS, 'grid']))}")
    try:
        return SAMPLERS[name](seed, **args)
    except TypeError as exc:
        raise ConfigError(f"{path}: sampler_args: {exc}") from exc


def _pruner(raw: Mapping, path: str, flag: str | None = None) -> optuna.pruners.BasePruner:
    """The config's ``pruner`` (or ``flag``'s, from the command line)."""
    name = raw.get("pruner", "median")
    if name not in PRUNERS:
        raise ConfigError(f"{flag or f'{path}: pruner'} {name!r} is unknown; use one of "
                          f"{', '.join(sorted(PRUNERS))}")
    try:
        return PRUNERS[name](**_mapping(raw.get("pruner_args", {}), "pruner_args", path))
    except TypeError as exc:
        raise ConfigError(f"{path}: pruner_args: {exc}") from exc


def _unknown(spec: Mapping, allowed: set[str], path: str, prefix: str) -> None:
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise ConfigError(f"{path}: unknown key '{prefix}{unknown[0]}'; allowed keys: "
                          f"{', '.join(sorted(allowed))}")


def _mapping(value: Any, key: str, path: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: {key} must be a mapping")
    return dict(value)


def _ratio(value: Any, path: str) -> int | str:
    if value == "auto" or not isinstance(value, bool) and isinstance(value, int) and value >= 1:
        return value
    raise ConfigError(f"{path}: ratio must be 'auto' or an integer >= 1 (2, 4, 8...), got "
                      f"{value!r}")


def _fuse(value: Any, path: str) -> int | str:
    from hydro.tuning.sizing import check_fuse

    return check_fuse(value, where=f"{path}: fuse")


def _fuse_memory(value: Any, path: str) -> float | None:
    from hydro.tuning.sizing import check_memory

    return check_memory(value, where=f"{path}: fuse_memory")


def _timeout(value: Any, path: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0 < value < float("inf"):
        raise ConfigError(f"{path}: timeout must be a number of seconds above 0, got {value!r}")
    return float(value)


def _alpha(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"{path}: depth_alpha must be a number in [0, 1] (1: CompleteP, 0.5: "
                          f"Depth-muP), got {value!r}")
    return float(value)


def _device(value: Any, path: str) -> str:
    from hydro.tuning.group import check_device

    if not isinstance(value, str):
        raise ConfigError(f"{path}: device must be 'cpu', 'cuda' or 'cuda:N', got {value!r}")
    try:
        return check_device(value)
    except ConfigError as exc:
        raise ConfigError(f"{path}: device: {exc}") from exc


def _first_group(value: Any, path: str) -> int | str:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise ConfigError(f"{path}: first_group must be auto or an integer >= 0, got {value!r}")


def _int(value: Any, key: str, path: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{path}: {key} must be an integer >= {minimum}, got {value!r}")
    return value

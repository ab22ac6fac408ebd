"""The options of a tuning run: one table, one set of defaults, validated once.

:class:`TuneOptions` is what ``hydro.tune(...)``'s keyword arguments, a ``hydro tune`` config
file and its flags all build; :func:`hydro.tuning.run.run` executes it. Each field's
``metadata`` is the table the docs, the config keys and the CLI's flags are made from, so a new
option is one field here and the code that reads it.

This module imports only the standard library: the CLI builds its parser from it before
torch is loaded.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hydro.errors import ConfigError

DEFAULT_STORAGE = "sqlite:///hydro.db"
MATMUL_PRECISIONS = ("highest", "high", "medium")  # torch.set_float32_matmul_precision's


def _opt(
    default: Any,
    help: str,
    *,
    flag: str | None = "",
    config: str | None = "",
    kind: str = "",
    choices: Sequence[str] | None = None,
    none: str = "",
) -> Any:
    """A field of :class:`TuneOptions`: its default and its row of the options table.

    ``flag``/``config``: the CLI flag and the config key (``""``: derived from the name;
    ``None``: none, a Python-only option). ``kind`` names the CLI parser of the value
    (:data:`PARSERS`). ``none``: what a default of ``None`` stands for (the storage, the
    sampler... used when none is given), said by :meth:`TuneOptions.shown`.
    """
    meta = {
        "help": help,
        "flag": flag,
        "config": config,
        "kind": kind,
        "choices": choices,
        "none": none,
    }
    return field(default=default, metadata=meta)


@dataclass
class TuneOptions:
    """Everything about a tuning run besides what it trains (:class:`hydro.Task` or your own
    loop) and the search space. Fields are ``hydro.tune``'s keyword arguments; the table in
    docs/reference/options.md lists them with their config keys and flags.

    Example:
        >>> opts = TuneOptions(n_trials=8, fuse=4, ratio=2)
        >>> opts.validate().fuse
        4
        >>> TuneOptions(n_trials=0).validate()
        Traceback (most recent call last):
        ...
        hydro.errors.ConfigError: n_trials must be a positive integer, got 0
    """

    n_trials: int = _opt(
        32,
        "configurations to finish (complete, pruned or failed), counted over the whole study",
        flag="--trials",
        config="trials",
        kind="count",
    )
    ratio: int | str = _opt(
        "auto",
        "surrogate width divisor (1: the full model, fused), or "
        "'auto': the largest within every layer's width floor, at most 4 "
        "for a model with attention; resuming a study, 'auto' keeps the "
        "ratio it recorded",
        kind="ratio",
    )
    fuse: int | str = _opt(
        "auto",
        "trials per fused group, or 'auto': as many as fit the "
        "device's memory per (batch size, architecture) key, at most 64 "
        "(16 for your own training function, whose memory Hydro cannot "
        "measure beforehand)",
        kind="ratio",
    )
    study: Any = _opt(
        "hydro", "the study's name in the storage (or, in Python, an optuna.Study)", kind="str"
    )
    storage: Any = _opt(
        None,
        "any Optuna storage URL; rerunning resumes the study there",
        kind="str",
        none=f"{DEFAULT_STORAGE}, a file in the working directory",
    )
    sampler: Any = _opt(
        None,
        "the Optuna sampler; in a config or flag its name: tpe, random, cmaes, gp, qmc, grid",
        kind="str",
        none="tpe: Optuna's TPE with constant_liar",
    )
    pruner: Any = _opt(
        None,
        "the Optuna pruner; in a config or flag its name: median, asha, hyperband, none",
        kind="str",
        none="median",
    )
    executor: Any = _opt(
        None,
        "where groups train: inline (this process), local (worker "
        "processes on this machine), ray (a Ray cluster: RAY_ADDRESS, else a "
        "local one), or an executor object",
        kind="str",
        choices=("inline", "local", "ray"),
        none="inline",
    )
    seed: int | None = _opt(
        0, "seeds the sampler, the surrogates' initializations and the data order", kind="int"
    )
    verify_top_k: int = _opt(
        0,
        "afterwards, train the full model with the best k configurations, fused, and export "
        "the one it ranks first; both rankings are kept (0: off; 3 recommended)",
        kind="count0",
    )
    verify_steps: int | None = _opt(
        None,
        "with verify_top_k: the check's training steps, 1 to the task's steps (a shorter "
        "schedule, warm-up shrunk with it)",
        kind="count",
        none="the task's steps",
    )
    replicas: int = _opt(
        0,
        "after the search, train each leading configuration this many more times with other "
        "seeds, and choose the middle of the region their seed noise cannot tell apart "
        "(0: off, the best trial is the choice)",
        kind="count0",
    )
    leaders: int = _opt(
        4, "with replicas: how many of the best configurations are replicated", kind="count"
    )
    progress: bool | None = _opt(
        None,
        "progress on stderr and a table of the best trials; "
        "None: on a terminal or in a notebook (the CLI: on unless "
        "--no-progress)",
        flag=None,
        config=None,
    )
    device: str = _opt("cpu", "where groups train in this process: cpu, cuda, cuda:N", kind="str")
    depth_ratio: int = _opt(
        1, "surrogates keep every k-th block of repeated residual stacks", kind="int"
    )
    depth_alpha: float = _opt(
        1.0, "the depth cut's residual exponent: 1 CompleteP, 0.5 Depth-muP", kind="float"
    )
    first_group: int | str = _opt(
        "auto",
        "train this many trials first, alone and to the "
        "end, so the pruner has complete trials to compare with; "
        "auto: the median pruner's start-up on a CPU in this "
        "process, else 0",
        kind="first_group",
    )
    policy: str = _opt(
        "dynamic",
        "how an executor places groups on its devices: a registered "
        "placement policy (docs/explanation/placement.md)",
        kind="policy",
    )
    deadline: float | None = _opt(
        None,
        "seconds to the deadline, with policy deadline: no trial is asked after it",
        kind="float",
        none="no deadline",
    )
    checkpoint_dir: str | None = _opt(
        None,
        "where trial checkpoints go, a directory per study",
        kind="str",
        none="beside the SQLite file",
    )
    checkpoint_every: int | None = _opt(
        None,
        "fused steps between trial checkpoints (0: never)",
        kind="count0",
        none="the task's checkpoint_every, 50",
    )
    fuse_memory: float | None = _opt(
        None,
        "with fuse auto: GiB one fused group may use",
        kind="float",
        none="half the free RAM, 90% of a GPU's free memory",
    )
    timeout: float | None = _opt(
        None,
        "stop asking new trials after this many seconds; trials in flight finish; rerun to go on",
        kind="float",
        none="no timeout",
    )
    compile: bool | str = _opt(
        False,
        "train the fused groups through torch.compile: on, off "
        "or auto (per key, where its measured pay-back fits the "
        "study)",
        kind="compile",
        choices=("auto", "on", "off"),
    )
    matmul_precision: str | None = _opt(
        None,
        "torch.set_float32_matmul_precision where "
        "groups train: highest, high (TF32 matmuls on NVIDIA GPUs), medium",
        kind="str",
        choices=MATMUL_PRECISIONS,
        none="torch's own",
    )
    world_size: int = _opt(
        1, "with an executor, train each group data parallel on this many devices", kind="count"
    )
    force_resume: bool = _opt(
        False,
        "continue a study whose model, data, recipe, space or "
        "ratio changed (prefer a new study name)",
        kind="flag",
    )
    callbacks: Sequence[Callable[..., Any]] = _opt(
        (),
        "f(study, frozen_trial) after each trial ends, as study.optimize's",
        flag=None,
        config=None,
    )
    catch: Any = _opt(
        (),
        "exception types of your code that fail a trial without stopping "
        "the run, as study.optimize's",
        flag=None,
        config=None,
    )

    # -- the table ----------------------------------------------------------------------

    @classmethod
    def rows(cls) -> Iterator[tuple[str, Any, dict[str, Any]]]:
        """``(name, default, metadata)`` of every option, in order."""
        for f in dataclasses.fields(cls):
            default = f.default
            meta = dict(f.metadata)
            if meta["config"] == "":
                meta["config"] = f.name
            if meta["flag"] == "":
                meta["flag"] = "--" + f.name.replace("_", "-")
            yield f.name, default, meta

    @classmethod
    def shown(cls, name: str) -> str:
        """Option ``name``'s default as the CLI's help and the table say it: the value as a flag
        or config key takes it (``compile``: ``off``), or what ``None`` stands for.

        Example:
            >>> TuneOptions.shown("n_trials"), TuneOptions.shown("compile")
            ('32', 'off')
            >>> TuneOptions.shown("storage")
            'sqlite:///hydro.db, a file in the working directory'
        """
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        default, meta = f.default, f.metadata
        if default is None:
            return meta["none"] or "none"
        if isinstance(default, bool):
            return "on" if default else "off"
        if default == ():
            return "none"
        return str(default)

    @classmethod
    def config_keys(cls) -> dict[str, str]:
        """Config key -> option name."""
        return {m["config"]: name for name, _, m in cls.rows() if m["config"]}

    @classmethod
    def table(cls) -> str:
        """The options as a Markdown table (docs/reference/options.md prints it; a test keeps
        the two equal): option, default, config key, flag, what it does."""
        rows = ["| option | default | config key | flag | what it does |",
                "|---|---|---|---|---|"]
        for name, default, m in cls.rows():
            shown = "`()`" if default == () else f"`{default!r}`"
            if m["none"] or m["kind"] == "compile":  # what None stands for; compile's off
                shown += f" ({cls.shown(name)})"
            key = f"`{m['config']}`" if m["config"] else "Python only"
            flag = f"`{m['flag']}`" if m["flag"] else ""
            rows.append(f"| `{name}` | {shown} | {key} | {flag} | {m['help']} |")
        return "\n".join(rows)

    def replace(self, **changes: Any) -> TuneOptions:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    # -- validation ---------------------------------------------------------------------

    def validate(self) -> TuneOptions:
        """Check every option once, before any work; returns ``self`` with values normalised
        (``compile`` "on" -> True, ``catch`` a tuple...).

        Raises:
            ConfigError: the first option that is wrong, naming it and what it takes.
        """
        from hydro.fx.floor import check_ratio
        from hydro.tuning.compiling import check_compile
        from hydro.tuning.sizing import MAX_FUSE, check_fuse, check_memory
        from hydro_fluid.policies import check_policy, get_policy

        n = self.n_trials
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"n_trials must be a positive integer, got {n!r}")
        check_ratio(self.ratio)  # a ScaleError, as hydro.scale's
        for name, least in (("replicas", 0), ("leaders", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ConfigError(f"{name} must be an integer >= {least}, got {v!r}")
        self.fuse = check_fuse(self.fuse)
        self.fuse_memory = check_memory(self.fuse_memory)
        self.compile = check_compile(self.compile)
        self.timeout = _seconds(self.timeout, "timeout")
        self.catch = _catch(self.catch)
        self.callbacks = _callbacks(self.callbacks)
        _check_depth(self.depth_ratio, self.depth_alpha)
        check_policy(self.policy, self.deadline)  # a ConfigError naming the registered ones
        most = MAX_FUSE if self.fuse == "auto" else self.fuse
        fg = self.first_group
        if fg != "auto" and (isinstance(fg, bool) or not isinstance(fg, int)
                             or not 0 <= fg <= most):
            raise ConfigError(f"first_group must be an integer from 0 to fuse ({most}) or "
                              f"'auto', got {fg!r}")
        if fg not in ("auto", 0) and self.executor not in (None, "inline"):
            raise ConfigError("first_group trains a first group alone in this process, before "
                              "any other: with an executor every other slot would wait for it. "
                              "Use executor=None, or first_group=0")
        if self.matmul_precision not in (None, *MATMUL_PRECISIONS):
            raise ConfigError(f"matmul_precision must be highest, high or medium, got "
                              f"{self.matmul_precision!r}")
        ws = self.world_size
        if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
            raise ConfigError(f"world_size must be an integer >= 1, got {ws!r}")
        ce = self.checkpoint_every
        if ce is not None and (isinstance(ce, bool) or not isinstance(ce, int) or ce < 0):
            raise ConfigError(f"checkpoint_every must be an integer >= 0, got {ce!r}")
        vk = self.verify_top_k
        if isinstance(vk, bool) or not isinstance(vk, int) or vk < 0:
            raise ConfigError(f"verify_top_k must be an integer >= 0, got {vk!r}")
        vs = self.verify_steps  # against the task's steps: hydro.tuning.verification.check_steps
        if vs is not None and (isinstance(vs, bool) or not isinstance(vs, int) or vs < 1):
            raise ConfigError(f"verify_steps must be a positive number of steps, got {vs!r}")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.study, str) and not _is_study(self.study):
            raise ConfigError(f"study must be a name (a string) or an optuna.Study, got "
                              f"{self.study!r}")
        if self.checkpoint_dir is not None and not isinstance(self.checkpoint_dir, str):
            import os

            if not isinstance(self.checkpoint_dir, os.PathLike):
                raise ConfigError(f"checkpoint_dir must be a directory path, got "
                                  f"{self.checkpoint_dir!r}")
        if not isinstance(self.force_resume, bool):
            raise ConfigError(f"force_resume must be true or false, got {self.force_resume!r}")
        if self.world_size > 1 and self.executor in (None, "inline"):
            raise ConfigError(f"world_size {self.world_size} trains each group on several "
                              "worker processes: pass an executor (local, ray), or use "
                              "world_size 1")
        if get_policy(self.policy).uses_deadline and self.executor in (None, "inline"):
            raise ConfigError(f"policy {self.policy!r} places groups on an executor's devices "
                              "by a deadline: use executor='local' (or 'ray'), or another "
                              "policy")
        return self

    @property
    def base_seed(self) -> int:
        """The seed of initializations and data (0 without one)."""
        return 0 if self.seed is None else int(self.seed)

    def for_worker(self) -> TuneOptions:
        """What an executor's workers get: the options that may not pickle (objects, Python
        callables) left out; the workers read the rest."""
        return self.replace(study=None, storage=None, sampler=None, pruner=None, executor=None,
                            callbacks=(), catch=())


def _is_study(obj: Any) -> bool:
    import optuna

    return isinstance(obj, optuna.Study)


def _seconds(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0 < value < math.inf:
        raise ConfigError(f"{name} must be a number of seconds above 0, got {value!r}")
    return float(value)


def _catch(catch: Any) -> tuple[type[BaseException], ...]:
    items = (catch,) if isinstance(catch, type) else tuple(catch or ())
    for c in items:
        if not (isinstance(c, type) and issubclass(c, Exception)):
            raise ConfigError(f"catch must hold exception classes (e.g. catch=(ValueError,)), "
                              f"got {c!r}")
    return items


def _callbacks(callbacks: Any) -> list[Callable[..., Any]]:
    items = list(callbacks or ())
    for c in items:
        if not callable(c):
            raise ConfigError(f"callbacks must be callables f(study, frozen_trial), got {c!r}")
    return items


def _check_depth(depth_ratio: Any, depth_alpha: Any) -> None:
    from hydro.errors import ScaleError
    from hydro.fx.depth import check_args

    try:
        check_args(depth_ratio, depth_alpha)
    except ScaleError as exc:
        raise ConfigError(str(exc)) from exc


__all__ = ["DEFAULT_STORAGE", "TuneOptions"]

"""``hydro.tune``: search on fused surrogates, then hand the answer back to the full model."""

from __future__ import annotations

import datetime
import inspect
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
import yaml
from optuna.trial import TrialState
from torch import nn

from hydro._version import __version__
from hydro.errors import ConfigError, StorageError, StudyError
from hydro.files import write_text
from hydro.fx.floor import task_ratio
from hydro.tuning.compiling import check_compile
from hydro.tuning.driver import (
    check_callbacks,
    check_catch,
    check_depth,
    check_placement,
    check_single_objective,
    check_timeout,
    optimize,
    refuse_directions,
)
from hydro.tuning.fingerprint import check_study, fingerprint, recipe_for
from hydro.tuning.group import check_device, group_key
from hydro.tuning.lockstep import train_group
from hydro.tuning.progress import wanted
from hydro.tuning.report import is_interrupted, is_surplus, trial_counts
from hydro.tuning.signals import terminate_as_interrupt
from hydro.tuning.sizing import check_fuse, check_memory
from hydro.tuning.space import Space, check_space, trained_params
from hydro.tuning.study import trial_seed
from hydro.tuning.task import Task

DEFAULT_STORAGE = "sqlite:///hydro.db"


@dataclass
class TuneResult:
    """What :func:`tune` found.

    Attributes:
        study: the Optuna study (its storage holds every trial).
        ratio: the surrogate width divisor used.
        verification: with ``verify_top_k``, the full-model check (see :func:`verify`).
    """

    study: optuna.Study
    ratio: int
    verification: dict[str, Any] | None = field(default=None)

    @property
    def best_trial(self) -> optuna.trial.FrozenTrial:
        """The best complete trial (:class:`hydro.errors.StudyError` when none completed)."""
        return best_trial(self.study)

    @property
    def best_params(self) -> dict[str, Any]:
        """The best hyperparameters: use them unchanged on the full model."""
        return trained_params(self.best_trial)

    @property
    def best_value(self) -> float:
        """The best surrogate value of the metric."""
        return float(self.best_trial.value)

    @property
    def trials(self) -> list[dict[str, Any]]:
        """One row per trial: number, state, value, parameters, group and fail reason. A trial
        that stopped with its process is ``WAITING`` until a run takes it up again (an older
        study's FAIL row for it: ``INTERRUPTED``)."""
        return [
            {"number": t.number, "state": "INTERRUPTED" if is_interrupted(t) else t.state.name,
             "value": t.value, **trained_params(t), "group": t.user_attrs.get("group"),
             "fail_reason": t.user_attrs.get("fail_reason")}
            for t in self.study.get_trials(deepcopy=False)
            if not is_surplus(t)
        ]  # fmt: skip

    @property
    def occupancy(self) -> dict[str, Any] | None:
        """How full the fused groups stayed in the last run (continuous batching): ``fuse``,
        ``overall`` (mean live trials per fused step over ``fuse``) and ``while_asking`` (the
        same over the steps taken while the study still had trials to ask), summed over every
        group (in process or on an executor's workers); ``None`` before any fused step."""
        occ = self.study.user_attrs.get("hydro_occupancy")
        return dict(occ) if occ else None

    def export(self, path: str | os.PathLike) -> dict[str, Any]:
        """Write the best hyperparameters and their provenance to YAML (or JSON by extension)."""
        return export(self.study, path, verification=self.verification)


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial:
    """A study's best complete trial, or a :class:`StudyError` saying why there is none."""
    try:
        return study.best_trial
    except ValueError as exc:
        counts = trial_counts(study)
        reasons = [t.user_attrs.get("fail_reason") for t in study.get_trials(deepcopy=False)
                   if t.state == TrialState.FAIL
                   and not (is_interrupted(t) or is_surplus(t))]  # fmt: skip
        first = next((r for r in reasons if r), None)
        raise StudyError(
            f"study {study.study_name!r} has no complete trial ({counts['failed']} failed, "
            f"{counts['pruned']} pruned, {counts['interrupted']} interrupted)"
            + (f"; first failure: {first}" if first else "")
            + ". Fix the cause and run it again (finished trials are kept), or see `hydro report`."
        ) from exc


def check_writable(path: str | os.PathLike, what: str = "output file") -> str:
    """Raise a ConfigError unless ``path`` can be written; checked before any long work."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{what} {path!r} is a directory: name a file, e.g. {path}/best.yaml")
    if not os.path.isdir(folder):
        raise ConfigError(f"cannot write the {what} {path!r}: directory {folder!r} does not "
                          "exist. Create it or name another path.")  # fmt: skip
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write the {what} {path!r}: {exc.strerror or exc}. Name a "
                          "path you can write.") from exc  # fmt: skip
    if not existed:
        os.remove(path)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write the {what} {path!r}: directory {folder!r} is not "
                          "writable (the file is written beside its name, then renamed over "
                          "it). Name a path in a directory you can write.")  # fmt: skip
    return path


def task_recipe(task: Task) -> dict[str, Any]:
    """What the study trains with besides the searched hyperparameters (kept with the study)."""
    return {"optimizer": task.optimizer, "scheduler": task.scheduler, "steps": task.steps,
            "batch_size": task.batch_size, "eval_every": task.eval_every,
            "loss": task.loss_name, "direction": task.direction}  # fmt: skip


def training(params: dict[str, Any], recipe: dict[str, Any]) -> dict[str, Any]:
    """Everything to train the full model: the optimizer's ``torch.optim`` arguments, the
    schedule, warm-up, steps and batch size (searched values, else the study's defaults)."""
    from hydro.tuning.group import DEFAULTS

    kind = recipe.get("optimizer", "adamw")
    base = DEFAULTS[kind]
    args: dict[str, Any] = {
        "lr": float(params.get("lr", base["lr"])),
        "weight_decay": float(params.get("weight_decay", base["weight_decay"])),
    }
    if kind == "sgd":
        args["momentum"] = float(params.get("momentum", 0.0))
    else:
        args["betas"] = [float(params.get("beta1", 0.9)), float(params.get("beta2", 0.999))]
        args["eps"] = float(params.get("eps", 1e-8))
    out = {
        "optimizer": kind,
        "optimizer_args": args,
        "scheduler": recipe.get("scheduler", "cosine"),
        "warmup": int(params.get("warmup", 0)),
        "steps": recipe.get("steps"),
        "batch_size": int(params.get("batch_size", recipe.get("batch_size", 32))),
        "grad_clip": params.get("grad_clip"),
    }
    for key in ("dropout", "init_scale", "output_mult"):
        if key in params:
            out[key] = params[key]
    return out


def export(
    study: optuna.Study, path: str | os.PathLike, verification: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write a study's best hyperparameters for the full model, with provenance.

    The file is YAML unless ``path`` ends in ``.json``. Besides the searched
    ``hyperparameters`` it holds ``training``: the optimizer with its ``torch.optim`` arguments,
    the scheduler, warm-up, steps and batch size, ready to train the full model (see
    docs/tuning.md). Returns what was written.

    Raises:
        StudyError: the study has no complete trial.
        ConfigError: ``path`` cannot be written.
    """
    path = check_writable(path, "export file")
    best = best_trial(study)
    counts = trial_counts(study)
    recipe = recipe_for(study, best.number)  # the one it trained with, if the study changed
    params = trained_params(best)  # what trained, fixed values of a space function included
    data: dict[str, Any] = {
        "hyperparameters": params,
        "training": training(params, recipe),
        "provenance": {
            "study": study.study_name,
            "trial": best.number,
            "direction": study.direction.name.lower(),
            "surrogate_value": best.value,
            "ratio": best.user_attrs.get("ratio"),
            "depth_ratio": best.user_attrs.get("depth_ratio", 1),
            "depth_alpha": best.user_attrs.get("depth_alpha", 1.0),
            "surrogate_widths": best.user_attrs.get("surrogate_widths"),
            "surrogate_blocks": best.user_attrs.get("surrogate_blocks"),
            "fused": best.user_attrs.get("fused"),
            "fuse": fuse_record(study),
            "trials_finished": counts["finished"],
            "trials": {k: counts[k] for k in ("complete", "pruned", "failed", "interrupted")},
            "hydro_version": __version__,
            "exported": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
    }
    if params != best.params:  # a space function's fixed or derived values: say what Optuna drew
        data["provenance"]["searched"] = dict(best.params)
    if verification:
        data["verification"] = verification
    # the whole text first, then one rename: an existing file is never left truncated
    text = json.dumps(data, indent=2) if path.endswith(".json") else \
        yaml.safe_dump(data, sort_keys=False)  # fmt: skip
    write_text(path, text)
    return data


def fuse_record(study: optuna.Study) -> dict[str, Any] | None:
    """How the last run sized its fused groups: ``fuse`` (a number or ``"auto"``) and, for
    ``"auto"``, one entry per key and device (batch size, model arguments, ``n``, bytes per
    trial, fixed bytes, budget, what capped ``n``)."""
    record = study.user_attrs.get("hydro_fuse")
    return dict(record) if record else None


def open_study(
    storage: str | None,
    study_name: str,
    direction: str,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
) -> optuna.Study:
    """Create or load a study, with a clear error for a storage that cannot be opened.

    The storage retries a locked database and turns what still fails into one
    :class:`StorageError` line (:mod:`hydro.tuning.storage`, ``HYDRO_STORAGE_TIMEOUT``).
    """
    from hydro.tuning.storage import open_storage

    url = storage or DEFAULT_STORAGE
    try:
        # a URL gets the guarded storage; a storage object (a journal file...) is used as given
        opened = open_storage(url) if isinstance(url, str) else url
        _refuse_multi_objective(opened, study_name)
        return optuna.create_study(
            storage=opened, study_name=study_name, direction=direction,
            sampler=sampler, pruner=pruner, load_if_exists=True,
        )  # fmt: skip
    except (StorageError, ConfigError):
        raise  # already one line saying what to do
    except Exception as exc:  # noqa: BLE001 - SQLAlchemy, file system, journal errors...
        raise StorageError(
            f"cannot open Optuna storage {url!r}: {type(exc).__name__}: {exc}. Check the URL "
            "(e.g. sqlite:///path/to/hydro.db, postgresql://user@host/db) and that its "
            "directory or server is reachable."
        ) from exc


def _refuse_multi_objective(storage: Any, study_name: str) -> None:
    """An existing multi-objective study of that name: one ConfigError line, before Optuna's
    own error about overwriting its directions."""
    try:
        storage = optuna.storages.get_storage(storage)
        directions = storage.get_study_directions(storage.get_study_id_from_name(study_name))
    except KeyError:
        return  # no such study yet: it is created with one direction
    refuse_directions(study_name, directions)


def tune(
    task: Task,
    space: Space,
    *,
    n_trials: int,
    ratio: int | str = 8,
    fuse: int | str = 16,
    study: optuna.Study | str | None = None,
    storage: str | None = None,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
    executor: Any = None,
    seed: int | None = None,
    verify_top_k: int = 0,
    progress: bool | None = None,
    device: str = "cpu",
    depth_ratio: int = 1,
    depth_alpha: float = 1.0,
    first_group: int | str = "auto",
    policy: str = "dynamic",
    deadline: float | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    fuse_memory: float | None = None,
    timeout: float | None = None,
    callbacks: Sequence[Callable[[optuna.Study, optuna.trial.FrozenTrial], Any]] | None = None,
    catch: Sequence[type[Exception]] | type[Exception] = (),
    force_resume: bool = False,
    compile: bool | str = False,
) -> TuneResult:
    """Tune ``task`` over ``space`` on fused muP surrogates, resumably.

    Args:
        task: what to train (:class:`hydro.Task`).
        space: a dict of Optuna distributions, or a function ``trial -> params`` calling
            ``trial.suggest_*``. Names: see :data:`hydro.tuning.space.HYPERPARAMETERS`, plus the
            model factory's keyword arguments.
        n_trials: configurations to finish.
        ratio: surrogate width divisor (1 tunes the full model itself, fused), or ``"auto"``:
            the largest that keeps every layer above its width floor, at most 4 for a model
            with attention (``result.ratio`` says which; see :func:`hydro.scale`).
        fuse: trials per fused group, or ``"auto"``: per (batch size, architecture) key, as
            many as fit the device's memory with a margin (measured on a GPU, estimated on the
            CPU against ``fuse_memory``), at most the trials left and 64; kept in the study
            and the export (docs/tuning.md, "Fusion size").
        study: an Optuna study, or a study name (default ``"hydro"``) to create or resume in
            ``storage``.
        storage: any Optuna storage URL; default ``sqlite:///hydro.db`` (a file in the working
            directory, readable by optuna-dashboard). Rerunning resumes the study there; a
            study keeps what defines it (model, data, loss, metric, recipe, space, ratio) and a
            rerun with another definition raises a :class:`~hydro.errors.ConfigError` naming
            what changed (docs/tuning.md, "Studies and resuming").
        sampler: default TPE with ``constant_liar`` (so a batch asked at once spreads out).
        pruner: default Optuna's ``MedianPruner``.
        executor: where groups train: ``None``/``"inline"`` in this process (one group per
            key, the groups of all keys sharing ``fuse`` slots, taking turns step by step);
            ``"local"`` in worker processes on this machine (``hydro_fluid.LocalExecutor``: one
            group per GPU slot, or CPU threads split between workers); ``"ray"`` on a Ray
            cluster (``hydro_fluid.RayExecutor``; ``RAY_ADDRESS`` or a local one); or an
            executor object.
        seed: seeds the sampler, the surrogates' initializations and the data order.
        verify_top_k: afterwards, train the full model (unmodified, standard parametrization)
            with the best ``k`` configurations and report which wins and the rank agreement.
        progress: show progress on stderr (trial-steps done, trials finished, ETA, best
            value; docs/tuning.md, "Progress") and the five best trials at the end; ``None``
            (default): on when stderr is a terminal or in a notebook, off otherwise.
        device: where groups train in this process (``"cpu"``, ``"cuda"``, ``"cuda:N"``): the
            inline executor and ``verify_top_k``. A ``"local"`` or ``"ray"`` executor places
            groups on its own devices (every visible GPU, else CPU). Asking for CUDA where
            none is available is a :class:`~hydro.errors.ConfigError`.
        depth_ratio: also cut depth: the surrogates keep every ``depth_ratio``-th block of each
            stack of repeated residual blocks (:func:`hydro.scale`; each trial records it in
            ``user_attrs``). 1 (default) keeps every block. ``verify_top_k`` still trains the
            full model.
        depth_alpha: the residual-branch exponent of the depth cut (1: CompleteP, 0.5:
            Depth-muP).
        first_group: train this many trials first, as a group of their own and to the end,
            before groups of ``fuse`` (in this process only): the default ``MedianPruner``
            compares against completed trials, so otherwise it cannot prune any of the first
            ``fuse`` (:func:`hydro.integrations.optuna.optimize`). ``"auto"`` (default): the
            pruner's ``n_startup_trials`` on the CPU, 0 on a GPU, with an executor or another
            pruner (:func:`hydro.tuning.driver.auto_first_group`). 0: off.
        policy: how an executor places groups on its devices: ``"dynamic"`` (default),
            ``"static"``, ``"fifo"`` (one group per device, the baseline) or ``"deadline"``
            (docs/placement.md). No effect in this process (``executor=None``).
        deadline: seconds to the deadline, with ``policy="deadline"`` (required there, refused
            otherwise); no trial is asked after it.
        checkpoint_dir: where the study's trial checkpoints go, in a directory per study
            (default: beside the SQLite file, ``hydro.db.checkpoints``): a trial taken up again
            after its tuner was killed resumes from its last checkpoint (``docs/tuning.md``).
        fuse_memory: with ``fuse="auto"``, the GiB one fused group may use; default half the
            RAM free at start on the CPU (split between an executor's workers), 90% of the
            free memory on a GPU.
        timeout: stop asking new trials after this many seconds (``study.optimize``'s
            ``timeout``). The trials already training run to the end of their fused group and
            are told, so the run ends a group's length after ``timeout`` at most; the next
            run with the same study goes on where it stopped. Default: no limit.
        callbacks: ``f(study, frozen_trial)`` called after each trial ends (COMPLETE, PRUNED
            or FAIL), in this process, with the trial as stored (``study.optimize``'s
            ``callbacks``). An exception in one propagates; the trials still training are
            put back and resume on the next run.
        catch: exception types that the task's data, loss or metric may raise as expected
            failures (``study.optimize``'s ``catch``): their trials fail and the run goes on.
            Without it Hydro already fails such trials and goes on, but stops the run once
            every trial failed the same way (a bug, not bad luck); ``catch`` lifts that stop
            for its types. With an executor a worker's exception is matched by class name.
        force_resume: continue a study whose recorded definition differs from this one (a
            :class:`~hydro.errors.HydroWarning` names the change; the export of a trial trained
            before it keeps its own recipe). Prefer a new study name.
        compile: train the fused groups through ``torch.compile`` (forward, backward and the
            optimizer's update; docs/fusion.md, "Compiled fused step"): ``True`` (or a mode
            such as ``"max-autotune"``), ``False`` (default), or ``"auto"``: per group key,
            time the first eager steps and compile only where the time saved over the steps
            left exceeds twice the estimated compile time, saying so in one line
            (``docs/tuning.md``, "Compiling"). An executor's workers compile as told ("auto":
            each worker decides from its own trials, silently).

    Returns:
        A :class:`TuneResult`.

    Example:
        >>> import optuna, torch, hydro
        >>> x, y = torch.randn(512, 8), torch.randint(0, 3, (512,))
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(),
        ...                             torch.nn.Linear(64, 3))
        >>> task = hydro.Task(model=model, train_data=(x, y), val_data=(x, y), steps=20)
        >>> space = {"lr": optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)}
        >>> result = hydro.tune(task, space, n_trials=8, ratio=4, fuse=8,
        ...                     storage="sqlite:///:memory:")
        >>> sorted(result.best_params)
        ['lr']
    """
    if not isinstance(task, Task):
        raise ConfigError(f"task must be a hydro.Task, got {type(task).__name__}")
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise ConfigError(f"n_trials must be a positive integer, got {n_trials!r}")
    device = check_device(device)
    check_depth(depth_ratio, depth_alpha)
    check_placement(policy, deadline)
    check_fuse(fuse)
    check_memory(fuse_memory)
    compile = check_compile(compile)
    timeout = check_timeout(timeout)
    catch = check_catch(catch)
    callbacks = check_callbacks(callbacks)
    if isinstance(study, optuna.Study):
        check_single_objective(study)
    progress = wanted(progress)  # None: on a terminal or in a notebook
    executor = make_executor(executor)
    check_space(space, task.model_args(), steps=task.steps)
    built = preflight(task, space)
    base_seed = 0 if seed is None else int(seed)
    ratio = task_ratio(task, ratio)  # "auto": the largest ratio within the width floors
    if isinstance(study, optuna.Study):
        the_study = study
    else:
        sampler = sampler or optuna.samplers.TPESampler(seed=seed, constant_liar=True)
        the_study = open_study(storage, study or "hydro", task.direction, sampler, pruner)
    where = f"study {the_study.study_name!r}"
    if not isinstance(study, optuna.Study):
        where += f" in {_storage_name(storage)}"
    definition = fingerprint(task, space, ratio=ratio, depth_ratio=depth_ratio,
                             depth_alpha=depth_alpha, model=built)  # fmt: skip
    check_study(the_study, definition, where=where, force=force_resume)  # before it is changed
    the_study.set_user_attr("hydro_task", task_recipe(task))  # export's training recipe
    with terminate_as_interrupt():  # SIGTERM stops the run and verification as Ctrl-C does
        optimize(the_study, task, space, n_trials, ratio=ratio, fuse=fuse, seed=base_seed,
                 progress=progress, executor=executor, device=device, depth_ratio=depth_ratio,
                 depth_alpha=depth_alpha, first_group=first_group, policy=policy,
                 deadline=deadline, checkpoint_dir=checkpoint_dir, fuse_memory=fuse_memory,
                 timeout=timeout, catch=catch, callbacks=callbacks,
                 compile=compile)  # fmt: skip
        result = TuneResult(the_study, ratio)
        if verify_top_k:
            result.verification = verify(task, the_study, verify_top_k, seed=base_seed,
                                         device=device)  # fmt: skip
            the_study.set_user_attr("hydro_verification", result.verification)
    return result


def preflight(task: Task, space: Space) -> nn.Module | None:
    """Build the target model and run it on a training batch before any trial is asked, so a
    broken factory, model, loss or data set is one clear error instead of failed trials.

    Architecture choices take their first value in a dict space; with a function space and a
    factory that needs searched arguments the check waits for the first group (``None``).
    Returns the model it built (the study's fingerprint records its architecture).
    """
    arch: dict[str, Any] = {}
    names = task.model_args()
    if isinstance(space, Mapping):
        for name, dist in space.items():
            if name in names:
                arch[name] = (dist.choices[0] if hasattr(dist, "choices")
                              else getattr(dist, "low", None))  # fmt: skip
    if not isinstance(task.model, nn.Module):
        needed = [p.name for p in inspect.signature(task.model).parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                  and p.name not in arch]  # fmt: skip
        if needed:
            return None
    model = task.build_model(**arch)
    task.validate(model, next(task.train_batches(2, seed=0)))
    return model


def _storage_name(storage: Any) -> str:
    """A storage as a message names it: its URL, or its type."""
    if storage is None:
        return DEFAULT_STORAGE
    return storage if isinstance(storage, str) else type(storage).__name__


def make_executor(executor: Any) -> Any:
    """``None``/"inline", "local", "ray" or an executor object -> an executor (or None)."""
    if executor in (None, "inline"):
        return None
    if executor == "local":
        from hydro_fluid.executors.local import LocalExecutor

        return LocalExecutor()
    if executor == "ray":
        from hydro_fluid.executors.ray import RayExecutor

        return RayExecutor()
    if hasattr(executor, "run"):
        return executor
    raise ConfigError(f"unknown executor {executor!r}: use 'inline', 'local', 'ray' or a "
                      "hydro_fluid executor")  # fmt: skip


def verify(
    task: Task, study: optuna.Study, top_k: int, *, seed: int = 0, device: str = "cpu"
) -> dict[str, Any]:
    """Train the full model with a study's ``top_k`` best configurations and compare.

    The full model is the task's model itself (ratio 1: standard parametrization, unmodified),
    trained by the same loop, fused where the configurations allow.

    Returns:
        ``{"configs": [{trial, params, surrogate_value, full_value}...], "winner": trial number,
        "spearman": rank correlation between surrogate and full-model values}``.
    """
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    reverse = task.direction == "maximize"
    top = sorted(complete, key=lambda t: t.value, reverse=reverse)[:top_k]
    if not top:
        raise ConfigError("no completed trial to verify")
    groups: dict[tuple, list] = {}
    for t in top:
        groups.setdefault(group_key(trained_params(t), task), []).append(t)
    full: dict[int, float | None] = {}
    for members in groups.values():
        outcomes, _ = train_group(task, [trained_params(t) for t in members], ratio=1,
                                  seeds=[trial_seed(t, seed) for t in members],
                                  device=device)  # fmt: skip
        for t, o in zip(members, outcomes):
            full[t.number] = o.value if o.state == "complete" else None
    rows = [{"trial": t.number, "params": trained_params(t), "surrogate_value": t.value,
             "full_value": full[t.number]} for t in top]  # fmt: skip
    finite = [r for r in rows if r["full_value"] is not None and math.isfinite(r["full_value"])]
    pick = max if reverse else min
    winner = pick(finite, key=lambda r: r["full_value"])["trial"] if finite else None
    rho = spearman([r["surrogate_value"] for r in finite], [r["full_value"] for r in finite])
    return {"configs": rows, "winner": winner, "spearman": rho}


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman rank correlation (average ranks for ties, NaN ranked worst, as a diverged run);
    None for fewer than 2 points."""
    if len(a) < 2:
        return None

    def ranks(v: Sequence[float]) -> list[float]:
        v = [math.inf if math.isnan(x) else float(x) for x in v]
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else None

"""The tuning driver: ask trials, train them in fused groups, tell their results.

Optuna is the tuning brain: its samplers propose, its pruners prune (per member of a group), its
storages persist. :func:`optimize` keeps every fused group full: a slot freed by pruning,
divergence or completion is refilled at once with a newly asked trial, and every member's
intermediate values are reported and each result told, so any sampler, pruner and storage works
unchanged. ``hydro.integrations.optuna`` is its public face.

Its example is in :mod:`hydro.integrations.optuna`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.trial import TrialState

from hydro.errors import ConfigError, ExecutorError
from hydro.tuning import checkpoint as _checkpoint
from hydro.tuning.bookkeeping import (  # noqa: F401 - reclaim_stale, HEARTBEAT_SECONDS, ...: as before
    HEARTBEAT_SECONDS,
    INTERRUPTED,
    POLL_SECONDS,
    STALE_SECONDS,
    Heartbeat,
    after_tell,
    ask,
    counts,
    fail,
    fail_unfinished,
    finished,
    is_void,
    put_back,
    reclaim_stale,
    report_and_ask,
    seed_and_resume,
    seed_sampler,
    sweep_checkpoints,
    tell,
    tell_safely,
)
from hydro.tuning.fleet import _Fleet
from hydro.tuning.group import check_device
from hydro.tuning.loop import Loop
from hydro.tuning.options import TuneOptions
from hydro.tuning.progress import Progress, wanted
from hydro.tuning.signals import terminate_as_interrupt
from hydro.tuning.sizing import MAX_FUSE, check_budget
from hydro.tuning.slots import Occupancy
from hydro.tuning.space import Space, check_space, sample
from hydro.tuning.stream import Where, _Stream, start_group  # noqa: F401 - tests patch start_group
from hydro.tuning.task import Task

__all__ = ["GroupCallback", "auto_first_group", "drive", "is_void", "make_executor", "optimize"]

# fuse="auto" with your own training function: its memory cannot be measured before it runs
LOOP_FUSE = 16

# A user's own group evaluation: given the asked trials (their params are in trial.params), train
# them however you like (report with trial.report, prune with trial.should_prune), and return one
# entry per trial: a float (complete), an optuna.TrialPruned (pruned), or another exception (fail).
GroupCallback = Callable[[list[optuna.Trial]], Sequence[Any]]


def optimize(
    study: optuna.Study,
    task_or_callback: Task | Loop | GroupCallback,
    space: Space | None = None,
    n_trials: int | None = None,
    *,
    options: TuneOptions | None = None,
    **kwargs: Any,
) -> None:
    """Run trials of ``study`` in fused groups until it has ``n_trials`` finished trials.

    Trials are asked as slots free up, ``fuse`` in flight (any Optuna sampler); trials that
    cannot share one fused model (different batch size or architecture arguments) train in
    separate groups. Each member's intermediate values go to ``trial.report`` at every
    evaluation and a member the study's pruner prunes leaves its group, whose slot takes the
    next asked trial. Every asked trial is told: COMPLETE, PRUNED or FAIL (with the reason in
    ``user_attrs["fail_reason"]``) — none is left RUNNING, even when training raises.

    Running the same call again resumes the study, and several processes (on one machine or
    several, through any shared Optuna storage) may run it on one study at once: each trial
    records its owner and a heartbeat; a trial left RUNNING by a dead process (a dead pid on this
    host, or no heartbeat for :data:`STALE_SECONDS` from another host) is put back to WAITING
    and taken up again (same number, parameters, seed and checkpoint), as are this run's own
    unfinished trials on Ctrl-C or SIGTERM: an interrupted trial is never a FAIL row. Trials of
    live processes are left alone. ``n_trials`` counts over the whole study, whichever process
    asked. The rare surplus ask of a race between processes (and an older study's interrupted
    FAIL rows) are void: :func:`is_void`, not counted.

    The sampler's random state is re-seeded from ``seed`` and the trial number before each trial
    is sampled, so a resumed or shared study never repeats start-up configurations.

    Args:
        study: the study (any sampler, pruner, storage; direction must match the task's).
        task_or_callback: a :class:`hydro.Task`, your own loop (a
            :class:`hydro.tuning.loop.Loop`), or a :data:`GroupCallback` that trains a batch of
            asked trials itself.
        space: the search space (a dict of distributions or a function of a trial); optional
            with a callback that suggests its own parameters.
        n_trials: finished trials (COMPLETE, PRUNED or FAIL) the study should have.
        options: the run's options (:class:`~hydro.tuning.options.TuneOptions`, whose
            defaults are ``hydro.tune``'s; docs/reference/options.md); keyword arguments
            override it.
            Of them, this function ignores ``study``, ``storage``, ``sampler``, ``pruner``,
            ``verify_top_k`` and ``force_resume`` (the study is given).
    """
    opts = (options or TuneOptions()).replace(**kwargs)
    if n_trials is not None:
        opts = opts.replace(n_trials=n_trials)
    opts = opts.validate()
    check_single_objective(study)
    opts.device = check_device(opts.device)
    opts.progress = wanted(opts.progress)
    if opts.ratio == "auto" and isinstance(task_or_callback, (Task, Loop)):
        from hydro.fx.floor import task_ratio  # (a group callback scales nothing)

        opts.ratio = task_ratio(task_or_callback, "auto")
    drive(study, task_or_callback, space, opts.replace(executor=make_executor(opts.executor)))


def drive(study: optuna.Study, trainer: Any, space: Space | None, options: TuneOptions) -> None:
    """The engine under :func:`optimize` and :func:`hydro.tuning.run.run`: asks, trains in
    fused groups (in this process, or on ``options.executor``), tells, until the study has
    ``options.n_trials`` finished trials. ``options`` is validated, its ratio resolved and its
    executor made."""
    o = options
    fuse = o.fuse
    most = MAX_FUSE if fuse == "auto" else fuse
    is_task = isinstance(trainer, (Task, Loop))
    if isinstance(trainer, Loop) and fuse == "auto":
        fuse = o.fuse = LOOP_FUSE  # its memory cannot be measured before it runs
    timeout = o.timeout
    if o.deadline is not None:  # the deadline also ends the asking
        timeout = o.deadline if timeout is None else min(timeout, o.deadline)
    first_group = o.first_group
    if first_group == "auto":
        first_group = auto_first_group(study.pruner, most, o.device) \
            if is_task and o.executor is None else 0
    if o.executor is not None and not is_task:
        raise ConfigError("an executor runs Hydro's training loop: pass a Task or your own "
                          "training function, not a group callback")
    if first_group and (o.executor is not None or not is_task):
        raise ConfigError("first_group trains a first group alone in this process, before any "
                          "other: with an executor every other slot would wait for it. Use "
                          "executor=None, or first_group=0")
    if o.world_size > 1 and isinstance(trainer, Loop):
        raise ConfigError("world_size > 1 splits Hydro's own training step over devices: your "
                          "own training function trains each group on one device")
    if is_task:
        if space is None:
            raise ConfigError("optimize(study, task, space, ...) needs a search space")
        check_space(space, None if isinstance(trainer, Loop) else trainer.model_args(),
                    steps=trainer.steps if isinstance(trainer, Task) else None)
        want = optuna.study.StudyDirection.MINIMIZE if trainer.direction == "minimize" \
            else optuna.study.StudyDirection.MAXIMIZE
        if study.direction != want:
            raise ConfigError(f"the study's direction is {study.direction.name.lower()} but the "
                              f"task's is {trainer.direction}")
    elif fuse == "auto":
        raise ConfigError("fuse='auto' sizes Hydro's fused groups: with a group callback, give "
                          "fuse a number")
    if is_task and not isinstance(trainer, Loop) and fuse == "auto" \
            and o.fuse_memory is not None and isinstance(space, dict):
        # a budget no trial fits is a mistake in the options: said before a trial is asked
        check_budget(trainer, space, ratio=o.ratio, device=o.device, memory=o.fuse_memory,
                     depth=(o.depth_ratio, o.depth_alpha), seed=o.base_seed)
    if study.user_attrs.get("hydro_occupancy") is not None:
        study.set_user_attr("hydro_occupancy", None)  # describes the last run only
    if study.user_attrs.get("hydro_sampler_exhausted"):
        study.set_user_attr("hydro_sampler_exhausted", False)  # a new run may bring a new sampler
    study.set_user_attr("hydro_fuse", {"fuse": fuse, "sizes": []})  # sizes: as keys appear
    every = o.checkpoint_every
    if every is None:
        every = getattr(trainer, "checkpoint_every", None)
        every = 50 if every is None else every  # 0: never
    checkpoints = _trial_checkpoints(study, o.checkpoint_dir) if every else None
    start = time.perf_counter()
    steps = trainer.steps if is_task else None  # a callback's steps are its own
    bar = Progress(study, o.n_trials, finished, steps) if o.progress else None
    occupancy = Occupancy(1 if fuse == "auto" else fuse)  # auto: the largest size, once known
    engine = o.replace(timeout=timeout, first_group=first_group, checkpoint_every=every)
    if checkpoints is not None:  # a dead run's files whose trials were re-asked and told
        sweep_checkpoints(study, checkpoints)
    # SIGTERM, while the run is active, stops it as Ctrl-C does (trials requeued, workers
    # stopped, scratch removed); a handler the user installed is left in place
    with terminate_as_interrupt(), Heartbeat(study) as heart:
        try:
            asked_before = len(study.get_trials(deepcopy=False, states=_ASKED)) \
                if o.deadline is not None else 0
            while True:
                if timeout is not None and time.perf_counter() - start > timeout:
                    if o.deadline is not None and timeout == o.deadline:
                        _check_deadline(study, o, start, asked_before)
                    break
                if study.user_attrs.get("hydro_sampler_exhausted"):
                    break
                reclaim_stale(study)
                done, running = counts(study)
                budget = o.n_trials - done - running
                if budget <= 0:
                    if running == 0:
                        break
                    # other live processes are training the rest: wait for them, or for them
                    # to die, in which case their trials are reclaimed above
                    time.sleep(POLL_SECONDS)
                    if bar is not None:
                        bar.update()
                    continue
                where = Where(study=study, heart=heart, bar=bar, start=start,
                              occupancy=occupancy, checkpoints=checkpoints)
                if is_task and o.executor is None:
                    _Stream(trainer, space, engine, where).run()
                elif is_task:
                    _Fleet(trainer, space, engine, where).run()
                else:
                    trials = ask(study, min(fuse, budget), o.n_trials, o.base_seed, heart)
                    if trials:
                        _run_batch(study, trainer, space, trials, heart, o.callbacks)
                if bar is not None:
                    bar.update()
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (Terminated)
            _requeue_owned(study, heart)
            raise
        finally:
            # the bar ends first: a storage error in the bookkeeping below must not leave it
            # to be redrawn at exit, after the CLI's last line
            if bar is not None:
                bar.close()
            if checkpoints is not None:
                sweep_checkpoints(study, checkpoints)
                checkpoints.tidy()
            if occupancy.steps:
                study.set_user_attr("hydro_occupancy", occupancy.as_dict())


_ASKED = (TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def _check_deadline(study: optuna.Study, o: TuneOptions, start: float, asked_before: int) -> None:
    """A deadline that passed before this run asked its first trial (while the study still
    wanted some) is a mistake in the options, not an empty result. (A ``timeout`` that short
    asks nothing new and ends, as a resume that only looks.)"""
    done, running = counts(study)
    if done + running >= o.n_trials:
        return
    if len(study.get_trials(deepcopy=False, states=_ASKED)) > asked_before:
        return
    raise ConfigError(f"the deadline of {o.deadline:g} s passed "
                      f"{time.perf_counter() - start:.2g} s into the search, before its first "
                      "trial was asked: give it more seconds (they count from the start of the "
                      "search, after the model is built)")


def make_executor(executor: Any) -> Any:
    """``None``/"inline", "local", "ray" or an executor object -> an executor (or None)."""
    if executor in (None, "inline"):
        return None
    if executor == "local":
        from hydro_fluid.executors.local import LocalExecutor

        return LocalExecutor()
    if executor == "ray":
        from hydro_fluid.executors.ray import RayExecutor, RayStartError

        try:
            return RayExecutor()
        except RayStartError as exc:
            raise ExecutorError(str(exc)) from exc
    if isinstance(executor, str):
        raise ConfigError(f"unknown executor {executor!r}: use 'inline', 'local', 'ray' or a "
                          "hydro_fluid executor")
    from hydro_fluid.executors.protocol import check_executor

    return check_executor(executor)  # an object: checked against the Executor protocol


def auto_first_group(pruner: optuna.pruners.BasePruner, fuse: int, device: str = "cpu") -> int:
    """The ``first_group`` that ``first_group="auto"`` trains: the trials ``pruner`` waits to
    see complete before it prunes any, where that is fewer than ``fuse``; else 0 (a first
    group of ``fuse`` or more is what the first cohort is anyway, or it does not pay).

    A ``MedianPruner`` or ``PercentilePruner`` (also inside a ``PatientPruner``) prunes only
    once ``n_startup_trials`` trials (at least one) completed, so without a first group none
    of the first ``fuse`` trials, which report together, can be pruned: on the CPU that
    trains them all to the end where plain Optuna would have pruned about half. On a GPU a
    fused step costs about the same however many slots train, so the first group's empty
    slots would cost a whole cohort's time: 0 there. Other pruners (rung-based ones compare
    trials at the same step whether or not they completed) and ``NopPruner``: 0.

    Example:
        >>> auto_first_group(optuna.pruners.MedianPruner(), fuse=16)
        5
        >>> auto_first_group(optuna.pruners.SuccessiveHalvingPruner(), fuse=16)
        0
    """
    if not str(device).startswith("cpu"):
        return 0
    while isinstance(pruner, optuna.pruners.PatientPruner):
        pruner = pruner._wrapped_pruner
    if pruner is None or not isinstance(pruner, optuna.pruners.PercentilePruner):
        return 0
    startup = max(int(pruner._n_startup_trials), 1)  # none prunes before one completed
    # from fuse trials on, the first cohort of fuse is itself the first group
    return startup if startup < int(fuse) else 0


def _requeue_owned(study: optuna.Study, heart: Heartbeat) -> None:
    """Put back to WAITING every trial this run asked that is still RUNNING: an interrupt can
    land between a trial's ask and the bookkeeping of the group that would have told it, and
    a rerun should not have to wait for such a trial to go stale."""
    with heart.lock:
        owned = set(heart.owned)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t._trial_id in owned:
            put_back(study, t._trial_id)


def _trial_checkpoints(study: optuna.Study, root: Any) -> _checkpoint.TrialCheckpoints | None:
    """The study's trial checkpoints under ``root`` (default: beside its SQLite file), or
    ``None`` where there is nowhere they would outlive this process."""
    if root is not None and not isinstance(root, (str, os.PathLike)):
        raise ConfigError(f"checkpoint_dir must be a directory path, got {root!r}")
    if root is not None and os.path.exists(root) and not os.path.isdir(root):
        raise ConfigError(f"checkpoint_dir {os.fspath(root)!r} is a file: give a directory "
                          "(it is created if missing)")
    root = root if root is not None else _checkpoint.default_root(study)
    return _checkpoint.for_study(study, root) if root is not None else None


def _run_batch(study, callback, space, trials, heart, callbacks=()) -> None:
    """Run one batch of asked trials through a group callback; whatever happens, none of them
    stays RUNNING."""
    told: set[int] = set()
    try:
        _run_callback_batch(study, callback, space, trials, told)
        for t in trials:
            after_tell(study, t, callbacks)
    except BaseException as exc:
        fail_unfinished(study, [t for t in trials if t.number not in told], exc)
        raise
    finally:
        heart.release(t._trial_id for t in trials)


def check_single_objective(study: optuna.Study) -> None:
    """A one-line :class:`ConfigError` for a multi-objective study: Hydro ranks, prunes and
    exports by the task's one value."""
    refuse_directions(study.study_name, study.directions)


def refuse_directions(name: str, directions: Sequence[Any]) -> None:
    """The :class:`ConfigError` of :func:`check_single_objective`, for several ``directions``."""
    if len(directions) > 1:
        names = ", ".join(d.name.lower() for d in directions)
        raise ConfigError(f"study {name!r} has {len(directions)} objectives ({names}): Hydro "
                          "tunes one value (the task's metric) and cannot run a "
                          "multi-objective study. Use a study with one direction (another "
                          "study name).")


def _run_callback_batch(study, callback, space, trials, told) -> None:
    if space is not None:
        for t in trials:
            sample(t, space)
    for t in trials:
        t.set_user_attr("group", min(u.number for u in trials))
        t.set_user_attr("fused", len(trials))
    results = list(callback(trials))
    if len(results) != len(trials):
        raise ConfigError(f"the group callback returned {len(results)} results for "
                          f"{len(trials)} trials")
    for t, r in zip(trials, results):
        if isinstance(r, optuna.TrialPruned):
            tell_safely(study, t, state=TrialState.PRUNED)
        elif isinstance(r, BaseException):
            t.set_user_attr("fail_reason", f"{type(r).__name__}: {r}")
            tell_safely(study, t, state=TrialState.FAIL)
        else:
            tell_safely(study, t, float(r))
        told.add(t.number)

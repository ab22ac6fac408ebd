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

from hydro.errors import ConfigError
from hydro.tuning import checkpoint as _checkpoint
from hydro.tuning.compiling import check_compile
from hydro.tuning.fleet import _Fleet
from hydro.tuning.group import check_device
from hydro.tuning.progress import Progress, wanted
from hydro.tuning.signals import terminate_as_interrupt
from hydro.tuning.sizing import MAX_FUSE, check_fuse, check_memory
from hydro.tuning.slots import (
    Occupancy,
)
from hydro.tuning.space import Space, check_space, sample
from hydro.tuning.stream import _Stream, start_group  # noqa: F401 - tests patch start_group
from hydro.tuning.study import (  # noqa: F401 - _reclaim_stale, HEARTBEAT_SECONDS, ...: as before
    _INTERRUPTED,
    _POLL_SECONDS,
    HEARTBEAT_SECONDS,
    STALE_SECONDS,
    _after_tell,
    _ask,
    _counts,
    _fail,
    _fail_unfinished,
    _finished,
    _Heartbeat,
    _put_back,
    _reclaim_stale,
    _report_and_ask,
    _seed_and_resume,
    _seed_sampler,
    _sweep_checkpoints,
    _tell,
    _tell_safely,
    is_void,
)
from hydro.tuning.task import Task

__all__ = ["GroupCallback", "auto_first_group", "is_void", "optimize"]

# A user's own group evaluation: given the asked trials (their params are in trial.params), train
# them however you like (report with trial.report, prune with trial.should_prune), and return one
# entry per trial: a float (complete), an optuna.TrialPruned (pruned), or another exception (fail).
GroupCallback = Callable[[list[optuna.Trial]], Sequence[Any]]


def optimize(
    study: optuna.Study,
    task_or_callback: Task | GroupCallback,
    space: Space | None = None,
    n_trials: int = 16,
    *,
    ratio: int = 8,
    fuse: int | str = 16,
    seed: int = 0,
    device: str = "cpu",
    progress: bool | None = False,
    timeout: float | None = None,
    executor: Any = None,
    checkpoint_every: int | None = None,
    depth_ratio: int = 1,
    depth_alpha: float = 1.0,
    first_group: int | str = "auto",
    world_size: int = 1,
    policy: str = "dynamic",
    deadline: float | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    fuse_memory: float | None = None,
    catch: Sequence[type[BaseException]] | type[BaseException] = (),
    callbacks: Sequence[Callable[[optuna.Study, optuna.trial.FrozenTrial], Any]] | None = None,
    compile: bool | str = False,
) -> None:
    """Run trials of ``study`` in fused groups until it has ``n_trials`` finished trials.

    Trials are asked as slots free up, ``fuse`` in flight (any Optuna sampler); trials that
    cannot share one fused model (different batch size or architecture arguments) train in
    separate groups. Each
    member's intermediate values go to ``trial.report`` at every evaluation and a member the
    study's pruner prunes is dropped from its group. Every asked trial is told: COMPLETE,
    PRUNED or FAIL (with the reason in ``user_attrs["fail_reason"]``) — none is left RUNNING, even
    when training raises.

    Running the same call again resumes the study, and several processes (on one machine or
    several, through any shared Optuna storage) may run it on one study at once: each trial
    records its owner and a heartbeat; a trial left RUNNING by a dead process (a dead pid on this
    host, or no heartbeat for :data:`STALE_SECONDS` from another host) is put back to WAITING
    and taken up again (same number, parameters, seed and checkpoint), as are this run's own
    unfinished trials on Ctrl-C or SIGTERM: an interrupted trial is never a FAIL row. Trials of
    live processes are left alone. ``n_trials`` counts over the whole study, whichever process
    asked: a process with nothing left to ask waits for the others' running trials. The rare
    surplus ask of a race between processes (and an older study's interrupted FAIL rows) are
    void: :func:`is_void`, not counted.

    The sampler's random state is re-seeded from ``seed`` and the trial number before each trial
    is sampled, so a resumed or shared study never repeats start-up configurations, and the
    same sequence of commands draws the same configurations.

    Args:
        study: the study (any sampler, pruner, storage; direction must match the task's).
        task_or_callback: a :class:`hydro.Task`, or a :data:`GroupCallback` for your own loop.
        space: the search space (a dict of distributions or a function of a trial); optional with
            a callback that suggests its own parameters.
        n_trials: finished trials (COMPLETE, PRUNED or FAIL) the study should have.
        ratio: surrogate width divisor.
        fuse: trials per fused group, or ``"auto"``: for each (batch size, architecture) key,
            as many as fit the device's memory (:func:`hydro.tuning.sizing.fuse_size`;
            measured on a GPU, estimated on the CPU), at most the trials left to ask and
            :data:`~hydro.tuning.sizing.MAX_FUSE`; with an executor, the smallest size over
            its devices. Each size is printed with ``progress`` and kept in the study's
            ``hydro_fuse`` user attribute. A group that runs out of memory anyway is halved
            and its trials start again in the smaller groups; none is lost.
        seed: base seed (a trial's initialization and data seed is ``seed + trial.number``;
            a trial re-asked after its tuner died keeps its predecessor's, ``hydro_seed``).
        device: where groups train.
        progress: show the run's progress on stderr (trial-steps and trials done, ETA, best
            value; :class:`hydro.tuning.progress.Progress`) and a table of the five best
            trials at the end; ``None``: only on a terminal or in a notebook.
        timeout: stop asking new trials after this many seconds; the trials already training
            run to their end and are told (as ``study.optimize`` lets running trials finish).
        executor: ``None`` trains in this process: one group per key, the groups of all
            keys sharing ``fuse`` slots and taking turns step by step; a
            ``hydro_fluid`` executor (``LocalExecutor`` for worker processes on this machine,
            ``RayExecutor`` for a Ray cluster) trains one group per slot at once, streaming
            every member's intermediate values back here for the pruner. With an executor the
            task must be picklable (module-level functions, not lambdas).
        checkpoint_every: every group (in this process or on an executor) saves each of its
            trials every this many fused steps (default: the task's ``checkpoint_every`` if it
            has one, else 50; 0: never): a trial re-asked after its tuner died resumes from
            its predecessor's checkpoint (``hydro_resumed_at`` records the step), and on an
            executor a group whose worker dies, or that moves, resumes bit-identically.
        depth_ratio: keep every ``depth_ratio``-th block of each stack of repeated residual
            blocks in the surrogates (:func:`hydro.scale`); 1 (default) keeps them all.
        depth_alpha: the residual-branch exponent of the depth cut (1: CompleteP, 0.5:
            Depth-muP).
        first_group: while the study has fewer than this many complete trials, train that many
            as one group of their own, to the end, before groups of ``fuse`` start (in this
            process only). A pruner that compares against completed trials (``MedianPruner``
            after its ``n_startup_trials``) can then act on every later trial, where otherwise
            the first ``fuse`` report together before any completed and none can be pruned; the
            first group's unused slots are the price. ``"auto"`` (default): the study pruner's
            start-up (:func:`auto_first_group`: a ``MedianPruner``'s or ``PercentilePruner``'s
            ``n_startup_trials``, where below ``fuse``) on the CPU, where a fused step costs about
            in proportion to its live trials so the empty slots cost little; 0 on a GPU (a step
            costs about the same however many slots train), with an executor, a group
            callback or another pruner. 0: groups of ``fuse`` at once.
        world_size: with an executor, each group trains data parallel on this many of its
            slots (devices), exactly as on one (docs/placement.md); a group whose batch size
            does not divide by it trains on one slot, with a warning. A fixed ``world_size``
            above 1 runs the executor's own first-come pool, whatever ``policy`` says; with
            ``world_size`` 1 the policy may widen a group itself, onto devices that would
            sit idle.
        policy: how an executor places the groups on its devices (:mod:`hydro_fluid.placement`):
            ``"dynamic"`` (default: DynamicFluid, asked at every event; a device whose group
            thinned out takes a new group, of another key if one waits, sized for the room
            left), ``"static"`` (StaticFluid over idle devices), ``"fifo"`` (one group per
            device, first come first served: the baseline) or ``"deadline"`` (as the
            deadline nears, the best groups get whole devices). Without an executor groups
            train one after another here and the policy has no effect; an executor whose
            ``run`` takes no ``policy`` runs its own fixed pool.
        deadline: with ``policy="deadline"``: seconds until the deadline; no new trial is
            asked after it.
        checkpoint_dir: the root of the trial checkpoints, each study in a directory of its own
            (named by the study's uuid, ``hydro_study_uid``). Default: beside the study's
            SQLite file (``hydro.db.checkpoints``); a storage without a file (in memory, a
            database server) keeps none unless this is given (for a server, a directory
            every tuner sees). A trial's checkpoint is removed once it is told.
        fuse_memory: with ``fuse="auto"``, the GiB one fused group may use; default: a share
            of the memory free at start (:func:`hydro.tuning.sizing.memory_budget`).
        catch: exception types that are expected failures of the user's data, loss or metric
            (``study.optimize``'s ``catch``): their trials fail and the run goes on. Other
            exceptions of user code fail their trials too, but stop the run once every trial
            failed the same way (:mod:`hydro.tuning.faults`); ``catch`` exempts its types.
        callbacks: ``f(study, frozen_trial)`` called in this process after each trial ends
            (COMPLETE, PRUNED or FAIL), as ``study.optimize``'s; an exception in one stops
            the run and propagates (the trials still training resume on the next run).
        compile: train the fused groups through ``torch.compile``: ``True`` (or a mode),
            ``False`` (default) or ``"auto"`` (per key, where it pays back:
            :mod:`hydro.tuning.compiling`). An executor's workers get it too; there "auto"
            decides per key and worker from that worker's own trials, and says nothing.
    """
    check_single_objective(study)
    catch = check_catch(catch)
    callbacks = check_callbacks(callbacks)
    timeout = check_timeout(timeout)
    fuse = check_fuse(fuse)
    fuse_memory = check_memory(fuse_memory)
    progress = wanted(progress)  # None: on a terminal or in a notebook
    most = MAX_FUSE if fuse == "auto" else fuse
    if first_group != "auto" and (isinstance(first_group, bool)
                                  or not isinstance(first_group, int)
                                  or not 0 <= first_group <= most):  # fmt: skip
        raise ConfigError(f"first_group must be an integer from 0 to fuse ({most}) or 'auto', "
                          f"got {first_group!r}")  # fmt: skip
    check_depth(depth_ratio, depth_alpha)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    if world_size > 1 and executor is None:
        raise ConfigError(f"world_size {world_size} trains each group on several worker "
                          "processes: pass an executor (LocalExecutor, RayExecutor), or use "
                          "world_size 1")  # fmt: skip
    check_placement(policy, deadline)
    if policy == "deadline" and executor is None:
        raise ConfigError("policy 'deadline' places groups on an executor's devices: use "
                          "executor='local' (or 'ray'), or another policy")  # fmt: skip
    if deadline is not None:  # the deadline also ends the asking
        timeout = deadline if timeout is None else min(timeout, deadline)
    depth = (depth_ratio, float(depth_alpha))
    device = check_device(device)
    compile = check_compile(compile)
    is_task = isinstance(task_or_callback, Task)
    if first_group == "auto":
        first_group = auto_first_group(study.pruner, most, device) \
            if is_task and executor is None else 0  # fmt: skip
    if executor is not None and not is_task:
        raise ConfigError("an executor runs Hydro's training loop: pass a Task, not a callback")
    if first_group and (executor is not None or not is_task):
        raise ConfigError("first_group trains a first group alone in this process, before any "
                          "other: with an executor every other slot would wait for it. Use "
                          "executor=None, or first_group=0")  # fmt: skip
    if is_task:
        if space is None:
            raise ConfigError("optimize(study, task, space, ...) needs a search space")
        check_space(space, task_or_callback.model_args(), steps=task_or_callback.steps)
        want = optuna.study.StudyDirection.MINIMIZE if task_or_callback.direction == "minimize" \
            else optuna.study.StudyDirection.MAXIMIZE  # fmt: skip
        if study.direction != want:
            raise ConfigError(f"the study's direction is {study.direction.name.lower()} but the "
                              f"task's is {task_or_callback.direction}")  # fmt: skip
    if study.user_attrs.get("hydro_occupancy") is not None:
        study.set_user_attr("hydro_occupancy", None)  # describes the last run only
    if study.user_attrs.get("hydro_sampler_exhausted"):
        study.set_user_attr("hydro_sampler_exhausted", False)  # a new run may bring a new sampler
    study.set_user_attr("hydro_fuse", {"fuse": fuse, "sizes": []})  # sizes: as keys appear
    if checkpoint_every is None:
        checkpoint_every = getattr(task_or_callback, "checkpoint_every", None)
        checkpoint_every = 50 if checkpoint_every is None else checkpoint_every  # 0: never
    if not isinstance(checkpoint_every, int) or checkpoint_every < 0:
        raise ConfigError(f"checkpoint_every must be an integer >= 0, got {checkpoint_every!r}")
    checkpoints = _trial_checkpoints(study, checkpoint_dir) if checkpoint_every else None
    start = time.perf_counter()
    steps = task_or_callback.steps if is_task else None  # a callback's steps are its own
    bar = Progress(study, n_trials, _finished, steps) if progress else None
    occupancy = Occupancy(1 if fuse == "auto" else fuse)  # auto: the largest size, once known
    if checkpoints is not None:  # a dead run's files whose trials were re-asked and told
        _sweep_checkpoints(study, checkpoints)
    # SIGTERM, while the run is active, stops it as Ctrl-C does (trials requeued, workers
    # stopped, scratch removed); a handler the user installed is left in place
    with terminate_as_interrupt(), _Heartbeat(study) as heart:
        try:
            while True:
                if timeout is not None and time.perf_counter() - start > timeout:
                    break
                if study.user_attrs.get("hydro_sampler_exhausted"):
                    break
                _reclaim_stale(study)
                finished, running = _counts(study)
                budget = n_trials - finished - running
                if budget <= 0:
                    if running == 0:
                        break
                    # other live processes are training the rest: wait for them, or for them
                    # to die, in which case their trials are reclaimed above
                    time.sleep(_POLL_SECONDS)
                    if bar is not None:
                        bar.update()
                    continue
                args = (study, task_or_callback, space, n_trials, ratio, fuse, seed, device,
                        heart, bar, start, timeout, occupancy, depth)  # fmt: skip
                keep = {"checkpoints": checkpoints, "every": checkpoint_every, "catch": catch,
                        "callbacks": callbacks}  # fmt: skip
                if is_task and executor is None:
                    _Stream(*args, first_group=first_group, fuse_memory=fuse_memory,
                            compile=compile, **keep).run()  # fmt: skip
                elif is_task:
                    _Fleet(*args, executor=executor, world_size=world_size, policy=policy,
                           deadline=deadline, fuse_memory=fuse_memory, compile=compile,
                           **keep).run()  # fmt: skip
                else:
                    if fuse == "auto":
                        raise ConfigError("fuse='auto' sizes Hydro's fused groups: with a group "
                                          "callback, give fuse a number")  # fmt: skip
                    trials = _ask(study, min(fuse, budget), n_trials, seed, heart)
                    if trials:
                        _run_batch(study, task_or_callback, space, trials, heart, callbacks)
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
                _sweep_checkpoints(study, checkpoints)
                checkpoints.tidy()
            if occupancy.steps:
                study.set_user_attr("hydro_occupancy", occupancy.as_dict())


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


def _requeue_owned(study: optuna.Study, heart: _Heartbeat) -> None:
    """Put back to WAITING every trial this run asked that is still RUNNING: an interrupt can
    land between a trial's ask and the bookkeeping of the group that would have told it, and
    a rerun should not have to wait for such a trial to go stale."""
    with heart.lock:
        owned = set(heart.owned)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t._trial_id in owned:
            _put_back(study, t._trial_id)


def _trial_checkpoints(study: optuna.Study, root: Any) -> _checkpoint.TrialCheckpoints | None:
    """The study's trial checkpoints under ``root`` (default: beside its SQLite file), or
    ``None`` where there is nowhere they would outlive this process."""
    if root is not None and not isinstance(root, (str, os.PathLike)):
        raise ConfigError(f"checkpoint_dir must be a directory path, got {root!r}")
    if root is not None and os.path.exists(root) and not os.path.isdir(root):
        raise ConfigError(f"checkpoint_dir {os.fspath(root)!r} is a file: give a directory "
                          "(it is created if missing)")  # fmt: skip
    root = root if root is not None else _checkpoint.default_root(study)
    return _checkpoint.for_study(study, root) if root is not None else None


def _run_batch(study, callback, space, trials, heart, callbacks=()) -> None:  # noqa: ANN001
    """Run one batch of asked trials through a group callback; whatever happens, none of them
    stays RUNNING."""
    told: set[int] = set()
    try:
        _run_callback_batch(study, callback, space, trials, told)
        for t in trials:
            _after_tell(study, t, callbacks)
    except BaseException as exc:
        _fail_unfinished(study, [t for t in trials if t.number not in told], exc)
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
                          "study name).")  # fmt: skip


def check_timeout(timeout: Any) -> float | None:
    """``timeout`` as seconds (a number above 0), or None; else a one-line ConfigError."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not 0 < timeout < float("inf"):  # fmt: skip
        raise ConfigError(f"timeout must be a number of seconds above 0, got {timeout!r}")
    return float(timeout)


def check_catch(catch: Any) -> tuple[type[BaseException], ...]:
    """``catch`` (one exception class or several, as ``study.optimize`` takes) as a tuple."""
    items = (catch,) if isinstance(catch, type) else tuple(catch or ())
    for c in items:
        if not (isinstance(c, type) and issubclass(c, Exception)):
            raise ConfigError(f"catch must hold exception classes (e.g. catch=(ValueError,)), "
                              f"got {c!r}")  # fmt: skip
    return items


def check_callbacks(callbacks: Any) -> list[Callable[..., Any]]:
    """``callbacks`` as a list of callables ``f(study, frozen_trial)``."""
    items = list(callbacks or ())
    for c in items:
        if not callable(c):
            raise ConfigError(f"callbacks must be callables f(study, frozen_trial), got {c!r}")
    return items


def check_placement(policy: Any, deadline: Any) -> None:
    """A one-line :class:`ConfigError` unless ``policy`` names a placement policy and
    ``deadline`` fits it (seconds > 0, given exactly with ``"deadline"``)."""
    from hydro_fluid.policies import check_policy

    try:
        check_policy(policy, deadline)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def check_depth(depth_ratio: Any, depth_alpha: Any) -> None:
    """A :class:`ConfigError` unless ``depth_ratio`` is an integer >= 1 and ``depth_alpha`` a
    number in [0, 1] (the arguments of :func:`hydro.scale`), before any trial is asked."""
    from hydro.errors import ScaleError
    from hydro.fx.depth import check_args

    try:
        check_args(depth_ratio, depth_alpha)
    except ScaleError as exc:
        raise ConfigError(str(exc)) from exc


def _run_callback_batch(study, callback, space, trials, told) -> None:  # noqa: ANN001
    if space is not None:
        for t in trials:
            sample(t, space)
    for t in trials:
        t.set_user_attr("group", min(u.number for u in trials))
        t.set_user_attr("fused", len(trials))
    results = list(callback(trials))
    if len(results) != len(trials):
        raise ConfigError(f"the group callback returned {len(results)} results for "
                          f"{len(trials)} trials")  # fmt: skip
    for t, r in zip(trials, results):
        if isinstance(r, optuna.TrialPruned):
            _tell_safely(study, t, state=TrialState.PRUNED)
        elif isinstance(r, BaseException):
            t.set_user_attr("fail_reason", f"{type(r).__name__}: {r}")
            _tell_safely(study, t, state=TrialState.FAIL)
        else:
            _tell_safely(study, t, float(r))
        told.add(t.number)

"""The tuning driver: ask trials, train them in fused groups, tell their results.

Optuna is the tuning brain: its samplers propose, its pruners prune (per member of a group), its
storages persist. :func:`optimize` keeps every fused group full: a slot freed by pruning,
divergence or completion is refilled at once with a newly asked trial, and every member's
intermediate values are reported and each result told, so any sampler, pruner and storage works
unchanged. ``hydro.integrations.optuna`` is its public face.

Its example is in :mod:`hydro.integrations.optuna`.
"""

from __future__ import annotations

import functools
import gc
import inspect
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction
from typing import Any

import optuna
import torch
from optuna.trial import TrialState

from hydro.errors import ConfigError, HydroWarning
from hydro.tuning import checkpoint as _checkpoint
from hydro.tuning.group import FusedGroup, GroupInfo, Outcome, check_device, group_key
from hydro.tuning.progress import Progress
from hydro.tuning.sizing import MAX_FUSE, FuseSize, check_fuse, check_memory, fuse_sizes
from hydro.tuning.slots import (
    Occupancy,
    _stream_in_worker,
    resume_slot,
    save_trials,
    step_slots,
)
from hydro.tuning.space import Space, check_names, check_space, sample
from hydro.tuning.study import (  # noqa: F401 - _reclaim_stale, HEARTBEAT_SECONDS, ...: as before
    _INTERRUPTED,
    _POLL_SECONDS,
    HEARTBEAT_SECONDS,
    STALE_SECONDS,
    _ask,
    _counts,
    _fail,
    _finished,
    _Heartbeat,
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

__all__ = ["GroupCallback", "is_void", "optimize"]

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
    progress: bool = False,
    timeout: float | None = None,
    executor: Any = None,
    checkpoint_every: int | None = None,
    depth_ratio: int = 1,
    depth_alpha: float = 1.0,
    first_group: int = 0,
    world_size: int = 1,
    policy: str = "dynamic",
    deadline: float | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    fuse_memory: float | None = None,
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
    host, or no heartbeat for :data:`STALE_SECONDS` from another host) is failed as
    ``"interrupted"`` and asked again with the same parameters, while trials of live processes
    are left alone. ``n_trials`` counts over the whole study, whichever process asked: a process
    with nothing left to ask waits for the others' running trials. Interrupted rows (and the rare
    surplus ask of a race between processes) are void: :func:`is_void`, not counted.

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
        progress: show a live progress bar on stderr (trials done, best value, ETA) and a
            table of the five best trials at the end.
        timeout: stop asking new groups after this many seconds.
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
            first group's unused slots are the price. 0 (default): groups of ``fuse`` at once.
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
    """
    fuse = check_fuse(fuse)
    fuse_memory = check_memory(fuse_memory)
    most = MAX_FUSE if fuse == "auto" else fuse
    if isinstance(first_group, bool) or not isinstance(first_group, int) \
            or not 0 <= first_group <= most:  # fmt: skip
        raise ConfigError(f"first_group must be an integer from 0 to fuse ({most}), got "
                          f"{first_group!r}")  # fmt: skip
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
    is_task = isinstance(task_or_callback, Task)
    if executor is not None and not is_task:
        raise ConfigError("an executor runs Hydro's training loop: pass a Task, not a callback")
    if first_group and (executor is not None or not is_task):
        raise ConfigError("first_group trains a first group alone in this process, before any "
                          "other: with an executor every other slot would wait for it. Use "
                          "executor=None, or first_group=0")  # fmt: skip
    if is_task:
        if space is None:
            raise ConfigError("optimize(study, task, space, ...) needs a search space")
        check_space(space, task_or_callback.model_args())
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
    bar = Progress(study, n_trials, _finished) if progress else None
    occupancy = Occupancy(1 if fuse == "auto" else fuse)  # auto: the largest size, once known
    if checkpoints is not None:  # a dead run's files whose trials were re-asked and told
        _sweep_checkpoints(study, checkpoints)
    with _Heartbeat(study) as heart:
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
                keep = {"checkpoints": checkpoints, "every": checkpoint_every}
                if is_task and executor is None:
                    _Stream(*args, first_group=first_group, fuse_memory=fuse_memory,
                            **keep).run()  # fmt: skip
                elif is_task:
                    _Fleet(*args, executor=executor, world_size=world_size, policy=policy,
                           deadline=deadline, fuse_memory=fuse_memory, **keep).run()  # fmt: skip
                else:
                    if fuse == "auto":
                        raise ConfigError("fuse='auto' sizes Hydro's fused groups: with a group "
                                          "callback, give fuse a number")  # fmt: skip
                    trials = _ask(study, min(fuse, budget), n_trials, seed, heart)
                    if trials:
                        _run_batch(study, task_or_callback, space, trials, heart)
                if bar is not None:
                    bar.update()
        finally:
            if checkpoints is not None:
                _sweep_checkpoints(study, checkpoints)
                checkpoints.tidy()
            if occupancy.steps:
                study.set_user_attr("hydro_occupancy", occupancy.as_dict())
            if bar is not None:
                bar.close()


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


def _run_batch(study, callback, space, trials, heart) -> None:  # noqa: ANN001
    """Run one batch of asked trials through a group callback; whatever happens, none of them
    stays RUNNING."""
    told: set[int] = set()
    try:
        _run_callback_batch(study, callback, space, trials, told)
    except BaseException as exc:
        stopped = isinstance(exc, KeyboardInterrupt)
        for t in trials:
            if t.number not in told:
                reason = _INTERRUPTED if stopped else f"{type(exc).__name__}: {exc}"[:500]
                _fail(study, t._trial_id, t.number, t.params, reason, requeue=stopped)
        raise
    finally:
        heart.release(t._trial_id for t in trials)


class _Stream:
    """Continuous batching in this process: one live fused group per key, taking turns.

    Trials are asked one at a time, while the study has trials left and the groups have room:
    together they train at most ``fuse`` trials (:meth:`size` says how many trials of a key
    fill the device; each live trial takes its share). A slot freed in any group takes the
    next asked trial: one of the group's own key (:func:`group_key`: batch size and
    architecture) goes into that slot at once; one of another key waits in ``pending`` and
    joins its key's group at the start of the next round, growing it or starting it. In a
    round every group takes one fused step, so every trial advances at the same rate. Every
    asked trial is told, whatever happens.

    :class:`_Fleet` (executors) reuses the asking side: :meth:`next_members` and
    :meth:`next_trial` give one group at a time, one key per group.
    """

    def __init__(self, study, task, space, n_trials, ratio, fuse, seed, device, heart, bar,
                 start, timeout, occupancy, depth=(1, 1.0), first_group=0, checkpoints=None,
                 every=0, fuse_memory=None) -> None:  # noqa: ANN001  # fmt: skip
        self.study, self.task, self.space, self.n_trials = study, task, space, n_trials
        self.ratio, self.fuse, self.seed, self.device = ratio, fuse, seed, device
        self.heart, self.bar, self.start, self.timeout = heart, bar, start, timeout
        self.hook = bar.update if bar is not None else None
        self.pending: dict[tuple, list[tuple[optuna.Trial, dict]]] = {}
        self.running: dict[int, optuna.Trial] = {}  # asked, not yet told
        self.asking = True
        self.occupancy = occupancy
        self.depth = depth  # (depth_ratio, depth_alpha)
        self.first_group = first_group
        self.checkpoints, self.every = checkpoints, every  # each trial's, every `every` steps
        self.seeds: dict[int, int] = {}  # trial -> its seed (a re-asked trial: its predecessor's)
        self.live: dict[tuple, _InProcess] = {}  # key -> its group training in this process
        self.key_of: dict[int, tuple] = {}  # trial -> its key, for the trials asked here
        self.refills = True  # freed slots take new trials (False: an evaluation phase)
        self.built: dict[tuple, FusedGroup] = {}  # key -> its last group built here
        self.fuse_memory = fuse_memory  # GiB per group for fuse="auto"; None: a share of free
        self.key_sizes: dict[tuple, int] = {}  # per key: sized by "auto", or halved after an OOM
        self.key_memory: dict[tuple, float] = {}  # per key, with "auto": GiB one trial adds

    def run(self) -> None:
        self._guard(self._groups)

    def devices(self) -> list[str]:
        """Where this source's groups train, one entry per group that trains at once."""
        return [self.device]

    def fuse_for(self, key: tuple, params: dict | None = None) -> int:
        """Trials per fused group of ``key``: ``fuse``, or with ``fuse="auto"`` the size that
        fits every device (measured when the key first appears, from ``params`` of one of its
        trials); smaller after one of its groups ran out of memory."""
        if key in self.key_sizes:
            return self.key_sizes[key]
        if self.fuse != "auto":
            return self.fuse
        if params is None:
            raise RuntimeError(f"fuse='auto': key {key[0]!r} is sized from a trial's parameters")
        finished, _ = _counts(self.study)
        sizes = fuse_sizes(self.task, params, self.devices(), ratio=self.ratio,
                           remaining=self.n_trials - finished, memory=self.fuse_memory,
                           depth=self.depth, seed=self.seed)  # fmt: skip
        self.key_sizes[key] = min(s.n for s in sizes.values())
        self.key_memory[key] = max(s.per_trial for s in sizes.values()) / 2**30  # GiB
        self._announce(params, sizes.values())
        return self.key_sizes[key]

    def _announce(self, params: dict, sizes: Iterable[FuseSize]) -> None:
        """Print each size (with a progress bar) and keep it in the study's ``hydro_fuse``."""
        args = {k: params[k] for k in sorted(self.task.model_args()) if k in params}
        key = {"batch_size": params.get("batch_size", self.task.batch_size), "model_args": args}
        record = dict(self.study.user_attrs.get("hydro_fuse") or {"fuse": "auto", "sizes": []})
        for size in sizes:
            record["sizes"] = [*record["sizes"], {**key, **size.as_dict()}]
            if self.bar is not None:
                self.bar.note(f"{size.describe()}: batch size {key['batch_size']}"
                              + "".join(f", {k} {v}" for k, v in args.items()))  # fmt: skip
        self.study.set_user_attr("hydro_fuse", record)
        self.occupancy.fuse = max(self.occupancy.fuse, *self.key_sizes.values())

    def out_of_memory(self, key: tuple, live: list[tuple[optuna.Trial, dict]],
                      exc: BaseException) -> None:  # fmt: skip
        """A group of ``key`` ran out of memory with ``live`` trials: later groups of the key
        fuse half as many, and those trials wait to start afresh in them; a lone trial fails."""
        if len(live) < 2:
            for t, _ in live:
                self.tell(t, Outcome("fail", None, 0, f"out of memory even with a single trial: "
                                     f"{type(exc).__name__}: {exc}"[:500]), None)  # fmt: skip
            return
        self.key_sizes[key] = (len(live) + 1) // 2  # as the executors split a group
        self.pending[key] = [*live, *self.pending.get(key, [])]

    def _groups(self) -> None:
        complete = len(self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
        if complete < self.first_group:  # a first group alone, to the end, for the pruner
            self._train(limit=self.first_group - complete, refill=False)
        self._train()

    def size(self, key: tuple) -> int:
        """How many trials of ``key`` fill this process's device (:meth:`fuse_for`)."""
        return self.fuse_for(key)

    def _load(self, numbers: Any) -> Fraction:
        """The part of the device the trials ``numbers`` take (1: full)."""
        return sum((Fraction(1, self.size(self.key_of[n])) for n in numbers), Fraction(0))

    def _train(self, limit: int | None = None, refill: bool = True) -> None:
        """Ask trials up to the room there is (at most ``limit``), then rounds until no group is
        left: the waiting trials join their key's group, then each group takes one fused step
        (its evaluations, ended trials told, freed slots refilled). ``refill=False``: no trial is
        asked after the first ones, and the groups drain."""
        self.refills = refill
        self._fill(limit)
        while True:
            self._admit()
            if not self.live:
                return
            # a group's membership changes only at its own turn: these are the trials this
            # round trains
            live, asking = sum(g.group.n for g in self.live.values()), self.asking
            for key, g in list(self.live.items()):
                try:
                    step_slots(g.group, g, fuse=self.size(key), joined=g.joined,
                               checkpoints=self.checkpoints)  # fmt: skip
                except (MemoryError, torch.cuda.OutOfMemoryError) as exc:
                    self._out_of_memory(key, exc)
                    continue
                save_trials(g.group, self.checkpoints, self.every)
                if not g.group.n:
                    del self.live[key]
            if refill:
                self._fill()
            self.occupancy.add(1, live, asking)
            if self.bar is not None:
                self.bar.occupancy = self.occupancy.fraction(asking=False)

    def _fill(self, limit: int | None = None) -> None:
        """Ask trials into ``pending`` while the device has room (at most ``limit``)."""
        while (limit is None or limit > 0) and self._load(self.running) < 1:
            if self._ask_keyed() is None:
                return
            limit = None if limit is None else limit - 1

    def _ask_keyed(self) -> tuple[optuna.Trial, dict] | None:
        got = self._ask()
        if got is not None:
            key = group_key(got[1], self.task)
            self.key_of[got[0].number] = key
            self.pending.setdefault(key, []).append(got)
        return got

    def _admit(self) -> None:
        """Waiting trials join their key's live group, or start one, while they fit."""
        used = sum(Fraction(g.group.n, self.size(k)) for k, g in self.live.items())
        for key in list(self.pending):
            share = Fraction(1, self.size(key))
            fits = []
            while self.pending[key] and used + share <= 1:
                fits.append(self.pending[key].pop(0))
                used += share
            if not self.pending[key]:
                del self.pending[key]
            if not fits:
                continue
            try:
                if key in self.live:
                    for t, params in fits:
                        self.live[key].add(t, params)
                else:
                    self.live[key] = start_group(self, fits, refill=self.refills)
            except (MemoryError, torch.cuda.OutOfMemoryError) as exc:
                members = self._members(key)
                if not members:  # the group could not even be built: these are its trials
                    self.out_of_memory(key, fits, exc)
                    continue
                self.pending.setdefault(key, [])[:0] = \
                    [f for f in fits if f[0].number not in members]  # fmt: skip
                self._out_of_memory(key, exc)

    def _members(self, key: tuple) -> set[int]:
        g = self.live.get(key)
        return set() if g is None else {m.id for m in g.group.members}

    def _out_of_memory(self, key: tuple, exc: BaseException) -> None:
        """``key``'s live group ran out of memory: its trials start afresh in groups of half
        its size (:meth:`out_of_memory`), ahead of those waiting; its memory is freed."""
        g = self.live.pop(key, None)
        live = [] if g is None else [(g.trials[m.id], m.params) for m in g.group.members]
        self.out_of_memory(key, live, exc)
        # the exception (and the frames it kept) is gone: free the group before the next
        del g
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def take(self, key: tuple) -> tuple[optuna.Trial, dict] | None:
        """The next trial for a freed slot of ``key``'s group: one waiting for that key, else
        newly asked while there is room (a trial of another key asked on the way waits for its
        own group, and the slot is dropped: its share of the device went to that trial)."""
        if not self.refills:
            return None
        while not self.pending.get(key) and self._load(self.running) < 1:
            if self._ask_keyed() is None:
                break
        waiting = self.pending.get(key)
        return waiting.pop(0) if waiting else None

    def next_members(
        self, limit: int | None = None, room: float = 1.0
    ) -> tuple[tuple, list[tuple[optuna.Trial, dict]]] | None:
        """The next group's key and up to its key's fusion size (or ``limit``, or the part
        ``room`` of a device) of members that fuse with its first trial; ``None`` once there
        is nothing left to ask."""
        first = self._pop_pending() or self._ask()
        if first is None:
            return None
        key = group_key(first[1], self.task)
        members = [first]
        fuse = self.fuse_for(key, first[1])
        fuse = min(fuse, limit or fuse, max(1, math.floor(room * fuse + 1e-9)))
        while len(members) < fuse:
            nxt = self.next_trial(key)
            if nxt is None:
                break
            members.append(nxt)
        return key, members

    def _guard(self, work: Callable[[], Any]) -> None:
        """Run ``work``; whatever happens, no trial asked here stays RUNNING."""
        try:
            work()
        except BaseException as exc:
            stopped = isinstance(exc, KeyboardInterrupt)
            for t in self.running.values():
                reason = _INTERRUPTED if stopped else f"{type(exc).__name__}: {exc}"[:500]
                _fail(self.study, t._trial_id, t.number, t.params, reason, requeue=stopped)
            raise
        finally:
            self.heart.release(t._trial_id for t in self.running.values())

    def _stopping(self) -> bool:
        if self.timeout is not None and time.perf_counter() - self.start > self.timeout:
            return True
        return bool(self.study.user_attrs.get("hydro_sampler_exhausted"))

    def _ask(self) -> tuple[optuna.Trial, dict] | None:
        """A new trial with its sampled parameters, or None when the study has enough."""
        if not self.asking or self._stopping():
            self.asking = False
            return None
        _reclaim_stale(self.study)
        finished, running = _counts(self.study)
        got = _ask(self.study, 1, self.n_trials, self.seed, self.heart) \
            if finished + running < self.n_trials else []  # fmt: skip
        if not got:
            self.asking = False
            return None
        t = got[0]
        self.running[t.number] = t
        _seed_sampler(self.study.sampler, self.seed, t.number)
        params = sample(t, self.space)
        check_names(params, self.task.model_args())
        self.seeds[t.number] = _seed_and_resume(self.study, t, params, self.seed,
                                                self.checkpoints)  # fmt: skip
        t.set_user_attr("ratio", self.ratio)
        _set_depth(t, self.depth)
        t.set_user_attr("fused", self.fuse_for(group_key(params, self.task), params))
        return t, params

    def _pop_pending(self) -> tuple[optuna.Trial, dict] | None:
        for key in sorted(self.pending, key=lambda k: -len(self.pending[k])):
            if self.pending[key]:
                return self.pending[key].pop(0)
        return None

    def next_trial(self, key: tuple) -> tuple[optuna.Trial, dict] | None:
        """The next trial for a slot of a group with ``key``: one waiting, else newly asked
        (trials asked on the way that do not fit wait for a group of their own)."""
        if self.pending.get(key):
            return self.pending[key].pop(0)
        for _ in range(self.fuse_for(key)):
            got = self._ask()
            if got is None:
                return None
            other = group_key(got[1], self.task)
            if other == key:
                return got
            self.pending.setdefault(other, []).append(got)
        return None

    def tell(self, trial: optuna.Trial, outcome: Outcome, info: GroupInfo | None) -> None:
        _tell(self.study, trial, outcome, info)
        if self.checkpoints is not None:
            self.checkpoints.remove(trial.number)
        self.running.pop(trial.number, None)
        self.key_of.pop(trial.number, None)
        self.heart.release([trial._trial_id])


def start_group(
    stream: _Stream, members: list[tuple[optuna.Trial, dict]], refill: bool = True
) -> _InProcess:
    """Build a fused group of ``members`` (one key) to train in this process, in the stream's
    rounds (:meth:`_Stream._train`): its freed slots take new trials until the study has no
    more to ask (``refill=False``: freed slots stay empty, the group drains)."""
    gid = min(t.number for t, _ in members)
    key = group_key(members[0][1], stream.task)
    for slot, (t, _) in enumerate(members):
        t.set_user_attr("group", gid)
        t.set_user_attr("slot", slot)
        t.set_user_attr("fused", stream.fuse_for(key))  # the key's size now (after an OOM)
    group = FusedGroup(stream.task, [(t.number, p, stream.seeds[t.number]) for t, p in members],
                       ratio=stream.ratio, device=stream.device, depth_ratio=stream.depth[0],
                       depth_alpha=stream.depth[1], like=stream.built.get(key))  # fmt: skip
    stream.built[key] = group  # a key's next group reuses its capture (seconds per group)
    for slot in range(group.n):  # a trial re-asked after its tuner died goes on from there
        resume_slot(group, slot, stream.checkpoints)
    return _InProcess(stream, gid, group, {t.number: t for t, _ in members}, refill=refill)


class _InProcess:
    """A group training in the driver's own process, and its trial source (see
    :func:`hydro.tuning.slots.step_slots`)."""

    def __init__(self, stream: _Stream, gid: int, group: FusedGroup,
                 trials: dict[int, optuna.Trial], refill: bool = True) -> None:  # fmt: skip
        self.stream, self.gid, self.group, self.trials = stream, gid, group, trials
        self.refills = refill
        self.joined = {n: time.perf_counter() for n in trials}  # for each trial's group_seconds

    @property
    def asking(self) -> bool:
        return self.stream.asking

    def stepped(self, live: int) -> None:
        """Nothing: the stream counts occupancy per round, over all its groups."""

    def report(self, items: list[tuple[int, int, float]]) -> set[int]:
        hook = self.stream.hook
        return {n for n, step, v in items if _report_and_ask(self.trials[n], step, v, hook)}

    def add(self, t: optuna.Trial, params: dict) -> None:
        """Trial ``t`` joins this group in a new slot."""
        slot = self.group.add(t.number, params, self.stream.seeds[t.number])
        resume_slot(self.group, slot, self.stream.checkpoints)
        t.set_user_attr("group", self.gid)
        t.set_user_attr("slot", slot)
        t.set_user_attr("fused", self.stream.fuse_for(self.group.key))
        self.trials[t.number] = t
        self.joined[t.number] = time.perf_counter()

    def refill(self, told: list, slots: list[int], key: tuple) -> list:
        for number, outcome, info in told:
            self.stream.tell(self.trials.pop(number), outcome, info)
        if not self.refills:
            return [None] * len(slots)
        out = []
        for slot in slots:
            nxt = self.stream.take(key)
            if nxt is None:
                out.append(None)
                continue
            t, params = nxt
            t.set_user_attr("group", self.gid)
            t.set_user_attr("slot", slot)
            t.set_user_attr("fused", self.stream.fuse_for(key))
            self.trials[t.number] = t
            out.append((t.number, params, self.stream.seeds[t.number]))
        return out


class _Fleet(_Stream):
    """Continuous batching on an executor: one fused group per free slot, refilled in place.

    ``executor.run`` asks :meth:`more` for a new group whenever one of its slots is free, so no
    slot waits for another. The group's worker asks this process (``ctx.request``) for its
    first members, gives every evaluation to the study's pruner, tells ended trials and asks for
    the next one, of any key, for each freed slot (the worker hosts a group per key:
    :class:`hydro.tuning.slots._Hosted`): the study and its storage stay here. What a group was
    given is logged in order, so a retried worker (after a crash) is given the same trials
    again and every trial ends as it would have, whichever slot, group or worker trained it.
    """

    def __init__(self, *args: Any, executor: Any, every: int, checkpoints: Any = None,
                 world_size: int = 1, policy: str = "fifo", deadline: float | None = None,
                 fuse_memory: float | None = None) -> None:  # fmt: skip
        super().__init__(*args, checkpoints=checkpoints, every=every, fuse_memory=fuse_memory)
        self.executor = executor
        self.policy, self.deadline = policy, deadline
        self.world_size = world_size
        self.sizes: dict[str, int] = {}  # group -> its data parallel world size
        self.undivided: set[tuple] = set()  # keys warned about: batch not divisible
        self.logs: dict[str, list] = {}  # group -> [first members, one entry per refill]
        self.capacity: dict[str, int] = {}  # group -> how many trials its worker trains
        self.trial_key: dict[int, tuple] = {}  # trial -> its key
        self.group_of: dict[int, int] = {}  # trial -> the fused group it trains in
        self.keys: dict[str, tuple] = {}
        self.gids: dict[str, int] = {}
        self.owner: dict[int, str] = {}  # trial -> the group training it
        self.params: dict[int, dict] = {}
        self.counts: dict[str, list[int]] = {}  # occupancy counters, per group
        self.base = self.occupancy.counts()

    def devices(self) -> list[str]:
        return list(self.executor.slots)

    def run(self) -> None:
        # the worker counts steps and members; the driver decides each group's size
        fuse = MAX_FUSE if self.fuse == "auto" else self.fuse
        fn = functools.partial(_stream_in_worker, self.task, self.ratio, fuse, self.depth,
                               self.every, checkpoints=self.checkpoints,
                               study=_checkpoint.study_id(self.study))  # fmt: skip
        placement = {}
        if self.world_size == 1 and "policy" in inspect.signature(self.executor.run).parameters:
            # the policy decides each group's devices (data parallel when it widens one); a
            # fixed world_size above 1 keeps the executor's own first-come pool
            placement = {"policy": self.policy, "deadline": self.deadline}
        # a worker captures its group's model with torch.export: an import of seconds, paid
        # once in the forkserver instead of in every worker
        self._guard(lambda: self.executor.run([], fn, more=self.more, on_result=self.ended,
                                              request=self.answer, world_size=self.sizes,
                                              preload=["torch.export._trace"],
                                              **placement))  # fmt: skip

    def more(self, room: float = 1.0) -> list:
        """A new group for a free device: ``room`` is the fraction of a device free for it
        (a device whose group thinned out has less than 1), so it gets that share of ``fuse``
        members; trials of a key waiting for a group of their own come first."""
        from hydro_fluid import TrialGroup

        found = self.next_members(room=room)
        if found is None:
            return []
        key, members = found
        gid = min(t.number for t, _ in members)
        name = f"group-{gid}"
        self.keys[name], self.gids[name] = key, gid
        self.sizes[name] = self._world_size(key)
        # the worker keeps this many trials of any key (its share of the device)
        fuse = self.fuse_for(key)
        self.capacity[name] = max(len(members), min(fuse, math.floor(room * fuse + 1e-9)))
        self.logs[name] = [[self._assign(t, p, name, slot) for slot, (t, p) in enumerate(members)]]
        # with fuse="auto" the placement policy packs by the memory the sizing measured
        return [TrialGroup(name, tuple(t.number for t, _ in members),
                           (self.task.steps,) * len(members),
                           memory_per_trial=self.key_memory.get(key, 0.0))]  # fmt: skip

    def _world_size(self, key: tuple) -> int:
        """How many slots a new group of ``key`` trains on: ``world_size``, or 1 where its
        batch size (``key[0]``) cannot be split evenly (a warning says so, once per key)."""
        batch = int(key[0])
        if batch % self.world_size == 0:
            return self.world_size
        if key not in self.undivided:
            self.undivided.add(key)
            warnings.warn(HydroWarning(
                f"batch size {batch} does not divide by world_size {self.world_size}: its "
                "groups train on one slot each (data parallel splits a batch into equal shards)"
            ), stacklevel=2)  # fmt: skip
        return 1

    def _assign(self, t: optuna.Trial, params: dict, name: str, slot: int) -> tuple:
        key = group_key(params, self.task)
        self.group_of[t.number] = self._gid(t.number, key, name)
        t.set_user_attr("group", self.group_of[t.number])
        t.set_user_attr("slot", slot)
        t.set_user_attr("world_size", self.sizes.get(name, 1))  # data parallel replicas
        t.set_user_attr("fused", self.fuse_for(key))
        self.owner[t.number], self.params[t.number] = name, params
        self.trial_key[t.number] = key
        return (t.number, params, self.seeds[t.number])

    def _gid(self, number: int, key: tuple, name: str) -> int:
        """The fused group trial ``number`` (of ``key``) joins in the worker of ``name``: the
        worker's first group, a group of another key it hosts already, or a new one that
        trial ``number`` starts."""
        if key == self.keys.get(name):
            return self.gids[name]
        for n, owner in self.owner.items():
            if owner == name and n in self.running and self.trial_key.get(n) == key:
                return self.group_of[n]
        return number

    def answer(self, name: str, payload: tuple) -> dict[str, Any]:
        """A worker's request: ``start``, ``report`` or ``refill`` (see :class:`_Remote`)."""
        kind = payload[0]
        if kind == "start":
            if name not in self.logs:
                self._split(name)
            return {
                "members": self.logs[name][0],
                "asking": self.asking,
                "capacity": self.capacity.get(name, len(self.logs[name][0])),
            }
        self._count(name, payload[-1])
        if kind == "report":
            pruned = []
            for number, step, value in payload[1]:
                t = self.running.get(number)  # told already: a retried group replaying it
                if t is None or _report_and_ask(t, step, value, self.hook):
                    pruned.append(number)
            return {"pruned": pruned, "asking": self.asking}
        _, told, wants, any_key, _ = payload
        for number, outcome, info in told:
            if number in self.running:
                self.tell(self.running[number], outcome, info)
        log, out = self.logs[name], []
        for index, slot in wants:
            if index >= len(log):  # new: ask; else a retried worker is given what it had
                # a worker hosts every key's group (any_key): the next trial, whatever its
                # key; a data parallel group takes only its own key
                nxt = self._next_any() if any_key else self.next_trial(self.keys[name])
                log.append(None if nxt is None else self._assign(*nxt, name, slot))
            out.append(log[index])
        return {"trials": out, "asking": self.asking}

    def _next_any(self) -> tuple[optuna.Trial, dict] | None:
        """The next trial for a freed slot of a worker that hosts every key: one waiting for a
        group of its own, else newly asked (with one key: what :meth:`next_trial` gives)."""
        return self._pop_pending() or self._ask()

    def _split(self, name: str) -> None:
        """Members of a half of a group split after running out of memory (``name/0``,
        ``name/1``): the trials its group still had, halved."""
        base = name.rsplit("/", 1)[0]
        live = sorted(n for n, g in self.owner.items() if g == base and n in self.running)
        half = (len(live) + 1) // 2
        key = self.keys.get(base)
        if key is not None:  # later groups of the key start at the size that fitted
            self.key_sizes[key] = max(1, min(self.fuse_for(key), half))
        for part, numbers in ((f"{base}/0", live[:half]), (f"{base}/1", live[half:])):
            self.keys[part], self.gids[part] = self.keys.get(base), self.gids.get(base, 0)
            self.sizes.setdefault(part, self.sizes.get(base, 1))  # as the executor runs it
            self.logs[part] = [[self._assign(self.running[n], self.params[n], part, slot)
                                for slot, n in enumerate(numbers)]]  # fmt: skip

    def _count(self, name: str, counts: Sequence[int] | None) -> None:
        if counts is None:
            return
        self.counts[name] = list(counts)
        total = [sum(c[i] for c in self.counts.values()) for i in range(4)]
        self.occupancy.set_counts([b + t for b, t in zip(self.base, total)])
        if self.bar is not None:
            self.bar.occupancy = self.occupancy.fraction(asking=False)

    def ended(self, result: Any) -> None:
        """A group's worker ended: the trials it still had fail, with the executor's reason."""
        name = result.group.name
        if isinstance(result.value, dict):
            self._count(name, result.value.get("occupancy"))
        reason = result.error or "its group's worker ended without a result for it"
        for number, owner in list(self.owner.items()):
            if owner == name and number in self.running:
                self.tell(self.running[number], Outcome("fail", None, 0, reason[:500]), None)


def check_placement(policy: Any, deadline: Any) -> None:
    """A one-line :class:`ConfigError` unless ``policy`` names a placement policy and
    ``deadline`` fits it (seconds > 0, given exactly with ``"deadline"``)."""
    from hydro_fluid.placement import check_policy

    try:
        check_policy(policy, deadline)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _set_depth(trial: optuna.Trial, depth: tuple[int, float]) -> None:
    trial.set_user_attr("depth_ratio", depth[0])
    trial.set_user_attr("depth_alpha", depth[1])


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

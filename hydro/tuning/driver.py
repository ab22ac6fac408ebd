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
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy
import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.samplers import BaseSampler
from optuna.samplers._lazy_random_state import LazyRandomState
from optuna.storages._heartbeat import is_heartbeat_enabled
from optuna.trial import FrozenTrial, TrialState

from hydro.errors import ConfigError
from hydro.tuning.group import (
    FusedGroup,
    GroupInfo,
    Outcome,
    _evaluated,
    check_device,
    group_key,
    train_group,
)
from hydro.tuning.progress import Progress
from hydro.tuning.space import Space, check_names, check_space, sample
from hydro.tuning.task import Task
from hydro_fluid.executors.local import start_ticks

__all__ = ["GroupCallback", "is_void", "optimize"]

# A user's own group evaluation: given the asked trials (their params are in trial.params), train
# them however you like (report with trial.report, prune with trial.should_prune), and return one
# entry per trial: a float (complete), an optuna.TrialPruned (pruned), or another exception (fail).
GroupCallback = Callable[[list[optuna.Trial]], Sequence[Any]]

_INTERRUPTED = "interrupted: the process running it stopped; re-asked with the same parameters"


def optimize(
    study: optuna.Study,
    task_or_callback: Task | GroupCallback,
    space: Space | None = None,
    n_trials: int = 16,
    *,
    ratio: int = 8,
    fuse: int = 16,
    seed: int = 0,
    device: str = "cpu",
    progress: bool = False,
    timeout: float | None = None,
    executor: Any = None,
    checkpoint_every: int | None = None,
    depth_ratio: int = 1,
    depth_alpha: float = 1.0,
) -> None:
    """Run trials of ``study`` in fused groups until it has ``n_trials`` finished trials.

    Trials are asked ``fuse`` at a time (any Optuna sampler); trials that cannot share one fused
    model (different batch size or architecture arguments) are split into separate groups. Each
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
        fuse: trials per fused group.
        seed: base seed (a trial's initialization and data seed is ``seed + trial.number``).
        device: where groups train.
        progress: show a live progress bar on stderr (trials done, best value, ETA) and a
            table of the five best trials at the end.
        timeout: stop asking new groups after this many seconds.
        executor: ``None`` trains groups in this process, one after another; a
            ``hydro_fluid`` executor (``LocalExecutor`` for worker processes on this machine,
            ``RayExecutor`` for a Ray cluster) trains one group per slot at once, streaming
            every member's intermediate values back here for the pruner. With an executor the
            task must be picklable (module-level functions, not lambdas).
        checkpoint_every: with an executor, each group saves a checkpoint every this many
            steps (default: the task's ``checkpoint_every`` if it has one, else 50), so a group
            whose worker dies resumes there and ends bit-identical to an uninterrupted run.
        depth_ratio: keep every ``depth_ratio``-th block of each stack of repeated residual
            blocks in the surrogates (:func:`hydro.scale`); 1 (default) keeps them all.
        depth_alpha: the residual-branch exponent of the depth cut (1: CompleteP, 0.5:
            Depth-muP).
    """
    if not isinstance(fuse, int) or fuse < 1:
        raise ConfigError(f"fuse must be a positive integer, got {fuse!r}")
    check_depth(depth_ratio, depth_alpha)
    depth = (depth_ratio, float(depth_alpha))
    device = check_device(device)
    is_task = isinstance(task_or_callback, Task)
    if executor is not None and not is_task:
        raise ConfigError("an executor runs Hydro's training loop: pass a Task, not a callback")
    # with an executor, ask enough trials to give every slot a group
    batch = fuse * (len(getattr(executor, "slots", None) or [None]) if executor else 1)
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
    if checkpoint_every is None:
        checkpoint_every = getattr(task_or_callback, "checkpoint_every", None) or 50
    if not isinstance(checkpoint_every, int) or checkpoint_every < 0:
        raise ConfigError(f"checkpoint_every must be an integer >= 0, got {checkpoint_every!r}")
    start = time.perf_counter()
    bar = Progress(study, n_trials, _finished) if progress else None
    occupancy = Occupancy(fuse)
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
                if is_task and executor is None:
                    _Stream(study, task_or_callback, space, n_trials, ratio, fuse, seed, device,
                            heart, bar, start, timeout, occupancy, depth).run()  # fmt: skip
                else:
                    trials = _ask(study, min(batch, budget), n_trials, seed, heart)
                    if trials:
                        _run_batch(study, task_or_callback, space, trials, ratio, seed, fuse,
                                   device, executor, is_task, heart, bar,
                                   checkpoint_every, depth)  # fmt: skip
                if bar is not None:
                    bar.update()
        finally:
            if occupancy.steps:
                study.set_user_attr("hydro_occupancy", occupancy.as_dict())
            if bar is not None:
                bar.close()


def _run_batch(study, task, space, trials, ratio, seed, fuse, device, executor, is_task,
               heart, bar, every, depth=(1, 1.0)) -> None:  # noqa: ANN001  # fmt: skip
    """Train one batch of asked trials; whatever happens, none of them stays RUNNING."""
    told: set[int] = set()
    hook = bar.update if bar is not None else None
    try:
        if executor is not None:
            _run_on_executor(study, task, space, trials, ratio, seed, fuse, told, executor, hook,
                             every, depth)  # fmt: skip
        else:
            _run_callback_batch(study, task, space, trials, told)
    except BaseException as exc:
        stopped = isinstance(exc, KeyboardInterrupt)
        for t in trials:
            if t.number not in told:
                reason = _INTERRUPTED if stopped else f"{type(exc).__name__}: {exc}"[:500]
                _fail(study, t._trial_id, t.number, t.params, reason, requeue=stopped)
        raise
    finally:
        heart.release(t._trial_id for t in trials)


def _plan_groups(trials, task, space, ratio, fuse, seed, depth=(1, 1.0)):  # noqa: ANN001, ANN202
    """Sample each trial, then split them into fused groups of at most ``fuse`` members that
    agree on :func:`group_key`, recording group id, ratio, depth and size on every trial.

    A group's id is its lowest trial number: unique even when several processes share a study.
    """
    params: dict[int, dict] = {}
    by_key: dict[tuple, list[optuna.Trial]] = {}
    for t in trials:
        _seed_sampler(t.study.sampler, seed, t.number)
        params[t.number] = sample(t, space)
        check_names(params[t.number], task.model_args())
        by_key.setdefault(group_key(params[t.number], task), []).append(t)
    groups = []
    for same in by_key.values():
        for i in range(0, len(same), fuse):
            members = same[i : i + fuse]
            for t in members:
                t.set_user_attr("group", min(m.number for m in members))
                t.set_user_attr("ratio", ratio)
                _set_depth(t, depth)
                t.set_user_attr("fused", len(members))
            groups.append(members)
    return groups, params


@dataclass
class Occupancy:
    """How full a run kept its fused groups: live members per fused step, out of ``fuse``.

    ``steps``/``live`` count every fused step; ``*_asking`` only the steps taken while the
    study still had trials to ask (a study's last groups drain as their members end).
    """

    fuse: int
    steps: int = 0
    live: int = 0
    steps_asking: int = 0
    live_asking: int = 0

    def fraction(self, asking: bool = True) -> float | None:
        """Mean live members per step over ``fuse`` (while asking, by default)."""
        steps, live = (self.steps_asking, self.live_asking) if asking else (self.steps, self.live)
        return live / (steps * self.fuse) if steps else None

    def as_dict(self) -> dict[str, Any]:
        return {"fuse": self.fuse, "steps": self.steps, "live": self.live,
                "steps_asking": self.steps_asking, "live_asking": self.live_asking,
                "while_asking": self.fraction(True), "overall": self.fraction(False)}  # fmt: skip


class _Stream:
    """Continuous batching in this process: fused groups whose freed slots take new trials.

    Trials are asked one at a time, when a slot is free. A trial that cannot join the group
    asking for it (another batch size or architecture, :func:`group_key`) waits in ``pending``
    for a group of its own. Every asked trial is told, whatever happens.
    """

    def __init__(self, study, task, space, n_trials, ratio, fuse, seed, device, heart, bar,
                 start, timeout, occupancy, depth=(1, 1.0)) -> None:  # noqa: ANN001  # fmt: skip
        self.study, self.task, self.space, self.n_trials = study, task, space, n_trials
        self.ratio, self.fuse, self.seed, self.device = ratio, fuse, seed, device
        self.heart, self.bar, self.start, self.timeout = heart, bar, start, timeout
        self.hook = bar.update if bar is not None else None
        self.pending: dict[tuple, list[tuple[optuna.Trial, dict]]] = {}
        self.running: dict[int, optuna.Trial] = {}  # asked, not yet told
        self.asking = True
        self.occupancy = occupancy
        self.depth = depth  # (depth_ratio, depth_alpha)

    def run(self) -> None:
        try:
            while True:
                first = self._pop_pending() or self._ask()
                if first is None:
                    break
                key = group_key(first[1], self.task)
                members = [first]
                while len(members) < self.fuse:
                    more = self.next_trial(key)
                    if more is None:
                        break
                    members.append(more)
                run_group(self, members)
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
        t.set_user_attr("ratio", self.ratio)
        _set_depth(t, self.depth)
        t.set_user_attr("fused", self.fuse)
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
        for _ in range(self.fuse):
            got = self._ask()
            if got is None:
                return None
            other = group_key(got[1], self.task)
            if other == key:
                return got
            self.pending.setdefault(other, []).append(got)
        return None

    def tell(self, trial: optuna.Trial, outcome: Outcome, info: GroupInfo) -> None:
        _tell(self.study, trial, outcome, info)
        self.running.pop(trial.number, None)
        self.heart.release([trial._trial_id])


def run_group(stream: _Stream, members: list[tuple[optuna.Trial, dict]]) -> None:
    """Train one fused group to the end: every slot freed by pruning, divergence or completion
    takes the next trial at once, until the study has no more to ask."""
    task, steps = stream.task, stream.task.steps
    gid = min(t.number for t, _ in members)
    trials = {t.number: t for t, _ in members}
    joined = {t.number: time.perf_counter() for t, _ in members}
    for slot, (t, _) in enumerate(members):
        t.set_user_attr("group", gid)
        t.set_user_attr("slot", slot)
    group = FusedGroup(task, [(t.number, p, stream.seed + t.number) for t, p in members],
                       ratio=stream.ratio, device=stream.device, depth_ratio=stream.depth[0],
                       depth_alpha=stream.depth[1])  # fmt: skip

    def report(number: int, step: int, value: float) -> bool:
        return _report_and_ask(trials[number], step, value, stream.hook)

    while group.n:
        losses = group.step()
        stream.occupancy.steps += 1
        stream.occupancy.live += group.n
        if stream.asking:
            stream.occupancy.steps_asking += 1
            stream.occupancy.live_asking += group.n
        if stream.bar is not None:
            stream.bar.occupancy = stream.occupancy.fraction(asking=False)
        ended: dict[int, Outcome] = {}
        for slot in group.diverged(losses):
            m = group.members[slot]
            ended[slot] = Outcome("fail", None, m.step, f"diverged at step {m.step}: non-finite "
                                  "loss or gradient", m.history)  # fmt: skip
        due = [slot for slot in group.due() if slot not in ended]
        if due:
            values = group.evaluate()
            for slot in due:
                m, out = group.members[slot], {}
                _evaluated(slot, m.step, float(values[slot]), m.history, out, _report_for(
                    report, m.id), steps)  # fmt: skip
                if slot in out:
                    ended[slot] = out[slot]
        for slot, m in enumerate(group.members):
            if slot not in ended and m.step >= steps:
                last = m.history[-1][1] if m.history else None
                ended[slot] = Outcome("complete", last, steps, "", m.history)
        if not ended:
            continue
        for slot in sorted(ended):  # tell every ended trial before asking new ones
            number = group.members[slot].id
            info = GroupInfo(ratio=stream.ratio, size=stream.fuse, widths=group.widths,
                             depth_ratio=stream.depth[0], depth_alpha=stream.depth[1],
                             blocks=group.blocks,
                             seconds=time.perf_counter() - joined.pop(number))  # fmt: skip
            stream.tell(trials.pop(number), ended[slot], info)
        freed = []
        for slot in sorted(ended):
            nxt = stream.next_trial(group.key)
            if nxt is None:
                freed.append(slot)
                continue
            t, params = nxt
            t.set_user_attr("group", gid)
            t.set_user_attr("slot", slot)
            trials[t.number] = t
            joined[t.number] = time.perf_counter()
            group.put(slot, t.number, params, stream.seed + t.number)
        if freed:
            group.drop(freed)


def _report_for(report: Callable[[int, int, float], bool], number: int) -> Callable:
    """``report`` for one member, as :func:`_evaluated` calls it (by slot)."""
    return lambda _slot, step, value: report(number, step, value)


def _report_and_ask(trial: optuna.Trial, step: int, value: float, hook=None) -> bool:  # noqa: ANN001
    """Give the study a member's intermediate value; True when its pruner prunes it."""
    try:
        trial.report(value, step)
        pruned = trial.should_prune()
    except UpdateFinishedTrialError:
        return True  # another process failed it as stale: it is no longer ours to train
    if hook is not None:
        hook()
    return pruned


def _run_on_executor(study, task, space, trials, ratio, seed, fuse, told, executor, hook, every,
                     depth=(1, 1.0)):  # noqa: ANN001, ANN202  # fmt: skip
    from hydro_fluid import TrialGroup

    by_number = {t.number: t for t in trials}
    groups, params = _plan_groups(trials, task, space, ratio, fuse, seed, depth)
    fluid_groups = [
        TrialGroup(f"group-{min(t.number for t in members)}", tuple(t.number for t in members),
                   (task.steps,) * len(members))
        for members in groups
    ]  # fmt: skip
    fn = functools.partial(_train_in_worker, task, params, ratio, seed, every, depth)
    on_report = lambda number, step, value: _report_and_ask(by_number[number], step, value, hook)  # noqa: E731
    for result in executor.run(fluid_groups, fn, report=on_report):
        outcomes, info = result.value if result.value is not None else ({}, None)
        for number in result.group.trial_ids:
            outcome = outcomes.get(number)
            if outcome is None:  # the worker never returned: the executor says why
                why = result.trials[number].reason or result.error or "the worker failed"
                outcome = Outcome("fail", None, 0, why)
            _tell(study, by_number[number], outcome, info)
            told.add(number)


def _train_in_worker(task, params, ratio, seed, every, depth, group, ctx):  # noqa: ANN001, ANN202
    """A group's training in a hydro_fluid worker; reports and prunes through ``ctx``, and
    checkpoints in ``ctx.checkpoint_dir`` (which survives a retry of the group)."""
    ids = list(group.trial_ids)

    def report(k: int, step: int, value: float) -> bool:
        ctx.report(ids[k], step, value)
        return ctx.is_pruned(ids[k])

    def pruned() -> set[int]:
        return {ids.index(t) for t in ctx.pruned if t in ids}

    outcomes, info = train_group(task, [params[i] for i in ids], ratio=ratio,
                                 seeds=[seed + i for i in ids], report=report,
                                 device=ctx.device, pruned=pruned,
                                 checkpoint=ctx.checkpoint_dir if ctx.rank == 0 else None,
                                 checkpoint_every=every, depth_ratio=depth[0],
                                 depth_alpha=depth[1])  # fmt: skip
    return dict(zip(ids, outcomes)), info


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


def _tell(
    study: optuna.Study, trial: optuna.Trial, outcome: Outcome, info: GroupInfo | None
) -> None:
    try:
        if info is not None:
            trial.set_user_attr("surrogate_widths", info.widths)
            if info.blocks:
                trial.set_user_attr("surrogate_blocks", info.blocks)
            trial.set_user_attr("group_seconds", round(info.seconds, 3))
            trial.set_user_attr("worker_pid", info.pid)
        if outcome.state == "complete" and outcome.value is not None \
                and math.isfinite(outcome.value):  # fmt: skip
            _tell_safely(study, trial, outcome.value)
        elif outcome.state == "pruned":
            _tell_safely(study, trial, state=TrialState.PRUNED)
        else:
            trial.set_user_attr("fail_reason", outcome.reason or "no finite value")
            _tell_safely(study, trial, state=TrialState.FAIL)
    except UpdateFinishedTrialError:
        pass  # failed as stale by another process meanwhile (and asked again there)


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


def _tell_safely(study: optuna.Study, trial: Any, *args: Any, **kwargs: Any) -> None:
    """``study.tell``, for a sampler that asks to stop when told (GridSampler, exhausted).

    Such a sampler calls ``study.stop()``, which Optuna allows only inside ``study.optimize``;
    the trial is already told by then, and the driver stops by itself once the sampler's space is
    exhausted, so the request is recorded instead of raised.
    """
    try:
        study.tell(trial, *args, **kwargs)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise
        study.set_user_attr("hydro_sampler_exhausted", True)


# -- sharing a study between processes -------------------------------------------------------
#
# Every trial this driver runs carries its owner (host, pid, process start time) and a heartbeat
# time refreshed by a thread. A RUNNING trial is stale when its owner is a dead process on this
# host, or, on another host, when its heartbeat is older than STALE_SECONDS. Stale trials are
# failed (one process wins that update; the storage refuses the others) and their parameters
# asked again, so live processes never lose trials to each other and dead ones lose none.

HEARTBEAT_SECONDS = 10.0
STALE_SECONDS = 60.0
_POLL_SECONDS = 0.5
_OWNER, _BEAT, _RETRY_OF = "hydro_owner", "hydro_heartbeat", "hydro_retry_of"
_SURPLUS = "surplus: other processes sharing the study had already asked n_trials trials"
_ACTIVE: set[int] = set()  # trial ids some optimize() call in this process is running
_ACTIVE_LOCK = threading.Lock()


def is_void(trial: FrozenTrial) -> bool:
    """Whether a finished row does not count as a trial: interrupted (and asked again) or a
    surplus ask of a shared study."""
    return trial.state == TrialState.FAIL and trial.user_attrs.get("fail_reason") in (
        _INTERRUPTED, _SURPLUS)  # fmt: skip


def _finished(study: optuna.Study) -> int:
    return _counts(study)[0]


def _counts(study: optuna.Study) -> tuple[int, int]:
    """(finished trials that count, RUNNING trials)."""
    finished = running = 0
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.RUNNING:
            running += 1
        elif t.state.is_finished() and not is_void(t):
            finished += 1
    return finished, running


def _me() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": start_ticks(os.getpid())}


def _owner_alive(t: FrozenTrial, now: float) -> bool:
    owner = t.user_attrs.get(_OWNER)
    if isinstance(owner, dict) and owner.get("host") == socket.gethostname():
        pid = owner.get("pid")
        if pid == os.getpid():
            with _ACTIVE_LOCK:
                return t._trial_id in _ACTIVE
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, TypeError, ValueError):
            pass
        started = owner.get("started")
        return started is None or start_ticks(int(pid)) in (None, started)
    beat = t.user_attrs.get(_BEAT)
    if beat is None:
        beat = t.datetime_start.timestamp() if t.datetime_start else now
    return now - float(beat) < STALE_SECONDS


def _reclaim_stale(study: optuna.Study) -> int:
    """Fail the RUNNING trials whose owner is gone and ask their parameters again."""
    now = time.time()
    n = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not _owner_alive(t, now):
            n += _fail(study, t._trial_id, t.number, t.params, _INTERRUPTED, requeue=True)
    return n


def _fail(study, trial_id, number, params, reason, *, requeue) -> bool:  # noqa: ANN001
    """Fail a RUNNING trial (True if this call did it: of racing processes one wins), and with
    ``requeue`` enqueue its parameters to be asked again."""
    storage = study._storage
    try:
        storage.set_trial_user_attr(trial_id, "fail_reason", reason)
        if not storage.set_trial_state_values(trial_id, TrialState.FAIL):
            return False
    except UpdateFinishedTrialError:
        return False
    if requeue and params:  # a trial killed before it was sampled has nothing to repeat
        study.enqueue_trial(dict(params), user_attrs={_RETRY_OF: number}, skip_if_exists=False)
    return True


def _ask(study, k, n_trials, seed, heart) -> list[optuna.Trial]:  # noqa: ANN001
    """Ask up to ``k`` trials, keeping only those within ``n_trials`` over the whole study.

    Trial numbers are handed out by the storage, so a trial is within budget when fewer than
    ``n_trials`` counting trials have a lower number, whichever process asked them.
    """
    asked = []
    for _ in range(k):
        # multivariate samplers draw when asked: seed by the number the trial will most likely get
        _seed_sampler(study.sampler, seed, len(study.get_trials(deepcopy=False)))
        t = study.ask()
        heart.own(t)
        below = sum(1 for u in study.get_trials(deepcopy=False)
                    if u.number < t.number and not is_void(u))  # fmt: skip
        if below >= n_trials:
            _fail(study, t._trial_id, t.number, {}, _SURPLUS, requeue=False)
            heart.release([t._trial_id])
            break
        asked.append(t)
    return asked


class _Heartbeat:
    """Marks the trials this process runs with their owner and refreshes their heartbeat."""

    def __init__(self, study: optuna.Study) -> None:
        self.study = study
        self.owned: set[int] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.me = _me()

    def __enter__(self) -> _Heartbeat:
        self.thread = threading.Thread(target=self._beat, name="hydro-heartbeat", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()
        self.release(list(self.owned))

    def own(self, trial: optuna.Trial) -> None:
        with _ACTIVE_LOCK:
            _ACTIVE.add(trial._trial_id)
        with self.lock:
            self.owned.add(trial._trial_id)
        storage = self.study._storage
        storage.set_trial_user_attr(trial._trial_id, _OWNER, self.me)
        storage.set_trial_user_attr(trial._trial_id, _BEAT, time.time())

    def release(self, ids: Any) -> None:
        ids = set(ids)
        with self.lock:
            self.owned -= ids
        with _ACTIVE_LOCK:
            _ACTIVE.difference_update(ids)

    def _beat(self) -> None:
        storage = self.study._storage
        native = is_heartbeat_enabled(storage)
        while not self.stop.wait(HEARTBEAT_SECONDS):
            with self.lock:
                ids = list(self.owned)
            for trial_id in ids:
                try:
                    storage.set_trial_user_attr(trial_id, _BEAT, time.time())
                    if native:  # a storage with Optuna's own heartbeat must not fail it either
                        storage.record_heartbeat(trial_id)
                except Exception:  # noqa: BLE001 - finished meanwhile, or a transient error
                    pass


def _seed_sampler(sampler: Any, seed: int, number: int) -> None:
    """Re-seed the random state of ``sampler`` (and of samplers inside it) from ``seed`` and a
    trial number.

    A seeded sampler built afresh by every run would draw the same start-up configurations each
    time a study resumes; seeding by trial number instead makes a resumed (or shared) study draw
    new ones, while the same sequence of commands still draws the same configurations.
    """
    value = (int(seed) * 1_000_003 + int(number)) % (2**32)
    seen: set[int] = set()

    def visit(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for attr in vars(obj).values():
            if isinstance(attr, LazyRandomState):
                attr.rng.seed(value)
            elif isinstance(attr, numpy.random.RandomState):
                attr.seed(value)
            elif isinstance(attr, BaseSampler):
                visit(attr)

    if isinstance(sampler, BaseSampler):
        visit(sampler)

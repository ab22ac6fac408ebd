"""The slot side of tuning: the loop of continuous batching, wherever a group trains.

:func:`train_slots` steps a fused group, evaluates the members that are due, and hands ended
trials to a *source* that tells them and fills the freed slots. The driver's own process is
one source (``hydro.tuning.engine``); an executor's worker is another (:class:`_Remote`, which
asks the driver through ``ctx.request``); a worker hosts one group per key (:class:`_Hosted`),
and checkpoints them so that a retried worker resumes them bit-identically.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from hydro.errors import HydroError, HydroWarning, UserCodeError
from hydro.tuning import parallel
from hydro.tuning.checkpoint import TrialCheckpoints, set_aside
from hydro.tuning.group import FusedGroup, GroupInfo, Outcome, group_key, load_model_state
from hydro.tuning.loop import make_group
from hydro.tuning.task import Task

__all__ = ["Occupancy", "Seat", "TrialSource", "play_round", "step_slots", "train_slots"]


@runtime_checkable
class TrialSource(Protocol):
    """Where a fused group's trials come from and where their results go: the slot loop's one
    interface (:func:`step_slots`). The tuner's own process is one source
    (:class:`hydro.tuning.stream._InProcess`), an executor's worker another (:class:`_Remote`,
    which asks the tuner through ``ctx.request``)."""

    @property
    def asking(self) -> bool:
        """Whether the study still has trials to ask."""

    def stepped(self, live: int) -> None:
        """Count one fused step that trained ``live`` members."""

    def report(self, items: list[tuple[int, int, float]]) -> set[int]:
        """Report every ``(trial, step, value)`` evaluated at one step; returns the trials the
        pruner prunes."""

    def eval_blocks(self, measured: int | None) -> int | None:
        """The blocks of the study's evaluation subsample (``eval_samples="auto"``), ``None``
        while unknown; ``measured`` (a group's measurement) is recorded if none is yet, and the
        recorded size is returned."""

    def refill(self, told: list, slots: list[int], key: tuple) -> list:
        """Tell the ended trials ``(trial, outcome, info)``; return, for each freed slot, the
        next ``(trial, params, seed)`` of ``key`` or ``None`` (the slot is dropped)."""


@dataclass
class Seat:
    """A group taking turns in a round (:func:`play_round`): the group, its trial source and
    when each of its members joined."""

    group: Any
    source: TrialSource
    joined: dict[int, float]


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

    def add(self, steps: int, live: int, asking: bool) -> None:
        """Count ``steps`` fused steps that trained ``live`` members each."""
        self.steps += steps
        self.live += steps * live
        if asking:
            self.steps_asking += steps
            self.live_asking += steps * live

    def counts(self) -> list[int]:
        return [self.steps, self.live, self.steps_asking, self.live_asking]

    def set_counts(self, counts: Sequence[int]) -> None:
        self.steps, self.live, self.steps_asking, self.live_asking = (int(c) for c in counts)

    def as_dict(self) -> dict[str, Any]:
        return {"fuse": self.fuse, "steps": self.steps, "live": self.live,
                "steps_asking": self.steps_asking, "live_asking": self.live_asking,
                "while_asking": self.fraction(True), "overall": self.fraction(False)}


def train_slots(group: FusedGroup, source: Any, *, fuse: int, joined: dict[int, float],
                after_step: Callable[[], None] | None = None,
                checkpoints: TrialCheckpoints | None = None, every: int = 0) -> None:
    """The loop of continuous batching, wherever the group trains (this process or a worker):
    :func:`step_slots` until the group has no member left, each member saved in
    ``checkpoints`` every ``every`` fused steps, ``after_step`` after each step that leaves
    members (a group checkpoint)."""
    while group.n:
        step_slots(group, source, fuse=fuse, joined=joined, checkpoints=checkpoints)
        save_trials(group, checkpoints, every)
        if after_step is not None and group.n:
            after_step()


def save_trials(group: FusedGroup, checkpoints: TrialCheckpoints | None, every: int) -> None:
    """Save each member that is part way through in ``checkpoints``, every ``every`` fused
    steps of ``group``."""
    if checkpoints is None or not every or group.steps % every:
        return
    for slot, m in enumerate(group.members):
        if 0 < m.step < group.task.steps:
            checkpoints.save(group.trial_state(slot))


def play_round(seats: dict[tuple, Seat], *, fuse: Callable[[tuple], int],
               checkpoints: TrialCheckpoints | None, every: int,
               fault: Callable[[tuple, BaseException], bool] | None = None) -> None:
    """One round of continuous batching, wherever groups train (the tuner's process or a
    worker): each seated group takes one turn (:func:`step_slots`), saves its trials every
    ``every`` fused steps, and leaves ``seats`` once it has no member. ``fault(key, exc)``
    handles an exception of a group's turn (``True``: handled, the group was unseated)."""
    for key, seat in list(seats.items()):
        try:
            step_slots(seat.group, seat.source, fuse=fuse(key), joined=seat.joined,
                       checkpoints=checkpoints)
        except Exception as exc:
            if fault is None or not fault(key, exc):
                raise
            continue
        save_trials(seat.group, checkpoints, every)
        if not seat.group.n:
            del seats[key]


def step_slots(group: FusedGroup, source: TrialSource, *, fuse: int, joined: dict[int, float],
               checkpoints: TrialCheckpoints | None = None) -> None:
    """One turn of continuous batching: one fused step of ``group``, the evaluations that are
    due, and each ended trial told and its slot refilled (or dropped; a trial that has a
    checkpoint in ``checkpoints`` resumes from it).

    ``source`` is where trials come from and results go: ``report(items)`` takes every
    ``(trial, step, value)`` evaluated at one step and returns the trials to prune;
    ``refill(told, slots, key)`` takes the ended trials ``(trial, outcome, info)`` and returns,
    for each freed slot, the next ``(trial, params, seed)`` or ``None`` (the slot is dropped);
    ``stepped(live)`` counts a fused step; ``asking`` says whether trials remain to ask.
    ``joined`` maps each member to when it joined (for its ``group_seconds``). With
    ``checkpoints`` and ``every``, every member is saved there every ``every`` fused steps,
    and a trial put in a freed slot resumes from its checkpoint (:func:`resume_slot`).
    """
    steps = group.task.steps
    group.step()  # no host read: on an accelerator the next step queues behind this one
    source.stepped(group.n)
    ended: dict[int, Outcome] = {}
    due = group.due()
    # Divergence flags are read with the evaluation values (on an accelerator, the one wait
    # for the device), even where reading is free: a slot then takes its next trial at an
    # evaluation step, so every slot's evaluations stay at the same fused steps and one
    # evaluation of the group serves them all.
    if due:
        for slot, at in group.diverged().items():
            ended[slot] = Outcome("fail", None, at, f"diverged at step {at}: non-finite "
                                  "loss or gradient", group.members[slot].history)
    due = [slot for slot in due if slot not in ended]
    if due:
        # a trial's last evaluation reads the whole validation split, the others may read a
        # fixed subsample of it (task.eval_samples)
        last = [slot for slot in due if group.members[slot].step >= steps]
        if getattr(group, "wants_eval_blocks", False):  # a Loop's group evaluates as it likes
            group.eval_blocks = source.eval_blocks(None)
        values = group.evaluate(full=last)
        if getattr(group, "measured", None) is not None:  # the study records one size: the first
            group.eval_blocks = source.eval_blocks(group.measured)
            if group.eval_blocks != group.measured:
                values = group.values_over(group.eval_blocks, last)
        values = [float(v) for v in values]
        finite = []
        for slot in due:
            m = group.members[slot]
            m.history.append((m.step, values[slot]))
            if math.isfinite(values[slot]):
                finite.append(slot)
            else:
                ended[slot] = Outcome("fail", None, m.step, "non-finite validation value",
                                      m.history)
        items = [(group.members[k].id, group.members[k].step, values[k]) for k in finite]
        pruned = source.report(items) if items else set()
        for slot in finite:
            m = group.members[slot]
            if m.id in pruned and m.step < steps:
                ended[slot] = Outcome("pruned", values[slot], m.step, "", m.history)
    for slot, m in enumerate(group.members):
        if slot not in ended and m.step >= steps:
            last = m.history[-1][1] if m.history else None
            ended[slot] = Outcome("complete", last, steps, "", m.history)
    if not ended:
        return
    slots = sorted(ended)
    now = time.perf_counter()
    told = []
    for slot in slots:  # every ended trial is told before new ones are asked
        number = group.members[slot].id
        info = GroupInfo(ratio=group.ratio, size=fuse, widths=group.widths,
                         depth_ratio=group.depth_ratio, depth_alpha=group.depth_alpha,
                         blocks=group.blocks, seconds=now - joined.pop(number, now))
        told.append((number, ended[slot], info))
    freed = []
    for slot, nxt in zip(slots, source.refill(told, slots, group.key)):
        if nxt is None:
            freed.append(slot)
            continue
        number, params, seed = nxt
        joined[number] = time.perf_counter()
        group.put(slot, number, params, seed)
        resume_slot(group, slot, checkpoints)
    if freed:
        group.drop(freed)


def _ask_driver(ctx: Any, payload: tuple, world_size: int | None = None) -> Any:
    """The driver's answer to ``payload``: rank 0 alone asks it, and every data parallel rank
    (of ``world_size``, default ``ctx.world_size``) gets that same answer at the same step, so
    the replicas change their group alike."""
    got = ctx.request(payload) if ctx.rank == 0 else None
    return parallel.share(got, ctx.rank, ctx.world_size if world_size is None else world_size)


def resume_slot(group: FusedGroup, slot: int, checkpoints: TrialCheckpoints | None) -> int:
    """Resume the trial in ``slot`` from its checkpoint, if it has one; returns its step (0:
    it starts afresh). A checkpoint that does not fit the trial's model is moved aside."""
    m = group.members[slot]
    state = checkpoints.load(m.id, m.seed, m.params) if checkpoints is not None else None
    if state is None:
        return 0
    try:  # a re-asked trial has its predecessor's file under its own number: it is its own now
        group.resume(slot, {**state, "id": m.id})
    except (HydroError, KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
        set_aside(checkpoints.path(m.id), f"does not fit trial {m.id}'s model ({exc})")
        group.put(slot, m.id, m.params, m.seed)
        return 0
    return group.members[slot].step


class _Remote:
    """The trial source of a worker's groups: the driver, through ``ctx.request`` on rank 0
    (see :func:`step_slots`, :func:`_ask_driver`). With ``any_key`` a freed slot takes the
    driver's next trial whatever its key: one of another key than the slot's group waits in
    ``waiting`` and joins its key's group in this worker at the next round (:class:`_Hosted`).
    """

    def __init__(self, ctx: Any, occupancy: Occupancy, cursor: int, asking: bool,
                 task: Any = None, any_key: bool = False) -> None:
        self.ctx, self.occupancy, self.cursor, self.asking = ctx, occupancy, cursor, asking
        self.world_size = ctx.world_size  # the replicas that train the group (_replicas)
        self.task, self.any_key = task, any_key
        self.waiting: list[tuple[int, dict, int]] = []  # other keys' trials, for the next round

    def stepped(self, live: int) -> None:
        """Nothing: :class:`_Hosted` counts occupancy per round, over all its groups."""

    def report(self, items: list[tuple[int, int, float]]) -> set[int]:
        got = _ask_driver(self.ctx, ("report", items, self.occupancy.counts()), self.world_size)
        self.asking = got["asking"]
        return set(got["pruned"])

    def eval_blocks(self, measured: int | None) -> int | None:
        got = _ask_driver(self.ctx, ("eval_blocks", measured, self.occupancy.counts()),
                          self.world_size)
        return got["blocks"]

    def refill(self, told: list, slots: list[int], key: tuple) -> list:
        wants = [(self.cursor + i, slot) for i, slot in enumerate(slots)]
        got = _ask_driver(self.ctx, ("refill", told, wants, self.any_key,
                                     self.occupancy.counts()), self.world_size)
        self.cursor += len(slots)
        self.asking = got["asking"]
        out = []
        for nxt in got["trials"]:
            if nxt is not None and group_key(nxt[1], self.task) != key:
                self.waiting.append(tuple(nxt))  # its key's group takes it next round
                nxt = None
            out.append(nxt)
        return out


class _Hosted:
    """The fused groups of one worker, at most one per key, taking turns: in a round each
    takes one fused step (:func:`step_slots`), after the trials waiting in ``source`` joined
    their key's group (grown with :meth:`FusedGroup.add`, or started reusing that key's
    capture). A freed slot's share of the worker goes to the driver's next trial, so the
    worker stays as full as its first group was."""

    def __init__(self, task: Any, options: Any, device: Any, fuse: int, source: _Remote,
                 checkpoints: TrialCheckpoints | None) -> None:
        self.task, self.options, self.device = task, options, device
        self.compile = options.compile  # "auto": each key's first group here decides (not said)
        self.every = options.checkpoint_every or 0
        self.fuse, self.source, self.checkpoints = fuse, source, checkpoints
        self.seats: dict[tuple, Seat] = {}
        self.built: dict[tuple, FusedGroup] = {}  # key -> its last group (for like=)
        self.rounds = 0

    @property
    def groups(self) -> dict[tuple, Any]:
        """Each key's live group."""
        return {key: seat.group for key, seat in self.seats.items()}

    @property
    def n(self) -> int:
        return sum(g.n for g in self.groups.values())

    def build(self, members: Sequence[tuple[int, dict, int]]) -> list[FusedGroup]:
        """Start one group per key of ``members`` (in order of first appearance)."""
        by_key: dict[tuple, list] = {}
        for m in members:
            by_key.setdefault(group_key(m[1], self.task), []).append(tuple(m))
        for key, ms in by_key.items():
            like = self.built.get(key)
            group = self.built[key] = make_group(
                self.task, ms, self.options, device=self.device, like=like,
                compile=like.compile if like is not None else self.compile,
                capacity=self.fuse)
            self.seats[key] = Seat(group, self.source, {m[0]: time.perf_counter() for m in ms})
        return [self.groups[k] for k in by_key]

    def admit(self) -> None:
        """The trials waiting in the source join their key's group, or start one."""
        waiting, self.source.waiting = self.source.waiting, []
        for number, params, seed in waiting:
            key = group_key(params, self.task)
            if key not in self.groups:
                (group,) = self.build([(number, params, seed)])
                resume_slot(group, 0, self.checkpoints)
                continue
            seat = self.seats[key]
            slot = seat.group.add(number, params, seed)
            resume_slot(seat.group, slot, self.checkpoints)
            seat.joined[number] = time.perf_counter()

    def fill(self, capacity: int) -> None:
        """Ask the driver for trials of any key while this worker has fewer than ``capacity``
        (its first group may have found few trials of its key): they wait for the round."""
        room = capacity - self.n - len(self.source.waiting)
        if self.source.any_key and self.source.asking and room > 0:
            self.source.refill([], list(range(self.n, self.n + room)), None)

    def round(self, capacity: int) -> None:
        """One round: the worker filled to ``capacity``, waiting trials join their key's
        group, then every group takes one fused step."""
        self.fill(capacity)
        self.admit()
        live, asking = self.n, self.source.asking
        play_round(self.seats, fuse=lambda key: self.fuse, checkpoints=self.checkpoints,
                   every=self.every)
        self.source.occupancy.add(1, live, asking)
        self.rounds += 1

    def state(self) -> dict[str, Any]:
        """The worker's checkpoint: each group's (:func:`_group_state`), the waiting trials,
        the random states, and how far the worker read its trial log."""
        from hydro.tuning import checkpoint as _checkpoint

        return {
            "groups": [_group_state(g) for g in self.groups.values()],
            "waiting": [list(w) for w in self.source.waiting],
            "rounds": self.rounds,
            "cursor": self.source.cursor,
            "asking": self.source.asking,
            "occupancy": self.source.occupancy.counts(),
            "rng": _checkpoint.rng_state(),
        }

    def restore(self, saved: dict[str, Any]) -> None:
        """Rebuild the groups of checkpoint ``saved`` in its state (random states included)."""
        from hydro.tuning import checkpoint as _checkpoint

        for g in saved["groups"]:
            (group,) = self.build([(int(m[0]), dict(m[1]), int(m[2])) for m in g["members"]])
            _restore_group(group, g)
        self.source.waiting = [(int(w[0]), dict(w[1]), int(w[2])) for w in saved["waiting"]]
        self.rounds = int(saved["rounds"])
        _checkpoint.set_rng_state(saved["rng"])


def _stream_in_worker(task, options, fuse, group, ctx, *, checkpoints=None,
                      study=""):
    """:func:`_train_in_worker`, where an exception the user's code raised (data, loss, metric)
    becomes a one-line :class:`~hydro.errors.UserCodeError`, which the executor does not retry
    (it would raise again) and whose message the driver gives the group's trials."""
    from hydro.tuning.faults import describe

    try:
        return _train_in_worker(task, options, fuse, group, ctx, checkpoints=checkpoints,
                                study=study)
    except Exception as exc:
        what = describe(exc, task)
        if what is None:
            raise
        raise UserCodeError(what) from None


def _train_in_worker(task, options, fuse, group, ctx, *, checkpoints=None,
                     study=""):
    """Fused groups with continuous batching in an executor's worker, at most one per key
    (:class:`_Hosted`). Its trials come from the driver; a freed slot takes the driver's next
    trial of any key (one data parallel group: of its own key). With ``every`` it
    checkpoints in ``ctx.checkpoint_dir`` (which survives a retry or a move) every ``every``
    rounds, and a restarted attempt resumes there. The checkpoint names ``study`` and the
    worker's first trials: one of another study or group (a ``checkpoint_dir`` shared by two
    studies) is moved aside, never resumed. Each member is also saved in the study's
    ``checkpoints``, and a member that has one there (re-asked after its tuner died) resumes
    from it. With ``ctx.world_size`` above 1 every rank runs this as one data parallel replica
    (:mod:`hydro.tuning.parallel`): rank 0 talks to the driver and saves, every rank applies
    the same answers."""
    from hydro.tuning import checkpoint as _checkpoint
    from hydro_fluid.executors.base import Stopped

    occupancy = Occupancy(fuse)
    got = _ask_driver(ctx, ("start",))
    first = [list(m) for m in got["members"]]
    saved = None
    if ctx.rank == 0:  # a checkpoint is there after a retry (with ``every``) or a move
        try:
            saved = _checkpoint.load(ctx.checkpoint_dir)
        except _checkpoint.CheckpointError as exc:  # truncated, or a planted pickle
            set_aside(Path(ctx.checkpoint_dir) / _checkpoint.FILE,
                      f"is unreadable ({_checkpoint.why(exc.__cause__ or exc)})")
        if saved is not None and (saved.get("study") != study or saved.get("first") != first
                                  or "groups" not in saved):
            set_aside(Path(ctx.checkpoint_dir) / _checkpoint.FILE,
                      f"belongs to another study or group than {group.name}")
            saved = None
    # data parallel: every rank resumes rank 0's checkpoint, whatever world size wrote it
    saved = parallel.share(saved, ctx.rank, ctx.world_size)
    if saved is not None:
        cursor, asking = int(saved["cursor"]), bool(saved["asking"])
        occupancy.set_counts(saved["occupancy"])
    else:
        cursor, asking = 1, got["asking"]
    # data parallel ranks step one group of one key alike; one process hosts every key
    source = _Remote(ctx, occupancy, cursor, asking, task, any_key=ctx.world_size == 1)
    hosted = _Hosted(task, options, ctx.device, fuse, source, checkpoints)
    # a group trained by your own function checkpoints its trials, not itself (its loop's
    # locals cannot be saved): a retried or moved worker resumes them from the study's files
    every = hosted.every if isinstance(task, Task) else 0
    if saved is not None:
        try:
            hosted.restore(saved)
        except Exception as exc:  # another model's state, keys missing
            from hydro.tuning.faults import describe

            if describe(exc, task) is not None:  # the user's data raised replaying its stream
                raise
            if ctx.rank == 0:  # every rank restored the same state and fails alike
                why = _checkpoint.why(exc)
                set_aside(Path(ctx.checkpoint_dir) / _checkpoint.FILE,
                          f"does not fit {group.name}'s model ({why})")
            saved = None
            occupancy = Occupancy(fuse)  # from step 0, as a first attempt
            source = _Remote(ctx, occupancy, 1, got["asking"], task, any_key=ctx.world_size == 1)
            hosted = _Hosted(task, options, ctx.device, fuse, source, checkpoints)
    if saved is None:
        for g in hosted.build([tuple(m) for m in got["members"]]):
            for slot in range(g.n):
                resume_slot(g, slot, checkpoints)
    if not hosted.n and not source.waiting:
        return {"occupancy": occupancy.counts()}
    # (a checkpoint taken as a key's group ended may hold only trials waiting for the next)
    world_size = min((_replicas(g, ctx) for g in hosted.groups.values()), default=1)
    if world_size == 0:  # an idle rank of a group that trains on rank 0 alone
        return {"occupancy": occupancy.counts()}
    source.world_size = world_size
    sign = 1.0 if task.direction == "minimize" else -1.0

    # a group that ended may leave trials of another key waiting: they start its next round
    while hosted.n or source.waiting:
        hosted.round(int(got.get("capacity", len(first))))
        if not hosted.n and not source.waiting:
            break
        # for the executor's placement policy: rounds, live members, best value so far (lower
        # is better); and a move it asks for: checkpoint here, resume where it puts us
        values = [sign * v for g in hosted.groups.values() for m in g.members
                  for _, v in m.history[-1:]]
        ctx.progress(hosted.rounds, hosted.n, min(values, default=None))
        stop = ctx.should_stop(agree=world_size == ctx.world_size)
        if stop and not isinstance(task, Task):  # your own loop: each trial saved alone
            for g in hosted.groups.values():
                save_trials(g, checkpoints, 1)
                g.close()
        elif ctx.rank == 0 and (stop or (every and hosted.rounds % every == 0)):
            _checkpoint.save(ctx.checkpoint_dir, {**hosted.state(), "study": study,
                                                  "first": first})
        if stop:
            raise Stopped
    return {"occupancy": occupancy.counts()}


def _replicas(group: FusedGroup, ctx: Any) -> int:
    """Make ``group`` this rank's data parallel replica; returns how many ranks train it. A
    group that would not train exactly when split (:meth:`FusedGroup.unsplittable`) trains on
    rank 0 alone, with a warning, rather than lose its trials; the other ranks get 0: idle."""
    why = group.unsplittable(ctx.world_size)
    if why is None:
        group.distribute(ctx.rank, ctx.world_size)
        return ctx.world_size
    warnings.warn(HydroWarning(f"group {ctx.group_name!r} trains on one process, not "
                               f"{ctx.world_size}: {why}"), stacklevel=2)
    return 1 if ctx.rank == 0 else 0


def _group_state(group: FusedGroup) -> dict[str, Any]:
    """A refilled group's checkpoint: each slot's trial, step and history, the fused model,
    optimizer and schedules."""
    return {
        "members": [
            [m.id, dict(m.params), m.seed, m.step, [list(h) for h in m.history]]
            for m in group.members
        ],
        "model": group.fused.state_dict(),
        "optimizer": group.opt.state_dict(),
        "scheduler": group.sched.state_dict(),
        "steps": [group.steps, group.live_steps],
        "data_seed": group.data_seed,  # shared data: the group's stream, read once per step
    }


def _restore_group(group: FusedGroup, saved: dict[str, Any]) -> None:
    """Put a group built from a checkpoint's members in that checkpoint's state."""
    for m, (_, _, _, step, history) in zip(group.members, saved["members"]):
        group.skip(int(step), m)  # each data stream continues where it stopped
        m.step = int(step)
        m.history[:] = [(int(s), float(v)) for s, v in history]
    load_model_state(group, saved["model"])
    group.opt.load_state_dict(saved["optimizer"])
    group.sched.load_state_dict(saved["scheduler"])
    group.steps, group.live_steps = (int(v) for v in saved["steps"])
    group.restart_data(int(saved.get("data_seed", group.data_seed)), group.steps)

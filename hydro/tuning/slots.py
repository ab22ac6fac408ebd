"""The slot side of tuning: the loop of continuous batching, wherever a group trains.

:func:`train_slots` steps a fused group, evaluates the members that are due, and hands ended
trials to a *source* that tells them and fills the freed slots. The driver's own process is
one source (``hydro.tuning.driver``); an executor's worker is another (:class:`_Remote`, which
asks the driver through ``ctx.request``), and checkpoints a refilled group so that a retried
worker resumes it bit-identically.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hydro.tuning.group import FusedGroup, GroupInfo, Outcome, load_model_state

__all__ = ["Occupancy", "step_slots", "train_slots"]


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
                "while_asking": self.fraction(True), "overall": self.fraction(False)}  # fmt: skip


def train_slots(group: FusedGroup, source: Any, *, fuse: int, joined: dict[int, float],
                after_step: Callable[[], None] | None = None) -> None:  # fmt: skip
    """The loop of continuous batching, wherever the group trains (this process or a worker):
    :func:`step_slots` until the group has no member left, ``after_step`` after each step
    that leaves members (a checkpoint)."""
    while group.n:
        step_slots(group, source, fuse=fuse, joined=joined)
        if after_step is not None and group.n:
            after_step()


def step_slots(group: FusedGroup, source: Any, *, fuse: int, joined: dict[int, float]) -> None:
    """One turn of continuous batching: one fused step of ``group``, the evaluations that are
    due, and each ended trial told and its slot refilled (or dropped).

    ``source`` is where trials come from and results go: ``report(items)`` takes every
    ``(trial, step, value)`` evaluated at one step and returns the trials to prune;
    ``refill(told, slots, key)`` takes the ended trials ``(trial, outcome, info)`` and returns,
    for each freed slot, the next ``(trial, params, seed)`` or ``None`` (the slot is dropped);
    ``stepped(live)`` counts a fused step; ``asking`` says whether trials remain to ask.
    ``joined`` maps each member to when it joined (for its ``group_seconds``).
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
                                  "loss or gradient", group.members[slot].history)  # fmt: skip
    due = [slot for slot in due if slot not in ended]
    if due:
        values = [float(v) for v in group.evaluate()]
        finite = []
        for slot in due:
            m = group.members[slot]
            m.history.append((m.step, values[slot]))
            if math.isfinite(values[slot]):
                finite.append(slot)
            else:
                ended[slot] = Outcome("fail", None, m.step, "non-finite validation value",
                                      m.history)  # fmt: skip
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
                         blocks=group.blocks, seconds=now - joined.pop(number, now))  # fmt: skip
        told.append((number, ended[slot], info))
    freed = []
    for slot, nxt in zip(slots, source.refill(told, slots, group.key)):
        if nxt is None:
            freed.append(slot)
            continue
        number, params, seed = nxt
        joined[number] = time.perf_counter()
        group.put(slot, number, params, seed)
    if freed:
        group.drop(freed)


class _Remote:
    """The trial source of a group in an executor's worker: the driver, through
    ``ctx.request`` (see :func:`train_slots`)."""

    def __init__(self, ctx: Any, occupancy: Occupancy, cursor: int, asking: bool) -> None:
        self.ctx, self.occupancy, self.cursor, self.asking = ctx, occupancy, cursor, asking

    def stepped(self, live: int) -> None:
        self.occupancy.add(1, live, self.asking)

    def report(self, items: list[tuple[int, int, float]]) -> set[int]:
        got = self.ctx.request(("report", items, self.occupancy.counts()))
        self.asking = got["asking"]
        return set(got["pruned"])

    def refill(self, told: list, slots: list[int], key: tuple) -> list:
        wants = [(self.cursor + i, slot) for i, slot in enumerate(slots)]
        got = self.ctx.request(("refill", told, wants, self.occupancy.counts()))
        self.cursor += len(slots)
        self.asking = got["asking"]
        return got["trials"]


def _stream_in_worker(task, ratio, fuse, depth, every, group, ctx):  # noqa: ANN001, ANN202
    """A fused group with continuous batching in an executor's worker. Its trials come from
    the driver; with ``every`` it checkpoints in ``ctx.checkpoint_dir`` (which survives a
    retry) every ``every`` steps, and a retried worker resumes there."""
    from hydro.tuning import checkpoint as _checkpoint

    occupancy = Occupancy(fuse)
    saved = _checkpoint.load(ctx.checkpoint_dir) if every and ctx.rank == 0 else None
    if saved is not None:
        members = [(int(m[0]), dict(m[1]), int(m[2])) for m in saved["members"]]
        cursor, asking = int(saved["cursor"]), bool(saved["asking"])
        occupancy.set_counts(saved["occupancy"])
    else:
        got = ctx.request(("start",))
        members, cursor, asking = [tuple(m) for m in got["members"]], 1, got["asking"]
    if not members:
        return {"occupancy": occupancy.counts()}
    fgroup = FusedGroup(task, members, ratio=ratio, device=ctx.device, depth_ratio=depth[0],
                        depth_alpha=depth[1])  # fmt: skip
    if saved is not None:
        _restore_slots(fgroup, saved)
    source = _Remote(ctx, occupancy, cursor, asking)
    joined = {m.id: time.perf_counter() for m in fgroup.members}

    def save() -> None:
        if every and fgroup.steps % every == 0:
            _checkpoint.save(ctx.checkpoint_dir, _slots_state(fgroup, source))

    train_slots(fgroup, source, fuse=fuse, joined=joined, after_step=save)
    return {"occupancy": occupancy.counts()}


def _slots_state(group: FusedGroup, source: _Remote) -> dict[str, Any]:
    """A refilled group's checkpoint: each slot's trial, step and history, the fused model,
    optimizer and schedules, the random states, and how far the group read its trial log."""
    from hydro.tuning import checkpoint as _checkpoint

    return {
        "members": [
            [m.id, dict(m.params), m.seed, m.step, [list(h) for h in m.history]]
            for m in group.members
        ],  # fmt: skip
        "model": group.fused.state_dict(),
        "optimizer": group.opt.state_dict(),
        "scheduler": group.sched.state_dict(),
        "steps": [group.steps, group.live_steps],
        "cursor": source.cursor,
        "asking": source.asking,
        "occupancy": source.occupancy.counts(),
        "rng": _checkpoint.rng_state(),
    }


def _restore_slots(group: FusedGroup, saved: dict[str, Any]) -> None:
    """Put a group built from a checkpoint's members in that checkpoint's state."""
    from hydro.tuning import checkpoint as _checkpoint

    for m, (_, _, _, step, history) in zip(group.members, saved["members"]):
        for _ in range(int(step)):  # each data stream continues where it stopped
            next(m.batches)
        m.step = int(step)
        m.history[:] = [(int(s), float(v)) for s, v in history]
    load_model_state(group, saved["model"])
    group.opt.load_state_dict(saved["optimizer"])
    group.sched.load_state_dict(saved["scheduler"])
    group.steps, group.live_steps = (int(v) for v in saved["steps"])
    _checkpoint.set_rng_state(saved["rng"])

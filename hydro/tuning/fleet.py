"""Continuous batching on an executor: groups streamed to its workers, placed by its policy.

:class:`_Fleet` hands ``executor.run`` a new group whenever a device has room, answers its
workers' requests (first members, reports for the pruner, refills of any key) and keeps a log
of what each group was given, so a retried or moved worker is given the same trials again.
The study and its storage stay in this process.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import optuna

from hydro.errors import HydroWarning
from hydro.tuning import checkpoint as _checkpoint
from hydro.tuning.bookkeeping import (
    report_and_ask,
)
from hydro.tuning.group import Outcome, group_key
from hydro.tuning.sizing import MAX_FUSE
from hydro.tuning.slots import (
    _stream_in_worker,
)
from hydro.tuning.stream import _Stream
from hydro_fluid.executors.protocol import PlacingExecutor

__all__: list[str] = []


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

    def __init__(self, task: Any, space: Any, options: Any, where: Any) -> None:
        super().__init__(task, space, options, where)
        self.executor = options.executor
        self.policy, self.deadline = options.policy, options.deadline
        self.world_size = options.world_size
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
        # the worker reads the run's options (those that pickle: Options.for_worker)
        fn = functools.partial(_stream_in_worker, self.task, self.options.for_worker(), fuse,
                               checkpoints=self.checkpoints,
                               study=_checkpoint.study_id(self.study))
        placement = {}
        if self.world_size == 1 and isinstance(self.executor, PlacingExecutor):
            # the policy decides each group's devices (data parallel when it widens one); a
            # fixed world_size above 1 keeps the executor's own first-come pool
            placement = {"policy": self.policy, "deadline": self.deadline}
        # a worker captures its group's model with torch.export: an import of seconds, paid
        # once in the forkserver instead of in every worker
        self._guard(lambda: self.executor.run([], fn, more=self.more, on_result=self.ended,
                                              request=self.answer, world_size=self.sizes,
                                              preload=["torch.export._trace"],
                                              **placement))
        self.faults.check(end=True)

    def more(self, room: float = 1.0) -> list:
        """A new group for a free device: ``room`` is the fraction of a device free for it
        (a device whose group thinned out has less than 1), so it gets that share of ``fuse``
        members; trials of a key waiting for a group of their own come first."""
        from hydro_fluid.groups import TrialGroup

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
        self.phase(f"starting {len(self.logs)} worker{'s' if len(self.logs) > 1 else ''}")
        # with fuse="auto" the placement policy packs by the memory the sizing measured
        return [TrialGroup(name, tuple(t.number for t, _ in members),
                           (self.task.steps,) * len(members),
                           memory_per_trial=self.key_memory.get(key, 0.0))]

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
            ), stacklevel=2)
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
            self.phase("workers up: capturing the model and training to the first evaluation")
            if name not in self.logs:
                self._split(name)
            return {
                "members": self.logs[name][0],
                "asking": self.asking,
                "capacity": self.capacity.get(name, len(self.logs[name][0])),
            }
        self._count(name, payload[-1])
        if kind == "eval_blocks":
            return {"blocks": self.eval_blocks(payload[1])}
        if kind == "report":
            pruned = []
            for number, step, value in payload[1]:
                t = self.running.get(number)  # told already: a retried group replaying it
                if t is None or report_and_ask(t, step, value, self.hook):
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
                                for slot, n in enumerate(numbers)]]

    def _count(self, name: str, counts: Sequence[int] | None) -> None:
        if counts is None:
            return
        self.counts[name] = list(counts)
        total = [sum(c[i] for c in self.counts.values()) for i in range(4)]
        self.occupancy.set_counts([b + t for b, t in zip(self.base, total)])
        if self.bar is not None:
            self.bar.occupancy = self.occupancy.fraction(asking=False)

    def ended(self, result: Any) -> None:
        """A group's worker ended: the trials it still had fail, with the executor's reason
        (one line); where user code raised (not retried), each trial's names it and the
        group, and the run stops once every trial failed that way (:meth:`worker_fault`)."""
        name = result.group.name
        if isinstance(result.value, dict):
            self._count(name, result.value.get("occupancy"))
        mine = [n for n, owner in self.owner.items() if owner == name and n in self.running]
        if getattr(result, "deterministic", False) and result.error:
            self.worker_fault(name, result.error, mine)
            return
        reason = result.error or "its group's worker ended without a result for it"
        reason = (reason.strip().splitlines() or [""])[0][:500]  # never a traceback
        for number in mine:
            self.tell(self.running[number], Outcome("fail", None, 0, reason), None)

    def worker_fault(self, name: str, what: str, numbers: list[int]) -> None:
        """User code raised ``what`` in the worker of group ``name``: its trials ``numbers``
        fail, each with a reason naming it and its fused group (by the exception's class
        name, a type the run catches never stops it)."""
        caught = self.faults.caught(what)
        first = ""
        for number in sorted(numbers):
            gid = self.group_of.get(number, self.gids.get(name))
            reason = f"trial {number} (group {gid}): {what}"
            first = first or reason
            self.tell(self.running[number], Outcome("fail", None, 0, reason), None,
                      fault=not caught)
        if caught:
            return
        self.faults.failed(what, first or f"{name}: {what}", self.keys.get(name))
        self.faults.check(training=(self.trial_key[n] for n in self.running if n in self.trial_key))

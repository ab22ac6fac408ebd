"""The bridge between the allocation policies and a running executor.

An executor keeps one :class:`Placer`. It tells it what happens (a group waits, starts, ends,
reports progress) and asks it, at every event, where the groups should run now
(:meth:`Placer.decide`) and whether a device has room for one more group
(:meth:`Placer.room`). The placer turns what the workers measured into the
:class:`~hydro_fluid.TrialGroup` inputs of the policies (cost per step, utilization,
memory, remaining budgets, score), calls the policy, and returns its
:data:`~hydro_fluid.Allocation`. Applying it (starting, packing, widening, moving workers)
is the executor's part; nothing here knows about processes, so the Ray executor can use the
same placer.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .groups import TrialGroup
from .policies import PlacementState, Policy, check_policy, make_policy
from .policy import Allocation, Slot
from .resources import Device

# check_policy lives with the registry; imported from here before it did
__all__ = ["Placer", "check_policy", "memory_per_trial"]

_EPS = 1e-9


def memory_per_trial(group: TrialGroup, measured: float | None) -> float:
    """GiB one member of ``group`` needs on a device, for the policies' memory checks.

    The caller's figure when it gave one (``TrialGroup.memory_per_trial``: the fusion sizing
    from measured memory), else the peak the group's worker measured on its GPU divided by
    its members, else 0 (on the CPU the memory budget does not bind for surrogates).
    """
    if group.memory_per_trial > 0:
        return group.memory_per_trial
    if measured is not None:
        return measured / group.size
    return 0.0


@dataclass
class _Measured:
    """What the workers of one group reported: how far it is and what a step costs."""

    steps: int = 0
    live: int | None = None
    seconds_per_step: float | None = None  # wall seconds of one fused step where it ran
    utilization: float | None = None  # CPU busy fraction of the threads it was given
    score: float | None = None
    memory: float | None = None  # peak GiB on its device


class Placer:
    """Asks a placement policy where groups run, fed with what the executor measured.

    Args:
        policy: A registered policy's name (:func:`~hydro_fluid.policy_names`) or a
            :class:`~hydro_fluid.Policy`: ``"fifo"`` (one group per idle device, in arrival
            order: the baseline), ``"static"`` (StaticFluid over the idle devices: shares by
            work, packing, data parallel), ``"dynamic"`` (DynamicFluid over every device at
            every event, moving running groups when it pays), ``"deadline"``
            (HyperSched-like: as the deadline nears, the best-ranked groups get whole
            devices), or any other registered one.
        devices: The executor's devices.
        c: Most groups packed on one device.
        d: Most devices for one data-parallel group.
        deadline: Seconds from the start to the deadline (only for a policy that uses one).
        restart_cost: Seconds a move costs (checkpoint, restart, warm-up): a running group
            moves only if the policy estimates it saves more.
        clock: Seconds, monotonic (a test may pass its own).

    Example:
        >>> from hydro_fluid import Device, TrialGroup
        >>> from hydro_fluid.placement import Placer
        >>> placer = Placer("dynamic", [Device("cpu0", "cpu"), Device("cpu1", "cpu")], d=2)
        >>> placer.wait(TrialGroup("g", (0, 1), (100, 100)))
        >>> placer.decide()
        {'g': (('cpu0', 1.0), ('cpu1', 1.0))}
    """

    def __init__(
        self,
        policy: str | Policy,
        devices: Sequence[Device],
        *,
        c: int = 4,
        d: int = 8,
        deadline: float | None = None,
        restart_cost: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_policy(policy, deadline)
        if not devices:
            raise ValueError("a Placer needs at least one device")
        self.rule = make_policy(policy)
        self.policy, self.devices, self.c, self.d = self.rule.name, list(devices), c, d
        self.restart_cost, self.clock = restart_cost, clock
        self.start = clock()
        self.end = None if deadline is None else self.start + deadline
        self.groups: dict[str, TrialGroup] = {}  # every group not ended, as submitted
        self.waiting: list[str] = []  # in arrival order
        self.running: dict[str, tuple[Slot, ...]] = {}
        self.measured: dict[str, _Measured] = {}
        # While a stream still brings groups, a device that empties takes the next one: a group
        # is widened over several devices (data parallel, with its cost of exchanging
        # gradients) only once none is coming, so the study's tail does not leave devices idle.
        self.widen = True

    # -- what happens -----------------------------------------------------------------------

    def wait(self, group: TrialGroup) -> None:
        """``group`` waits for devices (new, or stopped to move)."""
        self.groups.setdefault(group.name, group)
        self.measured.setdefault(group.name, _Measured())
        self.running.pop(group.name, None)
        if group.name not in self.waiting:
            self.waiting.append(group.name)

    def set_devices(self, devices: Sequence[Device]) -> None:
        """Devices joined or left (an event: call :meth:`decide` next). Running groups on a
        device that left are moved by a policy that re-plans running groups (``dynamic``,
        ``deadline``); an ``idle_only`` one (``fifo``, ``static``) leaves them to the
        executor, which restarts them when their worker dies."""
        if not devices:
            raise ValueError("a Placer needs at least one device")
        self.devices = list(devices)

    def started(self, name: str, slots: tuple[Slot, ...]) -> None:
        """``name`` runs on ``slots`` now."""
        if name in self.waiting:
            self.waiting.remove(name)
        self.running[name] = tuple(slots)

    def ended(self, name: str) -> None:
        """``name`` finished, failed or was split: forget it."""
        for table in (self.groups, self.running, self.measured):
            table.pop(name, None)
        if name in self.waiting:
            self.waiting.remove(name)

    def observe(self, name: str, steps: int, live: int, seconds_per_step: float,
                utilization: float, score: float | None = None,
                memory: float | None = None) -> bool:
        """Record a worker's progress; ``True`` when the group thinned out (a placement event)."""
        seen = self.measured.get(name)
        if seen is None:
            return False
        thinned = seen.live is not None and live < seen.live
        seen.steps, seen.live = steps, live
        seen.seconds_per_step, seen.utilization = seconds_per_step, utilization
        seen.score = score if score is not None else seen.score
        seen.memory = memory if memory is not None else seen.memory
        return thinned

    # -- what to do -------------------------------------------------------------------------

    def view(self, name: str) -> TrialGroup:
        """The group as the policy sees it: remaining budgets of its live members, and the
        cost per step, utilization and memory its workers measured."""
        group, seen = self.groups[name], self.measured[name]
        live = group.size if seen.live is None else max(1, min(seen.live, group.size))
        budgets = [max(1.0, b - seen.steps) for b in group.budgets[:live]]
        cost = seen.seconds_per_step / live if seen.seconds_per_step else self._typical_cost()
        util = group.utilization if seen.utilization is None else seen.utilization
        return replace(
            group.remaining(budgets),
            cost_per_step=max(cost, _EPS),
            utilization=min(1.0, max(0.05, util)),
            memory_per_trial=memory_per_trial(group, seen.memory),
            score=seen.score,
        )

    def _typical_cost(self) -> float:
        """Cost per member-step of a group not measured yet: the median of those measured."""
        costs = [
            m.seconds_per_step / max(1, m.live or 1)
            for m in self.measured.values()
            if m.seconds_per_step
        ]
        return statistics.median(costs) if costs else 1.0

    def _fill(self, name: str) -> float:
        """Fraction of its fused width a running group still uses (1 until measured)."""
        seen, size = self.measured[name], self.groups[name].size
        return 1.0 if seen.live is None else min(1.0, seen.live / size)

    def _effective(self) -> dict[str, tuple[Slot, ...]]:
        """Running groups with their shares scaled by how full they still are: a group whose
        members were pruned or finished (and that gets no new ones) leaves room on its device
        (at least ``1/c`` stays taken).

        Measured utilization is not used here: on a shared CPU a worker's busy fraction falls
        with contention, which would pack more where there is less room; a GPU's own
        utilization is not measured yet.
        """
        out = {}
        for name, slots in self.running.items():
            fill = self._fill(name)
            if len(slots) == 1 and fill < 1:
                (dev, share), = slots
                slots = ((dev, max(share * fill, 1 / self.c)),)
            out[name] = slots
        return out

    def decide(self) -> Allocation:
        """Where every group should run now: running groups (kept, rescaled or moved) and the
        waiting groups the policy places. Groups missing from the answer wait (a running
        one missing from it is to be stopped)."""
        groups = [self.view(n) for n in self.running] + [self.view(n) for n in self.waiting]
        state = PlacementState(groups, self.devices, self._effective(), c=self.c,
                               d=self.d if self.widen else 1, now=self.clock(),
                               start=self.start, end=self.end,
                               restart_cost=self.restart_cost)
        return self.rule.allocate(state)

    def room(self) -> float:
        """The largest free fraction of one device where another group could start (0: none).

        An ``idle_only`` policy (``fifo``, ``static``) starts groups on idle devices only
        (1.0 or 0.0). The others also pack a group on a device whose groups thinned out,
        sized for what they left.
        """
        load = {dev.name: 0.0 for dev in self.devices}
        count = dict.fromkeys(load, 0)
        for slots in self._effective().values():
            for dev, share in slots:
                if dev in load:
                    load[dev] += share
                    count[dev] += 1
        if self.rule.idle_only:
            return 1.0 if any(n == 0 for n in count.values()) else 0.0
        free = [1 - load[d] for d in load if count[d] < self.c]
        best = max(free, default=0.0)
        return best if best >= 1 / self.c - _EPS else 0.0

    def tick_due(self, last: float) -> bool:
        """Whether a deadline tick is due (with a deadline: every 1/20 of the time to it)."""
        if self.end is None:
            return False
        return self.clock() - last >= max(0.5, (self.end - self.start) / 20)

    def seconds_left(self) -> float | None:
        """Seconds to the deadline (``None`` without one)."""
        return None if self.end is None else self.end - self.clock()

    def threads(self, share: float, per_device: int) -> int:
        """CPU threads of a worker given ``share`` of a device with ``per_device`` threads."""
        return max(1, math.floor(share * per_device + _EPS))

"""Allocation policies: which trial group runs on which devices, and with what share.

Every policy returns an :data:`Allocation`: for each placed group, the slots it occupies as
``(device name, share of that device)``. A share below 1 means the group is packed on the
device with others; several slots of share 1 mean a data-parallel group over whole devices.
Groups missing from the allocation wait.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, islice
from typing import TYPE_CHECKING

from .groups import INTERFERENCE, TrialGroup
from .resources import Device

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Allocation", "fifo", "static_fluid", "dynamic_fluid", "deadline"]

Slot = tuple[str, float]
Allocation = dict[str, tuple[Slot, ...]]

_EPS = 1e-9


def fifo(groups: Sequence[TrialGroup], idle_devices: Sequence[Device]) -> Allocation:
    """The baseline: one group per idle device, in arrival order, no packing or scaling.

    Example:
        >>> from hydro_fluid import Cluster, TrialGroup, fifo
        >>> groups = [TrialGroup(f"g{i}", (i,), (100,)) for i in range(3)]
        >>> fifo(groups, Cluster.homogeneous(1, 2).devices)
        {'g0': (('node0/gpu0', 1.0),), 'g1': (('node0/gpu1', 1.0),)}
    """
    _check_groups(groups, idle_devices)
    allocation: Allocation = {}
    free = list(idle_devices)
    for group in groups:
        fits = [d for d in free if d.memory >= group.memory]
        if not fits:
            continue
        free.remove(fits[0])
        allocation[group.name] = ((fits[0].name, 1.0),)
    return allocation


def static_fluid(
    groups: Sequence[TrialGroup], idle_devices: Sequence[Device], c: int = 4, d: int = 8
) -> Allocation:
    """Fluid's StaticFluid: share idle devices in proportion to each group's budget.

    Each group's share of the ``idle_devices`` is proportional to its work (budget times cost
    per step), bounded below by ``1/c`` of a device and above by ``d`` devices. Shares of
    one or more become whole devices (data parallel, preferring one node); smaller shares
    become ``1/k`` of a device (``k <= c``) and are packed, respecting device memory. When
    there are more groups than ``c`` per device, the later ones wait.

    Args:
        groups: Groups to place, in priority (arrival) order.
        idle_devices: Devices with nothing running on them.
        c: Most groups packed on one device.
        d: Most devices for one data-parallel group.

    Example:
        >>> from hydro_fluid import Cluster, TrialGroup, static_fluid
        >>> long = TrialGroup("long", (0,), (900,))
        >>> short = [TrialGroup(f"s{i}", (i + 1,), (100,)) for i in range(4)]
        >>> alloc = static_fluid([long, *short], Cluster.homogeneous(1, 4).devices, c=4, d=8)
        >>> len(alloc["long"]), alloc["s0"][0][1]
        (2, 0.5)
    """
    _check_groups(groups, idle_devices)
    _check_bounds(c, d)
    bins = _Capacity(idle_devices, c)
    return _allocate(list(groups), bins, c, d, [g.work for g in groups])


def dynamic_fluid(
    groups: Sequence[TrialGroup],
    devices: Sequence[Device],
    c: int = 4,
    d: int = 8,
    *,
    running: Mapping[str, tuple[Slot, ...]] | None = None,
    restart_cost: float = 30.0,
) -> Allocation:
    """Fluid's DynamicFluid: recompute the allocation on every event, move groups only if it pays.

    Call it whenever a group finishes, members are pruned (pass the shrunken groups), or a
    device joins or leaves. It computes the StaticFluid allocation of all unfinished
    ``groups`` over all ``devices``; a running group is rescaled or moved only if the
    estimated time it saves exceeds ``restart_cost`` (checkpoint, restart, warm-up);
    otherwise it keeps its slots and the others are placed around it. Groups on a device
    that left must move.

    Args:
        groups: Every unfinished group that may run now (running or waiting), with its
            remaining budgets.
        devices: Every device present now.
        c: Most groups packed on one device.
        d: Most devices for one data-parallel group.
        running: The current allocation of the running groups.
        restart_cost: Seconds lost when a running group changes its slots.

    Example:
        >>> from hydro_fluid import Cluster, TrialGroup, dynamic_fluid
        >>> devices = Cluster.homogeneous(1, 4).devices
        >>> g = TrialGroup("g", (0,), (10_000,), cost_per_step=1.0)
        >>> now = {"g": (("node0/gpu0", 1.0),)}
        >>> len(dynamic_fluid([g], devices, running=now)["g"])  # worth scaling out
        4
        >>> tiny = TrialGroup("g", (0,), (10,), cost_per_step=1.0)
        >>> dynamic_fluid([tiny], devices, running=now)["g"]  # not worth a restart
        (('node0/gpu0', 1.0),)
    """
    _check_groups(groups, devices)
    _check_bounds(c, d)
    running = running or {}
    weights = [g.work for g in groups]
    target = _allocate(list(groups), _Capacity(devices, c), c, d, weights, prefer=running)
    return _rebalance(groups, devices, c, d, running, restart_cost, target)


def deadline(
    groups: Sequence[TrialGroup],
    devices: Sequence[Device],
    c: int = 4,
    d: int = 8,
    *,
    now: float,
    end: float,
    start: float = 0.0,
    running: Mapping[str, tuple[Slot, ...]] | None = None,
    restart_cost: float = 30.0,
) -> Allocation:
    """Deadline mode in the spirit of HyperSched: train the best configuration furthest by ``end``.

    Early on it behaves like :func:`dynamic_fluid` (explore). As the clock moves from
    ``start`` to ``end`` a growing fraction of the devices is reserved for the groups ranked
    best so far (lowest ``score``): each gets the fewest whole devices (at most ``d``) that
    finish it by the deadline, or ``d`` if none do. The other groups share what is left.

    Args:
        groups: Every unfinished group that may run now, with remaining budgets and scores.
        devices: Every device present now.
        c: Most groups packed on one device.
        d: Most devices for one data-parallel group.
        now: The current time.
        end: The deadline, on the same clock as ``now``.
        start: When the study started.
        running: The current allocation of the running groups.
        restart_cost: Seconds lost when a running group changes its slots.

    Example:
        >>> from hydro_fluid import Cluster, TrialGroup, deadline
        >>> devices = Cluster.homogeneous(1, 8).devices
        >>> groups = [TrialGroup(f"g{i}", (i,), (1000,), score=float(i)) for i in range(4)]
        >>> alloc = deadline(groups, devices, c=4, d=8, now=900.0, end=1000.0)
        >>> len(alloc["g0"]) > len(alloc.get("g3", ()))
        True
    """
    _check_groups(groups, devices)
    _check_bounds(c, d)
    if not end > start:
        raise ValueError(f"The deadline end={end} must be after start={start}.")
    bins = _Capacity(devices, c)
    exploit = min(1.0, max(0.0, (now - start) / (end - start))) * len(devices)
    time_left = max(end - now, _EPS)
    ranked = sorted((g for g in groups if g.score is not None), key=lambda g: g.score)
    running = running or {}
    reserved: Allocation = {}
    for group in ranked:
        if exploit < 1:
            break
        need = next((w for w in range(1, d + 1) if group.seconds(w) <= time_left), d)
        slots = _place_whole(group, min(need, int(exploit)), bins, running.get(group.name, ()))
        if not slots:
            break
        reserved[group.name] = slots
        exploit -= len(slots)
    rest = [g for g in groups if g.name not in reserved]
    target = {**reserved, **_allocate(rest, bins, c, d, [g.work for g in rest])}
    return _rebalance(groups, devices, c, d, running, restart_cost, target, reserved)


# --- shared machinery ---------------------------------------------------------------------


@dataclass
class _Bin:
    """Free capacity left on one device while an allocation is being built."""

    device: Device
    free: float  # share of the device not yet given out
    slots: int  # groups that may still be packed on it
    memory: float  # GiB not yet given out
    device_c: int  # most groups on this device (the policy's c)


class _Capacity(dict):
    """Device name -> :class:`_Bin`, with an index of idle devices per node.

    The index lets data-parallel groups find whole devices on one node without scanning
    every device, which keeps planning for 1,000 devices well under a second.
    """

    def __init__(self, devices: Sequence[Device], c: int) -> None:
        super().__init__((dev.name, _Bin(dev, 1.0, c, dev.memory, c)) for dev in devices)
        self._idle: dict[str, dict[str, _Bin]] | None = None
        # Smallest device memory per node: a group that fits it fits any idle device there.
        self.node_memory: dict[str, float] = {}
        for dev in devices:
            self.node_memory[dev.node] = min(self.node_memory.get(dev.node, dev.memory), dev.memory)

    def used(self, b: _Bin) -> None:
        """Note that ``b`` is no longer idle (call after changing ``b.free``)."""
        if self._idle is not None and b.free < 1 - _EPS:
            node = self._idle.get(b.device.node)
            if node is not None and node.pop(b.device.name, None) is not None and not node:
                del self._idle[b.device.node]

    def idle_by_node(self) -> dict[str, dict[str, _Bin]]:
        if self._idle is None:
            self._idle = {}
            for name, b in self.items():
                if b.free >= 1 - _EPS:
                    self._idle.setdefault(b.device.node, {})[name] = b
        return self._idle


def _allocate(
    groups: list[TrialGroup],
    bins: _Capacity,
    c: int,
    d: int,
    weights: list[float],
    prefer: Mapping[str, tuple[Slot, ...]] | None = None,
) -> Allocation:
    """StaticFluid on whatever capacity ``bins`` has left; takes the capacity it gives out.

    ``prefer`` maps running groups to their current slots, which they keep where possible.
    """
    import numpy as np  # here: the policy registry (and so `hydro --help`) loads this module

    prefer = prefer or {}
    capacity = sum(b.free for b in bins.values())
    admitted = groups[: int(c * capacity + _EPS)]
    if not admitted:
        return {}
    shares = _water_fill(np.asarray(weights[: len(admitted)], float), capacity, 1 / c, d)

    allocation: Allocation = {}
    packed: list[tuple[float, TrialGroup]] = []
    # Data-parallel groups first, biggest first, so they find whole devices on one node.
    order = np.argsort(-shares, kind="stable")
    for i in order:
        group, share = admitted[i], float(shares[i])
        if share >= 1 - _EPS:
            slots = _place_whole(group, int(share + _EPS), bins, prefer.get(group.name, ()))
            if slots:
                allocation[group.name] = slots
                continue
            share = 1.0
        packed.append((1 / min(c, math.ceil(1 / share - _EPS)), group))

    allocation.update(_pack(packed, bins))
    _hand_out_idle(allocation, admitted, bins, d)
    return allocation


def _water_fill(weights: np.ndarray, capacity: float, low: float, high: float) -> np.ndarray:
    """Shares proportional to ``weights``, clipped to [low, high], summing to ``capacity``."""
    import numpy as np

    n = len(weights)
    if n * high <= capacity:
        return np.full(n, float(high))
    if n * low >= capacity:
        return np.full(n, float(low))
    weights = np.maximum(weights, _EPS)
    # sum(clip(scale * w)) grows with scale, so bisect on the scale in log space.
    lo, hi = math.log(low / weights.max()), math.log(high / weights.min())
    for _ in range(60):
        mid = (lo + hi) / 2
        if np.clip(math.exp(mid) * weights, low, high).sum() > capacity:
            hi = mid
        else:
            lo = mid
    return np.clip(math.exp(lo) * weights, low, high)


def _place_whole(
    group: TrialGroup, k: int, bins: _Capacity, prefer: Sequence[Slot] = ()
) -> tuple[Slot, ...]:
    """Take up to ``k`` whole idle devices for ``group``, on as few nodes as possible.

    Devices in ``prefer`` (where the group runs now) are taken first, to avoid a restart.
    """
    need = group.memory
    kept = []
    for name, _ in prefer:
        b = bins.get(name)
        if len(kept) < k and b is not None and b.free >= 1 - _EPS and b.memory >= need:
            b.free, b.slots, b.memory = 0.0, 0, b.memory - need
            bins.used(b)
            kept.append((name, 1.0))
    k -= len(kept)
    idle = bins.idle_by_node()
    if not idle or k < 1:
        return tuple(kept)
    pools = []
    for node, members in idle.items():
        if bins.node_memory[node] < need:  # only then is filtering by memory needed
            members = {name: b for name, b in members.items() if b.memory >= need}
        if members:
            pools.append(members)
    k = min(k, sum(len(p) for p in pools))
    if k < 1:
        return tuple(kept)
    # One node that fits the whole group, the tightest such; else spill over the fullest.
    fitting = [p for p in pools if len(p) >= k]
    if fitting:
        chosen = list(islice(min(fitting, key=len).values(), k))
    else:
        pools.sort(key=len, reverse=True)
        chosen = list(islice(chain.from_iterable(p.values() for p in pools), k))
    for b in chosen:
        b.free, b.slots, b.memory = 0.0, 0, b.memory - need
        bins.used(b)
    return tuple(kept) + tuple((b.device.name, 1.0) for b in chosen)


def _pack(packed: list[tuple[float, TrialGroup]], bins: _Capacity) -> Allocation:
    """Pack fractional shares, largest first, each on the device with the most room left."""
    heap = [(-b.free, -b.slots, name) for name, b in bins.items() if b.free > _EPS and b.slots]
    heapq.heapify(heap)
    allocation: Allocation = {}
    for share, group in sorted(packed, key=lambda p: -p[0]):
        skipped = []
        while heap:
            _, _, name = heapq.heappop(heap)
            b = bins[name]
            if b.memory >= group.memory:
                break
            skipped.append((-b.free, -b.slots, name))
        else:
            b = None
        for item in skipped:
            heapq.heappush(heap, item)
        if b is None:
            continue  # no device has the memory left: the group waits
        if b.free < 1 / b.device_c - _EPS:
            heapq.heappush(heap, (-b.free, -b.slots, name))
            continue  # even the roomiest device has less than 1/c left: the group waits
        # The roomiest device may have less than the share asked for: take what it has,
        # rounded down to 1/k of a device.
        share = min(share, 1 / math.ceil(1 / b.free - _EPS))
        b.free -= share
        b.slots -= 1
        b.memory -= group.memory
        bins.used(b)
        allocation[group.name] = ((name, share),)
        if b.free > _EPS and b.slots:
            heapq.heappush(heap, (-b.free, -b.slots, name))
    _top_up(allocation, bins)
    return allocation


def _top_up(allocation: Allocation, bins: _Capacity) -> None:
    """Grow the shares just packed so that no device keeps an unused sliver.

    Shares are rounded down to 1/k when packed, which would leave part of a device unused.
    """
    used: dict[str, float] = {}
    for slots in allocation.values():
        name, share = slots[0]
        used[name] = used.get(name, 0.0) + share
    for group_name, slots in allocation.items():
        name, share = slots[0]
        b = bins[name]
        allocation[group_name] = ((name, share * (used[name] + b.free) / used[name]),)
    for name in used:
        bins[name].free = 0.0


def _hand_out_idle(
    allocation: Allocation, admitted: list[TrialGroup], bins: _Capacity, d: int
) -> None:
    """Give devices left idle by rounding to the data-parallel groups that gain the most."""
    idle = sum(len(v) for v in bins.idle_by_node().values())
    whole = [g for g in admitted if g.name in allocation and allocation[g.name][0][1] >= 1 - _EPS]
    if not idle or not whole:
        return
    # Decide the counts first (most seconds saved by one more device first), then place.
    count = {g.name: len(allocation[g.name]) for g in whole}
    heap = [
        (g.seconds(count[g.name] + 1) - g.seconds(count[g.name]), i)
        for i, g in enumerate(whole)
        if count[g.name] < d
    ]
    heapq.heapify(heap)
    while idle and heap:
        _, i = heapq.heappop(heap)
        group = whole[i]
        count[group.name] += 1
        idle -= 1
        if count[group.name] < d:
            n = count[group.name]
            heapq.heappush(heap, (group.seconds(n + 1) - group.seconds(n), i))
    for group in whole:
        extra = count[group.name] - len(allocation[group.name])
        if extra:
            allocation[group.name] += _place_whole(group, extra, bins)


def _estimate_seconds(
    group: TrialGroup, slots: Sequence[Slot], speeds: Mapping[str, float]
) -> float:
    """Estimated seconds for ``group`` to finish on ``slots`` (used to judge a move)."""
    if not slots:
        return math.inf
    speed = min(speeds.get(name, 1.0) for name, _ in slots)
    if len(slots) > 1 or slots[0][1] >= 1 - _EPS:
        return group.seconds(len(slots), speed)
    share = slots[0][1]
    # Co-tenants are assumed to be alike, so a 1/k share means k groups of this kind.
    k = round(1 / share)
    slowdown = max(1.0, group.utilization * k) * (1 + INTERFERENCE * (k - 1))
    return group.seconds(1, speed, slowdown)


def _rebalance(
    groups: Sequence[TrialGroup],
    devices: Sequence[Device],
    c: int,
    d: int,
    running: Mapping[str, tuple[Slot, ...]],
    restart_cost: float,
    target: Allocation,
    reserved: Allocation | None = None,
) -> Allocation:
    """Keep running groups where they are unless moving to ``target`` saves > restart_cost.

    Groups in ``reserved`` get their target slots regardless, and nobody else is kept on
    those devices.
    """
    by_name = {g.name: g for g in groups}
    speeds = {dev.name: dev.speed for dev in devices}
    kept: Allocation = dict(reserved or {})
    taken = {dev for slots in kept.values() for dev, _ in slots}
    for name, slots in running.items():
        group = by_name.get(name)
        if name in kept or group is None or any(dev not in speeds for dev, _ in slots):
            continue  # reserved, finished, or its device left: placed afresh
        if any(dev in taken for dev, _ in slots):
            continue
        new = target.get(name, ())
        if tuple(slots) == tuple(new):
            kept[name] = tuple(slots)
            continue
        gain = _estimate_seconds(group, slots, speeds) - _estimate_seconds(group, new, speeds)
        if gain <= restart_cost:
            kept[name] = tuple(slots)
    if all(target.get(n) == s for n, s in kept.items()):
        return dict(target)  # nothing pinned away from the target: it is consistent

    bins = _Capacity(devices, c)
    for name, slots in kept.items():
        for dev, share in slots:
            b = bins[dev]
            b.free -= share
            b.slots -= 1
            b.memory -= by_name[name].memory
    rest = [g for g in groups if g.name not in kept]
    allocation = _allocate(rest, bins, c, d, [g.work for g in rest])
    allocation.update(kept)
    return allocation


# --- input checks -------------------------------------------------------------------------


def _check_bounds(c: int, d: int) -> None:
    if not (isinstance(c, int) and c >= 1):
        raise ValueError(f"c (most groups packed on one device) must be an int >= 1, got {c!r}.")
    if not (isinstance(d, int) and d >= 1):
        raise ValueError(f"d (most devices for one group) must be an int >= 1, got {d!r}.")


def _check_groups(groups: Sequence[TrialGroup], devices: Sequence[Device]) -> None:
    names: set[str] = set()
    for g in groups:
        if not isinstance(g, TrialGroup):
            raise ValueError(f"Expected TrialGroup objects, got {type(g).__name__}: {g!r}.")
        if g.name in names:
            raise ValueError(f"Group name {g.name!r} appears twice; group names must be unique.")
        names.add(g.name)
    if devices and groups:
        biggest = max(dev.memory for dev in devices)
        for g in groups:
            if g.memory > biggest:
                raise ValueError(
                    f"Group {g.name!r} needs {g.memory:.1f} GiB but the largest device has "
                    f"{biggest:.1f} GiB; split it (TrialGroup.split) or lower the fusion size."
                )

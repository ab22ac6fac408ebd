"""Event-driven simulator: run a workload of trial groups through a policy on a cluster.

The speed model (the same one the policies use for their estimates):

* A group alone on one device of speed ``s`` takes ``cost_per_step * active_members / s``
  seconds per fused step; members leave when they reach their budget.
* On ``w`` whole devices it is faster by :meth:`TrialGroup.speedup` (sublinear: the part of
  a step that is not compute does not split, and gradient exchange grows with ``w``),
  paced by the slowest of its devices.
* Groups packed on one device run at full speed while their utilizations add up to at most
  one, and share the device beyond that, with a small interference cost per co-tenant
  (:func:`hydro_fluid.groups.packed_slowdown`).
* A group placed for the first time makes no progress for its measured ``startup`` seconds
  (:attr:`TrialGroup.startup`: its worker starting), and a running group whose slots change
  keeps its progress (checkpointed) but makes none for ``restart_cost`` seconds. Both are
  latency, not device work: while a group waits on them it holds its slots but takes no
  compute, so the groups packed with it run as if it were not there.
* A device that leaves evicts its groups, which then wait to be placed again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from hydro.errors import ConfigError

from .groups import TrialGroup, packed_slowdown
from .policies import PlacementState, Policy, make_policy
from .policy import Allocation
from .resources import Cluster, Device

__all__ = ["simulate", "SimResult", "Segment", "lower_bound", "check_allocation"]

PolicyFn = Callable[[float, list[TrialGroup], list[Device], Allocation], Allocation]

_TOL = 1e-9


@dataclass(frozen=True)
class Segment:
    """``group`` occupied ``share`` of ``device`` from ``start`` to ``end`` seconds."""

    group: str
    device: str
    start: float
    end: float
    share: float


@dataclass
class SimResult:
    """What a simulated run did.

    Attributes:
        policy: Name of the policy.
        makespan: Seconds until the last trial finished.
        trial_finish: Finish time of every trial.
        group_finish: Finish time of every group.
        utilization: ``(time, fraction)`` steps: the fraction of the cluster's compute doing
            useful work from ``time`` until the next entry.
        segments: Which group ran on which device when (for the Gantt chart).
        devices: Every device name seen, in order of appearance.
    """

    policy: str
    makespan: float
    trial_finish: dict[Hashable, float]
    group_finish: dict[str, float]
    utilization: list[tuple[float, float]]
    segments: list[Segment]
    devices: list[str] = field(default_factory=list)

    @property
    def mean_utilization(self) -> float:
        """Time-averaged utilization over the makespan."""
        if self.makespan <= 0:
            return 0.0
        total = 0.0
        ends = [t for t, _ in self.utilization[1:]] + [self.makespan]
        for (t0, u), t1 in zip(self.utilization, ends, strict=True):
            total += u * (t1 - t0)
        return total / self.makespan

    def plot_gantt(self, path: str | None = None, *, max_devices: int = 32, title: str = ""):
        """Draw devices (rows) against time, one colour per group; save to ``path`` if given.

        Returns the matplotlib ``Figure``. Only the first ``max_devices`` devices are drawn,
        plus the cluster utilization over time underneath.
        """
        import matplotlib

        if path is not None:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        shown = self.devices[:max_devices]
        row = {name: i for i, name in enumerate(shown)}
        fig, (ax, ax_util) = plt.subplots(
            2,
            1,
            figsize=(10, 1.2 + 0.28 * len(shown) + 1.6),
            sharex=True,
            gridspec_kw={"height_ratios": [max(len(shown), 4), 3]},
        )
        cmap = plt.get_cmap("tab20")
        colour = {g: cmap(i % 20) for i, g in enumerate(self.group_finish)}
        # Packed groups split the row height by their share, stacked in arrival order.
        filled: dict[tuple[str, float], float] = {}
        for seg in self.segments:
            if seg.device not in row:
                continue
            base = filled.get((seg.device, seg.start), 0.0)
            filled[(seg.device, seg.start)] = base + seg.share
            ax.broken_barh(
                [(seg.start, seg.end - seg.start)],
                (row[seg.device] - 0.4 + 0.8 * base, 0.8 * seg.share),
                facecolors=colour.get(seg.group, "grey"),
                edgecolor="white",
                linewidth=0.3,
            )
        ax.set_yticks(range(len(shown)))
        ax.set_yticklabels(shown, fontsize=7)
        ax.invert_yaxis()
        ax.set_ylabel("device")
        ax.set_title(title or f"{self.policy}: makespan {self.makespan:,.0f} s")
        times = [t for t, _ in self.utilization] + [self.makespan]
        values = [u for _, u in self.utilization] + [0.0]
        ax_util.step(times, values, where="post", color="black", linewidth=1)
        ax_util.set_ylim(0, 1.05)
        ax_util.set_ylabel("utilization")
        ax_util.set_xlabel("time (s)")
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=110)
        return fig


def simulate(
    workload: Sequence[TrialGroup],
    cluster: Cluster,
    policy: str | Policy | PolicyFn = "dynamic",
    *,
    c: int = 4,
    d: int = 8,
    restart_cost: float = 30.0,
    end: float | None = None,
    tick: float | None = None,
) -> SimResult:
    """Simulate ``workload`` on ``cluster`` under ``policy`` until every trial has finished.

    Args:
        workload: The groups; a group starts only after the groups named in its ``after``.
        cluster: Devices, including devices that join or leave over time.
        policy: A registered policy's name (:func:`~hydro_fluid.policy_names`: ``"fifo"``,
            ``"static"``, ``"dynamic"``, ``"deadline"``, ...; ``"static_fluid"`` and
            ``"dynamic_fluid"`` are aliases), a :class:`~hydro_fluid.Policy`, or a function
            ``(now, ready_groups, devices, running) -> Allocation``.
        c: Most groups packed on one device.
        d: Most devices for one data-parallel group.
        restart_cost: Seconds a running group loses when its slots change.
        end: The deadline, for a policy that uses one (``"deadline"``).
        tick: Also re-plan every ``tick`` seconds, not only on events (default: never,
            except ``end / 20`` for the deadline policy, whose plan changes with the clock).

    Example:
        >>> from hydro_fluid import Cluster, TrialGroup, simulate
        >>> work = [TrialGroup(f"g{i}", (i,), (100 * (i + 1),), utilization=0.5)
        ...         for i in range(8)]
        >>> cluster = Cluster.homogeneous(1, 4)
        >>> fifo_run = simulate(work, cluster, "fifo")
        >>> fluid_run = simulate(work, cluster, "dynamic")
        >>> fluid_run.makespan < fifo_run.makespan
        True
    """
    groups = list(workload)
    by_name = {g.name: g for g in groups}
    if len(by_name) != len(groups):
        raise ValueError("Group names in the workload must be unique.")
    for g in groups:
        for dep in g.after:
            if dep not in by_name:
                raise ValueError(
                    f"Group {g.name!r} waits for {dep!r}, which is not in the workload."
                )
    if callable(policy) and not isinstance(policy, Policy):
        decide, name = policy, getattr(policy, "__name__", "custom")
    else:
        rule = make_policy(policy)
        decide, name = _decide(rule, c, d, restart_cost, end), policy
        if isinstance(policy, Policy):
            name = rule.name
        if tick is None and rule.uses_deadline:
            tick = end / 20  # its plan changes with the clock, not only at events
    if tick is not None and not tick > 0:
        raise ValueError(f"tick must be > 0 seconds, got {tick}.")
    return _Simulation(groups, cluster, decide, c, d, restart_cost, str(name), tick).run()


def lower_bound(workload: Sequence[TrialGroup], cluster: Cluster, d: int = 8) -> float:
    """A makespan no policy can beat under the simulator's speed model.

    The larger of (a) the work at perfect packing (only the compute part of each step,
    no interference) over the largest capacity the cluster ever has, and (b) the longest
    chain of dependent groups, each on ``d`` of the fastest devices.

    Example:
        >>> from hydro_fluid import Cluster, TrialGroup
        >>> from hydro_fluid.simulate import lower_bound
        >>> lower_bound([TrialGroup("g", (0,), (100,))], Cluster.homogeneous(1, 1))
        100.0
    """
    times = [0.0] + [e.time for e in cluster.events]
    capacity = max(sum(dev.speed for dev in cluster.devices_at(t)) for t in times)
    fastest = max([dev.speed for dev in cluster.devices] + [e.device.speed for e in cluster.events])
    by_name = {g.name: g for g in workload}
    total = sum(g.work * g.utilization for g in workload) / capacity
    longest: dict[str, float] = {}

    def chain(name: str, seen: tuple[str, ...] = ()) -> float:
        if name in seen:
            cycle = " -> ".join(seen + (name,))
            raise ValueError(f"Groups wait on each other in a cycle: {cycle}.")
        if name not in longest:
            g = by_name[name]
            before = max((chain(dep, seen + (name,)) for dep in g.after), default=0.0)
            longest[name] = before + g.seconds(min(d, 10**9), fastest)
        return longest[name]

    return max(total, max(chain(g.name) for g in workload))


def check_allocation(
    allocation: Mapping[str, Sequence[tuple[str, float]]],
    devices: Sequence[Device],
    groups: Sequence[TrialGroup],
    c: int,
    d: int,
) -> None:
    """Raise ``RuntimeError`` if ``allocation`` over-commits a device or breaks the bounds.

    Checks: known groups and devices, no device shared beyond 100% or by more than ``c``
    groups or beyond its memory, no group on more than ``d`` devices or below ``1/c``.
    """
    by_dev = {dev.name: dev for dev in devices}
    by_group = {g.name: g for g in groups}
    load: dict[str, list[float]] = {}
    for name, slots in allocation.items():
        if name not in by_group:
            raise RuntimeError(f"Allocation places {name!r}, which is not a ready group.")
        if not 1 <= len(slots) <= d:
            raise RuntimeError(f"Group {name!r} got {len(slots)} devices; allowed 1 to d={d}.")
        if len(slots) > 1 and any(share < 1 - _TOL for _, share in slots):
            raise RuntimeError(f"Data-parallel group {name!r} must have whole devices: {slots}.")
        for dev, share in slots:
            if dev not in by_dev:
                raise RuntimeError(f"Group {name!r} is placed on unknown device {dev!r}.")
            if share < 1 / c - _TOL:
                raise RuntimeError(f"Group {name!r} got {share:.3f} of {dev}, below 1/c.")
            entry = load.setdefault(dev, [0.0, 0, 0.0])
            entry[0] += share
            entry[1] += 1
            entry[2] += by_group[name].memory
    for dev, (share, count, memory) in load.items():
        if share > 1 + 1e-6 or count > c or memory > by_dev[dev].memory + 1e-6:
            raise RuntimeError(
                f"Device {dev!r} over-committed: share {share:.3f}, {count} groups (c={c}), "
                f"{memory:.1f} of {by_dev[dev].memory:.1f} GiB."
            )


def _decide(rule: Policy, c: int, d: int, restart_cost: float, end: float | None) -> PolicyFn:
    """``rule`` as the simulator calls a policy: ``(now, ready, devices, running)``."""
    if rule.uses_deadline and end is None:
        raise ConfigError(f"policy={rule.name!r} needs end=<deadline in seconds>.")

    def decide(now: float, ready: list[TrialGroup], devices: list[Device],
               running: Allocation) -> Allocation:
        return rule.allocate(PlacementState(ready, devices, running, c=c, d=d, now=now,
                                            start=0.0, end=end,
                                            restart_cost=restart_cost))

    return decide


class _Simulation:
    """Mutable state of one simulated run; ``run`` advances it event by event."""

    def __init__(self, groups, cluster: Cluster, decide, c: int, d: int, restart_cost, name, tick):
        self.groups: dict[str, TrialGroup] = {g.name: g for g in groups}
        self.left: dict[str, list[float]] = {g.name: [float(b) for b in g.budgets] for g in groups}
        self.waits_on = {g.name: set(g.after) for g in groups}
        self.cluster, self.decide, self.restart_cost = cluster, decide, restart_cost
        self.c, self.d, self.tick = c, d, tick
        self.result = SimResult(name, 0.0, {}, {}, [], [])
        self.devices: dict[str, Device] = {}
        self.running: Allocation = {}
        self.since: dict[str, float] = {}
        self.paused_until: dict[str, float] = {}
        self.started: set[str] = set()
        self.views: dict[str, TrialGroup] = {}  # remaining-budget views, dropped on progress
        self.now = 0.0

    def run(self) -> SimResult:
        events = list(self.cluster.events)
        for dev in self.cluster.devices:
            self._add_device(dev)
        for name, left in self.left.items():
            if max(left) <= 0:  # nothing to train
                self._finish_group(name)
        while len(self.result.group_finish) < len(self.groups):
            while events and events[0].time <= self.now + _TOL:
                self._apply(events.pop(0))
            self._schedule()
            step, finishing = self._rates()
            horizon = events[0].time - self.now if events else math.inf
            if self.tick and step:
                horizon = min(
                    horizon, self.tick * (math.floor(self.now / self.tick + _TOL) + 1) - self.now
                )
            # A restart ending changes the utilization, so it is an event too.
            resumes = [
                t - self.now
                for name, t in self.paused_until.items()
                if name in self.running and t > self.now + _TOL
            ]
            dt = min([horizon] + list(finishing.values()) + resumes)
            if math.isinf(dt):
                stuck = sorted(set(self.groups) - set(self.result.group_finish))[:5]
                raise RuntimeError(
                    f"Simulation stuck at t={self.now:.1f}: groups {stuck} can never run "
                    "(no device fits them, or they wait on each other)."
                )
            self._record_utilization(step)
            self._advance(dt, step)
        self.result.makespan = max(self.result.group_finish.values(), default=0.0)
        return self.result

    # -- cluster and scheduling ----------------------------------------------------------

    def _add_device(self, dev: Device) -> None:
        self.devices[dev.name] = dev
        if dev.name not in self.result.devices:
            self.result.devices.append(dev.name)

    def _apply(self, event) -> None:
        if event.kind == "join":
            self._add_device(event.device)
            return
        self.devices.pop(event.device.name, None)
        for name, slots in list(self.running.items()):
            if any(dev == event.device.name for dev, _ in slots):
                self._stop(name)

    def _ready(self) -> list[TrialGroup]:
        """Unfinished groups whose dependencies are done, with their remaining budgets."""
        ready = []
        for name, g in self.groups.items():
            if name in self.result.group_finish or self.waits_on[name]:
                continue
            if name not in self.views:  # only groups that progressed need a fresh view
                left = [steps if steps > _TOL else 0.0 for steps in self.left[name]]
                self.views[name] = g.remaining(left)
            ready.append(self.views[name])
        return ready

    def _schedule(self) -> None:
        ready = self._ready()
        devices = list(self.devices.values())
        new = self.decide(self.now, ready, devices, dict(self.running))
        check_allocation(new, devices, ready, self.c, self.d)
        for name in list(self.running):
            if new.get(name) != self.running[name]:
                self._stop(name)
        for name, slots in new.items():
            if name not in self.running:
                self.running[name] = tuple(slots)
                self.since[name] = self.now
                # a first start waits for its worker; a move resumes from its checkpoint
                delay = self.restart_cost if name in self.started else self.groups[name].startup
                if delay > 0:
                    self.paused_until[name] = self.now + delay
                self.started.add(name)

    def _stop(self, name: str) -> None:
        for dev, share in self.running.pop(name):
            if self.now > self.since[name]:
                self.result.segments.append(Segment(name, dev, self.since[name], self.now, share))

    # -- progress ------------------------------------------------------------------------

    def _rates(self) -> tuple[dict[str, float], dict[str, float]]:
        """Seconds per fused step of every running group, and time until its next finish."""
        on_device: dict[str, list[str]] = {}
        for name, slots in self.running.items():
            if self.paused_until.get(name, 0.0) > self.now + _TOL:
                continue  # starting or restarting: it holds its slots but computes nothing
            for dev, _ in slots:
                on_device.setdefault(dev, []).append(name)
        slowdown = {
            dev: packed_slowdown([self.groups[n].utilization for n in names])
            for dev, names in on_device.items()
        }
        step, finishing = {}, {}
        for name, slots in self.running.items():
            g = self.groups[name]
            active = sum(1 for steps in self.left[name] if steps > _TOL)
            speed = min(self.devices[dev].speed for dev, _ in slots)
            worst = max(slowdown.get(dev, 1.0) for dev, _ in slots)
            step[name] = g.cost_per_step * active * worst / (speed * g.speedup(len(slots)))
            first = min(steps for steps in self.left[name] if steps > _TOL)
            pause = max(0.0, self.paused_until.get(name, 0.0) - self.now)
            finishing[name] = pause + first * step[name]
        return step, finishing

    def _record_utilization(self, step: dict[str, float]) -> None:
        capacity = sum(dev.speed for dev in self.devices.values())
        useful = 0.0
        for name, seconds in step.items():
            if self.paused_until.get(name, 0.0) > self.now + _TOL:
                continue
            g = self.groups[name]
            active = sum(1 for steps in self.left[name] if steps > _TOL)
            # Device-seconds of compute delivered per second, in speed-1.0 units.
            useful += g.cost_per_step * active * g.utilization / seconds
        fraction = min(1.0, useful / capacity) if capacity else 0.0
        series = self.result.utilization
        if series and series[-1][0] == self.now:
            series[-1] = (self.now, fraction)
        elif not series or series[-1][1] != fraction:
            series.append((self.now, fraction))

    def _advance(self, dt: float, step: dict[str, float]) -> None:
        end = self.now + dt
        for name, seconds in step.items():
            busy = end - max(self.now, self.paused_until.get(name, 0.0))
            if busy <= 0:
                continue
            done = busy / seconds
            self.views.pop(name, None)
            left = self.left[name]
            for i, steps in enumerate(left):
                if steps > _TOL:
                    left[i] = steps - done if steps - done > 1e-7 * max(1.0, steps) else 0.0
        self.now = end
        for name in list(self.running):
            g, left = self.groups[name], self.left[name]
            for trial, steps in zip(g.trial_ids, left, strict=True):
                if steps <= _TOL and trial not in self.result.trial_finish:
                    self.result.trial_finish[trial] = self.now
            if max(left) <= _TOL:
                self._stop(name)
                self._finish_group(name)

    def _finish_group(self, name: str) -> None:
        self.result.group_finish[name] = self.now
        for trial in self.groups[name].trial_ids:
            self.result.trial_finish.setdefault(trial, self.now)
        for waiting in self.waits_on.values():
            waiting.discard(name)

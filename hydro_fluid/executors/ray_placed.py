"""RayExecutor's event loop when a placement policy decides where groups run."""

from __future__ import annotations

import time
from typing import Any

from ..groups import TrialGroup
from ..placement import Placer
from ..resources import Device
from .local import Decision, PlacementEvents
from .ray_run import _RayAttempt, _RayRun


class _PlacedRayRun(PlacementEvents, _RayRun):
    """The event loop when a placement policy decides where groups run on the cluster.

    As :class:`~hydro_fluid.executors.local._PlacedRun`: every event (a group starts, ends or
    thins out, a deadline tick, a node joining or leaving) asks the
    :class:`~hydro_fluid.placement.Placer` and applies its allocation. Each rank is a Ray
    task pinned to its device's node, asking for the device's share (``num_gpus``, or
    ``num_cpus`` of the slot's ``cpus_per_worker``); a group whose devices change is told to
    stop through the hub and comes back through the ledger as a move.
    """

    placer: Placer

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.attempts: dict[str, int] = {}  # waiting group -> its attempt number
        self.waiting: dict[str, TrialGroup] = {}
        self.event: str | None = "start"
        self.t0 = self.last_tick = self.last_look = time.monotonic()
        self.nodes: dict[str, list[str]] = {}  # running attempt -> its ranks' nodes
        # Nodes whose tasks died with NodeDiedError: Ray marks such a node dead only after
        # missing heartbeats for a while, and a group placed there meanwhile would wait for it.
        self.lost: set[str] = set()
        self.ex.decisions = []  # type: ignore[attr-defined]
        self.ex.measured = {}  # type: ignore[attr-defined]

    def loop(self) -> None:
        tick = 0.01 if self.request is not None else 0.1
        while True:
            self._look_at_devices()
            if not self._turn():
                return
            if self.rank_of:
                self.ray.wait(list(self.rank_of), num_returns=1, timeout=tick)
            else:
                time.sleep(tick)
            self._deliver_reports()
            ready, _ = self.ray.wait(list(self.rank_of), num_returns=len(self.rank_of), timeout=0)
            for ref in ready:
                if ref in self.rank_of:
                    self._finished(ref)
            if self.placer.tick_due(self.last_tick):
                self.last_tick = time.monotonic()
                self.event = self.event or "tick"

    def _look_at_devices(self) -> None:
        """Re-read the cluster's devices (every 0.5 s): a node joining or leaving is an event."""
        if time.monotonic() - self.last_look < 0.5:
            return
        self.last_look = time.monotonic()
        devices = [d for d in self.ex.placement_devices() if d.node not in self.lost]
        if devices and [d.name for d in devices] != [d.name for d in self.placer.devices]:
            self.placer.set_devices(devices)
            self.event = "devices"  # says more than a group ending at the same time

    def _decide(self, event: str) -> None:
        self.event = None
        plan = self.placer.decide()
        self.ex.decisions.append(Decision(time.monotonic() - self.t0, event, plan))
        for key, run in self.running.items():
            now, new = self.placer.running.get(run.group.name, ()), plan.get(run.group.name, ())
            if run.stopping or sorted(d for d, _ in now) == sorted(d for d, _ in new):
                continue  # same devices: no restart; it keeps the share it was started with
            run.stopping = True  # moved, rescaled or preempted: stop after a checkpoint
            self.hub.stop.remote(key)
        where = {d.name: d for d in self.placer.devices}
        for name in [n for n in self.waiting if n in plan]:
            group, slots = self.waiting.pop(name), plan[name]
            self.placer.started(name, slots)
            self._start(
                group, self.attempts.pop(name), [self._options(where[d], s) for d, s in slots]
            )
            self.nodes[next(reversed(self.running))] = [where[d].node for d, _ in slots]
            record = self.ex.measured.setdefault(name, {"start": time.monotonic() - self.t0})
            record["slots"] = slots

    def _options(self, device: Device, share: float) -> dict[str, Any]:
        """Ray options of one rank given ``share`` of ``device``: pinned to its node."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cpus = self.ex.cpus_per_worker
        return {
            "num_cpus": cpus * share,
            "num_gpus": share if device.kind == "gpu" else 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(device.node, soft=False),
            "threads": self.placer.threads(share, cpus),
        }

    def _finished(self, ref: Any) -> None:
        key, rank = self.rank_of[ref]
        try:
            self.ray.get(ref, timeout=0)
        except self.ray.exceptions.NodeDiedError:
            if key in self.nodes:  # that node is gone, whatever Ray's node table says yet
                self.lost.add(self.nodes[key][rank])
                self.last_look = 0.0
        except self.ray.exceptions.RayError:
            pass  # the parent's _finished says what it means
        super()._finished(ref)

    def _end(self, key: str) -> None:
        name = self.running[key].group.name
        super()._end(key)
        self.nodes.pop(key, None)
        self.last_look = 0.0  # its node may have left: look before placing it again
        self.ex.measured.setdefault(name, {})["end"] = time.monotonic() - self.t0
        self.event = self.event or "ended"

    def _progress(self, run: _RayAttempt, *measured: Any) -> None:
        steps, live, per_step, busy, score, memory = measured
        record = self.ex.measured.setdefault(run.group.name, {})
        if "seconds_per_step" not in record:  # the first steps: what the simulator replays
            record.update(seconds_per_step=per_step, live=live, utilization=busy)
        record["steps"] = steps
        if self.placer.observe(run.group.name, steps, live, per_step, busy, score, memory):
            self.event = self.event or "thinned"

"""Devices and the cluster they form, including devices that join or leave during a study."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["Device", "Cluster"]

_KINDS = ("gpu", "cpu")
_EVENT_KINDS = ("join", "leave")


@dataclass(frozen=True)
class Device:
    """One accelerator (or a CPU slot) that trial groups can be placed on.

    Args:
        name: Unique name, e.g. ``"node0/gpu3"``.
        kind: ``"gpu"`` or ``"cpu"``.
        memory: Usable memory in GiB.
        speed: Throughput relative to a reference device (1.0). A device with speed 2.0
            trains the same group twice as fast.
        node: The machine the device sits in; data-parallel groups prefer one node.

    Example:
        >>> from hydro_fluid import Device
        >>> Device("n0/gpu0", kind="gpu", memory=80.0, speed=1.0, node="n0").memory
        80.0
    """

    name: str
    kind: str = "gpu"
    memory: float = 80.0
    speed: float = 1.0
    node: str = "node0"

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(
                f"Device {self.name!r}: kind must be one of {_KINDS}, got {self.kind!r}."
            )
        if not self.memory > 0:
            raise ValueError(f"Device {self.name!r}: memory must be > 0 GiB, got {self.memory}.")
        if not self.speed > 0:
            raise ValueError(f"Device {self.name!r}: speed must be > 0, got {self.speed}.")


@dataclass(frozen=True)
class ClusterEvent:
    """A device joining or leaving the cluster at ``time`` seconds after the start."""

    time: float
    kind: str
    device: Device

    def __post_init__(self) -> None:
        if self.kind not in _EVENT_KINDS:
            raise ValueError(f"Cluster event kind must be 'join' or 'leave', got {self.kind!r}.")
        if self.time < 0:
            raise ValueError(f"Cluster event time must be >= 0, got {self.time}.")


@dataclass
class Cluster:
    """Nodes of devices, with devices that may join or leave while a study runs.

    Args:
        devices: Devices present at time 0.
        events: ``(time, "join" | "leave", device)`` changes, in any order.

    Example:
        >>> from hydro_fluid import Cluster
        >>> cluster = Cluster.homogeneous(nodes=2, devices_per_node=4)
        >>> len(cluster.devices), sorted(cluster.nodes)
        (8, ['node0', 'node1'])
        >>> spare = cluster.devices[0]
        >>> cluster = cluster.with_events([(100.0, "leave", spare)])
        >>> len(cluster.devices_at(150.0))
        7
    """

    devices: list[Device]
    events: list[ClusterEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.devices = list(self.devices)
        self.events = sorted(
            (e if isinstance(e, ClusterEvent) else ClusterEvent(*e) for e in self.events),
            key=lambda e: e.time,
        )
        _check_unique(self.devices)
        # Replay the events once so that a bad history fails here, not mid-simulation.
        present = {d.name for d in self.devices}
        for event in self.events:
            name = event.device.name
            if event.kind == "join":
                if name in present:
                    raise ValueError(
                        f"Device {name!r} joins at t={event.time} but is already present; "
                        "give each device a unique name or add a 'leave' event first."
                    )
                present.add(name)
            else:
                if name not in present:
                    raise ValueError(
                        f"Device {name!r} leaves at t={event.time} but is not present then."
                    )
                present.remove(name)

    @classmethod
    def homogeneous(
        cls,
        nodes: int,
        devices_per_node: int,
        *,
        kind: str = "gpu",
        memory: float = 80.0,
        speed: float = 1.0,
    ) -> Cluster:
        """Build ``nodes`` machines with ``devices_per_node`` identical devices each.

        Example:
            >>> from hydro_fluid import Cluster
            >>> Cluster.homogeneous(1, 8).devices[3].name
            'node0/gpu3'
        """
        if nodes < 1 or devices_per_node < 1:
            raise ValueError(
                f"Need at least one node and one device per node, got nodes={nodes}, "
                f"devices_per_node={devices_per_node}."
            )
        devices = [
            Device(f"node{n}/{kind}{i}", kind=kind, memory=memory, speed=speed, node=f"node{n}")
            for n in range(nodes)
            for i in range(devices_per_node)
        ]
        return cls(devices)

    def with_events(self, events: Iterable[tuple[float, str, Device] | ClusterEvent]) -> Cluster:
        """Return a copy of this cluster with extra join/leave events."""
        return Cluster(list(self.devices), list(self.events) + list(events))

    @property
    def nodes(self) -> dict[str, list[Device]]:
        """Devices present at time 0, grouped by node."""
        by_node: dict[str, list[Device]] = {}
        for device in self.devices:
            by_node.setdefault(device.node, []).append(device)
        return by_node

    def devices_at(self, time: float) -> list[Device]:
        """Devices present at ``time`` (events at exactly ``time`` are applied)."""
        present = {d.name: d for d in self.devices}
        for event in self.events:
            if event.time > time:
                break
            if event.kind == "join":
                present[event.device.name] = event.device
            else:
                present.pop(event.device.name, None)
        return list(present.values())


def _check_unique(devices: Sequence[Device]) -> None:
    seen: set[str] = set()
    for device in devices:
        if not isinstance(device, Device):
            raise ValueError(f"Expected Device objects, got {type(device).__name__}: {device!r}.")
        if device.name in seen:
            raise ValueError(f"Device name {device.name!r} appears twice; names must be unique.")
        seen.add(device.name)

"""The placement policy interface: what a policy is given at an event and what it answers.

Placement (:class:`~hydro_fluid.placement.Placer`, for the executors) and the simulator
(:func:`~hydro_fluid.simulate`) call every policy the same way, ``policy.allocate(state)``;
a policy is named in the registry (:mod:`hydro_fluid.policies.registry`) so that both, and
``hydro tune --policy``, find it by name.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from ..groups import TrialGroup
from ..policy import Allocation, Slot
from ..resources import Device

__all__ = ["PlacementState", "Policy"]


@dataclass(frozen=True)
class PlacementState:
    """Everything a policy may look at when it is asked, at one event, where groups run.

    Attributes:
        groups: Every unfinished group that may run now, running or waiting, each with the
            remaining budgets of its live members and its measured cost per step,
            utilization, memory and score (:class:`~hydro_fluid.TrialGroup`). Waiting groups
            come in arrival order.
        devices: Every device present now.
        running: Where the running groups run now: name -> ``(device, share)`` slots. On an
            executor a group packed on one device that thinned out (members pruned or done)
            shows the share it still uses, at least ``1/c``, so a policy may pack beside it.
        c: Most groups packed on one device.
        d: Most devices for one data-parallel group (1 while a stream still brings groups:
            a device that empties takes the next one before any group widens).
        now: The current time, in seconds on the caller's clock.
        start: When the run started, on the same clock.
        end: The deadline on the same clock, for a policy that uses one (else ``None``).
        restart_cost: Seconds a running group loses when its slots change (checkpoint,
            restart, warm-up): move it only if that saves more.
    """

    groups: Sequence[TrialGroup]
    devices: Sequence[Device]
    running: Mapping[str, tuple[Slot, ...]] = field(default_factory=dict)
    c: int = 4
    d: int = 8
    now: float = 0.0
    start: float = 0.0
    end: float | None = None
    restart_cost: float = 30.0

    @property
    def waiting(self) -> list[TrialGroup]:
        """The groups not running, in arrival order."""
        return [g for g in self.groups if g.name not in self.running]

    @property
    def idle_devices(self) -> list[Device]:
        """The devices no running group uses."""
        busy = {dev for slots in self.running.values() for dev, _ in slots}
        return [dev for dev in self.devices if dev.name not in busy]


class Policy(abc.ABC):
    """A placement policy: where every group should run now.

    Subclass it, set :attr:`name`, implement :meth:`allocate`, and decorate the class with
    :func:`~hydro_fluid.policies.register_policy`; a module of its own in
    ``hydro_fluid/policies/`` is found by the registry without any other change. The
    executors ask it at every event (a group arrives, ends or thins out, a device joins or
    leaves, a deadline tick) and apply its answer to real devices; the simulator replays it
    on measured costs.

    Class attributes:
        name: The name users pass (``policy="..."``, ``hydro tune --policy``).
        aliases: Other accepted spellings of the name.
        idle_only: ``True`` for a policy that only places waiting groups on idle devices and
            never moves, rescales or packs next to a running group (``fifo``, ``static``):
            an executor then takes a new group only when a device is idle. ``False``: it may
            pack a new group on a device whose groups thinned out.
        uses_deadline: ``True`` for a policy that needs a deadline (``state.end``);
            every other policy refuses one.

    Example:
        A policy that puts every waiting group alone on an idle device, smallest memory
        first, and leaves running groups where they are::

        >>> from hydro_fluid import Cluster, TrialGroup, simulate
        >>> from hydro_fluid.policies import PlacementState, Policy
        >>> class SmallFirst(Policy):
        ...     name = "small_first"
        ...     idle_only = True
        ...
        ...     def allocate(self, state: PlacementState):
        ...         free = list(state.idle_devices)
        ...         placed = dict(state.running)
        ...         for group in sorted(state.waiting, key=lambda g: g.memory):
        ...             if free:
        ...                 placed[group.name] = ((free.pop(0).name, 1.0),)
        ...         return placed
        >>> work = [TrialGroup(f"g{i}", (i,), (100,)) for i in range(4)]
        >>> simulate(work, Cluster.homogeneous(1, 2), SmallFirst()).makespan
        200.0
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    idle_only: ClassVar[bool] = False
    uses_deadline: ClassVar[bool] = False

    @abc.abstractmethod
    def allocate(self, state: PlacementState) -> Allocation:
        """Where every group should run now.

        Returns:
            An :data:`~hydro_fluid.Allocation`: for each group to run, its slots
            ``(device name, share)``. A share below 1 packs the group with others on that
            device; several slots of share 1 make it data parallel over whole devices. A
            running group left out is stopped (its checkpoint kept) and waits; a waiting
            group left out waits. The answer must respect ``c``, ``d`` and each device's
            memory (:func:`~hydro_fluid.simulate.check_allocation` is what the simulator
            enforces).
        """

    @classmethod
    def summary(cls) -> str:
        """The first line of the class's docstring: what ``hydro tune --help`` shows."""
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0].rstrip(".") if doc else cls.name

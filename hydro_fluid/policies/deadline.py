"""``deadline``: as the deadline nears, the best-ranked groups get whole devices."""

from __future__ import annotations

from hydro.errors import ConfigError

from ..policy import Allocation, deadline
from .base import PlacementState, Policy
from .registry import register_policy

__all__ = ["Deadline"]


@register_policy
class Deadline(Policy):
    """HyperSched-like: as the deadline nears, the best-ranked groups get whole devices.

    Wraps :func:`hydro_fluid.deadline`: early on it explores as DynamicFluid does; as
    ``state.now`` moves from ``state.start`` to ``state.end`` a growing part of the devices
    goes to the groups with the lowest ``score`` so far.

    Example:
        >>> from hydro_fluid import Cluster, TrialGroup
        >>> from hydro_fluid.policies import PlacementState, get_policy
        >>> groups = [TrialGroup(f"g{i}", (i,), (1000,), score=float(i)) for i in range(4)]
        >>> state = PlacementState(groups, Cluster.homogeneous(1, 8).devices,
        ...                        now=900.0, end=1000.0)
        >>> alloc = get_policy("deadline")().allocate(state)
        >>> len(alloc["g0"]) > len(alloc.get("g3", ()))
        True
    """

    name = "deadline"
    uses_deadline = True

    def allocate(self, state: PlacementState) -> Allocation:
        if state.end is None:
            raise ConfigError("policy 'deadline' needs a deadline (state.end)")
        return deadline(state.groups, state.devices, state.c, state.d, now=state.now,
                        end=state.end, start=state.start, running=state.running,
                        restart_cost=state.restart_cost)

"""``fifo``: the baseline, one group per idle device in arrival order."""

from __future__ import annotations

from ..policy import Allocation, fifo
from .base import PlacementState, Policy
from .registry import register_policy

__all__ = ["Fifo"]


@register_policy
class Fifo(Policy):
    """One group per idle device, in arrival order, no packing or scaling (the baseline).

    Wraps :func:`hydro_fluid.fifo`; running groups stay where they are.

    Example:
        >>> from hydro_fluid import Cluster, TrialGroup
        >>> from hydro_fluid.policies import PlacementState, get_policy
        >>> groups = [TrialGroup(f"g{i}", (i,), (100,)) for i in range(3)]
        >>> get_policy("fifo")().allocate(
        ...     PlacementState(groups, Cluster.homogeneous(1, 2).devices))
        {'g0': (('node0/gpu0', 1.0),), 'g1': (('node0/gpu1', 1.0),)}
    """

    name = "fifo"
    idle_only = True

    def allocate(self, state: PlacementState) -> Allocation:
        return {**state.running, **fifo(state.waiting, state.idle_devices)}

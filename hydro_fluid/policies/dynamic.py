"""``dynamic``: Fluid's DynamicFluid over every device at every event."""

from __future__ import annotations

from ..policy import Allocation, dynamic_fluid
from .base import PlacementState, Policy
from .registry import register_policy

__all__ = ["DynamicFluid"]


@register_policy
class DynamicFluid(Policy):
    """DynamicFluid: re-plans every device at every event, moves a group when it pays.

    Wraps :func:`hydro_fluid.dynamic_fluid`: a running group is rescaled or moved only
    when the time it saves exceeds ``restart_cost``. ``dynamic_fluid`` (the simulator's
    former name) is an alias.

    Example:
        >>> from hydro_fluid import Cluster, TrialGroup
        >>> from hydro_fluid.policies import PlacementState, get_policy
        >>> g = TrialGroup("g", (0,), (10_000,), cost_per_step=1.0)
        >>> state = PlacementState([g], Cluster.homogeneous(1, 4).devices,
        ...                        running={"g": (("node0/gpu0", 1.0),)})
        >>> len(get_policy("dynamic")().allocate(state)["g"])  # worth scaling out
        4
    """

    name = "dynamic"
    aliases = ("dynamic_fluid",)

    def allocate(self, state: PlacementState) -> Allocation:
        return dynamic_fluid(state.groups, state.devices, state.c, state.d,
                             running=state.running,
                             restart_cost=state.restart_cost)

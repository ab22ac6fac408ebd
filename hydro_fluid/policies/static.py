"""``static``: Fluid's StaticFluid over the idle devices."""

from __future__ import annotations

from ..policy import Allocation, static_fluid
from .base import PlacementState, Policy
from .registry import register_policy

__all__ = ["StaticFluid"]


@register_policy
class StaticFluid(Policy):
    """StaticFluid over idle devices: shares by work, packing, data parallel.

    Wraps :func:`hydro_fluid.static_fluid` on the waiting groups and the idle devices;
    running groups stay where they are. ``static_fluid`` (the simulator's former name) is
    an alias.

    Example:
        >>> from hydro_fluid import Cluster, TrialGroup
        >>> from hydro_fluid.policies import PlacementState, get_policy
        >>> long = TrialGroup("long", (0,), (900,))
        >>> short = [TrialGroup(f"s{i}", (i + 1,), (100,)) for i in range(4)]
        >>> state = PlacementState([long, *short], Cluster.homogeneous(1, 4).devices)
        >>> alloc = get_policy("static")().allocate(state)
        >>> len(alloc["long"]), alloc["s0"][0][1]
        (2, 0.5)
    """

    name = "static"
    aliases = ("static_fluid",)
    idle_only = True

    def allocate(self, state: PlacementState) -> Allocation:
        placed = static_fluid(state.waiting, state.idle_devices, state.c, state.d)
        return {**state.running, **placed}

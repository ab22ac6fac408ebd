"""``largest_first``: DynamicFluid that admits the groups with the most work left first."""

from __future__ import annotations

from ..policy import Allocation, dynamic_fluid
from .base import PlacementState, Policy
from .registry import register_policy

__all__ = ["LargestFirst"]


@register_policy
class LargestFirst(Policy):
    """DynamicFluid, admitting the groups with the most work left first (LPT order).

    DynamicFluid admits waiting groups in arrival order (up to ``c`` per device); when more
    groups wait than fit, a long group that arrived late starts last and trains alone at
    the end while the other devices idle. Ordering the queue by remaining work (budget times
    cost per step, longest first: Graham's LPT rule) starts the long groups early and fills
    in around them with the short ones, which shortens the study's tail. Use it when a batch
    of groups of very different lengths is submitted at once (successive-halving rungs, a
    sweep over step budgets or model sizes), above all where a group fills its device
    (``c=1``: large models on GPUs) or may not go data parallel (``d=1``): there the
    simulator shows it at the lower bound where ``dynamic`` takes 1.5 times as long
    (tests/fluid/test_policy_largest_first.py). Running groups are kept or moved as by
    ``dynamic`` (only when the move saves more than ``restart_cost``).

    Example:
        >>> from hydro_fluid import Cluster, TrialGroup
        >>> from hydro_fluid.policies import PlacementState, get_policy
        >>> short = [TrialGroup(f"s{i}", (i,), (100,)) for i in range(3)]
        >>> long = TrialGroup("long", (9,), (1000,))
        >>> state = PlacementState([*short, long], Cluster.homogeneous(1, 2).devices, c=1)
        >>> sorted(get_policy("largest_first")().allocate(state))  # arrival order: s0, s1
        ['long', 's0']
    """

    name = "largest_first"

    def allocate(self, state: PlacementState) -> Allocation:
        # sorted() is stable: equal work keeps arrival order
        ordered = sorted(state.groups, key=lambda g: -g.work)
        return dynamic_fluid(ordered, state.devices, state.c, state.d, running=state.running,
                             restart_cost=state.restart_cost)

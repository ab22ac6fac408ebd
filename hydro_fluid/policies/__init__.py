"""Placement policies by name: one interface (:class:`Policy`), one registry.

A policy answers ``allocate(state) -> Allocation`` (:mod:`~hydro_fluid.policies.base`);
the registry (:mod:`~hydro_fluid.policies.registry`) maps names to policies for placement
(:class:`~hydro_fluid.placement.Placer`), the simulator (:func:`~hydro_fluid.simulate`) and
``hydro tune --policy``. The built-in ones, one module each:

* ``fifo``: one group per idle device, in arrival order (the baseline);
* ``static``: Fluid's StaticFluid over the idle devices;
* ``dynamic``: Fluid's DynamicFluid over every device at every event;
* ``deadline``: HyperSched-like, the best groups get whole devices as the deadline nears.

Adding one is a module in this package (and its test): every module here is imported with
the package, and its ``@register_policy`` class is then known everywhere by name.

Example:
    >>> from hydro_fluid.policies import get_policy, policy_names
    >>> policy_names()[:4]
    ['fifo', 'static', 'dynamic', 'deadline']
    >>> get_policy("static_fluid") is get_policy("static")  # the simulator's old spelling
    True
"""

import importlib
import pkgutil

from .base import PlacementState, Policy
from .registry import (
    check_policy,
    get_policy,
    make_policy,
    policy_help,
    policy_names,
    register_policy,
)

__all__ = ["PlacementState", "Policy", "check_policy", "get_policy", "make_policy",
           "policy_help", "policy_names", "register_policy"]

# the built-in ones first, in this order (the CLI lists them so), then any other module here
for _name in ("fifo", "static", "dynamic", "deadline"):
    importlib.import_module(f"{__name__}.{_name}")
for _info in pkgutil.iter_modules(__path__):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")

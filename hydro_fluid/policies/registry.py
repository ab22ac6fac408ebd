"""The policy registry: names -> :class:`~hydro_fluid.policies.Policy` classes.

Placement, the simulator and ``hydro tune --policy`` look policies up here, so a policy
registered once is accepted by all three. Every module of the :mod:`hydro_fluid.policies`
package is imported when the package is, so a policy in a module of its own there registers
itself; a policy defined elsewhere registers when its module is imported::

    from hydro_fluid.policies import PlacementState, Policy, register_policy

    @register_policy
    class Mine(Policy):
        \"\"\"One line for ``--help``.\"\"\"

        name = "mine"

        def allocate(self, state: PlacementState):
            ...
"""

from __future__ import annotations

from typing import Any, TypeVar

from hydro.errors import ConfigError

from .base import Policy

__all__ = [
    "check_policy",
    "get_policy",
    "make_policy",
    "policy_help",
    "policy_names",
    "register_policy",
]

P = TypeVar("P", bound=type[Policy])

_BY_NAME: dict[str, type[Policy]] = {}  # canonical names and aliases
_NAMES: list[str] = []  # canonical names, in registration order


def register_policy(cls: P) -> P:
    """Register a :class:`Policy` subclass under its ``name`` and ``aliases``; returns it
    (use it as a class decorator).

    Registering the same class again (a module imported twice) replaces it; another class
    under a name already taken is an error.
    """
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise TypeError(f"register_policy takes a Policy subclass, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{cls.__qualname__}.name must be an identifier, got {name!r}")
    for key in (name, *cls.aliases):
        old = _BY_NAME.get(key)
        if old is not None and _qualified(old) != _qualified(cls):
            raise ValueError(f"policy name {key!r} is taken by {_qualified(old)}")
    for key in (name, *cls.aliases):
        _BY_NAME[key] = cls
    if name not in _NAMES:
        _NAMES.append(name)
    return cls


def policy_names() -> list[str]:
    """The registered policies' names (without aliases): the built-in ones first."""
    return list(_NAMES)


def policy_help() -> str:
    """One line per registered policy, ``name: summary``, joined by ``"; "`` (for ``--help``)."""
    return "; ".join(f"{name}: {_BY_NAME[name].summary()}" for name in _NAMES)


def get_policy(name: str) -> type[Policy]:
    """The policy class registered as ``name`` (a name or an alias).

    Raises:
        ConfigError: ``name`` is not registered; the message lists the registered names.
    """
    cls = _BY_NAME.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"unknown placement policy {name!r}: use one of "
                          f"{', '.join(policy_names())}")
    return cls


def make_policy(policy: str | Policy) -> Policy:
    """A policy object: ``policy`` itself, or a new instance of the class named ``policy``."""
    if isinstance(policy, Policy):
        return policy
    return get_policy(policy)()


def check_policy(policy: Any, deadline_s: Any = None) -> None:
    """A one-line :class:`~hydro.errors.ConfigError` unless ``policy`` names a registered
    policy and ``deadline_s`` fits it: seconds > 0 for a policy that uses a deadline,
    ``None`` for every other."""
    cls = policy if isinstance(policy, Policy) else get_policy(policy)
    name = cls.name
    if cls.uses_deadline:
        if deadline_s is None:
            raise ConfigError(f"policy {name!r} needs a deadline: pass deadline=SECONDS")
        if isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float) \
                or not deadline_s > 0:
            raise ConfigError(f"deadline must be a number of seconds > 0, got {deadline_s!r}")
    elif deadline_s is not None:
        users = " or ".join(repr(n) for n in policy_names() if get_policy(n).uses_deadline)
        raise ConfigError(f"deadline={deadline_s!r} is only used by policy {users}, not "
                          f"{name!r}: drop it or use policy={users}")


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"

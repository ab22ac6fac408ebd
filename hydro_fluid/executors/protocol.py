"""The executor interface, as types: what the tuner and the policies may call on an executor.

:class:`Executor` is the contract of :mod:`hydro_fluid.executors.base` (its docstring tells
what ``fn``, ``ctx`` and the callbacks do); :class:`PlacingExecutor` adds placement by a
registered policy. :class:`~hydro_fluid.LocalExecutor` and :class:`~hydro_fluid.RayExecutor`
satisfy both. They are :class:`typing.Protocol`\\ s: an executor of your own needs no base
class, only these members, and :func:`check_executor` (what ``hydro.tune(executor=...)``
calls) refuses an object that lacks one with a :class:`~hydro.errors.ConfigError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from hydro.errors import ConfigError

from ..groups import TrialGroup
from ..resources import Device
from .base import GroupResult, MoreFn, ReportFn, RequestFn, ResultFn, WorkerFn

__all__ = ["Executor", "PlacingExecutor", "check_executor"]


@runtime_checkable
class Executor(Protocol):
    """Runs fused trial groups in workers and streams what they report.

    Attributes:
        slots: One entry per group the executor trains at once (its device, e.g. ``"cpu"``
            or ``"cuda:0"``): what ``more`` fills when :meth:`run` streams groups.

    Example:
        >>> from hydro_fluid import Executor, LocalExecutor, check_executor
        >>> executor = LocalExecutor(devices=[], num_workers=1)
        >>> isinstance(executor, Executor) and check_executor(executor) is executor
        True
        >>> check_executor(object())
        Traceback (most recent call last):
        ...
        hydro.errors.ConfigError: executor object() is not a hydro_fluid.Executor: it lacks run, ...
    """

    slots: Sequence[str]

    def run(
        self,
        groups: Sequence[TrialGroup],
        fn: WorkerFn,
        *,
        report: ReportFn | None = None,
        world_size: int | Mapping[str, int] = 1,
        more: MoreFn | None = None,
        on_result: ResultFn | None = None,
        request: RequestFn | None = None,
        preload: Sequence[str] = (),
    ) -> list[GroupResult]:
        """Run ``fn(group, ctx)`` in a worker for every group, and for every group ``more()``
        returns while it runs; one :class:`~hydro_fluid.GroupResult` per group that ran.

        ``report(trial, step, value)`` is called here for every value a worker reports (``True``
        prunes the trial), ``on_result(result)`` as each group ends, ``request(group_name,
        payload)`` answers a worker's ``ctx.request(payload)``. ``world_size`` makes a group
        data parallel (one number, or per group name); ``preload`` names modules a worker
        should start with (an executor may ignore it).
        """
        ...


@runtime_checkable
class PlacingExecutor(Executor, Protocol):
    """An :class:`Executor` whose :meth:`run` also takes ``policy``, ``deadline`` and
    ``max_world_size``: a registered placement policy (:func:`~hydro_fluid.policy_names`)
    decides, at every event, where each group runs on :meth:`placement_devices` (packing,
    data parallel, moves through a checkpoint), and ``more`` may take a keyword ``room`` (the
    fraction of a device free for the new group)."""

    def run(
        self,
        groups: Sequence[TrialGroup],
        fn: WorkerFn,
        *,
        report: ReportFn | None = None,
        world_size: int | Mapping[str, int] = 1,
        more: MoreFn | None = None,
        on_result: ResultFn | None = None,
        request: RequestFn | None = None,
        preload: Sequence[str] = (),
        policy: Any = None,
        deadline: float | None = None,
        max_world_size: int | None = None,
    ) -> list[GroupResult]:
        """As :meth:`Executor.run`, placed by ``policy`` (a name or a
        :class:`~hydro_fluid.Policy`; ``None``: the executor's own first-come pool)."""
        ...

    def placement_devices(self) -> list[Device]:
        """The devices a placement policy places groups on."""
        ...


def check_executor(executor: Any) -> Executor:
    """``executor`` itself if it is an :class:`Executor`, else a
    :class:`~hydro.errors.ConfigError` naming the members it lacks."""
    if isinstance(executor, Executor):
        return executor
    missing = [m for m in ("run", "slots") if not hasattr(executor, m)]
    if "run" not in missing and not callable(executor.run):
        missing.insert(0, "a callable run")
    name = f"{type(executor).__name__}()" if not isinstance(executor, str) else repr(executor)
    raise ConfigError(f"executor {name} is not a hydro_fluid.Executor: it lacks "
                      f"{', '.join(missing)} (see hydro_fluid.executors.protocol)")

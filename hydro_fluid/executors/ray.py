"""RayExecutor: the same groups and the same contract as LocalExecutor, as Ray tasks.

Ray is an optional dependency, imported only when a RayExecutor is created.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import signal
import threading
import warnings
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from ..groups import TrialGroup
from ..placement import Placer
from ..policies import check_policy
from ..resources import Device
from .base import (
    GroupResult,
    Ledger,
    MoreFn,
    ReportFn,
    RequestFn,
    ResultFn,
    WorkerFn,
)
from .ray_placed import _PlacedRayRun
from .ray_run import _RayRun
from .scratch import private_dir
from .worker import _scratch_dir

__all__ = ["RayExecutor"]

_INSTALL_HINT = "RayExecutor needs Ray: pip install 'hydro-surrogate[ray]'"


@contextmanager
def _loopback_only() -> Iterator[None]:
    """While the block runs, Ray processes started or connected here stay on 127.0.0.1.

    Ray turns "127.0.0.1" into the host's network address unless its multi-node mode is off
    (what it does on macOS and Windows). Off, a node given ``node_ip_address="127.0.0.1"``
    binds and connects to loopback only; the variable reaches the processes Ray starts
    meanwhile (GCS, raylets, agents, and through the raylets their workers).
    """
    from ray._private import ray_constants

    env = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    old_env, old_flag = os.environ.get(env), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[env] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old_flag
        if old_env is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = old_env


def _is_loopback(address: str) -> bool:
    """Whether a Ray address (``host:port``, not ``ray://`` or ``auto``) is on this machine's
    loopback interface."""
    if "://" in address or ":" not in address:
        return False
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _init_ray(ray, address: str | None, kwargs: dict[str, Any]) -> None:
    """Connect this process to Ray: to ``address`` (or ``RAY_ADDRESS``), else a new local Ray.

    A Ray cluster has no authentication: anyone who reaches its ports runs code as this user.
    Ray advertises and binds its node on the address it finds for this host (reachable from the
    network), so a Ray started here binds to 127.0.0.1 instead and starts no dashboard, unless
    ``kwargs`` say otherwise; and a driver joining a cluster on a loopback address joins on
    127.0.0.1 too (left to itself it would talk to the cluster from the network address). To
    serve other machines, start Ray yourself (``ray start --head``, behind a firewall) and
    pass its address.
    """
    address = address or os.environ.get("RAY_ADDRESS") or None
    local = address is None or _is_loopback(address)
    if local:
        kwargs.setdefault("_node_ip_address", "127.0.0.1")
    if address is None:
        kwargs.setdefault("include_dashboard", False)
        # a private Ray: its start-up notices (token authentication ...) are not the user's
        kwargs.setdefault("logging_level", logging.ERROR)
        # "local": a new Ray, not whichever cluster this machine last started (Ray's default)
        address = "local"
    # ray.init sets its own SIGTERM handler (sys.exit, mid-anything): the caller's, which
    # stops a run cleanly and requeues its trials, is put back once Ray is up
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    # A Ray started here runs in this process group, so a SIGTERM sent to the group (timeout,
    # Slurm, systemd) would kill it under the run, and the driver would abort in Ray's C++
    # before it could put its trials back. Its processes inherit a mask that blocks SIGTERM:
    # this process stops cleanly and takes them down (ray.shutdown ends them with SIGKILL
    # one second after the blocked SIGTERM)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}) \
        if main and address == "local" else None
    try:
        with _loopback_only() if local else nullcontext():
            ray.init(address=address, **kwargs)
    except Exception as exc:  # Ray's start-up fails in many ways: one line each
        try:
            ray.shutdown()  # what it did start
        except Exception:  # nothing more to clean up
            pass
        first = (str(exc).strip().splitlines() or [""])[0]
        where = "a new local Ray" if address == "local" else f"Ray at {address!r}"
        raise RayStartError(
            f"{where} did not start: {type(exc).__name__}: {first}. Start Ray yourself "
            "(`ray start --head`) and set RAY_ADDRESS, or use another executor (local)"
        ) from exc
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class RayStartError(RuntimeError):
    """Ray could not be started or reached by :class:`RayExecutor` (``ray.init`` failed)."""


def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError(f"{_INSTALL_HINT} ({exc}).") from exc
    return ray


class RayExecutor:
    """Run fused trial groups as Ray tasks, on an existing Ray cluster or a local one.

    Each group is one task asking for ``1 / groups_per_device`` of a GPU (fractional
    ``num_gpus`` packs small groups on one GPU) and ``cpus_per_worker`` CPUs. A group with
    ``world_size > 1`` gets a placement group of that many bundles (one GPU each, packed on
    as few nodes as possible) and trains with ``torch.distributed`` across them (nccl on
    GPUs, gloo otherwise). Reports stream back through a small Ray actor.

    The contract of ``fn``, the retries, the out-of-memory halving and the trial states are
    those of :class:`~hydro_fluid.LocalExecutor` (see :mod:`hydro_fluid.executors.base`).
    Ray's own task retries are switched off so that a retried group restarts from its
    checkpoint and failures end with the same reasons everywhere. A group whose node is lost
    (its task ends in ``NodeDiedError``, ``WorkerCrashedError``, ...) is such a dead worker:
    retried from its checkpoint on a node that has room, within ``max_retries``. The
    reporting actor lives on the driver's node, so losing another node never loses it. On a
    multi-node cluster ``checkpoint_dir`` must be on a file system every node sees (a warning
    says so when it is missing), and ``hydro_fluid`` and the module defining ``fn`` must be
    importable on every node.

    Args:
        address: Ray cluster to connect to (e.g. ``"auto"``, ``"10.0.0.1:6379"`` or
            ``"ray://head:10001"``). ``None`` connects to the running Ray of this process, or
            to ``RAY_ADDRESS``, or starts a new local one bound to 127.0.0.1 with no dashboard
            (a Ray cluster runs code for anyone who reaches its ports, so one started here is
            not reachable from the network; see docs/explanation/placement.md); never the cluster
            ``ray start`` last left on this machine, which ``"auto"`` joins. A cluster at a loopback
            address (``127.0.0.1:port``) is joined on 127.0.0.1 as well.
        groups_per_device: Groups that share one GPU (each asks for ``1/groups_per_device``).
        cpus_per_worker: CPUs per worker; also its ``torch.set_num_threads``.
        use_gpus: Ask for GPUs; default: when the cluster has any.
        max_retries: Restarts of a group whose worker died, before its trials FAIL.
        checkpoint_dir: Where each group gets its checkpoint directory (default: a
            temporary directory, removed after ``run``).
        max_packed: With a placement policy (``run(policy=...)``): most groups on one device.
        restart_cost: With a placement policy: seconds a move is assumed to cost.
        init_kwargs: Extra arguments for ``ray.init`` when this executor starts Ray.

    Example:
        >>> from hydro_fluid import RayExecutor, TrialGroup  # doctest: +SKIP
        >>> from hydro_fluid.executors.examples import count_steps  # doctest: +SKIP
        >>> executor = RayExecutor(address="auto", groups_per_device=4)  # doctest: +SKIP
        >>> results = executor.run([TrialGroup("g", (0, 1), (100, 100))], count_steps,
        ...                        report=lambda trial, step, value: None)  # doctest: +SKIP
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        groups_per_device: int = 1,
        cpus_per_worker: int = 1,
        use_gpus: bool | None = None,
        max_retries: int = 1,
        checkpoint_dir: str | Path | None = None,
        max_packed: int = 4,
        restart_cost: float = 5.0,
        init_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        ray = _import_ray()
        if isinstance(max_packed, bool) or not isinstance(max_packed, int) or max_packed < 1:
            raise ValueError(f"max_packed must be an int >= 1, got {max_packed!r}.")
        if not restart_cost >= 0:
            raise ValueError(f"restart_cost must be >= 0 seconds, got {restart_cost!r}.")
        self.max_packed, self.restart_cost = max_packed, restart_cost
        if groups_per_device < 1:
            raise ValueError(f"groups_per_device must be >= 1, got {groups_per_device}.")
        if cpus_per_worker < 1:
            raise ValueError(f"cpus_per_worker must be >= 1, got {cpus_per_worker}.")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}.")
        self._started_ray = False
        self._hub = None
        if not ray.is_initialized():
            _init_ray(ray, address, dict(init_kwargs or {}))
            self._started_ray = True
        resources = ray.cluster_resources()
        self.gpus = float(resources.get("GPU", 0.0))
        self.use_gpus = self.gpus > 0 if use_gpus is None else use_gpus
        if self.use_gpus and self.gpus == 0:
            raise ValueError("use_gpus=True but the Ray cluster reports no GPU resources.")
        self.groups_per_device = groups_per_device
        self.cpus_per_worker = cpus_per_worker
        self.max_retries = max_retries
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None

    @property
    def slots(self) -> list[str]:
        """One entry per group the cluster can train at once (its device kind): what
        ``more`` fills when :meth:`run` streams groups."""
        resources = _import_ray().cluster_resources()
        if self.use_gpus:
            n = int(float(resources.get("GPU", 0.0)) * self.groups_per_device)
            return ["cuda"] * max(1, n)
        return ["cpu"] * max(1, int(float(resources.get("CPU", 1.0)) // self.cpus_per_worker))

    def _get_hub(self, ray):
        """The reporting actor, started once and waited for: reports sent before it is up
        would otherwise queue in the workers and reach the callback late.

        It lives on this driver's node, never elsewhere: the loss of any other node must not
        take the hub (and with it every group's line to the driver) along. Losing the
        driver's node ends the run anyway."""
        if self._hub is None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), False)
            self._hub = _hub_class(ray).options(scheduling_strategy=here).remote()
        ray.get(self._hub.flush.remote())
        return self._hub

    def shutdown(self) -> None:
        """Stop the reporting actor, and Ray if this executor started it."""
        if self._hub is not None:
            _import_ray().kill(self._hub)
            self._hub = None
        if self._started_ray:
            _import_ray().shutdown()
            self._started_ray = False

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
        policy: str | None = None,
        deadline: float | None = None,
        max_world_size: int | None = None,
    ) -> list[GroupResult]:
        """Run ``fn(group, ctx)`` for every group; same contract as :meth:`LocalExecutor.run`
        (``more`` is asked for groups while fewer than ``len(self.slots)`` run; ``preload``
        is not needed: Ray reuses its worker processes, which keep what they imported).

        ``policy``, ``deadline`` and ``max_world_size`` place groups as in
        :meth:`LocalExecutor.run`, on the cluster's devices (:meth:`placement_devices`,
        re-read at every event, so a node joining or leaving is one): a share below 1 asks
        Ray for that fraction of a GPU (on CPUs, of the slot's ``cpus_per_worker``), several
        devices make a data-parallel group, each rank pinned to its device's node, and a
        group the policy moves is stopped through the hub at a step boundary after its
        checkpoint and started again where the policy puts it.
        """
        ray = _import_ray()
        placer = None
        if policy is not None:
            placer = self._placer(policy, deadline, max_world_size)
        ledger = Ledger(self.max_retries, on_result=on_result)
        ledger.submit(groups)  # checks the groups first
        sizes = {g.name: self._size(world_size, g.name) for g in groups}
        if self.checkpoint_dir is None and sum(n["Alive"] for n in ray.nodes()) > 1:
            warnings.warn(
                "RayExecutor has no checkpoint_dir on a cluster of several nodes: checkpoints go "
                "to a temporary directory of each node, so a group retried on another node "
                "restarts from step 0. Pass checkpoint_dir on a file system every node sees.",
                stacklevel=2,
            )
        # the scratch root is named by this process, so a run killed before its clean-up
        # leaves one the next run removes
        root = private_dir(self.checkpoint_dir or _scratch_dir())
        hub = self._get_hub(ray)
        if placer is None:
            run = _RayRun(self, ray, ledger, fn, report, sizes, root, hub)
        else:
            run = _PlacedRayRun(self, ray, ledger, fn, report, sizes, root, hub)
            run.placer = placer
            placer.widen = more is None  # a stream widens groups once it runs dry
        run.more, run.request, run.world_size = more, request, world_size
        run.capacity = len(self.slots) if more is not None else 0
        try:
            run.loop()
        finally:
            run.stop_all()
            self._hub.forget.remote(run.run_id)
            if self.checkpoint_dir is None:
                shutil.rmtree(root, ignore_errors=True)
        return ledger.ordered_results()

    def _size(self, world_size: int | Mapping[str, int], name: str) -> int:
        size = world_size.get(name, 1) if isinstance(world_size, Mapping) else world_size
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"world_size of group {name!r} must be an int >= 1.")
        if self.use_gpus and size > self.gpus:
            raise ValueError(
                f"Group {name!r} asks for world_size={size} but the cluster has "
                f"{self.gpus:g} GPU(s); lower it or add GPUs."
            )
        return size

    def placement_devices(self) -> list[Device]:
        """The cluster's alive devices as a placement policy sees them, named ``NODE/gpuI``
        or ``NODE/cpuI`` (``NODE``: the first 8 hex digits of the Ray node id).

        With GPUs, each GPU of each node, with 16 GiB (Ray does not report a GPU's memory).
        Without, each node's CPUs split into slots of ``cpus_per_worker``, each with its share
        of the node's memory.
        """
        devices = []
        for node in _import_ray().nodes():
            if not node.get("Alive"):
                continue
            res, short = node.get("Resources", {}), node["NodeID"][:8]
            if self.use_gpus:
                devices += [Device(f"{short}/gpu{i}", "gpu", 16.0, node=node["NodeID"])
                            for i in range(int(res.get("GPU", 0)))]
            else:
                n = int(res.get("CPU", 0) // self.cpus_per_worker)
                memory = float(res.get("memory", 2 * 2**30)) / 2**30 / max(n, 1)
                devices += [Device(f"{short}/cpu{i}", "cpu", memory, node=node["NodeID"])
                            for i in range(n)]
        return devices

    def _placer(self, policy: str, deadline: float | None, d: int | None) -> Placer:
        check_policy(policy, deadline)
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"max_world_size must be an int >= 1, got {d!r}.")
        devices = self.placement_devices()
        if not devices:
            raise ValueError(
                "the Ray cluster has no device to place groups on (no GPU, or fewer CPUs than "
                "cpus_per_worker on every node); lower cpus_per_worker or add nodes."
            )
        return Placer(policy, devices, c=self.max_packed, d=min(d or len(devices), len(devices)),
                      deadline=deadline, restart_cost=self.restart_cost)


# --- the pieces that live in Ray --------------------------------------------------------

_HUB = None


def _hub_class(ray):
    """The reporting actor; defined lazily so that importing this module needs no Ray."""
    global _HUB
    if _HUB is None:

        class Hub:
            """Collects reports from workers and hands out pruned trials and rendezvous."""

            def __init__(self) -> None:
                self.reports: list[tuple] = []
                self.pruned_ids: dict[str, set] = {}
                self.addresses: dict[str, str] = {}
                self.answers: dict[str, Any] = {}
                self.stops: set[str] = set()  # attempts asked to stop for a move

            def report(self, key: str, trial: Hashable, step: int, value: float) -> None:
                self.reports.append(("report", key, trial, step, value))

            def request(self, key: str, ident: str, payload: Any) -> None:
                self.reports.append(("request", key, ident, payload))

            def progress(self, key: str, *measured: Any) -> None:
                self.reports.append(("progress", key, *measured))

            def stop(self, key: str) -> None:
                self.stops.add(key)

            def stopping(self, key: str) -> bool:
                return key in self.stops

            def answer(self, ident: str, value: Any) -> None:
                self.answers[ident] = value

            def take(self, ident: str) -> tuple[bool, Any]:
                if ident in self.answers:
                    return True, self.answers.pop(ident)
                return False, None

            def drain(self) -> list[tuple]:
                reports, self.reports = self.reports, []
                return reports

            def prune(self, group: str, trial: Hashable) -> None:
                self.pruned_ids.setdefault(group, set()).add(trial)

            def pruned(self, group: str) -> set:
                return self.pruned_ids.get(group, set())

            def publish(self, key: str, address: str) -> None:
                self.addresses[key] = address

            def lookup(self, key: str) -> str | None:
                return self.addresses.get(key)

            def flush(self) -> None:
                """A worker's last call: it returns after all its earlier reports."""

            def node(self) -> str:
                """The id of the node this hub lives on (the driver's)."""
                return ray.get_runtime_context().get_node_id()

            def forget(self, run_id: str) -> None:
                """Drop what one ``run`` left behind (keys start with its id)."""
                for table in (self.pruned_ids, self.addresses, self.answers):
                    for key in [k for k in table if k.startswith(run_id)]:
                        del table[key]
                self.stops = {k for k in self.stops if not k.startswith(run_id)}

        _HUB = ray.remote(num_cpus=0)(Hub)
    return _HUB

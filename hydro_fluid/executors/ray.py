"""RayExecutor: the same groups and the same contract as LocalExecutor, as Ray tasks.

Ray is an optional dependency, imported only when a RayExecutor is created.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

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
    WorkerContext,
    WorkerFn,
    call_worker_fn,
)
from .scratch import private_dir
from .worker import _peak_memory, _scratch_dir, _StepTimer

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


def _init_ray(ray, address: str | None, kwargs: dict[str, Any]) -> None:  # noqa: ANN001
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
    if address is not None and not _is_loopback(address):
        ray.init(address=address, **kwargs)
        return
    kwargs.setdefault("_node_ip_address", "127.0.0.1")
    if address is None:
        kwargs.setdefault("include_dashboard", False)
        # "local": a new Ray, not whichever cluster this machine last started (Ray's default)
        address = "local"
    with _loopback_only():
        ray.init(address=address, **kwargs)


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
            not reachable from the network; see docs/placement.md); never the cluster
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
            from .ray_placed import _PlacedRayRun

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
                            for i in range(int(res.get("GPU", 0)))]  # fmt: skip
            else:
                n = int(res.get("CPU", 0) // self.cpus_per_worker)
                memory = float(res.get("memory", 2 * 2**30)) / 2**30 / max(n, 1)
                devices += [Device(f"{short}/cpu{i}", "cpu", memory, node=node["NodeID"])
                            for i in range(n)]  # fmt: skip
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
                      deadline=deadline, restart_cost=self.restart_cost)  # fmt: skip


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


class _HubChannel:
    """The worker's line to the parent through the hub actor."""

    def __init__(self, ray, hub, key: str, group: str) -> None:
        self.ray, self.hub, self.key, self.group = ray, hub, key, group
        self.cache: set = set()
        self.checked = 0.0
        self.asked = 0

    def request(self, payload: Any) -> Any:
        self.asked += 1
        ident = f"{self.key}?{self.asked}"
        self.hub.request.remote(self.key, ident, payload)  # after this worker's reports
        wait = 0.001
        while True:
            found, value = self.ray.get(self.hub.take.remote(ident))
            if found:
                return value
            time.sleep(wait)
            wait = min(0.02, wait * 2)

    def send(self, message: tuple) -> None:
        # Calls from one worker to an actor run in order, so reports keep their order.
        self.hub.report.remote(self.key, *message[1:])

    def pruned(self) -> set:
        if time.monotonic() - self.checked > 0.2:  # a round trip per step would be slow
            self.cache = self.ray.get(self.hub.pruned.remote(self.group))
            self.checked = time.monotonic()
        return self.cache


class _PlacedHubChannel(_HubChannel):
    """The channel of a group placed by a policy: it times its steps and can be stopped."""

    def __init__(self, ray, hub, key: str, group: str) -> None:
        super().__init__(ray, hub, key, group)
        self.stop, self.stop_checked = False, 0.0
        self.timer = _StepTimer()

    def progress(self, steps: int, live: int, score: float | None) -> None:
        measured = self.timer.measure(steps, live)
        if measured is not None:
            per_step, busy = measured
            self.hub.progress.remote(self.key, steps, live, per_step, busy, score, _peak_memory())

    def stopping(self) -> bool:
        # a round trip per step would be slow; a stop is honoured within 0.2 s
        if not self.stop and time.monotonic() - self.stop_checked > 0.2:
            self.stop = self.ray.get(self.hub.stopping.remote(self.key))
            self.stop_checked = time.monotonic()
        return self.stop


@dataclass
class _RaySpec:
    group: TrialGroup
    key: str  # names this attempt in the hub
    prune_key: str  # names this group's pruned trials in the hub
    rank: int
    world_size: int
    threads: int
    attempt: int
    checkpoint_dir: Path
    pruned: set
    timeout: float = 300.0
    placed: bool = False  # a policy placed it: it reports step times and may be stopped


def _ray_worker(spec: _RaySpec, fn: WorkerFn, hub: Any) -> tuple[str, Any]:
    """Body of the Ray task for one rank of one group."""
    import ray

    torch.set_num_threads(spec.threads)
    # Ray sets CUDA_VISIBLE_DEVICES to the GPUs it granted, so ours is always cuda:0.
    device = "cuda:0" if torch.cuda.is_available() and ray.get_gpu_ids() else "cpu"
    distributed = spec.world_size > 1
    try:
        if distributed:
            _join_process_group(spec, device, hub)
        ctx = WorkerContext(
            spec.group.name,
            device,
            spec.threads,
            spec.rank,
            spec.world_size,
            spec.attempt,
            spec.checkpoint_dir,
            (_PlacedHubChannel if spec.placed else _HubChannel)(ray, hub, spec.key, spec.prune_key),
            spec.pruned,
        )
        return call_worker_fn(fn, spec.group, ctx)
    except Exception as exc:
        return "error", f"worker set-up failed: {type(exc).__name__}: {exc}"
    finally:
        ray.get(hub.flush.remote())  # the parent must see every report before the result
        if distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _join_process_group(spec: _RaySpec, device: str, hub: Any) -> None:
    """Rendezvous through a TCPStore on rank 0, whose address goes through the hub."""
    import ray
    import torch.distributed as dist

    timeout = timedelta(seconds=spec.timeout)
    if spec.rank == 0:
        host = ray.util.get_node_ip_address()
        # Port 0: the OS picks a free one. Do not wait for the peers here: they can only
        # connect once they have learnt the address published below.
        store = dist.TCPStore(
            host, 0, spec.world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        ray.get(hub.publish.remote(spec.key, f"{host}:{store.port}"))
    else:
        deadline = time.monotonic() + spec.timeout
        while (address := ray.get(hub.lookup.remote(spec.key))) is None:
            if time.monotonic() > deadline:
                raise RuntimeError("rank 0 never published its rendezvous address")
            time.sleep(0.05)
        host, port = address.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), spec.world_size, is_master=False, timeout=timeout)
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        store=store,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timeout,
    )


# --- the parent's loop ----------------------------------------------------------------


@dataclass
class _RayAttempt:
    group: TrialGroup
    attempt: int
    refs: list[Any]
    placement: Any = None
    values: dict[int, Any] = field(default_factory=dict)
    stopping: bool = False  # asked to stop at its next step boundary, to move


class _RayRun:
    def __init__(self, ex: RayExecutor, ray, ledger: Ledger, fn, report, sizes, root, hub):
        self.ex, self.ray, self.ledger, self.fn, self.report = ex, ray, ledger, fn, report
        self.sizes: dict[str, int] = dict(sizes)
        self.root, self.hub = Path(root), hub
        self.task = ray.remote(max_retries=0)(_ray_worker)
        self.run_id = uuid.uuid4().hex  # keeps this run's keys apart in the shared hub
        self.running: dict[str, _RayAttempt] = {}
        self.rank_of: dict[Any, tuple[str, int]] = {}
        self.more, self.request, self.world_size, self.capacity = None, None, 1, 0
        self.starts = 0  # makes every start's hub key unique (a moved group keeps its attempt)

    def _ask_more(self) -> bool:
        """Take new groups from ``more`` while fewer groups than slots run and none waits."""
        asked = False
        while self.more is not None and len(self.running) < self.capacity \
                and not self.ledger.pending:  # fmt: skip
            groups = list(self.more())
            if not groups:
                break
            for g in groups:
                if isinstance(g, TrialGroup):
                    self.sizes[g.name] = self.ex._size(self.world_size, g.name)
            self.ledger.submit(groups)
            while self.ledger.pending:
                self._start(*self.ledger.pending.pop(0))
            asked = True
        return asked

    def loop(self) -> None:
        # a worker waiting for an answer waits for this loop: poll often when answers are due
        tick = 0.01 if self.request is not None else 0.1
        while self._ask_more() or self.ledger.pending or self.running:
            # Ray queues tasks until resources free up, so everything pending is submitted.
            while self.ledger.pending:
                self._start(*self.ledger.pending.pop(0))
            ready, _ = self.ray.wait(list(self.rank_of), num_returns=1, timeout=tick)
            self._deliver_reports()
            ready, _ = self.ray.wait(list(self.rank_of), num_returns=len(self.rank_of), timeout=0)
            for ref in ready:
                if ref in self.rank_of:
                    self._finished(ref)

    def _start(self, group: TrialGroup, attempt: int, ranks: list[dict] | None = None) -> None:
        """Start ``group``: from the pool (one placement group for ``world_size > 1``), or with
        ``ranks``, the Ray options of each rank placed by a policy."""
        self.starts += 1
        key = f"{self.run_id}/{group.name}#{attempt}.{self.starts}"
        checkpoint_dir = self.root / re.sub(r"[^A-Za-z0-9_.-]", "_", group.name)
        private_dir(checkpoint_dir)  # 0o700 from the start, not from the first save
        size = self.sizes[group.name] if ranks is None else len(ranks)
        gpus = (1.0 if size > 1 else 1.0 / self.ex.groups_per_device) if self.ex.use_gpus else 0
        options: dict[str, Any] = {"num_cpus": self.ex.cpus_per_worker, "num_gpus": gpus}
        run = _RayAttempt(group, attempt, [])
        if size > 1 and ranks is None:
            bundle = {"CPU": self.ex.cpus_per_worker, **({"GPU": 1} if self.ex.use_gpus else {})}
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            run.placement = placement_group([bundle] * size, strategy="PACK")
        for rank in range(size):
            threads = self.ex.cpus_per_worker
            if ranks is not None:
                options, threads = dict(ranks[rank]), ranks[rank]["threads"]
                del options["threads"]
            if run.placement is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    run.placement, placement_group_bundle_index=rank
                )
            spec = _RaySpec(
                group,
                key,
                f"{self.run_id}/{group.name}",
                rank,
                size,
                threads,
                attempt,
                checkpoint_dir,
                set(self.ledger.pruned[group.name]),
                placed=ranks is not None,
            )
            ref = self.task.options(**options).remote(spec, self.fn, self.hub)
            run.refs.append(ref)
            self.rank_of[ref] = (key, rank)
        self.running[key] = run

    def _deliver_reports(self) -> None:
        for kind, key, *rest in self.ray.get(self.hub.drain.remote()):
            run = self.running.get(key)
            if kind == "request":
                ident, payload = rest
                if run is None:
                    continue  # that attempt ended; nobody waits for the answer
                if self.request is None:
                    raise RuntimeError("a worker called ctx.request but run() got no request=")
                self.hub.answer.remote(ident, self.request(run.group.name, payload))
                continue
            if kind == "progress":
                if run is not None:
                    self._progress(run, *rest)
                continue
            trial, step, value = rest
            if run is None or self.report is None:
                continue
            if trial in self.ledger.pruned[run.group.name]:
                continue
            if self.report(trial, step, value):
                self.ledger.prune(run.group, trial)
                self.hub.prune.remote(f"{self.run_id}/{run.group.name}", trial)

    def _finished(self, ref: Any) -> None:
        key, rank = self.rank_of.pop(ref)
        run = self.running.get(key)
        if run is None:
            return
        try:
            kind, payload = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:  # the worker died or was cancelled
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            kind, payload = "died", f"worker rank {rank} died: {type(exc).__name__}: {first_line}"
        if kind == "done":
            run.values[rank] = payload
            if len(run.values) == len(run.refs):
                self._end(key)
                self.ledger.done(run.group, run.attempt, run.values[0])
        elif kind == "stopped":  # stopped after a checkpoint, to move: not a retry
            run.values[rank] = None
            if len(run.values) == len(run.refs):
                self._end(key)
                self.ledger.moved(run.group, run.attempt)
        elif kind == "raised":  # deterministic: another attempt would raise it again
            self._end(key)
            self.ledger.raised(run.group, run.attempt, payload)
        elif kind == "oom":
            self._end(key)
            self.ledger.out_of_memory(run.group, run.attempt, payload)
            for part in (f"{run.group.name}/0", f"{run.group.name}/1"):
                self.sizes[part] = self.sizes[run.group.name]
        else:
            self._end(key)
            self.ledger.failed(run.group, run.attempt, payload)

    def _progress(self, run: _RayAttempt, *measured: Any) -> None:
        """A worker's ``ctx.progress``: only a placement policy uses it."""

    def _end(self, key: str) -> None:
        """Forget an attempt; cancel ranks still running (they would wait for a dead peer)."""
        self._deliver_reports()  # reports sent just before the end still reach the callback
        run = self.running.pop(key)
        if self.more is not None:  # nodes come and go: stream as many groups as fit now
            self.capacity = len(self.ex.slots)
        for ref in run.refs:
            if self.rank_of.pop(ref, None) is not None:
                self.ray.cancel(ref, force=True)
        if run.placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(run.placement)

    def stop_all(self) -> None:
        for key in list(self.running):
            self._end(key)

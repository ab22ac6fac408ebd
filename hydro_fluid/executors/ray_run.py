"""RayExecutor's parent loop and its Ray tasks: the worker's channel through the hub actor,
the task body of one rank, and the loop that starts, watches and retries them.

Split from :mod:`hydro_fluid.executors.ray` so that the placed loop
(:mod:`~hydro_fluid.executors.ray_placed`) builds on it without importing the executor.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..groups import TrialGroup
from .base import Ledger, WorkerContext, WorkerFn, call_worker_fn
from .scratch import private_dir
from .worker import _peak_memory, _StepTimer

if TYPE_CHECKING:
    from .ray import RayExecutor

__all__: list[str] = []


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
                and not self.ledger.pending:
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

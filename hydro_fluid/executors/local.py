"""LocalExecutor: fused trial groups in worker processes on this machine."""

from __future__ import annotations

import inspect
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import re
import shutil
import time
import uuid
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..groups import TrialGroup
from ..placement import Placer
from ..resources import Device
from .base import GroupResult, Ledger, MoreFn, ReportFn, RequestFn, ResultFn, WorkerFn
from .scratch import claim_mp_tempdir, private_dir

# start_ticks and _scratch_dir are imported from here by the tuner and the tests
from .worker import _scratch_dir, _Spec, _worker_main, start_ticks

__all__ = ["LocalExecutor"]


class LocalExecutor:
    """Run fused trial groups in worker processes on this machine, one per device slot.

    With GPUs, each GPU offers ``groups_per_device`` slots (packing small groups on one GPU).
    Without, there are ``num_workers`` CPU slots and the CPU threads are split between them
    (``torch.set_num_threads`` in each worker). A group given ``world_size > 1`` trains with
    real data parallelism: that many processes, each on its own slot (its own GPU), joined
    in a ``torch.distributed`` process group (gloo on CPU, nccl on GPU).

    See :mod:`hydro_fluid.executors.base` for the contract of ``fn``. A worker that dies
    (killed, crashed, or ``fn`` raised) is started again up to ``max_retries`` times, from
    the group's last checkpoint; after that its trials FAIL with the reason (one line). An
    exception whose class sets ``deterministic = True`` is not retried: it would raise again
    (``GroupResult.deterministic``). A worker that
    runs out of memory (``torch.cuda.OutOfMemoryError`` or ``MemoryError``) has its group
    split in two halves that run separately, so no trial is lost.

    With ``run(..., policy=...)`` a placement policy decides instead of the fixed pool (see
    :meth:`run`); after such a run ``decisions`` lists every :class:`Decision` (when, which
    event, the allocation) and ``measured`` what each group's workers reported (first start,
    end, first seconds per step, live members then, utilization, seconds from the start to the
    first step, steps).

    Args:
        devices: GPUs to use, e.g. ``["cuda:0", "cuda:1"]``. Default: every visible GPU, or
            the CPU when there is none. Pass ``[]`` to force the CPU.
        num_workers: Concurrent CPU workers when running on the CPU (default: up to 4, at
            most one per core).
        groups_per_device: Workers that share one GPU.
        threads: CPU threads to split between workers (default: all cores).
        max_retries: Restarts of a group whose worker died, before its trials FAIL.
        checkpoint_dir: Where each group gets its checkpoint directory (default: a
            temporary directory removed after ``run``).
        start_method: ``multiprocessing`` start method. Default ``"forkserver"`` (workers
            fork from a server that has imported torch once, so they start in a fraction
            of a second, and CUDA is never initialized before the fork), else ``"spawn"``.
        collective_timeout: Seconds a data-parallel collective may wait for a peer.
        max_packed: With a placement policy (``run(policy=...)``): most groups packed on one
            device.
        restart_cost: With a placement policy: seconds a move is assumed to cost; a running
            group moves only when the policy estimates it saves more.
        memory_budget: With a placement policy on the CPU: GiB the groups may use in all
            (default: half of the memory available when ``run`` starts).

    Example:
        >>> from hydro_fluid import LocalExecutor, TrialGroup
        >>> from hydro_fluid.executors.examples import count_steps
        >>> groups = [TrialGroup("a", (0, 1), (3, 3)), TrialGroup("b", (2,), (2,))]
        >>> seen = []
        >>> results = LocalExecutor(devices=[], num_workers=2).run(
        ...     groups, count_steps, report=lambda trial, step, value: seen.append(trial))
        >>> [r.value for r in results], sorted(set(seen))
        ([3, 2], [0, 1, 2])
        >>> {t: o.state for r in results for t, o in r.trials.items()}
        {0: 'COMPLETE', 1: 'COMPLETE', 2: 'COMPLETE'}
    """

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        *,
        num_workers: int | None = None,
        groups_per_device: int = 1,
        threads: int | None = None,
        max_retries: int = 1,
        checkpoint_dir: str | Path | None = None,
        start_method: str | None = None,
        collective_timeout: float = 300.0,
        max_packed: int = 4,
        restart_cost: float = 5.0,
        memory_budget: float | None = None,
    ) -> None:
        cores = os.cpu_count() or 1
        if devices is None:
            devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        devices = list(devices)
        for dev in devices:
            if not re.fullmatch(r"cuda(:\d+)?", dev):
                raise ValueError(
                    f"devices lists GPUs such as 'cuda:0', got {dev!r}; "
                    "pass devices=[] and num_workers=N to run on the CPU."
                )
        if groups_per_device < 1:
            raise ValueError(f"groups_per_device must be >= 1, got {groups_per_device}.")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}.")
        available = mp.get_all_start_methods()
        if start_method is None:
            start_method = "forkserver" if "forkserver" in available else "spawn"
        if start_method not in available:
            raise ValueError(
                f"start_method {start_method!r} is not available here; use one of "
                f"{mp.get_all_start_methods()}."
            )
        if devices:
            self.slots = [dev for dev in devices for _ in range(groups_per_device)]
        else:
            workers = num_workers if num_workers is not None else min(4, cores)
            if workers < 1:
                raise ValueError(f"num_workers must be >= 1, got {workers}.")
            self.slots = ["cpu"] * workers
        self.threads_per_worker = max(1, (threads or cores) // len(self.slots))
        self.max_retries = max_retries
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.start_method = start_method
        self.collective_timeout = collective_timeout
        if isinstance(max_packed, bool) or not isinstance(max_packed, int) or max_packed < 1:
            raise ValueError(f"max_packed must be an int >= 1, got {max_packed!r}.")
        if not restart_cost >= 0:
            raise ValueError(f"restart_cost must be >= 0 seconds, got {restart_cost!r}.")
        if memory_budget is not None and not memory_budget > 0:
            raise ValueError(f"memory_budget must be > 0 GiB, got {memory_budget!r}.")
        self.max_packed, self.restart_cost = max_packed, restart_cost
        self.memory_budget = memory_budget

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
        """Run ``fn(group, ctx)`` for every group and return one result per group that ran.

        Args:
            groups: The groups; names and trial ids must be unique.
            fn: Picklable ``fn(group, ctx) -> value`` run in a worker process.
            report: Called in this process as ``report(trial_id, step, value)`` for every
                value a worker reports; return ``True`` to prune that trial.
            world_size: Data-parallel processes per group: one number for all, or per group
                name (e.g. the number of devices :func:`~hydro_fluid.static_fluid` gave it).
            more: Called whenever a slot is free and no group waits; returns further groups
                to run (``[]``: none now). ``run`` ends when nothing runs or waits and ``more``
                returns none.
            on_result: Called with each group's result as soon as the group ends.
            request: Answers ``ctx.request(payload)`` of a worker: called here as
                ``request(group_name, payload)``; its return value goes back to the worker.
            preload: Modules to import once in the forkserver (with ``torch``, ``hydro_fluid``
                and ``fn``'s module), so that every worker starts with them imported; only
                the first run of this process (which starts the forkserver) can preload.
            policy: ``None`` (default): the fixed pool of slots, first come first served.
                A registered policy (:func:`~hydro_fluid.policy_names`: ``"fifo"``,
                ``"static"``, ``"dynamic"``, ``"deadline"``, ...) or a
                :class:`~hydro_fluid.Policy` object: the executor's
                devices (:meth:`placement_devices`) are placed by that policy
                (:class:`~hydro_fluid.placement.Placer`), asked at every event (a group
                starts, ends or thins out, a deadline tick) and applied for real: a share
                below 1 packs groups on one device (threads split by share), several devices
                make a group data parallel (``world_size`` from the policy, not the argument),
                and a running group the policy moves is stopped at a step boundary after a
                checkpoint (``ctx.should_stop()``) and resumed on its new devices. ``more``
                may take a keyword ``room``: the fraction of a device free for the new group.
            deadline: Seconds from the start to the deadline (a policy that uses one).
            max_world_size: Most devices one group may get from the policy (default: all).
        """
        try:
            pickle.dumps(fn)
        except Exception as exc:
            raise ValueError(
                f"fn must be picklable to reach worker processes (a module-level function or "
                f"a functools.partial of one), got {fn!r}: {exc}"
            ) from exc
        ledger = Ledger(self.max_retries, on_result=on_result)
        ledger.submit(groups)  # checks the groups first
        sizes = {g.name: self._size(world_size, g.name) for g in groups}
        root = private_dir(self.checkpoint_dir or _scratch_dir())
        if policy is None:
            run = _Run(self, ledger, fn, report, sizes, root, more, request, world_size, preload)
        else:
            placer = self._placer(policy, deadline, max_world_size)
            run = _PlacedRun(self, ledger, fn, report, sizes, root, more, request, world_size,
                             preload, placer=placer)
        try:
            run.loop()
        finally:
            run.stop_all()
            if self.checkpoint_dir is None:
                shutil.rmtree(root, ignore_errors=True)
        return ledger.ordered_results()

    def _size(self, world_size: int | Mapping[str, int], name: str) -> int:
        size = _world_size(world_size, name)
        if size > self._max_world_size():
            raise ValueError(
                f"Group {name!r} asks for world_size={size} but this executor has only "
                f"{self._max_world_size()} slot(s) for one group; lower it or add devices."
            )
        return size

    def _max_world_size(self) -> int:
        return len(set(self.slots)) if self.slots[0] != "cpu" else len(self.slots)

    def placement_devices(self) -> list[Device]:
        """This executor's devices as a placement policy sees them.

        On GPUs, each GPU with its total memory. On the CPU, one device per worker slot
        (``num_workers``), each with its share of the threads and of the memory budget
        (``memory_budget``, default half of the memory available now).
        """
        gpus = sorted(set(self.slots)) if self.slots[0] != "cpu" else []
        if gpus:
            return [Device(dev, "gpu", _gpu_gib(dev), node="local") for dev in gpus]
        budget = self.memory_budget or 0.5 * _available_gib()
        n = len(self.slots)
        return [Device(f"cpu{i}", "cpu", budget / n, node="local") for i in range(n)]

    def _placer(self, policy: str, deadline: float | None, d: int | None) -> Placer:
        devices = self.placement_devices()
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"max_world_size must be an int >= 1, got {d!r}.")
        return Placer(policy, devices, c=self.max_packed, d=min(d or len(devices), len(devices)),
                      deadline=deadline, restart_cost=self.restart_cost)


def _gpu_gib(device: str) -> float:
    return torch.cuda.get_device_properties(torch.device(device)).total_memory / 1024**3


def _available_gib() -> float:
    """GiB of memory available now (Linux ``MemAvailable``; else the machine's total)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3


def _world_size(world_size: int | Mapping[str, int], name: str) -> int:
    size = world_size.get(name, 1) if isinstance(world_size, Mapping) else world_size
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"world_size of group {name!r} must be an int >= 1, got {size!r}.")
    return size


@dataclass
class _Attempt:
    """One start of one group: its worker processes and what they have sent back."""

    group: TrialGroup
    attempt: int
    slots: list[int]
    procs: list[Any] = field(default_factory=list)
    inboxes: list[Any] = field(default_factory=list)  # worker -> parent, one pipe per rank
    outboxes: list[Any] = field(default_factory=list)  # parent -> worker: pruned trial ids
    values: dict[int, Any] = field(default_factory=dict)
    stopping: bool = False  # asked to stop at its next step boundary, to move


class _Run:
    """The parent's event loop for one ``LocalExecutor.run`` call."""

    def __init__(self, executor: LocalExecutor, ledger: Ledger, fn, report, sizes, root: Path,
                 more=None, request=None, world_size=1, preload=()):
        self.ex, self.ledger, self.fn, self.report = executor, ledger, fn, report
        self.more, self.request, self.world_size = more, request, world_size
        self.sizes: dict[str, int] = dict(sizes)
        self.root = root
        self.ctx = mp.get_context(executor.start_method)
        claim_mp_tempdir()  # the fork server's socket lives there; a killed run's are swept
        if executor.start_method == "forkserver":
            # fn's module too (the tuner's driver imports in seconds): every worker forks with
            # it imported. Only the run that starts this process's forkserver decides.
            module = getattr(getattr(fn, "func", fn), "__module__", None)
            extra = [module] if module and module != "__main__" else []
            modules = ["torch", "hydro_fluid.executors", *extra, *preload]
            self.ctx.set_forkserver_preload([*modules, "hydro_fluid.executors._forkserver"])
        self.free = set(range(len(executor.slots)))
        self.running: dict[str, _Attempt] = {}

    def loop(self) -> None:
        while self._ask_more() or self.ledger.pending or self.running:
            self._launch_what_fits()
            self._wait_and_read()

    def _wait_and_read(self) -> None:
        """Wait (at most 0.5 s) for a worker's message or exit, then handle what came."""
        waitables = [c for run in self.running.values() for c in run.inboxes if not c.closed]
        waitables += [p.sentinel for run in self.running.values() for p in run.procs]
        mp_connection.wait(waitables, timeout=0.5)
        for key in list(self.running):
            self._read(key)
        self._reap_dead_workers()

    # -- starting ------------------------------------------------------------------------

    def _ask_more(self) -> bool:
        """Take new groups from ``more`` while a slot is free and none waits."""
        asked = False
        while self.more is not None and self.free and not self.ledger.pending:
            groups = list(self.more())
            if not groups:
                break
            for g in groups:
                if isinstance(g, TrialGroup):
                    self.sizes[g.name] = self.ex._size(self.world_size, g.name)
            self.ledger.submit(groups)
            self._launch_what_fits()
            asked = True
        return asked

    def _launch_what_fits(self) -> None:
        for group, attempt in list(self.ledger.pending):
            slots = self._pick_slots(self.sizes[group.name])
            if slots is None:
                continue
            self.ledger.pending.remove((group, attempt))
            self._start(group, attempt, slots)

    def _pick_slots(self, k: int) -> list[int] | None:
        """``k`` free slots, on ``k`` different GPUs (any ``k`` CPU slots)."""
        chosen, devices = [], set()
        for slot in sorted(self.free):
            device = self.ex.slots[slot]
            if device != "cpu" and device in devices:
                continue
            chosen.append(slot)
            devices.add(device)
            if len(chosen) == k:
                return chosen
        return None

    def _start(self, group: TrialGroup, attempt: int, slots: list[int],
               ranks: list[tuple[str, int]] | None = None) -> None:
        """Start ``group`` on ``slots`` of the pool, or on ``ranks`` ((device, threads) per
        rank) placed by a policy."""
        if ranks is None:
            ranks = [(self.ex.slots[slot], self.ex.threads_per_worker) for slot in slots]
        key = f"{group.name}#{attempt}"
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", group.name)
        checkpoint_dir = self.root / safe
        private_dir(checkpoint_dir)
        store = None
        if len(ranks) > 1:  # a fresh rendezvous file per attempt
            (self.root / ".rendezvous").mkdir(exist_ok=True)
            store = self.root / ".rendezvous" / f"{safe}-{attempt}-{uuid.uuid4().hex}"
        self.free -= set(slots)
        run = _Attempt(group, attempt, slots)
        self.running[key] = run
        for rank, (device, threads) in enumerate(ranks):
            inbox, worker_outbox = self.ctx.Pipe(duplex=False)
            worker_inbox, outbox = self.ctx.Pipe(duplex=False)
            spec = _Spec(
                group,
                rank,
                len(ranks),
                device,
                threads,
                attempt,
                checkpoint_dir,
                store,
                self.ex.collective_timeout,
                set(self.ledger.pruned[group.name]),
                os.getpid(),
                start_ticks(os.getpid()),
            )
            proc = self.ctx.Process(
                target=_worker_main,
                args=(spec, self.fn, worker_outbox, worker_inbox),
                name=f"hydro-fluid-{key}-rank{rank}",
            )
            proc.start()
            worker_outbox.close()  # the worker's copies; closing ours lets EOF show a death
            worker_inbox.close()
            run.procs.append(proc)
            run.inboxes.append(inbox)
            run.outboxes.append(outbox)

    # -- messages ------------------------------------------------------------------------

    def _read(self, key: str) -> None:
        """Handle every message the attempt's workers have sent so far."""
        for rank in range(len(self.running[key].inboxes)):
            run = self.running.get(key)
            if run is None:
                return  # ended by an earlier message
            inbox = run.inboxes[rank]
            try:
                while not inbox.closed and inbox.poll():
                    self._handle(key, rank, pickle.loads(inbox.recv_bytes()))
                    if key not in self.running:
                        return
            except (EOFError, OSError):
                inbox.close()  # the worker is gone; _reap_dead_workers decides what it means

    def _handle(self, key: str, rank: int, message: tuple) -> None:
        run = self.running[key]
        kind, *rest = message
        if kind == "report":
            self._on_report(run, *rest)
        elif kind == "request":
            ident, payload = rest
            if self.request is None:
                raise RuntimeError("a worker called ctx.request but run() was given no request=")
            answer = self.request(run.group.name, payload)
            try:
                run.outboxes[rank].send_bytes(pickle.dumps(("answer", ident, answer)))
            except OSError:
                pass  # the worker died meanwhile; _reap_dead_workers sees to it
        elif kind == "done":
            run.values[rank] = rest[0]
            if len(run.values) == len(run.procs):
                self._end(key, kill=False)
                self.ledger.done(run.group, run.attempt, run.values[0])
        elif kind == "progress":
            self._progress(run, *rest)
        elif kind == "stopped":
            run.values[rank] = None
            if len(run.values) == len(run.procs):
                self._end(key, kill=False)
                self.ledger.moved(run.group, run.attempt)
        elif kind == "raised":  # deterministic: another attempt would raise it again
            self._end(key)
            self.ledger.raised(run.group, run.attempt, rest[0])
        elif kind == "oom":
            self._end(key)
            self.ledger.out_of_memory(run.group, run.attempt, rest[0])
            for part in (f"{run.group.name}/0", f"{run.group.name}/1"):
                self.sizes[part] = self.sizes[run.group.name]
        else:
            self._end(key)
            self.ledger.failed(run.group, run.attempt, rest[0])

    def _progress(self, run: _Attempt, *measured: Any) -> None:
        """A worker's ``ctx.progress``: only a placement policy uses it."""

    def _on_report(self, run: _Attempt, trial_id: Hashable, step: int, value: float) -> None:
        pruned = self.ledger.pruned[run.group.name]
        if trial_id in pruned or self.report is None:
            return
        if self.report(trial_id, step, value):
            self.ledger.prune(run.group, trial_id)
            for outbox in run.outboxes:
                try:
                    outbox.send_bytes(pickle.dumps(("pruned", trial_id)))
                except OSError:
                    pass  # that worker already exited; nothing left to tell it

    # -- failures and clean-up -----------------------------------------------------------

    def _reap_dead_workers(self) -> None:
        for key in list(self.running):
            run = self.running[key]
            dead = [
                (rank, p.exitcode)
                for rank, p in enumerate(run.procs)
                if p.exitcode is not None and rank not in run.values
            ]
            if not dead:
                continue
            self._read(key)  # a last message may have arrived just before the exit
            if key not in self.running:
                continue
            rank, code = dead[0]
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            self._end(key)
            self.ledger.failed(run.group, run.attempt, f"worker process rank {rank} died ({how})")

    def _end(self, key: str, kill: bool = True) -> None:
        """Stop an attempt's processes and free its slots.

        After a failure the peers of the failed rank are killed: they would wait for it in
        the next collective. After success they are given a moment to exit on their own.
        """
        run = self.running.pop(key)
        deadline = time.monotonic() + (0.0 if kill else 5.0)
        for proc in run.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in run.inboxes + run.outboxes:
            conn.close()
        self.free |= set(run.slots)

    def stop_all(self) -> None:
        for key in list(self.running):
            self._end(key)


@dataclass
class Decision:
    """One placement decision of a policy-driven run: when, why, and the allocation."""

    seconds: float  # since the run started
    event: str  # "start", "new group", "ended", "thinned", "drained", "tick"
    allocation: dict[str, tuple[tuple[str, float], ...]]


class PlacementEvents:
    """What both executors' policy-driven loops do alike: move the ledger's queue into the
    :class:`~hydro_fluid.placement.Placer` and take new groups from a stream while a device
    has room. The loop provides ``placer``, ``ledger``, ``waiting``, ``attempts``,
    ``running``, ``more``, ``event`` and ``_decide``."""

    def _turn(self) -> bool:
        """Place what the last events changed and take new groups; False once nothing runs,
        nothing waits and the stream has none."""
        self._sync()
        if self.event is not None:
            self._decide(self.event)
        asked = self._ask_more()
        return bool(asked or self.waiting or self.running)

    def _sync(self) -> None:
        """Move the ledger's queue (new, retried, split, moved groups) into the placer."""
        for group, attempt in self.ledger.pending:
            self.placer.wait(group)
            self.waiting[group.name], self.attempts[group.name] = group, attempt
            self.event = self.event or "ended"
        self.ledger.pending.clear()
        live = {run.group.name for run in self.running.values()} | set(self.waiting)
        for name in [n for n in self.placer.groups if n not in live]:
            self.placer.ended(name)

    def _ask_more(self) -> bool:
        """Take new groups from ``more`` while no group waits and a device has room."""
        asked = False
        while self.more is not None and not self.waiting:
            room = self.placer.room()
            if room <= 0:
                break
            wants_room = "room" in inspect.signature(self.more).parameters
            groups = list(self.more(room=room) if wants_room else self.more())
            if not groups:
                if not self.placer.widen:  # the stream ran dry: its tail may widen now
                    self.placer.widen = True
                    self.event = self.event or "drained"
                break
            self.placer.widen = False
            self.ledger.submit(groups)
            self.event = "new group"
            self._sync()
            self._decide(self.event)
            asked = True
        return asked


class _PlacedRun(PlacementEvents, _Run):
    """The event loop when a placement policy decides where groups run.

    Every event asks the :class:`~hydro_fluid.placement.Placer` for an allocation and applies
    it: waiting groups start on the devices it gives them (``world_size`` = their number,
    threads by share), and a running group whose devices change is asked to stop after a
    checkpoint; it comes back through the ledger as a move and starts where the policy puts it.
    """

    def __init__(self, *args: Any, placer: Placer) -> None:
        super().__init__(*args)
        self.placer = placer
        self.attempts: dict[str, int] = {}  # waiting group -> its attempt number
        self.waiting: dict[str, TrialGroup] = {}
        self.event: str | None = "start"
        self.t0 = time.monotonic()
        self.last_tick = self.t0
        self.threads = self.ex.threads_per_worker  # per placement device
        self.ex.decisions = []  # type: ignore[attr-defined]
        self.ex.measured = {}  # type: ignore[attr-defined]
        self.placer.widen = self.more is None  # a stream widens groups once it runs dry

    def loop(self) -> None:
        while True:
            if not self._turn():
                return
            self._wait_and_read()
            if self.placer.tick_due(self.last_tick):
                self.last_tick = time.monotonic()
                self.event = self.event or "tick"

    def _decide(self, event: str) -> None:
        self.event = None
        plan = self.placer.decide()
        self.ex.decisions.append(Decision(time.monotonic() - self.t0, event, plan))
        for run in list(self.running.values()):
            name = run.group.name
            if run.stopping:
                continue
            now, new = self.placer.running.get(name, ()), plan.get(name, ())
            if sorted(dev for dev, _ in now) == sorted(dev for dev, _ in new):
                # same devices: no restart; it keeps the share (threads) it was started with
                continue
            run.stopping = True  # moved, rescaled or preempted: stop after a checkpoint
            for outbox in run.outboxes:
                try:
                    outbox.send_bytes(pickle.dumps(("stop",)))
                except OSError:
                    pass  # that worker already exited
        for name in [n for n in self.waiting if n in plan]:
            group, slots = self.waiting.pop(name), plan[name]
            ranks = [(self._torch_device(dev), self.placer.threads(share, self.threads))
                     for dev, share in slots]
            self.placer.started(name, slots)
            self._start(group, self.attempts.pop(name), [], ranks)
            record = self.ex.measured.setdefault(name, {"start": time.monotonic() - self.t0})
            record["slots"] = slots

    def _end(self, key: str, kill: bool = True) -> None:
        name = self.running[key].group.name
        super()._end(key, kill)
        self.ex.measured.setdefault(name, {})["end"] = time.monotonic() - self.t0
        self.event = self.event or "ended"

    def _torch_device(self, name: str) -> str:
        return "cpu" if name.startswith("cpu") else name

    def _progress(self, run: _Attempt, *measured: Any) -> None:
        steps, live, per_step, busy, score, memory = measured
        record = self.ex.measured.setdefault(run.group.name, {})
        if "seconds_per_step" not in record:  # the first steps: what the simulator replays
            record.update(seconds_per_step=per_step, live=live, utilization=busy)
            # the worker's start (fork, imports, building the model) before its first step
            since = time.monotonic() - self.t0 - record.get("start", 0.0)
            record["startup"] = max(0.0, since - per_step * steps)
        record["steps"] = steps
        if self.placer.observe(run.group.name, steps, live, per_step, busy, score, memory):
            self.event = self.event or "thinned"

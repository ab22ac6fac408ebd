"""The worker side of LocalExecutor: a worker process, its pipes to the parent, its life.

Each worker runs ``fn(group, ctx)`` for one rank of one group. It dies with the process that
started the run, talks to the parent over two private pipes, and joins a ``torch.distributed``
group when its group trains data parallel.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch

from ..groups import TrialGroup
from .base import WorkerContext, WorkerFn, call_worker_fn
from .scratch import _alive, start_ticks


def _scratch_dir() -> Path:
    """A fresh private directory for one run's checkpoints, under ``$TMPDIR/hydro-fluid-UID``.

    Each run's directory is named after its process; a process killed before it could clean up
    leaves it behind, so every new run first removes those of processes no longer alive.
    """
    base = (
        Path(tempfile.gettempdir()) / f"hydro-fluid-{os.getuid() if hasattr(os, 'getuid') else 0}"
    )
    try:
        base.mkdir(mode=0o700, exist_ok=True)
        st = base.lstat()
        if base.is_symlink() or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            raise PermissionError(f"{base} is not a directory of this user")
        os.chmod(base, 0o700)
    except OSError:  # shared or foreign: fall back to a private directory of its own
        return Path(tempfile.mkdtemp(prefix="hydro-fluid-"))
    for old in base.glob("run-*"):
        try:
            _, pid, ticks, _ = old.name.split("-", 3)
            if not _alive(int(pid), None if ticks == "x" else int(ticks)):
                shutil.rmtree(old, ignore_errors=True)
        except ValueError:
            continue
    ticks = start_ticks(os.getpid())
    prefix = f"run-{os.getpid()}-{'x' if ticks is None else ticks}-"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def _die_with_parent(parent: int, ticks: int | None) -> None:
    """Make this worker die when the process that started the run dies, even by SIGKILL.

    On Linux the kernel sends SIGKILL when the parent exits (``PR_SET_PDEATHSIG``); a thread
    that watches the run's process covers other systems and the forkserver in between.
    """
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while _alive(parent, ticks):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="hydro-fluid-watchdog", daemon=True).start()
    if not _alive(parent, ticks):
        os._exit(1)


def _orphaned() -> NoReturn:
    """Leave at once, and quietly: the pipe to the parent broke, so the process that started
    the run is gone (killed, or stopping) and nothing is left to report to. A traceback here
    would only land in the dead tuner's log."""
    os._exit(1)


@dataclass
class _Spec:
    """Everything a worker process needs to start (pickled to the child)."""

    group: TrialGroup
    rank: int
    world_size: int
    device: str
    threads: int
    attempt: int
    checkpoint_dir: Path
    store: Path | None
    timeout: float
    pruned: set
    parent: int = 0
    parent_ticks: int | None = None


class _PipeChannel:
    """The worker's end of its two private pipes to the parent.

    Each worker has its own pipes rather than one shared queue: a worker killed in the middle
    of a write then damages only its own pipe, never the other workers' line to the parent.
    """

    def __init__(self, outbox: Any, inbox: Any) -> None:
        self.outbox, self.inbox = outbox, inbox
        self.lock = threading.Lock()  # fn may report from several threads
        self.found: set = set()  # pruned trial ids read while waiting for an answer
        self.asked = 0
        self.stop = False  # the parent asked the group to stop and move
        self.timer = _StepTimer()

    def send(self, message: tuple) -> None:
        # Plain pickle, not the multiprocessing pickler: that one shares tensors through the
        # sender's memory, which is gone once a finished worker exits.
        data = pickle.dumps(message)
        with self.lock:
            try:
                self.outbox.send_bytes(data)
            except OSError:  # BrokenPipeError, ConnectionResetError: the parent is gone
                _orphaned()

    def _recv(self) -> tuple:
        try:
            return pickle.loads(self.inbox.recv_bytes())
        except (EOFError, OSError):
            _orphaned()

    def _take(self, message: tuple) -> tuple | None:
        """Keep a prune or stop notice; return anything else (an answer)."""
        kind, *rest = message
        if kind == "pruned":
            self.found.add(rest[0])
        elif kind == "stop":
            self.stop = True
        else:
            return message
        return None

    def _drain(self) -> None:
        try:
            while self.inbox.poll():
                self._take(self._recv())
        except (EOFError, OSError):  # poll of a pipe whose other end is gone
            _orphaned()

    def pruned(self) -> set:
        self._drain()
        found, self.found = self.found, set()
        return found

    def stopping(self) -> bool:
        self._drain()
        return self.stop

    def progress(self, steps: int, live: int, score: float | None) -> None:
        """Send wall seconds per step and the busy fraction of the worker's threads
        (:func:`runnable_seconds`) since the last message (at most every 0.2 s)."""
        measured = self.timer.measure(steps, live)
        if measured is not None:
            self.send(("progress", steps, live, *measured, score, _peak_memory()))

    def request(self, payload: Any) -> Any:
        self.asked += 1
        ident = self.asked
        self.send(("request", ident, payload))
        while True:  # the parent answers in order; prunes and stops may come in between
            message = self._take(self._recv())
            if message is not None and message[1] == ident:
                return message[2]


def runnable_seconds() -> float:
    """Seconds this process's threads were running or ready to run (waiting for a core).

    Its utilization is this over wall time times its threads: what the worker would use of
    its cores, also on a shared CPU. CPU time alone (``time.process_time``) reads the share
    the other processes left it, so a compute-bound worker under contention would look half
    idle and the policies would pack more where there is less room. Linux's per-thread
    ``schedstat`` (on-CPU and run-queue nanoseconds) gives both; elsewhere, CPU time.
    """
    total = 0
    try:
        for task in os.scandir("/proc/self/task"):
            try:
                with open(f"{task.path}/schedstat") as f:
                    run, wait, _ = f.read().split()
            except (OSError, ValueError):  # the thread ended meanwhile
                continue
            total += int(run) + int(wait)
    except OSError:
        return time.process_time()
    return total / 1e9 if total else time.process_time()


class _StepTimer:
    """Times a worker's steps for ``ctx.progress``: wall seconds per step and the busy fraction
    of its threads since the last measure, at most every 0.2 s or when ``live`` changes."""

    def __init__(self) -> None:
        self.sent = (0.0, -1)  # (when, live) of the last measure
        self.clock = (time.perf_counter(), runnable_seconds(), 0)  # at the last measure

    def measure(self, steps: int, live: int) -> tuple[float, float] | None:
        """``(seconds_per_step, busy)`` when one is due, else ``None``."""
        now = time.perf_counter()
        if self.sent[1] < 0:  # the first step: start the clock here, not at the worker's start
            self.sent, self.clock = (now, live), (now, runnable_seconds(), steps)
            return None
        if now - self.sent[0] < 0.2 and live == self.sent[1]:
            return None
        wall0, cpu0, steps0 = self.clock
        cpu = runnable_seconds()
        measured = None
        if steps > steps0:
            per_step = (now - wall0) / (steps - steps0)
            busy = max(0.0, cpu - cpu0) / max(now - wall0, 1e-9) / torch.get_num_threads()
            measured = per_step, busy
        self.sent, self.clock = (now, live), (now, cpu, steps)
        return measured


def _peak_memory() -> float | None:
    """GiB this worker's GPU has held at most (``None`` on the CPU: memory does not bind)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 1024**3
    return None


def _worker_main(spec: _Spec, fn: WorkerFn, outbox: Any, inbox: Any) -> None:
    """Entry point of a worker process."""
    if spec.parent:
        _die_with_parent(spec.parent, spec.parent_ticks)
    torch.set_num_threads(spec.threads)
    distributed = spec.world_size > 1
    channel = _PipeChannel(outbox, inbox)
    try:
        if spec.device.startswith("cuda"):
            torch.cuda.set_device(spec.device)
        if distributed:
            import torch.distributed as dist

            dist.init_process_group(
                "nccl" if spec.device.startswith("cuda") else "gloo",
                store=dist.FileStore(str(spec.store), spec.world_size),
                rank=spec.rank,
                world_size=spec.world_size,
                timeout=timedelta(seconds=spec.timeout),
            )
        ctx = WorkerContext(
            spec.group.name,
            spec.device,
            spec.threads,
            spec.rank,
            spec.world_size,
            spec.attempt,
            spec.checkpoint_dir,
            channel,
            spec.pruned,
        )
        kind, payload = call_worker_fn(fn, spec.group, ctx)
    except Exception as exc:  # set-up failed before fn ran
        kind, payload = "error", f"worker set-up failed: {type(exc).__name__}: {exc}"
    if distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    channel.send((kind, payload))
    outbox.close()

"""A real pipeline-parallel job with a guest trial group in its bubbles, on this machine.

Two processes, joined by ``torch.distributed`` (gloo over 127.0.0.1), train an MLP split in
two stages with a 1F1B schedule over ``m`` micro-batches, sending activations forward and
gradients backward. Whenever a stage waits for a receive, a thread waits on the receive
while the main thread trains a *guest*: ``n`` trials of a small MLP fused with
:func:`hydro.fuse` and trained by :class:`hydro.optim.Adam`, one fused step at a time. A
step starts only if, by 1.5 x the guest's median measured step, it ends before the receive is
expected to complete (the wait of that slot in the warm-up iterations, which run without
the guest), so the host is delayed at most by timing noise.

The guest touches none of the host's tensors, data or random streams, so the host's
parameters after ``k`` steps are bit-identical with and without it.

An example, not library code: the host and guest models are demos. Run it from the
repository's root (the stages are spawned processes that import this module)::

    python -c "from examples.coordinator.pipeline import run_pipeline; print(run_pipeline())"
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import socket
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PipelineRun", "run_pipeline"]


@dataclass
class PipelineRun:
    """What a real 2-stage run did.

    Attributes:
        params: The host's parameters after the run, per stage (``{name: tensor}``).
        iteration_times: Seconds of every measured host iteration (stage 0's clock, warm-up
            iterations excluded).
        guest_steps: Fused guest steps run on each stage.
        guest_trials: Fusion size of each stage's guest.
        guest_loss: Mean guest loss over its trials at its first and last step, per stage.
        wait_time: Seconds each stage waited for a receive in the measured iterations.
        guest_time: Seconds of guest steps on each stage.
        overrun: Seconds by which guest steps outlasted a receive that had completed, per
            stage: the host's delay caused by the guest on that stage.
        expected_wait: Per stage, the wait of every receive slot of an iteration that guest
            steps must fit in (measured in the warm-up iterations).
        guest_step: Per stage, the guest step duration the policy plans with.
    """

    params: list[dict[str, torch.Tensor]]
    iteration_times: list[float]
    guest_steps: list[int] = field(default_factory=lambda: [0, 0])
    guest_trials: int = 0
    guest_loss: list[tuple[float, float] | None] = field(default_factory=lambda: [None, None])
    wait_time: list[float] = field(default_factory=lambda: [0.0, 0.0])
    guest_time: list[float] = field(default_factory=lambda: [0.0, 0.0])
    overrun: list[float] = field(default_factory=lambda: [0.0, 0.0])
    expected_wait: list[dict[int, float]] = field(default_factory=lambda: [{}, {}])
    guest_step: list[float] = field(default_factory=lambda: [0.0, 0.0])

    @property
    def iteration_time(self) -> float:
        """Median seconds per host iteration."""
        return statistics.median(self.iteration_times)

    @property
    def trial_steps(self) -> int:
        """Trial-steps the guest gained (fused steps times the fusion size), both stages."""
        return sum(self.guest_steps) * self.guest_trials


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pipeline(
    steps: int = 4,
    micro_batches: int = 4,
    *,
    guest: bool | Sequence[bool] = True,
    guest_trials: int = 4,
    guest_width: int = 32,
    width: int = 256,
    batch: int = 32,
    warmup: int = 2,
    seed: int = 0,
    timeout: float = 120.0,
) -> PipelineRun | list[PipelineRun]:
    """Train a 2-stage pipeline for ``warmup + steps`` iterations in two processes.

    With a sequence for ``guest`` the same two processes train the host once per entry,
    from the same initialization and data, with or without the guest, and a list of runs
    comes back (side by side on the same processes: cheaper and fairer to compare).

    Args:
        steps: Measured host iterations (after ``warmup``); the guest runs in these.
        micro_batches: ``m``, micro-batches per iteration (1F1B).
        guest: Run the guest trial group in the bubbles (or one flag per run).
        guest_trials: Trials fused into the guest group.
        guest_width: Hidden width of the guest MLP (its step must fit the bubbles).
        width: Hidden width of the host MLP.
        batch: Samples per micro-batch.
        warmup: Iterations without the guest first, which measure every receive's wait.
        seed: Seed of the host's weights and data.
        timeout: Seconds before the run is abandoned.

    Raises:
        ValueError: Bad arguments.
        RuntimeError: A process failed or the run timed out.
    """
    for name, value in (("steps", steps), ("micro_batches", micro_batches)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}.")
    if warmup < 1 or guest_trials < 1 or width < 1 or batch < 1 or guest_width < 1:
        raise ValueError("warmup, guest_trials, width, guest_width and batch must be >= 1.")
    flags = [bool(guest)] if isinstance(guest, bool) else [bool(g) for g in guest]
    if not flags:
        raise ValueError("guest is an empty sequence; give at least one run.")
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    config = dict(
        steps=steps,
        m=micro_batches,
        guests=flags,
        n=guest_trials,
        guest_width=guest_width,
        width=width,
        batch=batch,
        warmup=warmup,
        seed=seed,
        address=f"tcp://127.0.0.1:{_free_port()}",
    )
    results = ctx.Queue()
    procs = [ctx.Process(target=_stage, args=(r, config, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < 2:
            try:
                rank, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_module.Empty:
                raise RuntimeError(f"The pipeline run did not finish within {timeout} s.") from None
            if isinstance(payload, str):
                raise RuntimeError(f"Pipeline stage {rank} failed:\n{payload}")
            got[rank] = payload
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    runs = [
        PipelineRun(
            params=[_from_bytes(got[r][k]["params"]) for r in range(2)],
            iteration_times=got[0][k]["times"],
            guest_steps=[got[r][k]["guest_steps"] for r in range(2)],
            guest_trials=guest_trials if flag else 0,
            guest_loss=[got[r][k]["guest_loss"] for r in range(2)],
            wait_time=[got[r][k]["wait"] for r in range(2)],
            guest_time=[got[r][k]["guest_time"] for r in range(2)],
            overrun=[got[r][k]["overrun"] for r in range(2)],
            expected_wait=[got[r][k]["expected"] for r in range(2)],
            guest_step=[got[r][k]["estimate"] for r in range(2)],
        )
        for k, flag in enumerate(flags)
    ]
    return runs[0] if isinstance(guest, bool) else runs


def _to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


class _Guest:
    """A fused trial group that trains one step at a time when there is room."""

    def __init__(self, n: int, width: int) -> None:
        import hydro

        torch.manual_seed(1234)  # the guest's own stream; the host's is fixed before
        self.model = hydro.fuse(
            nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4)), n=n
        )
        self.opt = hydro.optim.Adam(
            self.model.parameters(), lr=[10 ** -(2 + k % 3) for k in range(n)]
        )
        gen = torch.Generator().manual_seed(99)
        self.x = torch.randn(64, 16, generator=gen)
        self.y = (self.x[:, :4].argmax(1) + (self.x[:, 4] > 0).long()) % 4
        self.steps, self.first, self.last = 0, None, None
        self.durations: list[float] = []
        for _ in range(3):  # the first calls trace and allocate; they are not typical
            self.step()
        self.durations.clear()
        for _ in range(7):  # measure steps before trusting one to fit a bubble
            self.step()
        self.steps = 0

    @property
    def estimate(self) -> float:
        """Seconds planned for the next step: 1.5 x the median of the recent ones.

        Not the slowest: on a shared CPU one preempted step would keep the guest out of
        every bubble; the margin covers ordinary jitter and the overrun is measured.
        """
        return 1.5 * statistics.median(self.durations[-21:])

    def step(self) -> float:
        import hydro

        t0 = time.perf_counter()
        loss = hydro.trial_loss(F.cross_entropy, self.model(self.x), self.y)
        self.opt.zero_grad(set_to_none=True)
        loss.sum().backward()
        self.opt.step()
        seconds = time.perf_counter() - t0
        value = float(loss.detach().mean())
        if self.steps == 0:
            self.first = value
        self.last = value
        self.steps += 1
        self.durations.append(seconds)
        return seconds


def _stage(rank: int, cfg: dict, results: Any) -> None:
    try:
        results.put((rank, _train(rank, cfg)))
    except BaseException:  # report any failure to the parent, then exit
        import traceback

        results.put((rank, traceback.format_exc()))


def _train(rank: int, cfg: dict) -> list[dict]:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # one core per stage, as on a device; also keeps sums in order
    dist.init_process_group("gloo", init_method=cfg["address"], rank=rank, world_size=2)
    try:
        return [_train_once(rank, cfg, flag) for flag in cfg["guests"]]
    finally:
        dist.destroy_process_group()


def _train_once(rank: int, cfg: dict, with_guest: bool) -> dict:
    import torch.distributed as dist

    m, b, w = cfg["m"], cfg["batch"], cfg["width"]
    torch.manual_seed(cfg["seed"] + rank)
    if rank == 0:
        model = nn.Sequential(nn.Linear(32, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU())
    else:
        model = nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    guest = _Guest(cfg["n"], cfg["guest_width"]) if with_guest else None
    expected: dict[int, float] = {}  # receive slot -> shortest wait seen in warm-up
    stats = {"wait": 0.0, "guest_time": 0.0, "overrun": 0.0}
    times = []

    def receive(buf: torch.Tensor, src: int, slot: int, measured: bool, use_guest: bool) -> None:
        t0 = time.perf_counter()
        req = dist.irecv(buf, src)
        done = threading.Event()
        finished = [0.0]

        def wait() -> None:
            req.wait()
            finished[0] = time.perf_counter()
            done.set()

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        budget = expected.get(slot, 0.0)
        while use_guest and not done.is_set():
            if time.perf_counter() - t0 + guest.estimate > budget:
                break  # the next step would not fit the bubble: do not start it
            t_step = time.perf_counter()
            guest.step()
            end = time.perf_counter()
            stats["guest_time"] += end - t_step
            if done.is_set():
                stats["overrun"] += end - max(finished[0], t_step)
        waiter.join()
        wait = finished[0] - t0
        if not measured:
            expected[slot] = min(expected.get(slot, float("inf")), wait)
        else:
            stats["wait"] += wait

    for it in range(cfg["warmup"] + cfg["steps"]):
        measured = it >= cfg["warmup"]
        use_guest = measured and guest is not None
        gen = torch.Generator().manual_seed(cfg["seed"] * 1000 + it)
        xs = torch.randn(m, b, 32, generator=gen)
        ys = torch.randint(0, 10, (m, b), generator=gen)
        t_start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        sends = []
        slot = 0
        if rank == 0:
            outputs: dict[int, torch.Tensor] = {}
            # 1F1B on the first of 2 stages: one warm-up forward, then F(j), B(j - 1).
            order = [("F", 0)] + [op for j in range(1, m) for op in (("F", j), ("B", j - 1))]
            for kind, j in order + [("B", m - 1)]:
                if kind == "F":
                    outputs[j] = model(xs[j])
                    sends.append(dist.isend(outputs[j].detach().contiguous(), 1))
                else:
                    grad = torch.empty(b, w)
                    receive(grad, 1, slot, measured, use_guest)
                    slot += 1
                    outputs.pop(j).backward(grad)
        else:
            for j in range(m):
                act = torch.empty(b, w)
                receive(act, 0, slot, measured, use_guest)
                slot += 1
                act.requires_grad_(True)
                loss = F.cross_entropy(model(act), ys[j]) / m
                loss.backward()
                sends.append(dist.isend(act.grad.contiguous(), 0))
        for req in sends:
            req.wait()
        opt.step()
        if measured:
            times.append(time.perf_counter() - t_start)
    dist.barrier()
    return {
        # As bytes: tensors shared by file descriptor die with this process.
        "params": _to_bytes({k: v.detach().clone() for k, v in model.state_dict().items()}),
        "times": times,
        "guest_steps": guest.steps if guest else 0,
        "guest_loss": (guest.first, guest.last) if guest and guest.steps else None,
        "expected": dict(expected),
        "estimate": guest.estimate if guest else 0.0,
        **stats,
    }

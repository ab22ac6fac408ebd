"""A pipeline-parallel host job: its schedule, and the bubbles that follow from it.

A job of ``p`` stages (one device each) trains on ``m`` micro-batches per iteration. Every
stage runs a forward (``F``) and a backward (``B``) op per micro-batch, in an order fixed by
the schedule:

* **GPipe**: all forwards, then all backwards.
* **1F1B** (PipeDream-flush): stage ``i`` runs ``min(p - i - 1, m)`` warm-up forwards, then
  alternates one forward and one backward, then drains the remaining backwards.

An op starts when its stage is free and its input is there: ``F`` of stage ``i`` needs ``F``
of stage ``i - 1`` on the same micro-batch, ``B`` of stage ``i`` needs ``B`` of stage
``i + 1`` (and its own ``F``). Iterations end with a flush (every backward done, then the
optimizer step), so they repeat exactly. The idle gaps of each stage are the *bubbles*; a
stage holds the activations of every micro-batch whose forward has run and backward has
not, which gives its memory over time and the memory free during each bubble.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Bubble", "Op", "PipelineJob", "Timeline"]

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class Op:
    """One forward (``"F"``) or backward (``"B"``) of ``micro_batch`` on ``stage``.

    ``index`` is the op's position in its stage's sequence over all iterations.
    """

    stage: int
    kind: str
    micro_batch: int
    iteration: int
    index: int
    start: float
    end: float


@dataclass(frozen=True)
class Bubble:
    """``stage`` is idle from ``start`` to ``end`` with ``free_memory`` GiB unused.

    ``before`` is the index (in the stage's op sequence) of the op that ends the bubble, or
    ``None`` for the idle tail after the stage's last op.
    """

    stage: int
    start: float
    end: float
    free_memory: float
    before: int | None

    @property
    def duration(self) -> float:
        """Seconds the bubble lasts."""
        return self.end - self.start


def _per_stage(value: float | Sequence[float], p: int, name: str) -> tuple[float, ...]:
    values = (float(value),) * p if isinstance(value, (int, float)) else tuple(map(float, value))
    if len(values) != p:
        raise ValueError(f"{name} has {len(values)} values for {p} stages; give one per stage.")
    if any(not (v >= 0 and math.isfinite(v)) for v in values):
        raise ValueError(f"{name} must be finite and >= 0 for every stage, got {values}.")
    return values


@dataclass(frozen=True)
class PipelineJob:
    """A pipeline-parallel training job: ``stages`` devices, ``micro_batches`` per iteration.

    Args:
        stages: ``p``, the number of pipeline stages (one device each).
        micro_batches: ``m``, micro-batches per iteration.
        forward: Seconds of one micro-batch's forward on each stage (one value or one per
            stage).
        backward: Seconds of one micro-batch's backward on each stage.
        schedule: ``"1f1b"`` or ``"gpipe"``.
        device_memory: GiB of every stage's device.
        static_memory: GiB each stage holds all the time (weights, gradients, optimizer
            state).
        activation_memory: GiB of activations one micro-batch keeps on each stage from its
            forward until its backward.

    Example:
        >>> from hydro_fluid.coordinator import PipelineJob
        >>> job = PipelineJob(stages=4, micro_batches=8, forward=1.0, backward=2.0)
        >>> t = job.timeline()
        >>> t.makespan, round(t.idle_fraction, 4), round(3 / (8 + 3), 4)  # (p-1)/(m+p-1)
        (33.0, 0.2727, 0.2727)
        >>> [t.peak_in_flight(i) for i in range(4)]  # 1F1B: stage i holds p - i
        [4, 3, 2, 1]
    """

    stages: int
    micro_batches: int
    forward: float | Sequence[float] = 1.0
    backward: float | Sequence[float] = 2.0
    schedule: str = "1f1b"
    device_memory: float = 80.0
    static_memory: float | Sequence[float] = 0.0
    activation_memory: float | Sequence[float] = 0.0

    def __post_init__(self) -> None:
        for name in ("stages", "micro_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PipelineJob: {name} must be an int >= 1, got {value!r}.")
        p = self.stages
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"PipelineJob: schedule must be one of {SCHEDULES}, got {self.schedule!r}."
            )
        for name in ("forward", "backward", "static_memory", "activation_memory"):
            object.__setattr__(self, name, _per_stage(getattr(self, name), p, name))
        if not sum(self.forward) + sum(self.backward) > 0:
            raise ValueError("PipelineJob: forward and backward times are all 0; give seconds.")
        if not self.device_memory > 0:
            raise ValueError(
                f"PipelineJob: device_memory must be > 0 GiB, got {self.device_memory}."
            )
        for i in range(p):
            peak = self.static_memory[i] + self.activation_memory[i] * self.max_in_flight(i)
            if peak > self.device_memory + 1e-9:
                raise ValueError(
                    f"PipelineJob: stage {i} needs {peak:.2f} GiB at its peak "
                    f"({self.max_in_flight(i)} micro-batches in flight) but the device has "
                    f"{self.device_memory} GiB; use more stages, fewer micro-batches in flight "
                    "(1F1B instead of GPipe) or less activation memory."
                )

    def max_in_flight(self, stage: int) -> int:
        """Most micro-batches whose activations ``stage`` holds at once (closed form)."""
        if self.schedule == "gpipe":
            return self.micro_batches
        return min(self.stages - stage, self.micro_batches)

    def order(self, stage: int) -> list[tuple[str, int]]:
        """The ``(kind, micro_batch)`` sequence ``stage`` runs in one iteration."""
        m = self.micro_batches
        if not 0 <= stage < self.stages:
            raise ValueError(f"stage must be in [0, {self.stages}), got {stage}.")
        if self.schedule == "gpipe":
            return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
        warm = min(self.stages - stage - 1, m)
        ops = [("F", j) for j in range(warm)]
        for j in range(m - warm):
            ops += [("F", warm + j), ("B", j)]
        return ops + [("B", j) for j in range(m - warm, m)]

    def timeline(
        self, iterations: int = 1, guest: Mapping[tuple[int, int], float] | None = None
    ) -> Timeline:
        """Simulate ``iterations`` iterations: every op's start and end, stage by stage.

        Args:
            iterations: How many iterations to run back to back.
            guest: ``{(stage, index): seconds}``: the stage is busy with guest work for that
                long right after the op before ``index`` ends (at time 0 for index 0), so
                op ``index`` cannot start earlier. Used to check what guests do to the host.
        """
        if iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {iterations}.")
        guest = dict(guest or {})
        for (stage, _), seconds in guest.items():
            if not 0 <= stage < self.stages or not seconds >= 0:
                raise ValueError(f"guest time {seconds} on stage {stage} is not valid.")
        p, m = self.stages, self.micro_batches
        orders = [
            [(kind, j, it) for it in range(iterations) for kind, j in self.order(i)]
            for i in range(p)
        ]
        ends: dict[tuple[int, str, int, int], float] = {}
        ops: list[list[Op]] = [[] for _ in range(p)]
        free_at = [0.0] * p
        todo = list(range(p))
        while todo:
            i = todo.pop()
            while len(ops[i]) < len(orders[i]):
                k = len(ops[i])
                kind, j, it = orders[i][k]
                dep = (i - 1, "F", j, it) if kind == "F" else (i + 1, "B", j, it)
                if (kind == "F" and i == 0) or (kind == "B" and i == p - 1):
                    dep = (i, "F", j, it)
                if dep[0] != i and dep not in ends:
                    break  # its input is not computed yet; that stage will wake this one
                start = max(free_at[i] + guest.get((i, k), 0.0), ends.get(dep, 0.0))
                end = start + (self.forward[i] if kind == "F" else self.backward[i])
                ends[(i, kind, j, it)] = end
                ops[i].append(Op(i, kind, j, it, k, start, end))
                free_at[i] = end
                for nxt in (i - 1, i + 1):
                    if 0 <= nxt < p and nxt not in todo:
                        todo.append(nxt)
        if any(len(ops[i]) != len(orders[i]) for i in range(p)):
            raise RuntimeError("The pipeline schedule deadlocked; this is a bug in Hydro.")
        return Timeline(self, iterations, ops, m)


@dataclass
class Timeline:
    """The simulated ops of a :class:`PipelineJob`, per stage, and what follows from them."""

    job: PipelineJob
    iterations: int
    ops: list[list[Op]]
    micro_batches: int
    makespan: float = field(init=False)

    def __post_init__(self) -> None:
        self.makespan = max(stage[-1].end for stage in self.ops)

    @property
    def iteration_time(self) -> float:
        """Mean seconds per iteration."""
        return self.makespan / self.iterations

    def busy(self, stage: int) -> float:
        """Seconds ``stage`` computes over the whole timeline."""
        return sum(op.end - op.start for op in self.ops[stage])

    @property
    def idle_fraction(self) -> float:
        """Fraction of device time (all stages, whole makespan) spent idle."""
        p = len(self.ops)
        return 1.0 - sum(self.busy(i) for i in range(p)) / (p * self.makespan)

    def in_flight(self, stage: int) -> list[tuple[float, int]]:
        """``(time, count)`` steps: micro-batches whose activations ``stage`` holds.

        Activations count from the start of their forward to the end of their backward.
        """
        events = []
        for op in self.ops[stage]:
            events.append((op.start, 1) if op.kind == "F" else (op.end, -1))
        events.sort(key=lambda e: (e[0], e[1]))  # a release at t frees before a take at t
        steps, count = [(0.0, 0)], 0
        for t, delta in events:
            count += delta
            if steps[-1][0] == t:
                steps[-1] = (t, count)
            else:
                steps.append((t, count))
        return steps

    def peak_in_flight(self, stage: int) -> int:
        """Most micro-batches ``stage`` holds at once."""
        return max(count for _, count in self.in_flight(stage))

    def memory(self, stage: int, time: float) -> float:
        """GiB the host uses on ``stage`` at ``time``."""
        count = 0
        for t, c in self.in_flight(stage):
            if t > time:
                break
            count = c
        job = self.job
        return job.static_memory[stage] + job.activation_memory[stage] * count

    def peak_memory(self, stage: int) -> float:
        """GiB the host uses on ``stage`` at its peak."""
        job = self.job
        return job.static_memory[stage] + job.activation_memory[stage] * self.peak_in_flight(stage)

    def bubbles(self, min_duration: float = 1e-12) -> list[Bubble]:
        """Every idle gap of every stage (including the head before its first op and the
        tail after its last op until the makespan), sorted by start time.

        The activations a stage holds change only when its own ops start or end, so the
        free memory is constant over a bubble.
        """
        job = self.job
        found = []
        for i, ops in enumerate(self.ops):
            steps = self.in_flight(i)
            s = 0
            prev_end, before = 0.0, 0
            for op in [*ops, None]:
                start = self.makespan if op is None else op.start
                if start - prev_end > min_duration:
                    while s + 1 < len(steps) and steps[s + 1][0] <= prev_end:
                        s += 1
                    used = job.static_memory[i] + job.activation_memory[i] * steps[s][1]
                    free = job.device_memory - used
                    found.append(Bubble(i, prev_end, start, free, before))
                if op is not None:
                    prev_end, before = op.end, op.index + 1
            # the tail bubble has no op after it
            if found and found[-1].stage == i and found[-1].before == len(ops):
                last = found[-1]
                found[-1] = Bubble(i, last.start, last.end, last.free_memory, None)
        return sorted(found, key=lambda b: (b.start, b.stage))

    def stage_bubbles(self, stage: int) -> list[Bubble]:
        """The bubbles of one stage, in time order."""
        return [b for b in self.bubbles() if b.stage == stage]

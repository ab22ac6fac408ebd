"""The interleaving policy: which trial group runs in which bubble of a host pipeline job.

Rules, applied bubble by bubble in time order over the host's run:

* Each stage runs one guest group at a time; a stage without one takes the first ready group
  of the study (FIFO; a group is ready once the groups in its ``after`` have finished).
* **Fusion size that fits**: a guest stays resident on its stage's device (weights,
  optimizer state), so its memory must fit what the host leaves free at its *peak* on that
  stage (1F1B: stage ``i`` peaks at ``p - i`` micro-batches, so late stages take bigger
  groups). With ``resident=False`` it only has to fit the memory free during the bubble,
  and it pays a swap in and out of every bubble it runs in. A group larger than that is cut
  into a part that fits (the members with the smallest budgets) and the rest, which goes
  back to the front of the queue.
* **Fusion size that fills the bubbles**: among the sizes that fit the memory, the one whose
  whole steps fill most of the stage's bubble time in one iteration (a large fused step may
  not fit the short gaps of the steady 1F1B phase, a smaller one does).
* **Steps cut to fit**: a fused step of ``n`` active members takes ``n * cost_per_step /
  speed`` seconds. A step runs only if it ends before the bubble does; otherwise the group
  pauses at that step boundary and resumes in the stage's next bubble.
* **Host-delay bound**: with ``delay_bound = d`` the steps of one iteration may overrun their
  bubbles by at most ``d * T`` seconds in total (``T``: the host's iteration time). Adding
  ``g`` seconds to an idle gap of ``s`` seconds lengthens any chain of dependent host ops by
  at most ``max(0, g - s)``, so the host's iteration grows by at most ``d * T``. With the
  default ``d = 0`` no step ever overruns and the host's schedule is exactly unchanged.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from ..groups import TrialGroup
from .pipeline import Bubble, PipelineJob, Timeline

__all__ = ["GuestRun", "InterleavePlan", "interleave", "periodic_bubbles"]

_EPS = 1e-9


@dataclass(frozen=True)
class GuestRun:
    """``steps`` fused steps of ``trial_ids`` (part of group ``group``) on ``stage``.

    ``before`` is the host op index on that stage the run precedes (``None``: after the
    stage's last op), ``swap`` the seconds spent moving the group in and out.
    """

    group: str
    trial_ids: tuple[Hashable, ...]
    stage: int
    start: float
    end: float
    steps: int
    before: int | None
    swap: float = 0.0


@dataclass
class InterleavePlan:
    """What the policy decided over the host's run, and the study's progress.

    Attributes:
        job: The host job.
        iterations: Host iterations the plan covers.
        iteration_time: The host's iteration time without guests (seconds).
        bubble_time: Device-seconds of bubbles over the run (all stages).
        runs: Every guest run, in the order it was decided.
        trial_finish: Time each finished trial reached its budget.
        left: Steps still to go for every trial (0 when finished).
        leftover: The unfinished part of the study, as groups with their remaining budgets
            (``after`` restricted to unfinished groups), to run once the host is done.
        fusion: Largest fusion size each stage can hold for each group.
    """

    job: PipelineJob
    iterations: int
    iteration_time: float
    bubble_time: float
    runs: list[GuestRun] = field(default_factory=list)
    trial_finish: dict[Hashable, float] = field(default_factory=dict)
    left: dict[Hashable, float] = field(default_factory=dict)
    leftover: list[TrialGroup] = field(default_factory=list)
    fusion: dict[str, list[int]] = field(default_factory=dict)

    @property
    def host_time(self) -> float:
        """Seconds of the host's run without guests."""
        return self.iterations * self.iteration_time

    @property
    def guest_time(self) -> float:
        """Device-seconds guests compute inside bubbles (swaps excluded)."""
        return sum(r.end - r.start - r.swap for r in self.runs)

    @property
    def bubble_use(self) -> float:
        """Fraction of the bubble time guests use for training steps."""
        return self.guest_time / self.bubble_time if self.bubble_time > 0 else 0.0

    @property
    def finished(self) -> bool:
        """Whether every trial reached its budget inside the host's run."""
        return not self.leftover

    @property
    def completion(self) -> float | None:
        """Time the last trial finished, if all finished inside the host's run."""
        if not self.finished:
            return None
        return max(self.trial_finish.values(), default=0.0)

    def guest_delays(self, iterations: int | None = None) -> dict[tuple[int, int], float]:
        """``{(stage, op index): guest seconds}`` for :meth:`PipelineJob.timeline`.

        Only runs before a host op of the first ``iterations`` iterations are included.
        """
        per_stage = 2 * self.job.micro_batches
        limit = (iterations or self.iterations) * per_stage
        delays: dict[tuple[int, int], float] = {}
        for r in self.runs:
            if r.before is not None and r.before < limit:
                key = (r.stage, r.before)
                delays[key] = delays.get(key, 0.0) + r.end - r.start
        return delays


def periodic_bubbles(timeline: Timeline, iterations: int) -> Iterator[Bubble]:
    """The bubbles of ``iterations`` back-to-back iterations, in time order, from one.

    Iterations end with a flush, so the schedule repeats every ``T`` seconds; the idle tail
    of one iteration and the idle head of the next form one bubble.

    Example:
        >>> from hydro_fluid.coordinator import PipelineJob, periodic_bubbles
        >>> job = PipelineJob(stages=2, micro_batches=2, forward=1.0, backward=1.0)
        >>> bubbles = list(periodic_bubbles(job.timeline(), 2))
        >>> [(b.stage, b.start, b.end) for b in bubbles[:4]]  # stage 1: tail + next head
        [(1, 0.0, 1.0), (0, 2.0, 3.0), (0, 4.0, 5.0), (1, 5.0, 7.0)]
    """
    if timeline.iterations != 1:
        raise ValueError("periodic_bubbles needs the timeline of a single iteration.")
    period, ops_per_stage = timeline.makespan, 2 * timeline.micro_batches
    p = len(timeline.ops)
    heads: list[Bubble | None] = [None] * p
    tails: list[Bubble | None] = [None] * p
    inner: list[Bubble] = []
    for b in timeline.bubbles():
        if b.before == 0:
            heads[b.stage] = b
        elif b.before is None:
            tails[b.stage] = b
        else:
            inner.append(b)
    for k in range(iterations):
        shift, index = k * period, k * ops_per_stage
        batch = [
            Bubble(b.stage, b.start + shift, b.end + shift, b.free_memory, b.before + index)
            for b in inner
        ]
        if k == 0:
            batch += [b for b in heads if b is not None]
        for i in range(p):
            head, tail = heads[i], tails[i]
            last = k == iterations - 1
            if tail is None and (last or head is None):
                continue
            start = shift + (tail.start if tail is not None else period)
            end = shift + period + (0.0 if last or head is None else head.end)
            free = min(b.free_memory for b in (head, tail) if b is not None)
            before = None if last else index + ops_per_stage
            batch.append(Bubble(i, start, end, free, before))
        yield from sorted(batch, key=lambda b: (b.start, b.stage))


@dataclass
class _Guest:
    """A (part of a) group resident on a stage, with each member's steps to go."""

    group: TrialGroup
    origin: str
    left: list[float]
    loaded: bool = False


def interleave(
    job: PipelineJob,
    groups: Sequence[TrialGroup],
    iterations: int,
    *,
    delay_bound: float = 0.0,
    speed: float = 1.0,
    resident: bool = True,
    swap_bandwidth: float = 16.0,
    fit_bubbles: bool = True,
) -> InterleavePlan:
    """Plan a tuning study's groups into the bubbles of ``iterations`` host iterations.

    Args:
        job: The host pipeline job.
        groups: The study's trial groups, in the order they should start.
            ``cost_per_step`` (seconds per member per step on a speed-1.0 device) and
            ``memory_per_trial`` (GiB) size the fusion and the steps.
        iterations: Host iterations the run lasts.
        delay_bound: Most the host's iteration time may grow, as a fraction (0.01 = 1%).
            Default 0: a step that would overrun its bubble does not start.
        speed: Guest speed of the host's devices relative to ``cost_per_step``'s device.
        resident: Keep a guest's state on its stage between bubbles (it must fit the host's
            peak); ``False`` loads it into each bubble (it must fit that bubble's free memory
            and pays ``2 * memory / swap_bandwidth`` seconds per bubble).
        swap_bandwidth: GiB/s for moving a non-resident guest in and out.
        fit_bubbles: Also cut a group to the fusion size (within memory) whose whole steps
            fill most of the stage's bubble time in one host iteration; ``False`` keeps the
            largest size that fits the memory.

    Raises:
        ValueError: Bad arguments, or a group whose single trial fits no stage's memory.

    Example:
        >>> from hydro_fluid import TrialGroup
        >>> from hydro_fluid.coordinator import PipelineJob, interleave
        >>> job = PipelineJob(8, 16, forward=0.1, backward=0.2, device_memory=80,
        ...                   static_memory=40, activation_memory=2)
        >>> study = [TrialGroup(f"g{k}", range(8 * k, 8 * k + 8), [3000] * 8,
        ...                     cost_per_step=0.004, memory_per_trial=1.0) for k in range(8)]
        >>> plan = interleave(job, study, iterations=100)
        >>> plan.finished, round(plan.completion), round(plan.host_time)
        (True, 324, 690)
        >>> host = job.timeline(100, guest=plan.guest_delays())  # the host with its guests
        >>> abs(host.makespan - plan.host_time) < 1e-9 * plan.host_time  # not delayed
        True
    """
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an int >= 1, got {iterations!r}.")
    if not (delay_bound >= 0 and math.isfinite(delay_bound)):
        raise ValueError(f"delay_bound must be a fraction >= 0 (0.01 = 1%), got {delay_bound}.")
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed}.")
    if not swap_bandwidth > 0:
        raise ValueError(f"swap_bandwidth must be > 0 GiB/s, got {swap_bandwidth}.")
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ValueError("Group names in the study must be unique.")
    for g in groups:
        if not isinstance(g, TrialGroup):
            raise ValueError(f"Expected TrialGroup objects, got {type(g).__name__}: {g!r}.")
        for dep in g.after:
            if dep not in names:
                raise ValueError(f"Group {g.name!r} waits for {dep!r}, which is not in the study.")

    one = job.timeline()
    period = one.makespan
    p = job.stages
    peak_free = [job.device_memory - one.peak_memory(i) for i in range(p)]
    all_bubbles = one.bubbles()
    bubble_free = [0.0] * p
    for b in all_bubbles:
        bubble_free[b.stage] = max(bubble_free[b.stage], b.free_memory)
    room = peak_free if resident else bubble_free

    def fits(g: TrialGroup, free: float) -> int:
        if g.memory_per_trial <= 0:
            return g.size
        return min(g.size, math.floor(free / g.memory_per_trial + _EPS))

    plan = InterleavePlan(job, iterations, period, iterations * p * one.idle_fraction * period)
    for g in groups:
        plan.fusion[g.name] = [fits(g, free) for free in room]
        if max(plan.fusion[g.name]) < 1 and max(g.budgets) > 0:
            where = "at the host's peak" if resident else "in any bubble"
            raise ValueError(
                f"Group {g.name!r}: one trial needs {g.memory_per_trial} GiB but the host "
                f"leaves at most {max(room):.2f} GiB free {where}; make the surrogate "
                "smaller (a larger scaling ratio) or its batch smaller"
                + (", or pass resident=False." if resident else ".")
            )
        for t, steps in zip(g.trial_ids, g.budgets, strict=True):
            plan.left[t] = float(steps)
            if steps <= 0:
                plan.trial_finish[t] = 0.0

    queue: deque[_Guest] = deque(
        _Guest(g, g.name, [float(b) for b in g.budgets]) for g in groups if max(g.budgets) > 0
    )
    open_parts = {g.name: 1 for g in groups if max(g.budgets) > 0}
    done = {g.name for g in groups if max(g.budgets) <= 0}
    current: list[_Guest | None] = [None] * p
    slack = [delay_bound * period] * iterations  # overrun left per iteration
    stage_free = [0.0] * p

    # Per stage, the lengths of one period's bubbles (tail and next head as one).
    lengths: list[list[float]] = [[] for _ in range(p)]
    ends = [0.0] * p
    for b in all_bubbles:
        if b.before == 0:
            ends[b.stage] += b.duration
        elif b.before is None:
            ends[b.stage] += b.duration
        else:
            lengths[b.stage].append(b.duration)
    for i in range(p):
        lengths[i].append(ends[i])
    best: dict[tuple[int, float, int], int] = {}

    def fill(stage: int, step: float, most: int) -> int:
        """The fusion size up to ``most`` whose whole steps fill most of the stage's bubbles."""
        key = (stage, step, most)
        if key not in best:
            used = {
                n: sum(math.floor(length / (n * step) + _EPS) * n for length in lengths[stage])
                for n in range(1, most + 1)
            }
            # Within 10% of the best fill, the larger fusion: fewer, larger parts balance better.
            top = max(used.values())
            best[key] = max(n for n, value in used.items() if value >= 0.9 * top)
        return best[key]

    def take(stage: int, free: float) -> _Guest | None:
        for guest in list(queue):
            if not all(dep in done for dep in guest.group.after):
                continue
            n = fits(guest.group, free)
            if n < 1:
                continue
            if fit_bubbles:  # a smaller group whose steps fit the bubbles may use them better
                n = fill(stage, guest.group.cost_per_step / speed, n)
            queue.remove(guest)
            if n < guest.group.size:  # cut off the part that fits
                order = sorted(range(guest.group.size), key=lambda k: guest.left[k])
                ids = guest.group.trial_ids
                # back in member order: without() keeps the group's order of trial_ids
                keep, rest = sorted(order[:n]), sorted(order[n:])
                part = replace(
                    guest.group.without([ids[k] for k in rest]),
                    name=f"{guest.origin}/{open_parts[guest.origin]}",
                    budgets=tuple(guest.left[k] for k in keep),
                )
                other = replace(
                    guest.group.without([ids[k] for k in keep]),
                    budgets=tuple(guest.left[k] for k in rest),
                )
                queue.appendleft(_Guest(other, guest.origin, [guest.left[k] for k in rest]))
                open_parts[guest.origin] += 1
                guest = _Guest(part, guest.origin, [guest.left[k] for k in keep])
            return guest
        return None

    for bubble in periodic_bubbles(one, iterations):
        i = bubble.stage
        k_iter = min(int(bubble.start / period + _EPS), iterations - 1)
        free = room[i] if resident else bubble.free_memory
        # An overrun (delay_bound > 0) pushes what follows on this stage later.
        t = max(bubble.start, stage_free[i])
        while True:
            guest = current[i]
            if guest is None:
                guest = current[i] = take(i, free)
                if guest is None:
                    break
            g = guest.group
            swap = 0.0 if resident else 2 * g.memory / swap_bandwidth
            active = [k for k, steps in enumerate(guest.left) if steps > _EPS]
            step = g.cost_per_step * len(active) / speed
            limit = bubble.end + slack[k_iter] - swap
            steps = min(
                math.floor((limit - t) / step + _EPS),
                math.ceil(min(guest.left[k] for k in active) - _EPS),
            )
            if steps < 1 or (not resident and fits(g, bubble.free_memory) < g.size):
                break  # pause at this step boundary; resume in the next bubble
            end = t + swap + steps * step
            plan.runs.append(GuestRun(g.name, g.trial_ids, i, t, end, steps, bubble.before, swap))
            slack[k_iter] -= max(0.0, end - max(t, bubble.end))
            t = stage_free[i] = end
            for k in active:
                guest.left[k] = max(0.0, guest.left[k] - steps)
                plan.left[g.trial_ids[k]] = guest.left[k]
                if guest.left[k] <= _EPS:
                    plan.trial_finish[g.trial_ids[k]] = t
            if max(guest.left) <= _EPS:
                current[i] = None
                open_parts[guest.origin] -= 1
                if open_parts[guest.origin] == 0:
                    done.add(guest.origin)

    unfinished = [c for c in current if c is not None] + list(queue)
    by_origin: dict[str, list[str]] = {}
    for k, c in enumerate(unfinished):
        by_origin.setdefault(c.origin, []).append(f"{c.origin}#{k}")
    for k, c in enumerate(unfinished):
        g = c.group.remaining(c.left)
        after = tuple(name for d in c.group.after for name in by_origin.get(d, []))
        plan.leftover.append(
            replace(g, name=f"{c.origin}#{k}", budgets=tuple(g.budgets), after=after)
        )
    return plan

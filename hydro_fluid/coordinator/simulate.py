"""Simulate a host pipeline job with a tuning study in its bubbles, against two baselines.

* **Coordinator**: :func:`~hydro_fluid.coordinator.interleave` plans the study into the
  host's bubbles; the host is simulated again with the guests' time inserted to measure its
  real iteration time; whatever the study has left when the host finishes runs on the
  freed devices (:func:`hydro_fluid.simulate`, FIFO).
* **Separate devices after the host**: the study waits for the host, then runs alone on its
  ``p`` devices (:func:`hydro_fluid.simulate`, FIFO).
* **Plain time sharing**: host and study share every device, the device time-slicing evenly
  while both have work, so host ops take twice as long and the study gets the idle time
  plus half the busy time. A fluid estimate (work divides perfectly), so it flatters time
  sharing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..groups import TrialGroup
from ..resources import Cluster
from ..simulate import Segment, SimResult, simulate
from .interleave import InterleavePlan, interleave
from .pipeline import PipelineJob

__all__ = ["CoordinatorResult", "simulate_coordinator"]


@dataclass
class CoordinatorResult:
    """Side-by-side numbers for one host job and one study.

    Attributes:
        plan: The coordinator's plan over the host's run.
        iteration_time: Host seconds per iteration alone.
        iteration_time_guests: Host seconds per iteration with the guests, measured by
            simulating the first ``checked_iterations`` iterations with the guests' time.
        checked_iterations: Iterations re-simulated to measure the host's slowdown.
        bubble_fraction: Idle fraction of the host's device time, from its schedule.
        bubble_use: Fraction of the bubble time guests spend on training steps.
        study_coordinator: Seconds until the study's last trial finishes with the coordinator.
        study_separate: ... when it runs on the host's devices after the host finishes.
        study_time_sharing: ... under plain time sharing (fluid estimate).
        host_time_sharing: Host seconds for its run under plain time sharing.
        utilization: Device utilization (host plus guest compute) over the host's run,
            without guests and with them.
    """

    plan: InterleavePlan
    iteration_time: float
    iteration_time_guests: float
    checked_iterations: int
    bubble_fraction: float
    bubble_use: float
    study_coordinator: float
    study_separate: float
    study_time_sharing: float
    host_time_sharing: float
    utilization: tuple[float, float]

    @property
    def host_slowdown(self) -> float:
        """Relative growth of the host's iteration time with guests (0.01 = 1%)."""
        return self.iteration_time_guests / self.iteration_time - 1.0

    def plot_gantt(self, path: str | None = None, *, iterations: int = 2, title: str = ""):
        """Draw each stage's host ops and guest steps over the first ``iterations``.

        Reuses :meth:`hydro_fluid.simulate.SimResult.plot_gantt`: host forwards and
        backwards are two colours, each guest group has its own. Returns the figure.
        """
        import matplotlib

        if path is not None:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        plan = self.plan
        job = plan.job
        shown = min(iterations, plan.iterations)
        timeline = job.timeline(shown, guest=plan.guest_delays(shown))
        horizon = timeline.makespan
        devices = [f"stage {i}" for i in range(job.stages)]
        segments = [
            Segment("host forward" if op.kind == "F" else "host backward", devices[i], *span, 1.0)
            for i, ops in enumerate(timeline.ops)
            for op in ops
            for span in [(op.start, op.end)]
        ]
        guests: dict[str, None] = {}
        for run in plan.runs:
            if run.start < horizon:
                name = run.group.split("/")[0]
                guests[name] = None
                segments.append(
                    Segment(name, devices[run.stage], run.start, min(run.end, horizon), 1.0)
                )
        order = {"host forward": 0.0, "host backward": 0.0, **{g: 0.0 for g in guests}}
        result = SimResult("coordinator", horizon, {}, order, _busy(segments, job), segments)
        result.devices = devices
        fig = result.plot_gantt(
            path=None,
            max_devices=job.stages,
            title=title
            or (
                f"{job.schedule.upper()} p={job.stages} m={job.micro_batches}: host ops and "
                f"guest steps, {shown} iterations"
            ),
        )
        ax = fig.axes[0]
        cmap = plt.get_cmap("tab20")
        names = list(order)[:12]
        ax.legend(
            [Patch(color=cmap(k % 20)) for k in range(len(names))],
            names,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            fontsize=7,
        )
        fig.axes[1].set_ylabel("busy devices")
        if path is not None:
            fig.savefig(path, dpi=110, bbox_inches="tight")
        return fig


def _busy(segments: list[Segment], job: PipelineJob) -> list[tuple[float, float]]:
    """``(time, fraction of stages busy)`` steps from the segments."""
    events: dict[float, int] = {}
    for s in segments:  # rounded: a guest ending where a host op starts is not an overlap
        start, end = round(s.start, 9), round(s.end, 9)
        events[start] = events.get(start, 0) + 1
        events[end] = events.get(end, 0) - 1
    series, count = [], 0
    for t in sorted(events):
        count += events[t]
        series.append((t, count / job.stages))
    return series


def simulate_coordinator(
    job: PipelineJob,
    groups: Sequence[TrialGroup],
    iterations: int,
    *,
    delay_bound: float = 0.0,
    speed: float = 1.0,
    check_iterations: int = 4,
    resident: bool = True,
) -> CoordinatorResult:
    """Run the host for ``iterations`` iterations with ``groups`` as guests; compare.

    Args:
        job: The host pipeline job.
        groups: The tuning study's trial groups.
        iterations: Length of the host's run.
        delay_bound: Host slowdown the guests may cause (fraction); see :func:`interleave`.
        speed: Guest speed of the devices relative to ``cost_per_step``'s device.
        check_iterations: Iterations simulated again with the guests in them to measure the
            host's slowdown (the schedule repeats, so a few suffice).
        resident: See :func:`interleave`.

    Example:
        >>> from hydro_fluid import TrialGroup
        >>> from hydro_fluid.coordinator import PipelineJob, simulate_coordinator
        >>> job = PipelineJob(4, 8, forward=0.1, backward=0.2, static_memory=40,
        ...                   activation_memory=4)
        >>> study = [TrialGroup(f"g{k}", range(4 * k, 4 * k + 4), [500] * 4,
        ...                     cost_per_step=0.005, memory_per_trial=2.0) for k in range(4)]
        >>> r = simulate_coordinator(job, study, iterations=200)
        >>> r.host_slowdown <= 0, r.study_coordinator < r.study_separate
        (True, True)
    """
    if check_iterations < 1:
        raise ValueError(f"check_iterations must be >= 1, got {check_iterations}.")
    plan = interleave(
        job, groups, iterations, delay_bound=delay_bound, speed=speed, resident=resident
    )
    period = plan.iteration_time
    checked = min(check_iterations, iterations)
    with_guests = job.timeline(checked, guest=plan.guest_delays(checked)).makespan / checked
    host_end = iterations * with_guests
    p = job.stages
    cluster = Cluster.homogeneous(1, p, memory=job.device_memory, speed=speed)
    if plan.finished:
        coordinator = plan.completion or 0.0
    else:
        coordinator = host_end + simulate(plan.leftover, cluster, "fifo").makespan
    active = [g for g in groups if max(g.budgets) > 0]
    separate = plan.host_time + (simulate(active, cluster, "fifo").makespan if active else 0.0)

    idle = job.timeline().idle_fraction
    work = sum(g.work for g in groups) / speed
    share_rate = p * (idle + (1 - idle) / 2)  # device-seconds per second the study gets
    host_alone = plan.host_time
    if work / share_rate <= 2 * host_alone:
        study_ts = work / share_rate
        host_ts = host_alone + study_ts / 2
    else:
        host_ts = 2 * host_alone
        study_ts = host_ts + (work - share_rate * host_ts) / p
    busy = 1 - idle
    return CoordinatorResult(
        plan=plan,
        iteration_time=period,
        iteration_time_guests=with_guests,
        checked_iterations=checked,
        bubble_fraction=idle,
        bubble_use=plan.bubble_use,
        study_coordinator=coordinator,
        study_separate=separate,
        study_time_sharing=study_ts,
        host_time_sharing=host_ts,
        utilization=(busy, busy + plan.guest_time / (p * host_end)),
    )

"""Coordinator benchmark: a tuning study in the bubbles of a pipeline-parallel job.

Simulated part: a host model of fixed size split into p in {4, 8, 16, 64} stages with 1F1B
over m in {p, 2p, 4p} micro-batches (per-stage times vary by +-10%, the last stage carries
the loss head), on 80 GiB devices. For each job two studies of fused trial groups:

* a *saturating* study (more work than the bubbles hold), for the host's iteration time with
  and without guests and the fraction of bubble time the guests use;
* a study sized at half the device-time of the host run's bubbles ("X device-hours"), for
  its completion time with the coordinator, on the host's devices after the host finishes,
  and under plain time sharing (fluid estimate).

Real part: a 2-stage gloo pipeline on this machine (examples/coordinator/pipeline.py), runs with
and without a fused guest alternating in the same processes; medians over the runs.

Run:  python benchmarks/coordinator.py             (full table and the real run)
      python benchmarks/coordinator.py --quick     (p in {4, 8}, a short real run)
      python benchmarks/coordinator.py --gantt docs/img   (also draw Gantt charts)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")

# Runnable from a source checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from examples.coordinator.pipeline import run_pipeline
from hydro_fluid import TrialGroup
from hydro_fluid.coordinator import PipelineJob, interleave, simulate_coordinator

FORWARD = 0.8  # seconds of one micro-batch's forward through the whole host model
ITERATIONS = 50  # host iterations simulated
FUSION = 16  # trials per group as the tuner builds them
COST = 0.004  # seconds per trial per step of the surrogate on one device
MEMORY = 0.5  # GiB per trial of the surrogate


def host(p: int, m: int, schedule: str = "1f1b", seed: int = 0) -> PipelineJob:
    """The host model split in ``p`` stages: time and memory per stage shrink with ``p``."""
    rng = np.random.default_rng(seed + p)
    jitter = rng.uniform(0.9, 1.1, p)
    jitter[-1] = 1.25  # the loss head
    forward = FORWARD / p * jitter
    return PipelineJob(
        p,
        m,
        forward=forward.tolist(),
        backward=(2 * forward).tolist(),
        schedule=schedule,
        device_memory=80.0,
        static_memory=160.0 / p,
        activation_memory=24.0 / p,
    )


def study(seconds: float, seed: int = 0, prefix: str = "g") -> list[TrialGroup]:
    """Fused groups of FUSION trials with random budgets, ``seconds`` device-seconds in all."""
    rng = np.random.default_rng(seed)
    groups, total, k = [], 0.0, 0
    while total < seconds:
        budgets = rng.integers(200, 2000, FUSION).tolist()
        g = TrialGroup(
            f"{prefix}{k}",
            trial_ids=tuple(f"{prefix}{k}-t{i}" for i in range(FUSION)),
            budgets=tuple(budgets),
            cost_per_step=COST,
            memory_per_trial=MEMORY,
        )
        groups.append(g)
        total += g.work
        k += 1
    return groups


def simulated(stages: list[int], delay_bound: float = 0.0) -> list[dict]:
    rows = []
    for p in stages:
        for m in (p, 2 * p, 4 * p):
            t0 = time.perf_counter()
            job = host(p, m)
            one = job.timeline()
            bubble_seconds = ITERATIONS * p * one.makespan * one.idle_fraction
            saturated = simulate_coordinator(
                job, study(2.0 * bubble_seconds, seed=p + m), ITERATIONS, delay_bound=delay_bound
            )
            largest = interleave(
                job,
                study(2.0 * bubble_seconds, seed=p + m),
                ITERATIONS,
                delay_bound=delay_bound,
                fit_bubbles=False,
            )
            sized = simulate_coordinator(
                job,
                study(0.5 * bubble_seconds, seed=1 + p + m),
                ITERATIONS,
                delay_bound=delay_bound,
            )
            rows.append(
                dict(
                    p=p,
                    m=m,
                    bubble=one.idle_fraction,
                    closed=(p - 1) / (m + p - 1),
                    iteration=saturated.iteration_time,
                    with_guests=saturated.iteration_time_guests,
                    slowdown=saturated.host_slowdown,
                    use=saturated.bubble_use,
                    use_largest=largest.bubble_use,
                    util=saturated.utilization,
                    host_time=sized.plan.host_time,
                    coordinator=sized.study_coordinator,
                    separate=sized.study_separate,
                    sharing=sized.study_time_sharing,
                    host_sharing=sized.host_time_sharing,
                    inside=sized.plan.finished,
                    seconds=time.perf_counter() - t0,
                )
            )
            print_row(rows[-1])
    return rows


HEADER = (
    "| p | m | bubble (sim) | (p-1)/(m+p-1) | host iter alone (s) | with guests (s) | slowdown "
    "| bubble used (fitted / largest fusion) | utilization alone -> with "
    "| study: coordinator (s) | after host (s) | time sharing (s) | host under time sharing "
    "| study inside host run |"
)


def _zero(x: float) -> float:
    """Float noise of a sum over thousands of ops is not a slowdown."""
    return 0.0 if abs(x) < 1e-9 else x


def print_row(r: dict) -> None:
    print(
        f"| {r['p']} | {r['m']} | {r['bubble']:.3f} | {r['closed']:.3f} | {r['iteration']:.3f} "
        f"| {r['with_guests']:.3f} | {_zero(r['slowdown']):+.2%} "
        f"| {r['use']:.1%} / {r['use_largest']:.1%} "
        f"| {r['util'][0]:.1%} -> {r['util'][1]:.1%} | {r['coordinator']:.1f} "
        f"| {r['separate']:.1f} | {r['sharing']:.1f} | x{r['host_sharing'] / r['host_time']:.2f} "
        f"| {'yes' if r['inside'] else 'no'} |",
        flush=True,
    )


def real(repeats: int, steps: int, micro_batches: int) -> dict:
    flags = [False, True] * repeats
    runs = run_pipeline(
        steps=steps, micro_batches=micro_batches, guest=flags, width=1024, batch=128, timeout=600
    )
    alone = [r for r, f in zip(runs, flags) if not f]
    shared = [r for r, f in zip(runs, flags) if f]
    identical = all(
        torch.equal(v, r.params[s][k])
        for r in runs
        for s in range(2)
        for k, v in runs[0].params[s].items()
    )
    t_alone = statistics.median(r.iteration_time for r in alone)
    t_shared = statistics.median(r.iteration_time for r in shared)
    waits = statistics.median(sum(r.wait_time) / len(r.iteration_times) for r in alone)
    return dict(
        alone=t_alone,
        shared=t_shared,
        ratio=t_shared / t_alone,
        pairs=[(a.iteration_time, s.iteration_time) for a, s in zip(alone, shared)],
        identical=identical,
        trial_steps=statistics.median(r.trial_steps / len(r.iteration_times) for r in shared),
        guest_seconds=statistics.median(sum(r.guest_time) / len(r.iteration_times) for r in shared),
        overrun=statistics.median(sum(r.overrun) / len(r.iteration_times) for r in shared),
        step=statistics.median(x for r in shared for x in r.guest_step),
        wait=waits,
        loss=[r.guest_loss for r in shared],
    )


def gantt(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for p, m, schedule in ((4, 8, "1f1b"), (8, 16, "1f1b"), (4, 4, "gpipe")):
        job = host(p, m, schedule)
        one = job.timeline()
        bubble_seconds = ITERATIONS * p * one.makespan * one.idle_fraction
        groups = study(2.0 * bubble_seconds, seed=p + m, prefix="group ")
        result = simulate_coordinator(job, groups, ITERATIONS)
        path = folder / f"coordinator_{schedule}_p{p}_m{m}.png"
        result.plot_gantt(str(path), iterations=2)
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="p in {4, 8}, a short real run")
    parser.add_argument("--gantt", type=Path, help="folder for Gantt chart PNGs")
    parser.add_argument("--delay-bound", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=7, help="real-run pairs")
    parser.add_argument("--no-real", action="store_true", help="skip the real run")
    parser.add_argument("--only-real", action="store_true", help="skip the simulated table")
    args = parser.parse_args(argv)
    stages = [4, 8] if args.quick else [4, 8, 16, 64]
    print(
        f"Simulated: 1F1B, {ITERATIONS} host iterations, groups of {FUSION} trials "
        f"({COST * 1000:.0f} ms/trial-step, {MEMORY} GiB/trial), delay bound "
        f"{args.delay_bound:.0%}\n"
    )
    if not args.only_real:
        print(HEADER)
        print("|" + "---|" * (HEADER.count("|") - 1))
        simulated(stages, args.delay_bound)
    if args.gantt:
        gantt(args.gantt)
    if not args.no_real:
        repeats = 3 if args.quick else args.repeats
        r = real(repeats, steps=6, micro_batches=4)
        print(
            f"\nReal run: 2 stages, gloo, 1F1B, m=4, {repeats} runs each way alternating in the "
            "same processes, 6 measured iterations per run\n"
        )
        print(
            "| | host iteration (median, s) | guest trial-steps / iteration "
            "| guest s / iteration | overrun s / iteration | host params |"
        )
        print("|---|---|---|---|---|---|")
        print(f"| without guest | {r['alone']:.4f} | 0 | 0 | 0 | reference |")
        print(
            f"| with guest | {r['shared']:.4f} ({r['ratio'] - 1:+.1%}) | {r['trial_steps']:.1f} "
            f"| {r['guest_seconds']:.4f} | {r['overrun']:.4f} "
            f"| {'bit-identical' if r['identical'] else 'DIFFERENT'} |"
        )
        print(
            "\nper-run medians (alone, with guest): "
            + ", ".join(f"({a:.4f}, {s:.4f})" for a, s in r["pairs"])
        )
        print(f"receive waits per iteration without guest: {r['wait']:.4f} s")
        falling = sum(1 for losses in r["loss"] for x in losses if x is not None and x[1] < x[0])
        stages = sum(1 for losses in r["loss"] for x in losses if x is not None)
        print(f"guest loss fell on {falling} of {stages} stage-runs that trained")
        print(f"guest step planned with (1.5 x median step): {r['step'] * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

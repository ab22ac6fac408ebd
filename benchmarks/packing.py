"""Packing benchmark: FIFO vs StaticFluid vs DynamicFluid vs a lower bound, in the simulator.

Workloads are shaped like real tuning runs of small (surrogate) models, which leave a GPU
partly idle: random search, synchronous successive halving and Hyperband brackets, with
heterogeneous budgets, on 8 to 512 devices, some of which leave and join mid-run. Makespans
are medians over several seeds; every policy sees the same workload and cluster.

Run:  python benchmarks/packing.py            (full table, a few minutes)
      python benchmarks/packing.py --quick    (small sizes, seconds)
      python benchmarks/packing.py --gantt docs/img   (also draw Gantt charts)
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

# Runnable from a source checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydro_fluid import Cluster, TrialGroup, simulate, static_fluid
from hydro_fluid.simulate import lower_bound

FUSION = 4  # trials fused per group, as the tuner would build them
C, D = 4, 8
# Solo utilization of a fused group: small models leave much of a GPU idle, bigger ones less.
UTILIZATION = (0.2, 1.0)
POLICIES = ("fifo", "static_fluid", "dynamic_fluid")


def _groups(
    rng: np.random.Generator, prefix: str, budgets: list[float], after: tuple[str, ...] = ()
) -> list[TrialGroup]:
    """Fuse consecutive trials into groups of FUSION with one random model size per group."""
    groups = []
    for start in range(0, len(budgets), FUSION):
        part = budgets[start : start + FUSION]
        groups.append(
            TrialGroup(
                f"{prefix}-{start // FUSION}",
                trial_ids=tuple(f"{prefix}-t{start + i}" for i in range(len(part))),
                budgets=tuple(part),
                cost_per_step=float(rng.uniform(0.05, 0.15)),  # seconds per step per trial
                memory_per_trial=float(rng.uniform(0.5, 4.0)),
                utilization=float(rng.uniform(*UTILIZATION)),
                comm=0.05,
                after=after,
            )
        )
    return groups


def random_search(rng: np.random.Generator, devices: int) -> list[TrialGroup]:
    """8 trials per device with budgets spread over 1x to 8x (different epochs per trial)."""
    budgets = [float(rng.choice([250, 500, 1000, 2000])) for _ in range(8 * devices)]
    return _groups(rng, "rs", budgets)


def successive_halving(
    rng: np.random.Generator,
    devices: int,
    prefix: str = "sha",
    trials: int | None = None,
    min_steps: float = 250.0,
    eta: int = 4,
    rungs: int = 4,
) -> list[TrialGroup]:
    """Synchronous SHA: each rung trains 1/eta of the last rung's trials eta times longer."""
    n = trials or 8 * devices
    groups: list[TrialGroup] = []
    previous: tuple[str, ...] = ()
    for rung in range(rungs):
        if n < 1:
            break
        # Promoted trials continue from their checkpoint: only the extra steps are new work.
        extra = min_steps * eta**rung - (min_steps * eta ** (rung - 1) if rung else 0)
        rung_groups = _groups(rng, f"{prefix}-r{rung}", [extra] * n, after=previous)
        groups += rung_groups
        previous = tuple(g.name for g in rung_groups)
        n //= eta
    return groups


def hyperband(rng: np.random.Generator, devices: int) -> list[TrialGroup]:
    """Hyperband: brackets of SHA with fewer, longer-trained trials, run side by side."""
    groups: list[TrialGroup] = []
    for bracket, rungs in enumerate((4, 3, 2)):
        trials = max(4, 8 * devices // 4**bracket)
        groups += successive_halving(
            rng,
            devices,
            prefix=f"hb{bracket}",
            trials=trials,
            min_steps=250.0 * 4**bracket,
            rungs=rungs,
        )
    return groups


WORKLOADS: dict[str, Callable[[np.random.Generator, int], list[TrialGroup]]] = {
    "random": random_search,
    "sha": successive_halving,
    "hyperband": hyperband,
}


def make_cluster(rng: np.random.Generator, devices: int, churn: bool) -> Cluster:
    """Nodes of 8 GPUs (fewer if small); with churn, 1/8 of them leave and come back."""
    per_node = min(8, devices)
    cluster = Cluster.homogeneous(devices // per_node, per_node, memory=40.0)
    if not churn:
        return cluster
    leaving = rng.choice(len(cluster.devices), size=max(1, devices // 8), replace=False)
    events = []
    for i in leaving:
        dev = cluster.devices[int(i)]
        t = float(rng.uniform(50, 400))
        events += [(t, "leave", dev), (t + float(rng.uniform(200, 800)), "join", dev)]
    return cluster.with_events(events)


def one_run(task: tuple[str, int, bool, int, tuple[float, float]]) -> dict[str, float]:
    """Makespan of every policy, and the bound, for one workload, cluster size and seed."""
    workload, devices, churn, seed, utilization = task
    global UTILIZATION  # worker processes get the setting passed along explicitly
    UTILIZATION = utilization
    rng = np.random.default_rng(seed)
    groups = WORKLOADS[workload](rng, devices)
    cluster = make_cluster(rng, devices, churn)
    spans = {p: simulate(groups, cluster, p, c=C, d=D).makespan for p in POLICIES}
    spans["bound"] = lower_bound(groups, cluster, d=D)
    return spans


def draw_gantt(folder: Path, devices: int) -> None:
    """Gantt charts of seed 0 of every workload and policy, without churn."""
    for workload, make in WORKLOADS.items():
        rng = np.random.default_rng(0)
        groups = make(rng, devices)
        cluster = make_cluster(rng, devices, churn=False)
        for policy in POLICIES:
            result = simulate(groups, cluster, policy, c=C, d=D)
            fig = result.plot_gantt(
                str(folder / f"gantt_{workload}_{policy}.png"),
                title=f"{workload}, {devices} GPUs, {policy}: makespan {result.makespan:,.0f} s, "
                f"utilization {result.mean_utilization:.0%}",
            )
            plt.close(fig)


def run_table(sizes: list[int], seeds: dict[int, int], processes: int) -> list[dict]:
    tasks = [
        (workload, devices, churn, seed, UTILIZATION)
        for workload in WORKLOADS
        for devices in sizes
        for churn in (False, True)
        for seed in range(seeds[devices])
    ]
    with multiprocessing.Pool(processes) as pool:
        outcomes = pool.map(one_run, tasks, chunksize=1)
    by_row: dict[tuple, list[dict[str, float]]] = {}
    for task, spans in zip(tasks, outcomes, strict=True):
        by_row.setdefault(task[:3], []).append(spans)

    print(
        f"{'workload':<10} {'devices':>7} {'churn':>5} {'seeds':>5} {'FIFO':>8} {'Static':>8} "
        f"{'Dynamic':>8} {'bound':>8} {'dyn/FIFO':>8} {'dyn/bound':>9}"
    )
    rows = []
    for (workload, devices, churn), runs in by_row.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append(dict(workload=workload, devices=devices, churn=churn, **med))
        print(
            f"{workload:<10} {devices:>7} {'yes' if churn else 'no':>5} {len(runs):>5} "
            f"{med['fifo']:>8.0f} {med['static_fluid']:>8.0f} {med['dynamic_fluid']:>8.0f} "
            f"{med['bound']:>8.0f} {med['dynamic_fluid'] / med['fifo']:>8.2f} "
            f"{med['dynamic_fluid'] / med['bound']:>9.2f}"
        )
    return rows


def planning_time(trials: int = 10_000, devices: int = 1_000) -> float:
    """Seconds for one StaticFluid plan of ``trials`` single-trial groups on ``devices``."""
    rng = np.random.default_rng(0)
    groups = [
        TrialGroup(
            f"g{i}",
            (i,),
            (float(rng.integers(100, 10_000)),),
            memory_per_trial=1.0,
            utilization=0.3,
        )
        for i in range(trials)
    ]
    cluster = Cluster.homogeneous(devices // 8, 8)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        static_fluid(groups, cluster.devices, c=C, d=D)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    global UTILIZATION  # the workload builders read it
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 and 32 devices, 3 seeds")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per row (3 at 512 devices)")
    parser.add_argument("--gantt", type=Path, help="folder for Gantt chart PNGs")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--utilization",
        type=float,
        nargs=2,
        metavar=("LOW", "HIGH"),
        default=UTILIZATION,
        help="range of group utilization (default 0.2 1.0)",
    )
    args = parser.parse_args(argv)
    UTILIZATION = tuple(args.utilization)
    sizes = [8, 32] if args.quick else [8, 64, 512]
    seeds = {n: 3 if args.quick or n >= 512 else args.seeds for n in sizes}
    print(
        f"c={C} (groups per device), d={D} (devices per group), fusion size {FUSION}, "
        f"group utilization {UTILIZATION[0]}-{UTILIZATION[1]}; medians over seeds; "
        "makespans in simulated seconds\n"
    )
    start = time.perf_counter()
    run_table(sizes, seeds, args.processes)
    print(f"(simulated in {time.perf_counter() - start:.0f} s)")
    seconds = planning_time()
    print(f"\nStaticFluid plan of 10,000 trials on 1,000 devices: {seconds * 1000:.0f} ms")
    if args.gantt:
        args.gantt.mkdir(parents=True, exist_ok=True)
        draw_gantt(args.gantt, sizes[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())

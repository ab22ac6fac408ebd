"""The placement policies on real worker processes, next to the simulator replaying the same work.

A heterogeneous study: three (batch size, width) keys of clearly different cost, groups of
fused MLP trials (``hydro_fluid.executors.examples.fused_mlp``), and a pruner's tail: in each
group of ``fuse`` trials, successive-halving rungs leave half the members at a quarter of the
budget, a quarter at half, and a quarter train to the end. The pruner's decisions are fixed in
advance so that every policy (and the simulator) runs exactly the same work.

Each policy (fifo, static, dynamic) runs it for real on ``LocalExecutor`` with 2 workers, which
records each group's cost per step and utilization from its first steps; ``simulate`` replays
the workload on 2 devices with the costs the fifo run of the same round measured (each group
alone on its device there, and the start-up of its worker as latency: ``TrialGroup.startup``).
One table of medians over the rounds: makespan, slots busy, trials per hour, the simulator's
makespan and its error. Then the deadline mode: the best trial's last loss at a deadline of
60 % of that round's fifo makespan, ``deadline`` against ``fifo``.

    PYTHONPATH=$PWD python3 benchmarks/placement_real.py           # full (a quiet machine)
    PYTHONPATH=$PWD python3 benchmarks/placement_real.py --quick --repeats 1   # smoke run

Prints the table and the load average; not a test.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

from hydro_fluid import Cluster, Device, LocalExecutor, TrialGroup, simulate
from hydro_fluid.executors.examples import count_steps, fused_mlp

KEYS = {"small": (32, 32), "medium": (256, 128), "large": (1024, 256)}  # name: (width, batch)
SIM_NAMES = {"fifo": "fifo", "static": "static_fluid", "dynamic": "dynamic_fluid",
             "deadline": "deadline"}


def workload(groups_per_key: int, fuse: int, budget: int) -> list[tuple[str, TrialGroup]]:
    """(key, group) in arrival order: keys interleaved, as a sampler proposes them."""
    rungs = [budget // 4] * (fuse // 2) + [budget // 2] * (fuse // 4)
    rungs += [budget] * (fuse - len(rungs))
    out, number = [], 0
    for i in range(groups_per_key):
        for key in KEYS:
            ids = tuple(range(number, number + fuse))
            number += fuse
            out.append((key, TrialGroup(f"{key}-{i}", ids, tuple(rungs))))
    return out


def worker_fn(key_of: dict[str, str], group: TrialGroup, ctx) -> dict:
    """One fused MLP group with its key's width and batch size (module level: picklable)."""
    width, batch = KEYS[key_of[group.name]]
    return fused_mlp(group, ctx, width=width, batch=batch)


def run_real(policy: str, work: list[tuple[str, TrialGroup]], deadline: float | None = None):
    """Run ``work`` for real under ``policy``; returns the executor (its decisions and its
    measurements), the makespan and every report with its time."""
    key_of = {g.name: key for key, g in work}
    ex = LocalExecutor(devices=[], num_workers=2, threads=2, restart_cost=2.0)
    reports: list[tuple[float, int, float]] = []
    start = time.monotonic()

    def report(trial, step, value):
        reports.append((time.monotonic() - start, trial, value))

    results = ex.run([g for _, g in work], functools.partial(worker_fn, key_of), report=report,
                     policy=policy, deadline=deadline)
    makespan = time.monotonic() - start
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    ex.moves = sum(r.moves for r in results)
    return ex, makespan, reports


def slots_busy(ex: LocalExecutor, makespan: float, devices: int = 2) -> float:
    """Share of the devices given to running groups, over the makespan (from the decisions)."""
    total = 0.0
    marks = ex.decisions + [None]
    for decision, nxt in zip(marks, marks[1:]):
        end = makespan if nxt is None else nxt.seconds
        shares = sum(s for slots in decision.allocation.values() for _, s in slots)
        total += (end - decision.seconds) * min(shares, devices)
    return total / (devices * makespan)


def measured_workload(ex: LocalExecutor, work: list[tuple[str, TrialGroup]]) -> list[TrialGroup]:
    """The workload as a fifo run measured it: each group's worker start-up (latency in the
    simulator: other groups compute meanwhile), utilization from its first steps, and its
    cost per member-step over its whole run (alone on its device under fifo: from its first
    step to its end, over the member-steps it trained). The first steps' cost, which the
    policies use while a group runs, is also paying for the other workers' start-ups."""
    out = []
    for _, g in work:
        m = ex.measured[g.name]
        training = m["end"] - m["start"] - m["startup"]
        out.append(TrialGroup(g.name, g.trial_ids, g.budgets,
                              cost_per_step=max(training, 1e-6) / sum(g.budgets),
                              utilization=min(1.0, max(0.05, m["utilization"])),
                              startup=m["startup"]))
    return out


def sim_busy(result, devices: int = 2) -> float:
    used = sum((s.end - s.start) * s.share for s in result.segments)
    return used / (devices * result.makespan)


def best_at(reports: list[tuple[float, int, float]], when: float) -> float:
    """The best trial's last loss reported by ``when``."""
    last: dict[int, float] = {}
    for t, trial, value in reports:
        if t <= when:
            last[trial] = value
    return min(last.values(), default=float("nan"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 groups per key, fuse 4")
    p.add_argument("--groups-per-key", type=int, default=4)
    p.add_argument("--fuse", type=int, default=8)
    p.add_argument("--budget", type=int, default=800, help="steps of the trials that survive")
    p.add_argument("--repeats", type=int, default=3, help="rounds of all policies; medians")
    a = p.parse_args()
    if a.quick:
        a.groups_per_key, a.fuse, a.budget = 2, 4, 200
    work = workload(a.groups_per_key, a.fuse, a.budget)
    trials = sum(g.size for _, g in work)
    load = os.getloadavg()[0]
    cluster = Cluster([Device(f"cpu{i}", "cpu", 8.0, node="local") for i in range(2)])
    # the first run of a process starts the fork server (imports torch): not any policy's time
    LocalExecutor(devices=[], num_workers=1).run([TrialGroup("warm-up", (-1,), (1,))], count_steps)
    rows: dict[str, list[dict]] = {p: [] for p in ("fifo", "static", "dynamic")}
    deadlines: list[tuple[float, float, float]] = []
    for _ in range(a.repeats):
        # fifo first in each round: the simulator replays every policy of the round with the
        # costs fifo measured (each group alone on its device), under the same load
        fifo_ex, fifo_span, fifo_reports = run_real("fifo", work)
        costs = measured_workload(fifo_ex, work)
        for policy in rows:
            ex, span, _ = (fifo_ex, fifo_span, None) if policy == "fifo" else \
                run_real(policy, work)
            sim = simulate(costs, cluster, SIM_NAMES[policy], restart_cost=ex.restart_cost, d=2)
            rows[policy].append({"span": span, "busy": slots_busy(ex, span), "moves": ex.moves,
                                 "sim": sim.makespan, "sim_busy": sim_busy(sim),
                                 "vs": span / fifo_span})
        when = 0.6 * fifo_span
        _, dl_span, dl_reports = run_real("deadline", work, deadline=when)
        deadlines.append((best_at(fifo_reports, when), best_at(dl_reports, when), when))
    med = statistics.median
    print(f"{len(work)} groups of {a.fuse} ({trials} trials), keys {KEYS} (width, batch), "
          f"budgets {sorted(set(work[0][1].budgets))}, LocalExecutor 2 workers x 2 threads, "
          f"medians of {a.repeats} rounds; load average {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    print("| policy | makespan s | vs fifo | slots busy | trials/hour | simulated s | sim error |"
          " sim busy | moves |")
    print("|---|---|---|---|---|---|---|---|---|")
    for policy, runs in rows.items():
        span = med(r["span"] for r in runs)
        error = med((r["sim"] - r["span"]) / r["span"] for r in runs)
        print(f"| {policy} | {span:.1f} | {med(r['vs'] for r in runs):.2f}x | "
              f"{med(r['busy'] for r in runs):.0%} | {trials / span * 3600:.0f} | "
              f"{med(r['sim'] for r in runs):.1f} | {error:+.0%} | "
              f"{med(r['sim_busy'] for r in runs):.0%} | "
              f"{sum(r['moves'] for r in runs)} |")
    print("\nthe best trial's last loss at a deadline of 60% of that round's fifo makespan")
    print("| round | deadline s | fifo | deadline policy |")
    print("|---|---|---|---|")
    for i, (fifo_best, dl_best, when) in enumerate(deadlines):
        print(f"| {i} | {when:.1f} | {fifo_best:.4f} | {dl_best:.4f} |")


if __name__ == "__main__":
    main()

"""Group effects: does sharing a fused group's data order bias which trials a pruner stops?

The same 32 configurations (enqueued, so every run trains the same ones) are tuned with a median
pruner three ways: fused 8 per group on one shared data order (Hydro before per-trial data
order: run this file with the old tree on ``PYTHONPATH``), fused 8 per group with each trial its
own data order (this tree), and one trial per group (``--fuse 1``, the reference: every trial
alone on its own data order). Each run is repeated with 3 seeds and saved as JSON; ``--report``
prints the table.

Measures, per run kind (median over seeds):

Trials are compared by cohort: the 8 consecutive trials asked together (one fused group when
groups are fixed; with continuous batching and alone they share no data).

* ICC: intra-cohort correlation of the first evaluation's residuals (a trial's value minus the
  mean of its configuration over the one-per-group runs). Members sharing one data order share
  its noise: ICC near 1 means the group, not the configuration, moves the value.
* clustered: cohorts whose members were all pruned or all kept, against what a random shuffle
  of the same pruning decisions over the cohorts gives. (The first cohort is never pruned when
  trained fused: no trial has finished when it reports.)
* good pruned: of the 8 best configurations (by their mean final value trained alone), how many
  were pruned.

    PYTHONPATH=/old/tree python3 benchmarks/group_effects.py --fuse 8 --out shared.json
    PYTHONPATH=$PWD python3 benchmarks/group_effects.py --fuse 8 --out per_trial.json
    PYTHONPATH=$PWD python3 benchmarks/group_effects.py --fuse 1 --out alone.json
    python3 benchmarks/group_effects.py --report shared.json per_trial.json alone.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

import optuna
import torch
from optuna.trial import TrialState

N_CONFIGS, STEPS, EVERY = 32, 40, 10


def make_task():
    import hydro

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    w1, w2 = torch.randn(32, 32, generator=g), torch.randn(32, 10, generator=g)
    y = (torch.tanh(x @ w1) @ w2 + 2.0 * torch.randn(4096, 10, generator=g)).argmax(-1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )
    return hydro.Task(model=model, train_data=(x[:3072], y[:3072]), val_data=(x[3072:], y[3072:]),
                      steps=STEPS, eval_every=EVERY, batch_size=16)


def configs() -> list[dict]:
    rng = random.Random(0)
    return [{"lr": 10 ** rng.uniform(-3.0, -1.3), "weight_decay": rng.uniform(0.0, 0.2)}
            for _ in range(N_CONFIGS)]


def run(fuse: int, seed: int) -> list[dict]:
    from optuna.distributions import FloatDistribution

    from hydro.integrations.optuna import optimize

    space = {"lr": FloatDistribution(1e-3, 10**-1.3, log=True),
             "weight_decay": FloatDistribution(0.0, 0.2)}
    study = optuna.create_study(
        sampler=optuna.samplers.RandomSampler(seed=seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=EVERY - 1),
    )
    for c in configs():
        study.enqueue_trial(c)
    optimize(study, make_task(), space, n_trials=N_CONFIGS, ratio=4, fuse=fuse, seed=seed * 1000)
    index = {json.dumps(c, sort_keys=True): i for i, c in enumerate(configs())}
    # cohort: the 8 trials asked together (one fused group when groups are fixed)
    return [{"config": index[json.dumps(t.params, sort_keys=True)], "group": t.number // 8,
             "pruned": t.state == TrialState.PRUNED,
             "first": t.intermediate_values.get(EVERY), "final": t.value}
            for t in study.trials]


def icc(rows: list[dict], mean_of: dict[int, float]) -> float:
    """One-way intra-class correlation of residuals, groups as classes."""
    groups: dict[int, list[float]] = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r["first"] - mean_of[r["config"]])
    groups = {g: v for g, v in groups.items() if len(v) > 1}
    if not groups:
        return float("nan")
    allv = [x for v in groups.values() for x in v]
    grand = statistics.fmean(allv)
    k = statistics.fmean(len(v) for v in groups.values())
    msb = sum(len(v) * (statistics.fmean(v) - grand) ** 2 for v in groups.values()) / max(
        1, len(groups) - 1)
    msw = sum((x - statistics.fmean(v)) ** 2 for v in groups.values() for x in v) / max(
        1, len(allv) - len(groups))
    return (msb - msw) / (msb + (k - 1) * msw) if msb + (k - 1) * msw else float("nan")


def clustered(rows: list[dict], shuffles: int = 2000) -> tuple[float, float]:
    """(groups all pruned or all kept, the same under random shuffles of the decisions)."""

    def count(decisions: list[bool]) -> int:
        groups: dict[int, list[bool]] = {}
        for r, d in zip(rows, decisions):
            groups.setdefault(r["group"], []).append(d)
        return sum(1 for v in groups.values() if len(v) > 1 and len(set(v)) == 1)

    decisions = [r["pruned"] for r in rows]
    rng = random.Random(0)
    base = []
    for _ in range(shuffles):
        d = decisions[:]
        rng.shuffle(d)
        base.append(count(d))
    return count(decisions), statistics.fmean(base)


def report(paths: list[str]) -> None:
    runs = {p: json.load(open(p)) for p in paths}
    alone = next((r for r in runs.values() if r["fuse"] == 1), None)
    if alone is None:
        raise SystemExit("--report needs a --fuse 1 run (the reference)")
    firsts: dict[int, list[float]] = {}
    finals: dict[int, list[float]] = {}
    for rows in alone["seeds"]:
        for r in rows:
            firsts.setdefault(r["config"], []).append(r["first"])
            if r["final"] is not None and not r["pruned"]:
                finals.setdefault(r["config"], []).append(r["final"])
    mean_first = {c: statistics.fmean(v) for c, v in firsts.items()}
    # quality: mean final value where it was trained to the end, else its first value
    quality = {c: statistics.fmean(finals.get(c) or firsts[c]) for c in firsts}
    good = set(sorted(quality, key=quality.get)[:8])
    print(f"{N_CONFIGS} configurations, median pruner, {STEPS} steps, eval every {EVERY}")
    print("| run | fuse | data order | ICC per seed | cohorts all-same / shuffled | good pruned |")
    print("|---|---|---|---|---|---|")
    for path, r in runs.items():
        iccs = [icc(rows, mean_first) for rows in r["seeds"]]
        cl = [clustered(rows) for rows in r["seeds"]]
        gp = [sum(1 for x in rows if x["pruned"] and x["config"] in good) for rows in r["seeds"]]
        icc_text = " ".join(f"{v:.2f}" for v in iccs)
        print(
            f"| {path} | {r['fuse']} | {r['order']} | {icc_text} | "
            f"{' '.join(f'{a}/{b:.1f}' for a, b in cl)} | {' '.join(map(str, gp))} of 8 |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fuse", type=int, default=8)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out")
    p.add_argument("--report", nargs="+")
    a = p.parse_args()
    if a.report:
        report(a.report)
        return
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(1)
    from hydro.tuning import group

    order = "per trial" if hasattr(group, "FusedGroup") else "shared by the group"
    out = {"fuse": a.fuse, "order": order if a.fuse > 1 else "own (alone)",
           "seeds": [run(a.fuse, s) for s in range(a.seeds)]}
    with open(a.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()

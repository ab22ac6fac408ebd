"""How full fused groups stay under a pruner: live trials per fused step, out of ``fuse``.

A study of 48 trials (TPE, median pruner, fuse 8) on a small MLP. With continuous batching a
slot freed by pruning takes the next trial at once; before it, a group shrank as its members were
pruned and the next batch waited for its slowest member. Run it on two trees to compare:

    PYTHONPATH=/path/to/old/tree python3 benchmarks/occupancy.py
    PYTHONPATH=$PWD python3 benchmarks/occupancy.py

Where the driver records ``hydro_occupancy`` (continuous batching) that figure is printed;
otherwise it is computed from the trials: steps each trial trained over (steps each group ran
x fuse). Prints a table; not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import optuna
import torch
from optuna.distributions import FloatDistribution, IntDistribution
from optuna.trial import TrialState

import hydro
from hydro.integrations.optuna import optimize


def make_task(steps: int) -> hydro.Task:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=g)
    y = (
        torch.tanh(x @ torch.randn(32, 32, generator=g)) @ torch.randn(32, 10, generator=g)
    ).argmax(-1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )  # fmt: skip
    return hydro.Task(model=model, train_data=(x[:1536], y[:1536]), val_data=(x[1536:], y[1536:]),
                      steps=steps, eval_every=10, batch_size=64)  # fmt: skip


SPACE = {
    "lr": FloatDistribution(1e-4, 3e-1, log=True),
    "weight_decay": FloatDistribution(0.0, 0.2),
    "warmup": IntDistribution(0, 10),
}


def post_hoc(study: optuna.Study, fuse: int, steps: int) -> float:
    """Occupancy from the trials alone: each trial's trained steps over its group's lifetime."""
    trained: dict[int, list[int]] = {}
    for t in study.trials:
        if t.state == TrialState.COMPLETE:
            n = steps
        else:
            n = max(t.intermediate_values, default=0)
        trained.setdefault(t.user_attrs["group"], []).append(n)
    return sum(map(sum, trained.values())) / sum(max(v) * fuse for v in trained.values())


def run(seed: int, trials: int, fuse: int, steps: int) -> dict:
    task = make_task(steps)
    study = optuna.create_study(
        sampler=optuna.samplers.TPESampler(seed=seed, constant_liar=True),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=fuse, n_warmup_steps=10),
    )
    start = time.perf_counter()
    optimize(study, task, SPACE, n_trials=trials, ratio=4, fuse=fuse, seed=seed)
    seconds = time.perf_counter() - start
    occ = study.user_attrs.get("hydro_occupancy")
    pruned = sum(t.state == TrialState.PRUNED for t in study.trials)
    return {
        "seconds": seconds,
        "pruned": pruned,
        "overall": occ["overall"] if occ else post_hoc(study, fuse, steps),
        "while_asking": occ["while_asking"] if occ else None,
        "best": study.best_value,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=48)
    p.add_argument("--fuse", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(1)
    rows = [run(seed, a.trials, a.fuse, a.steps) for seed in range(a.repeats)]
    print(f"{a.trials} trials, fuse {a.fuse}, {a.steps} steps, median pruner, TPE; "
          f"hydro from {hydro.__file__}")  # fmt: skip
    print("| seed | pruned | live/fuse (all steps) | live/fuse (while asking) | seconds | best |")
    print("|---|---|---|---|---|---|")
    for seed, r in enumerate(rows):
        asking = "-" if r["while_asking"] is None else f"{r['while_asking']:.1%}"
        print(f"| {seed} | {r['pruned']} | {r['overall']:.1%} | {asking} | {r['seconds']:.1f} | "
              f"{r['best']:.4f} |")  # fmt: skip
    print(f"median live/fuse {statistics.median(r['overall'] for r in rows):.1%}, "
          f"median seconds {statistics.median(r['seconds'] for r in rows):.1f}")  # fmt: skip


if __name__ == "__main__":
    main()

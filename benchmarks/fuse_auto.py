"""What ``fuse="auto"`` picks on the CPU examples, against the measured best fusion size.

For each example (the character-level GPT of examples/charlm, the CNN of examples/cnn, the MLP
of examples.models), a fused group of n surrogates trains a few steps at each n of ``--sizes``;
the table gives trial-steps per second (the median of ``--repeats`` windows of ``--steps``
steps, every size timed in turn in each round of this one run), the size ``fuse="auto"`` picks
(:func:`hydro.tuning.sizing.fuse_size`, not capped by any study's trial count), and its
throughput as a fraction of the best measured (the target: at least 0.5, i.e. within 2x).

    python benchmarks/fuse_auto.py                      # every example, sizes 1..64
    python benchmarks/fuse_auto.py --examples mlp --sizes 1,8,64 --repeats 3 --steps 3
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path

import optuna
import torch

from hydro.tuning.config import load
from hydro.tuning.group import FusedGroup
from hydro.tuning.sizing import fuse_size
from hydro.tuning.task import Task

ROOT = Path(__file__).resolve().parents[1]


def mlp_task() -> Task:
    """examples.models:mlp (4 layers, width 1024, 32 features, 10 classes) on generated data."""
    from examples.models import mlp

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    y = (x @ torch.randn(32, 10, generator=g)).argmax(-1)
    return Task(model=mlp, train_data=(x[:3584], y[:3584]), val_data=(x[3584:], y[3584:]),
                steps=100, batch_size=64)


def example(name: str) -> tuple[Task, dict, int]:
    """``(task, one trial's parameters, ratio)`` of an example, as its tune.yaml sets it up."""
    if name == "mlp":
        return mlp_task(), {"lr": 1e-3}, 8
    cfg = load(str(ROOT / "examples" / name / "tune.yaml"))
    trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask(cfg.space)
    return cfg.task, dict(trial.params), int(cfg.ratio)


def throughputs(task: Task, params: dict, ratio: int, sizes: list[int], steps: int,
                repeats: int) -> dict[int, float]:
    """Trial-steps per second of a fused group of each size: the median over ``repeats``
    windows of ``steps`` steps. The groups are built (and warmed up) first, then timed in
    turn, one window each per round, so that a change in the machine's load hits every size."""
    groups = {n: FusedGroup(task, [(k, dict(params), k) for k in range(n)], ratio=ratio)
              for n in sizes}
    for group in groups.values():
        for _ in range(2):
            group.step()
    rates: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n, group in groups.items():
            start = time.perf_counter()
            for _ in range(steps):
                group.step()
            rates[n].append(n * steps / (time.perf_counter() - start))
    return {n: statistics.median(r) for n, r in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="charlm,cnn,mlp")
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # width-floor advice about the examples' ratios
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"torch threads {torch.get_num_threads()}; trial-steps/s, median of {args.repeats} "
          f"windows of {args.steps} steps")
    print(f"{'example':8} {'n':>4} {'trial-steps/s':>14} {'of best':>8}")
    for name in args.examples.split(","):
        task, params, ratio = example(name)
        auto = fuse_size(task, params, ratio=ratio)
        measured = sorted(set(sizes) | {auto.n})
        rates = throughputs(task, params, ratio, measured, args.steps, args.repeats)
        best = max(rates.values())
        for n in measured:
            mark = "  <- auto" if n == auto.n else ""
            print(f"{name:8} {n:>4} {rates[n]:>14.1f} {rates[n] / best:>8.2f}{mark}")
        best_n = max(rates, key=rates.get)
        print(f"{name}: {auto.describe()}; best measured n={best_n}; auto/best "
              f"{rates[auto.n] / best:.2f} (target >= 0.5)")


if __name__ == "__main__":
    main()

"""End to end: plain Optuna on the full model versus ``hydro.tune`` on fused muP surrogates.

The same search (the same space, sampler, pruner and number of configurations) on the
character-level GPT of ``examples/charlm``:

* **plain**: Optuna's ``study.optimize`` with an objective that trains the full model with
  ``torch.optim.AdamW`` and reports its validation loss (pruned by the same pruner);
* **hydro**: ``hydro.tune`` at ratio 8 with 16 trials fused per group.

Then each method's chosen configuration is trained on the full model (same loop, same seed)
and the full-model losses compared. Prints one table per repeat and the medians; wall times are
measured side by side in one run.

    python benchmarks/end_to_end.py                     # defaults: 32 configurations, 1 repeat
    python benchmarks/end_to_end.py --trials 32 --repeats 3 --steps 150
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import optuna
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydro  # noqa: E402
from examples.charlm.data import load  # noqa: E402
from examples.charlm.model import gpt  # noqa: E402

SPACE = {
    "lr": optuna.distributions.FloatDistribution(3e-4, 3e-2, log=True),
    "weight_decay": optuna.distributions.FloatDistribution(0.0, 0.2),
    "warmup": optuna.distributions.IntDistribution(0, 20),
    "beta2": optuna.distributions.CategoricalDistribution([0.95, 0.99, 0.999]),
}


def full_model_run(args, params: dict, seed: int, trial: optuna.Trial | None = None) -> float:
    """Train the unmodified full model with plain PyTorch; the final validation loss."""
    data = load(block_size=args.block, max_chars=args.chars)
    torch.manual_seed(seed)
    model = gpt(n_layer=args.layers, n_head=args.heads, n_embd=args.width, block_size=args.block)
    opt = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=(0.9, params["beta2"]),
                            weight_decay=params["weight_decay"])  # fmt: skip
    warmup, steps = params["warmup"], args.steps

    def factor(step: int) -> float:  # warm-up, then cosine to zero
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    x, y = data["train"]
    g = torch.Generator().manual_seed(seed)
    value = math.nan
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(y), (args.batch,), generator=g)
        logits = model(x[idx])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y[idx].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % args.eval_every == 0 or step == steps:
            value = evaluate(model, data["val"])
            if not math.isfinite(value):
                raise optuna.TrialPruned() if trial is not None else ValueError("diverged")
            if trial is not None:
                trial.report(value, step)
                if step < steps and trial.should_prune():
                    raise optuna.TrialPruned()
    return value


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: tuple) -> float:
    model.eval()
    x, y = val
    total = 0.0
    for i in range(0, len(y), 256):
        logits = model(x[i : i + 256])
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), y[i : i + 256].reshape(-1),
                                 reduction="sum").item()  # fmt: skip
    model.train()
    return total / y.numel()


def run_plain(args, seed: int) -> tuple[float, dict]:
    sampler = optuna.samplers.TPESampler(seed=seed, constant_liar=True)
    study = optuna.create_study(sampler=sampler, pruner=optuna.pruners.MedianPruner())

    def objective(trial: optuna.Trial) -> float:
        params = {name: hydro.tuning.space.suggest(trial, name, d) for name, d in SPACE.items()}
        return full_model_run(args, params, seed, trial)

    start = time.perf_counter()
    study.optimize(objective, n_trials=args.trials)
    return time.perf_counter() - start, study.best_params


def run_hydro(args, seed: int) -> tuple[float, dict]:
    data = load(block_size=args.block, max_chars=args.chars)
    torch.manual_seed(seed)
    target = gpt(n_layer=args.layers, n_head=args.heads, n_embd=args.width, block_size=args.block)
    task = hydro.Task(
        model=target,
        train_data=data["train"],
        val_data=data["val"],
        loss="cross_entropy",
        optimizer="adamw",
        scheduler="cosine",
        steps=args.steps,
        eval_every=args.eval_every,
        batch_size=args.batch,
    )
    start = time.perf_counter()
    result = hydro.tune(task, SPACE, n_trials=args.trials, ratio=args.ratio, fuse=args.fuse,
                        storage="sqlite:///:memory:", seed=seed)  # fmt: skip
    return time.perf_counter() - start, result.best_params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--ratio", type=int, default=8)
    p.add_argument("--fuse", type=int, default=16)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--eval-every", type=int, default=40)
    p.add_argument("--chars", type=int, default=200_000)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    print(f"charlm GPT: {args.layers} layers, width {args.width}, block {args.block}, batch "
          f"{args.batch}, {args.steps} steps; {args.trials} configurations; hydro ratio "
          f"{args.ratio}, {args.fuse} fused; torch threads {torch.get_num_threads()}")  # fmt: skip
    rows = []
    for r in range(args.repeats):
        seed = r
        t_plain, best_plain = run_plain(args, seed)
        t_hydro, best_hydro = run_hydro(args, seed)
        loss_plain = full_model_run(args, best_plain, seed=1000 + seed)
        loss_hydro = full_model_run(args, best_hydro, seed=1000 + seed)
        rows.append((t_plain, t_hydro, loss_plain, loss_hydro))
        print(f"\nrepeat {r}: best plain {best_plain}\n          best hydro {best_hydro}")
        print(f"{'method':8} {'wall s':>9} {'full-model loss':>16}")
        print(f"{'plain':8} {t_plain:9.1f} {loss_plain:16.4f}")
        print(f"{'hydro':8} {t_hydro:9.1f} {loss_hydro:16.4f}")
        print(f"speed-up {t_plain / t_hydro:.1f}x; hydro's loss vs plain's: "
              f"{100 * (loss_hydro - loss_plain) / loss_plain:+.2f}%")  # fmt: skip
    speedups = [tp / th for tp, th, _, _ in rows]
    gaps = [100 * (lh - lp) / lp for _, _, lp, lh in rows]
    print(f"\nover {len(rows)} repeat(s): speed-up median {statistics.median(speedups):.1f}x "
          f"(range {min(speedups):.1f}-{max(speedups):.1f}x); hydro's full-model loss vs "
          f"plain's: median {statistics.median(gaps):+.2f}% (range {min(gaps):+.2f}% to "
          f"{max(gaps):+.2f}%)")  # fmt: skip


if __name__ == "__main__":
    main()

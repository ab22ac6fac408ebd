"""Do learning rate, weight decay and warm-up transfer across width *and depth* on a BatchNorm CNN?

The target is ``examples.cnn.model.deep_cnn(width=64, blocks=4)``: a BatchNorm ResNet with two
stages of 4 identically shaped residual blocks (64 and 128 channels) around a strided block, on
the generated shapes of ``examples/cnn`` (8x8 pixels, to fit a shared CPU). Against it:

* Hydro surrogates at ``(ratio, depth_ratio)`` = (8, 1), (8, 2), (8, 4) (8/16 channels: below
  the conv width floor) and (4, 1), (4, 4) (16/32 channels: at it), trained with Hydro's muP
  (and CompleteP depth) multipliers;
* naive narrow / shallow models in standard parametrization: ``deep_cnn(8, 4)``,
  ``deep_cnn(8, 1)`` and ``deep_cnn(16, 1)``, every parameter at the same learning rate.

Every model is trained with SGD (momentum 0.9, as ``examples/cnn/tune.yaml``), linear warm-up and
cosine decay to 10%. Phase ``lr``: a grid of learning rates (no weight decay, 10% warm-up).
Phase ``hp``: at each model's own best learning rate (the median over seeds of phase ``lr``),
a grid of weight decays (10% warm-up) and one of warm-up lengths (no weight decay). Each grid of
one model and seed is ONE fused model (``hydro.fuse`` of identical copies: every grid point
starts from the same initialization and sees the same batches), per-trial hyperparameters through
``hydro.optim.SGD`` and a ``TrialScheduler``: fused training is exactly separate training
(tests/fusion), and several times cheaper here. One thread.

Per grid it reports each model's best value, its distance from the full model's in grid steps,
Spearman's rank correlation with the full model over the grid, and the full model's loss at the
model's choice; a model *transfers* when it is within one grid step and Spearman >= 0.9. Then the
median wall time of one training step of each model, alone (not fused), taken interleaved.

Not a test. Results go to a JSON-lines file as each grid finishes; a rerun resumes. The full
model costs most of the time, and its grids do not depend on the others', so on a busy machine
run it apart (phase ``hp`` needs every seed of its phase ``lr`` in its ``--out`` file)::

    python benchmarks/transfer_cnn.py                 # 3 seeds, both phases
    python benchmarks/transfer_cnn.py --models full --phases lr --seed-list 1 --out f1.jsonl
    python benchmarks/transfer_cnn.py --combine a.jsonl f1.jsonl    # the tables
    python benchmarks/transfer_cnn.py --step-times    # interleaved step times
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed
import hydro
from benchmarks.transfer import lr_lambda
from examples.cnn.data import load
from examples.cnn.model import deep_cnn
from hydro.errors import HydroWarning
from hydro.tuning.verification import spearman

RESULTS = Path(__file__).resolve().parent / "results"  # the committed result files
WIDTH, BLOCKS = 64, 4
# name -> ("hydro", ratio, depth_ratio) or ("naive", width, blocks)
MODELS: dict[str, tuple[str, int, int]] = {
    "full": ("hydro", 1, 1),
    "(8,1)": ("hydro", 8, 1),
    "(8,2)": ("hydro", 8, 2),
    "(8,4)": ("hydro", 8, 4),
    "(4,1)": ("hydro", 4, 1),
    "(4,4)": ("hydro", 4, 4),
    "naive 8x4": ("naive", 8, 4),
    "naive 8x1": ("naive", 8, 1),
    "naive 16x1": ("naive", 16, 1),
}
LR_EXP = list(range(-8, 1))  # SGD learning rates 2^-8 .. 1, 2x steps
WD_EXP = [-12, -10, -8, -6, -4]  # weight decays 2^-12 .. 2^-4, 4x steps
WARMUPS = [0, 4, 8, 16, 32]  # warm-up steps (of --steps; 8 is the default 10%)


def build(name: str, seed: int, example: torch.Tensor) -> nn.Module:
    """Model ``name`` for ``seed``: the target's initialization is the seed's, and a surrogate
    is drawn from it (``hydro.scale(..., seed=seed)``)."""
    kind, a, b = MODELS[name]
    torch.manual_seed(seed)
    if kind == "naive":
        return deep_cnn(a, b)
    target = deep_cnn(WIDTH, BLOCKS)
    if a == 1 and b == 1:
        return target  # ratio 1, depth ratio 1: the target itself, in SP
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HydroWarning)  # ratio 8 is below the conv floor: measured
        return hydro.scale(target, a, depth_ratio=b, example_inputs=(example,), seed=seed)


def grid(phase: str, lr: float | None = None) -> list[dict]:
    """The trials of one fused grid: ``{"lr", "wd", "warmup"}`` each."""
    if phase == "lr":
        return [{"lr": 2.0**e, "wd": 0.0, "warmup": None} for e in LR_EXP]
    wd = [{"lr": lr, "wd": 2.0**e, "warmup": None} for e in WD_EXP]
    warm = [{"lr": lr, "wd": 0.0, "warmup": w} for w in WARMUPS]
    return {"hp": wd + warm, "wd": wd, "warmup": warm}[phase]


def train_grid(model: nn.Module, trials: list[dict], data: dict, batches: torch.Tensor,
               steps: int) -> tuple[list[float], float]:
    """Train one fused copy of ``model`` per trial; each trial's validation loss (NaN when it
    diverged) and the median wall time of a fused step."""
    n = len(trials)
    fused = hydro.fuse([model] * n)
    opt = hydro.optim.SGD(fused.parameters(), lr=[t["lr"] for t in trials], momentum=0.9,
                          weight_decay=[t["wd"] for t in trials], compile=False)
    default = max(1, steps // 10)
    warm = [default if t["warmup"] is None else t["warmup"] for t in trials]
    sched = hydro.optim.lr_scheduler.TrialScheduler(
        opt, lambda o, k: torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(warm[k], steps))
    )
    x, y = data["train"]
    fused.train()
    times = []
    for idx in batches:
        t0 = time.perf_counter()
        loss = hydro.trial_loss(F.cross_entropy, fused(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.sum().backward()
        opt.step()
        sched.step()
        times.append(time.perf_counter() - t0)
    fused.eval()
    xv, yv = data["val"]
    with torch.no_grad():
        val = sum(hydro.trial_loss(F.cross_entropy, fused(xv[i : i + 256]), yv[i : i + 256])
                  * len(yv[i : i + 256]) for i in range(0, len(yv), 256))
    val = (val / len(yv)).tolist()
    bad = fused.diverged.tolist()
    out = [float("nan") if b or not math.isfinite(v) else v for v, b in zip(val, bad)]
    return out, float(np.median(times))


def best_lrs(rows: list[dict]) -> dict[str, float]:
    """Each model's best learning rate on the median over seeds of its ``lr`` grid."""
    out = {}
    for name in MODELS:
        runs = [r["losses"] for r in rows if r["phase"] == "lr" and r["model"] == name]
        if runs:
            med = np.nanmedian(np.array(runs, dtype=float), axis=0)
            out[name] = 2.0 ** LR_EXP[int(np.nanargmin(med))]
    return out


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    data = load(n_train=2048, n_val=512, size=args.size, seed=0)
    example = data["train"][0][:2]
    rows = [json.loads(line) for line in args.out.read_text().splitlines()] if args.out.exists() \
        else []
    done = {(r["phase"], r["model"], r["seed"]) for r in rows}
    start = time.time()
    names = args.models or list(MODELS)
    seeds = args.seed_list if args.seed_list is not None else range(args.seeds)
    for phase in args.phases:
        lrs = best_lrs(rows)
        # the cheap models first: numbers early
        for seed in seeds:
            for name in reversed(names):
                if (phase, name, seed) in done:
                    continue
                if phase != "lr" and name not in lrs:
                    continue
                g = torch.Generator().manual_seed(1000 + seed)  # one batch order per seed
                batches = torch.randint(len(data["train"][0]), (args.steps, args.batch),
                                        generator=g)
                model = build(name, seed, example)
                trials = grid(phase, lrs.get(name))
                t0 = time.time()
                losses, step = train_grid(model, trials, data, batches, args.steps)
                row = {"phase": phase, "model": name, "seed": seed, "losses": losses,
                       "trials": trials, "fused_step_s": step, "n": len(trials),
                       "steps": args.steps, "wall_s": time.time() - t0}
                rows.append(row)
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{phase} {name:>10} seed {seed}: {time.time() - t0:5.0f} s "
                      f"(elapsed {time.time() - start:.0f} s)", flush=True)
    report(rows)


def step_times(args: argparse.Namespace, rounds: int = 20) -> dict[str, float]:
    """Median wall time of one SGD step of each model alone (not fused), taken interleaved: one
    step of each in turn, so that a busy machine slows them alike."""
    torch.set_num_threads(1)
    data = load(n_train=2048, n_val=8, size=args.size, seed=0)
    x, y = data["train"]
    models = {k: build(k, 0, x[:2]) for k in MODELS}
    opts = {k: torch.optim.SGD(hydro.parametrize.param_groups(m, lr=0.01) if MODELS[k][0] ==
                               "hydro" else m.parameters(), lr=0.01, momentum=0.9)
            for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    g = torch.Generator().manual_seed(0)
    for r in range(rounds + 2):
        idx = torch.randint(len(x), (args.batch,), generator=g)
        for k, m in models.items():
            t0 = time.perf_counter()
            loss = F.cross_entropy(m(x[idx]), y[idx])
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            opts[k].step()
            if r >= 2:
                times[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in times.items()}


def verdict(values: list[float], losses: np.ndarray, full: np.ndarray) -> tuple[int, float]:
    """(distance in grid steps of the best value from the full model's, Spearman)."""
    shift = int(np.nanargmin(losses)) - int(np.nanargmin(full))
    rho = spearman(list(losses), list(full))
    return shift, float("nan") if rho is None else rho


def table(title: str, labels: list[str], runs: dict[str, list[list[float]]]) -> str:
    """Median losses, one row per grid point and one column per model, then the verdicts."""
    med = {k: np.nanmedian(np.array(v, dtype=float), axis=0) for k, v in runs.items() if v}
    if "full" not in med:
        return f"{title}: no full-model runs yet"
    n = min(len(v) for v in runs.values() if v)
    lines = [f"{title} (median of {n}+ seeds; * = best)",
             f"{'':>8} | " + " ".join(f"{k:>11}" for k in med)]
    for i, lab in enumerate(labels):
        cells = []
        for v in med.values():
            star = "*" if not np.isnan(v[i]) and v[i] == np.nanmin(v) else " "
            cells.append(f"{_num(v[i]):>10}{star}")
        lines.append(f"{lab:>8} | " + " ".join(cells))
    full = med["full"]
    lines.append(f"{'model':>10}  best      shift  Spearman  full's loss there  per-seed best  "
                 "transfers")
    for k, v in med.items():
        shift, rho = verdict(labels, v, full)
        b = int(np.nanargmin(v))
        per_seed = ",".join(labels[int(np.nanargmin(s))] if np.isfinite(s).any() else "-"
                            for s in np.array(runs[k], dtype=float))
        ok = abs(shift) <= 1 and rho >= 0.9
        lines.append(f"{k:>10}  {labels[b]:>8} {shift:+5d}  {rho:+8.3f}  "
                     f"{_num(full[b]):>6} ({_num(full[b] - np.nanmin(full), '+.3f'):>6})  "
                     f"{per_seed:>18}  "
                     f"{'yes' if ok else 'NO'}")
    return "\n".join(lines)


def _num(v: float, fmt: str = ".3f") -> str:
    """A loss for a table: diverged (NaN) and blown-up (> 99) runs short."""
    return "nan" if np.isnan(v) else ">99" if v > 99 else format(v, fmt)


def report(rows: list[dict]) -> None:
    names = [k for k in MODELS if any(r["model"] == k for r in rows)]
    lr = {k: [r["losses"] for r in rows if r["phase"] == "lr" and r["model"] == k] for k in names}
    print(table("learning rate, SGD, no weight decay", [f"2^{e}" for e in LR_EXP], lr))
    nw = len(WD_EXP)
    # phase hp holds both grids; phases wd and warmup one each (the full model, run apart)
    wd = {k: [r["losses"][:nw] if r["phase"] == "hp" else r["losses"] for r in rows
              if r["phase"] in ("hp", "wd") and r["model"] == k] for k in names}
    warm = {k: [r["losses"][nw:] if r["phase"] == "hp" else r["losses"] for r in rows
                if r["phase"] in ("hp", "warmup") and r["model"] == k] for k in names}
    bests = best_lrs(rows)
    at = ", ".join(f"{k} 2^{round(math.log2(v))}" for k, v in bests.items())
    print(f"\nphase hp: each model at its own best learning rate ({at})\n")
    print(table("weight decay", [f"2^{e}" for e in WD_EXP], wd))
    print()
    print(table("warm-up steps", [str(w) for w in WARMUPS], warm))
    fused = {k: [r["fused_step_s"] / r["n"] for r in rows if r["model"] == k] for k in names}
    print(
        "\nfused sweep, seconds per trial-step (median): "
        + ", ".join(f"{k} {np.median(v) * 1e3:.1f} ms" for k, v in fused.items() if v)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", type=int, default=8, help="image height and width, pixels")
    p.add_argument("--models", nargs="+", choices=list(MODELS), help="a subset (default all)")
    p.add_argument("--seed-list", type=int, nargs="+", help="run these seeds (not 0..seeds-1)")
    p.add_argument("--phases", nargs="+", default=["lr", "hp"],
                   choices=["lr", "hp", "wd", "warmup"], help="hp = wd and warmup in one fused "
                   "model; wd and warmup apart (2 processes)")
    p.add_argument("--out", type=Path, default=RESULTS / "transfer_cnn.jsonl")
    p.add_argument("--combine", type=Path, nargs="+", help="report the rows of these files")
    p.add_argument("--report", action="store_true", help="only print the tables from --out")
    p.add_argument("--step-times", action="store_true", help="only the interleaved step times")
    args = p.parse_args()
    if args.step_times:
        t = step_times(args)
        base = t["(8,1)"]
        print(f"step time alone, median of 20 interleaved steps ({args.batch} images of "
              f"{args.size}x{args.size}, 1 thread):")
        for k, v in t.items():
            print(
                f"{k:>10}: {v * 1e3:7.1f} ms  {v / base:5.2f} x (8,1)  {v / t['full']:.3f} x full"
            )
        return
    if args.report or args.combine:
        paths = args.combine or [args.out]
        report([json.loads(line) for p in paths for line in p.read_text().splitlines()])
        return
    run(args)


if __name__ == "__main__":
    main()

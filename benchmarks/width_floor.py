"""How narrow can a surrogate get before the best learning rate stops transferring?  Per layer kind.

For three kinds of width this sweeps the AdamW learning rate of Hydro surrogates of one target at
several ratios and compares each surrogate's curve with the target's (ratio 1):

* ``linear``: the hidden width of a 3-hidden-layer ReLU MLP regressing a fixed random teacher
  network (32 inputs, 10 outputs, mean squared error; fresh-enough data that it cannot overfit).
* ``conv``: the channels of the BatchNorm ResNet of ``examples/cnn`` (first stage ``width``,
  second ``2 * width``) on its synthetic shapes, cross-entropy.
* ``attention``: the head dim of the GPT of ``examples/charlm`` (1 block, 2 heads) on a task only
  attention solves (predict the token 3 positions back, 64 random tokens), shrunk with
  ``head_policy="keep_head_count"`` so that the head dim is what narrows; the model width
  narrows with it, and the ``linear`` rows say whether that alone would matter.

Second tasks, and the attention head count (each lr grid trained as one fused model):

* ``linear2``: the same MLP shape (hidden width 256) classifying the shapes of ``examples/cnn``
  from their flattened 8x8 pixels (cross-entropy).
* ``conv2``: a plain 4-layer ConvNet without any normalization (``PlainCNN``, 32/64 channels) on
  the shapes at 8x8 pixels, 150 steps.
* ``heads`` and ``headdim``: one GPT target with 8 heads of 16 (width 128) on the lag task,
  shrunk two ways: Hydro's default ``head_policy="keep_head_dim"`` keeps the head dim and cuts
  the head count (8, 4, 2, 1 heads), ``"keep_head_count"`` keeps 8 heads and cuts the head dim
  (16, 8, 4, 2). The model width is 128 / ratio either way.

A surrogate *transfers* when, on the median over seeds of the validation loss, its best learning
rate is within one 2x grid step of the target's and its Spearman rank correlation with the target
over the grid is at least 0.9. The *floor* of a kind is the narrowest width that transfers (a
wider one that misses is reported in the table: on 7-8 grid points each swap of two neighbours
costs 0.024-0.036 of Spearman, so near the optimum, where losses are close, noise swaps some).
``hydro/fx/floor.py`` holds the floors measured here.

Not a test. Sized for a busy, shared 2-core CPU (docs/explanation/transfer.md gives the time
taken)::

    python benchmarks/width_floor.py                    # all kinds, 3 seeds
    python benchmarks/width_floor.py --kinds heads headdim linear2 conv2 --jobs 1
    python benchmarks/width_floor.py --kinds conv --seeds 2
    python benchmarks/width_floor.py --report           # the tables from --out
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed
import hydro
from benchmarks.transfer import lr_lambda
from hydro.errors import HydroWarning
from hydro.tuning.verification import spearman

RESULTS = Path(__file__).resolve().parent / "results"  # the committed result files


@dataclass
class Kind:
    """One layer kind: its target, data, grid, and which width narrows."""

    name: str
    what: str  # the width that narrows, in words
    width: int  # its size in the target
    ratios: list[int]
    lr_exp: tuple[int, int]
    steps: int
    batch: int
    head_policy: str = "keep_head_dim"


KINDS = {
    "linear": Kind("linear", "MLP hidden width", 256, [1, 2, 4, 8, 16, 32], (-12, -5), 200, 64),
    "conv": Kind("conv", "first-stage channels (BN)", 32, [1, 2, 4, 8], (-10, -4), 80, 32),
    "attention": Kind(
        "attention",
        "head dim (2 heads)",
        64,
        [1, 2, 4, 8],
        (-11, -4),
        150,
        32,
        head_policy="keep_head_count",
    ),
    # second tasks, and the head count (trained fused: see `cell`)
    "linear2": Kind(
        "linear2", "MLP hidden width, shapes", 256, [1, 2, 4, 8, 16], (-12, -5), 150, 64
    ),
    "conv2": Kind("conv2", "channels, no normalization", 32, [1, 2, 4, 8], (-11, -5), 150, 32),
    "heads": Kind("heads", "head count (head dim 16)", 8, [1, 2, 4, 8], (-11, -4), 150, 32),
    "headdim": Kind(
        "headdim",
        "head dim (8 heads)",
        16,
        [1, 2, 4, 8],
        (-11, -4),
        150,
        32,
        head_policy="keep_head_count",
    ),
}
# kinds trained as one fused model per lr grid (hydro.fuse + hydro.optim.AdamW: exactly separate
# training, tests/fusion), the first three were trained one run at a time
FUSED = {"linear2", "conv2", "heads", "headdim"}


class MLP(nn.Module):
    def __init__(self, d_in: int, width: int, d_out: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, d_out),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class PlainCNN(nn.Module):
    """Four 3x3 conv-ReLU layers (``width``, ``width``, ``2 * width``, ``2 * width``), a max-pool
    after the second, average pool, linear: convolution channels without any normalization."""

    def __init__(self, width: int, classes: int = 10) -> None:
        super().__init__()
        w2 = 2 * width
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(width, w2, 3, padding=1), nn.ReLU(),
            nn.Conv2d(w2, w2, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(w2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _lag_task(g: torch.Generator) -> dict:
    """Predict the token 3 positions back (64 random tokens, 16 positions): only attention can."""
    t, vocab, lag = 16, 64, 3
    x = torch.randint(0, vocab, (8192 + 1024, t), generator=g)
    y = torch.roll(x, lag, 1)
    y[:, :lag] = x[:, :lag]  # the first positions copy themselves
    return {"train": (x[:8192], y[:8192]), "val": (x[8192:], y[8192:])}


def setup(kind: Kind, seed: int) -> tuple[nn.Module, dict, Callable]:
    """The target (initialized from ``seed``), the data (the same for every seed), the loss."""
    g = torch.Generator().manual_seed(123)
    if kind.name in ("attention", "heads", "headdim"):
        from examples.charlm.model import gpt

        data = _lag_task(g)
        torch.manual_seed(seed)
        if kind.name == "attention":
            return gpt(n_layer=1, n_head=2, n_embd=2 * kind.width, block_size=16), data, \
                cross_entropy
        # 8 heads of 16: ``heads`` cuts the head count (Hydro's default), ``headdim`` the dim
        return gpt(n_layer=1, n_head=8, n_embd=128, block_size=16), data, cross_entropy
    if kind.name == "linear":
        d = 32
        w1, w2 = torch.randn(d, 64, generator=g) / d**0.5, torch.randn(64, 10, generator=g) / 8
        x = torch.randn(16384 + 2048, d, generator=g)
        y = torch.tanh(x @ w1) @ w2
        torch.manual_seed(seed)
        data = {"train": (x[:16384], y[:16384]), "val": (x[16384:], y[16384:])}
        return MLP(d, kind.width, 10), data, F.mse_loss
    from examples.cnn.data import load
    from examples.cnn.model import cnn

    if kind.name == "linear2":  # the shapes of examples/cnn, flattened: classification
        data = load(n_train=4096, n_val=1024, size=8, seed=1)
        data = {k: (x.flatten(1), y) for k, (x, y) in data.items()}
        torch.manual_seed(seed)
        return MLP(3 * 8 * 8, kind.width, 10), data, cross_entropy
    if kind.name == "conv2":
        torch.manual_seed(seed)
        # 8x8 pixels: at 12x12 this net (no normalization) sat at chance for half the grid
        return PlainCNN(kind.width), load(n_train=2048, n_val=512, size=8, seed=1), cross_entropy
    torch.manual_seed(seed)
    return cnn(width=kind.width), load(n_train=2048, n_val=512, size=12), cross_entropy


def cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


def train(model: nn.Module, lr: float, data: dict, batches: torch.Tensor, steps: int,
          loss_of: Callable) -> float:
    """AdamW with muP groups, warm-up and cosine decay; the validation loss (NaN if diverged)."""
    opt = torch.optim.AdamW(hydro.parametrize.param_groups(model, lr=lr), betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(max(1, steps // 10), steps))
    x, y = data["train"]
    model.train()
    for idx in batches:
        loss = loss_of(model(x[idx]), y[idx])
        if not torch.isfinite(loss):
            return float("nan")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    with torch.no_grad():
        xv, yv = data["val"]
        total = sum(float(loss_of(model(xv[i : i + 256]), yv[i : i + 256])) * len(yv[i : i + 256])
                    for i in range(0, len(yv), 256))
    loss = total / len(yv)
    return loss if math.isfinite(loss) else float("nan")


def train_fused(model: nn.Module, lrs: list[float], data: dict, batches: torch.Tensor,
                steps: int) -> list[float]:
    """``train`` for every learning rate at once: one fused model, ``hydro.optim.AdamW`` (the
    same muP multipliers as ``param_groups``) and per-trial warm-up + cosine; losses per lr."""
    n = len(lrs)
    fused = hydro.fuse([model] * n)
    opt = hydro.optim.AdamW(fused.parameters(), lr=lrs, betas=(0.9, 0.95), weight_decay=0.0,
                            compile=False)
    sched = hydro.optim.lr_scheduler.TrialScheduler(
        opt, lambda o, k: torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(max(1, steps // 10),
                                                                       steps))
    )
    loss_of = cross_entropy if data["train"][1].dtype == torch.long else F.mse_loss
    x, y = data["train"]
    fused.train()
    for idx in batches:
        opt.zero_grad(set_to_none=True)
        hydro.trial_loss(loss_of, fused(x[idx]), y[idx]).sum().backward()
        opt.step()
        sched.step()
    fused.eval()
    with torch.no_grad():
        xv, yv = data["val"]
        total = sum(hydro.trial_loss(loss_of, fused(xv[i : i + 256]), yv[i : i + 256])
                    * len(yv[i : i + 256]) for i in range(0, len(yv), 256))
    out = (total / len(yv)).tolist()
    return [float("nan") if d or not math.isfinite(v) else v
            for v, d in zip(out, fused.diverged.tolist())]


def cell(job: tuple[str, int, int]) -> tuple[str, int, int, list[float], float]:
    """One (kind, seed, ratio): the loss per learning rate, every run from the same init."""
    name, seed, ratio = job
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", HydroWarning)  # going below the floors is the point here
    kind = KINDS[name]
    target, data, loss_of = setup(kind, seed)
    example = (data["train"][0][:2],)
    g = torch.Generator().manual_seed(1000 + seed)  # one data order per seed, shared by all cells
    batches = torch.randint(len(data["train"][0]), (kind.steps, kind.batch), generator=g)
    sur = hydro.scale(target, ratio, example_inputs=example, seed=seed,
                      head_policy=kind.head_policy)
    start = time.perf_counter()
    lrs = [2.0**e for e in range(kind.lr_exp[0], kind.lr_exp[1] + 1)]
    if name in FUSED:
        losses = train_fused(sur, lrs, data, batches, kind.steps)
        return name, seed, ratio, losses, time.perf_counter() - start
    init = {k: v.clone() for k, v in sur.state_dict().items()}
    losses = []
    for lr in lrs:
        sur.load_state_dict(init)
        losses.append(train(sur, lr, data, batches, kind.steps, loss_of))
    return name, seed, ratio, losses, time.perf_counter() - start


def verdict(lrs: list[float], losses: np.ndarray, target: np.ndarray) -> tuple[int, float, bool]:
    """(log2 shift of the best lr, Spearman vs target, transfers?)."""
    shift = int(round(math.log2(lrs[int(np.nanargmin(losses))] / lrs[int(np.nanargmin(target))])))
    rho = spearman(list(losses), list(target))
    return shift, rho, abs(shift) <= 1 and rho >= 0.9


def report(name: str, cells: dict[int, dict[int, list[float]]]) -> tuple[str, int | None]:
    """The table of one kind and its floor (None if even ratio 2 fails), over the seeds that
    finished at every ratio."""
    kind = KINDS[name]
    seeds = sorted(set.intersection(*(set(v) for v in cells.values())))
    runs = {r: [v[s] for s in seeds] for r, v in cells.items()}
    lrs = [2.0**e for e in range(kind.lr_exp[0], kind.lr_exp[1] + 1)]
    med = {r: np.nanmedian(np.array(v, dtype=float), axis=0) for r, v in runs.items()}
    n = len(seeds)
    lines = [
        f"{name}: {kind.what}, target {kind.width}, median of {n} seed(s), "
        f"lr grid 2^{kind.lr_exp[0]}..2^{kind.lr_exp[1]}",
        f"{'ratio':>5} {'width':>5}  "
        + " ".join(f"{'2^' + str(round(math.log2(lr))):>6}" for lr in lrs)
        + "   best  shift  Spearman  transfers  target there",
    ]
    floor = None
    for r in sorted(med):
        shift, rho, ok = verdict(lrs, med[r], med[1])
        best = round(math.log2(lrs[int(np.nanargmin(med[r]))]))
        cells = " ".join(f"{'nan' if math.isnan(v) else f'{v:.3f}':>6}" for v in med[r])
        # what the choice costs: the target's loss at this ratio's best rate, against its best
        there = med[1][int(np.nanargmin(med[r]))]
        lines.append(f"{r:>5} {kind.width // r:>5}  {cells}   2^{best:<3} {shift:+5d}  "
                     f"{rho:+8.3f}  {'yes' if ok else 'NO ':<9}  {there:.3f} "
                     f"({there - np.nanmin(med[1]):+.3f})")
        if ok:
            floor = kind.width // r
    lines.append(f"floor ({kind.what}): {floor}")
    return "\n".join(lines), floor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="run seeds first-seed..seeds-1")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (one thread each)")
    p.add_argument(
        "--out",
        type=Path,
        default=RESULTS / "width_floor.jsonl",
        help="one line per finished cell; a rerun skips the cells found there",
    )
    p.add_argument("--report", action="store_true", help="only print the tables from --out")
    args = p.parse_args()
    # the slowest cells first, so that the pool does not end on one long cell
    cost = {"conv": 3, "conv2": 3, "attention": 2, "heads": 2, "headdim": 2, "linear": 1,
            "linear2": 1}
    jobs = sorted(((k, s, r) for s in range(args.first_seed, args.seeds) for k in args.kinds
                   for r in KINDS[k].ratios), key=lambda j: (j[1], -cost[j[0]], j[2]))
    runs: dict[str, dict[int, dict]] = {k: {r: {} for r in KINDS[k].ratios} for k in args.kinds}
    secs: dict[str, dict[int, list]] = {k: {r: [] for r in KINDS[k].ratios} for k in args.kinds}
    done = set()
    if args.out.exists():  # resume: a busy machine may not give one sitting enough time
        for line in args.out.read_text().splitlines():
            name, seed, ratio, losses, sec = json.loads(line)
            if name in runs and ratio in runs[name] and seed < args.seeds:
                runs[name][ratio][seed] = losses
                secs[name][ratio].append(sec)
                done.add((name, seed, ratio))
    start = time.time()
    jobs = [j for j in jobs if j not in done and not args.report]
    with mp.get_context("spawn").Pool(args.jobs) as pool, args.out.open("a") as out:
        for name, seed, ratio, losses, sec in pool.imap_unordered(cell, jobs):
            runs[name][ratio][seed] = losses
            secs[name][ratio].append(sec)
            out.write(json.dumps([name, seed, ratio, losses, sec]) + "\n")
            out.flush()
            print(f"{name} seed {seed} ratio {ratio}: {sec:.0f} s "
                  f"(elapsed {time.time() - start:.0f} s)", flush=True)
    print()
    floors = {}
    for name in args.kinds:
        if not set.intersection(*(set(v) for v in runs[name].values())):
            print(f"{name}: not every ratio has a finished seed yet\n")
            continue
        text, floors[name] = report(name, runs[name])
        print(text)
        per = ", ".join(f"r{r} {np.median(v):.0f}s" for r, v in secs[name].items())
        print(f"time per lr sweep (median): {per}\n")
    print("floors:", floors, f"  total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

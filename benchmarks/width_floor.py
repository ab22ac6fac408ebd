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

A surrogate *transfers* when, on the median over seeds of the validation loss, its best learning
rate is within one 2x grid step of the target's and its Spearman rank correlation with the target
over the grid is at least 0.9. The *floor* of a kind is the narrowest width that transfers (a
wider one that misses is reported in the table: on 7-8 grid points each swap of two neighbours
costs 0.024-0.036 of Spearman, so near the optimum, where losses are close, noise swaps some).
``hydro/fx/floor.py`` holds the floors measured here.

Not a test. Sized for a busy, shared 2-core CPU (see docs/transfer.md for the time taken)::

    python benchmarks/width_floor.py                    # all kinds, 3 seeds
    python benchmarks/width_floor.py --kinds conv --seeds 2
    python benchmarks/width_floor.py --report           # the tables from width_floor.jsonl
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
import hydro  # noqa: E402
from benchmarks.transfer import lr_lambda  # noqa: E402
from hydro.errors import HydroWarning  # noqa: E402
from hydro.tuning.tune import spearman  # noqa: E402


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
    ),  # fmt: skip
}


class MLP(nn.Module):
    def __init__(self, d_in: int, width: int, d_out: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, d_out),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def setup(kind: Kind, seed: int) -> tuple[nn.Module, dict, Callable]:
    """The target (initialized from ``seed``), the data (the same for every seed), the loss."""
    g = torch.Generator().manual_seed(123)
    if kind.name == "attention":
        from examples.charlm.model import gpt

        t, vocab, lag = 16, 64, 3
        x = torch.randint(0, vocab, (8192 + 1024, t), generator=g)
        y = torch.roll(x, lag, 1)
        y[:, :lag] = x[:, :lag]  # the first positions copy themselves
        torch.manual_seed(seed)
        model = gpt(n_layer=1, n_head=2, n_embd=2 * kind.width, block_size=t)
        return model, {"train": (x[:8192], y[:8192]), "val": (x[8192:], y[8192:])}, cross_entropy
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

    torch.manual_seed(seed)
    return cnn(width=kind.width), load(n_train=2048, n_val=512, size=12), cross_entropy


def cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


def train(model: nn.Module, lr: float, data: dict, batches: torch.Tensor, steps: int,
          loss_of: Callable) -> float:  # fmt: skip
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
                    for i in range(0, len(yv), 256))  # fmt: skip
    loss = total / len(yv)
    return loss if math.isfinite(loss) else float("nan")


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
                      head_policy=kind.head_policy)  # fmt: skip
    init = {k: v.clone() for k, v in sur.state_dict().items()}
    start = time.perf_counter()
    losses = []
    for e in range(kind.lr_exp[0], kind.lr_exp[1] + 1):
        sur.load_state_dict(init)
        losses.append(train(sur, 2.0**e, data, batches, kind.steps, loss_of))
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
        f"lr grid 2^{kind.lr_exp[0]}..2^{kind.lr_exp[1]}",  # fmt: skip
        f"{'ratio':>5} {'width':>5}  "
        + " ".join(f"{'2^' + str(round(math.log2(lr))):>6}" for lr in lrs)  # fmt: skip
        + "   best  shift  Spearman  transfers",
    ]
    floor = None
    for r in sorted(med):
        shift, rho, ok = verdict(lrs, med[r], med[1])
        best = round(math.log2(lrs[int(np.nanargmin(med[r]))]))
        cells = " ".join(f"{'nan' if math.isnan(v) else f'{v:.3f}':>6}" for v in med[r])
        lines.append(f"{r:>5} {kind.width // r:>5}  {cells}   2^{best:<3} {shift:+5d}  "
                     f"{rho:+8.3f}  {'yes' if ok else 'NO'}")  # fmt: skip
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
        default=Path("width_floor.jsonl"),
        help="one line per finished cell; a rerun skips the cells found there",
    )
    p.add_argument("--report", action="store_true", help="only print the tables from --out")
    args = p.parse_args()
    # the slowest cells first, so that the pool does not end on one long cell
    cost = {"conv": 3, "attention": 2, "linear": 1}
    jobs = sorted(((k, s, r) for s in range(args.first_seed, args.seeds) for k in args.kinds
                   for r in KINDS[k].ratios), key=lambda j: (j[1], -cost[j[0]], j[2]))  # fmt: skip
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
                  f"(elapsed {time.time() - start:.0f} s)", flush=True)  # fmt: skip
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

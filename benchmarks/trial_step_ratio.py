"""What one trial-step costs against the full model's, by ratio: the charlm GPT of
``examples/charlm/tune.yaml`` (4 layers, width 256, 4 heads, block 64, dropout 0.1).

For each ratio, in one process and interleaved rounds: the full model's training step
(``torch.optim.AdamW``) and evaluation forward pass, against a fused step and forward pass of
``--fuse`` surrogates (``hydro.fuse`` + ``hydro.optim.AdamW``). ``per trial`` is the full
model's time over the fused one's share per trial (``fuse`` times the ratio of the two): how
many times cheaper a trial-step is. The GEMMs' FLOPs fall with the width squared; the
element-wise work (layer norms, GELU, dropout, attention maps, the update) only with the width,
so the figure sits between ``ratio`` and ``ratio**2``. One thread; medians of ``--repeats``
timings per round, then of the rounds.

    python benchmarks/trial_step_ratio.py [--ratios 4 8] [--fuse 16] [--batch 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydro
from examples.charlm.model import gpt

VOCAB = 103


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), target.flatten())


def median_time(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def steps(ratio: int, fuse: int, batch: int) -> dict[str, Callable[[], None]]:
    """The full model's and the fused surrogates' training step and evaluation forward."""
    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (batch, 64))
    y = torch.randint(0, VOCAB, (batch, 64))
    full = gpt(n_layer=4, n_head=4, n_embd=256, block_size=64, dropout=0.1)
    opt = torch.optim.AdamW(full.parameters(), lr=1e-3)
    fused = hydro.fuse([hydro.scale(full, ratio=ratio, example_inputs=(x[:2],))
                        for _ in range(fuse)])
    fused_opt = hydro.optim.AdamW(fused.parameters(), lr=[1e-3] * fuse)

    def full_step() -> None:
        opt.zero_grad()
        loss_fn(full(x), y).backward()
        opt.step()

    def fused_step() -> None:
        fused_opt.zero_grad()
        hydro.trial_loss(loss_fn, fused(x), y).sum().backward()
        fused_opt.step()

    @torch.no_grad()
    def full_eval() -> None:
        loss_fn(full(x), y)

    @torch.no_grad()
    def fused_eval() -> None:
        hydro.trial_loss(loss_fn, fused(x), y)

    return {"full step": full_step, "fused step": fused_step, "full eval": full_eval,
            "fused eval": fused_eval}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ratios", type=int, nargs="+", default=[4, 8])
    p.add_argument("--fuse", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args()
    torch.set_num_threads(1)
    built = {r: steps(r, a.fuse, a.batch) for r in a.ratios}
    for fns in built.values():
        for fn in fns.values():
            fn()  # the first call of each allocates and builds
    rounds: dict[int, dict[str, list[float]]] = {r: {} for r in a.ratios}
    for _ in range(a.rounds):
        for r, fns in built.items():
            for name, fn in fns.items():
                rounds[r].setdefault(name, []).append(median_time(fn, a.repeats))
    print(f"charlm GPT, batch {a.batch} x 64, {a.fuse} fused, one thread, "
          f"torch {torch.__version__}")
    print("| ratio | full step ms | fused step ms | per trial | full eval ms | fused eval ms | "
          "per trial |")
    print("|---|---|---|---|---|---|---|")
    for r in a.ratios:
        m = {k: 1e3 * statistics.median(v) for k, v in rounds[r].items()}
        print(
            f"| {r} | {m['full step']:.1f} | {m['fused step']:.1f} | "
            f"{a.fuse * m['full step'] / m['fused step']:.1f}x | {m['full eval']:.1f} | "
            f"{m['fused eval']:.1f} | {a.fuse * m['full eval'] / m['fused eval']:.1f}x |"
        )


if __name__ == "__main__":
    main()

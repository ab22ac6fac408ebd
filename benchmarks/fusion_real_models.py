"""Fused training step against sequential steps, on the real models of tests/real_models.py.

For each model: n copies trained one after the other (torch.optim.AdamW each) against one
``hydro.fuse`` of the n (``hydro.optim.AdamW``), same batch, rounds interleaved; prints the
median step time of each and the ratio. ``--before-rev REV`` adds a third column, side by side:
the same fused step with the fusion rewrite (``rewrite.py``, ``ops.py``) of git revision REV.

    PYTHONPATH=. python3 benchmarks/fusion_real_models.py --n 8 --threads 1 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import hydro.optim
from hydro.fusion import fuse, trial_loss
from tests.fusion.real import no_dropout
from tests.real_models import MODELS, build

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this tree's benchmarks/fusion.py
from fusion import building_with, rewrite_at


def _loss(out: object, labels: torch.Tensor, fused: bool) -> torch.Tensor:
    if hasattr(out, "loss"):
        return out.loss
    if isinstance(out, tuple):
        return out[1]
    return trial_loss(F.cross_entropy, out, labels) if fused else F.cross_entropy(out, labels)


def measure(
    name: str, n: int, batch: int, steps: int, repeats: int, before: object = None
) -> tuple[float, float, float]:
    models = []
    for seed in range(n):
        model, make = build(name, seed=seed)
        models.append(no_dropout(model).train())
    args, kwargs = make(batch, torch.Generator().manual_seed(0))
    labels = torch.randint(0, 5, (batch,))
    fused = fuse(models)
    fopt = hydro.optim.AdamW(fused.parameters(), lr=[1e-3] * n)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    old = fuse(models) if before is not None else None
    oopt = hydro.optim.AdamW(old.parameters(), lr=[1e-3] * n) if old is not None else None

    def sequential() -> None:
        for m, o in zip(models, opts):
            o.zero_grad()
            _loss(m(*args, **kwargs), labels, False).backward()
            o.step()

    def fused_step() -> None:
        fopt.zero_grad()
        _loss(fused(*args, **kwargs), labels, True).sum().backward()
        fopt.step()

    def before_step() -> None:
        oopt.zero_grad()
        _loss(old(*args, **kwargs), labels, True).sum().backward()
        oopt.step()

    sequential()
    fused_step()  # capture and warm up
    rounds = [(sequential, []), (fused_step, [])]
    if old is not None:
        with building_with(before):
            before_step()  # its graph built by the other revision's rewrite, then cached
        rounds.append((before_step, []))
    for _ in range(repeats):
        for fn, out in rounds:
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            out.append((time.perf_counter() - start) / steps)
    medians = [statistics.median(out) for _, out in rounds]
    return medians[0], medians[1], medians[2] if old is not None else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--before-rev", default=None, help="also time this revision's rewrite")
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    before = rewrite_at(a.before_rev) if a.before_rev else None
    print(f"n={a.n} batch={a.batch} threads={a.threads} median of {a.repeats}")
    head = f"{'model':22} {'sequential ms':>14} {'fused ms':>10} {'speed-up':>9}"
    if before is not None:
        head += f" {'fused@' + a.before_rev + ' ms':>18} {'speed-up':>9} {'now/before':>10}"
    print(head)
    for name in a.models:
        seq, fus, old = measure(name, a.n, a.batch, a.steps, a.repeats, before)
        row = f"{name:22} {seq * 1e3:14.1f} {fus * 1e3:10.1f} {seq / fus:8.2f}x"
        if before is not None:
            row += f" {old * 1e3:18.1f} {seq / old:8.2f}x {old / fus:9.2f}x"
        print(row, flush=True)


if __name__ == "__main__":
    main()

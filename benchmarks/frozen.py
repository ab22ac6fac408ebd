"""Fine-tuning a head on a frozen backbone: fused with sharing vs fused without vs sequential.

n trials share one frozen "pretrained" backbone (``requires_grad=False``, equal values, its
BatchNorm in evaluation mode) and each trains its own head with its own learning rate. Prints the
median time of one training step (forward, backward, AdamW step) of all n trials for:

* sequential: n separate models, each with ``torch.optim.AdamW`` over its head;
* fused, no sharing: ``hydro.fuse(models, share_frozen=False)`` (each trial runs its own copy of
  the backbone, as before shared frozen computation);
* fused, shared: ``hydro.fuse(models)`` (the backbone stored once and run once for the group).

All three run side by side in interleaved rounds (medians of ``--repeats`` rounds).

    python benchmarks/frozen.py                      # CNN and MLP backbones, n = 16, 1 thread
    python benchmarks/frozen.py --n 16 32 --threads 1 2
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydro.optim
from hydro.fusion import fuse, trial_loss


def cnn_backbone() -> tuple[nn.Module, int, torch.Tensor]:
    net = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    )
    return net, 64, torch.randn(32, 3, 32, 32)


def mlp_backbone() -> tuple[nn.Module, int, torch.Tensor]:
    net = nn.Sequential(
        nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 256),
        nn.GELU(),
    )
    return net, 256, torch.randn(64, 128)


class FineTune(nn.Module):
    def __init__(self, backbone: nn.Module, width: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def members(make: Callable, n: int) -> tuple[list[nn.Module], torch.Tensor]:
    torch.manual_seed(0)
    backbone, width, x = make()
    out = []
    for k in range(n):
        torch.manual_seed(k + 1)
        m = FineTune(copy.deepcopy(backbone), width)
        m.backbone.requires_grad_(False)
        m.train()
        m.backbone.eval()
        out.append(m)
    return out, x


def sequential_step(models: list[nn.Module], x: torch.Tensor, y: torch.Tensor) -> Callable:
    lrs = [1e-4 * 1.3**k for k in range(len(models))]
    opts = [torch.optim.AdamW(m.head.parameters(), lr=lr) for m, lr in zip(models, lrs)]

    def step() -> None:
        for m, o in zip(models, opts):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()

    return step


def fused_step(models: list[nn.Module], x: torch.Tensor, y: torch.Tensor, share: bool) -> Callable:
    fused = fuse([copy.deepcopy(m) for m in models], share_frozen=share)
    opt = hydro.optim.AdamW(fused.parameters(), lr=[1e-4 * 1.3**k for k in range(len(models))])

    def step() -> None:
        opt.zero_grad()
        trial_loss(F.cross_entropy, fused(x), y).sum().backward()
        opt.step()

    step()  # capture and build the fused graph outside the timing
    return step


def timed(step: Callable, min_time: float) -> float:
    start, calls = time.perf_counter(), 0
    while True:
        step()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time:
            return elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[16])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--min-time", type=float, default=0.5)
    args = parser.parse_args()
    print(
        "| backbone | n | threads | sequential ms | fused, no sharing ms | fused, shared ms "
        "| shared/no sharing | shared/sequential | frozen MB stored (no sharing -> shared) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for label, make in (("CNN 3 conv", cnn_backbone), ("MLP 3x512", mlp_backbone)):
            for n in args.n:
                models, x = members(make, n)
                y = torch.randint(0, 10, (x.shape[0],), generator=torch.Generator().manual_seed(0))
                steps = {
                    "sequential": sequential_step(models, x, y),
                    "unshared": fused_step(models, x, y, share=False),
                    "shared": fused_step(models, x, y, share=True),
                }
                for step in steps.values():  # warm up
                    step()
                samples: dict[str, list[float]] = {k: [] for k in steps}
                for _ in range(args.repeats):  # interleaved rounds
                    for key, step in steps.items():
                        samples[key].append(timed(step, args.min_time))
                med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
                frozen = sum(p.numel() * p.element_size() for p in models[0].backbone.parameters())
                print(
                    f"| {label} | {n} | {threads} | {med['sequential']:.2f} | "
                    f"{med['unshared']:.2f} | {med['shared']:.2f} | "
                    f"{med['unshared'] / med['shared']:.1f}x | "
                    f"{med['sequential'] / med['shared']:.1f}x | "
                    f"{n * frozen / 1e6:.2f} -> {frozen / 1e6:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()

"""The fused step on a CUDA device: n separate models (``torch.optim.Adam``, one after another)
against ``hydro.fuse`` + ``hydro.optim.AdamW``, eager and compiled, for the two models of
``benchmarks/fusion.py --compile`` (MLP width 64 with 32 trials, the charlm GPT surrogate at
ratio 8 with 16). Milliseconds per training step of all n trials: median of 5 rounds of 20
steps after 3 warm-up steps, synchronised; ``compile s`` is the first compiled step.

    python benchmarks/fusion_cuda.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import fusion as B


def timed(step: Callable[[], None], rounds: int = 5, steps: int = 20) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    ms = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - t) / steps * 1e3)
    return statistics.median(ms)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("fusion_cuda.py needs a CUDA device; benchmarks/fusion.py times the CPU")
    torch.set_default_device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| model | n | sequential ms | fused eager ms | fused compiled ms | eager vs "
          "sequential | compiled vs eager | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (make, n) in B.COMPILED.items():
        sequential = timed(B.sequential_step(make, n))
        eager = timed(B.compiled_pair(make, n, False)[0])
        start = time.perf_counter()
        step, _ = B.compiled_pair(make, n, True)
        step()
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        compiled = timed(step)
        print(f"| {name} | {n} | {sequential:.2f} | {eager:.2f} | {compiled:.2f} | "
              f"{sequential / eager:.2f}x | {eager / compiled:.2f}x | {compile_s:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()

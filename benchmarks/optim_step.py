"""The fused optimizer step alone, side by side: old per-trial loop vs earlier revision vs now.

For each model's parameter shapes (stacked ``[n, ...]``, muP infshapes kept), n and optimizer
(Adam, AdamW; per-trial lr, betas and weight decay), this times in interleaved rounds (medians):

- ``loop``: the per-trial loop of torch's fused kernel (``hydro/optim`` at ``--loop-rev``),
- ``before``: the vectorized ``_foreach`` step at ``--before-rev`` (one op sequence over all
  parameters, broadcast per-trial tensors),
- ``now``: this tree's eager step (``compile=False``, which is what ``compile="auto"`` runs on
  a CPU),
- ``compiled`` (with ``--compile``): this tree with ``compile=True`` (compile time reported).

    python benchmarks/optim_step.py --threads 1 --ns 16 32 --repeats 7
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusion import LRS, MODELS, old_optimizers, stacked, timed

import hydro.optim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop-rev", default="13b3095", help="revision with the per-trial loop")
    parser.add_argument("--before-rev", default="c04bed5", help="revision to compare with")
    parser.add_argument("--models", nargs="*", default=["MLP w64", "CNN+BN", "GPT surrogate"])
    parser.add_argument("--ns", nargs="*", type=int, default=[16, 32])
    parser.add_argument("--optimizers", nargs="*", default=["Adam", "AdamW"])
    parser.add_argument("--threads", nargs="*", type=int, default=[1])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds per repeat")
    parser.add_argument("--compile", action="store_true", help="also time compile=True")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    versions = {"loop": old_optimizers(args.loop_rev), "before": old_optimizers(args.before_rev)}
    print(f"torch {torch.__version__}; loop = {args.loop_rev}, before = {args.before_rev}")
    cols = ["loop", "before", "now"] + (["compiled"] if args.compile else [])
    print("ms per step, medians of", args.repeats, "interleaved rounds\n")
    header = "| model | opt | n | threads | " + " | ".join(cols) + " | loop/now | before/now |"
    if args.compile:
        header += " now/compiled | compile s |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.models:
            model = MODELS[name]()[0]
            for opt_name in args.optimizers:
                for n in args.ns:
                    hp = dict(lr=LRS(n), betas=(0.9, [0.99 - 0.001 * k for k in range(n)]),
                              eps=1e-8, weight_decay=[0.01 * k / n for k in range(n)])
                    steps = {}
                    for col, module in versions.items():
                        if module is not None:
                            steps[col] = getattr(module, opt_name)(stacked(model, n), **hp).step
                    now = getattr(hydro.optim, opt_name)(stacked(model, n), **hp, compile=False)
                    steps["now"] = now.step
                    compile_s = float("nan")
                    if args.compile:
                        compiled = getattr(hydro.optim, opt_name)(
                            stacked(model, n), **hp, compile=True
                        )
                        start = time.perf_counter()
                        compiled.step()
                        compile_s = time.perf_counter() - start
                        steps["compiled"] = compiled.step
                    t = timed(steps, args.repeats, args.min_time)
                    nan = float("nan")
                    row = f"| {name} | {opt_name} | {n} | {threads} | " + " | ".join(
                        f"{1e3 * t.get(c, nan):.2f}" for c in cols
                    )
                    row += (
                        f" | {t.get('loop', nan) / t['now']:.2f}x"
                        f" | {t.get('before', nan) / t['now']:.2f}x |"
                    )
                    if args.compile:
                        row += f" {t['now'] / t['compiled']:.2f}x | {compile_s:.0f} |"
                    print(row, flush=True)
    print(
        "\nloop/now > 1: this tree's eager step is faster than the per-trial loop of torch's "
        "fused kernel; before/now > 1: faster than the earlier vectorized step."
    )


if __name__ == "__main__":
    main()

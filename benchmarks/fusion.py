"""Training throughput of n trials: sequential models vs torch.func.vmap vs hydro.fuse.

Prints trial-steps per second (one trial-step = forward, backward and Adam step of one trial)
for n in 1, 4, 16, 32, 64 on a few models, all measured side by side in this run (medians of
several repeats), plus the fused model's achieved GFLOP/s against a large-matmul peak measured
in the same run.

    python benchmarks/fusion.py              # the full table
    python benchmarks/fusion.py --quick      # fewer models and n, for a smoke run
    python benchmarks/fusion.py --compile    # also time torch.compile(fused model)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydro.optim  # noqa: E402
from examples.charlm.model import GPT  # noqa: E402
from examples.models import ResNet  # noqa: E402
from hydro.fusion import fuse, trial_loss  # noqa: E402
from hydro.scaling import scale  # noqa: E402


def mlp(width: int) -> Callable[[], tuple[nn.Module, tuple, torch.Tensor, Callable]]:
    def make():
        model = nn.Sequential(
            nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, 10),
        )  # fmt: skip
        return model, (torch.randn(64, 32),), torch.randint(0, 10, (64,)), F.cross_entropy

    return make


def cnn():
    model = ResNet(width=16)
    return model, (torch.randn(32, 3, 16, 16),), torch.randint(0, 10, (32,)), F.cross_entropy


def gpt_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def gpt_surrogate():
    idx = torch.randint(0, 96, (8, 32))
    target = GPT(n_layer=2, n_head=8, n_embd=256, block_size=32, dropout=0.0)
    model = scale(target, ratio=4, example_inputs=(idx,))  # n_embd 256 -> 64, muP
    return model, (idx,), torch.randint(0, 96, (8, 32)), gpt_loss


MODELS = {
    "MLP w64": mlp(64),
    "MLP w256": mlp(256),
    "MLP w1024": mlp(1024),
    "CNN+BN": cnn,
    "GPT surrogate": gpt_surrogate,
}


def LRS(n: int) -> list[float]:  # noqa: N802 - a constant-like helper
    """A different learning rate per trial, as in a real study."""
    return [1e-3 * (1 + k / n) for k in range(n)]


def calibrate(step: Callable[[], None], min_time: float) -> int:
    """Warm ``step`` up and return how many calls make a run of at least ``min_time`` seconds."""
    step()
    step()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_time:
        step()
        calls += 1
    return max(1, calls)


def timed(steps: dict[str, Callable[[], None]], repeats: int, min_time: float) -> dict[str, float]:
    """Median seconds per call of each step, measured in interleaved rounds.

    Round r times every method once, so a burst of load from other processes hits all methods
    alike instead of one of them.
    """
    calls = {name: calibrate(step, min_time) for name, step in steps.items()}
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                step()
            samples[name].append((time.perf_counter() - start) / calls[name])
    return {name: statistics.median(values) for name, values in samples.items()}


def sequential_step(make, n: int) -> Callable[[], None]:
    built = [make() for _ in range(n)]
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for (m, *_), lr in zip(built, LRS(n))]

    def step() -> None:
        for (model, x, y, loss_fn), opt in zip(built, opts):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(*x), y).backward()
            opt.step()

    return step


def vmap_step(make, n: int) -> Callable[[], None]:
    built = [make() for _ in range(n)]
    _, x, y, loss_fn = built[0]
    # (stack_module_state refuses GraphModules: each has a class of its own)
    models = [m for m, *_ in built]
    params = {
        name: torch.stack([m.get_parameter(name).detach() for m in models]).requires_grad_()
        for name, _ in models[0].named_parameters()
    }
    buffers = {
        name: torch.stack([m.get_buffer(name) for m in models])
        for name, _ in models[0].named_buffers()
    }
    base = copy.deepcopy(built[0][0])

    def one(p, b, *inputs):  # noqa: ANN001
        return torch.func.functional_call(base, (p, b), inputs)

    forward = torch.func.vmap(one, in_dims=(0, 0) + (None,) * len(x), randomness="different")
    opt = hydro.optim.Adam(list(params.values()), lr=LRS(n))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = forward(params, buffers, *x)
        torch.func.vmap(loss_fn, in_dims=(0, None))(out, y).sum().backward()
        opt.step()

    return step


def fused_step(make, n: int, compiled: bool = False) -> Callable[[], None]:
    built = [make() for _ in range(n)]
    _, x, y, loss_fn = built[0]
    fused = fuse([m for m, *_ in built])
    opt = hydro.optim.Adam(fused.parameters(), lr=LRS(n))
    forward = torch.compile(fused) if compiled else fused

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        trial_loss(loss_fn, forward(*x), y).sum().backward()
        opt.step()

    return step


def flops_per_trial(make) -> int:
    """Forward + backward FLOPs of one model (counted on the unfused model: the counter's
    formulas for grouped convolutions do not apply to the fused form)."""
    model, x, y, loss_fn = make()
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(*x), y).backward()
    return counter.get_total_flops()


def matmul_peak(size: int = 2048) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    seconds = timed({"mm": lambda: torch.mm(a, b)}, repeats=5, min_time=0.3)["mm"]
    return 2 * size**3 / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two models, n in 1 and 32")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(fused)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="*", choices=list(MODELS), help="a subset of models")
    parser.add_argument(
        "--ns", nargs="*", type=int, help="numbers of trials (default 1 4 16 32 64)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per repeat")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ns = [1, 32] if args.quick else [1, 4, 16, 32, 64]
    models = ["MLP w64", "MLP w256"] if args.quick else list(MODELS)
    models = args.models or models
    ns = args.ns or ns

    peak = matmul_peak()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"matmul peak (2048x2048 float32 mm): {peak:.1f} GFLOP/s\n")
    header = (
        "| model | n | sequential | vmap | hydro.fuse | fuse/seq | fuse/vmap | GFLOP/s | % peak |"
    )
    if args.compile:
        header += " fuse+compile |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name in models:
        make = MODELS[name]
        for n in ns:
            steps = {"seq": sequential_step(make, n)}
            try:
                steps["vmap"] = vmap_step(make, n)
                steps["vmap"]()
            except Exception as exc:  # noqa: BLE001 - report, keep going
                steps.pop("vmap", None)
                print(f"  (vmap cannot run {name}: {type(exc).__name__}: {exc})".split("\n")[0])
            steps["fuse"] = fused_step(make, n)
            if args.compile:
                steps["compiled"] = fused_step(make, n, compiled=True)
            t = timed(steps, args.repeats, args.min_time)
            t_vmap = t.get("vmap", float("nan"))
            gflops = n * flops_per_trial(make) / t["fuse"] / 1e9
            row = (
                f"| {name} | {n} | {n / t['seq']:.0f} | {n / t_vmap:.0f} | {n / t['fuse']:.0f} | "
                f"{t['seq'] / t['fuse']:.1f}x | {t_vmap / t['fuse']:.1f}x | {gflops:.1f} | "
                f"{100 * gflops / peak:.0f}% |"
            )
            if args.compile:
                row += f" {n / t['compiled']:.0f} |"
            print(row, flush=True)
    print("\nColumns sequential/vmap/hydro.fuse: trial-steps per second (higher is better).")


if __name__ == "__main__":
    main()

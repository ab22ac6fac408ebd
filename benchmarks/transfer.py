"""Does the best learning rate transfer across width?  SP vs Hydro's muP surrogates, char LM.

For the character-level GPT of ``examples/charlm`` this sweeps the AdamW learning rate on a log
grid at several widths, two ways:

* **SP** (standard parametrization): a plain ``gpt(n_embd=width)`` of each width, every parameter
  trained with the same learning rate. This is what you get by shrinking a model naively.
* **Hydro**: ``hydro.scale(target, ratio=target_width // width)`` of the widest model, trained
  with ``hydro.parametrize.param_groups`` (muP learning rates relative to the target).

At the target width both are the same model (a ratio-1 surrogate *is* the target in SP), so
that column is trained once and shared. It prints validation loss per learning rate and width,
the best learning rate per width, and the Spearman rank correlation over the learning-rate grid
between the ratio-8 model and the target, and saves a plot (``docs/img/transfer.png``).

Not a test: run it by hand (22 minutes for the default 3 seeds, one thread, busy 2-core CPU)::

    python benchmarks/transfer.py
    python benchmarks/transfer.py --seeds 1 --steps 100    # a quick look (not the same optimum)

``--depth`` runs the depth experiment instead: an 8-block, 256-wide target against Hydro
surrogates at (ratio, depth_ratio) = (8, 1), (8, 2), (8, 4) and a naive narrow and shallow model
in standard parametrization (2 blocks, width 32), over a learning-rate grid; it prints each
model's best learning rate, its Spearman rank correlation with the target over the grid, the
target's loss at that learning rate, and the median wall time of a training step. Its defaults
(100 steps of 8 x 32 characters, 7 learning rates 2^-14 to 2^-8, validation on 256 windows spread
over the held-out tail) were sized for 20 minutes; on the shared 2-core CPU at a load average
of about 14 one seed took 28.5 minutes, three quarters of it the full model, so the two seeds
ran as two processes and were combined::

    python benchmarks/transfer.py --depth --seeds 1 --first-seed 0 --save s0.json &
    python benchmarks/transfer.py --depth --seeds 1 --first-seed 1 --save s1.json
    python benchmarks/transfer.py --combine s0.json s1.json
    python benchmarks/transfer.py --depth --step-times       # interleaved step times
    python benchmarks/transfer.py --depth --depth-alpha 0.5 --models "(8,2)" "(8,4)" --save a.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed
import hydro  # noqa: E402
from examples.charlm.data import load  # noqa: E402
from examples.charlm.model import gpt  # noqa: E402
from hydro.tuning.tune import spearman  # noqa: E402


def lr_lambda(warmup: int, steps: int):
    """Linear warm-up, then cosine decay to 10% of the peak (a multiplier for LambdaLR)."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 256) -> float:
    """Mean validation cross-entropy (nats per character)."""
    model.eval()
    total = 0.0
    for i in range(0, len(x), chunk):
        logits = model(x[i : i + chunk])
        total += F.cross_entropy(logits.flatten(0, 1), y[i : i + chunk].flatten(), reduction="sum")
    model.train()
    return float(total) / y.numel()


def train(
    model: nn.Module,
    groups: list[dict],
    data: dict,
    batches: torch.Tensor,
    args: argparse.Namespace,
    times: list[float] | None = None,
) -> float:
    """Train ``model`` with AdamW on ``groups`` over the given batch indices; validation loss.

    With ``times``, the wall time of each step is appended to it."""
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup, args.steps))
    x, y = data["train"]
    for idx in batches:
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x[idx]).flatten(0, 1), y[idx].flatten())
        if not torch.isfinite(loss):
            return float("nan")  # diverged: no point in training on
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if times is not None:
            times.append(time.perf_counter() - t0)
    loss = evaluate(model, *data["val"])
    return loss if math.isfinite(loss) else float("nan")


def sweep(
    model: nn.Module, make_groups, lrs: list[float], data, batches, args, times=None
) -> list[float]:
    """Validation loss for each learning rate, every run starting from the same initialization."""
    init = {k: v.clone() for k, v in model.state_dict().items()}
    losses = []
    for lr in lrs:
        model.load_state_dict(init)
        losses.append(train(model, make_groups(model, lr), data, batches, args, times))
    return losses


def table(name: str, lrs: list[float], widths: list[int], losses: dict[int, np.ndarray]) -> str:
    """A text table: one row per learning rate, one column per width, then the best lr."""
    head = f"{name:>6} | " + " ".join(f"{'w=' + str(w):>8}" for w in widths)
    lines = [head, "-" * len(head)]
    for i, lr in enumerate(lrs):
        cells = []
        for w in widths:
            v = losses[w][i]
            best = not np.isnan(v) and v == np.nanmin(losses[w])
            cells.append(f"{'nan' if np.isnan(v) else f'{v:.3f}':>7}{'*' if best else ' '}")
        lines.append(f"2^{int(round(math.log2(lr))):<4} | " + " ".join(cells))
    best = [f"{'2^' + str(int(round(math.log2(best_lr(lrs, losses[w]))))):>8}" for w in widths]
    lines.append(f"{'best':>6} | " + " ".join(best))
    return "\n".join(lines)


def best_lr(lrs: list[float], losses: np.ndarray) -> float:
    return lrs[int(np.nanargmin(losses))]


def plot(lrs, widths, sp, mu, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    finite = np.concatenate([v[np.isfinite(v)] for d in (sp, mu) for v in d.values()])
    top = min(float(finite.max()), float(finite.min()) + 1.5)  # keep diverged runs off-scale
    for ax, losses, name in ((axes[0], sp, "SP (plain models)"), (axes[1], mu, "Hydro (muP)")):
        for w in widths:
            (line,) = ax.plot(lrs, losses[w], marker="o", label=f"width {w}")
            i = int(np.nanargmin(losses[w]))
            ax.plot(lrs[i], losses[w][i], marker="*", markersize=14, color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_xlabel("learning rate (AdamW)")
        ax.set_title(name)
        ax.set_ylim(float(finite.min()) - 0.05, top)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (nats/char)")
    axes[1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# the depth experiment's sizes: a 256-wide, 8-block target costs ~0.5 s a step here
DEPTH_DEFAULTS = dict(seeds=2, steps=100, warmup=10, batch_size=8, block_size=32,
                      lr_exp=[-14, -8])  # fmt: skip
DEPTH_MODELS = ("full", "(8,1)", "(8,2)", "(8,4)", "naive")


def depth_main(args: argparse.Namespace) -> None:
    """Learning-rate transfer across width and depth: the 8-block target against its surrogates."""
    lrs = [2.0**e for e in range(args.lr_exp[0], args.lr_exp[1] + 1)]
    data = load(block_size=args.block_size)
    # the validation windows, thinned: a full pass over them costs the 256-wide target ~25 s
    vx, vy = data["val"]
    every = max(1, len(vx) // args.val_windows)
    data["val"] = (vx[::every][: args.val_windows], vy[::every][: args.val_windows])
    margs = dict(n_head=args.n_head, block_size=args.block_size)
    names = args.models or list(DEPTH_MODELS)
    runs: dict[str, list] = {_label(k, args): [] for k in names}
    times: dict[str, list[float]] = {_label(k, args): [] for k in names}
    start = time.time()

    for seed in range(args.first_seed, args.first_seed + args.seeds):
        g = torch.Generator().manual_seed(seed)
        batches = torch.randint(len(data["train"][0]), (args.steps, args.batch_size), generator=g)
        torch.manual_seed(seed)
        target = gpt(n_layer=args.depth_layers, n_embd=args.depth_width, **margs)
        example = (data["train"][0][:2],)
        models = build_depth_models(target, example, seed, args, margs)
        for name in reversed(list(models)):  # cheap ones first: numbers early
            model, groups = models[name]
            key = _label(name, args)
            runs[key].append(sweep(model, groups, lrs, data, batches, args, times[key]))
            print(f"seed {seed} {name:>6} done at {time.time() - start:6.0f} s", flush=True)
        if args.save:  # first: a partial run (no full model) is reported with --combine
            args.save.write_text(json.dumps({"lrs": lrs, "runs": runs, "times": times,
                                             "steps": args.steps}))  # fmt: skip
        depth_report(lrs, runs, times, args.steps)
        print(f"elapsed {time.time() - start:.0f} s\n", flush=True)


def _label(name: str, args: argparse.Namespace) -> str:
    if args.depth_alpha == 1.0 or not name.startswith("("):
        return name
    return f"{name}a{args.depth_alpha:g}"


def build_depth_models(target, example, seed, args, margs) -> dict:  # noqa: ANN001
    """``{name: (model, param-group maker)}`` for the names in ``args.models``."""

    def plain_groups(model, lr):
        return [{"params": list(model.parameters()), "lr": lr, "weight_decay": args.weight_decay}]

    def mup_groups(model, lr):
        return hydro.parametrize.param_groups(model, lr=lr, weight_decay=args.weight_decay)

    models = {}
    for name in args.models or DEPTH_MODELS:
        if name == "full":
            models[name] = (target, plain_groups)
        elif name == "naive":
            torch.manual_seed(seed)
            naive = gpt(n_layer=args.depth_layers // 4, n_embd=args.depth_width // 8, **margs)
            models[name] = (naive, plain_groups)
        else:
            r, d = (int(v) for v in name.strip("()").split(","))
            sur = hydro.scale(target, r, depth_ratio=d, depth_alpha=args.depth_alpha,
                              example_inputs=example, seed=seed)  # fmt: skip
            models[name] = (sur, mup_groups)
    return models


def depth_step_times(args: argparse.Namespace, rounds: int = 30) -> None:
    """Median wall time of one training step of each surrogate, measured interleaved (one step
    of each in turn, ``rounds`` times) so that a busy machine slows them alike."""
    data = load(block_size=args.block_size)
    margs = dict(n_head=args.n_head, block_size=args.block_size)
    torch.manual_seed(0)
    target = gpt(n_layer=args.depth_layers, n_embd=args.depth_width, **margs)
    args.models = ["(8,1)", "(8,2)", "(8,4)", "naive"]
    models = build_depth_models(target, (data["train"][0][:2],), 0, args, margs)
    x, y = data["train"]
    opts = {k: torch.optim.AdamW(g(m, 1e-3)) for k, (m, g) in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(rounds + 3):
        idx = torch.randint(len(x), (args.batch_size,))
        for k, (m, _) in models.items():
            t0 = time.perf_counter()
            loss = F.cross_entropy(m(x[idx]).flatten(0, 1), y[idx].flatten())
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            opts[k].step()
            if r >= 3:  # warm-up rounds
                times[k].append(time.perf_counter() - t0)
    base = float(np.median(times["(8,1)"]))
    print(f"step time, median of {rounds} interleaved steps ({args.batch_size} x "
          f"{args.block_size} characters, {args.threads} thread(s)):")  # fmt: skip
    for k, v in times.items():
        ms = float(np.median(v))
        print(f"{k:>6}: {ms * 1e3:7.1f} ms  {ms / base:.2f} x (8,1)")


def depth_report(lrs: list[float], runs: dict, times: dict, steps: int) -> None:
    med = {k: np.nanmedian(np.array(v, dtype=float), axis=0) for k, v in runs.items()}
    n = max(len(v) for v in runs.values())
    print(f"\nValidation loss after {steps} steps, median over {n} seed(s); * = best lr")
    print(depth_table(lrs, med))
    if "full" in med and "(8,1)" in med:
        print(depth_summary(lrs, med, times), flush=True)


def depth_combine(paths: list[Path]) -> None:
    """One report from the saved results of several runs (seeds run as separate processes)."""
    parts = [json.loads(p.read_text()) for p in paths]
    lrs = parts[0]["lrs"]
    names = list(dict.fromkeys(k for p in parts for k in p["runs"]))
    runs = {k: [r for p in parts for r in p["runs"].get(k, [])] for k in names}
    times = {k: [t for p in parts for t in p["times"].get(k, [])] for k in names}
    depth_report(lrs, runs, times, parts[0]["steps"])


def depth_table(lrs: list[float], losses: dict[str, np.ndarray]) -> str:
    head = f"{'lr':>6} | " + " ".join(f"{k:>8}" for k in losses)
    lines = [head, "-" * len(head)]
    for i, lr in enumerate(lrs):
        cells = []
        for v in losses.values():
            best = not np.isnan(v[i]) and v[i] == np.nanmin(v)
            cells.append(f"{'nan' if np.isnan(v[i]) else f'{v[i]:.3f}':>7}{'*' if best else ' '}")
        lines.append(f"2^{int(round(math.log2(lr))):<4} | " + " ".join(cells))
    return "\n".join(lines)


def depth_summary(lrs: list[float], losses: dict[str, np.ndarray], times: dict) -> str:
    full = losses["full"]
    base = float(np.median(times["(8,1)"]))  # the sweep's own timings: not interleaved
    lines = ["model  | best lr | shift (2x steps) | Spearman vs full | full's loss at that lr "
             "| step ms | step / (8,1)"]  # fmt: skip
    for k, v in losses.items():
        b = best_lr(lrs, v)
        shift = math.log2(b / best_lr(lrs, full))
        rho = spearman(list(v), list(full))
        at = full[lrs.index(b)]
        ms = float(np.median(times[k]))
        lines.append(f"{k:>6} | 2^{int(round(math.log2(b))):<5} | {shift:+16.0f} | "
                     f"{rho if rho is not None else float('nan'):+16.3f} | "
                     f"{at:.3f} ({at - np.nanmin(full):+.3f})"
                     f"{'':>8}| {ms * 1e3:7.1f} | {ms / base:.2f}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depth", action="store_true", help="the depth experiment (see above)")
    p.add_argument("--depth-layers", type=int, default=8)
    p.add_argument("--depth-width", type=int, default=256)
    p.add_argument("--val-windows", type=int, default=256, help="validation windows (--depth)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--depth-alpha", type=float, default=1.0, help="--depth: 1 CompleteP, 0.5")
    p.add_argument("--models", nargs="+", help=f"--depth: a subset of {', '.join(DEPTH_MODELS)}")
    p.add_argument("--step-times", action="store_true", help="--depth: interleaved step times")
    p.add_argument("--save", type=Path, help="--depth: write the results as JSON here")
    p.add_argument("--combine", type=Path, nargs="+", help="--depth: report saved results")
    p.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr-exp", type=int, nargs=2, default=[-12, -4], help="log2 lr range")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seeds", type=int, default=3)
    # One thread: these models are too small to gain from more, and on a shared CPU extra threads
    # spin against other processes (we measured a 20x slowdown with 2 threads on a busy 2-core box).
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--plot", type=Path, default=Path("docs/img/transfer.png"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.combine:
        depth_combine(args.combine)
        return
    if args.depth:
        for key, value in DEPTH_DEFAULTS.items():  # only where not given on the command line
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
        if args.step_times:
            depth_step_times(args)
        else:
            depth_main(args)
        return

    widths = sorted(args.widths)
    target_width = widths[-1]
    lrs = [2.0**e for e in range(args.lr_exp[0], args.lr_exp[1] + 1)]
    data = load(block_size=args.block_size)
    model_args = dict(n_layer=args.n_layer, n_head=args.n_head, block_size=args.block_size)

    def plain_groups(model, lr):
        return [{"params": list(model.parameters()), "lr": lr, "weight_decay": args.weight_decay}]

    def mup_groups(model, lr):
        return hydro.parametrize.param_groups(model, lr=lr, weight_decay=args.weight_decay)

    sp_runs: dict[int, list] = {w: [] for w in widths}
    mu_runs: dict[int, list] = {w: [] for w in widths}
    start = time.time()
    for seed in range(args.seeds):
        # The same batches for every width and learning rate of a seed: fewer differences to blame.
        g = torch.Generator().manual_seed(seed)
        batches = torch.randint(len(data["train"][0]), (args.steps, args.batch_size), generator=g)
        torch.manual_seed(seed)
        target = gpt(n_embd=target_width, **model_args)
        example = (data["train"][0][:2],)
        for w in widths:
            torch.manual_seed(seed)
            plain = gpt(n_embd=w, **model_args)
            sp_runs[w].append(sweep(plain, plain_groups, lrs, data, batches, args))
            if w == target_width:
                mu_runs[w].append(sp_runs[w][-1])  # ratio 1: the surrogate is the target
            else:
                sur = hydro.scale(target, target_width // w, example_inputs=example, seed=seed)
                mu_runs[w].append(sweep(sur, mup_groups, lrs, data, batches, args))
            print(f"seed {seed} width {w:4d} done at {time.time() - start:6.0f} s", flush=True)

        # Report after every seed, so that an interrupted run still leaves numbers behind.
        sp = {w: np.nanmedian(np.array(v, dtype=float), axis=0) for w, v in sp_runs.items()}
        mu = {w: np.nanmedian(np.array(v, dtype=float), axis=0) for w, v in mu_runs.items()}
        n = seed + 1
        print(f"\nValidation loss after {args.steps} steps, median over {n} seed(s); * = best lr")
        print(table("SP", lrs, widths, sp))
        print()
        print(table("Hydro", lrs, widths, mu))
        print()
        for name, losses in (("SP", sp), ("Hydro", mu)):
            shifts = [
                math.log2(best_lr(lrs, losses[w]) / best_lr(lrs, losses[target_width]))
                for w in widths
            ]
            print(
                f"{name:>5}: best-lr shift vs target (log2): "
                + ", ".join(f"{s:+.0f}" for s in shifts)
            )
        small = widths[0]
        r = target_width // small
        print(f"Spearman over the lr grid, width {small} (ratio {r}) vs target {target_width}:")
        print(f"  Hydro surrogate {spearman(mu[small], mu[target_width]):+.3f}   ", end="")
        print(f"SP small model {spearman(sp[small], sp[target_width]):+.3f}", flush=True)
        title = (
            f"char GPT ({args.n_layer} layers), {args.steps} steps, target width {target_width}, "
            f"median of {n} seed(s)"
        )
        plot(lrs, widths, sp, mu, args.plot, title)
        print(f"plot: {args.plot}   elapsed {time.time() - start:.0f} s\n", flush=True)


if __name__ == "__main__":
    main()

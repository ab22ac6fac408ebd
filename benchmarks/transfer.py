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

``--depth`` runs the depth experiment instead: an 8-block, 256-wide target (``full``) against
Hydro surrogates at (ratio, depth_ratio) = (8, 1), (8, 2), (8, 4) (CompleteP, and (8, 2), (8, 4)
with ``depth_alpha=0.5``), a naive narrow model (8 blocks, width 32) and a naive narrow and
shallow one (2 blocks, width 32), both in standard parametrization. Each model gets a
learning-rate grid (2^-14 to 2^-7), then, at its best rate on the median curve, a weight-decay
and a warm-up grid; 3 seeds, 200 AdamW steps of 8 x 32 characters with Hydro's own schedule
(``hydro.tune``'s warm-up and cosine), validation on 256 windows of the held-out tail. Every grid
trains as ONE fused model (``hydro.fuse`` of copies of the model, per-trial hyperparameters
through ``hydro.optim``): the same numbers as training each point alone, in a fraction of the
time. It prints each model's best value, steps off the full model's, Spearman rank correlation
with the full model over the grid, the full model's loss at the model's choice, and fused step
times; ``--report`` merges saved parts (a grid may be split across processes by seed, by
``--lr-exp`` range or by ``--second``); ``--tune`` is the end-to-end run (``hydro.tune`` at (8, 4)
and (8, 1), then the full model trained with each choice), ``--tune-report`` its table::

    python benchmarks/transfer.py --depth --save depth.json            # everything, in order
    python benchmarks/transfer.py --depth --models full --first-seed 1 --seeds 1 \
        --phases lr --lr-exp -14 -11 --save full_s1_lo.json             # one part of one grid
    python benchmarks/transfer.py --depth --report depth.json full_*.json
    python benchmarks/transfer.py --depth --step-times                  # interleaved step times
    python benchmarks/transfer.py --depth --tune --save tune.json
    python benchmarks/transfer.py --depth --tune --tune-depths 4 --tune-alpha 0.5 --save tune.json
    python benchmarks/transfer.py --depth --tune-report tune.json --report depth.json full_*.json
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
import hydro.optim
from examples.charlm.data import load
from examples.charlm.model import gpt
from hydro.errors import HydroWarning
from hydro.fusion import fuse, trial_loss
from hydro.tuning.group import _schedule
from hydro.tuning.verification import spearman


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


# --- depth: fused grids of the 8-block target and its surrogates ---------------------------------

# the depth experiment's sizes: one step of the 256-wide, 8-block target costs ~0.35 s here, a
# fused step of its 8-point learning-rate grid ~1.9 s
DEPTH_DEFAULTS = dict(seeds=3, steps=200, warmup=20, batch_size=8, block_size=32,
                      lr_exp=[-14, -7])
# name: (width ratio, depth ratio, depth alpha) for Hydro surrogates; the plain models:
# "full" the target, "narrow" gpt(8 blocks, width 32) and "naive" gpt(2 blocks, width 32), in SP
SURROGATES = {"(8,1)": (8, 1, 1.0), "(8,2)": (8, 2, 1.0), "(8,4)": (8, 4, 1.0),
              "(8,2)a.5": (8, 2, 0.5), "(8,4)a.5": (8, 4, 0.5)}
DEPTH_MODELS = ("full", *SURROGATES, "narrow", "naive")
WD_GRID = [0.0, 1.0, 4.0, 16.0, 64.0]  # AdamW's decay per step is lr x wd: ~1e-4 x 64 at most
WARMUP_FRACTIONS = [0, 0.025, 0.075, 0.225, 0.675]  # of the steps: 0, 5, 15, 45, 135 of 200


def build_depth_model(name: str, target: nn.Module, example: tuple, seed: int, args) -> nn.Module:
    """One model of the depth experiment, initialized from ``seed``."""
    margs = dict(n_head=args.n_head, block_size=args.block_size)
    if name == "full":
        return target
    if name in ("narrow", "naive"):
        torch.manual_seed(seed)
        layers = args.depth_layers if name == "narrow" else args.depth_layers // 4
        return gpt(n_layer=layers, n_embd=args.depth_width // 8, **margs)
    r, d, alpha = SURROGATES[name]
    return hydro.scale(target, r, depth_ratio=d, depth_alpha=alpha, example_inputs=example,
                       seed=seed)


def fused_grid(
    model: nn.Module, trials: list[dict], data: dict, batches: torch.Tensor, args, times=None
) -> list[float]:
    """Validation loss of each trial (``lr``, ``weight_decay``, ``warmup``), all trained at once
    as one fused model (``hydro.fuse`` of copies of ``model``: the same initialization for every
    trial) with ``hydro.optim.AdamW`` and each trial's own schedule: what training each alone
    with ``torch.optim.AdamW`` (muP multipliers through ``param_groups``) would give."""
    fused = fuse([model] * len(trials))
    opt = hydro.optim.AdamW(fused.parameters(), lr=[t["lr"] for t in trials],
                            weight_decay=[t["weight_decay"] for t in trials])
    # Hydro's own schedule (warm-up from lr / (warmup + 1), then cosine to 0): the one hydro.tune
    # trains with, so that the end-to-end run and the grids are the same recipe
    sched = hydro.optim.lr_scheduler.TrialScheduler(
        opt, lambda o, k: _schedule("cosine", args.steps, trials[k]["warmup"], o)
    )
    x, y = data["train"]
    for idx in batches:
        t0 = time.perf_counter()
        out = fused(x[idx])
        loss = trial_loss(F.cross_entropy, out.flatten(1, 2), y[idx].flatten()).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if times is not None:
            times.append(time.perf_counter() - t0)
    fused.eval()
    vx, vy = data["val"]
    total = torch.zeros(len(trials), dtype=torch.float64)
    with torch.no_grad():
        for i in range(0, len(vx), 128):
            out = fused(vx[i : i + 128]).flatten(1, 2)
            total += trial_loss(F.cross_entropy, out, vy[i : i + 128].flatten()).double() * (
                vy[i : i + 128].numel()
            )
    losses = (total / vy.numel()).tolist()
    return [math.nan if d or not math.isfinite(v) else v for v, d in zip(losses, fused.diverged)]


def depth_data(args) -> dict:
    data = load(block_size=args.block_size)
    # the validation windows, thinned: a full pass over them costs the 256-wide target ~25 s
    vx, vy = data["val"]
    every = max(1, len(vx) // args.val_windows)
    data["val"] = (vx[::every][: args.val_windows], vy[::every][: args.val_windows])
    return data


def depth_batches(data: dict, seed: int, args) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(len(data["train"][0]), (args.steps, args.batch_size), generator=g)


def depth_target(seed: int, args) -> nn.Module:
    torch.manual_seed(seed)
    return gpt(n_layer=args.depth_layers, n_embd=args.depth_width, n_head=args.n_head,
               block_size=args.block_size)


def depth_main(args: argparse.Namespace) -> None:
    """The learning-rate grid of every model, 3 seeds; then, at each model's best rate (median
    curve), the weight-decay and warm-up grids. Cheap models first, the full model last; the
    results are saved after every grid, so an interrupted run still reports."""
    lrs = [2.0**e for e in range(args.lr_exp[0], args.lr_exp[1] + 1)]
    warmups = [round(f * args.steps) for f in WARMUP_FRACTIONS]
    data = depth_data(args)
    names = args.models or list(DEPTH_MODELS)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    res = {"lrs": lrs, "wds": WD_GRID, "warmups": warmups, "steps": args.steps, "seeds": seeds,
           "lr": {}, "wd": {}, "warmup": {}, "best_lr": {}, "times": {}}
    if args.save and args.save.exists():  # resume: grids already done are kept
        res.update(json.loads(args.save.read_text()))
    start = time.time()

    def save() -> None:
        if args.save:
            args.save.write_text(json.dumps(res))

    order = [n for n in names if n != "full"] + (["full"] if "full" in names else [])
    if args.best_lr:  # the second phase at a given rate, without the first
        res["best_lr"].update({name: args.best_lr for name in order})
    wds = args.wd_grid or WD_GRID
    warmups = args.warmup_grid or warmups
    res["wds"], res["warmups"] = wds, warmups
    for name in order:
        for phase in args.phases:
            for seed in seeds:
                key = "lr" if phase == "lr" else args.second[0]
                if str(seed) in res[key].get(name, {}):
                    continue
                target = depth_target(seed, args)
                model = build_depth_model(name, target, (data["train"][0][:2],), seed, args)
                if phase == "lr":
                    trials = [{"lr": lr, "weight_decay": 0.0, "warmup": args.warmup} for lr in lrs]
                else:
                    lr = res["best_lr"][name]
                    trials = [{"lr": lr, "weight_decay": wd, "warmup": args.warmup}
                              for wd in wds if "wd" in args.second]
                    trials += [{"lr": lr, "weight_decay": 0.0, "warmup": w}
                               for w in warmups if "warmup" in args.second]
                times: list[float] = []
                losses = fused_grid(model, trials, data, depth_batches(data, seed, args), args,
                                    times)
                res["times"].setdefault(f"{name} {phase}", []).append(
                    [len(trials), float(np.median(times))]
                )
                if phase == "lr":
                    res["lr"].setdefault(name, {})[str(seed)] = losses
                else:
                    if "wd" in args.second:
                        res["wd"].setdefault(name, {})[str(seed)] = losses[: len(wds)]
                        losses = losses[len(wds) :]
                    if "warmup" in args.second:
                        res["warmup"].setdefault(name, {})[str(seed)] = losses
                save()
                print(f"{name:>9} {phase:>6} seed {seed}: {time.time() - start:6.0f} s "
                      f"({np.median(times) * 1e3:.0f} ms a fused step of {len(trials)})",
                      flush=True)
            if phase == "lr" and not args.best_lr:
                med = np.nanmedian(np.array(list(res["lr"][name].values()), dtype=float), axis=0)
                res["best_lr"][name] = lrs[int(np.nanargmin(med))]
                save()
    depth_report(res, args.plot)


def merge(paths: list[Path]) -> dict:
    """One result from several saved runs of ``depth_main`` (models, seeds or parts of a grid
    run apart): each grid becomes the union of the runs' grid values, missing points ``nan``."""
    parts = [json.loads(p.read_text()) for p in paths]
    res = {"steps": parts[0]["steps"], "best_lr": {}, "times": {}}
    res["seeds"] = sorted({s for p in parts for s in p["seeds"]})
    for key, grid in (("lr", "lrs"), ("wd", "wds"), ("warmup", "warmups")):
        values: dict[str, dict[str, dict[float, float]]] = {}
        for p in parts:
            for model, runs in p[key].items():
                for seed, losses in runs.items():
                    values.setdefault(model, {}).setdefault(seed, {}).update(zip(p[grid], losses))
        used = {g for r in values.values() for v in r.values() for g in v}
        res[grid] = sorted(used)
        res[key] = {m: {s: [v.get(g) for g in res[grid]] for s, v in runs.items()}
                    for m, runs in values.items()}
    for p in parts:
        res["best_lr"].update(p["best_lr"])
        for k, v in p["times"].items():
            res["times"].setdefault(k, []).extend(v)
    return res


def _median(runs: dict) -> np.ndarray:
    return np.nanmedian(np.array(list(runs.values()), dtype=float), axis=0)


def _steps_off(grid: list[float], a: float, b: float) -> int:
    return grid.index(a) - grid.index(b)


def depth_report(res: dict, plot_path: Path | None = None, reference: str = "full") -> dict:
    """Print the grids and the transfer summary against ``reference`` (the full model; another
    model where the full model's grids are missing); return the summary rows."""
    rows = {}
    for key, grid, label in (("lr", res["lrs"], "learning rate"),
                             ("wd", res["wds"], "weight decay"),
                             ("warmup", res["warmups"], "warm-up steps")):
        runs = {k: v for k, v in res[key].items() if v}
        if not runs:
            continue
        med = {k: _median(v) for k, v in runs.items()}
        n = max(len(v) for v in runs.values())
        print(f"\n{label}: validation loss after {res['steps']} steps, median of {n} seed(s)"
              f"{' (each at its own best lr)' if key != 'lr' else ''}; * = best")
        fmt = (lambda v: f"2^{int(round(math.log2(v)))}") if key == "lr" else (lambda v: f"{v:g}")
        print(_grid_table(grid, med, fmt))
        if reference not in med:
            continue
        # the summary is over the points the full model was run at (NaN there is divergence)
        ref_runs = runs[reference]
        ran = [i for i in range(len(grid)) if any(r[i] is not None for r in ref_runs.values())]
        grid = [grid[i] for i in ran]
        med = {k: v[ran] for k, v in med.items()}
        full = med[reference]
        fbest = grid[int(np.nanargmin(full))]
        fruns = np.array(list(ref_runs.values()), dtype=float)[:, ran]
        spread = np.nanmax(fruns, axis=0) - np.nanmin(fruns, axis=0)
        print(f"{reference} ({len(fruns)} seed(s)), seed-to-seed range (max - min) per point: "
              f"{' '.join(f'{s:.3f}' for s in spread)}")
        print(f"model     | best    | steps off | Spearman | pass | {reference}'s loss there "
              "| per seed")
        for k, v in med.items():
            b = grid[int(np.nanargmin(v))]
            off = _steps_off(grid, b, fbest)
            rho = spearman(list(v), list(full))
            at = full[grid.index(b)]
            seeds = np.array(list(runs[k].values()), dtype=float)[:, ran]
            per_seed = [fmt(grid[int(np.nanargmin(s))]) for s in seeds]
            ok = abs(off) <= 1 and rho is not None and rho >= 0.9 - 1e-9
            rows[(key, k)] = dict(best=b, off=off, rho=rho, at=at, ok=ok)
            print(f"{k:>9} | {fmt(b):>7} | {off:+9d} | {rho if rho is not None else math.nan:+8.3f}"
                  f" | {'yes' if ok else 'no':>4} | {at:.3f} ({at - np.nanmin(full):+.3f})     | "
                  f"{', '.join(per_seed)}")
    times = {k: v for k, v in res["times"].items() if k.endswith(" lr")}
    if times:
        print("\nfused step of the learning-rate grid, median over seeds (ms; per trial):")
        for k, v in times.items():
            n, t = v[0][0], float(np.median([t for _, t in v]))
            print(f"{k[:-3]:>9}: {t * 1e3:8.1f} ms for {n} trials, {t / n * 1e3:7.1f} ms a trial")
    if plot_path is not None:
        try:
            depth_plot(res, plot_path)
            print(f"plot: {plot_path}")
        except ImportError:
            pass
    return rows


def _grid_table(grid: list[float], med: dict[str, np.ndarray], fmt) -> str:
    head = f"{'':>6} | " + " ".join(f"{k:>9}" for k in med)
    lines = [head, "-" * len(head)]
    for i, g in enumerate(grid):
        cells = []
        for v in med.values():
            best = not np.isnan(v[i]) and v[i] == np.nanmin(v)
            cells.append(f"{'nan' if np.isnan(v[i]) else f'{v[i]:.3f}':>8}{'*' if best else ' '}")
        lines.append(f"{fmt(g):>6} | " + " ".join(cells))
    return "\n".join(lines)


def depth_plot(res: dict, path: Path) -> None:
    """Three panels (learning rate, weight decay, warm-up): each model's median loss above its
    own best, so that curves of different levels compare by shape and by where they bottom."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("lr", res["lrs"], "learning rate (AdamW)"), ("wd", res["wds"], "weight decay"),
              ("warmup", res["warmups"], "warm-up steps"))
    for ax, (key, grid, label) in zip(axes, panels):
        xs = list(range(len(grid)))
        for k, runs in res[key].items():
            if not runs:
                continue
            v = _median(runs)
            style = dict(lw=3, color="black") if k == "full" else dict(lw=1.5)
            if k in ("narrow", "naive"):
                style["ls"] = "--"
            (line,) = ax.plot(xs, v - np.nanmin(v), marker="o", label=k, **style)
            i = int(np.nanargmin(v))
            ax.plot(xs[i], 0, marker="*", markersize=14, color=line.get_color())
        ax.set_xticks(xs)
        ax.set_xticklabels([f"2^{int(round(math.log2(g)))}" if key == "lr" else f"{g:g}"
                            for g in grid])
        ax.set_xlabel(label)
        ax.set_ylim(-0.02, 0.6)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss above the model's best (nats/char)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Depth experiment (char GPT, target 8 blocks x 256): {res['steps']} steps, "
                 f"median of {len(res['seeds'])} seeds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def depth_step_times(args: argparse.Namespace, rounds: int = 30) -> None:
    """Median wall time of one training step of each surrogate alone (not fused), measured
    interleaved (one step of each in turn, ``rounds`` times) so that a busy machine slows them
    alike."""
    data = load(block_size=args.block_size)
    target = depth_target(0, args)
    names = ["full", "(8,1)", "(8,2)", "(8,4)", "naive"]
    models = {k: build_depth_model(k, target, (data["train"][0][:2],), 0, args) for k in names}
    x, y = data["train"]
    opts = {k: torch.optim.AdamW(hydro.parametrize.param_groups(m, 1e-4))
            for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(rounds + 3):
        idx = torch.randint(len(x), (args.batch_size,))
        for k, m in models.items():
            t0 = time.perf_counter()
            loss = F.cross_entropy(m(x[idx]).flatten(0, 1), y[idx].flatten())
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            opts[k].step()
            if r >= 3:  # warm-up rounds
                times[k].append(time.perf_counter() - t0)
    base = float(np.median(times["(8,1)"]))
    print(f"step time, median of {rounds} interleaved steps ({args.batch_size} x "
          f"{args.block_size} characters, {args.threads} thread(s)):")
    for k, v in times.items():
        ms = float(np.median(v))
        print(f"{k:>6}: {ms * 1e3:7.1f} ms  {ms / base:.2f} x (8,1)")


# the end-to-end search: the grids' ranges (warm-up up to 22.5% of the steps, 45 of 200)
DEPTH_TUNE_SPACE = {"lr": (2.0**-15, 2.0**-6), "weight_decay": (0.0, 16.0), "warmup": (0, 0.225)}


def depth_tune(args: argparse.Namespace) -> None:
    """End to end: ``hydro.tune`` on the charlm task at (8, 4) and at (8, 1), the same search,
    then the full model trained (``--tune-seeds`` seeds, the grids' batches) with each choice."""
    import optuna

    data = depth_data(args)
    space = {
        "lr": optuna.distributions.FloatDistribution(*DEPTH_TUNE_SPACE["lr"], log=True),
        "weight_decay": optuna.distributions.FloatDistribution(*DEPTH_TUNE_SPACE["weight_decay"]),
        "warmup": optuna.distributions.IntDistribution(
            0, round(DEPTH_TUNE_SPACE["warmup"][1] * args.steps)
        ),
    }
    out = json.loads(args.save.read_text()) if args.save and args.save.exists() else {}
    alpha = args.tune_alpha
    for d in args.tune_depths:
        name = f"(8,{d})" + (f"a{alpha:g}" if alpha != 1.0 and d > 1 else "")
        if name in out:  # resumed: this search is done
            continue
        task = hydro.Task(model=depth_target(0, args), train_data=data["train"],
                          val_data=data["val"], loss="cross_entropy", optimizer="adamw",
                          scheduler="cosine", steps=args.steps, eval_every=args.steps // 4,
                          batch_size=args.batch_size)
        t0 = time.perf_counter()
        result = hydro.tune(task, space, n_trials=args.tune_trials, ratio=8, depth_ratio=d,
                            depth_alpha=alpha, fuse=args.tune_fuse, storage="sqlite:///:memory:",
                            seed=0)
        wall = time.perf_counter() - t0
        out[name] = {"wall_s": wall, "params": dict(result.best_params)}
        print(f"{name}: {wall:.0f} s, best {result.best_params}", flush=True)
        if args.save:
            args.save.write_text(json.dumps(out))
    for v in out.values():  # then the full model with each choice (the grids' seeds and batches)
        if v.get("full_losses"):
            continue
        p = v["params"]
        trial = [{"lr": p["lr"], "weight_decay": p["weight_decay"], "warmup": int(p["warmup"])}]
        v["full_losses"] = []
        for s in range(args.tune_seeds):
            batches = depth_batches(data, s, args)
            v["full_losses"].append(
                fused_grid(depth_target(s, args), trial, data, batches, args)[0]
            )
            if args.save:
                args.save.write_text(json.dumps(out))
        print(f"  full model with {p}: {v['full_losses']}", flush=True)


def depth_tune_report(tune: dict, grids: dict) -> None:
    """The end-to-end table: each choice's full-model loss against the grids' best."""
    best = min(float(np.nanmin(_median(grids[k]["full"]))) for k in ("lr", "wd", "warmup")
               if grids[k].get("full"))
    base = tune.get("(8,1)", {}).get("wall_s")
    print(f"full model's grid best (median of seeds): {best:.4f}")
    print(
        "surrogate | tune wall s | vs (8,1) | chosen lr, wd, warm-up | full model loss "
        "(median of seeds) | vs grid best"
    )
    for k, v in tune.items():
        if not v.get("full_losses"):
            continue
        p, loss = v["params"], float(np.nanmedian(v["full_losses"]))
        rel = f"{v['wall_s'] / base:.2f}" if base else "-"
        print(f"{k:>9} | {v['wall_s']:11.0f} | {rel:>8} | 2^{math.log2(p['lr']):.2f}, "
              f"{p['weight_decay']:.2f}, {int(p['warmup'])} | {loss:.4f} | "
              f"{(loss / best - 1) * 100:+.2f}%")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depth", action="store_true", help="the depth experiment (see above)")
    p.add_argument("--depth-layers", type=int, default=8)
    p.add_argument("--depth-width", type=int, default=256)
    p.add_argument("--val-windows", type=int, default=256, help="validation windows (--depth)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--models", nargs="+", help=f"--depth: a subset of {', '.join(DEPTH_MODELS)}")
    p.add_argument("--step-times", action="store_true", help="--depth: interleaved step times")
    p.add_argument("--save", type=Path, help="--depth: the results as JSON (resumed if there)")
    p.add_argument("--report", type=Path, nargs="+",
                   help="--depth: report saved results (several are merged)")
    p.add_argument(
        "--phases",
        nargs="+",
        default=["lr", "second"],
        choices=["lr", "second"],
        help="--depth: the learning-rate grid, then the second grids at its best",
    )
    p.add_argument("--second", nargs="+", default=["wd", "warmup"], choices=["wd", "warmup"])
    p.add_argument("--reference", default="full", help="--report: the model compared against")
    p.add_argument("--best-lr", type=float, help="--depth: the second grids at this rate")
    p.add_argument("--wd-grid", type=float, nargs="+")
    p.add_argument("--warmup-grid", type=int, nargs="+")
    p.add_argument("--tune", action="store_true", help="--depth: the end-to-end hydro.tune run")
    p.add_argument("--tune-depths", type=int, nargs="+", default=[4, 1])
    p.add_argument("--tune-alpha", type=float, default=1.0, help="--tune: depth_alpha of the cut")
    p.add_argument("--tune-trials", type=int, default=24)
    p.add_argument("--tune-fuse", type=int, default=8)
    p.add_argument("--tune-seeds", type=int, default=3, help="full-model runs of each choice")
    p.add_argument("--tune-report", type=Path, help="--depth: report a saved --tune result "
                   "against the grids of --report")
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
    if args.depth:
        warnings.filterwarnings("ignore", category=HydroWarning)  # ratio 8 is below the floor
        for key, value in DEPTH_DEFAULTS.items():  # only where not given on the command line
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
        if args.plot == p.get_default("plot"):
            args.plot = Path("docs/img/transfer_depth.png")
        if args.tune_report:
            depth_tune_report(json.loads(args.tune_report.read_text()), merge(args.report))
        elif args.report:
            depth_report(merge(args.report), args.plot, args.reference)
        elif args.step_times:
            depth_step_times(args)
        elif args.tune:
            depth_tune(args)
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

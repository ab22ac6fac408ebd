"""End to end: plain Optuna on the full model versus ``hydro.tune`` before and after continuous
batching.

The same search (the same space, TPE sampler, median pruner and number of configurations) on
the character-level GPT of ``examples/charlm`` (its ``tune.yaml``: 4 layers, width 256, 4
heads, blocks of 64 characters; space lr, weight decay, warm-up, dropout, beta2), three ways:

* **plain**: Optuna's ``study.optimize`` with an objective that trains the full model with
  ``torch.optim.AdamW`` and reports its validation loss (pruned by the same pruner);
* **before**: ``hydro.tune`` (ratio 8, 16 trials per fused group) of ``--before-rev``, the tree
  before continuous batching (fixed groups; pruned members leave and are not replaced), read
  from git into a temporary directory (``git archive``) and imported from there;
* **after**: ``hydro.tune`` of this tree (continuous batching: freed slots take new trials).

Each search runs in a fresh Python process (so each pays its own start-up, e.g. the first
``torch.export``), one after another, with the same thread count; the wall time is that of the
search call. Then each method's chosen configuration trains the full model (the same loop as
plain's objective, the schedule ``docs/tuning.md`` gives for the full model) from ``--check-seeds``
seeds, and the mean final validation losses are compared. One table per repeat, then medians.

    python benchmarks/end_to_end.py --repeats 3                  # the yaml's own scale (hours)
    # the run in docs/tuning.md (shortened to fit a 2-core machine):
    python benchmarks/end_to_end.py --repeats 3 --steps 32 --eval-every 8 --batch 8 --chars 50000
    # one repeat (seed 2) on its own, e.g. in parallel with others: --first-repeat 2 --repeats 1
    # hydro.tune's first_group (the median pruner's start-up trials alone first), against plain:
    python benchmarks/end_to_end.py --repeats 3 --steps 32 --eval-every 8 --batch 8 \
        --chars 50000 --methods plain,after --first-group 5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("plain", "before", "after")


def space(steps: int) -> dict:
    """The search space of ``examples/charlm/tune.yaml``, its warm-up range (0-50 of 200
    steps) scaled to ``steps``."""
    import optuna

    D = optuna.distributions
    return {
        "lr": D.FloatDistribution(1e-4, 3e-2, log=True),
        "weight_decay": D.FloatDistribution(0.0, 0.2),
        "warmup": D.IntDistribution(0, max(1, steps // 4)),
        "dropout": D.FloatDistribution(0.0, 0.2),
        "beta2": D.CategoricalDistribution([0.95, 0.99, 0.999]),
    }


def model_args(args: argparse.Namespace) -> dict:
    return {"n_layer": args.layers, "n_head": args.heads, "n_embd": args.width,
            "block_size": args.block}  # fmt: skip


def schedule(opt, warmup: int, steps: int):  # noqa: ANN001, ANN201
    """Linear warm-up from lr/(warmup+1), then cosine decay: the full-model recipe of
    docs/tuning.md (what each surrogate trial trains with)."""
    import torch

    S = torch.optim.lr_scheduler
    main = S.CosineAnnealingLR(opt, T_max=steps - max(warmup, 1))
    if not warmup:
        return main
    ramp = S.LinearLR(opt, start_factor=1.0 / (warmup + 1), end_factor=1.0, total_iters=warmup)
    return S.SequentialLR(opt, [ramp, main], milestones=[warmup])


def full_model_run(args, params: dict, seed: int, trial=None) -> float:  # noqa: ANN001
    """Train the unmodified full model with plain PyTorch; its final validation loss.

    With ``trial`` (plain Optuna's objective) the loss is reported every ``eval_every`` steps
    and the trial pruned when the pruner says so; without, it is evaluated at the end only.
    """
    import optuna
    import torch
    import torch.nn.functional as F

    from examples.charlm.data import load
    from examples.charlm.model import gpt

    data = load(block_size=args.block, max_chars=args.chars)
    torch.manual_seed(seed)
    model = gpt(**model_args(args), dropout=params["dropout"])
    opt = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=(0.9, params["beta2"]),
                            weight_decay=params["weight_decay"])  # fmt: skip
    sched = schedule(opt, params["warmup"], args.steps)
    x, y = data["train"]
    g = torch.Generator().manual_seed(seed)
    value = math.nan
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, len(y), (args.batch,), generator=g)
        logits = model(x[idx])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y[idx].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step == args.steps or (trial is not None and step % args.eval_every == 0):
            value = evaluate(model, data["val"])
            if not math.isfinite(value):
                if trial is None:
                    return math.inf
                raise optuna.TrialPruned()
            if trial is not None:
                trial.report(value, step)
                if step < args.steps and trial.should_prune():
                    raise optuna.TrialPruned()
    return value


def evaluate(model, val: tuple) -> float:  # noqa: ANN001
    """Mean per-character cross-entropy over the whole validation split."""
    import torch
    import torch.nn.functional as F

    model.eval()
    x, y = val
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(y), 256):
            logits = model(x[i : i + 256])
            target = y[i : i + 256].reshape(-1)
            total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), target,
                                     reduction="sum").item()  # fmt: skip
    model.train()
    return total / y.numel()


# --- one search, in its own process ------------------------------------------------------------


def search_plain(args: argparse.Namespace) -> dict:
    import optuna

    from hydro.tuning.space import suggest

    sampler = optuna.samplers.TPESampler(seed=args.seed, constant_liar=True)
    study = optuna.create_study(sampler=sampler, pruner=optuna.pruners.MedianPruner())
    dists = space(args.steps)

    def objective(trial: optuna.Trial) -> float:
        params = {name: suggest(trial, name, d) for name, d in dists.items()}
        return full_model_run(args, params, args.seed + trial.number, trial)

    start, cpu = time.perf_counter(), time.process_time()
    study.optimize(objective, n_trials=args.trials)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"wall": wall, "cpu": cpu, "best": study.best_params, "states": states(study),
            "occupancy": None}  # fmt: skip


def search_hydro(args: argparse.Namespace) -> dict:
    import functools

    import optuna
    import torch

    import hydro
    from examples.charlm.data import load
    from examples.charlm.model import gpt

    start, cpu = time.perf_counter(), time.process_time()
    data = load(block_size=args.block, max_chars=args.chars)
    task = hydro.Task(model=functools.partial(gpt, **model_args(args)), train_data=data["train"],
                      val_data=data["val"], loss="cross_entropy", optimizer="adamw",
                      scheduler="cosine", steps=args.steps, eval_every=args.eval_every,
                      batch_size=args.batch)  # fmt: skip
    result = hydro.tune(
        task, space(args.steps), n_trials=args.trials, ratio=args.ratio, fuse=args.fuse,
        storage="sqlite:///:memory:", seed=args.seed,
        sampler=optuna.samplers.TPESampler(seed=args.seed, constant_liar=True),
        pruner=optuna.pruners.MedianPruner(),
        **({"first_group": args.first_group} if args.first_group and args.worker == "after"
           else {}),
    )  # fmt: skip
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    occupancy = getattr(result, "occupancy", None)
    return {"wall": wall, "cpu": cpu, "best": result.best_params, "states": states(result.study),
            "occupancy": occupancy, "hydro": hydro.__file__,
            "threads": torch.get_num_threads()}  # fmt: skip


def states(study) -> dict:  # noqa: ANN001
    """Trials per state, and ``trial_steps``: the steps trained summed over trials (a pruned
    trial's last reported step)."""
    counts: dict[str, int] = {"trial_steps": 0}
    for t in study.get_trials(deepcopy=False):
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
        counts["trial_steps"] += max(t.intermediate_values, default=0)
    return counts


def worker(args: argparse.Namespace) -> None:
    """``--worker METHOD``: run one search here and print its result as the last line (JSON)."""
    sys.path.insert(0, args.root)  # the tree whose hydro (and examples) this search uses
    import optuna
    import torch

    torch.set_num_threads(args.threads)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out = search_plain(args) if args.worker == "plain" else search_hydro(args)
    if args.worker != "plain" and not out["hydro"].startswith(args.root):
        raise RuntimeError(f"imported {out['hydro']}, not the hydro of {args.root}")
    print(json.dumps(out))


def run_worker(args: argparse.Namespace, method: str, root: str, seed: int) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", method, "--root", root,
            "--seed", str(seed)] + shared_argv(args)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=root)
    if proc.returncode:
        raise RuntimeError(f"{method} search failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def shared_argv(args: argparse.Namespace) -> list[str]:
    keys = ("trials", "ratio", "fuse", "width", "layers", "heads", "block", "batch", "steps",
            "eval_every", "chars", "threads", "first_group")  # fmt: skip
    out = []
    for k in keys:
        v = getattr(args, k)
        if v is not None:
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def checkout(rev: str, into: str) -> str:
    """The files of git revision ``rev`` (hydro, hydro_fluid, examples) under ``into``."""
    archive = subprocess.run(["git", "archive", rev, "hydro", "hydro_fluid", "examples"], cwd=ROOT,
                             capture_output=True, check=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--first-repeat", type=int, default=0, help="repeat r uses seed r")
    p.add_argument("--ratio", type=int, default=8)
    p.add_argument("--fuse", type=int, default=16)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--chars", type=int, default=None, help="use the first N characters of text")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--first-group", type=int, default=0,
                   help="hydro.tune's first_group (this tree's 'after' only; 5: MedianPruner's "
                        "n_startup_trials)")  # fmt: skip
    p.add_argument("--check-seeds", type=int, default=2, help="full-model runs per choice")
    p.add_argument("--before-rev", default="4f3d3c1", help="the tree before continuous batching")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--json", default=None, help="also write every repeat's numbers here")
    p.add_argument(
        "--worker", choices=("plain", "hydro", "before", "after"), help=argparse.SUPPRESS
    )
    p.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(args.threads)
    methods = [m for m in args.methods.split(",") if m]
    rev = subprocess.run(["git", "rev-parse", "--short", args.before_rev], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    now = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()  # fmt: skip
    print(f"charlm GPT: {args.layers} layers, width {args.width}, {args.heads} heads, block "
          f"{args.block}, batch {args.batch}, {args.steps} steps (evaluation every "
          f"{args.eval_every}), text {args.chars or 'all'} characters; {args.trials} "
          f"configurations, TPE + median pruner; hydro ratio {args.ratio}, {args.fuse} fused; "
          f"before = {rev}, after = {now} (+ working tree); {args.threads} thread(s); full-model "
          f"check: mean of {args.check_seeds} seed(s)")  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory(prefix="hydro-before-") as tmp:
        roots = {"plain": str(ROOT), "before": checkout(args.before_rev, tmp), "after": str(ROOT)}
        for r in range(args.first_repeat, args.first_repeat + args.repeats):
            row: dict = {"repeat": r}
            for m in methods:
                row[m] = run_worker(args, "plain" if m == "plain" else m, roots[m], seed=r)
                print(f"  repeat {r} {m}: {row[m]['wall']:.1f} s, {row[m]['states']}", flush=True)
            checked: dict[str, float] = {}
            for m in methods:
                key = json.dumps(row[m]["best"], sort_keys=True)
                if key not in checked:
                    losses = [full_model_run(args, row[m]["best"], seed=1000 * (s + 1) + r)
                              for s in range(args.check_seeds)]  # fmt: skip
                    checked[key] = statistics.fmean(losses)
                row[m]["full_loss"] = checked[key]
            rows.append(row)
            print_repeat(row, methods)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1))
    print_summary(rows, methods)


def print_repeat(row: dict, methods: list[str]) -> None:
    r = row["repeat"]
    print(f"\nrepeat {r} (seed {r}):")
    for m in methods:
        best = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in row[m]["best"].items()}
        print(f"  {m:7} choice {best}")
    base = row.get("plain")
    print(f"  {'method':7} {'wall s':>8} {'cpu s':>8} {'speed-up wall/cpu':>18} "
          f"{'full-model loss':>16} {'gap':>8} {'trials':>22} {'occupancy':>10}")  # fmt: skip
    for m in methods:
        x = row[m]
        speed = f"{base['wall'] / x['wall']:.1f}x/{base['cpu'] / x['cpu']:.1f}x" if base else ""
        gap = f"{100 * (x['full_loss'] - base['full_loss']) / base['full_loss']:+.2f}%" \
            if base else ""  # fmt: skip
        occ = x.get("occupancy") or {}
        occ_s = f"{100 * occ['while_asking']:.0f}%" if occ.get("while_asking") else ""
        st = x["states"]
        trials = (
            f"{st.get('COMPLETE', 0)} done {st.get('PRUNED', 0)} pruned {st.get('FAIL', 0)} failed"
        )
        print(f"  {m:7} {x['wall']:8.1f} {x['cpu']:8.1f} {speed:>18} {x['full_loss']:16.4f} "
              f"{gap:>8} {trials:>22} {occ_s:>10}")  # fmt: skip


def print_summary(rows: list[dict], methods: list[str]) -> None:
    if "plain" not in methods:
        return
    print(f"\nover {len(rows)} repeat(s), medians (range):")
    for m in methods:
        if m == "plain":
            continue
        speed = [row["plain"]["wall"] / row[m]["wall"] for row in rows]
        cpu = [row["plain"]["cpu"] / row[m]["cpu"] for row in rows]
        gaps = [100 * (row[m]["full_loss"] - row["plain"]["full_loss"]) / row["plain"]["full_loss"]
                for row in rows]  # fmt: skip
        print(f"  {m:7} speed-up wall {statistics.median(speed):.1f}x ({min(speed):.1f}-"
              f"{max(speed):.1f}x), cpu {statistics.median(cpu):.1f}x ({min(cpu):.1f}-"
              f"{max(cpu):.1f}x); full-model loss vs plain's {statistics.median(gaps):+.2f}% "
              f"({min(gaps):+.2f}% to {max(gaps):+.2f}%)")  # fmt: skip
    if {"before", "after"} <= set(methods):
        ratio = [row["before"]["wall"] / row["after"]["wall"] for row in rows]
        cpu = [row["before"]["cpu"] / row["after"]["cpu"] for row in rows]
        print(f"  after vs before: {statistics.median(ratio):.2f}x less wall time "
              f"({min(ratio):.2f}-{max(ratio):.2f}x), {statistics.median(cpu):.2f}x less cpu "
              f"({min(cpu):.2f}-{max(cpu):.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()

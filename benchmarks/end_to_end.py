"""End to end: plain Optuna on the full model against ``hydro.tune``, with Hydro's capture cache
and ``torch.compile`` switched on and off.

The same search (the same space, TPE sampler, median pruner and number of configurations) on
the character-level GPT of ``examples/charlm`` (its ``tune.yaml``: 4 layers, width 256, 4
heads, blocks of 64 characters; space lr, weight decay, warm-up, dropout, beta2). Methods:

* ``plain``: Optuna's ``study.optimize`` with an objective that trains the full model with
  ``torch.optim.AdamW`` and reports its validation loss (pruned by the same pruner);
* ``hydro``, ``hydro+cache``, ``hydro+compile``, ``hydro+auto``, ``hydro+cache+compile``, ...:
  ``hydro.tune`` (ratio 8, 16 trials per fused group), named by its switches. Without
  ``+cache`` a search starts cold: ``HYDRO_CACHE=0`` and an empty ``TORCHINDUCTOR_CACHE_DIR``
  of its own. With ``+cache`` both are on, in a directory of the search's own, warmed by the same
  search (same seed) shortened to 4 steps and not timed, just before it. ``+compile`` and
  ``+auto`` pass ``compile=True`` / ``"auto"`` to ``hydro.tune`` (``n/a`` where the hydro under
  test has no such argument); otherwise ``compile=False`` where it has one. Every hydro
  search uses plain's storage, Optuna's ``InMemoryStorage`` (``--storage sqlite``: an SQLite
  database in memory, as before 2026-11-26, which costs hydro's asks and tells a few
  milliseconds each), and ``hydro.tune``'s default ``first_group`` ("auto": the median
  pruner's 5 start-up trials train alone first; ``--first-group N`` sets it, 0 turns it off).

``--hydro-path DIR`` makes the hydro methods import ``hydro`` (and ``examples``) from another
tree, e.g. a worktree with work not merged yet; ``plain`` and the full-model checks always use
this tree. Each search runs in a fresh Python process, one after another, with one thread; its
wall and CPU time are those of the search call (data, task and ``tune`` or ``optimize``), and
the process's own (start-up and imports included) are recorded too. ``first eval`` is the time
from the search's start to the pruner's first call: start-up, capture, build (and compile)
plus ``eval_every`` steps. Then each method's chosen configuration trains the full model (the
same loop as plain's objective, with the schedule the trials trained with: ``hydro.recipe``) from
``--check-seeds`` seeds, and the mean final validation losses are compared. One table per
repeat, then medians and ranges.

    python benchmarks/end_to_end.py --budget short --repeats 3 --json out.json
    python benchmarks/end_to_end.py --budget long --repeats 1 --methods plain,hydro+cache
    # another tree's hydro (here a worktree with hydro.tune(compile=)), against plain:
    python benchmarks/end_to_end.py --budget short --hydro-path ../i21-compile \
        --methods plain,hydro+cache,hydro+cache+compile,hydro+cache+auto
    # one repeat (seed 2) on its own: --first-repeat 2 --repeats 1
    # on a GPU (every search and check there; compare wall times): --device cuda

Budgets: ``short`` is the run of ``docs/evidence/2026-12-tuning.md`` (32 steps, batch 8, evaluation
every 8, the first 50,000 characters); ``long`` is the example's own (200 steps, batch 32,
evaluation every 50, the whole text). Any of ``--steps --batch --eval-every --chars``
overrides the budget's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWITCHES = ("cache", "compile", "auto")  # what may follow "hydro+" in a method's name
BUDGETS = {
    "short": {"steps": 32, "eval_every": 8, "batch": 8, "chars": 50_000},
    "long": {"steps": 200, "eval_every": 50, "batch": 32, "chars": None},
}


def add_search_args(p: argparse.ArgumentParser, budget: dict | None = None) -> None:
    """The options that say what a search trains: Hydro's ratio and fusion, the GPT's shape and
    the training budget (``budget``'s values as defaults, else ``None``: the ``--budget``'s)."""
    b = budget or {}
    p.add_argument("--ratio", type=int, default=8)
    p.add_argument("--fuse", type=int, default=16)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=b.get("batch"))
    p.add_argument("--steps", type=int, default=b.get("steps"))
    p.add_argument("--eval-every", type=int, default=b.get("eval_every"))
    p.add_argument("--chars", type=int, default=b.get("chars"),
                   help="use the first N characters of text")


def fill_budget(args: argparse.Namespace) -> None:
    """The options :func:`add_search_args` left unset take ``args.budget``'s values."""
    for k, v in BUDGETS[args.budget].items():
        if getattr(args, k) is None:
            setattr(args, k, v)


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
            "block_size": args.block}


def schedule(opt, warmup: int, steps: int):
    """Linear warm-up from lr/(warmup+1), then cosine decay: the full-model recipe of
    docs/evidence/2026-12-tuning.md (what each surrogate trial trains with)."""
    import torch

    S = torch.optim.lr_scheduler
    main = S.CosineAnnealingLR(opt, T_max=steps - max(warmup, 1))
    if not warmup:
        return main
    ramp = S.LinearLR(opt, start_factor=1.0 / (warmup + 1), end_factor=1.0, total_iters=warmup)
    return S.SequentialLR(opt, [ramp, main], milestones=[warmup])


def check_seed(s: int, repeat: int) -> int:
    """The seed of the full-model check ``s`` of a repeat's choices (the same for every method)."""
    return 1000 * (s + 1) + repeat


def full_model_run(args, params: dict, seed: int, trial=None, build=None) -> float:
    """Train the unmodified full model with plain PyTorch; its final validation loss.

    With ``trial`` (plain Optuna's objective) the loss is reported every ``eval_every`` steps
    and the trial pruned when the pruner says so; without, it is evaluated at the end only.
    ``build``: a factory of another character model to train the same way (default: the
    charlm GPT of ``args``' shape with ``params["dropout"]``).
    """
    import optuna
    import torch
    import torch.nn.functional as F

    from examples.charlm.data import load
    from examples.charlm.model import gpt

    device = torch.device(getattr(args, "device", "cpu"))
    data = load(block_size=args.block, max_chars=args.chars)
    data = {k: tuple(t.to(device) for t in v) for k, v in data.items()}
    torch.manual_seed(seed)
    model = (build() if build is not None
             else gpt(**model_args(args), dropout=params["dropout"])).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=(0.9, params["beta2"]),
                            weight_decay=params["weight_decay"])
    sched = schedule(opt, params["warmup"], args.steps)
    x, y = data["train"]
    g = torch.Generator().manual_seed(seed)
    value = math.nan
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, len(y), (args.batch,), generator=g).to(device)
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


def evaluate(model, val: tuple) -> float:
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
                                     reduction="sum").item()
    model.train()
    return total / y.numel()


# --- one search, in its own process ------------------------------------------------------------


def timed_pruner(clock: dict):
    """Optuna's ``MedianPruner`` that notes when it is first asked (the first evaluation)."""
    import optuna

    class Timed(optuna.pruners.MedianPruner):
        def prune(self, study, trial) -> bool:
            clock.setdefault("first_eval", time.perf_counter() - clock["start"])
            return super().prune(study, trial)

    return Timed()


def search_plain(args: argparse.Namespace) -> dict:
    import optuna

    from hydro.tuning.space import suggest

    clock = {"start": time.perf_counter()}
    cpu = time.process_time()
    sampler = optuna.samplers.TPESampler(seed=args.seed, constant_liar=True)
    study = optuna.create_study(sampler=sampler, pruner=timed_pruner(clock))
    dists = space(args.steps)

    def objective(trial: optuna.Trial) -> float:
        params = {name: suggest(trial, name, d) for name, d in dists.items()}
        return full_model_run(args, params, args.seed + trial.number, trial)

    def note(study: optuna.Study, t: optuna.trial.FrozenTrial) -> None:  # progress, to stderr
        print(f"plain trial {t.number} {t.state.name} at step {max(t.intermediate_values or [0])},"
              f" {time.process_time() - cpu:.0f} cpu s", file=sys.stderr, flush=True)

    study.optimize(objective, n_trials=args.trials, callbacks=[note])
    return {"wall": time.perf_counter() - clock["start"], "cpu": time.process_time() - cpu,
            "first_eval": clock.get("first_eval"), "best": study.best_params,
            "states": states(study), "occupancy": None}


def search_hydro(args: argparse.Namespace, switches: set[str]) -> dict:
    import functools

    import optuna

    import hydro
    from examples.charlm.data import load
    from examples.charlm.model import gpt
    from hydro.fx import cache

    has_compile = "compile" in inspect.signature(hydro.tune).parameters
    compile_ = True if "compile" in switches else "auto" if "auto" in switches else False
    if compile_ and not has_compile:
        return {"na": f"{hydro.__file__}: hydro.tune has no compile argument"}
    clock = {"start": time.perf_counter()}
    cpu = time.process_time()
    data = load(block_size=args.block, max_chars=args.chars)
    task = hydro.Task(model=functools.partial(gpt, **model_args(args)), train_data=data["train"],
                      val_data=data["val"], loss="cross_entropy", optimizer="adamw",
                      scheduler="cosine", steps=args.steps, eval_every=args.eval_every,
                      batch_size=args.batch,
                      **({"eval_samples": args.eval_samples}
                         if getattr(args, "eval_samples", None) else {}))
    # plain's storage (Optuna's in-memory one), unless --storage sqlite
    storage = "sqlite:///:memory:" if args.storage == "sqlite" else \
        optuna.storages.InMemoryStorage()
    result = hydro.tune(
        task, space(args.steps), n_trials=args.trials, ratio=args.ratio, fuse=args.fuse,
        storage=storage, seed=args.seed,
        sampler=optuna.samplers.TPESampler(seed=args.seed, constant_liar=True),
        pruner=timed_pruner(clock),
        **({} if args.first_group == "auto" else {"first_group": int(args.first_group)}),
        **({"compile": compile_} if has_compile else {}),
        **({} if args.device == "cpu" else {"device": args.device}),
    )
    return {"wall": time.perf_counter() - clock["start"], "cpu": time.process_time() - cpu,
            "first_eval": clock.get("first_eval"), "best": result.best_params,
            "best_value": result.best_value,
            "states": states(result.study), "occupancy": getattr(result, "occupancy", None),
            "hydro": hydro.__file__, "compile": compile_ if has_compile else None,
            "cache": dict(cache.stats),
            "eval_blocks": result.study.user_attrs.get("hydro_eval_blocks")}


def states(study) -> dict:
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
    if args.worker == "plain":
        out = search_plain(args)
    else:
        out = search_hydro(args, set(args.worker.split("+")[1:]))
        if "hydro" in out and not out["hydro"].startswith(args.root):
            raise RuntimeError(f"imported {out['hydro']}, not the hydro of {args.root}")
    print(json.dumps(out))


def run_worker(args: argparse.Namespace, method: str, root: str, seed: int, env: dict,
               **override: int) -> dict:
    """One search in a fresh process; adds the process's own wall and CPU seconds."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", method, "--root", root,
            "--seed", str(seed)] + shared_argv(args, override)
    env = {**os.environ, **env, "PYTHONPATH": root, "OMP_NUM_THREADS": str(args.threads)}
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True, cwd=root)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:  # its stderr went to ours
        raise RuntimeError(f"{method} search failed (exit {proc.returncode})")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_wall"] = time.perf_counter() - start
    out["process_cpu"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return out


def method_env(method: str, tmp: str, repeat: int | str) -> dict:
    """The caches a method's search sees, in a directory of its own per repeat: empty, with
    Hydro's switched off, or (``+cache``) warmed by its untimed short run of the same search
    (the capture key holds the first trial's model, dropout included: another seed misses)."""
    d = os.path.join(tmp, f"{method}-{repeat}")
    return {"HYDRO_CACHE": "1" if "cache" in method.split("+") else "0",
            "HYDRO_CACHE_DIR": os.path.join(d, "hydro"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(d, "inductor")}


def shared_argv(args: argparse.Namespace, override: dict) -> list[str]:
    keys = ("trials", "ratio", "fuse", "width", "layers", "heads", "block", "batch", "steps",
            "eval_every", "chars", "threads", "first_group", "storage", "device")
    out = []
    for k in keys:
        v = override.get(k, getattr(args, k))
        if v is not None:
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def tree(path: str) -> str:
    """A tree's commit, and ``+dirty`` when its working tree differs from it."""
    git = ["git", "-C", path]
    rev = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return f"{path} {rev}{'+dirty' if dirty else ''}"


def uptime() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", choices=tuple(BUDGETS), default="short")
    p.add_argument("--trials", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--first-repeat", type=int, default=0, help="repeat r uses seed r")
    add_search_args(p)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--first-group", default="auto",
                   help="hydro.tune's first_group: auto (its default: the median pruner's "
                   "start-up, 5), or a number (0: off)")
    p.add_argument("--storage", choices=("memory", "sqlite"), default="memory",
                   help="the hydro methods' Optuna storage: memory (plain's: Optuna's "
                   "InMemoryStorage) or sqlite (an SQLite database in memory)")
    p.add_argument("--device", default="cpu", help="where every search and check trains: cpu, "
                   "cuda, cuda:N (on a GPU, read wall time: CPU time counts only the host's "
                   "share)")
    p.add_argument("--check-seeds", type=int, default=2, help="full-model runs per choice")
    p.add_argument("--hydro-path", default=str(ROOT), help="the tree the hydro methods import")
    p.add_argument("--methods", default="plain,hydro,hydro+cache")
    p.add_argument("--json", default=None, help="also write every repeat's numbers here")
    p.add_argument("--report", nargs="+", help="print saved JSON files as Markdown tables")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    fill_budget(args)
    if args.worker:
        return worker(args)
    if args.report:
        return report(args.report)
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        parts = m.split("+")
        if m != "plain" and (parts[0] != "hydro" or not set(parts[1:]) <= set(SWITCHES)):
            p.error(f"unknown method {m!r}: plain, or hydro followed by +cache, +compile, +auto")
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(args.threads)
    hydro_path = str(Path(args.hydro_path).resolve())
    config = {k: getattr(args, k) for k in ("budget", "trials", "ratio", "fuse", "width", "layers",
              "heads", "block", "batch", "steps", "eval_every", "chars", "threads", "first_group",
              "check_seeds", "storage")}
    config.update(plain=tree(str(ROOT)), hydro=tree(hydro_path), torch=torch.__version__)
    print(f"charlm GPT: {args.layers} layers, width {args.width}, {args.heads} heads, block "
          f"{args.block}, batch {args.batch}, {args.steps} steps (evaluation every "
          f"{args.eval_every}), text {args.chars or 'all'} characters; {args.trials} "
          f"configurations, TPE + median pruner; hydro ratio {args.ratio}, {args.fuse} fused, "
          f"from {config['hydro']}; plain from {config['plain']}; {args.threads} thread(s); "
          f"full-model check: mean of {args.check_seeds} seed(s)", flush=True)
    rows: list[dict] = []

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps({"config": config, "repeats": rows}, indent=1))

    with tempfile.TemporaryDirectory(prefix="hydro-e2e-") as tmp:
        env = {"PYTHONPYCACHEPREFIX": os.path.join(tmp, "pycache")}  # leave --hydro-path's tree be
        if hydro_path == str(ROOT):
            env = {}
        for r in range(args.first_repeat, args.first_repeat + args.repeats):
            row: dict = {"repeat": r, "load": {"before": uptime()}}
            rows.append(row)
            for m in methods:
                root = str(ROOT) if m == "plain" else hydro_path
                if "cache" in m.split("+"):  # warm the caches: the same search, 4 steps, untimed
                    warm = run_worker(args, m, root, r, {**env, **method_env(m, tmp, r)},
                                      steps=4, eval_every=4)
                    print(f"  repeat {r} warmed {m}: {warm.get('cache', warm.get('na'))}, "
                          f"{warm['process_cpu']:.1f} cpu s", flush=True)
                row[m] = run_worker(args, m, root, r, {**env, **method_env(m, tmp, r)})
                if "cache" in m.split("+"):
                    row[m]["warm"] = {k: warm.get(k) for k in ("process_wall", "process_cpu",
                                      "cache", "na")}
                row[m]["load"] = uptime()
                print(f"  repeat {r} {m}: " + (row[m].get("na") or f"{row[m]['wall']:.1f} s, "
                      f"{row[m]['cpu']:.1f} cpu s, {row[m]['states']}, cache "
                      f"{row[m].get('cache')}, {row[m]['load']}"),
                      flush=True)
                save()
            checked: dict[str, list[float]] = {}
            for m in methods:
                if "na" in row[m]:
                    continue
                key = json.dumps(row[m]["best"], sort_keys=True)
                if key not in checked:
                    checked[key] = [full_model_run(args, row[m]["best"], seed=check_seed(s, r))
                                    for s in range(args.check_seeds)]
                row[m]["full_loss"] = statistics.fmean(checked[key])
                row[m]["full_losses"] = checked[key]  # one per check seed: the noise floor
            row["load"]["after"] = uptime()
            save()
            print_repeat(row, methods)
    print_summary(rows, methods)


def ratio(base: dict | None, x: dict, key: str) -> str:
    return f"{base[key] / x[key]:.1f}x" if base else ""


def gap(base: dict | None, x: dict) -> float | None:
    if not base:
        return None
    return 100 * (x["full_loss"] - base["full_loss"]) / base["full_loss"]


def print_repeat(row: dict, methods: list[str]) -> None:
    r = row["repeat"]
    print(f"\nrepeat {r} (seed {r}; {row['load']['before']} before, {row['load']['after']} "
          "after):")
    w = max(len(m) for m in methods)
    for m in methods:
        if "na" not in row[m]:
            best = {k: round(v, 5) if isinstance(v, float) else v
                    for k, v in row[m]["best"].items()}
            print(f"  {m:{w}} choice {best}")
    base = row.get("plain")
    print(f"  {'method':{w}} {'wall s':>7} {'cpu s':>7} {'process':>7} {'1st eval':>8} "
          f"{'plain/x wall':>12} {'cpu':>5} {'full loss':>9} {'gap':>7} {'done/pruned':>11} "
          f"{'trial-steps':>11}")
    for m in methods:
        x = row[m]
        if "na" in x:
            print(f"  {m:{w}} n/a ({x['na']})")
            continue
        g = gap(base, x)
        st = x["states"]
        print(f"  {m:{w}} {x['wall']:7.1f} {x['cpu']:7.1f} {x['process_wall']:7.1f} "
              f"{x['first_eval'] or math.nan:8.1f} {ratio(base, x, 'wall'):>12} "
              f"{ratio(base, x, 'cpu'):>5} {x['full_loss']:9.4f} "
              f"{'' if g is None else f'{g:+.2f}%':>7} "
              f"{st.get('COMPLETE', 0):>5}/{st.get('PRUNED', 0):<5} "
              f"{st['trial_steps']:>11}")


def print_summary(rows: list[dict], methods: list[str]) -> None:
    def med(xs: list[float], unit: str, fmt: str = ".1f") -> str:
        return (f"{statistics.median(xs):{fmt}}{unit} ({min(xs):{fmt}}{unit} to "
                f"{max(xs):{fmt}}{unit})")

    print(f"\nover {len(rows)} repeat(s), medians (range):")
    for m in methods:
        done = [row for row in rows if "full_loss" in row.get(m, {})]
        if not done:
            print(f"  {m}: n/a")
            continue
        line = (f"  {m}: wall {med([r[m]['wall'] for r in done], ' s')}, cpu "
                f"{med([r[m]['cpu'] for r in done], ' s')}, first eval "
                f"{med([r[m]['first_eval'] for r in done], ' s')}")
        if m != "plain" and "plain" in methods:
            line += (f"; plain/{m}: wall "
                     f"{med([r['plain']['wall'] / r[m]['wall'] for r in done], 'x')}, cpu "
                     f"{med([r['plain']['cpu'] / r[m]['cpu'] for r in done], 'x')}; "
                     f"full-model loss gap "
                     f"{med([gap(r['plain'], r[m]) for r in done], '%', '+.2f')}")
        print(line)


def report(paths: list[str]) -> None:
    """``--report A.json [B.json ...]``: the saved repeats as Markdown tables, merged by repeat
    (a method from another tree than plain's is named ``method@tree``; plain, same seed, is
    the same search in every file)."""
    rows: dict[int, dict] = {}
    for path in paths:
        saved = json.loads(Path(path).read_text())
        tree_ = saved["config"]["hydro"].split()[0]
        suffix = "" if tree_ == saved["config"]["plain"].split()[0] else "@" + Path(tree_).name
        for row in saved["repeats"]:
            into = rows.setdefault(row["repeat"], {})
            for m, x in row.items():
                if isinstance(x, dict) and "wall" in x and "full_loss" in x:
                    into.setdefault(m if m == "plain" else m + suffix, x)
    methods = list(dict.fromkeys(m for row in rows.values() for m in row))
    methods.sort(key=lambda m: m != "plain")  # plain first, the others as they came
    print("| repeat | method | wall s | CPU s | process CPU s | first eval s | plain/method wall "
          "(CPU) | complete / pruned | trial-steps | full-model loss | gap vs plain | load after "
          "|")
    print("|---" * 12 + "|")
    for r, row in sorted(rows.items()):
        base = row.get("plain")
        for m in methods:
            if m not in row:
                continue
            x, g = row[m], gap(base, row[m])
            speed = "" if base is None or x is base else \
                f"{ratio(base, x, 'wall')} ({ratio(base, x, 'cpu')})"
            st = x["states"]
            print(f"| {r} | {m} | {x['wall']:.1f} | {x['cpu']:.1f} | {x['process_cpu']:.1f} | "
                  f"{x['first_eval'] or math.nan:.1f} | {speed} | {st.get('COMPLETE', 0)} / "
                  f"{st.get('PRUNED', 0)} | {st['trial_steps']} | {x['full_loss']:.4f} | "
                  f"{'' if m == 'plain' or g is None else f'{g:+.2f}%'} | "
                  f"{x['load'].split()[2].rstrip(',')} |")
    print("\n| method | CPU s | wall s | plain/method CPU | plain/method wall | gap vs plain | "
          "CPU per trial-step |\n|---|---|---|---|---|---|---|")
    for m in methods:
        done = [row for row in rows.values() if m in row and "plain" in row]
        if not done:
            continue

        def med(xs: list[float], fmt: str = ".1f", unit: str = "") -> str:
            return (f"{statistics.median(xs):{fmt}}{unit} ({min(xs):{fmt}} to {max(xs):{fmt}}"
                    f"{unit})" if len(xs) > 1 else f"{xs[0]:{fmt}}{unit}")

        per_step = [1000 * r[m]["cpu"] / r[m]["states"]["trial_steps"] for r in done]
        cells = [med([r[m]["cpu"] for r in done]), med([r[m]["wall"] for r in done])]
        if m == "plain":
            cells += ["", "", ""]
        else:
            cells += [med([r["plain"]["cpu"] / r[m]["cpu"] for r in done], ".1f", "x"),
                      med([r["plain"]["wall"] / r[m]["wall"] for r in done], ".1f", "x"),
                      med([gap(r["plain"], r[m]) for r in done], "+.2f", "%")]
        print(f"| {m} | " + " | ".join(cells) + f" | {med(per_step, '.0f', ' ms')} |")


if __name__ == "__main__":
    main()

"""Does Hydro's choice hold on the full model? The learning-rate targets, measured on two GPTs.

Two GPT-style character-level language models on ``pydoc_data.topics`` (``examples/charlm``'s
data: blocks of 64 characters, the first ``--chars`` characters of the text):

* **charlm**: the ``examples/charlm`` GPT as its ``tune.yaml`` sets it (4 layers, 4 heads, tied
  embedding and readout), width 256;
* **pregpt**: the pre-LN GPT of ``benchmarks/mup_compare.py`` (``SmallGPT``: 2 layers, 8 heads,
  an untied readout with a bias, PyTorch's default init), width 512.

For each model and each seed of ``--seeds``:

1. **full grid**: the unmodified full model over a learning-rate grid of powers of 2 (widened by
   a doubling while the mean's best sits at an edge), with plain PyTorch and the recipe every
   Hydro trial trains with here: AdamW (betas 0.9 / 0.999, weight decay 0.01: ``hydro.Task``'s
   AdamW defaults), no warm-up, cosine decay over the run, no dropout; charlm through
   ``end_to_end.full_model_run`` itself, pregpt through the same steps written for a model of
   any class (:func:`full_run`);
2. **surrogate grid**: the ratio-4 surrogate over the same grid, trained as ``hydro.tune`` trains
   it: one ``hydro.tune`` call per seed whose study has the grid enqueued (``NopPruner``,
   ``first_group=0``; fused groups train each member as it would train alone). A seed's best lr
   is compared with the full model's best at the same seed.

Then, for each search seed, ``hydro.tune`` end to end (TPE, ``--trials`` trials, ratio 4, 16
fused, Hydro's default pruner, the learning rate alone over the grid's range, log scale) with
``replicas=2, leaders=4``, and after it ``hydro.tuning.verification.verify`` on the same study at
k = 3 (what ``verify_top_k=3`` runs at the end of ``hydro.tune``; called here so that its CPU time
is measured apart from the search's), at each fraction of ``--verify-fracs`` of the steps. Three
variants of the same search:

* (a) **best trial**: the best trial of the search itself (replicas left out): what the export
  gives without ``replicas``;
* (b) **replicas**: ``TuneResult.chosen_params`` (the noise-aware choice);
* (c) **check**: the export's choice once the check ran (``outputs.chosen_params`` with the
  check's result), one per check length.

Each variant's learning rate trains the full model on the grid's seeds; its gap is (mean full
loss at the choice) / (mean full loss at the grid's best lr) - 1. The check's cost is its CPU
time (``time.process_time``) over the search's (the ``hydro.tune`` call, replicas included),
with Hydro's capture cache on, in a cache directory of this benchmark's own (``--cache-dir``, in
the system's temporary directory: the surrogate grids capture first, so the searches read their
surrogate from the cache, as a user's reruns do; the first check captures the full model, later
ones read it).

Every trained run is kept in ``--json`` under its model, seed and learning rate: a rerun trains
only what is missing. ``--report FILE`` prints the tables from it.

    python benchmarks/transfer_targets.py --models charlm pregpt
    python benchmarks/transfer_targets.py --report benchmarks/results/transfer_targets.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's hydro and examples
sys.path.insert(0, str(HERE))
import end_to_end as e2e  # noqa: E402

RESULTS = HERE / "results"
RATIO, FUSE, K = 4, 16, 3
# the recipe's fixed values: hydro.Task's AdamW defaults (hydro.tuning.recipe.DEFAULTS), no
# warm-up, the model's dropout (0): what a search of the learning rate alone trains with
FIXED = {"weight_decay": 0.01, "beta2": 0.999, "warmup": 0, "dropout": 0.0}
MODELS = {
    "charlm": {"width": 256, "layers": 4, "heads": 4, "lr_lo": -12, "lr_hi": -7},
    "pregpt": {"width": 512, "layers": 2, "heads": 8, "lr_lo": -13, "lr_hi": -8},
}


def factory(name: str):
    """The full model's factory (what ``hydro.Task`` gets)."""
    m = MODELS[name]
    if name == "charlm":
        from examples.charlm.model import gpt

        return functools.partial(gpt, n_layer=m["layers"], n_head=m["heads"], n_embd=m["width"],
                                 block_size=64)
    from mup_compare import SmallGPT

    return functools.partial(SmallGPT, width=m["width"], layers=m["layers"], heads=m["heads"])


def budget(args: argparse.Namespace, name: str) -> argparse.Namespace:
    """The namespace ``end_to_end.full_model_run`` reads: the model's shape and the budget."""
    m = MODELS[name]
    steps, batch = (args.steps, args.batch) if name == "charlm" else (args.steps2, args.batch2)
    return argparse.Namespace(width=m["width"], layers=m["layers"], heads=m["heads"], block=64,
                              batch=batch, steps=steps, eval_every=steps, chars=args.chars,
                              device="cpu")


@functools.cache
def load_data(chars: int) -> dict:
    from examples.charlm.data import load

    return load(block_size=64, max_chars=chars)


def full_run(name: str, b: argparse.Namespace, lr: float, seed: int) -> float:
    """The full model's final validation loss at ``lr`` (the module's recipe), from ``seed``:
    ``end_to_end.full_model_run``'s loop, with pregpt built in place of its GPT."""
    build = None if name == "charlm" else factory(name)
    return e2e.full_model_run(b, {**FIXED, "lr": lr}, seed, build=build)


def task(name: str, b: argparse.Namespace, eval_every: int):
    import hydro

    data = load_data(b.chars)
    return hydro.Task(model=factory(name), train_data=data["train"], val_data=data["val"],
                      loss="cross_entropy", optimizer="adamw", scheduler="cosine",
                      steps=b.steps, eval_every=eval_every, batch_size=b.batch)


def lr_space(lo: int, hi: int) -> dict:
    import optuna

    return {"lr": optuna.distributions.FloatDistribution(2.0**lo, 2.0**hi, log=True)}


@contextlib.contextmanager
def quiet():
    """Hydro's warnings about studies made here (nothing older to compare with) left out."""
    from hydro.errors import HydroWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "study .* has no definition", HydroWarning)
        yield


def surrogate_grid(name: str, b: argparse.Namespace, lrs: list[float], seed: int) -> list[float]:
    """Each lr's final value on the ratio-4 surrogate, trained by ``hydro.tune`` from ``seed``."""
    import optuna

    import hydro

    study = optuna.create_study(storage=optuna.storages.InMemoryStorage(),
                                pruner=optuna.pruners.NopPruner())
    for lr in lrs:
        study.enqueue_trial({"lr": lr})
    exps = [math.log2(lr) for lr in lrs]
    with quiet():
        result = hydro.tune(task(name, b, b.steps), lr_space(min(exps), max(exps)),
                            n_trials=len(lrs), ratio=RATIO, fuse=FUSE, study=study, seed=seed,
                            first_group=0, progress=False)
    by_lr = {t.params["lr"]: t.value if t.value is not None else math.inf
             for t in result.study.get_trials(deepcopy=False)}
    return [by_lr[lr] for lr in lrs]


def search(name: str, b: argparse.Namespace, args: argparse.Namespace, lo: int, hi: int,
           seed: int, fracs: list[float]) -> dict:
    """One ``hydro.tune`` search with replicas, then the check at each length: the variants'
    learning rates and the CPU times."""
    import optuna

    import hydro
    from hydro.tuning.outputs import chosen_params
    from hydro.tuning.selection import REPLICA_OF
    from hydro.tuning.verification import verify

    t = task(name, b, args.eval_every if name == "charlm" else args.eval_every2)
    cpu = time.process_time()
    with quiet():
        result = hydro.tune(t, lr_space(lo, hi), n_trials=args.trials, ratio=RATIO, fuse=FUSE,
                            storage=optuna.storages.InMemoryStorage(), seed=seed,
                            sampler=optuna.samplers.TPESampler(seed=seed, constant_liar=True),
                            replicas=2, leaders=4, progress=False)
    search_cpu = time.process_time() - cpu
    trials = result.study.get_trials(deepcopy=False)
    own = [x for x in trials if x.state.name == "COMPLETE" and REPLICA_OF not in x.user_attrs]
    best = min(own, key=lambda x: x.value)
    out = {"search_cpu": search_cpu, "best_trial": best.number, "best_lr": best.params["lr"],
           "best_value": best.value, "chosen_lr": result.chosen_params["lr"],
           "selection": result.selection, "below_floor": result.below_floor,
           "states": e2e.states(result.study), "checks": {}}
    for frac in fracs:
        steps = check_len(frac, b.steps)
        cpu = time.process_time()
        v = verify(t, result.study, K, steps=steps, seed=seed)
        out["checks"][str(steps)] = {"cpu": time.process_time() - cpu, "search_cpu": search_cpu,
                                     "lr": chosen_params(result.study, v)["lr"],
                                     "winner": v["winner"], "surrogate_best": v["surrogate_best"],
                                     "checked": [r["trial"] for r in v["configs"]],
                                     "checked_lrs": [r["params"]["lr"] for r in v["configs"]],
                                     "full_values": [r["full_value"] for r in v["configs"]]}
    return out


# --- the run ---------------------------------------------------------------------------------


def check_len(frac: float, steps: int) -> int:
    return max(1, round(frac * steps))


def lr_key(lr: float) -> str:
    return repr(float(lr))


def mean_full(saved: dict, name: str, lr: float, seeds: list[int]) -> float | None:
    runs = saved["full"].get(name, {})
    vals = [runs.get(f"{s}|{lr_key(lr)}") for s in seeds]
    return None if any(v is None for v in vals) else statistics.fmean(vals)


def grid_range(saved: dict, name: str) -> tuple[int, int]:
    g = saved.setdefault("grid", {}).setdefault(name, {})
    return g.get("lo", MODELS[name]["lr_lo"]), g.get("hi", MODELS[name]["lr_hi"])


def run_model(name: str, args: argparse.Namespace, saved: dict, save) -> None:
    b = budget(args, name)
    saved["config"][name] = {**MODELS[name], "steps": b.steps, "batch": b.batch, "block": 64,
                             "chars": b.chars, "eval_every": args.eval_every if name == "charlm"
                             else args.eval_every2, "trials": args.trials, "ratio": RATIO,
                             "fuse": FUSE, "seeds": args.seeds, "search_seeds": args.search_seeds,
                             "recipe": "AdamW (0.9, 0.999), weight decay 0.01, no warm-up, "
                             "cosine decay, no dropout"}
    full = saved["full"].setdefault(name, {})
    sur = saved["sur"].setdefault(name, {})

    def train_full(lr: float, seed: int) -> None:
        k = f"{seed}|{lr_key(lr)}"
        if k not in full:
            t0 = time.process_time()
            full[k] = full_run(name, b, lr, seed)
            save()
            print(f"{name} full seed {seed} lr 2^{math.log2(lr):.2f}: {full[k]:.4f} "
                  f"({time.process_time() - t0:.0f} cpu s)", flush=True)

    while True:  # the grids, widened while a mean's best sits at an edge
        lo, hi = grid_range(saved, name)
        lrs = [2.0**e for e in range(lo, hi + 1)]
        for seed in args.seeds:
            todo = [lr for lr in lrs if f"{seed}|{lr_key(lr)}" not in sur]
            if todo:
                t0 = time.process_time()
                for lr, v in zip(todo, surrogate_grid(name, b, todo, seed)):
                    sur[f"{seed}|{lr_key(lr)}"] = v
                save()
                print(f"{name} surrogate seed {seed}: {len(todo)} lrs, "
                      f"{time.process_time() - t0:.0f} cpu s", flush=True)
        for seed in args.seeds:
            for lr in lrs:
                train_full(lr, seed)
        g = saved["grid"][name]
        edge = []
        for runs in (full, sur):
            means = {e: statistics.fmean(runs[f"{s}|{lr_key(2.0**e)}"] for s in args.seeds)
                     for e in range(lo, hi + 1)}
            best = min(means, key=means.get)
            edge += [best] if best in (lo, hi) else []
        if not edge or hi - lo >= args.max_grid - 1:
            break
        g["lo"], g["hi"] = (lo - 1 if lo in edge else lo), (hi + 1 if hi in edge else hi)
        print(f"{name}: a best sits at an edge of 2^{lo}..2^{hi}: the grid widens to "
              f"2^{g['lo']}..2^{g['hi']}", flush=True)

    lo, hi = grid_range(saved, name)
    tunes = saved["tune"].setdefault(name, {})
    for seed in args.search_seeds:
        x = tunes.get(str(seed))
        fracs = [f for f in args.verify_fracs
                 if x is None or str(check_len(f, b.steps)) not in x["checks"]]
        if x is None or fracs:
            t0 = time.process_time()
            new = search(name, b, args, lo, hi, seed, fracs)
            if x is None:
                tunes[str(seed)] = x = new
            else:  # a check length not run yet: the same search again (seeded), then the check
                same = (new["best_lr"], new["chosen_lr"]) == (x["best_lr"], x["chosen_lr"])
                x.setdefault("reruns", []).append({"search_cpu": new["search_cpu"],
                                                   "same_choices": same,
                                                   "checks": list(new["checks"])})
                if not same:
                    print(f"{name} search seed {seed} ran again chose otherwise: "
                          f"{new['best_lr']}, {new['chosen_lr']} against {x['best_lr']}, "
                          f"{x['chosen_lr']}; its checks are kept apart", flush=True)
                    x.setdefault("other_checks", {}).update(new["checks"])
                else:
                    x["checks"].update(new["checks"])
            save()
            print(f"{name} search seed {seed}: best trial lr {x['best_lr']:.3g}, chosen "
                  f"{x['chosen_lr']:.3g}, checks "
                  f"{ {k: round(c['lr'], 6) for k, c in x['checks'].items()} }; search "
                  f"{x['search_cpu']:.0f} cpu s, checks "
                  f"{ {k: round(c['cpu'], 1) for k, c in x['checks'].items()} } cpu s "
                  f"({time.process_time() - t0:.0f} cpu s)", flush=True)
        x = tunes[str(seed)]
        for lr in variant_lrs(x):
            for s in args.seeds:
                train_full(lr, s)


def variant_lrs(x: dict) -> list[float]:
    return list(dict.fromkeys([x["best_lr"], x["chosen_lr"]]
                              + [c["lr"] for c in x["checks"].values()]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="the grids' seeds (every full-model measurement's)")
    p.add_argument("--search-seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--steps", type=int, default=100, help="charlm's training steps")
    p.add_argument("--batch", type=int, default=16, help="charlm's batch")
    p.add_argument("--eval-every", type=int, default=25, help="charlm's search evaluations")
    p.add_argument("--steps2", type=int, default=100, help="pregpt's training steps")
    p.add_argument("--batch2", type=int, default=8, help="pregpt's batch")
    p.add_argument("--eval-every2", type=int, default=25, help="pregpt's search evaluations")
    p.add_argument("--chars", type=int, default=200_000, help="the first N characters of text")
    p.add_argument("--verify-fracs", type=float, nargs="+", default=[1.0, 0.5],
                   help="the check's lengths, as fractions of the steps")
    p.add_argument("--max-grid", type=int, default=9, help="widen the grid to at most N lrs")
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(),
                                                       "hydro-transfer-targets"),
                   help="Hydro's capture cache directory")
    p.add_argument("--json", default=str(RESULTS / "transfer_targets.json"))
    p.add_argument("--txt", default=str(RESULTS / "transfer_targets.txt"),
                   help="the printed tables, written at the end")
    p.add_argument("--report", help="print the tables of a saved JSON file")
    args = p.parse_args()
    if args.report:
        return print(report(json.loads(Path(args.report).read_text())), end="")
    import optuna
    import torch

    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path = Path(args.json)
    os.environ["HYDRO_CACHE_DIR"] = args.cache_dir
    os.environ["HYDRO_CACHE"] = "1"
    saved = json.loads(path.read_text()) if path.exists() else {}
    for k in ("config", "full", "sur", "tune", "grid"):
        saved.setdefault(k, {})

    def save() -> None:
        path.write_text(json.dumps(saved, indent=1))

    for name in args.models:
        run_model(name, args, saved, save)
    text = report(saved)
    print(text, end="")
    Path(args.txt).write_text(text)


# --- the report ------------------------------------------------------------------------------


def pow2(lr: float) -> str:
    e = math.log2(lr)
    return f"2^{e:.0f}" if abs(e - round(e)) < 1e-9 else f"2^{e:.2f}"


def report(saved: dict) -> str:
    """Every model's tables, as Markdown."""
    return "".join(model_report(saved, name, cfg) for name, cfg in saved["config"].items())


def model_report(saved: dict, name: str, cfg: dict) -> str:
    """One model's tables: the grids, the end-to-end variants' gaps and the check's cost."""
    out = io.StringIO()

    def say(line: str = "") -> None:
        print(line, file=out)

    full, sur = saved["full"].get(name, {}), saved["sur"].get(name, {})
    seeds = cfg["seeds"]
    lo, hi = grid_range(saved, name)
    exps = list(range(lo, hi + 1))
    say(f"## {name}: width {cfg['width']}, {cfg['layers']} layers, {cfg['heads']} heads; "
        f"{cfg['steps']} steps, batch {cfg['batch']}, block 64, the first {cfg['chars']} "
        f"characters; {cfg['recipe']}; ratio {cfg['ratio']}; seeds "
        f"{', '.join(map(str, seeds))}")
    say()
    say("Final validation loss over the learning-rate grid (* the row's best):")
    say()
    say("| model | seed | " + " | ".join(f"2^{e}" for e in exps) + " | best |")
    say("|---" * (len(exps) + 3) + "|")
    best: dict[tuple[str, str], int | None] = {}
    for label, runs in (("full", full), ("surrogate", sur)):
        for s in [*map(str, seeds), "mean"]:
            vals = {}
            for e in exps:
                if s == "mean":
                    xs = [runs.get(f"{t}|{lr_key(2.0**e)}") for t in seeds]
                    if all(x is not None for x in xs):
                        vals[e] = statistics.fmean(xs)
                elif f"{s}|{lr_key(2.0**e)}" in runs:
                    vals[e] = runs[f"{s}|{lr_key(2.0**e)}"]
            b = min(vals, key=vals.get) if vals else None
            best[label, s] = b
            say(f"| {label} | {s} | " + " | ".join(
                f"{vals[e]:.4f}{'*' if e == b else ''}" if e in vals else "" for e in exps)
                + f" | {'' if b is None else f'2^{b}'} |")
    agree = [s for s in map(str, seeds) if best["full", s] is not None
             and best["full", s] == best["surrogate", s]]
    say()
    say(f"Surrogate's best lr = the full model's: {len(agree)} of {len(seeds)} seeds "
        f"({', '.join(agree) or 'none'}); the means' bests: full "
        f"2^{best['full', 'mean']}, surrogate 2^{best['surrogate', 'mean']} (target: 2 of "
        f"3 seeds)")
    say()
    grid_best = {e: mean_full(saved, name, 2.0**e, seeds) for e in exps}
    grid_best = {e: v for e, v in grid_best.items() if v is not None}
    tunes = saved["tune"].get(name, {})
    if not grid_best or not tunes:
        return out.getvalue()
    ref_e = min(grid_best, key=grid_best.get)
    ref = grid_best[ref_e]

    def gap(lr: float) -> float | None:
        m = mean_full(saved, name, lr, seeds)
        return None if m is None else 100 * (m / ref - 1)

    def cell(lr: float) -> str:
        g = gap(lr)
        return f"{pow2(lr)}: {'?' if g is None else f'{g:+.2f}%'}"

    steps_list = sorted({int(k) for x in tunes.values() for k in x["checks"]})
    names = ["a", "b"] + [f"c{n}" for n in steps_list]
    say(f"hydro.tune end to end ({cfg['trials']} trials, TPE, ratio {cfg['ratio']}, lr "
        f"alone over 2^{lo}..2^{hi}): each variant's lr and its gap to the full grid's best "
        f"(2^{ref_e}, mean loss {ref:.4f} over seeds {', '.join(map(str, seeds))}):")
    say()
    say("| search seed | (a) best trial | (b) replicas=2, leaders=4 | " + " | ".join(
        f"(c) + check k={K}, {n} steps" for n in steps_list) + " |")
    say("|---" * (3 + len(steps_list)) + "|")
    cols: dict[str, list[float]] = {}
    ordered = sorted(tunes.items(), key=lambda kv: int(kv[0]))
    for seed, x in ordered:
        checks = x["checks"]
        lrs = [x["best_lr"], x["chosen_lr"]] + [checks[str(n)]["lr"] if str(n) in checks
                                                else None for n in steps_list]
        for n_, lr in zip(names, lrs):
            g = None if lr is None else gap(lr)
            if g is not None:
                cols.setdefault(n_, []).append(g)
        say(f"| {seed} | " + " | ".join("" if lr is None else cell(lr) for lr in lrs) + " |")
    say("| median | " + " | ".join(f"{statistics.median(cols[n]):+.2f}%" if n in cols else ""
                                   for n in names) + " |")
    say()
    say("Targets: (b) median within 1%, (c) within 0.5%.")
    say()
    say("The noise-aware choice: the seed noise it measured, the configurations within it, and "
        "the lr range they span:")
    say()
    say("| search seed | seed noise | configurations within noise | lr range within noise |")
    say("|---|---|---|---|")
    for seed, x in ordered:
        sel = x.get("selection") or {}
        rng = sel.get("ranges", {}).get("lr")
        say(f"| {seed} | {sel.get('noise', math.nan):.4f} | {len(sel.get('within', []))} | "
            + (f"{pow2(rng[0])} to {pow2(rng[1])}" if rng else "") + " |")
    say()
    say(f"The check's cost (k = {K}; CPU s, capture cache on), against the search it followed "
        "(hydro.tune with its replicas; a check added later follows the same seeded search run "
        "again):")
    say()
    say("| search seed | search CPU s | trials complete / pruned | " + " | ".join(
        f"check {n} steps: CPU s (x search)" for n in steps_list) + " | checked trials "
        "(winner per length) |")
    say("|---" * (4 + len(steps_list)) + "|")
    ratios: dict[int, list[float]] = {}
    for seed, x in ordered:
        cells = []
        for n in steps_list:
            c = x["checks"].get(str(n))
            if c is None:
                cells.append("")
                continue
            c.setdefault("search_cpu", x["search_cpu"])  # saved before it was kept
            ratios.setdefault(n, []).append(c["cpu"] / c["search_cpu"])
            cells.append(f"{c['cpu']:.1f} ({c['cpu'] / c['search_cpu']:.2f}x of "
                         f"{c['search_cpu']:.1f})")
        st = x["states"]
        checked = next(iter(x["checks"].values()))["checked"]
        say(f"| {seed} | {x['search_cpu']:.1f} | {st.get('COMPLETE', 0)} / "
            f"{st.get('PRUNED', 0)} | " + " | ".join(cells) + " | "
            + ", ".join(map(str, checked)) + " ("
            + ", ".join(f"{n}: {x['checks'][str(n)]['winner']}" for n in steps_list
                        if str(n) in x["checks"]) + ") |")
    say("| median | | | " + " | ".join(f"{statistics.median(ratios[n]):.2f}x" if n in ratios
                                      else "" for n in steps_list) + " | |")
    say()
    return out.getvalue()


if __name__ == "__main__":
    main()

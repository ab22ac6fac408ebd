"""Does the ratio-8 surrogate rank configurations as the full model does, at the short budget?

The end-to-end benchmark (``benchmarks/end_to_end.py --budget short``: the ``examples/charlm``
GPT, 4 layers, width 256, 32 AdamW steps of batch 8, warm-up then cosine) found the full model
trained with ``hydro.tune``'s choice a few percent worse than with plain Optuna's. This asks
where the surrogate's ranking departs from the full model's. Every configuration is trained

* **full**: the unmodified full model, ``end_to_end.full_model_run`` (plain Optuna's objective
  without pruning: ``torch.optim.AdamW``, the full-model schedule), one run per ``--full-seeds``
  seed;
* **surrogate**: exactly as ``hydro.tune`` trains it (ratio 8, the same task, recipe and
  parameter mapping), with no pruning: one ``hydro.tune`` call per ``--sur-seeds`` seed whose
  study has every configuration enqueued (``NopPruner``, ``first_group=0``, ``fuse`` 16; fused
  groups train each member exactly as alone, by the fusion tests).

Sets of configurations: ``choices`` (each repeat's plain and hydro choice, read from
``--choices`` end_to_end JSON files), ``grid`` (learning rate 2^-13 to 2^-7 by 2x at warm-up 0, 4
and 8, weight decay 0.1, dropout 0.1, beta2 0.99; then weight decay, dropout and beta2 one at a
time at lr 2^-10, warm-up 4) and ``random`` (``--random`` configurations drawn by Optuna's
``RandomSampler``, seed 0, from the end-to-end search space). Results are cached by
configuration and seed in ``--json``: a rerun with more sets or seeds trains only what is
missing. It prints the Spearman rank correlation between the two models' mean losses (per set
and over all), each model's seed-to-seed rank agreement (the ceiling for it), each
hyperparameter's rank correlation with the loss under each model, the grid's tables, and the
choices' losses under both models.

    python benchmarks/transfer_short.py --choices benchmarks/results/end_to_end_short.json \
        benchmarks/results/end_to_end_short_more.json --json benchmarks/results/transfer_short.json
    python benchmarks/transfer_short.py --report benchmarks/results/transfer_short.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's hydro and examples
sys.path.insert(0, str(HERE))
import end_to_end as e2e  # noqa: E402

HPS = ("lr", "weight_decay", "warmup", "dropout", "beta2")
CENTRE = {"lr": 2.0**-10, "weight_decay": 0.1, "warmup": 4, "dropout": 0.1, "beta2": 0.99}


def key(params: dict) -> str:
    return json.dumps({k: params[k] for k in HPS}, sort_keys=True)


def grid_configs(lr_only: bool = False, warmups: tuple[int, ...] = (0, 4, 8)) -> list[dict]:
    """Learning rate x warm-up at the centre, then (unless ``lr_only``) the other three one at
    a time."""
    out = [{**CENTRE, "lr": 2.0**e, "warmup": w} for w in warmups for e in range(-13, -6)]
    if lr_only:
        return out
    out += [{**CENTRE, "weight_decay": v} for v in (0.0, 0.2)]
    out += [{**CENTRE, "dropout": v} for v in (0.0, 0.2)]
    out += [{**CENTRE, "beta2": v} for v in (0.95, 0.999)]
    return out


def random_configs(n: int, steps: int) -> list[dict]:
    import optuna

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    dists = e2e.space(steps)
    return [study.ask(dists).params for _ in range(n)]


def choice_configs(paths: list[str]) -> list[tuple[dict, str, float | None]]:
    """``(params, label, full_loss)`` of every method's choice in saved end_to_end runs (its
    full-model check, the mean over the check seeds)."""
    out = []
    for path in paths:
        for row in json.loads(Path(path).read_text())["repeats"]:
            for m, x in row.items():
                if isinstance(x, dict) and "best" in x:
                    out.append((x["best"], f"{row['repeat']}:{m}", x.get("full_loss")))
    return out


def train_surrogates(args: argparse.Namespace, configs: list[dict], seed: int) -> list[float]:
    """Each configuration's final validation loss on its surrogate, trained as ``hydro.tune``
    trains it (the benchmark's task), with no pruning."""
    import optuna

    import hydro
    from examples.charlm.data import load
    from examples.charlm.model import gpt
    from hydro.errors import HydroWarning

    data = load(block_size=args.block, max_chars=args.chars)
    task = hydro.Task(
        model=functools.partial(gpt, **e2e.model_args(args)),
        train_data=data["train"],
        val_data=data["val"],
        loss="cross_entropy",
        optimizer="adamw",
        scheduler="cosine",
        steps=args.steps,
        eval_every=args.eval_every,
        batch_size=args.batch,
    )
    study = optuna.create_study(
        storage=optuna.storages.InMemoryStorage(), pruner=optuna.pruners.NopPruner()
    )
    for c in configs:
        study.enqueue_trial(c)
    with warnings.catch_warnings():  # a study made here: nothing of an older hydro to check
        warnings.filterwarnings("ignore", "study .* has no definition", HydroWarning)
        result = hydro.tune(
            task,
            e2e.space(args.steps),
            n_trials=len(configs),
            ratio=args.ratio,
            fuse=args.fuse,
            study=study,
            seed=seed,
            first_group=0,
            progress=False,
        )
    trials = sorted(result.study.get_trials(deepcopy=False), key=lambda t: t.number)
    by_key = {key(t.params): t.value if t.value is not None else math.inf for t in trials}
    return [by_key[key(c)] for c in configs]


def run(args: argparse.Namespace) -> None:
    import optuna
    import torch

    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path = Path(args.json)
    saved = json.loads(path.read_text()) if path.exists() else {"config": {}, "runs": {}}
    saved["config"] = {
        k: getattr(args, k)
        for k in (
            "ratio",
            "fuse",
            "width",
            "layers",
            "heads",
            "block",
            "batch",
            "steps",
            "eval_every",
            "chars",
        )
    }
    runs: dict = saved["runs"]

    def add(params: dict, label: str) -> dict:
        params = {k: params[k] for k in HPS}
        entry = runs.setdefault(key(params), {"params": params, "sets": [], "full": {}, "sur": {}})
        if label not in entry["sets"]:
            entry["sets"].append(label)
        return entry

    for params, label, full_loss in choice_configs(args.choices or []):
        entry = add(params, "choice " + label)
        if full_loss is not None:  # the end-to-end check of this choice
            entry.setdefault("e2e_full", {})[label.split(":")[0]] = full_loss
    if "grid" in args.sets or "lr" in args.sets:
        warmups = tuple(int(w) for w in args.warmups.split(","))
        for c in grid_configs(lr_only="grid" not in args.sets, warmups=warmups):
            add(c, "grid")
    if "random" in args.sets:
        for c in random_configs(args.random, args.steps):
            add(c, "random")

    def save() -> None:
        path.write_text(json.dumps(saved, indent=1))

    for s in range(args.sur_seeds):
        todo = [e for e in runs.values() if str(s) not in e["sur"]]
        if todo:
            t0 = time.process_time()
            losses = train_surrogates(args, [e["params"] for e in todo], seed=s)
            for e, v in zip(todo, losses):
                e["sur"][str(s)] = v
            save()
            print(
                f"surrogates, seed {s}: {len(todo)} configurations, "
                f"{time.process_time() - t0:.0f} cpu s",
                flush=True,
            )

    # the choices first (they explain the gap), then the learning-rate x warm-up grid, the
    # random configurations, and the grid's one-at-a-time points
    def priority(e: dict) -> int:
        kinds = {x.split()[0] for x in e["sets"]}
        if "choice" in kinds:
            return 0
        if "grid" in kinds and all(e["params"][h] == CENTRE[h] for h in HPS[1:] if h != "warmup"):
            return 1
        return 2 if "random" in kinds else 3

    entries = sorted(runs.values(), key=priority)
    if args.full_only:  # e.g. a second process: the learning-rate x warm-up grid only
        entries = [e for e in entries if priority(e) == {"choice": 0, "lr": 1}[args.full_only]]
    for s in range(args.first_full_seed, args.full_seeds):
        for e in entries:
            if str(s) in e["full"]:
                continue
            t0 = time.process_time()
            e["full"][str(s)] = e2e.full_model_run(args, e["params"], seed=s)
            save()
            print(
                f"full, seed {s}: {e['params']} -> {e['full'][str(s)]:.4f} "
                f"({time.process_time() - t0:.1f} cpu s, {e2e.uptime()})",
                flush=True,
            )
    report(saved)


# --- the report ---------------------------------------------------------------------------


def spearman(a: list[float], b: list[float]) -> float:
    from hydro.tuning.verification import spearman as rho

    r = rho(a, b)
    return math.nan if r is None else r


def mean(xs: dict) -> float:
    return statistics.fmean(xs.values()) if xs else math.nan


def report(saved: dict) -> None:
    runs = [e for e in saved["runs"].values() if e["full"] and e["sur"]]
    if not runs:
        choices([e for e in saved["runs"].values() if e["sur"]])
        return
    print(f"\n{len(runs)} configurations with both models trained; config {saved['config']}")
    sets = {"all": runs}
    for name in ("grid", "random", "choice"):
        sets[name] = [e for e in runs if any(x.split()[0] == name for x in e["sets"])]
    print(
        "\nSpearman rank correlation of the mean losses, full against surrogate; each model "
        "against itself across seeds (seed 0 against seed 1, over the configurations run with "
        "both, in brackets: the noise ceiling); the two models' seed 0 against each other"
    )
    print(
        f"  {'set':8} {'n':>3} {'full~sur':>9} {'full0~full1':>12} {'sur0~sur1':>12} "
        f"{'sur0~full0':>11}"
    )
    for name, es in sets.items():
        if len(es) < 3:
            continue
        full = [mean(e["full"]) for e in es]
        sur = [mean(e["sur"]) for e in es]

        def pair(model: str, a: str, b: str, es: list = es) -> str:
            both = [e for e in es if a in e[model] and b in e[model]]
            rho = spearman([e[model][a] for e in both], [e[model][b] for e in both])
            return f"{rho:+.3f} ({len(both)})"

        both = [e for e in es if "0" in e["full"] and "0" in e["sur"]]
        cross = spearman([e["full"]["0"] for e in both], [e["sur"]["0"] for e in both])
        print(
            f"  {name:8} {len(es):3d} {spearman(full, sur):+9.3f} "
            f"{pair('full', '0', '1'):>12} {pair('sur', '0', '1'):>12} {cross:+11.3f}"
        )
    print(
        "\nseed-to-seed spread of one configuration's loss (max - min over seeds), median "
        "over configurations (range)"
    )
    for model in ("full", "sur"):
        spreads = [
            max(e[model].values()) - min(e[model].values())
            for e in runs
            if len(e[model]) > 1 and all(math.isfinite(v) for v in e[model].values())
        ]
        if spreads:
            rel = [s / mean(e[model]) for s, e in zip(spreads, runs)]
            print(
                f"  {model:4}: {statistics.median(spreads):.4f} ({min(spreads):.4f} to "
                f"{max(spreads):.4f}); relative {100 * statistics.median(rel):.2f}%"
            )
    rnd = sets["random"] if len(sets["random"]) >= 5 else runs
    print(
        f"\neach hyperparameter's Spearman correlation with the loss ({len(rnd)} "
        f"{'random' if rnd is sets['random'] else 'all'} configurations; + means a larger "
        "value gives a larger loss)"
    )
    print(f"  {'':13}" + "".join(f"{h:>13}" for h in HPS))
    for model in ("full", "sur"):
        ys = [mean(e[model]) for e in rnd]
        cells = [spearman([float(e["params"][h]) for e in rnd], ys) for h in HPS]
        print(f"  {model:13}" + "".join(f"{c:+13.3f}" for c in cells))
    for name, es in (("full's best", rnd), ("surrogate's best", rnd)):
        model = "full" if name.startswith("full") else "sur"
        b = min(es, key=lambda e: mean(e[model]))
        print(
            f"  {name}: {fmt(b['params'])}: full {mean(b['full']):.4f}, surrogate "
            f"{mean(b['sur']):.4f}"
        )
    grid_tables(sets["grid"])
    choices([e for e in saved["runs"].values() if e["sur"]])


def fmt(p: dict) -> str:
    return (
        f"lr {p['lr']:.2e}, wd {p['weight_decay']:.3f}, warm-up {p['warmup']}, dropout "
        f"{p['dropout']:.3f}, beta2 {p['beta2']}"
    )


def grid_tables(es: list[dict]) -> None:
    if not es:
        return
    at = {
        (e["params"]["lr"], e["params"]["warmup"]): e
        for e in es
        if all(e["params"][h] == CENTRE[h] for h in ("weight_decay", "dropout", "beta2"))
    }
    lrs = sorted({lr for lr, _ in at})
    warms = sorted({w for _, w in at})
    for model in ("full", "sur"):
        print(
            f"\n{model}: mean loss, learning rate x warm-up (wd 0.1, dropout 0.1, beta2 0.99); "
            "* = best of each column, ! = best overall"
        )
        print(f"  {'lr':>8}" + "".join(f"{'warm-up ' + str(w):>13}" for w in warms))
        best = {
            w: min((mean(at[lr, w][model]), lr) for lr in lrs if (lr, w) in at)[1] for w in warms
        }
        overall = min((mean(e[model]), k) for k, e in at.items())[1]
        for lr in lrs:
            cells = []
            for w in warms:
                e = at.get((lr, w))
                mark = "!" if (lr, w) == overall else "*" if best[w] == lr else " "
                cells.append(f"{mean(e[model]):12.4f}{mark}" if e else f"{'':13}")
            print(f"  2^{round(math.log2(lr)):<6}" + "".join(cells))
    print("\none at a time at lr 2^-10, warm-up 4 (mean loss): full / surrogate")
    for h in ("weight_decay", "dropout", "beta2"):
        row = sorted(
            (e["params"][h], e)
            for e in es
            if e["params"]["lr"] == CENTRE["lr"]
            and e["params"]["warmup"] == 4
            and all(e["params"][o] == CENTRE[o] for o in HPS if o not in (h, "lr", "warmup"))
        )
        print(
            f"  {h:13}"
            + "".join(f"  {v}: {mean(e['full']):.4f} / {mean(e['sur']):.4f}" for v, e in row)
        )


def choices(runs: list[dict]) -> None:
    """Per repeat: each distinct choice's loss under the surrogate (mean over seeds), the full
    model here (mean over seeds, where run) and the end-to-end check (``e2e``)."""
    by_repeat: dict[str, dict[str, dict]] = {}
    for e in runs:
        for label in e["sets"]:
            if label.startswith("choice "):
                r, m = label.split()[1].split(":")
                by_repeat.setdefault(r, {}).setdefault(key(e["params"]), (e, []))[1].append(m)
    if not by_repeat:
        return
    print(
        "\nthe end-to-end choices: each choice's loss under the surrogate and the full model "
        "(here, and the end-to-end check), and hydro's choice against plain's"
    )
    print(f"  {'repeat':>6} {'method':24} {'surrogate':>9} {'full':>8} {'e2e':>8}  choice")
    for r in sorted(by_repeat, key=int):
        row = sorted(by_repeat[r].values(), key=lambda x: "plain" not in x[1])
        p = row[0][0] if "plain" in row[0][1] else None
        for e, ms in row:
            e2e_full = e.get("e2e_full", {}).get(r, math.nan)
            extra = ""
            if p is not None and e is not p:
                pe = p.get("e2e_full", {}).get(r, math.nan)
                extra = (
                    f"  surrogate {100 * (mean(e['sur']) / mean(p['sur']) - 1):+.2f}%, "
                    f"full {100 * (mean(e['full']) / mean(p['full']) - 1):+.2f}%, "
                    f"e2e {100 * (e2e_full / pe - 1):+.2f}%"
                )
            print(
                f"  {r:>6} {','.join(ms):24} {mean(e['sur']):9.4f} {mean(e['full']):8.4f} "
                f"{e2e_full:8.4f}  {fmt(e['params'])}{extra}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--json",
        default=str(HERE / "results" / "transfer_short.json"),
        help="results, by configuration and seed (read, extended and written back)",
    )
    p.add_argument("--choices", nargs="*", help="end_to_end JSON files whose choices to add")
    p.add_argument(
        "--sets",
        default="grid,random",
        help="grid, lr (the grid's learning-rate x warm-up part only), random (comma-separated)",
    )
    p.add_argument("--warmups", default="0,4,8", help="the grid's warm-ups")
    p.add_argument("--random", type=int, default=24, help="random configurations")
    p.add_argument("--full-seeds", type=int, default=2)
    p.add_argument("--first-full-seed", type=int, default=0)
    p.add_argument(
        "--full-only",
        choices=("choice", "lr"),
        help="train the full model on these configurations only: the end-to-end choices, "
        "or the grid's learning rate x warm-up part",
    )
    p.add_argument("--sur-seeds", type=int, default=3)
    e2e.add_search_args(p, e2e.BUDGETS["short"])
    p.add_argument("--report", help="print a saved JSON's tables only")
    p.add_argument(
        "--full-from",
        nargs="*",
        help="with --report: take the full model's losses of the same configurations from "
        "these files too (e.g. a surrogate-only run at another ratio)",
    )
    args = p.parse_args()
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        for other in args.full_from or []:  # the full model does not depend on the ratio
            runs = json.loads(Path(other).read_text())["runs"]
            for k, e in saved["runs"].items():
                if k in runs:
                    e["full"] = {**runs[k]["full"], **e["full"]}
                    e["e2e_full"] = {**runs[k].get("e2e_full", {}), **e.get("e2e_full", {})}
        return report(saved)
    args.sets = [s for s in args.sets.split(",") if s]
    run(args)


if __name__ == "__main__":
    main()

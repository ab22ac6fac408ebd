"""What the check on the full model costs against the search, and how often it changes the choice.

For each example (``examples/charlm/tune.yaml`` at ``end_to_end.py``'s short budget: 32 steps,
batch 8, evaluation every 8, the first 50,000 characters, its warm-up range scaled to the steps;
``examples/cnn/tune.yaml`` shortened to 60 steps, evaluation every 15, warm-up 0-6) and each
search seed: one ``hydro.tune`` search as the example's config sets it (ratio 4, 16 fused, 32
trials, TPE and the median pruner), then :func:`hydro.tuning.verification.verify` at k = 3 and 5,
with ``verify_steps`` = the task's steps and half of them (``--fractions``). Every part runs in
this process, one after another, on one thread, with Hydro's capture cache off (each search and
each check captures its model afresh, as a first run does); CPU times are
``time.process_time`` around the ``hydro.tune`` call and around each check.

For every check it prints its CPU time as a fraction of its search's, whether its winner differs
from the surrogate's best, and, for a check at the task's full steps, how much better the winner
did on the full model than the surrogate's best (both are among the checked: the surrogate's best
is the first of the top k), in the same runs.

    python benchmarks/verify_cost.py --seeds 0 1 2 --out benchmarks/results/verify_cost.json
    python benchmarks/verify_cost.py --examples charlm --seeds 0 --ks 3   # a quick look
    python benchmarks/verify_cost.py --confirm benchmarks/results/verify_cost.json
    python benchmarks/verify_cost.py --report benchmarks/results/verify_cost.json

``--confirm`` trains the surrogate's best and the check's winner of every charlm search whose
full-length check changed the choice again, by plain PyTorch (``end_to_end.py``'s full-model
run) from new seeds: a judge independent of the seeds the check itself trained with.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SHORT = {"cnn": {"steps": 60, "eval_every": 15, "warmup_high": 6}}


def example_config(name: str) -> dict[str, Any]:
    """The example's ``tune.yaml`` as a dict, shortened as the module's docstring says."""
    import yaml
    from end_to_end import BUDGETS

    raw = yaml.safe_load((ROOT / "examples" / name / "tune.yaml").read_text())
    task = raw["task"]
    if name == "charlm":
        b = BUDGETS["short"]
        task.update(steps=b["steps"], eval_every=b["eval_every"], batch_size=b["batch"])
        task["data_args"] = {**task["data_args"], "max_chars": b["chars"]}
        raw["space"]["warmup"]["high"] = max(1, b["steps"] // 4)  # end_to_end.space(steps)'s
    else:
        s = SHORT[name]
        task.update(steps=s["steps"], eval_every=s["eval_every"])
        raw["space"]["warmup"]["high"] = s["warmup_high"]
    raw.pop("storage", None)
    raw["verify_top_k"] = 0  # the checks below run one by one, each timed
    return raw


def load(name: str, seed: int) -> Any:
    """The example's config (shortened, seeded ``seed``), parsed by ``hydro tune``'s loader."""
    import yaml

    from hydro.tuning import config

    raw = {**example_config(name), "seed": seed}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tune.yaml")
        Path(path).write_text(yaml.safe_dump(raw, sort_keys=False))
        return config.load(path)


def one(name: str, seed: int, ks: list[int], fractions: list[float]) -> dict[str, Any]:
    """One search of example ``name`` from ``seed``, then its checks."""
    import optuna

    from hydro.tuning.run import run
    from hydro.tuning.verification import verify

    cfg = load(name, seed)
    steps = cfg.task.steps
    options = cfg.options(storage=optuna.storages.InMemoryStorage(), progress=False,
                          study=f"{name}-{seed}")
    cpu, wall = time.process_time(), time.perf_counter()
    result = run(cfg.task, cfg.space, options)
    search = {"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall,
              "best": result.best_trial.number, "best_value": result.best_value,
              "states": {s: sum(t["state"] == s for t in result.trials)
                         for s in ("COMPLETE", "PRUNED", "FAIL")},
              "trial_steps": sum(max(t.intermediate_values, default=0)
                                 for t in result.study.trials)}
    print(f"{name} seed {seed}: search {search['cpu']:.1f} cpu s, {search['wall']:.1f} s, "
          f"{search['states']}, {search['trial_steps']} trial-steps, best trial "
          f"{search['best']} ({search['best_value']:.4f})", flush=True)
    checks = []
    budgets = [max(1, round(steps * f)) for f in fractions]
    for k in ks:
        for vs in budgets:
            cpu, wall = time.process_time(), time.perf_counter()
            v = verify(cfg.task, result.study, k, steps=vs, seed=cfg.seed, device=cfg.device)
            c = {"k": k, "steps": vs, "cpu": time.process_time() - cpu,
                 "wall": time.perf_counter() - wall, **v}
            c["fraction"] = c["cpu"] / search["cpu"]
            full = {r["trial"]: r["full_value"] for r in v["configs"]}
            best_full, win_full = full[v["surrogate_best"]], full.get(v["winner"])
            c["gain"] = (None if best_full is None or win_full is None
                         else (best_full - win_full) / best_full)  # > 0: the winner did better
            checks.append(c)
            print(f"  k={k} steps {vs}: {c['cpu']:.1f} cpu s ({c['fraction']:.2f}x the search), "
                  f"winner {v['winner']} (surrogate's best {v['surrogate_best']}), Spearman "
                  f"{v['spearman']}, full values "
                  + ", ".join(f"{r['trial']}: {r['full_value']:.4f}" for r in v["configs"]
                              if r["full_value"] is not None), flush=True)
    return {"example": name, "seed": seed, "steps": steps, "search": search, "checks": checks}


def confirm(rows: list[dict[str, Any]], seeds: int) -> list[dict[str, Any]]:
    """For each search whose full-length check changed the choice (the first such check of a
    search: every k picks among the same runs): the surrogate's best and the check's winner
    trained on the full model again from ``seeds`` new seeds (``end_to_end.py``'s
    ``check_seed``: not the seeds the check trained with), both configurations from the same
    seeds. charlm trains by plain PyTorch (``end_to_end.py``'s ``full_model_run``); cnn by
    Hydro's loop at ratio 1 (``train_group``, one configuration at a time)."""
    from end_to_end import BUDGETS, check_seed, full_model_run

    from hydro.tuning.lockstep import train_group

    b = BUDGETS["short"]
    out = []
    for r in rows:
        done = set()
        for c in r["checks"]:
            if c["agrees"] or c["steps"] != r["steps"] or c["winner"] is None:
                continue
            if (c["surrogate_best"], c["winner"]) in done:
                continue
            done.add((c["surrogate_best"], c["winner"]))
            if r["example"] != "charlm":
                cfg = load(r["example"], r["seed"])
                params = {row["trial"]: row["params"] for row in c["configs"]}
                losses = {who: [train_group(cfg.task, [params[c[who]]], ratio=1,
                                            seeds=[check_seed(s, r["seed"])])[0][0].value
                                for s in range(seeds)]
                          for who in ("surrogate_best", "winner")}
                out.append({"example": r["example"], "seed": r["seed"], "k": c["k"],
                            "surrogate_best": c["surrogate_best"], "winner": c["winner"],
                            "losses": losses})
                print(f"  confirm {r['example']} seed {r['seed']}: {losses}", flush=True)
                continue
            a = argparse.Namespace(block=64, chars=b["chars"], steps=b["steps"],
                                   eval_every=b["eval_every"], batch=b["batch"], layers=4,
                                   heads=4, width=256, device="cpu")
            params = {row["trial"]: row["params"] for row in c["configs"]}
            losses = {}
            for who in ("surrogate_best", "winner"):
                p = {"dropout": 0.0, "warmup": 0, "weight_decay": 0.0, "beta2": 0.999,
                     **params[c[who]]}
                losses[who] = [full_model_run(a, p, seed=check_seed(s, r["seed"]))
                               for s in range(seeds)]
            out.append({"example": "charlm", "seed": r["seed"], "k": c["k"],
                        "surrogate_best": c["surrogate_best"],
                        "winner": c["winner"], "losses": losses})
            m = {w: statistics.fmean(v) for w, v in losses.items()}
            print(f"  confirm seed {r['seed']} k={c['k']}: surrogate's best {c['surrogate_best']} "
                  f"{m['surrogate_best']:.4f}, winner {c['winner']} {m['winner']:.4f} "
                  f"({100 * (m['surrogate_best'] - m['winner']) / m['surrogate_best']:+.2f}% "
                  "better)", flush=True)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """The runs as Markdown: one line per check, then medians per example, k and steps."""
    out = ["| example | seed | search CPU s | k | check steps | check CPU s | check / search "
           "| winner (surrogate's best) | changed | winner vs surrogate's best, full model | "
           "Spearman |", "|---" * 11 + "|"]
    for r in rows:
        for c in r["checks"]:
            gain = "" if c["gain"] is None or c["steps"] != r["steps"] else \
                f"{100 * c['gain']:+.2f}% better" if c["gain"] > 0 else \
                "same run" if c["gain"] == 0 else f"{100 * c['gain']:+.2f}% (worse)"
            rho = "n/a" if c["spearman"] is None else f"{c['spearman']:+.2f}"
            out.append(f"| {r['example']} | {r['seed']} | {r['search']['cpu']:.1f} | {c['k']} | "
                       f"{c['steps']} of {r['steps']} | {c['cpu']:.1f} | {c['fraction']:.2f}x | "
                       f"{c['winner']} ({c['surrogate_best']}) | "
                       f"{'no' if c['agrees'] else 'yes'} | {gain} | {rho} |")
    out += ["", "| example | k | check steps | check / search CPU, median (range) | choice changed "
            "| seeds |", "|---|---|---|---|---|---|"]
    groups: dict[tuple, list] = {}
    for r in rows:
        for c in r["checks"]:
            key = (r["example"], c["k"], f"{c['steps']} of {r['steps']}")
            groups.setdefault(key, []).append((r["seed"], c))
    for (ex, k, st), cs in groups.items():
        fr = [c["fraction"] for _, c in cs]
        changed = sum(not c["agrees"] for _, c in cs)
        out.append(f"| {ex} | {k} | {st} | {statistics.median(fr):.2f}x ({min(fr):.2f}x to "
                   f"{max(fr):.2f}x) | {changed} of {len(cs)} | "
                   f"{', '.join(str(s) for s, _ in cs)} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", nargs="+", default=["charlm", "cnn"], choices=["charlm", "cnn"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--ks", nargs="+", type=int, default=[3, 5])
    p.add_argument("--fractions", nargs="+", type=float, default=[1.0, 0.5],
                   help="the checks' verify_steps as fractions of the task's steps")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="write every run here (JSON), after each search")
    p.add_argument("--report", nargs="+", help="print saved JSON files' tables")
    p.add_argument("--confirm", metavar="FILE", help="train the changed choices of a saved "
                   "charlm run again by plain PyTorch from new seeds, adding them to FILE")
    p.add_argument("--confirm-seeds", type=int, default=2)
    args = p.parse_args()
    if args.report:
        saved = [json.loads(Path(path).read_text()) for path in args.report]
        print(table([r for d in saved for r in d["runs"]]))
        for c in (c for d in saved for c in d.get("confirm", [])):
            m = {w: statistics.fmean(v) for w, v in c["losses"].items()}
            print(f"confirmed, charlm seed {c['seed']} k={c['k']}: surrogate's best "
                  f"{m['surrogate_best']:.4f}, check's winner {m['winner']:.4f} over "
                  f"{len(c['losses']['winner'])} new seeds "
                  f"({100 * (m['surrogate_best'] - m['winner']) / m['surrogate_best']:+.2f}%)")
        return
    if args.confirm:
        import torch

        torch.set_num_threads(args.threads)
        saved = json.loads(Path(args.confirm).read_text())
        saved["confirm"] = confirm(saved["runs"], args.confirm_seeds)
        Path(args.confirm).write_text(json.dumps(saved, indent=1, default=str))
        return
    os.environ["HYDRO_CACHE"] = "0"  # every search and check captures afresh
    import optuna
    import torch

    torch.set_num_threads(args.threads)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    print(f"torch {torch.__version__}, {args.threads} thread(s), load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for name in args.examples:
        for seed in args.seeds:
            rows.append(one(name, seed, args.ks, args.fractions))
            if args.out:
                Path(args.out).write_text(json.dumps({"runs": rows}, indent=1, default=str))
    print()
    print(table(rows))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

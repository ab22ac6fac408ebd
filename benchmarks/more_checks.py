"""More full-model check seeds for the choices saved by ``benchmarks/end_to_end.py``.

At the long budget two check seeds of one configuration can differ by 20%, so a saved run's
gap rests on too few seeds. This trains each saved choice of the given methods on check seeds
``first..first+n-1`` (the benchmark's own are ``0..--check-seeds - 1``, seeded by
``end_to_end.check_seed``), writes every loss to ``--out`` as it goes, and prints each
repeat's gap against plain over all seeds, old and new::

    python benchmarks/more_checks.py --out benchmarks/results/end_to_end_long_checks4.json --runs \\
        plain=benchmarks/results/end_to_end_long_stop28.json:plain \\
        ratio8=benchmarks/results/end_to_end_long_stop28.json:hydro+cache \\
        ratio4=benchmarks/results/end_to_end_long_ratio4.json:hydro+cache

Not a test. ``--repeats`` splits the work across processes (one thread each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
import end_to_end as e2e  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", choices=tuple(e2e.BUDGETS), default="long")
    p.add_argument("--runs", nargs="+", required=True, metavar="LABEL=FILE:METHOD",
                   help="the choices to check, e.g. plain=a.json:plain")
    p.add_argument("--first-seed", type=int, default=2)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--repeats", default=None, help="comma-separated repeats (default: all)")
    p.add_argument("--out", required=True, help="losses by repeat, label and seed (extended)")
    e2e.add_search_args(p)
    args = p.parse_args()
    e2e.fill_budget(args)
    args.device = "cpu"
    import torch

    torch.set_num_threads(1)
    out = Path(args.out)
    saved = json.loads(out.read_text()) if out.exists() else {}
    runs = {}
    for spec in args.runs:
        label, rest = spec.split("=", 1)
        path, method = rest.rsplit(":", 1)
        runs[label] = {
            r["repeat"]: r[method] for r in json.loads(Path(path).read_text())["repeats"]
        }
    wanted = {int(r) for r in args.repeats.split(",")} if args.repeats else None
    for label, rows in runs.items():
        for rep, row in sorted(rows.items()):
            if wanted is not None and rep not in wanted:
                continue
            entry = saved.setdefault(str(rep), {}).setdefault(label, {"params": row["best"]})
            losses = entry.setdefault(
                "losses", {str(i): v for i, v in enumerate(row["full_losses"])}
            )
            for s in range(args.first_seed, args.first_seed + args.seeds):
                if str(s) not in losses:
                    losses[str(s)] = e2e.full_model_run(
                        args, row["best"], seed=e2e.check_seed(s, rep)
                    )
                    out.write_text(json.dumps(saved, indent=1))
                    print(f"repeat {rep} {label} seed {s}: {losses[str(s)]:.4f}", flush=True)
    for rep, entry in sorted(saved.items()):
        base = entry.get("plain")
        for label, e in entry.items():
            mean = statistics.fmean(e["losses"].values())
            gap = ""
            if base is not None and e is not base:
                gap = f", gap {100 * (mean / statistics.fmean(base['losses'].values()) - 1):+.2f}%"
            print(f"repeat {rep} {label}: mean of {len(e['losses'])} seeds {mean:.4f}{gap}")


if __name__ == "__main__":
    main()

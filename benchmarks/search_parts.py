"""Where one ``hydro.tune`` search of ``benchmarks/end_to_end.py`` spends its CPU time.

Runs the benchmark's hydro search (the charlm GPT, short budget unless ``--steps`` says
otherwise) in this process, with process-CPU timers around the tuner's parts: fused training
steps, evaluations, building groups, refilling slots, asking, reporting (and pruning),
telling. A part called inside another counts in the outer one only. ``--root`` imports
``hydro`` (and ``examples``) from another tree, e.g. an export of an older commit, to compare
side by side; run each configuration in its own process, in interleaved rounds::

    python benchmarks/search_parts.py --steps 32
    python benchmarks/search_parts.py --steps 4 --first-group 0 --storage sqlite --root /tmp/old

It is not a test. A warm capture cache (``HYDRO_CACHE_DIR``, filled by a first run) makes
the figures those of the benchmark's ``hydro+cache``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PARTS = {  # (module, class, method) -> label
    ("group", "FusedGroup", "step"): "fused training steps",
    ("group", "FusedGroup", "evaluate"): "evaluations",
    ("stream", None, "start_group"): "building groups",
    ("group", "FusedGroup", "put"): "refilling slots",
    ("group", "FusedGroup", "add"): "growing groups",
    ("stream", "_Stream", "_ask"): "asking trials",  # its method, over bookkeeping.ask
    ("stream", "_InProcess", "report"): "reporting and pruning",
    ("stream", "_Stream", "tell"): "telling",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--first-group", default="auto")
    p.add_argument("--storage", choices=("memory", "sqlite"), default="memory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trials", type=int, default=32)
    p.add_argument("--ratio", type=int, default=8)
    p.add_argument("--chars", type=int, default=50_000, help="text characters (0: all)")
    p.add_argument(
        "--eval-samples",
        type=lambda v: v if v == "auto" else int(v),
        default=None,
        help="validation samples of the intermediate evaluations (Task.eval_samples): a "
        "count or auto",
    )
    p.add_argument("--root", default=str(HERE.parent), help="the tree whose hydro is timed")
    a = p.parse_args()
    sys.path[:0] = [a.root, str(HERE)]
    import end_to_end as e2e
    import optuna
    import torch

    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    depth = [0]

    def timed(f, label):
        @functools.wraps(f)
        def call(*args, **kwargs):
            if depth[0]:
                return f(*args, **kwargs)
            depth[0] += 1
            start = time.process_time()
            try:
                return f(*args, **kwargs)
            finally:
                spent[label] += time.process_time() - start
                calls[label] += 1
                depth[0] -= 1

        return call

    for (mod, cls, name), label in PARTS.items():
        owner = importlib.import_module(f"hydro.tuning.{mod}")
        owner = getattr(owner, cls) if cls else owner
        setattr(owner, name, timed(getattr(owner, name), label))
    args = argparse.Namespace(trials=a.trials, ratio=a.ratio, fuse=16, width=256, layers=4, heads=4,
                              block=64, batch=8, steps=a.steps, eval_every=min(8, a.steps),
                              chars=a.chars or None, threads=1, first_group=a.first_group,
                              seed=a.seed, storage=a.storage, device="cpu",
                              eval_samples=a.eval_samples)
    out = e2e.search_hydro(args, set())
    print(f"hydro from {out['hydro']}: ratio {a.ratio}, {a.steps} steps, first_group "
          f"{a.first_group}, storage {a.storage}, seed {a.seed}, eval_samples "
          f"{a.eval_samples}: {out['cpu']:.2f} CPU s, {out['states']}, "
          f"best {out.get('best_value')}"
          + (f", subsample {out['eval_blocks']} blocks" if out.get("eval_blocks") else ""))
    for label, s in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {label:24s} {s:7.2f} s  {calls[label]:4d} calls")
    print(f"  {'the rest':24s} {out['cpu'] - sum(spent.values()):7.2f} s")


if __name__ == "__main__":
    main()

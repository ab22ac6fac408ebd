"""How far a validation subsample moves trials' values against each other, in one search.

Runs ``benchmarks/end_to_end.py``'s hydro search (the charlm GPT) with every intermediate
evaluation reading the whole split, and at each evaluation of a group of two trials or more
also reads every block of 64 windows in the subsamples' fixed order (``Task.val_blocks``),
keeping each block's mean per trial. Prints, per evaluation: the median block-to-block
variation of a trial's value, the trials' spread, and for a subsample of the first ``k``
blocks Kendall's tau against the whole split's ranking, the offset common to all trials and
the trials' own errors as a fraction of their spread (what ``eval_samples="auto"`` measures,
:mod:`hydro.tuning.eval_sample`), and the size ``auto`` would choose. Not a test::

    python benchmarks/eval_noise.py --steps 32 --trials 16 --ratio 4 --chars 0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--ratio", type=int, default=4)
    p.add_argument("--chars", type=int, default=0, help="text characters (0: all)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    sys.path[:0] = [str(HERE.parent), str(HERE)]
    import end_to_end as e2e
    import optuna
    import torch
    from scipy.stats import kendalltau

    from hydro.tuning import group as group_module
    from hydro.tuning.eval_sample import choose_blocks, prefix_means

    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    seen = []
    evaluate = group_module.FusedGroup.evaluate

    def recording(self, full=None):
        if self.n >= 2:
            seen.append(group_module.block_means(self.task, self.fused, self.device))
        return evaluate(self, full)

    group_module.FusedGroup.evaluate = recording
    args = argparse.Namespace(trials=a.trials, ratio=a.ratio, fuse=16, width=256, layers=4, heads=4,
                              block=64, batch=8, steps=a.steps, eval_every=min(8, a.steps),
                              chars=a.chars or None, threads=1, first_group="auto",
                              seed=a.seed, storage="memory", device="cpu",
                              eval_samples=None)
    e2e.search_hydro(args, set())
    print(f"charlm ratio {a.ratio}, {a.steps} steps, {a.trials} trials; per evaluation of a "
          "group: the first k blocks of 64 windows in the fixed order")
    print("| n | blocks | block cv | spread | k=1: tau, own/spread | k=2 | k=4 | k=8 | auto |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for means, sizes in seen:
        whole = prefix_means(means, sizes, len(sizes))
        cv = float((means.std(0) / means.mean(0).abs()).median())
        cells = []
        for k in (1, 2, 4, 8):
            if k >= len(sizes):
                cells.append("-")
                continue
            error = prefix_means(means, sizes, k) - whole
            own = float((error - error.mean()).pow(2).mean().sqrt()) / float(whole.std())
            tau = kendalltau(prefix_means(means, sizes, k), whole).statistic
            cells.append(f"{tau:.2f}, {own:.2f}")
        print(f"| {means.shape[1]} | {len(sizes)} | {cv:.3f} | "
              f"{float(whole.std() / whole.mean()):.3f} | {' | '.join(cells)} | "
              f"{choose_blocks(means, sizes)} |")


if __name__ == "__main__":
    main()

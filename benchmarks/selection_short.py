"""The noise-aware choice (``replicas``) against the search's best single trial, on the full model.

For each seed: one ``hydro.tune`` of ``benchmarks/end_to_end.py``'s charlm search (short
budget, ratio 4, TPE and the median pruner) with ``replicas=2`` and ``leaders=4``. The search's
best single trial (what the export gives without replicas; the replicas train after the search,
so the search is the same) and the choice made with the seeds' noise are then each trained on
the unmodified full model from ``--check-seeds`` seeds (``end_to_end.full_model_run``). Prints
one row per seed: the replica phase's CPU time as a fraction of the search's, whether the
choice changed, both choices' learning rates and their full-model losses. Not a test::

    python benchmarks/selection_short.py --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--trials", type=int, default=32)
    p.add_argument("--ratio", type=int, default=4)
    p.add_argument("--check-seeds", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the rows here")
    a = p.parse_args()
    sys.path[:0] = [str(HERE.parent), str(HERE)]
    import end_to_end as e2e
    import optuna
    import torch

    import hydro
    from hydro.tuning import run as run_module
    from hydro.tuning.selection import REPLICA_OF

    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    args = argparse.Namespace(budget="short", ratio=a.ratio, fuse=16, width=256, layers=4, heads=4,
                              block=64, batch=None, steps=None, eval_every=None, chars=None,
                              device="cpu")
    e2e.fill_budget(args)
    from examples.charlm.data import load
    from examples.charlm.model import gpt

    data = load(block_size=args.block, max_chars=args.chars)
    spent = {}
    replicate = run_module.replicate

    def timed(*x, **k):
        start = time.process_time()
        try:
            return replicate(*x, **k)
        finally:
            spent["replicas"] = time.process_time() - start

    run_module.replicate = timed
    rows = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        import functools

        task = hydro.Task(model=functools.partial(gpt, **e2e.model_args(args)),
                          train_data=data["train"], val_data=data["val"], loss="cross_entropy",
                          optimizer="adamw", scheduler="cosine", steps=args.steps,
                          eval_every=args.eval_every, batch_size=args.batch)
        start = time.process_time()
        sampler = optuna.samplers.TPESampler(seed=seed, constant_liar=True)
        result = hydro.tune(task, e2e.space(args.steps), n_trials=a.trials, ratio=a.ratio,
                            fuse=16, seed=seed, replicas=2, leaders=4, progress=False,
                            storage=optuna.storages.InMemoryStorage(), sampler=sampler)
        total = time.process_time() - start
        search = [t for t in result.study.get_trials(deepcopy=False)
                  if t.state == optuna.trial.TrialState.COMPLETE
                  and REPLICA_OF not in t.user_attrs]
        single = min(search, key=lambda t: t.value)
        chosen = result.chosen_params
        losses = {}
        for name, params in (("best single trial", dict(single.params)), ("noise-aware", chosen)):
            if name == "noise-aware" and params == dict(single.params):
                losses[name] = losses["best single trial"]
                continue
            losses[name] = statistics.mean(e2e.full_model_run(args, params, e2e.check_seed(s, seed))
                                           for s in range(a.check_seeds))
        row = {"seed": seed, "search_cpu": total - spent["replicas"],
               "replica_cpu": spent["replicas"], "changed": chosen != dict(single.params),
               "single_lr": single.params["lr"], "chosen_lr": chosen["lr"],
               "single_loss": losses["best single trial"], "chosen_loss": losses["noise-aware"],
               "noise": result.selection["noise"], "within": len(result.selection["within"])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| seed | replica CPU / search CPU | choice changed | lr: single -> chosen | "
          "full-model loss: single -> chosen | seed noise | configurations within noise |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['replica_cpu'] / r['search_cpu']:.2f} | {r['changed']} | "
              f"{r['single_lr']:.2e} -> {r['chosen_lr']:.2e} | {r['single_loss']:.4f} -> "
              f"{r['chosen_loss']:.4f} ({(r['chosen_loss'] / r['single_loss'] - 1):+.2%}) | "
              f"{r['noise']:.4f} | {r['within']} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

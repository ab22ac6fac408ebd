"""How full fused groups stay under a pruner: live trials per fused step, out of ``fuse``.

A study of 48 trials (TPE, median pruner, fuse 8) on a small MLP. With continuous batching a
slot freed by pruning takes the next trial at once; before it, a group shrank as its members were
pruned and the next batch waited for its slowest member. Run it on two trees to compare:

    PYTHONPATH=/path/to/old/tree python3 benchmarks/occupancy.py
    PYTHONPATH=$PWD python3 benchmarks/occupancy.py
    PYTHONPATH=$PWD python3 benchmarks/occupancy.py --executor local   # 2 worker processes
    PYTHONPATH=$PWD python3 benchmarks/occupancy.py --executor local --four-keys --trials 24 \
        --fuse 4   # 4 (batch size, width) keys: fifo against dynamic placement
    PYTHONPATH=$PWD python3 benchmarks/occupancy.py --keys 4   # width x batch size: 4 keys

``--keys`` searches the hidden width ({128, 256}, 2 keys) and the batch size ({32, 64}, 4 keys)
besides the optimizer's hyperparameters: trials of different keys cannot share a fused model.
``trial steps/s`` is the training throughput: steps trained by all trials over the wall time;
``trials/fused step`` the mean size of the fused models stepped (in process only).

Where the driver records ``hydro_occupancy`` (continuous batching) that figure is printed;
otherwise it is computed from the trials: steps each trial trained over (steps each group ran
x fuse), and, "while asking", the same over the groups of every batch but the last (a tree
that asks ``fuse x slots`` trials per batch has nothing left to ask during its last batch).
Prints a table and the load average; not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import optuna
import torch
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

import hydro
from hydro.integrations.optuna import optimize
from hydro.tuning.group import FusedGroup


def mlp(width: int = 256) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
        torch.nn.ReLU(), torch.nn.Linear(width, 10),
    )


def make_task(steps: int) -> hydro.Task:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=g)
    y = (
        torch.tanh(x @ torch.randn(32, 32, generator=g)) @ torch.randn(32, 10, generator=g)
    ).argmax(-1)
    return hydro.Task(model=mlp, train_data=(x[:1536], y[:1536]), val_data=(x[1536:], y[1536:]),
                      steps=steps, eval_every=10, batch_size=64)


SPACE = {
    "lr": FloatDistribution(1e-4, 3e-1, log=True),
    "weight_decay": FloatDistribution(0.0, 0.2),
    "warmup": IntDistribution(0, 10),
}


def space(keys: int) -> dict:
    """The search space with 1, 2 (width) or 4 (width x batch size) group keys."""
    out = dict(SPACE)
    if keys >= 2:
        out["width"] = CategoricalDistribution([128, 256])
    if keys == 4:
        out["batch_size"] = CategoricalDistribution([32, 64])
    return out


def post_hoc(study: optuna.Study, fuse: int, steps: int, batch: int | None = None) -> float:
    """Occupancy from the trials alone: each trial's trained steps over its group's lifetime;
    with ``batch`` (trials asked per batch), over the groups of every batch but the last."""
    trained: dict[int, list[int]] = {}
    last = (len(study.trials) - 1) // batch if batch else None
    for t in study.trials:
        if batch and t.user_attrs["group"] // batch == last:
            continue
        if t.state == TrialState.COMPLETE:
            n = steps
        else:
            n = max(t.intermediate_values, default=0)
        trained.setdefault(t.user_attrs["group"], []).append(n)
    return sum(map(sum, trained.values())) / sum(max(v) * fuse for v in trained.values())


def slots_busy(study: optuna.Study, slots: int) -> float:
    """Executor slots' busy time over ``slots`` x the span of the run: each group's span is from
    its first trial's start of training (told time - ``group_seconds``) to its last trial's
    end. The old tree's ``group_seconds`` include building the group, the new tree's do not,
    so this favours the old tree a little."""
    spans: dict[int, list[float]] = {}
    for t in study.trials:
        if t.datetime_complete is None or "group_seconds" not in t.user_attrs:
            continue
        end = t.datetime_complete.timestamp()
        start = end - t.user_attrs["group_seconds"]
        span = spans.setdefault(t.user_attrs["group"], [start, end])
        span[0], span[1] = min(span[0], start), max(span[1], end)
    first = min(s for s, _ in spans.values())
    last = max(e for _, e in spans.values())
    return sum(e - s for s, e in spans.values()) / (slots * (last - first))


def run(seed: int, trials: int, fuse: int, steps: int, executor: str, workers: int,
        keys: int = 1) -> dict:
    task = make_task(steps)
    study = optuna.create_study(
        sampler=optuna.samplers.TPESampler(seed=seed, constant_liar=True),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=fuse, n_warmup_steps=10),
    )
    ex = None
    if executor == "local":
        from hydro_fluid import LocalExecutor

        ex = LocalExecutor(devices=[], num_workers=workers, threads=workers)
    # fused steps taken in this process (in process only: workers step their own groups)
    fused_steps = [0]
    step = FusedGroup.step

    def counted(self: FusedGroup) -> torch.Tensor:
        fused_steps[0] += 1
        return step(self)

    FusedGroup.step = counted
    start = time.perf_counter()
    try:
        optimize(study, task, space(keys), n_trials=trials, ratio=4, fuse=fuse, seed=seed,
                 executor=ex)
    finally:
        FusedGroup.step = step
    seconds = time.perf_counter() - start
    occ = study.user_attrs.get("hydro_occupancy")
    pruned = sum(t.state == TrialState.PRUNED for t in study.trials)
    slots = workers if ex is not None else 1
    return {
        "seconds": seconds,
        "pruned": pruned,
        "overall": occ["overall"] if occ else post_hoc(study, fuse, steps),
        "while_asking": occ["while_asking"] if occ else post_hoc(study, fuse, steps, fuse * slots),
        "recorded": bool(occ),
        "groups": len({t.user_attrs["group"] for t in study.trials}),
        # in process, groups of several keys take turns: their spans overlap, busy is moot
        "slots_busy": slots_busy(study, slots) if ex is not None else None,
        "keys": len({(t.params.get("width"), t.params.get("batch_size")) for t in study.trials}),
        "steps_per_s": occ["live"] / seconds if occ else None,
        # trials per fused step: below the live/fuse figure where several keys' groups share
        # the slots (each group is a fused step of its own)
        "per_step": occ["live"] / fused_steps[0] if occ and ex is None else None,
        "best": study.best_value,
    }


# --- executor rows: 4 (batch size, width) keys on LocalExecutor, per placement policy ----------


FOUR_KEYS = {**SPACE, "width": CategoricalDistribution([128, 256]),
             "batch_size": CategoricalDistribution([16, 32])}


def device_occupancy(study: optuna.Study, devices: int, fuse: int) -> float:
    """Trials training per device, out of ``fuse``, while trials remained to ask: each trial's
    time in its group (``group_seconds`` before it was told), summed over the window from the
    first trial's start to the last ask, over ``devices x fuse x`` that window. Several groups
    packed on one device count together, so a device whose group thinned out and took a group
    of another key beside it counts as full again."""
    done = [t for t in study.trials if t.datetime_complete and "group_seconds" in t.user_attrs]
    first = min(t.datetime_complete.timestamp() - t.user_attrs["group_seconds"] for t in done)
    last_ask = max(t.datetime_start.timestamp() for t in study.trials)
    busy = 0.0
    for t in done:
        end = t.datetime_complete.timestamp()
        start = end - t.user_attrs["group_seconds"]
        busy += max(0.0, min(end, last_ask) - max(start, first))
    return busy / (devices * fuse * (last_ask - first))


def executor_rows(seed: int, trials: int, fuse: int, steps: int, workers: int) -> list[dict]:
    """The 4-key study (width {128, 256} x batch size {16, 32}, TPE, median pruner) on
    LocalExecutor under fifo (one group per device, the fixed pool) and dynamic (a device
    whose group thinned out takes a group of another key, sized for the room left)."""
    from hydro_fluid import LocalExecutor, TrialGroup

    task = dataclasses.replace(make_task(steps), model=mlp)  # a factory: width is searched
    # the first run of a process starts the fork server (imports torch): not fifo's time
    from hydro_fluid.executors.examples import count_steps

    LocalExecutor(devices=[], num_workers=1).run(
        [TrialGroup("warm-up", (0,), (1,))], count_steps,
        preload=["hydro.tuning.slots", "torch.export._trace"],  # what the tuner preloads
    )
    rows = []
    for policy in ("fifo", "dynamic"):
        study = optuna.create_study(
            sampler=optuna.samplers.TPESampler(seed=seed, constant_liar=True),
            pruner=optuna.pruners.MedianPruner(n_startup_trials=fuse, n_warmup_steps=10),
        )
        ex = LocalExecutor(devices=[], num_workers=workers, threads=workers)
        start = time.perf_counter()
        optimize(study, task, FOUR_KEYS, n_trials=trials, ratio=4, fuse=fuse, seed=seed,
                 executor=ex, policy=policy)
        occ = study.user_attrs.get("hydro_occupancy") or {}
        rows.append({
            "policy": policy, "seconds": time.perf_counter() - start,
            "groups": len({t.user_attrs["group"] for t in study.trials}),
            "live_per_group": occ.get("while_asking"),
            "device": device_occupancy(study, workers, fuse), "best": study.best_value,
        })
    return rows


def print_executor_rows(a: argparse.Namespace) -> None:
    load = os.getloadavg()[0]
    rows = [r for seed in range(a.first_seed, a.first_seed + a.repeats)
            for r in executor_rows(seed, a.trials, a.fuse, a.steps, a.workers)]
    print(f"4 keys (width {{128, 256}} x batch {{16, 32}}), {a.trials} trials, fuse {a.fuse}, "
          f"{a.steps} steps, TPE, median pruner, LocalExecutor {a.workers} workers; load "
          f"average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    print("| policy | groups | live/fuse per group (while asking) | trials per device / fuse "
          "(while asking) | seconds | best |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        live = "-" if r["live_per_group"] is None else f"{r['live_per_group']:.1%}"
        print(f"| {r['policy']} | {r['groups']} | {live} | {r['device']:.1%} | "
              f"{r['seconds']:.1f} | {r['best']:.4f} |")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _num(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=48)
    p.add_argument("--fuse", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--executor", choices=["inline", "local"], default="inline",
                   help="inline: groups in this process; local: LocalExecutor workers")
    p.add_argument("--first-seed", type=int, default=0, help="seeds first-seed, +1, ...")
    p.add_argument("--workers", type=int, default=2, help="worker slots with --executor local")
    p.add_argument("--four-keys", action="store_true", help="with --executor local: the 4-key "
                   "study under the fifo and dynamic placement policies")
    p.add_argument("--keys", type=int, nargs="+", choices=[1, 2, 4], default=[1],
                   help="(batch size, architecture) keys in the space: 1, 2 or 4")
    a = p.parse_args()
    if a.four_keys:
        if a.executor != "local":
            p.error("--four-keys measures the executor rows: add --executor local")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        torch.set_num_threads(1)
        print_executor_rows(a)
        return
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    seeds = range(a.first_seed, a.first_seed + a.repeats)
    rows = {k: [run(seed, a.trials, a.fuse, a.steps, a.executor, a.workers, k) for seed in seeds]
            for k in a.keys}
    where = "in process" if a.executor == "inline" else f"LocalExecutor, {a.workers} workers"
    print(f"{a.trials} trials, fuse {a.fuse}, {a.steps} steps, median pruner, TPE, {where}; "
          f"hydro from {hydro.__file__}; load average {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    print("| keys | seed | pruned | groups | live/fuse (all steps) | live/fuse (while asking) "
          "| slots busy | trials/fused step | trial steps/s | seconds | best |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for runs in rows.values():
        for seed, r in zip(seeds, runs):
            how = "" if r["recorded"] else " (from trials)"
            rate = _num(r["steps_per_s"], 0)
            print(f"| {r['keys']} | {seed} | {r['pruned']} | {r['groups']} | "
                  f"{r['overall']:.1%}{how} | {r['while_asking']:.1%}{how} | "
                  f"{_pct(r['slots_busy'])} | {_num(r['per_step'], 2)} | {rate} | "
                  f"{r['seconds']:.1f} | "
                  f"{r['best']:.4f} |")
    for k, runs in rows.items():
        names = ("overall", "while_asking", "slots_busy", "per_step", "steps_per_s", "seconds")
        med = {name: statistics.median(r[name] for r in runs)
               if all(r[name] is not None for r in runs) else None for name in names}
        print(f"{k} key(s), medians of {len(runs)}: live/fuse {_pct(med['overall'])}, while "
              f"asking {_pct(med['while_asking'])}, slots busy {_pct(med['slots_busy'])}, "
              f"trials/fused step {_num(med['per_step'], 2)}, trial steps/s "
              f"{_num(med['steps_per_s'], 0)}, seconds {med['seconds']:.1f}")


if __name__ == "__main__":
    main()

"""Continuous batching on executors: one group per free slot with no batch barrier, slots of a
worker's group refilled from the driver's sampler, results that depend only on a trial's
parameters and seed, and no trial lost when a worker is killed. Real worker processes, a real
local Ray, real Optuna."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from hydro.integrations.optuna import optimize
from hydro.tuning.lockstep import train_group
from hydro_fluid import LocalExecutor, TrialGroup
from tests.tuning.test_continuous_batching import make_task

optuna.logging.set_verbosity(optuna.logging.WARNING)
ROOT = Path(__file__).resolve().parents[2]
SPACE = {"lr": FloatDistribution(1e-3, 3e-1, log=True), "warmup": IntDistribution(0, 3)}


def assert_alone(study: optuna.Study, task, seed: int, numbers=None) -> None:
    """Complete trials (``numbers``, or all) equal those trials trained alone in this process:
    float64, so equal to the last bits the fused arithmetic leaves."""
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE
                and (numbers is None or t.number in numbers)]
    assert complete
    for t in complete:
        (alone,), _ = train_group(task, [t.params], ratio=2, seeds=[seed + t.number])
        assert alone.value == pytest.approx(t.value, rel=1e-12, abs=0)
        assert {s: v for s, v in alone.history} == pytest.approx(t.intermediate_values, rel=1e-12)


def test_local_workers_refill_their_groups_from_the_driver(capsys):
    task = make_task(steps=8)
    study = optuna.create_study(
        sampler=optuna.samplers.TPESampler(seed=0),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=0),
    )
    ex = LocalExecutor(devices=[], num_workers=2)
    # fifo: one group per slot for good (dynamic may move the last group to widen it)
    optimize(study, task, SPACE, n_trials=10, ratio=2, fuse=2, seed=5, executor=ex,
             policy="fifo", progress=True)
    # progress from the workers' evaluations: trial-steps advance before any trial ends
    lines = [line for line in capsys.readouterr().err.splitlines()
             if line.startswith("trial-steps ")]
    early = {int(line.split()[1].split("/")[0]) for line in lines if ", trials 0/10," in line}
    assert len(early - {0}) >= 2 and lines[-1].startswith("trial-steps 80/80 (100%), trials 10/")
    trials = study.trials
    assert len(trials) == 10 and all(t.state.is_finished() for t in trials)
    assert any(t.state == TrialState.PRUNED for t in trials)
    groups: dict[int, list] = {}
    for t in trials:
        groups.setdefault(t.user_attrs["group"], []).append(t)
    # one group per slot, trained in its own worker; the 10 trials went through 2 x 2 slots
    assert len(groups) == 2
    assert all(len({t.user_attrs["worker_pid"] for t in g}) == 1 for g in groups.values())
    assert os.getpid() not in {t.user_attrs["worker_pid"] for t in trials}
    assert sum(len(g) for g in groups.values()) > 2 * 2
    assert all({t.user_attrs["slot"] for t in g} == {0, 1} for g in groups.values())
    occ = study.user_attrs["hydro_occupancy"]
    assert occ["fuse"] == 2 and occ["while_asking"] == 1.0 and occ["steps_asking"] > 0
    # a trial's result is its parameters and seed, whichever worker, group or slot trained it
    late = [t.number for t in trials if t.state == TrialState.COMPLETE and t.number >= 4]
    assert_alone(study, task, seed=5, numbers={0, *late[:2]})


class PruneSmallBatches(optuna.pruners.BasePruner):
    """Prunes every trial with batch size 16 at its first report: a pruner whose answer is
    known, so which group ends first is too."""

    def prune(self, study, trial):
        return trial.params["batch_size"] == 16


def test_a_freed_executor_slot_takes_a_new_group_while_the_other_still_trains():
    """Trials 0-1 (batch 16) are pruned at step 2; their group asks for trials 4-5, which need
    a group of their own (batch 64), and ends. Its slot starts that group at once, while the
    group of trials 2-3 (batch 32) trains on: no barrier between the groups of the two slots."""
    # long enough that the other slot's group outlasts a new worker's start and capture (a few
    # seconds on a loaded 2-core machine): the test asks about barriers, not startup latency
    task = make_task(steps=600, eval_every=2)
    space = {**SPACE, "batch_size": CategoricalDistribution([16, 32, 64])}
    study = optuna.create_study(pruner=PruneSmallBatches())
    for bs in (16, 16, 32, 32, 64, 64):
        study.enqueue_trial({"lr": 1e-2, "warmup": 0, "batch_size": bs})
    ex = LocalExecutor(devices=[], num_workers=2)
    optimize(study, task, space, n_trials=6, ratio=2, fuse=2, seed=1, executor=ex)
    t = study.trials
    assert [x.state.name for x in t] == ["PRUNED"] * 2 + ["COMPLETE"] * 4
    assert [x.user_attrs["group"] for x in t] == [0, 0, 2, 2, 4, 4]

    def trained(x: optuna.trial.FrozenTrial) -> tuple[float, float]:
        end = x.datetime_complete.timestamp()
        return end - x.user_attrs["group_seconds"], end

    started_4 = min(trained(x)[0] for x in t[4:])
    ended_2 = max(trained(x)[1] for x in t[2:4])
    assert started_4 < ended_2 - 0.05, (started_4, ended_2)
    assert_alone(study, task, seed=1, numbers={4})


def sleeper(group: TrialGroup, ctx) -> float:
    """Asks the parent how long to train, then trains that long."""
    seconds = ctx.request(("how long", list(group.trial_ids)))
    time.sleep(seconds)
    return seconds


def test_executor_streams_groups_and_answers_requests():
    """The executor's streaming API alone: ``more`` is asked whenever a slot is free, each
    group's result arrives as it ends, and ``ctx.request`` gets the parent's answer."""
    pending = [TrialGroup("long", (0,), (1,))] + [TrialGroup(f"short{i}", (i,), (1,))
                                                  for i in range(1, 4)]
    ended: list[str] = []
    asked: list[tuple] = []

    def more() -> list[TrialGroup]:
        return [pending.pop(0)] if pending else []

    def answer(name: str, payload: tuple) -> float:
        asked.append((name, payload))
        return 4.0 if name == "long" else 0.05

    results = LocalExecutor(devices=[], num_workers=2).run(
        [], sleeper, more=more, on_result=lambda r: ended.append(r.group.name), request=answer
    )
    assert ended[-1] == "long" and sorted(ended[:-1]) == ["short1", "short2", "short3"]
    assert [r.value for r in results] == [4.0, 0.05, 0.05, 0.05]
    assert sorted(asked) == [("long", ("how long", [0]))] + [
        (f"short{i}", ("how long", [i])) for i in range(1, 4)
    ]


def test_killed_worker_loses_no_trial_and_refilled_slots_resume(tmp_path):
    """A worker SIGKILLed after its group refilled slots (step 12) and checkpointed (step 16)
    is retried from the checkpoint; the 5 trials end as they would alone."""
    from tests.tuner_child import SPACE as LR_WD
    from tests.tuner_child import make_task as killing_task

    marker = tmp_path / "killed"
    task = killing_task(12, 18, str(marker))
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    ex = LocalExecutor(devices=[], num_workers=1, max_retries=1)
    optimize(study, task, LR_WD, n_trials=5, ratio=2, fuse=2, executor=ex, checkpoint_every=4)
    assert marker.exists()  # a worker really was SIGKILLed
    assert [x.state.name for x in study.trials] == ["COMPLETE"] * 5
    assert len({x.user_attrs["group"] for x in study.trials}) == 1  # trials 2-4 were refills
    plain = killing_task(12)
    for x in study.trials[2:]:  # the refilled ones
        (alone,), _ = train_group(plain, [x.params], ratio=2, seeds=[x.number])
        assert alone.value == pytest.approx(x.value, rel=1e-6)


def test_ray_workers_refill_their_groups():
    ray = pytest.importorskip("ray")
    from hydro_fluid import RayExecutor
    from hydro_fluid.executors.ray import _init_ray

    path = os.pathsep.join([str(ROOT), *sys.path])
    _init_ray(ray, None, {"num_cpus": 2, "log_to_driver": False,  # a new Ray, on 127.0.0.1
                          "runtime_env": {"env_vars": {"PYTHONPATH": path}}})
    ex = None
    try:
        ex = RayExecutor()
        assert len(ex.slots) == 2
        task = make_task(steps=8)
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        optimize(study, task, SPACE, n_trials=6, ratio=2, fuse=2, seed=3, executor=ex)
        trials = study.trials
        assert [t.state for t in trials] == [TrialState.COMPLETE] * 6
        groups = {t.user_attrs["group"] for t in trials}
        assert len(groups) == 2  # both slots' groups took the other trials in freed slots
        assert os.getpid() not in {t.user_attrs["worker_pid"] for t in trials}
        assert study.user_attrs["hydro_occupancy"]["while_asking"] == 1.0
        assert_alone(study, task, seed=3, numbers={4, 5})
    finally:
        if ex is not None:
            ex.shutdown()
        ray.shutdown()

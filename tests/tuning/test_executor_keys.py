"""Several (batch size, architecture) keys on an executor: a worker hosts one fused group per
key, a freed slot takes the driver's next trial whatever its key, and every trial still ends
exactly as it would alone, also after its worker was SIGKILLed. Real worker processes, real
Optuna, real fused training."""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from hydro.integrations.optuna import optimize
from hydro.tuning.lockstep import train_group
from hydro_fluid import LocalExecutor
from tests.tuning.test_several_keys import FOUR_KEYS, SPACE, keyed_task, study_of

optuna.logging.set_verbosity(optuna.logging.WARNING)


def assert_alone(study: optuna.Study, task, seed: int) -> None:
    """Every complete trial equals that trial trained alone here (float64: to the last bits)."""
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert complete
    for t in complete:
        (alone,), _ = train_group(task, [t.params], ratio=2, seeds=[seed + t.number])
        assert alone.value == pytest.approx(t.value, rel=1e-12, abs=0)
        assert {s: v for s, v in alone.history} == pytest.approx(t.intermediate_values, rel=1e-12)


@pytest.mark.parametrize("policy", ["fifo", "dynamic"])
def test_four_keys_keep_each_workers_slots_busy(policy):
    """24 trials over width {16, 32} x batch size {8, 16}, fuse 4, two workers: each worker
    hosts the groups of several keys, so its slots stay busy while trials remain to ask
    (about 0.5 when a freed slot could take only its own key's trials)."""
    task = keyed_task()
    study = study_of()
    ex = LocalExecutor(devices=[], num_workers=2)
    optimize(study, task, FOUR_KEYS, n_trials=24, ratio=2, fuse=4, seed=5, executor=ex,
             policy=policy)
    trials = study.trials
    assert len(trials) == 24 and all(t.state.is_finished() for t in trials)
    assert len({(t.params["width"], t.params["batch_size"]) for t in trials}) == 4
    occ = study.user_attrs["hydro_occupancy"]
    assert occ["fuse"] == 4 and occ["steps_asking"] > 0
    # fifo keeps the target (0.85) even here; under dynamic a packed worker's capacity is its
    # room, and on a loaded 2-core machine its share of rounds varies (0.83 seen, 1.0 alone):
    # benchmarks/occupancy.py measures the target quietly, this asserts well above 0.5
    assert (0.85 if policy == "fifo" else 0.75) <= occ["while_asking"] <= 1.0
    # a worker hosted several keys, each fused group holds one
    by_worker: dict[int, set] = {}
    by_group: dict[int, set] = {}
    for t in trials:
        key = (t.params["width"], t.params["batch_size"])
        by_worker.setdefault(t.user_attrs["worker_pid"], set()).add(key)
        by_group.setdefault(t.user_attrs["group"], set()).add(key)
    assert any(len(keys) > 1 for keys in by_worker.values())
    assert all(len(keys) == 1 for keys in by_group.values())
    assert_alone(study, task, seed=5)


def test_a_killed_worker_with_two_keys_resumes_as_if_uninterrupted(tmp_path):
    """Fuse 2, batch sizes 16, 32, 32, 16, 32, 16: trial 0's group finds no second trial of
    its key, so its worker fills its other slot with trial 1 (batch 32) in a group of its own:
    two keys' groups live side by side. The worker is SIGKILLed at its 18th training step
    (round 9 of 12; checkpoints every 4 rounds), retried from its checkpoint, and every trial
    ends exactly as in the same study run without the kill."""
    from tests.tuner_child import make_task as killing_task

    space = {**SPACE, "batch_size": CategoricalDistribution([16, 32])}

    def run(task):
        study = optuna.create_study(pruner=optuna.pruners.NopPruner())
        for i, bs in enumerate((16, 32, 32, 16, 32, 16)):
            study.enqueue_trial({"lr": 0.01 * (i + 1), "warmup": i % 3, "batch_size": bs})
        ex = LocalExecutor(devices=[], num_workers=1, max_retries=1)
        # fifo: one worker, never a packed second group, so both runs place alike
        optimize(study, task, space, n_trials=6, ratio=2, fuse=2, seed=0, executor=ex,
                 checkpoint_every=4, policy="fifo")
        return study

    marker = tmp_path / "killed"
    killed = run(killing_task(12, 18, str(marker), eval_every=4))
    assert marker.exists()  # a worker really was SIGKILLed
    plain = run(killing_task(12, eval_every=4))
    assert [t.state.name for t in killed.trials] == ["COMPLETE"] * 6
    # trials 0 and 1 trained side by side in one worker, in the groups of their two keys
    assert [t.user_attrs["group"] for t in killed.trials[:2]] == [0, 1]
    for a, b in zip(killed.trials, plain.trials):
        assert a.params == b.params
        assert a.user_attrs["group"] == b.user_attrs["group"]
        assert a.value == b.value
        assert a.intermediate_values == b.intermediate_values

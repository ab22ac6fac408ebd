"""Several (batch size, architecture) keys in one process: the groups of all keys share
``fuse`` slots, a slot freed in one group goes to the next trial whatever its key, and every
trial still ends exactly as it would alone. Real Optuna studies, real fused training."""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

import hydro
from hydro.integrations.optuna import optimize
from hydro.tuning.group import FusedGroup
from hydro.tuning.lockstep import train_group
from hydro_fluid import LocalExecutor
from tests.tuning.test_continuous_batching import _mlp, make_task

optuna.logging.set_verbosity(optuna.logging.WARNING)

SPACE = {"lr": FloatDistribution(1e-3, 3e-1, log=True), "warmup": IntDistribution(0, 3)}
FOUR_KEYS = {**SPACE, "width": CategoricalDistribution([16, 32]),
             "batch_size": CategoricalDistribution([8, 16])}


def keyed_task(steps: int = 12) -> hydro.Task:
    """The float64 MLP of ``test_continuous`` with its width a factory argument."""
    base = make_task(steps=steps)
    return hydro.Task(model=_mlp, train_data=base.train_data, val_data=base.val_data,
                      steps=steps, eval_every=4, batch_size=16)


def study_of(seed: int = 0) -> optuna.Study:
    return optuna.create_study(
        sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=0),
    )


def trials_of(study: optuna.Study) -> list[tuple]:
    return [(t.number, t.state.name, t.params) for t in study.trials]


def test_one_key_in_process_trains_what_one_worker_trains():
    """With one key the in-process rounds are the loop the executors run (unchanged): the same
    trials are asked in the same order, pruned at the same steps, and end with the same values
    as in a worker, in one group whose slots are always full while trials remain to ask."""
    task = make_task(steps=8)
    inline = study_of()
    optimize(inline, task, SPACE, n_trials=10, ratio=2, fuse=3, seed=5)
    worker = study_of()
    optimize(worker, task, SPACE, n_trials=10, ratio=2, fuse=3, seed=5,
             executor=LocalExecutor(devices=[], num_workers=1, threads=1))
    assert trials_of(inline) == trials_of(worker)
    assert any(t.state == TrialState.PRUNED for t in inline.trials)
    for a, b in zip(inline.trials, worker.trials):
        assert a.intermediate_values.keys() == b.intermediate_values.keys()
        assert list(a.intermediate_values.values()) == pytest.approx(
            list(b.intermediate_values.values()), rel=1e-12)
        assert a.user_attrs["group"] == b.user_attrs["group"] == 0
        assert a.user_attrs["slot"] == b.user_attrs["slot"]
    assert inline.user_attrs["hydro_occupancy"] == worker.user_attrs["hydro_occupancy"]
    assert inline.user_attrs["hydro_occupancy"]["while_asking"] == 1.0


def test_four_keys_keep_the_slots_busy_and_each_trial_exact(monkeypatch):
    """24 trials over width {16, 32} x batch size {8, 16}, fuse 4: a slot freed in one key's
    group takes the next trial of any key (it joins its own key's group, grown or started), so
    the slots stay busy while trials remain to ask (0.5 when a freed slot could take only its
    own key). Every trial, whichever group it joined and however that group grew and shrank,
    ends exactly as it would alone."""
    grown = []  # trials that joined a running group in a new slot (FusedGroup.add)
    add = FusedGroup.add

    def counting_add(self, number, *args):
        grown.append(number)
        return add(self, number, *args)

    monkeypatch.setattr(FusedGroup, "add", counting_add)
    task = keyed_task()
    study = study_of()
    optimize(study, task, FOUR_KEYS, n_trials=24, ratio=2, fuse=4, seed=5)
    trials = study.trials
    assert len(trials) == 24 and all(t.state.is_finished() for t in trials)
    assert any(t.state == TrialState.PRUNED for t in trials)
    keys = {(t.params["width"], t.params["batch_size"]) for t in trials}
    assert len(keys) == 4
    occ = study.user_attrs["hydro_occupancy"]
    assert occ["fuse"] == 4
    assert 0.85 <= occ["while_asking"] <= 1.0
    groups: dict[int, list] = {}
    for t in trials:
        groups.setdefault(t.user_attrs["group"], []).append(t)
    assert all(len({(t.params["width"], t.params["batch_size"]) for t in g}) == 1
               for g in groups.values())
    assert grown, "some trial should join a running group of its key in a new slot"
    # each key's trials trained side by side in one group from step 0, never refilled: each
    # member there ends as it would alone (test_continuous), so this is every trial alone
    for key in keys:
        mine = [t for t in trials if (t.params["width"], t.params["batch_size"]) == key]
        alone, _ = train_group(task, [t.params for t in mine], ratio=2,
                               seeds=[5 + t.number for t in mine])
        for t, ref in zip(mine, alone):
            seen = t.intermediate_values
            assert {s: v for s, v in ref.history if s in seen} == pytest.approx(seen, rel=1e-12)
            if t.state == TrialState.COMPLETE:
                assert ref.value == pytest.approx(t.value, rel=1e-12, abs=0)
                assert max(seen) == task.steps


def test_a_first_group_of_several_keys_trains_to_the_end_before_any_other_trial():
    """``first_group=3`` with two keys: the first 3 trials (whatever their keys) train to the
    end, one group per key, before trial 3 is asked; then all slots are shared."""
    task = keyed_task(steps=8)
    space = {**SPACE, "width": CategoricalDistribution([16, 32])}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3),
                                pruner=optuna.pruners.NopPruner())
    optimize(study, task, space, n_trials=8, ratio=2, fuse=4, first_group=3)
    trials = sorted(study.trials, key=lambda t: t.number)
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert len({t.params["width"] for t in trials[:3]}) == 2  # two keys among the first three
    done = max(t.datetime_complete for t in trials[:3])
    assert all(t.datetime_start >= done for t in trials[3:])
    first_groups = {t.user_attrs["group"] for t in trials[:3]}
    assert not first_groups & {t.user_attrs["group"] for t in trials[3:]}


def test_an_error_in_one_group_leaves_no_trial_of_any_group_running():
    """A pruner that raises while groups of two keys train (and trials wait to join): every
    asked trial is told FAIL with the reason, none stays RUNNING."""

    class Exploding(optuna.pruners.BasePruner):
        def prune(self, study, trial):
            if trial.number >= 5:
                raise RuntimeError("pruner broke")
            return False

    task = keyed_task(steps=8)
    space = {**SPACE, "width": CategoricalDistribution([16, 32])}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), pruner=Exploding())
    with pytest.raises(RuntimeError, match="pruner broke"):
        optimize(study, task, space, n_trials=12, ratio=2, fuse=4, seed=1)
    states = [t.state for t in study.trials]
    assert TrialState.RUNNING not in states and TrialState.FAIL in states
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    assert all(t.user_attrs["fail_reason"] == "RuntimeError: pruner broke" for t in failed)
    assert len({t.params["width"] for t in failed}) == 2  # groups of both keys were live


def test_a_new_group_of_a_key_reuses_the_last_capture_and_trains_the_same():
    """``FusedGroup(like=earlier)``: a key's next group takes the earlier group's capture (no
    new ``torch.export``) and its trials train exactly as in a group captured afresh; another
    key or ratio captures afresh."""
    from tests.tuning.test_continuous_batching import assert_same, trajectory

    task = keyed_task()
    a, b = {"lr": 3e-2, "warmup": 2, "width": 32}, {"lr": 1e-2, "width": 32}
    first = FusedGroup(task, [(0, a, 10)], ratio=2)
    first.drop([0])  # emptied: its capture still serves the key's next group
    again = FusedGroup(task, [(1, b, 11)], ratio=2, like=first)
    assert again.builder is first.builder
    fresh = FusedGroup(task, [(1, b, 11)], ratio=2)
    assert fresh.builder is not first.builder
    assert_same(trajectory(again, 0, task.steps), trajectory(fresh, 0, task.steps))
    other = FusedGroup(task, [(2, {**b, "width": 16}, 12)], ratio=2, like=first)
    assert other.builder is not first.builder
    coarser = FusedGroup(task, [(3, b, 13)], ratio=4, like=first)
    assert coarser.builder is not first.builder

"""Data parallel fused groups: a group trained by two real worker processes joined with gloo
equals the same group on one process, through the tuner (refills, a pruned member), at the
fused group itself (every parameter), and across a restart from a checkpoint written at the
other world size. float64 throughout, so "equal" means to the rounding of the averaged sum."""

from __future__ import annotations

import functools

import optuna
import pytest
import torch
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState

import hydro
from hydro.errors import ConfigError, HydroWarning
from hydro.integrations.optuna import optimize
from hydro.tuning.group import FusedGroup
from hydro.tuning.lockstep import train_group
from hydro.tuning.options import TuneOptions
from hydro.tuning.slots import _stream_in_worker
from hydro_fluid import LocalExecutor, TrialGroup
from tests.tuning.test_continuous_batching import make_task

optuna.logging.set_verbosity(optuna.logging.WARNING)
pytestmark = pytest.mark.filterwarnings("ignore:ratio 2 takes")  # the tiny MLP is below the floor
SPACE = {"lr": FloatDistribution(1e-3, 3e-1, log=True)}
TOL = {"rel": 1e-12, "abs": 1e-12}


class PruneTrialOne(optuna.pruners.BasePruner):
    """Prunes trial 1 at its first report: a pruner whose answer does not depend on timing."""

    def prune(self, study, trial):
        return trial.number == 1


def run_study(world_size: int, space: dict, n_trials: int, workers: int) -> optuna.Study:
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0),
                                pruner=PruneTrialOne())
    ex = LocalExecutor(devices=[], num_workers=workers, threads=workers)  # 1 thread per worker
    optimize(study, make_task(steps=8), space, n_trials=n_trials, ratio=2, fuse=2, seed=3,
             executor=ex, world_size=world_size)
    return study


def test_two_rank_groups_through_the_tuner_equal_one_rank_groups():
    """5 trials through groups of 2 (refills), trial 1 pruned: every trial's intermediate and
    final values at world size 2 equal those at world size 1."""
    one = run_study(1, SPACE, 5, workers=1)
    two = run_study(2, SPACE, 5, workers=2)
    assert len(two.trials) == 5
    assert {t.user_attrs["world_size"] for t in two.trials} == {2}
    assert {t.user_attrs["world_size"] for t in one.trials} == {1}
    assert two.trials[1].state == TrialState.PRUNED
    assert sum(t.state == TrialState.COMPLETE for t in two.trials) == 4
    for a, b in zip(one.trials, two.trials):
        assert (a.number, a.state, a.params) == (b.number, b.state, b.params)
        assert a.intermediate_values.keys() == b.intermediate_values.keys()
        assert list(b.intermediate_values.values()) == pytest.approx(
            list(a.intermediate_values.values()), **TOL)
        if a.state == TrialState.COMPLETE:
            assert b.value == pytest.approx(a.value, **TOL)


def test_a_batch_that_cannot_be_split_trains_its_group_on_one_slot():
    space = {**SPACE, "batch_size": CategoricalDistribution([15])}
    with pytest.warns(HydroWarning, match="batch size 15 does not divide by world_size 2"):
        study = run_study(2, space, 2, workers=2)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.PRUNED]
    assert {t.user_attrs["world_size"] for t in study.trials} == {1}


# -- the fused group itself --------------------------------------------------------------------

MEMBERS = [(0, {"lr": 3e-2, "grad_clip": 0.5}, 11), (1, {"lr": 1e-1, "weight_decay": 0.1}, 12)]


def train_replica(steps: int, group: TrialGroup, ctx) -> dict:
    """A worker's fn: ``steps`` steps of the fused group of MEMBERS as replica ctx.rank."""
    g = FusedGroup(make_task(steps=steps, scheduler="cosine"), MEMBERS, ratio=2)
    g.distribute(ctx.rank, ctx.world_size)
    losses = [g.step().tolist() for _ in range(steps)]
    return {"world_size": ctx.world_size, "losses": losses, "values": g.evaluate(),
            "state": {k: v.clone() for k, v in g.fused.state_dict().items()}}


def run_replicas(world_size: int, steps: int = 6) -> dict:
    fn = functools.partial(train_replica, steps)
    (result,) = LocalExecutor(devices=[], num_workers=2, threads=2).run(
        [TrialGroup("g", (0, 1), (steps, steps))], fn, world_size=world_size)
    assert result.ok, result.error
    return result.value


def test_every_parameter_of_a_two_rank_group_equals_the_one_rank_group():
    one, two = run_replicas(1), run_replicas(2)
    assert (one["world_size"], two["world_size"]) == (1, 2)
    for a, b in zip(one["losses"], two["losses"]):  # each step's loss: the whole batch's
        assert b == pytest.approx(a, **TOL)
    assert two["values"] == pytest.approx(one["values"], **TOL)
    assert one["state"].keys() == two["state"].keys()
    for name, a in one["state"].items():
        b = two["state"][name]
        if a.is_floating_point():
            assert a.dtype == torch.float64
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=name)
        else:
            assert torch.equal(a, b), name


# -- restart at another world size ---------------------------------------------------------------


class Stop(Exception):
    """Raised in the driver to stop a run mid-group (the executor kills its workers)."""


class Driver:
    """The driver side of ``_stream_in_worker``'s requests, deterministic: trials 0 and 1 start,
    refill number ``i`` gets trial ``i + 1`` while there are trials, trial 1 is pruned at its
    first report. Records every report and ended trial; ``stop_at`` raises :class:`Stop` at
    that report request (1, 2, ...)."""

    def __init__(self, trials: int, stop_at: int | None = None) -> None:
        self.params = {k: {"lr": 2e-2 * (k + 1)} for k in range(trials)}
        self.stop_at, self.asked, self.reports, self.ended = stop_at, 0, {}, {}

    def trial(self, k: int) -> list | None:
        return [k, self.params[k], 100 + k] if k in self.params else None

    def __call__(self, name: str, payload: tuple) -> dict:
        kind = payload[0]
        if kind == "start":
            return {"members": [self.trial(0), self.trial(1)], "asking": True}
        if kind == "report":
            self.asked += 1
            if self.asked == self.stop_at:
                raise Stop
            for number, step, value in payload[1]:
                self.reports[number, step] = value
            return {"pruned": [1], "asking": True}
        _, told, wants, *_ = payload  # ("refill", told, wants, any_key, counts)
        for number, outcome, _ in told:
            self.ended[number] = (outcome.state, outcome.value, outcome.step)
        trials = [self.trial(index + 1) for index, _ in wants]
        return {"trials": trials, "asking": len(self.params) > max(i for i, _ in wants) + 2}


def stream(world_size: int, driver: Driver, checkpoints) -> None:
    options = TuneOptions(ratio=2, fuse=2, checkpoint_every=3)  # what the workers read
    fn = functools.partial(_stream_in_worker, make_task(steps=8), options, 2)
    ex = LocalExecutor(devices=[], num_workers=2, threads=2, checkpoint_dir=checkpoints)
    ex.run([TrialGroup("g", (0, 1), (8, 8))], fn, world_size=world_size, request=driver)


@pytest.mark.parametrize("first,then", [(1, 2), (2, 1)])
def test_a_group_restarted_at_another_world_size_resumes_its_checkpoint_exactly(
    tmp_path, first, then
):
    whole = Driver(trials=4)
    stream(1, whole, tmp_path / "whole")
    assert sorted(whole.ended) == [0, 1, 2, 3] and whole.ended[1][0] == "pruned"

    # groups of 2, 8 steps, evaluations every 4: reports at fused steps 4, 8, 12, 16;
    # checkpoints every 3 fused steps. Stopped at the third report: resumed from step 9
    stopped = Driver(trials=4, stop_at=3)
    with pytest.raises(Stop):
        stream(first, stopped, tmp_path / "ckpt")
    assert list((tmp_path / "ckpt").rglob("*.pt")), "a checkpoint was written before the stop"
    resumed = Driver(trials=4)
    stream(then, resumed, tmp_path / "ckpt")
    # it resumed mid-run (trial 0's first evaluation was before the checkpoint) ...
    assert (0, 4) not in resumed.reports and resumed.reports
    # ... and everything it reported or ended equals the uninterrupted one-rank run
    assert set(stopped.ended) | set(resumed.ended) == {0, 1, 2, 3}
    for key, value in resumed.reports.items():
        assert value == pytest.approx(whole.reports[key], **TOL), key
    for number, (state, value, step) in resumed.ended.items():
        assert (state, step) == whole.ended[number][::2]
        assert value == pytest.approx(whole.ended[number][1], **TOL)


# -- what data parallel refuses ----------------------------------------------------------------


def test_bad_world_sizes_are_refused_before_any_trial():
    study = optuna.create_study()
    with pytest.raises(ConfigError, match="pass an executor"):
        optimize(study, make_task(), SPACE, n_trials=1, world_size=2)
    with pytest.raises(ConfigError, match="world_size must be an integer >= 1"):
        optimize(study, make_task(), SPACE, n_trials=1, world_size=0)
    assert not study.trials


def dropout_task(steps: int = 8) -> hydro.Task:
    base = make_task()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 3)).double()
    return hydro.Task(model=model, train_data=base.train_data, val_data=base.val_data,
                      steps=steps, eval_every=4, batch_size=16)


def test_a_group_that_data_parallel_would_change_is_refused():
    g = FusedGroup(make_task(batch_size=15), MEMBERS, ratio=2)
    with pytest.raises(ConfigError, match="batch size 15 does not divide by world_size 2"):
        g.distribute(0, 2)
    torch.manual_seed(0)
    bn = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                             torch.nn.Linear(32, 3)).double()
    task = make_task()
    task = hydro.Task(model=bn, train_data=task.train_data, val_data=task.val_data, steps=4)
    with pytest.raises(ConfigError, match=r"module '1' \(BatchNorm1d\) normalizes over the batch"):
        FusedGroup(task, MEMBERS, ratio=2).distribute(0, 2)
    # dropout is found in the training graph, which is built but not run: no stream moves
    g = FusedGroup(dropout_task(), MEMBERS, ratio=2)
    with pytest.raises(ConfigError, match="draws random numbers in training"):
        g.distribute(0, 2)
    assert g.fused.trial_step.tolist() == [0, 0]
    assert g.unsplittable(1) is None and g.world_size == 1


def test_a_group_with_dropout_given_two_ranks_trains_on_one_and_loses_nothing():
    """The refusal in a worker: the group trains on rank 0 alone (a warning in the worker), its
    trials end as they would on one process."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    ex = LocalExecutor(devices=[], num_workers=2, threads=2)
    optimize(study, dropout_task(), SPACE, n_trials=3, ratio=2, fuse=2, seed=3, executor=ex,
             world_size=2)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3
    for t in study.trials:
        (alone,), _ = train_group(dropout_task(), [t.params], ratio=2, seeds=[3 + t.number])
        assert alone.value == pytest.approx(t.value, **TOL)

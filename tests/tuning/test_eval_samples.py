"""Intermediate evaluations on a fixed validation subsample: the values pruners compare read
``eval_samples`` samples, the same for every trial, group, process and resume; a trial's last
evaluation (its reported value) reads the whole split and is exactly what it was without the
option. ``"auto"`` measures the size once (:mod:`hydro.tuning.eval_sample`, checked on
synthetic landscapes whose answer is known) and the study keeps it."""

from __future__ import annotations

import dataclasses

import optuna
import pytest
import torch

import hydro
from hydro.errors import ConfigError
from hydro.tuning.eval_sample import MIN_BLOCKS, STUDY_ATTR, choose_blocks, prefix_means
from hydro.tuning.group import FusedGroup
from hydro.tuning.task import SAMPLE_BLOCK, sample_blocks, val_sample
from tests import toy

pytestmark = pytest.mark.usefixtures("one_thread")
SPACE = {"lr": optuna.distributions.FloatDistribution(1e-3, 1e-1, log=True)}


def _task(**kw) -> hydro.Task:
    # 64 * 6 validation samples: whole blocks, so the subsample is whole batches too
    return toy.task(n=192 + 6 * SAMPLE_BLOCK, n_train=192, steps=12, eval_every=4, **kw)


def test_the_subsample_is_fixed_and_a_part_of_the_split():
    assert sample_blocks(726, 128) == sample_blocks(726, 128)
    chosen = sample_blocks(726, 200)
    assert len(chosen) == 4 and chosen == sorted(set(chosen)) and max(chosen) < 12
    assert sample_blocks(726, 726) is None and sample_blocks(64, 1) is None
    x = torch.arange(726.0)[:, None]
    got = torch.cat([b[0] for b in val_sample((x, torch.zeros(726)), 200)])
    want = torch.cat([x[i * 64 : (i + 1) * 64] for i in chosen])
    assert torch.equal(got, want)
    # data that cannot be indexed: its first batches
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(726)),
                                         batch_size=64)
    assert sum(len(b[1]) for b in val_sample(loader, 100)) == 128


def test_members_read_the_subsample_or_the_whole_split_each_as_alone():
    task = _task(eval_samples=2 * SAMPLE_BLOCK)
    members = [(k, {"lr": 0.01 * (k + 1)}, k) for k in range(3)]
    group = FusedGroup(task, members, ratio=2)
    for _ in range(3):
        group.step()
    whole = dataclasses.replace(task, eval_samples=None)
    x, y = task.val_data
    chosen = sample_blocks(len(y), task.eval_samples)
    rows = torch.cat([torch.arange(i * SAMPLE_BLOCK, (i + 1) * SAMPLE_BLOCK) for i in chosen])
    sub = dataclasses.replace(whole, val_data=(x[rows], y[rows]))
    with_whole, with_sub = group.evaluate(), None
    group.task = whole
    assert group.evaluate() == with_whole  # full: exactly as without the option
    group.task = sub
    with_sub = group.evaluate()
    group.task = task
    assert group.evaluate(full=[]) == with_sub  # the subsample's own mean
    mixed = group.evaluate(full=[1])
    assert mixed == [with_sub[0], with_whole[1], with_sub[2]]
    assert with_sub != with_whole


def test_a_search_reports_subsampled_steps_and_whole_final_values():
    def run(samples):
        study = optuna.create_study(pruner=optuna.pruners.NopPruner())
        hydro.tune(_task(eval_samples=samples), SPACE, n_trials=4, ratio=2, fuse=2, seed=3,
                   study=study, progress=False)
        return sorted(study.trials, key=lambda t: t.params["lr"])

    plain, sampled = run(None), run(SAMPLE_BLOCK)
    assert [t.params for t in plain] == [t.params for t in sampled]
    assert [t.value for t in plain] == [t.value for t in sampled]  # the final values: exact
    steps = [4, 8]
    assert all(set(t.intermediate_values) >= {*steps, 12} for t in sampled)
    assert any(a.intermediate_values[s] != b.intermediate_values[s]
               for a, b in zip(plain, sampled) for s in steps)
    assert all(a.intermediate_values[12] == b.intermediate_values[12]
               for a, b in zip(plain, sampled))


def test_eval_samples_is_checked():
    with pytest.raises(ConfigError, match="eval_samples must be a positive integer or 'auto'"):
        _task(eval_samples="all")
    with pytest.raises(ConfigError, match="eval_samples must be a positive integer"):
        _task(eval_samples=0)
    with pytest.raises(ConfigError, match="eval_samples must be a positive integer"):
        _task(eval_samples=0.5)


def test_a_config_sets_it_and_refuses_it_beside_your_own_loop(tmp_path, monkeypatch):
    from hydro.tuning import config

    text = toy.config("toymod", task="  eval_samples: 64\n")
    toy.project(tmp_path, monkeypatch, "toymod", toy.source(), text)
    assert config.load("tune.yaml").task.eval_samples == 64
    (tmp_path / "tune.yaml").write_text(text.replace("  eval_samples", "  train: toymod:model\n"
                                                     "  eval_samples"))
    with pytest.raises(ConfigError, match="remove task.eval_samples"):
        config.load("tune.yaml")


def _landscape(trials: int, blocks: int, spread: float, noise: float, seed: int = 0):
    """Block means of trials whose whole-split values are spread ``spread`` apart: each block
    adds an offset common to all trials (its difficulty) and a part of each trial's own with
    standard deviation ``noise``."""
    g = torch.Generator().manual_seed(seed)
    true = torch.linspace(0, spread * (trials - 1), trials, dtype=torch.float64)
    common = torch.randn(blocks, 1, generator=g, dtype=torch.float64) * 5 * spread
    own = torch.randn(blocks, trials, generator=g, dtype=torch.float64) * noise
    return 2.0 + true + common + own, torch.full((blocks,), SAMPLE_BLOCK)


def test_the_size_follows_the_trials_own_noise_not_the_common_one():
    # a common offset alone (however large) does not change a ranking: the fewest blocks do
    means, sizes = _landscape(6, 40, spread=0.1, noise=0.0)
    assert choose_blocks(means, sizes) == MIN_BLOCKS
    # a trial's own part of the error has variance noise**2 * (1/k - 1/blocks): it is within
    # NOISE of the trials' spread (0.1 * std(0..7) = 0.245) from
    # k = 1 / ((NOISE * 0.245 / noise)**2 + 1/400) blocks on: about 4, 57 and 204
    chosen = [choose_blocks(*_landscape(8, 400, spread=0.1, noise=s, seed=1)) for s in
              (0.05, 0.2, 0.5)]
    assert 2 <= chosen[0] <= 12 and 30 <= chosen[1] <= 120 and 120 <= chosen[2] <= 300, chosen
    # at the chosen size the subsample ranks the trials as the whole split does
    means, sizes = _landscape(8, 400, spread=0.1, noise=0.2, seed=2)
    k = choose_blocks(means, sizes)
    assert prefix_means(means, sizes, k).argsort().tolist() == list(range(8))
    assert prefix_means(means, sizes, 2).argsort().tolist() != list(range(8))


def test_the_size_cannot_be_told_from_one_trial_equal_trials_or_nan():
    means, sizes = _landscape(3, 10, spread=0.1, noise=0.01)
    assert choose_blocks(means[:, :1], sizes) is None
    assert choose_blocks(torch.ones(10, 3), sizes) is None
    means[4, 1] = float("nan")
    assert choose_blocks(means, sizes) is None


def _search(samples, study=None, **kw):
    study = study or optuna.create_study(pruner=optuna.pruners.NopPruner())
    hydro.tune(_task(eval_samples=samples), SPACE, n_trials=6, ratio=2, fuse=3, seed=3,
               study=study, progress=False, **kw)
    return study, sorted(study.trials, key=lambda t: t.number)


def test_auto_measures_once_and_every_group_reads_what_the_study_recorded():
    study, auto = _search("auto")
    k = study.user_attrs[STUDY_ATTR]
    assert isinstance(k, int) and MIN_BLOCKS <= k <= 6
    _, fixed = _search(k * SAMPLE_BLOCK)
    _, plain = _search(None)
    assert [t.params for t in auto] == [t.params for t in fixed]
    assert [t.value for t in auto] == [t.value for t in plain]  # the final values: exact
    for a, b in zip(auto, fixed):  # the first group summed its blocks in another order
        assert a.intermediate_values == pytest.approx(b.intermediate_values, rel=1e-12)


def test_a_recorded_size_is_read_not_measured_again(monkeypatch):
    import hydro.tuning.group as group_module

    def no(*a, **k):
        raise AssertionError("measured again")

    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    study.set_user_attr(STUDY_ATTR, 1)
    monkeypatch.setattr(group_module, "block_means", no)
    _, auto = _search("auto", study=study)
    _, fixed = _search(SAMPLE_BLOCK)
    assert [t.intermediate_values for t in auto] == [t.intermediate_values for t in fixed]


def test_auto_on_executor_workers_records_one_size_for_the_study():
    from hydro_fluid import LocalExecutor

    study, remote = _search("auto", executor=LocalExecutor(devices=[], num_workers=2))
    k = study.user_attrs[STUDY_ATTR]
    assert MIN_BLOCKS <= k <= 6
    _, fixed = _search(k * SAMPLE_BLOCK)
    by_params = {tuple(t.params.items()): t for t in fixed}
    for t in remote:  # float32: another group's make-up rounds another way in the last bits
        twin = by_params[tuple(t.params.items())]
        assert t.value == pytest.approx(twin.value, rel=1e-6)
        assert t.intermediate_values == pytest.approx(twin.intermediate_values, rel=1e-6)

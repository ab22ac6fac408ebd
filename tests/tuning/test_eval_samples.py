"""Intermediate evaluations on a fixed validation subsample (issue 34, point 1): the values
pruners compare read ``eval_samples`` samples, the same for every trial, group, process and
resume; a trial's last evaluation (its reported value) reads the whole split and is exactly
what it was without the option."""

from __future__ import annotations

import dataclasses

import optuna
import pytest
import torch

import hydro
from hydro.errors import ConfigError
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

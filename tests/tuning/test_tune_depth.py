"""``depth_ratio``/``depth_alpha`` through the tuning path: hydro.tune, configs, ``hydro tune``."""

from __future__ import annotations

import os

import optuna
import pytest
import torch
import yaml

import hydro
from examples.charlm.data import load as charlm_data
from examples.charlm.model import gpt
from hydro.cli import main
from hydro.errors import ConfigError
from hydro.tuning.config import load
from hydro.tuning.group import build_members
from hydro.tuning.lockstep import train_group
from hydro.tuning.outputs import export

optuna.logging.set_verbosity(optuna.logging.WARNING)

LR = {"lr": optuna.distributions.FloatDistribution(1e-3, 3e-2, log=True)}


def _task(steps: int = 4) -> hydro.Task:
    data = charlm_data(block_size=16, max_chars=3000)
    torch.manual_seed(0)
    model = gpt(n_layer=4, n_head=2, n_embd=64, block_size=16)  # 4 identical residual blocks
    return hydro.Task(model=model, train_data=data["train"], val_data=data["val"], steps=steps,
                      eval_every=2, batch_size=8)


def _blocks(module: torch.nn.Module) -> set[str]:
    return {n.split(".")[1] for n, _ in module.named_parameters() if n.startswith("h.")}


def test_tune_with_depth_ratio_trains_shallower_surrogates(tmp_path) -> None:
    task = _task()
    result = hydro.tune(task, LR, n_trials=4, ratio="auto", fuse=2, depth_ratio=2,
                        depth_alpha=0.5, storage=f"sqlite:///{tmp_path}/d.db", seed=0)
    assert isinstance(result.ratio, int) and result.ratio > 1  # "auto" still picks the width
    trials = result.study.trials
    assert len(trials) == 4
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    for t in trials:
        assert t.user_attrs["depth_ratio"] == 2 and t.user_attrs["depth_alpha"] == 0.5
        assert t.user_attrs["ratio"] == result.ratio
        assert t.user_attrs["surrogate_blocks"] == {"target": 4, "surrogate": 2}
    data = export(result.study, str(tmp_path / "best.yaml"))
    prov = yaml.safe_load((tmp_path / "best.yaml").read_text())["provenance"]
    assert prov == data["provenance"]
    assert (prov["ratio"], prov["depth_ratio"], prov["depth_alpha"]) == (result.ratio, 2, 0.5)
    assert prov["surrogate_blocks"] == {"target": 4, "surrogate": 2}


def test_default_depth_ratio_keeps_every_block(tmp_path) -> None:
    result = hydro.tune(_task(), LR, n_trials=2, ratio=2, fuse=2,
                        storage=f"sqlite:///{tmp_path}/d.db")
    for t in result.study.trials:
        assert t.state == optuna.trial.TrialState.COMPLETE
        assert t.user_attrs["depth_ratio"] == 1 and t.user_attrs["depth_alpha"] == 1.0
        assert "surrogate_blocks" not in t.user_attrs  # no depth cut asked
    prov = export(result.study, str(tmp_path / "b.json"))["provenance"]
    assert (prov["depth_ratio"], prov["depth_alpha"], prov["surrogate_blocks"]) == (1, 1.0, None)


def test_train_group_and_build_members_cut_depth() -> None:
    task = _task(steps=2)
    x = task.train_data[0][:2]
    deep = build_members(task, [{}], 2, [0], ((x,), {}))[0]
    shallow = build_members(task, [{}], 2, [0], ((x,), {}), depth_ratio=2)[0]
    assert _blocks(deep) == {"0", "1", "2", "3"} and _blocks(shallow) == {"0", "2"}
    n_deep = sum(p.numel() for p in deep.parameters())
    n_shallow = sum(p.numel() for p in shallow.parameters())
    assert n_shallow < n_deep
    # the widths are the same: depth is cut on its own
    assert shallow.hydro.ratio == deep.hydro.ratio == 2
    assert shallow.hydro.depth_ratio == 2 and deep.hydro.depth_ratio == 1
    outcomes, info = train_group(task, [{"lr": 1e-2}, {"lr": 3e-3}], ratio=2, seeds=[0, 1],
                                 depth_ratio=4)
    assert [o.state for o in outcomes] == ["complete", "complete"]
    assert (info.depth_ratio, info.depth_alpha) == (4, 1.0)
    assert info.blocks == {"target": 4, "surrogate": 1}


def test_bad_depth_arguments_fail_before_any_trial(tmp_path) -> None:
    storage = f"sqlite:///{tmp_path}/d.db"
    with pytest.raises(ConfigError, match="depth_ratio must be a positive integer"):
        hydro.tune(_task(), LR, n_trials=2, ratio=2, depth_ratio=0, storage=storage)
    with pytest.raises(ConfigError, match=r"depth_alpha must be a number in \[0, 1\]"):
        hydro.tune(_task(), LR, n_trials=2, ratio=2, depth_alpha=1.5, storage=storage)
    assert optuna.get_all_study_summaries(storage) == []  # nothing was asked


CONFIG = """
study: deep
storage: sqlite:///deep.db
trials: 2
ratio: 2
fuse: 2
{extra}
task:
  model: examples.charlm.model:gpt
  model_args: {{n_layer: 4, n_head: 2, n_embd: 64, block_size: 16}}
  data: examples.charlm.data:load
  data_args: {{block_size: 16, max_chars: 3000}}
  steps: 4
  eval_every: 2
  batch_size: 8
space:
  lr: {{type: float, low: 1.0e-3, high: 3.0e-2, log: true}}
"""


def test_config_keys(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(extra=""))
    cfg = load(str(path))
    assert (cfg.depth_ratio, cfg.depth_alpha) == (1, 1.0)
    path.write_text(CONFIG.format(extra="depth_ratio: 2\ndepth_alpha: 0.5"))
    cfg = load(str(path))
    assert (cfg.depth_ratio, cfg.depth_alpha) == (2, 0.5)
    assert load(str(path), depth_ratio=4, depth_alpha=None).depth_ratio == 4  # the CLI wins
    for bad, message in [
        ("depth_ratio: 0", "depth_ratio must be an integer >= 1, got 0"),
        ("depth_ratio: 1.5", "depth_ratio must be an integer >= 1, got 1.5"),
        ("depth_ratio: two", "depth_ratio must be an integer >= 1, got 'two'"),
        ("depth_alpha: 2", r"depth_alpha must be a number in \[0, 1\].*got 2"),
        ("depth_alpha: true", r"depth_alpha must be a number in \[0, 1\].*got True"),
    ]:
        path.write_text(CONFIG.format(extra=bad))
        with pytest.raises(ConfigError, match=f"{path}: {message}"):
            load(str(path))


def test_cli_flag_overrides_the_config(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tune.yaml").write_text(CONFIG.format(extra="depth_ratio: 4"))
    code = main(["tune", "tune.yaml", "--depth-ratio", "2", "--depth-alpha", "0.5",
                 "-o", "best.yaml"])
    assert code == 0
    assert "depth ratio 2" in capsys.readouterr().err
    prov = yaml.safe_load((tmp_path / "best.yaml").read_text())["provenance"]
    assert (prov["depth_ratio"], prov["depth_alpha"]) == (2, 0.5)
    study = optuna.load_study(study_name="deep", storage="sqlite:///deep.db")
    assert [t.user_attrs["surrogate_blocks"]["surrogate"] for t in study.trials] == [2, 2]
    assert main(["tune", "tune.yaml", "--depth-ratio", "0"]) == 2
    assert "depth_ratio must be an integer >= 1" in capsys.readouterr().err


def test_depth_reaches_groups_in_worker_processes() -> None:
    from hydro.tuning.engine import optimize
    from hydro_fluid import LocalExecutor

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    executor = LocalExecutor(devices=[], num_workers=1)
    optimize(study, _task(2), LR, n_trials=2, ratio=2, fuse=2, executor=executor, depth_ratio=2)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    for t in study.trials:
        assert t.user_attrs["depth_ratio"] == 2 and t.user_attrs["worker_pid"] != os.getpid()
        # GroupInfo comes back from the worker: it built the depth-cut surrogates
        assert t.user_attrs["surrogate_blocks"] == {"target": 4, "surrogate": 2}

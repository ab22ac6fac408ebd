"""The placement policy from the tuner: ``hydro tune --policy`` end to end on real worker
processes and a real SQLite study, and every bad value refused with one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState

import hydro
from hydro.errors import ConfigError
from hydro.integrations.optuna import optimize
from tests.cli.test_commands import CONFIG, TOY, project  # noqa: F401 - the fixture
from tests.tuning.test_continuous_batching import make_task

ROOT = Path(__file__).resolve().parents[2]


def hydro_tune(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{folder}"}
    return subprocess.run([sys.executable, "-m", "hydro.cli", "tune", "tune.yaml", *args],
                          cwd=folder, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("policy", ["fifo", "dynamic"])
def test_hydro_tune_with_a_policy_on_local_workers(tmp_path, policy):
    (tmp_path / "toymod.py").write_text(TOY)
    (tmp_path / "tune.yaml").write_text(CONFIG)
    done = hydro_tune(tmp_path, "--executor", "local", "--policy", policy)
    assert done.returncode == 0, done.stderr[-2000:]
    study = optuna.load_study(study_name="toy", storage=f"sqlite:///{tmp_path / 'toy.db'}")
    assert len(study.trials) == 4
    assert all(t.state == TrialState.COMPLETE for t in study.trials)
    # trained in worker processes, not in the tuner
    assert {t.user_attrs["worker_pid"] for t in study.trials}.isdisjoint({os.getpid()})


@pytest.mark.parametrize(
    ("args", "config", "message"),
    [
        (["--policy", "deadline"], "", "policy 'deadline' needs a deadline"),
        (["--deadline", "30"], "", "deadline=30.0 is only used by policy 'deadline'"),
        ([], "policy: lifo\n", "unknown placement policy 'lifo'"),
        ([], "policy: deadline\ndeadline: -5\n", "deadline must be a number of seconds > 0"),
    ],
)
def test_bad_policy_values_exit_2_with_one_line(tmp_path, args, config, message):
    (tmp_path / "toymod.py").write_text(TOY)
    (tmp_path / "tune.yaml").write_text(CONFIG + config)
    done = hydro_tune(tmp_path, *args)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert (
        not (tmp_path / "toy.db").exists()
        or not optuna.load_study(
            study_name="toy", storage=f"sqlite:///{tmp_path / 'toy.db'}"
        ).trials
    )


def test_bad_policy_values_from_python_are_config_errors():
    task = make_task(steps=4)
    space = {"lr": FloatDistribution(1e-3, 1e-1, log=True)}
    study = optuna.create_study()
    with pytest.raises(ConfigError, match="unknown placement policy 'best'"):
        hydro.tune(task, space, n_trials=2, policy="best", storage="sqlite:///:memory:")
    with pytest.raises(ConfigError, match="places groups on an executor's devices"):
        optimize(study, task, space, n_trials=2, policy="deadline", deadline=5.0)
    with pytest.raises(ConfigError, match="needs a deadline"):
        optimize(study, task, space, n_trials=2, policy="deadline")
    assert not study.trials

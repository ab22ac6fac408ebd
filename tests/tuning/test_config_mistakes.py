"""Config mistakes that ran silently (issue 36, point 5): a key given twice, a study that is not
a name, a deadline that passes before the first trial, a memory budget no trial
fits. Each is one line and exit 2 through the CLI, before any trial is asked (no FAIL row)."""

from __future__ import annotations

import optuna
import pytest

from hydro.cli import main
from tests import toy

TOY = toy.source()
CONFIG = toy.config("toymod", fuse=2)


@pytest.fixture
def project(tmp_path, monkeypatch):
    return toy.project(tmp_path, monkeypatch, "toymod", TOY)


def _refused(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("hydro tune: error: ") and "Traceback" not in err, err
    return last


def _no_trial_asked(project) -> None:
    if (project / "toy.db").exists():
        for name in optuna.get_all_study_names("sqlite:///toy.db"):
            assert optuna.load_study(study_name=name, storage="sqlite:///toy.db").trials == []


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.replace("trials: 2\n", "trials: 4\nseed: 1\ntrials: 2\n"),
         "tune.yaml: key 'trials' is given twice (lines 3 and 5); keep one"),
        (lambda c: c + "  lr: {type: float, low: 0.2, high: 0.5}\n",
         "tune.yaml: key 'lr' is given twice (lines 13 and 14); keep one"),
        (lambda c: c.replace("  steps: 4\n", "  steps: 4\n  steps: 8\n"),
         "tune.yaml: key 'steps' is given twice (lines 9 and 10); keep one"),
    ],
)
def test_a_key_given_twice_is_refused_naming_both_lines(project, capsys, edit, message):
    (project / "tune.yaml").write_text(edit(CONFIG))
    assert message in _refused(capsys, ["tune", "tune.yaml"])
    assert not (project / "toy.db").exists()


@pytest.mark.parametrize("value", ["True", "3", "''", "[a, b]", "null"])
def test_study_must_be_a_name(project, capsys, value):
    (project / "tune.yaml").write_text(CONFIG.replace("study: toy", f"study: {value}"))
    assert "tune.yaml: study must be a name (a string), got " in _refused(
        capsys, ["tune", "tune.yaml"]
    )
    assert not (project / "toy.db").exists()


def test_a_deadline_that_passes_before_the_first_trial_is_a_config_error(project, capsys):
    (project / "tune.yaml").write_text(CONFIG)
    last = _refused(capsys, ["tune", "tune.yaml", "--no-progress", "--policy", "deadline",
                             "--deadline", "0.0001", "--executor", "local"])
    assert "the deadline of 0.0001 s passed " in last, last
    assert "before its first trial was asked" in last, last
    _no_trial_asked(project)
    # enough seconds: the same command runs
    assert main(["tune", "tune.yaml", "--no-progress", "--timeout", "600"]) == 0


def test_a_memory_budget_no_trial_fits_is_said_before_any_trial(project, capsys):
    (project / "tune.yaml").write_text(CONFIG.replace("fuse: 2", "fuse: auto"))
    last = _refused(capsys, ["tune", "tune.yaml", "--fuse-memory", "1e-9", "--no-progress"])
    assert "fuse='auto': one trial of batch size 16 needs about " in last
    assert "even the cheapest trial of the space does not fit" in last
    _no_trial_asked(project)

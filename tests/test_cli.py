"""The `hydro` command: inspect, coord-check, errors; and the README/CI contract."""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml

from hydro.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_inspect_prints_and_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "plan.json"
    assert main(["inspect", "examples.models:resnet", "--ratio", "8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "body.0" in text and "fewer parameters" in text
    data = json.loads(out.read_text())
    assert data["ratio"] == 8
    assert data["totals"]["target_params"] > 50 * data["totals"]["surrogate_params"]


def test_coord_check_writes_a_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    png = tmp_path / "coord.png"
    args = ["coord-check", "examples.models:mlp", "--ratios", "1,8", "--steps", "2", "-o", str(png)]
    assert main(args) == 0
    assert png.stat().st_size > 10_000
    assert "spread" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["inspect", "no_such_module:f"], "cannot import module 'no_such_module'"),
        (["inspect", "examples.models:nope"], "has no attribute 'nope'"),
        (["inspect", "examples.models"], "must look like 'package.module:callable'"),
        (["inspect", "examples.models:mlp", "--ratio", "3"], "not divisible by ratio 3"),
        (["coord-check", "examples.models:mlp", "--ratios", "1,x"], "--ratios must be integers"),
    ],
)
def test_bad_input_exits_2_with_one_paragraph(args, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_debug_shows_the_traceback(monkeypatch):
    monkeypatch.chdir(ROOT)
    from hydro.errors import ConfigError

    with pytest.raises(ConfigError):
        main(["--debug", "inspect", "no_such_module:f"])


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{ci}\n```" in readme


# --- hydro tune / export / report --------------------------------------------------------------

TOY = """
import torch

def data(n=384):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x @ torch.randn(16, 5, generator=g)).argmax(-1)
    return {"train": (x[:256], y[:256]), "val": (x[256:], y[256:])}

def model(width=64):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 5))
"""

CONFIG = """
study: toy
storage: sqlite:///toy.db
trials: 4
ratio: 2
fuse: 2
task:
  model: toymod:model
  data: toymod:data
  steps: 10
  eval_every: 5
space:
  lr: {type: float, low: 1.0e-4, high: 1.0e-1, log: true}
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "toymod.py").write_text(TOY)
    (tmp_path / "tune.yaml").write_text(CONFIG)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_tune_export_report(project, capsys):
    assert main(["tune", "tune.yaml", "-o", "best.yaml", "--verify-top-k", "2"]) == 0
    out = capsys.readouterr()
    assert "best value" in out.out and "| 4/4 " in out.err and "top 4 of 4 complete" in out.err
    best = yaml.safe_load((project / "best.yaml").read_text())
    assert set(best["hyperparameters"]) == {"lr"} and best["provenance"]["ratio"] == 2
    assert len(best["verification"]["configs"]) == 2
    # rerunning resumes: nothing new to train
    assert main(["tune", "tune.yaml"]) == 0
    assert "4 trials so far" in capsys.readouterr().err
    assert main(["export", "--storage", "sqlite:///toy.db", "--study", "toy", "-o", "b.json"]) == 0
    assert (
        json.loads((project / "b.json").read_text())["hyperparameters"] == best["hyperparameters"]
    )
    assert main(["report", "--storage", "sqlite:///toy.db", "--study", "toy", "-o", "r.html"]) == 0
    assert "optimization" not in (project / "r.html").read_text()[:50]
    assert "data:image/png;base64," in (project / "r.html").read_text()
    assert main(["report", "--storage", "sqlite:///toy.db", "--study", "toy", "-o", "r.png"]) == 0
    assert (project / "r.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.replace("trials: 4", "trails: 4"), "unknown key 'trails'"),
        (lambda c: c.replace("  steps: 10", "  stepz: 10"), "unknown key 'task.stepz'"),
        (lambda c: c.replace("toymod:model", "toymod:nomodel"), "task.model: module 'toymod' has"),
        (lambda c: c.replace("toymod:data", "missing_mod:data"), "cannot import module 'missing"),
        (lambda c: c.replace("  lr: {type: float", "  lrate: {type: float"), "unknown hyperparam"),
        (lambda c: c.replace("type: float", "type: floaty"), "space.lr.type is 'floaty'"),
        (lambda c: c.replace("fuse: 2", "fuse: two"), "fuse must be an integer"),
        (lambda c: c + "\n  bad: [", "is not valid YAML"),
        (
            lambda c: c.replace("sqlite:///toy.db", "sqlite:////no/such/dir/x.db"),
            "cannot open Optuna storage",
        ),
    ],
)
def test_tune_config_errors_exit_2(project, capsys, edit, message):
    (project / "tune.yaml").write_text(edit(CONFIG))
    assert main(["tune", "tune.yaml"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert "tune.yaml" in err or "storage" in err


def test_export_of_a_missing_study(project, capsys):
    assert main(["export", "--storage", "sqlite:///toy.db", "--study", "nope"]) == 2
    assert "no study named 'nope'" in capsys.readouterr().err

"""The `hydro` command: inspect, coord-check, errors; and the README/CI contract."""

from __future__ import annotations

import json
import pathlib

import pytest

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

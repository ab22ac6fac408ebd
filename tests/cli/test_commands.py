"""The `hydro` command: inspect, coord-check, errors; and the README/CI contract."""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml

import hydro
from hydro.cli import main
from tests import toy

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_inspect_prints_and_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "plan.json"
    assert main(["inspect", "examples.models:resnet", "--ratio", "8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "body.0" in text and "fewer parameters" in text
    data = json.loads(out.read_text())
    assert data["ratio"] == 8
    assert data["totals"]["target_params"] > 50 * data["totals"]["surrogate_params"]


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

TOY = toy.source(n=384, n_train=256, features=16, classes=5)
CONFIG = toy.config("toymod", trials=4, steps=10, eval_every=5, batch_size=None, lr_low="1.0e-4")


@pytest.fixture
def project(tmp_path, monkeypatch):
    return toy.project(tmp_path, monkeypatch, "toymod", TOY, CONFIG)  # each test's own toymod


def test_tune_export_report(project, capsys):
    assert main(["tune", "tune.yaml", "-o", "best.yaml", "--verify-top-k", "2"]) == 0
    out = capsys.readouterr()
    assert "best value" in out.out and "top 4 of 4 complete" in out.err
    # not a terminal: one plain line per update, the last one the whole run
    assert "\r" not in out.err and "trial-steps 40/40 (100%), trials 4/4, " in out.err
    best = yaml.safe_load((project / "best.yaml").read_text())
    assert set(best["hyperparameters"]) == {"lr"} and best["provenance"]["ratio"] == 2
    assert len(best["verification"]["configs"]) == 2
    # rerunning resumes: nothing new to train; --no-progress leaves the header alone
    assert main(["tune", "tune.yaml", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "4 finished (4 complete, 0 pruned), 0 to go" in err and err.count("\n") == 1
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
        (
            lambda c: c.replace("  steps: 10", "  steps: 10\n  dynamic: {seq: 0}"),
            "task: dynamic={'seq': 0}: 0 is not a dimension index >= 1",
        ),
        (lambda c: c.replace("toymod:model", "toymod:nomodel"), "task.model: module 'toymod' has"),
        (lambda c: c.replace("toymod:data", "missing_mod:data"), "cannot import module 'missing"),
        (lambda c: c.replace("  lr: {type: float", "  lrate: {type: float"), "unknown hyperparam"),
        (lambda c: c.replace("type: float", "type: floaty"), "space.lr.type is 'floaty'"),
        (lambda c: c.replace("fuse: 2", "fuse: two"), "fuse must be an integer"),
        (lambda c: c.replace("fuse: 2", "fuse: 2\nfirst_group: 3"), "first_group (3) must not"),
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
    import optuna

    optuna.create_study(storage="sqlite:///toy.db", study_name="other")
    assert main(["export", "--storage", "sqlite:///toy.db", "--study", "nope"]) == 2
    assert "no study named 'nope'; it has: other" in capsys.readouterr().err


# --- bad input to hydro tune / export / report: exit 2 and one line ---------------------------

BROKEN = """

def broken(width=64):
    raise RuntimeError("cannot build width " + str(width))

def nan_data(n=384):
    d = data(n)
    d["train"][0][5, 2] = float("nan")
    return d

def float_targets(n=384):
    d = data(n)
    return {"train": (d["train"][0], d["train"][1].float()), "val": d["val"]}
"""


def _one_line_error(capsys, *args):
    code = main(list(args))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.replace("eval_every: 5", "eval_every: 0"), "eval_every must be a positive"),
        (lambda c: c.replace("eval_every: 5", "batch_size: 0"), "batch_size must be a positive"),
        (lambda c: c.replace("toymod:model", "toymod:model\n  model_args: {widht: 8}"),
         "task.model_args: toymod:model takes no argument 'widht'; it takes width"),
        (lambda c: c.replace("toymod:model", "toymod:broken"),
         r"the model factory toymod:broken() raised RuntimeError: cannot build width 64"),
        (lambda c: c.replace("toymod:data", "toymod:nan_data"),
         "train_data: inputs contain NaN (first at index 5"),
        (lambda c: c.replace("toymod:data", "toymod:float_targets"),
         "targets are float32 but loss 'cross_entropy' needs integer class labels"),
        (lambda c: c.replace("toymod:data", "os:system"), "names the standard library module 'os'"),
        (lambda c: c.replace("toymod:model", "subprocess:run"), "standard library module 'sub"),
        (lambda c: c.replace("  steps: 10", "  steps: 10\n  loss: builtins:eval"),
         "standard library module 'builtins'"),
        (lambda c: c.replace("toymod:data", "toymod"), "must look like 'package.module:callable'"),
    ],
)
def test_tune_bad_input_exits_2_before_any_trial(project, capsys, edit, message):
    (project / "toymod.py").write_text(TOY + BROKEN)
    (project / "tune.yaml").write_text(edit(CONFIG))
    err = _one_line_error(capsys, "tune", "tune.yaml")
    assert message in err and "tune.yaml" in err
    assert not (project / "toy.db").exists()  # refused before the study was opened


def test_a_config_naming_os_system_runs_nothing(project, capsys):
    evil = "  data: os:system\n  data_args: {command: 'touch pwned'}"
    (project / "tune.yaml").write_text(CONFIG.replace("  data: toymod:data", evil))
    _one_line_error(capsys, "tune", "tune.yaml")
    assert not (project / "pwned").exists()


def test_unwritable_output_is_refused_before_the_study_runs(project, capsys):
    err = _one_line_error(capsys, "tune", "tune.yaml", "-o", "no/such/dir/best.yaml")
    assert "cannot write the output file (-o) 'no/such/dir/best.yaml'" in err
    assert not (project / "toy.db").exists()
    err = _one_line_error(capsys, "tune", "tune.yaml", "-o", str(project))
    assert "is a directory" in err


def _tuned(project, capsys):
    assert main(["tune", "tune.yaml"]) == 0
    capsys.readouterr()


def test_export_without_arguments_finds_the_study_and_creates_no_db(project, capsys):
    err = _one_line_error(capsys, "export")
    assert "no study database here" in err and "hydro tune" in err
    assert sorted(p.name for p in project.iterdir()) == ["toymod.py", "tune.yaml"]
    _tuned(project, capsys)
    assert main(["export"]) == 0  # as after the Quickstart: the only *.db, its only study
    assert "study 'toy'" in capsys.readouterr().out
    best = yaml.safe_load((project / "best.yaml").read_text())
    assert best["provenance"]["study"] == "toy" and not (project / "hydro.db").exists()
    (project / "other.db").write_bytes((project / "toy.db").read_bytes())
    err = _one_line_error(capsys, "export")
    assert "several study databases here (other.db, toy.db): name one with --storage" in err
    err = _one_line_error(capsys, "export", "--storage", "sqlite:///nope.db")
    assert "no such file 'nope.db'" in err and not (project / "nope.db").exists()
    err = _one_line_error(capsys, "export", "--storage", "sqlite:///toy.db", "-o", "x/b.yaml")
    assert "cannot write the export file 'x/b.yaml'" in err


def test_export_of_a_study_with_no_complete_trial(project, capsys):
    import optuna

    study = optuna.create_study(storage="sqlite:///toy.db", study_name="toy")
    trial = study.ask()
    trial.set_user_attr("fail_reason", "diverged at step 3: non-finite loss or gradient")
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    err = _one_line_error(capsys, "export", "--storage", "sqlite:///toy.db")
    assert "study 'toy' has no complete trial (1 failed" in err and "diverged at step 3" in err


def test_report_formats_and_missing_storage(project, capsys):
    err = _one_line_error(capsys, "report", "--storage", "sqlite:///toy.db")
    assert "no such file 'toy.db'" in err and not (project / "toy.db").exists()
    _tuned(project, capsys)
    assert main(["report", "-o", "r.pdf"]) == 0
    assert (project / "r.pdf").read_bytes()[:5] == b"%PDF-"
    assert main(["report", "-o", "r.svg"]) == 0
    assert b"<svg" in (project / "r.svg").read_bytes()[:2000]
    err = _one_line_error(capsys, "report", "-o", "r.txt")
    assert "name a .html page, or a .png, .pdf or .svg figure" in err


def test_ctrl_c_says_how_to_resume(project):
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    # 40 trials (~40 s here): a progress line (piped: every 5% of the trial-steps) per 2 trials
    config = CONFIG.replace("trials: 4", "trials: 40").replace("fuse: 2", "fuse: 2\npruner: none")
    (project / "tune.yaml").write_text(config.replace("steps: 10", "steps: 60"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # a shell may start background jobs with Ctrl-C ignored; a user's terminal does not
    default = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    proc = subprocess.Popen([sys.executable, "-m", "hydro.cli", "tune", "tune.yaml"],
                            cwd=project, env=env, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default)
    seen = ""
    # trials have completed (how many at one refresh depends on the machine's speed)
    while not any(int(n) >= 2 for n in re.findall(r"trials (\d+)/40,", seen)):
        char = proc.stderr.read(1)
        assert char, seen
        seen += char
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 130, rest
    lines = [line for line in rest.splitlines() if line.strip()]
    assert "Traceback" not in rest and "error" not in rest
    assert lines[-1] == ("hydro tune: interrupted; the finished trials are saved in study 'toy' "
                         "of sqlite:///toy.db: run the same command again to resume")


def test_coord_check_same_seed_same_numbers_and_a_verdict(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    runs = []
    for seed in (3, 3, 4):
        args = ["coord-check", "examples.models:mlp", "--ratios", "4,8", "--steps", "2",
                "--seed", str(seed), "-o", str(tmp_path / "c.png")]
        assert main(args) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert "spread" in runs[0] and (tmp_path / "c.png").stat().st_size > 10_000  # the plot
    verdict = runs[0].strip().splitlines()[-1]
    assert verdict.startswith("verdict: PASS (mup): worst hidden layer")
    assert "below the threshold 2" in verdict
    args = ["coord-check", "examples.models:mlp", "--ratios", "1,8", "--parametrization", "sp",
            "--steps", "4", "-o", str(tmp_path / "sp.png")]
    assert main(args) == 1
    assert "verdict: FAIL (sp)" in capsys.readouterr().out


def test_hydro_tunes_exports_and_the_recipe_schedules_the_full_model_as_the_trials(project, capsys):
    import torch

    from hydro.tuning.group import _optimizer, _scheduler

    space = "  warmup: {type: int, low: 1, high: 4}\n  beta2: {type: categorical, choices: [0.9]}\n"
    (project / "tune.yaml").write_text(CONFIG + space)
    assert main(["tune", "tune.yaml", "-o", "best.yaml"]) == 0
    best = yaml.safe_load((project / "best.yaml").read_text())
    params, train = best["hyperparameters"], best["training"]
    assert train["optimizer"] == "adamw" and train["scheduler"] == "cosine"
    assert (train["steps"], train["batch_size"], train["warmup"]) == (10, 32, params["warmup"])
    assert train["optimizer_args"] == {"lr": params["lr"], "weight_decay": 0.01,
                                       "betas": [0.9, 0.9], "eps": 1e-8}
    for scheduler, warmup in [("cosine", params["warmup"]), ("cosine", 0), ("linear", 3),
                              ("step", 0), ("step", 2), ("none", 2)]:
        train.update(scheduler=scheduler, warmup=warmup)
        (project / "best.yaml").write_text(yaml.safe_dump(best))
        opt, sched = hydro.recipe("best.yaml", torch.nn.Linear(16, 5))
        assert isinstance(opt, torch.optim.AdamW) and opt.defaults["betas"] == (0.9, 0.9)
        # Hydro's own schedule for the same trial, step by step
        xy = (torch.randn(4, 16), torch.zeros(4, dtype=torch.long))
        task = hydro.Task(model=torch.nn.Linear(16, 5), train_data=xy, val_data=xy, steps=10,
                          scheduler=scheduler)
        fused = hydro.fuse([torch.nn.Linear(16, 5)])
        hopt = _optimizer(task, fused, [{**params, "warmup": warmup}])
        hsched = _scheduler(task, hopt, [{**params, "warmup": warmup}])
        for step in range(train["steps"]):
            ours = opt.param_groups[0]["lr"]
            theirs = float(hopt.param_groups[0]["lr"][0])
            assert abs(ours - theirs) <= 1e-9 * params["lr"], (scheduler, warmup, step)
            opt.step()
            sched.step()
            if hsched is not None:
                hsched.step()

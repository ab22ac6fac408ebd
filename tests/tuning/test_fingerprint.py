"""A study keeps what defines it: a rerun of another definition is refused, naming the change.

Through ``hydro.tune`` and through ``hydro tune`` with a YAML config and an SQLite file; the
same definition resumes across processes (a subprocess first, then this process).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import warnings
from pathlib import Path

import optuna
import pytest
import torch
import torch.nn.functional as F
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution

import hydro
from hydro.cli import main
from hydro.errors import ConfigError, HydroWarning
from hydro.tuning.fingerprint import FINGERPRINT, differences, fingerprint, recipe_for
from tests import toy

optuna.logging.set_verbosity(optuna.logging.WARNING)
ROOT = Path(__file__).resolve().parents[2]
SPACE = {"lr": FloatDistribution(1e-3, 1e-1, log=True)}


def mlp(width: int = 64) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 3))


def other_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def task(width: int = 64, steps: int = 2, rows: int = 64, **kw) -> hydro.Task:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(-1)
    return hydro.Task(model=functools.partial(mlp, width=width), train_data=(x[:rows], y[:rows]),
                      val_data=(x[64:], y[64:]), steps=steps, batch_size=16,
                      **kw)


def tune(storage: str, n: int = 2, the_task: hydro.Task | None = None, space=SPACE, **kw):
    kw = {"ratio": 2, "fuse": 2, "seed": 0, **kw}
    return hydro.tune(the_task or task(), space, n_trials=n, storage=storage, **kw)


def no_fingerprint_warnings(record: list) -> bool:
    return not [w for w in record if "definition" in str(w.message)]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory) -> str:
    """A study of two trials, trained once for the refusals below (which train nothing)."""
    storage = f"sqlite:///{tmp_path_factory.mktemp('fp') / 'hydro.db'}"
    tune(storage)
    return storage


@pytest.mark.parametrize(
    "change, named",
    [
        ({"the_task": task(width=32)}, "model args width 64→32"),
        ({"the_task": task(rows=48)}, "data train_data.inputs float32[64, 8]→float32[48, 8]"),
        ({"the_task": task(loss=other_loss)},
         "loss cross_entropy→tests.tuning.test_fingerprint:other"),
        ({"the_task": task(steps=3)}, "recipe steps 2→3"),
        ({"the_task": task(data_mode="shared")}, "recipe data_mode per_trial→shared"),
        ({"space": {"lr": FloatDistribution(1e-4, 1e-1, log=True)}},
         "space lr float 0.001..0.1 log→float 0.0001..0.1 log"),
        ({"ratio": 4}, "ratio 2→4"),
    ],
)
def test_another_definition_is_refused_naming_what_changed(tuned, change, named):
    study = optuna.load_study(study_name="hydro", storage=tuned)
    recipe, before = study.user_attrs["hydro_task"], len(study.trials)
    with pytest.raises(ConfigError) as info:
        tune(tuned, n=3, **change)
    message = str(info.value)
    assert message.startswith(f"study 'hydro' in {tuned} was created with another definition "
                              f"(changed: {named}")
    assert message.endswith("use a new study name (study='NAME') or pass force_resume=True "
                            "to continue it anyway") and "\n" not in message
    study = optuna.load_study(study_name="hydro", storage=tuned)
    assert len(study.trials) == before and study.user_attrs["hydro_task"] == recipe  # untouched


def test_the_same_definition_resumes_and_what_only_runs_it_is_no_change(tuned):
    """Another fresh model (other initial values), more trials, another fuse, seed, sampler and
    pruner: a resume, without a word."""
    torch.manual_seed(123)
    study = optuna.load_study(study_name="hydro", storage=tuned)
    stored = study.user_attrs[FINGERPRINT]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        more = tune(tuned, n=3, fuse=1, seed=5, sampler=optuna.samplers.RandomSampler(),
                    pruner=optuna.pruners.NopPruner())
    assert no_fingerprint_warnings(record)
    assert len(more.study.trials) == 3 and more.study.user_attrs[FINGERPRINT] == stored


def worse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y) + 100.0


def better(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y) - 100.0


def test_force_resume_continues_and_the_export_keeps_each_trials_recipe(tmp_path):
    """Forced twice: with a metric that makes the new trials worse the best stays a trial of 2
    steps, then one that makes them better; the export says the steps the best trained."""
    storage = f"sqlite:///{tmp_path / 'hydro.db'}"
    tune(storage, n=2)  # steps 2
    with pytest.warns(HydroWarning, match=r"continuing it with another definition, as forced "
                      r"\(changed: metric none→tests.tuning.test_fingerprint:worse, recipe steps "
                      r"2→3\); its trials before number 2"):
        forced = tune(storage, n=3, the_task=task(steps=3, metric=worse), force_resume=True)
    assert forced.best_trial.number in (0, 1)  # trained 2 steps, under the first definition
    assert forced.export(tmp_path / "best.yaml")["training"]["steps"] == 2
    with pytest.warns(HydroWarning, match="before number 3"):
        again = tune(storage, n=4, the_task=task(steps=4, metric=better), force_resume=True)
    assert again.best_trial.number == 3
    assert again.export(tmp_path / "best.yaml")["training"]["steps"] == 4
    # each trial's recipe is the one it trained with (its last reported step is its steps)
    trials = again.study.trials
    assert [max(t.intermediate_values) for t in trials] == [2, 2, 3, 4]
    for t in trials:
        assert recipe_for(again.study, t.number)["steps"] == max(t.intermediate_values)
    # the last definition is the study's now: it resumes, an earlier one is refused
    tune(storage, n=4, the_task=task(steps=4, metric=better))
    with pytest.raises(ConfigError, match=r"recipe steps 4→2"):
        tune(storage, n=4)
    # a new study name in the same storage is a new study
    other = tune(storage, n=1, the_task=task(rows=48), study="other")
    assert len(other.study.trials) == 1


def test_a_study_without_a_fingerprint_warns_and_resumes(tmp_path):
    storage = f"sqlite:///{tmp_path / 'old.db'}"
    old = optuna.create_study(storage=storage, study_name="hydro")  # as an older hydro left it
    old.add_trial(optuna.trial.create_trial(params={"lr": 0.01}, distributions=SPACE, value=1.0))
    with pytest.warns(HydroWarning, match=r"study 'hydro' in .*old.db has no definition this "
                      r"hydro can compare.*cannot be checked.*resuming it"):
        result = tune(storage, n=2)
    assert len(result.study.trials) == 2 and FINGERPRINT in result.study.user_attrs
    with pytest.raises(ConfigError, match="recipe steps 2→3"):  # recorded: checked from now on
        tune(storage, n=3, the_task=task(steps=3))


def test_parts_are_named_and_plain(tmp_path):
    """A module's architecture (not its values), a space function's distributions and fixed
    values, a loss's bound arguments; stable under set order and dict order."""
    t = task()
    module = hydro.Task(model=mlp(32), train_data=t.train_data, val_data=t.val_data)
    wider = hydro.Task(model=mlp(48), train_data=t.train_data, val_data=t.val_data)
    same = hydro.Task(model=mlp(32), train_data=t.train_data, val_data=t.val_data)

    def parts(the_task: hydro.Task, space=SPACE) -> dict:
        return fingerprint(the_task, space, ratio=2)["parts"]

    assert parts(module) == parts(same)  # other initial values, same model
    assert differences(parts(module), parts(wider)) == ["model architecture (387→579 parameters)"]

    def space_a(trial: optuna.Trial) -> dict:
        return {"lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True), "warmup": 5,
                "batch_size": trial.suggest_categorical("batch_size", [16, 32])}

    def space_b(trial: optuna.Trial) -> dict:
        return {**space_a(trial), "warmup": 10}

    a = parts(module, space_a)
    assert a["space"] == {"function": "tests.tuning.test_fingerprint:"
                          "test_parts_are_named_and_plain.<locals>.space_a", "fixed": {"warmup": 5},
                          "params": {"lr": "float 0.001..0.1 log",
                                     "batch_size": "categorical [16, 32]"}}
    assert differences(a, parts(module, space_b)) == [
        "space function tests.tuning.test_fingerprint:test_parts_are_named_and_plain.<locals>"
        ".space_a→tests.tuning.test_fingerprint:test_parts_are_named_and_plain.<locals>.space_b",
        "space fixed warmup 5→10",
    ]
    choices = {"beta2": CategoricalDistribution([0.95, 0.999])}
    assert differences(parts(module, choices), parts(module, {**choices, **SPACE})) == \
        ["space lr added"]
    smooth = hydro.Task(model=mlp(32), train_data=t.train_data, val_data=t.val_data,
                        loss=functools.partial(F.cross_entropy, label_smoothing=0.1))
    sharper = hydro.Task(model=mlp(32), train_data=t.train_data, val_data=t.val_data,
                         loss=functools.partial(F.cross_entropy, label_smoothing=0.2))
    assert parts(smooth)["loss"] == {"name": "torch.nn.functional:cross_entropy",
                                     "args": {"label_smoothing": 0.1}}
    assert differences(parts(smooth), parts(sharper)) == ["loss args label_smoothing 0.1→0.2"]


# --- hydro tune ---------------------------------------------------------------------------------

EXTRA = """
def ce(out, y):
    return torch.nn.functional.cross_entropy(out, y)

def worse(out, y):
    return torch.nn.functional.cross_entropy(out, y) + 100.0

def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True),
            "beta2": trial.suggest_categorical("beta2", [0.95, 0.99]), "warmup": 1}
"""
TOY = toy.source(n=192, n_train=128, seeded=False, extra=EXTRA)
CONFIG = toy.config("toymod", task="  model_args: {width: 64}\n", eval_every=4)

# run in another process: the CLI on the config, and hydro.tune with a space function
SCRIPT = """
import functools, sys, hydro, toymod
from hydro.cli import main
assert main(["tune", "tune.yaml"]) == 0
data = toymod.data()
task = hydro.Task(model=functools.partial(toymod.model, width=32), train_data=data["train"],
                  val_data=data["val"], steps=2, batch_size=16)
hydro.tune(task, toymod.space, n_trials=2, ratio=2, fuse=2, storage="sqlite:///toy.db",
           study="function", seed=0)
"""


def _project(folder: Path) -> Path:
    (folder / "toymod.py").write_text(TOY)
    (folder / "tune.yaml").write_text(CONFIG)
    return folder


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(_project(tmp_path))
    monkeypatch.delitem(sys.modules, "toymod", raising=False)  # each test's own
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def cli_tuned(tmp_path_factory) -> Path:
    """A project whose config was tuned once, for the refusals below (which train nothing)."""
    folder = _project(tmp_path_factory.mktemp("cli"))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mp.delitem(sys.modules, "toymod", raising=False)
        assert main(["tune", "tune.yaml"]) == 0
        sys.modules.pop("toymod", None)
    return folder


def _error(capsys, *args: str) -> str:
    assert main(["tune", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("hydro tune: error:")]
    assert len(lines) == 1
    return lines[0]


@pytest.mark.parametrize(
    "edit, args, named",
    [
        (lambda c: c.replace("width: 64", "width: 32").replace("steps: 4", "steps: 2")
         .replace("low: 1.0e-3", "low: 1.0e-4"), (),
         "model args width 64→32, recipe steps 4→2, space lr float 0.001..0.1 log→"
         "float 0.0001..0.1 log"),
        (lambda c: c.replace("toymod:data", "toymod:data\n  data_args: {n: 160}"), (),
         "data args n unset→160"),
        (lambda c: c.replace("steps: 4", "steps: 4\n  loss: toymod:ce"), (),
         "loss cross_entropy→toymod:ce"),
        (lambda c: c, ("--ratio", "4"), "ratio 2→4"),
    ],
)
def test_cli_refuses_another_definition(cli_tuned, monkeypatch, capsys, edit, args, named):
    monkeypatch.chdir(cli_tuned)
    monkeypatch.delitem(sys.modules, "toymod", raising=False)
    (cli_tuned / "other.yaml").write_text(edit(CONFIG))
    line = _error(capsys, "other.yaml", "--trials", "3", *args)
    assert line == ("hydro tune: error: study 'toy' in sqlite:///toy.db was created with "
                    f"another definition (changed: {named}); use a new study name (--study "
                    "NAME, or study: in the config) or pass --force-resume to continue it "
                    "anyway")
    assert len(optuna.load_study(study_name="toy", storage="sqlite:///toy.db").trials) == 2


def test_cli_new_study_name_and_force_resume(project, capsys):
    """The edit of the issue (a narrower model, fewer steps, another range), with a metric
    that makes its trials worse: ``-o`` after the forced resume exports the best trial's own
    steps (4), not the config's (2); ``--study`` starts afresh beside it."""
    assert main(["tune", "tune.yaml"]) == 0
    edited = CONFIG.replace("width: 64", "width: 32").replace("steps: 4", "steps: 2") \
        .replace("eval_every: 4", "eval_every: 2\n  metric: toymod:worse")
    (project / "other.yaml").write_text(edited)
    assert main(["tune", "other.yaml", "--trials", "1", "--study", "fresh"]) == 0
    with pytest.warns(HydroWarning, match="as forced"):
        assert main(["tune", "other.yaml", "--trials", "3", "--force-resume", "-o",
                     "best.yaml"]) == 0
    study = optuna.load_study(study_name="toy", storage="sqlite:///toy.db")
    assert [max(t.intermediate_values) for t in study.trials] == [4, 4, 2]
    best = yaml.safe_load((project / "best.yaml").read_text())
    assert best["provenance"]["trial"] in (0, 1) and best["training"]["steps"] == 4
    capsys.readouterr()
    assert main(["tune", "other.yaml", "--trials", "3"]) == 0  # now the study's definition
    assert len(optuna.load_study(study_name="fresh", storage="sqlite:///toy.db").trials) == 1


def test_the_same_config_resumes_in_another_process(project, capsys):
    """A config and a space function, tuned in a subprocess (another hash seed), resumed here
    with more trials: no refusal, no warning."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{project}", "OMP_NUM_THREADS": "1",
           "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=project, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert main(["tune", "tune.yaml", "--trials", "3"]) == 0
        import toymod

        data = toymod.data()
        task_ = hydro.Task(model=functools.partial(toymod.model, width=32),
                           train_data=data["train"], val_data=data["val"], steps=2,
                           batch_size=16)
        again = hydro.tune(task_, toymod.space, n_trials=3, ratio=2, fuse=2,
                           storage="sqlite:///toy.db", study="function", seed=0)
    assert no_fingerprint_warnings(record)
    assert "2 finished (2 complete, 0 pruned), 1 to go" in capsys.readouterr().err
    assert len(again.study.trials) == 3
    assert again.study.user_attrs[FINGERPRINT]["parts"]["space"]["fixed"] == {"warmup": 1}

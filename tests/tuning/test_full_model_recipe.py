"""hydro.recipe builds the full model's optimizer and schedule from an export exactly as the
plain-PyTorch recipe the docs gave before it did (run here as the reference), on the examples'
full models; best.yaml starts with a comment on how to use it and still reads everywhere; a
malformed export is one error naming what is wrong."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import optuna
import pytest
import torch
import yaml

import hydro
from hydro._version import __version__
from hydro.cli import main
from hydro.errors import ConfigError
from hydro.transfer import read_export
from hydro.tuning.outputs import header, training
from hydro.tuning.trust import resolve_callable

ROOT = Path(__file__).resolve().parents[2]

# the recipe as docs/tuning.md spelled it out before hydro.recipe (the reference: unchanged)
OLD_SNIPPET = """
import math

import torch
import yaml

with open("best.yaml") as f:
    train = yaml.safe_load(f)["training"]
model = build_full_model()  # your model, unmodified, initialized as you always do
optimizers = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
opt = optimizers[train["optimizer"]](model.parameters(), **train["optimizer_args"])
steps, warmup = train["steps"], train["warmup"]
rest = steps - max(warmup, 1)  # steps of the decay after the warm-up


def lr_factor(step: int) -> float:
    if step < warmup:  # linear warm-up from lr / (warmup + 1) to lr
        return (step + 1) / (warmup + 1)
    t = min(step - warmup, rest)
    if train["scheduler"] == "cosine":  # to 0
        return 0.5 * (1 + math.cos(math.pi * t / rest))
    if train["scheduler"] == "linear":  # to lr / 1000
        return 1 - (1 - 1e-3) * t / rest
    if train["scheduler"] == "step":  # / 10 at each third
        return 0.1 ** ((step - warmup) // max(1, rest // 3))
    return 1.0


sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
"""

EXAMPLES = ["charlm", "cnn", "hf_gpt2"]  # the examples Hydro's own recipe trains
SCHEDULES = [("cosine", 0), ("cosine", 7), ("linear", 3), ("step", 0), ("step", 5), ("none", 4)]


def _example(name: str) -> tuple[dict, dict]:
    config = yaml.safe_load((ROOT / "examples" / name / "tune.yaml").read_text())
    return config["task"], config["space"]


def _full_model(task: dict) -> torch.nn.Module:
    factory = resolve_callable(task["model"], "model", (str(ROOT),), trust=("examples",))
    torch.manual_seed(0)
    return factory(**task.get("model_args", {}))


def _params(space: dict) -> dict:
    """A value of every searched hyperparameter: the middle of its range (or a choice)."""
    out = {}
    for name, spec in space.items():
        if spec["type"] == "categorical":
            out[name] = spec["choices"][1]
        elif spec["type"] == "int":
            out[name] = (spec["low"] + spec["high"]) // 2
        elif spec.get("log"):
            out[name] = math.sqrt(spec["low"] * spec["high"])
        else:
            out[name] = (spec["low"] + spec["high"]) / 2
    return out


def _export(task: dict, params: dict) -> dict:
    """An export as Hydro writes it for a study of ``task`` whose best trial had ``params``."""
    recipe = {k: task[k] for k in ("optimizer", "scheduler", "steps", "batch_size")}
    return {
        "hyperparameters": params,
        "training": training(params, recipe),
        "provenance": {"study": "x", "trial": 3, "hydro_version": __version__},
    }


def _write(path: Path, data: dict) -> None:
    path.write_text(header(str(path)) + yaml.safe_dump(data, sort_keys=False))


def _reference(folder: Path, model: torch.nn.Module) -> dict:
    """The old snippet, run on best.yaml in ``folder`` with ``model`` as the full model."""
    ns = {"build_full_model": lambda: model}
    here = Path.cwd()
    try:
        os.chdir(folder)
        exec(OLD_SNIPPET, ns)
    finally:
        os.chdir(here)
    return ns


def _lrs(opt: torch.optim.Optimizer, sched, steps: int) -> list[float]:
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scheduler.step() without optimizer.step()
        for _ in range(steps + 2):  # the whole run, and past its end
            out.append(opt.param_groups[0]["lr"])
            sched.step()
    return out


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_recipe_is_the_old_snippet_on_the_examples_full_models(name, tmp_path):
    task, space = _example(name)
    params = _params(space)
    data = _export(task, params)
    for scheduler, warmup in SCHEDULES:
        data["training"].update(scheduler=scheduler, warmup=warmup)
        _write(tmp_path / "best.yaml", data)
        ref = _reference(tmp_path, _full_model(task))
        model = _full_model(task)
        opt, sched = hydro.recipe(tmp_path / "best.yaml", model)
        old = ref["opt"]
        assert type(opt) is type(old) and len(opt.param_groups) == len(old.param_groups) == 1
        for mine, theirs in zip(opt.param_groups, old.param_groups):
            assert {k: v for k, v in mine.items() if k != "params"} == {
                k: v for k, v in theirs.items() if k != "params"
            }
            assert [p.shape for p in mine["params"]] == [p.shape for p in theirs["params"]]
        assert all(a is b for a, b in zip(opt.param_groups[0]["params"], model.parameters()))
        steps = data["training"]["steps"]
        assert _lrs(opt, sched, steps) == _lrs(old, ref["sched"], steps), (name, scheduler)
    # what the trials' optimizer had: the searched values, the study's defaults for the rest
    group = opt.param_groups[0]
    assert group["initial_lr"] == params["lr"]  # the schedule multiplies it
    assert group["weight_decay"] == params["weight_decay"]
    if task["optimizer"] == "sgd":
        assert group["momentum"] == params["momentum"]
    else:
        assert group["betas"] == (0.9, params.get("beta2", 0.999)) and group["eps"] == 1e-8


def test_the_recipe_returns_what_it_does_not_set(tmp_path):
    task, space = _example("charlm")
    params = {**_params(space), "grad_clip": 1.0, "init_scale": 0.5}
    data = _export(task, params)
    model = _full_model(task)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    made = hydro.recipe(data, model)
    assert made.steps == task["steps"] and made.warmup == params["warmup"]
    assert made.batch_size == task["batch_size"] and made.grad_clip == 1.0
    assert made.model_settings == {"dropout": params["dropout"], "init_scale": 0.5}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched
    dropouts = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
    assert params["dropout"] not in dropouts
    # more steps: the warm-up keeps its length, the decay spans the rest
    longer = hydro.recipe(data, model, steps=1000)
    assert longer.steps == 1000 and longer.scheduler.lr_lambdas[0].steps == 1000
    assert longer.scheduler.lr_lambdas[0](params["warmup"]) == 1.0
    # parameter groups as torch.optim takes them
    groups = [{"params": [model.lm_head.weight], "weight_decay": 0.0}]
    opt, _ = hydro.recipe(data, groups)
    assert opt.param_groups[0]["weight_decay"] == 0.0
    assert opt.param_groups[0]["lr"] == pytest.approx(params["lr"] / (params["warmup"] + 1))
    # the scheduler keeps its schedule in its state_dict, so a checkpoint resumes it
    state = made.scheduler.state_dict()
    assert state["lr_lambdas"][0] == {"kind": "cosine", "steps": 200, "warmup": params["warmup"]}


@pytest.fixture
def tuned(tmp_path):
    """A two-trial study of a tiny model and its TuneResult."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    task = hydro.Task(
        model=torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3)),
        train_data=(x, y),
        val_data=(x, y),
        steps=6,
        eval_every=3,
        batch_size=16,
    )
    space = {
        "lr": optuna.distributions.FloatDistribution(1e-3, 1e-1, log=True),
        "warmup": optuna.distributions.IntDistribution(0, 3),
    }
    result = hydro.tune(
        task,
        space,
        n_trials=2,
        fuse=2,
        ratio=2,
        progress=False,
        storage=f"sqlite:///{tmp_path / 'tiny.db'}",
        study="tiny",
    )
    return result


def test_best_yaml_says_how_to_use_it_and_reads_everywhere(tuned, tmp_path, monkeypatch):
    path = tmp_path / "best.yaml"
    tuned.export(path)
    text = path.read_text()
    first, second = text.splitlines()[:2]
    assert first.startswith("# ") and 'hydro.recipe("best.yaml", model)' in first
    assert "docs/how-to/use-the-export.md" in first and not second.startswith("#")
    data = yaml.safe_load(text)
    assert set(data) >= {"hyperparameters", "training", "provenance"}
    assert read_export(path)[0] == data  # Hydro's own reader
    # the three doors give one recipe: the file, the dict read from it, the TuneResult
    model = torch.nn.Linear(8, 3)
    lrs = [_lrs(*hydro.recipe(best, model), 6) for best in (path, data, tuned)]
    assert lrs[0] == lrs[1] == lrs[2]
    # `hydro export` writes the comment too (naming its file), and JSON stays plain JSON
    monkeypatch.chdir(tmp_path)
    assert main(["export", "-o", "mine.yaml"]) == 0
    assert (tmp_path / "mine.yaml").read_text().startswith('# hydro.recipe("mine.yaml", model)')
    assert main(["export", "-o", "best.json"]) == 0
    assert json.loads((tmp_path / "best.json").read_text())["training"] == data["training"]
    assert read_export(str(tmp_path / "best.json"))[0]["training"] == data["training"]


def _good() -> dict:
    task, space = _example("charlm")
    return _export(task, _params(space))


def _edit(change) -> dict:
    data = _good()
    change(data)
    return data


@pytest.mark.parametrize(
    ("best", "words"),
    [
        ("no/such/best.yaml", "export file 'no/such/best.yaml' does not exist"),
        ([1, 2], "hydro.recipe reads an export"),
        ({"hyperparameters": {}}, "has no 'training' section (keys: hyperparameters)"),
        (_edit(lambda d: d["training"].pop("optimizer_args")), "training lacks optimizer_args"),
        (
            _edit(lambda d: d["training"].update(optimizer="lion")),
            "training.optimizer 'lion' is not one of adamw, adam, sgd",
        ),
        (
            _edit(lambda d: d["training"].update(scheduler="onecycle")),
            "training.scheduler 'onecycle' is not one of cosine, linear, step, none",
        ),
        (_edit(lambda d: d["training"].update(warmup="10")), "training.warmup must be an integer"),
        (
            _edit(lambda d: d["training"].update(warmup=200)),
            "training.warmup 200 must be shorter than the steps (200)",
        ),
        (
            _edit(lambda d: d["training"]["optimizer_args"].pop("lr")),
            "training.optimizer_args must be a mapping with a number 'lr'",
        ),
        (
            _edit(lambda d: d["training"]["optimizer_args"].update(momentum=0.9)),
            "training.optimizer_args do not fit torch.optim.AdamW",
        ),
        (
            _edit(lambda d: d["provenance"].update(hydro_version="99.0.0")),
            "provenance.hydro_version '99.0.0': written by a newer or unknown Hydro",
        ),
        (
            {"training": {"loop": "train:train", "steps": 10, "batch_size": 8}},
            "this export comes from your own training function (train:train)",
        ),
    ],
)
def test_a_malformed_export_names_what_is_wrong(best, words):
    with pytest.raises(ConfigError) as err:
        hydro.recipe(best, torch.nn.Linear(2, 2))
    assert words in str(err.value)


def test_a_malformed_file_is_named(tmp_path):
    bad = tmp_path / "best.yaml"
    bad.write_text("training: [unclosed\n")
    with pytest.raises(ConfigError, match=r"best.yaml is not a readable export \(invalid YAML"):
        hydro.recipe(bad, torch.nn.Linear(2, 2))
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="is not a Hydro export: it holds list"):
        hydro.recipe(str(bad), torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("optimizer", "scheduler", "warmup"),
    [
        ("adamw", "cosine", 3),
        ("adamw", "cosine", 0),
        ("adam", "linear", 2),
        ("sgd", "step", 0),
        ("sgd", "step", 4),
        ("adamw", "none", 2),
    ],
)
def test_the_recipe_is_each_trial_own_schedule(optimizer, scheduler, warmup):
    """The learning rate of every step is what Hydro's fused optimizer gave the trial."""
    from hydro.tuning.group import _optimizer, _scheduler

    params = {"lr": 0.02, "warmup": warmup, "weight_decay": 0.05}
    recipe = {"optimizer": optimizer, "scheduler": scheduler, "steps": 12, "batch_size": 4}
    data = {"training": training(params, recipe)}
    opt, sched = hydro.recipe(data, torch.nn.Linear(6, 3))
    xy = (torch.randn(4, 6), torch.zeros(4, dtype=torch.long))
    task = hydro.Task(
        model=torch.nn.Linear(6, 3),
        train_data=xy,
        val_data=xy,
        steps=12,
        optimizer=optimizer,
        scheduler=scheduler,
    )
    fused = hydro.fuse([torch.nn.Linear(6, 3)])
    hopt = _optimizer(task, fused, [params])
    hsched = _scheduler(task, hopt, [params])
    for step in range(12):
        theirs = float(hopt.param_groups[0]["lr"][0])
        assert opt.param_groups[0]["lr"] == pytest.approx(theirs, rel=1e-9, abs=1e-15), step
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sched.step()
        if hsched is not None:
            hsched.step()

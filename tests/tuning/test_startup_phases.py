"""While a run starts (workers importing torch, the first capture, the first fused step) its
progress says what it is doing in the ETA's place, instead of ``elapsed 0:00, eta ?``."""

from __future__ import annotations

import io

import optuna
import torch

import hydro
from hydro.tuning.progress import Progress


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("trial-steps")]


def test_a_phase_takes_the_eta_place_until_a_step_trains():
    now = [0.0]
    out = io.StringIO()
    study = optuna.create_study()
    bar = Progress(study, 4, lambda s: 0, steps=10, file=out, mode="lines", clock=lambda: now[0])
    now[0] = 75.0
    bar.phase("starting 2 workers")
    bar.phase("starting 2 workers")  # the same phase again: no new line
    now[0] = 130.0
    bar.phase("capturing the model")
    lines = _lines(out.getvalue())
    assert lines[0].endswith("elapsed 0:00, eta ?, best -")  # the first line, before any phase
    assert lines[1] == "trial-steps 0/40 (0%), trials 0/4, elapsed 1:15, starting 2 workers, best -"
    assert lines[2].endswith("elapsed 2:10, capturing the model, best -") and len(lines) == 3
    now[0] = 140.0
    bar.stepped(0, 1)
    bar.update(force=True)
    assert _lines(out.getvalue())[-1].endswith("eta ?, best -")  # training: no phase any more
    bar.phase("capturing the model again")  # after the first step: ignored
    assert "again" not in out.getvalue()
    text = bar.describe(None, now[0], plain=False)  # a bar's postfix says the same
    assert "capturing" not in text and "eta ?" in text


def _task() -> hydro.Task:
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    return hydro.Task(
        model=model, train_data=(x, y), val_data=(x, y), steps=4, eval_every=2, batch_size=16
    )


SPACE = {"lr": optuna.distributions.FloatDistribution(1e-3, 1e-1, log=True)}


def test_an_inline_run_says_it_captures_and_fuses_first(capsys, tmp_path):
    hydro.tune(
        _task(),
        SPACE,
        n_trials=2,
        fuse=2,
        ratio=2,
        progress=True,
        first_group=0,
        storage=f"sqlite:///{tmp_path / 'p.db'}",
    )
    lines = _lines(capsys.readouterr().err)
    phases = [line.split("elapsed ")[1].split(", ", 1)[1].rsplit(", best", 1)[0] for line in lines]
    assert phases[:3] == [
        "eta ?",
        "capturing the model and fusing a group of 2 trials",
        "first fused step",
    ]
    assert not any("capturing" in p or "first fused" in p for p in phases[3:])


def test_an_executor_run_says_its_workers_start(capsys, tmp_path):
    hydro.tune(
        _task(),
        SPACE,
        n_trials=2,
        fuse=2,
        ratio=2,
        progress=True,
        executor="local",
        storage=f"sqlite:///{tmp_path / 'p.db'}",
    )
    err = capsys.readouterr().err
    lines = _lines(err)
    said = [line for line in lines if "worker" in line]
    assert said and ", starting 1 worker, best -" in said[0], err
    assert any(
        "workers up: capturing the model and training to the first evaluation" in line
        for line in said
    ), err
    assert "eta" in lines[-1] and "worker" not in lines[-1]


def test_the_cli_says_it_captures_to_choose_the_ratio(tmp_path):
    from hydro.tuning.options import TuneOptions
    from hydro.tuning.run import run

    said: list[str] = []
    options = TuneOptions(
        n_trials=1, fuse=1, ratio="auto", progress=False, storage=f"sqlite:///{tmp_path / 'p.db'}"
    )
    run(_task(), SPACE, options, say=said.append)
    assert said[0].startswith("ratio auto: capturing the model to find the largest ratio")
    assert said[1].startswith("study 'hydro' in sqlite:///") and "ratio 2 (auto)" in said[1]
    said.clear()
    run(_task(), SPACE, options.replace(n_trials=2), say=said.append)  # resumed: its ratio kept
    assert len(said) == 1 and "ratio 2 (the study's)" in said[0]

"""``hydro report``'s figure: pruned trials drawn, axes that follow each distribution, bounded
time at 500 trials. Studies are made in memory with fake values (no training)."""

from __future__ import annotations

import math
import random
import time

import matplotlib
import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from hydro.tuning.report import _figure, write_report

matplotlib.use("Agg")

SPACE = {
    "lr": FloatDistribution(1e-4, 1e-1, log=True),
    "dropout": FloatDistribution(0.0, 0.3),
    "beta2": CategoricalDistribution([0.95, 0.99, 0.999]),
    "warmup": IntDistribution(0, 100, step=10),
}


def fake_study(n: int, seed: int = 0, first_prune: float = 0.6) -> optuna.Study:
    """``n`` trials over SPACE reporting at steps 25..100; from trial 5 on, a trial whose report
    is above 3 is pruned there (with chance ``first_prune`` at its first report, 0.15 later)."""
    rng = random.Random(seed)
    study = optuna.create_study(study_name="synthetic", sampler=optuna.samplers.RandomSampler(seed))
    for i in range(n):
        t = study.ask(SPACE)
        final = 2 + (math.log10(t.params["lr"]) + 2.3) ** 2 + 2 * t.params["dropout"]
        for j, step in enumerate((25, 50, 75, 100)):
            value = final + 3 * math.exp(-step / 30) + rng.gauss(0, 0.05)
            t.report(value, step)
            if i > 4 and value > 3 and rng.random() < (first_prune if j == 0 else 0.15):
                study.tell(t, state=TrialState.PRUNED)
                break
        else:
            study.tell(t, value)
    return study


def panels(figure) -> dict[str, object]:
    """The figure's axes by title, up to the first " (" (``"value per lr"``)."""
    return {ax.get_title().split(" (")[0]: ax for ax in figure.axes if ax.get_title()}


def gid(ax, name: str) -> list:
    return [a for a in ax.get_children() if a.get_gid() == name]


def test_every_pruned_trial_is_marked_at_its_last_report():
    study = fake_study(64)
    pruned = [t for t in study.trials if t.state == TrialState.PRUNED]
    at_first = [t for t in pruned if len(t.intermediate_values) == 1]
    assert len(pruned) > 10 and len(at_first) > 5  # most pruned at their first report
    curves = panels(_figure(study))["learning curves"]
    (marks,) = gid(curves, "pruned")
    got = sorted(map(tuple, marks.get_offsets().tolist()))
    want = sorted(
        (max(t.intermediate_values), t.intermediate_values[max(t.intermediate_values)])
        for t in pruned
    )
    assert got == pytest.approx(want)
    texts = [t.get_text() for t in curves.get_legend().get_texts()]
    complete = sum(t.state == TrialState.COMPLETE for t in study.trials)
    assert f"complete ({complete})" in texts
    (label,) = [t for t in texts if t.startswith(f"pruned ({len(pruned)})")]
    assert f"{len(at_first)} at step 25" in label  # how many stopped at each step


def test_history_and_parameter_panels_count_the_pruned_trials():
    study = fake_study(64)
    n_pruned = sum(t.state == TrialState.PRUNED for t in study.trials)
    fig = _figure(study)
    assert f"{n_pruned} pruned" in fig._suptitle.get_text()
    by_title = panels(fig)
    (history,) = gid(by_title["optimization history"], "pruned")
    assert len(history.get_offsets()) == n_pruned
    for name in SPACE:
        (rug,) = gid(by_title[f"value per {name}"], "pruned")
        assert len(rug.get_xdata()) == n_pruned  # where each pruned trial was tried


def test_parameter_axes_follow_their_distributions():
    study = fake_study(40)
    by_title = panels(_figure(study))
    lr, dropout = by_title["value per lr"], by_title["value per dropout"]
    assert lr.get_xscale() == "log" and dropout.get_xscale() == "linear"
    assert lr.get_xlim()[0] < 1e-4 and lr.get_xlim()[1] > 1e-1  # the searched range
    warmup = by_title["value per warmup"]
    assert warmup.get_xscale() == "linear"
    assert all(float(x).is_integer() for x in warmup.get_xticks())
    beta2 = by_title["value per beta2"]
    assert [t.get_text() for t in beta2.get_xticklabels()] == ["0.95", "0.99", "0.999"]
    (points,) = gid(beta2, "complete")
    # each choice's trials sit within a narrow band around its category's position
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    for (x, _), t in zip(points.get_offsets(), complete, strict=True):
        assert abs(x - SPACE["beta2"].choices.index(t.params["beta2"])) <= 0.15


def test_a_far_outlier_does_not_flatten_the_rest():
    study = fake_study(30, first_prune=0.0)
    t = study.ask(SPACE)
    t.report(1e4, 25)  # a diverged trial, pruned at its first report
    study.tell(t, state=TrialState.PRUNED)
    curves = panels(_figure(study))["learning curves"]
    assert curves.get_ylim()[1] < 100
    offsets = gid(curves, "pruned")[0].get_offsets()
    assert offsets[-1][1] == pytest.approx(curves.get_ylim()[1])  # drawn at the edge
    assert any("1 trial beyond the scale" in a.get_text() for a in curves.texts)


def test_five_hundred_trials_render_in_bounded_time(tmp_path):
    study = fake_study(500)
    start = time.perf_counter()
    write_report(study, str(tmp_path / "r.png"))
    assert time.perf_counter() - start < 20  # about 1 s on a laptop core
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_a_study_without_trials_or_reports_still_draws(tmp_path):
    study = optuna.create_study()
    write_report(study, str(tmp_path / "empty.png"))
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)  # no reports at all
    write_report(study, str(tmp_path / "plain.html"))
    assert "3 trials: 3 complete" in _figure(study)._suptitle.get_text()


def test_a_pruned_trial_without_reports_is_counted_and_a_maximized_study_draws(tmp_path):
    study = optuna.create_study(study_name="acc", direction="maximize")
    for i in range(6):
        t = study.ask(SPACE)
        t.report(0.1 * i, 1)
        study.tell(t, 0.1 * i + 0.05)
    study.tell(study.ask(SPACE), state=TrialState.PRUNED)  # told pruned before any report
    fig = _figure(study)
    curves = panels(fig)["learning curves"]
    texts = [t.get_text() for t in curves.get_legend().get_texts()]
    assert any(t.startswith("pruned (1)") and "1 pruned before any report" in t for t in texts)
    history = panels(fig)["optimization history"]
    (best_line,) = [ln for ln in history.get_lines() if ln.get_label() == "best so far"]
    assert list(best_line.get_ydata()) == pytest.approx([0.05, 0.15, 0.25, 0.35, 0.45, 0.55])
    write_report(study, str(tmp_path / "acc.html"))
    page = (tmp_path / "acc.html").read_text()
    assert "7 trials: 6 complete, 1 pruned" in page and "Red crosses: pruned trials" in page


def test_a_range_an_earlier_space_offered_stays_on_the_axis_and_none_is_a_choice():
    """A study whose float range changed between runs: every trial's value is inside the
    panel. (Optuna keeps one set of choices per categorical name.)"""
    study = optuna.create_study(study_name="changed")
    act = CategoricalDistribution([None, "relu"])
    old = {"act": act, "lr": FloatDistribution(1e-5, 1.0)}
    new = {"act": act, "lr": FloatDistribution(1e-3, 0.1)}
    for i, space in enumerate([old] * 3 + [new] * 3):
        t = study.ask(space)
        t.report(float(i), 1)
        study.tell(t, float(i))
    by_title = panels(_figure(study))
    assert [t.get_text() for t in by_title["value per act"].get_xticklabels()] == ["None", "relu"]
    lo, hi = by_title["value per lr"].get_xlim()
    assert all(lo <= t.params["lr"] <= hi for t in study.trials)
    assert by_title["learning curves"].get_xlim() == (0, 2)  # one step: whole numbers around it

"""Progress of a tuning run: counted in trial-steps, so a fused cohort whose trials all finish
at their last step still advances; a redrawn bar on a terminal, one plain line per update
elsewhere; an ETA from the measured step rate; nothing unless asked for (or on a terminal)."""

from __future__ import annotations

import io
import re

import optuna
import pytest

import hydro
import hydro.tuning.progress as progress_module
from hydro.errors import ConfigError
from hydro.tuning.progress import Eta, Progress, wanted
from tests.tuner_child import SPACE, make_task

optuna.logging.set_verbosity(optuna.logging.WARNING)

# before the first trained step a start-up phase ("capturing the model...") takes the ETA's place
LINE = re.compile(r"trial-steps (\d+)/(\d+) \((\d+)%\), trials (\d+)/(\d+), elapsed \d+:\d\d, "
                  r"(?:eta (\?|\d+:\d\d)|[a-z][^,]*), "
                  r"best( -| [^*,\s~]+|~[^*,\s]+\*)(, .*)?$")


def _lines(err: str) -> list[tuple[int, int, int, str, str]]:
    """(done, total, trials finished, eta, best) of each progress line; every one parses."""
    out = []
    for line in err.splitlines():
        if line.startswith("trial-steps"):
            m = LINE.match(line)
            assert m, line
            out.append((int(m[1]), int(m[2]), int(m[4]), m[6] or "?", m[7].strip()))
    return out


def test_piped_lines_advance_within_a_cohort_and_mark_the_interim_best(capsys):
    """Three fused trials finish together at step 8: the lines advance step by step before
    any completes, one per update (no carriage returns), with the best intermediate value
    marked until the first trial completes."""
    study = optuna.create_study()
    hydro.tune(make_task(8, eval_every=2), SPACE, n_trials=3, ratio=2, fuse=3, study=study,
               seed=0, progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = _lines(err)
    assert {total for _, total, _, _, _ in lines} == {24}
    dones, trials = [d for d, *_ in lines], [t for _, _, t, _, _ in lines]
    assert dones == sorted(dones) and trials == sorted(trials)
    before = [line for line in lines if line[2] == 0]  # no trial finished yet
    advancing = sorted({d for d, *_ in before if 0 < d < 24})
    assert len(advancing) >= 5, before  # the cohort's steps, not one jump at its end
    assert any(eta != "?" for *_, eta, _ in before)  # an ETA from the step rate, in the cohort
    interim = [best for *_, best in before if best.startswith("~")]
    assert interim and all(best == "-" or best.startswith("~") for *_, best in before)
    reported = {f"{v:.4g}" for t in study.trials for v in t.intermediate_values.values()}
    assert {best[1:-1] for best in interim} <= reported
    assert lines[-1][:3] == (24, 24, 3) and lines[-1][4] == f"{study.best_value:.4g}"
    assert err.index("top 3 of 3 complete trials") > err.rindex("trial-steps")


def test_bar_on_a_terminal_closes_before_the_table(capsys, monkeypatch):
    monkeypatch.setattr(progress_module, "interactive", lambda file: True)
    hydro.tune(make_task(4), SPACE, n_trials=6, ratio=2, fuse=3, storage="sqlite:///:memory:",
               seed=0)
    err = capsys.readouterr().err
    assert "\r" in err and "trial-steps: 100%" in err and "| 24/24, trials 6/6, " in err
    # the bar is closed (its last redraw ends with a newline) before the table, never after
    table = err[err.index("top 5 of 6 complete trials (minimize)") :].splitlines()
    assert "\r" not in "\n".join(table) and err[: err.index("top 5")].endswith("\n")
    assert table[1].split() == ["trial", "value", "lr", "weight_decay"]
    values = [float(row.split()[1]) for row in table[2:7]]
    assert len(values) == 5 and values == sorted(values)


def test_eta_from_the_step_rate_on_a_synthetic_clock():
    now = [0.0]
    eta = Eta(1000, clock=lambda: now[0])
    assert eta.observe(0) is None
    now[0] = 30.0  # start-up (capture, first batches): not part of the rate
    assert eta.observe(0) is None
    assert eta.observe(100) is None  # the first advance: the rate starts here
    now[0] = 40.0
    assert eta.observe(200) == pytest.approx(80.0)  # 100 steps / 10 s; 800 left
    now[0] = 50.0  # no report since (an executor reports at evaluations): counts down
    assert eta.observe(200) == pytest.approx(70.0)
    now[0] = 200.0
    assert eta.observe(200) == 0.0  # overdue: never negative
    assert eta.observe(600) == pytest.approx(400 * 170 / 500)  # 500 steps in 170 s since
    assert eta.observe(1000) == 0.0
    resumed = Eta(1000, clock=lambda: now[0])  # a resumed study: 700 done before this run
    assert resumed.observe(700) is None
    now[0] = 210.0
    assert resumed.observe(750) is None
    now[0] = 220.0
    assert resumed.observe(800) == pytest.approx(40.0)  # 50 steps / 10 s, not 800 / 20 s


def test_piped_lines_are_throttled():
    """A line per 5% of the run's trial-steps, or after 30 s with news, and one with the first
    ETA; never more."""
    now = [0.0]
    study = optuna.create_study()
    out = io.StringIO()
    bar = Progress(study, 10, lambda s: 0, steps=100, file=out, clock=lambda: now[0])
    assert bar.mode == "lines" and len(out.getvalue().splitlines()) == 1
    for step in range(1, 11):  # 10 of 1000 trial-steps: under 5%, within 30 s
        now[0] += 1.0
        if step % 5:
            bar.stepped(0, step)
            bar.update()
        else:  # an evaluation every 5 steps
            bar.reported(0, step, 2.0 - step / 100)
    lines = out.getvalue().splitlines()  # and the first ETA, at the first evaluation (1 step/s)
    assert lines[1:] == ["trial-steps 5/1000 (0%), trials 0/10, elapsed 0:05, eta 16:35, "
                         "best~1.95*"]
    for step in range(11, 61):  # 50 more: past 5% of the run since the last line
        now[0] += 0.01
        bar.stepped(0, step)
        bar.update()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[-1].startswith("trial-steps 55/1000 (6%), ")
    now[0] += 31.0
    bar.stepped(1, 1)
    bar.update()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and lines[-1].startswith("trial-steps 61/1000 (6%), trials 0/10, ")
    assert lines[-1].endswith(", best~1.9*")
    now[0] += 100.0
    bar.update()  # nothing new, however long since
    assert len(out.getvalue().splitlines()) == 4


def test_no_progress_prints_nothing(capsys):
    hydro.tune(make_task(4), SPACE, n_trials=3, ratio=2, fuse=3, storage="sqlite:///:memory:",
               seed=0, progress=False)
    out, err = capsys.readouterr()
    assert out == "" and err == ""


def test_auto_progress_is_off_off_a_terminal(capsys):
    """``progress=None`` (hydro.tune's default) shows progress only on a terminal."""
    hydro.tune(make_task(4), SPACE, n_trials=3, ratio=2, fuse=3, storage="sqlite:///:memory:",
               seed=0)
    out, err = capsys.readouterr()
    assert out == "" and err == ""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert wanted(None, Terminal()) and not wanted(None, io.StringIO())
    assert wanted(True) and not wanted(False)
    with pytest.raises(ConfigError, match=r"^progress must be True, False or None \(auto\), "
                       "got 'yes'$"):
        hydro.tune(make_task(4), SPACE, n_trials=3, storage="sqlite:///:memory:",
                   progress="yes")


def test_a_long_first_cohort_shows_an_eta_before_its_first_evaluation():
    """Without an evaluation the ETA appears once the measured rate covers 2% of the run (the
    README's main job evaluates first at 12% of its run)."""
    now = [0.0]
    out = io.StringIO()
    bar = Progress(optuna.create_study(), 10, lambda s: 0, steps=100, file=out,
                   clock=lambda: now[0])
    for step in range(1, 31):  # 10 trials fused: 10 trial-steps a second, no evaluation
        now[0] += 1.0
        for number in range(10):
            bar.stepped(number, step)
        bar.update()
    lines = _lines(out.getvalue())
    first = next(line for line in lines if line[3] != "?")
    assert 30 <= first[0] <= 40, lines  # the rate measured over >= 20 trial-steps (2%)
    assert first[3] == f"{(1000 - first[0]) // 10 // 60}:{(1000 - first[0]) // 10 % 60:02d}"

"""A study whose ratio takes layers below their width floor says so where its results are read:
the top of ``hydro tune``'s output, the export (a comment and ``provenance.below_floor``), the
report (page and figure), ``TuneResult.below_floor``; one within every floor says nothing."""

from __future__ import annotations

import warnings

import optuna
import pytest
import yaml

import hydro
from hydro.cli import main
from hydro.tuning.report import BELOW_FLOOR
from tests import toy

SPACE = {"lr": optuna.distributions.FloatDistribution(1e-3, 1e-1, log=True)}


@pytest.mark.parametrize("width, below", [(32, True), (64, False)])
def test_the_cli_says_it_first_and_the_export_and_report_keep_it(tmp_path, monkeypatch, capsys,
                                                                   width, below):
    config = toy.config("toymod", trials=2, ratio=2, steps=4, eval_every=2)
    toy.project(tmp_path, monkeypatch, "toymod", toy.source(width=width), config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scale's own warning: a script may silence it
        assert main(["tune", "tune.yaml", "-o", "best.yaml", "--no-progress"]) == 0
        assert main(["report", "-o", "report.html"]) == 0
    lines = capsys.readouterr().err.splitlines()
    said = [k for k, line in enumerate(lines) if line.startswith("BELOW THE WIDTH FLOOR")]
    text = (tmp_path / "best.yaml").read_text()
    best = yaml.safe_load(text)
    page = (tmp_path / "report.html").read_text()
    if not below:
        assert not said and "below_floor" not in best["provenance"]
        assert "BELOW THE WIDTH FLOOR" not in text + page
        return
    assert said == [1], lines[:3]  # right under the opening line
    assert "ratio 2 takes 2 layer(s)" in lines[1] and "'0' (linear): width 32 -> 16" in lines[1]
    assert text.splitlines()[1].startswith("# BELOW THE WIDTH FLOOR: ratio 2 took 2 layer(s)")
    assert best["provenance"]["below_floor"] == [
        "'0' (linear): width 32 -> 16, floor 32", "'2' (linear): width 32 -> 16, floor 32"]
    assert "BELOW THE WIDTH FLOOR: ratio 2 takes 2 layer(s)" in page


def test_python_results_and_the_figure_say_it(tmp_path):
    study = optuna.create_study()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = hydro.tune(toy.task(steps=4, eval_every=2), SPACE, n_trials=2, ratio=2, fuse=2,
                            study=study, progress=False)
    assert result.below_floor == study.user_attrs[BELOW_FLOOR] != []
    from hydro.tuning.report import _figure

    title = _figure(study)._suptitle
    assert "BELOW THE WIDTH FLOOR: 2 layer(s)" in title.get_text()
    within = optuna.create_study()
    result = hydro.tune(toy.task(width=64, steps=4, eval_every=2), SPACE, n_trials=2, ratio=2,
                        fuse=2, study=within, progress=False)
    assert result.below_floor == [] and "BELOW" not in _figure(within)._suptitle.get_text()

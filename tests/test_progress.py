"""Progress of a tuning run: a live tqdm bar and a top-5 table with progress=True, nothing
without."""

from __future__ import annotations

import optuna

import hydro
from tests.tuner_child import SPACE, make_task

optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_progress_bar_and_top_five_table(capsys):
    hydro.tune(make_task(4), SPACE, n_trials=6, ratio=2, fuse=3, storage="sqlite:///:memory:",
               seed=0, progress=True)  # fmt: skip
    out, err = capsys.readouterr()
    assert "trials:" in err and "6/6" in err and "best " in err and "trial/s" in err
    table = err[err.index("top 5 of 6 complete trials (minimize)") :].splitlines()
    assert table[1].split() == ["trial", "value", "lr", "weight_decay"]
    values = [float(row.split()[1]) for row in table[2:7]]
    assert len(values) == 5 and values == sorted(values)


def test_no_progress_prints_nothing(capsys):
    hydro.tune(make_task(4), SPACE, n_trials=3, ratio=2, fuse=3, storage="sqlite:///:memory:",
               seed=0, progress=False)  # fmt: skip
    out, err = capsys.readouterr()
    assert out == "" and err == ""

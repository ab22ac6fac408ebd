"""One set of options for a tuning run: the docs' table is the code's, the CLI's flags are the
table's, bad values are one clear error, and an option reaches the workers."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch

import hydro
from hydro.cli import build_parser
from hydro.errors import ConfigError
from hydro.tuning.loop import Loop
from hydro.tuning.options import TuneOptions
from tests.tuning import loops

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_table_is_the_code_table():
    page = (ROOT / "docs" / "reference" / "options.md").read_text()
    found = re.search(r"<!-- options-table:[^\n]*-->\n(.*?)\n<!-- /options-table -->", page, re.S)
    assert found, "docs/reference/options.md lost its generated table"
    assert found.group(1) == TuneOptions.table(), "regenerate the table: TuneOptions.table()"


def test_every_option_with_a_flag_is_a_flag_of_hydro_tune_with_its_help():
    parser = build_parser()
    tune = parser._subparsers._group_actions[0].choices["tune"]
    flags = {a.option_strings[0]: a for a in tune._actions if a.option_strings}
    for name, _, meta in TuneOptions.rows():
        if not meta["flag"]:
            continue
        action = flags[meta["flag"]]
        assert action.dest == name
        assert meta["help"].replace("%", "%%") in action.help
        assert action.default is None  # the config's value wins unless the flag is given
    args = parser.parse_args(["tune", "x.yaml", "--trials", "3", "--ratio", "auto",
                              "--matmul-precision", "high", "--force-resume"])
    assert (args.n_trials, args.ratio, args.matmul_precision, args.force_resume) == \
        (3, "auto", "high", True)


@pytest.mark.parametrize(("changes", "words"), [
    ({"n_trials": 0}, "n_trials must be a positive integer"),
    ({"fuse": 0}, "fuse must be an integer >= 1"),
    ({"timeout": -1}, "timeout must be a number of seconds"),
    ({"matmul_precision": "low"}, "matmul_precision must be highest, high or medium"),
    ({"world_size": 2}, "world_size 2 trains each group on several"),
    ({"policy": "nope"}, "nope"),
    ({"study": 3}, "study must be a name"),
    ({"catch": [3]}, "catch must hold exception classes"),
])
def test_bad_options_are_one_clear_error(changes, words):
    with pytest.raises(ConfigError, match=words):
        TuneOptions(**changes).validate()


def test_the_defaults_are_one_set():
    opts = TuneOptions()
    assert (opts.n_trials, opts.ratio, opts.fuse, opts.seed, opts.compile) == \
        (32, "auto", "auto", 0, False)


def test_an_option_reaches_the_workers(tmp_path):
    """matmul_precision is set where groups train: here in a worker process."""
    out = tmp_path / "precision"
    x, y = loops.data()
    train = functools.partial(loops.precision_train, path=str(out))
    loop = Loop(train=train, model=loops.mlp(), steps=2, train_data=(x, y),
                val_data=(x, y), batch_size=16)
    before = torch.get_float32_matmul_precision()
    hydro.tune(loop, {"lr": __import__("optuna").distributions.FloatDistribution(1e-3, 1e-1)},
               n_trials=2, fuse=2, ratio=2, executor="local", matmul_precision="medium",
               storage="sqlite:///:memory:")
    assert out.read_text() == "medium"
    assert torch.get_float32_matmul_precision() == before  # set in the worker, not here

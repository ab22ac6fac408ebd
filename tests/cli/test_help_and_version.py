"""`hydro --version` names Hydro's, torch's and Optuna's versions, and every help line of the
command states its default, the code's own (read from TuneOptions, never a copy)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch

from hydro._version import __version__
from hydro.cli import build_parser, main
from hydro.tuning.compiling import check_compile
from hydro.tuning.options import DEFAULT_STORAGE, TuneOptions

ROOT = Path(__file__).resolve().parents[2]


def _subcommand(name: str):
    return build_parser()._subparsers._group_actions[0].choices[name]


def _helps(name: str) -> dict[str, str]:
    """Flag -> its help line as `hydro NAME --help` prints it (wrapping undone)."""
    parser = _subcommand(name)
    formatter = parser._get_formatter()
    return {
        a.option_strings[-1]: " ".join(formatter._expand_help(a).split())
        for a in parser._actions
        if a.option_strings and a.help
    }


def test_version_names_hydro_torch_and_optuna(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"hydro {__version__} (")
    assert f"torch {torch.__version__.split('+')[0]}" in line
    assert f"optuna {optuna.__version__}" in line


def test_version_as_a_module_answers_without_importing_torch():
    code = (
        "import sys; from hydro.cli import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "assert 'torch' not in sys.modules and 'optuna' not in sys.modules"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"hydro {__version__} (torch ")
    done = subprocess.run(
        [sys.executable, "-m", "hydro.cli", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and f"optuna {optuna.__version__}" in done.stdout, done.stderr


@pytest.mark.parametrize("command", ["tune", "export", "report", "inspect", "coord-check"])
def test_every_help_line_states_its_default(command):
    for flag, text in _helps(command).items():
        if flag in ("--help",):
            continue
        assert "(default: " in text or "; default: " in text, f"hydro {command} {flag}: {text}"


def _parse(meta: dict, action, shown: str):
    """The value a flag would take from the text its help shows as the default."""
    if meta["kind"] == "flag":
        assert shown in ("on", "off")
        return shown == "on"
    if meta["kind"] == "compile":
        return check_compile(shown)
    return action.type(shown)


def test_tune_help_names_the_code_defaults():
    parser = _subcommand("tune")
    actions = {a.option_strings[-1]: a for a in parser._actions if a.option_strings}
    helps = _helps("tune")
    seen = 0
    for f in dataclasses.fields(TuneOptions):
        meta = dict(f.metadata)
        flag = meta["flag"] if meta["flag"] != "" else "--" + f.name.replace("_", "-")
        if flag is None:
            continue
        shown = TuneOptions.shown(f.name)
        assert f"(default: the config's, else {shown})" in helps[flag], helps[flag]
        if f.default is None:  # a description of what None stands for, never "none"
            assert meta["none"] and shown == meta["none"], f.name
        else:
            assert _parse(meta, actions[flag], shown) == f.default, (f.name, shown)
        assert helps[flag].count("default") == 1, f"{flag} states its default twice"
        seen += 1
    assert seen >= 20
    # the cases that read wrong before: compile is off, the storage is the SQLite file
    assert helps["--compile"].endswith("else off)") and TuneOptions().compile is False
    assert helps["--storage"].endswith(f"else {DEFAULT_STORAGE}, a file in the working directory)")
    assert re.search(r"else 32\)$", helps["--trials"]) and TuneOptions().n_trials == 32
    assert helps["--study"].endswith(f"else {TuneOptions().study})")


def test_other_help_defaults_are_the_parser_defaults():
    for command in ("export", "report", "inspect", "coord-check"):
        parser = _subcommand(command)
        helps = _helps(command)
        for action in parser._actions:
            if action.option_strings and action.default not in (None, argparse.SUPPRESS):
                flag = action.option_strings[-1]
                assert f"default: {action.default}" in helps[flag], (command, flag)

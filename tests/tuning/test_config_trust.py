"""The trust rule of a config (issue 36, point 2): your own code, and the installed packages the
config (or ``--trust``) names; anything else is refused before it is imported or called, with
one line naming it and how to trust it. The payloads are real: each would run a shell command
(``touch pwned``) if the named function were called with the config's arguments."""

from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest
import torch

from hydro.cli import main
from hydro.errors import ConfigError
from hydro.tuning import config
from hydro.tuning.trust import is_own_code, resolve_callable
from tests import toy
from tests.tuning.test_config_names import _refused

EXTRA = """
from sympy import sympify  # a re-export: its home is sympy, not this module
"""
TOY = toy.source(extra=EXTRA)
CONFIG = toy.config("toymod")


class Pwn:
    """Pickled, it runs ``touch pwned`` when it is loaded."""

    def __reduce__(self):
        import os

        return (os.system, ("touch pwned",))


@pytest.fixture
def project(tmp_path, monkeypatch):
    folder = toy.project(tmp_path, monkeypatch, "toymod", TOY)
    with open(folder / "payload.pt", "wb") as f:
        pickle.dump(Pwn(), f)
    np.save(folder / "payload.npy", np.array([Pwn()], dtype=object), allow_pickle=True)
    (folder / "payload.yaml").write_text("!!python/object/apply:os.system ['touch pwned']\n")
    return folder


def _write(project, data: str, args: str, top: str = "") -> None:
    text = CONFIG.replace("  data: toymod:data\n", f"  data: {data}\n  data_args: {args}\n")
    (project / "tune.yaml").write_text(top + text)


@pytest.mark.parametrize(
    "data, args, package",
    [
        ("sympy:sympify", "{a: \"__import__('os').system('touch pwned')\"}", "sympy"),
        ("yaml:unsafe_load", "{stream: \"!!python/object/apply:os.system ['touch pwned']\"}",
         "yaml"),
        ("torch:load", "{f: payload.pt, weights_only: false}", "torch"),
        ("numpy:load", "{file: payload.npy, allow_pickle: true}", "numpy"),
        ("torch.utils.cpp_extension:load_inline",
         "{name: x, cpp_sources: 'int f() { return 0; }'}", "torch"),
    ],
)
def test_an_installed_package_the_config_does_not_trust_is_refused(project, capsys, data, args,
                                                                   package):
    _write(project, data, args)
    err = _refused(capsys, ["tune", "tune.yaml"])
    assert f"tune.yaml: task.data: '{data}' names the installed package '{package}', which this " \
        f"config does not trust: add 'trust: [{package}]' to the config or pass --trust " \
        f"{package}." in err, err
    assert not (project / "pwned").exists()
    assert not (project / "toy.db").exists()  # refused before the study was opened


def test_a_re_exported_callable_is_judged_by_its_home(project, capsys):
    _write(project, "toymod:sympify", "{a: \"__import__('os').system('touch pwned')\"}")
    err = _refused(capsys, ["tune", "tune.yaml"])
    assert "'toymod:sympify' is a callable of the installed package 'sympy' (defined in " in err
    assert "add 'trust: [sympy]'" in err and not (project / "pwned").exists()


def test_trusting_a_package_lets_a_config_name_it(project, capsys):
    made = config.load
    (project / "tune.yaml").write_text("trust: [torch.nn]\n" + CONFIG.replace(
        "  model: toymod:model\n", "  model: torch.nn:Linear\n  model_args: {in_features: 8, "
        "out_features: 3}\n"))
    cfg = made("tune.yaml")
    assert isinstance(cfg.task.model(), torch.nn.Linear)
    # --trust adds to the config's list, and an entry covers its submodules only
    (project / "tune.yaml").write_text(CONFIG.replace(
        "  model: toymod:model\n", "  model: torch.nn:Linear\n  model_args: {in_features: 8, "
        "out_features: 3}\n"))
    with pytest.raises(ConfigError, match="names the installed package 'torch'"):
        made("tune.yaml")
    assert isinstance(made("tune.yaml", trust=["torch"]).task.model(), torch.nn.Linear)
    with pytest.raises(ConfigError, match="names the installed package 'torch'"):
        made("tune.yaml", trust=["torch.optim"])
    # through the command line, end to end
    assert main(["tune", "tune.yaml", "--trust", "torch", "--no-progress"]) == 0
    assert "best value" in capsys.readouterr().out


@pytest.mark.parametrize(
    "top, message",
    [
        ("trust: [os]\n", "trust: 'os' is a module of the standard library"),
        ("trust: 3\n", "trust must be a list of package names"),
        ("trust: ['torch; rm -rf']\n", "is not a package name"),
    ],
)
def test_a_bad_trust_list_is_one_line(project, capsys, top, message):
    (project / "tune.yaml").write_text(top + CONFIG)
    assert message in _refused(capsys, ["tune", "tune.yaml"])


def test_trusting_the_standard_library_from_the_command_line_is_refused(project, capsys):
    (project / "tune.yaml").write_text(CONFIG)
    assert "--trust: 'subprocess' is a module of the standard library" in _refused(
        capsys, ["tune", "tune.yaml", "--trust", "subprocess"]
    )


def test_own_code_is_found_without_importing_it(project):
    assert is_own_code("toymod") and "toymod" not in sys.modules
    assert not is_own_code("torch") and not is_own_code("json") and not is_own_code("sys")
    assert resolve_callable("toymod:model", "model")().__class__ is torch.nn.Sequential


def test_the_examples_need_no_trust():
    for name in ("charlm", "cnn", "hf_gpt2", "own_loop"):
        assert is_own_code(f"examples.{name}")

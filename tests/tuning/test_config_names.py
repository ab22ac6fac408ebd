"""What a config (or `hydro inspect`) may name: no way into the standard library, not even through
an attribute of another module; legitimate dotted names still resolve. Real configs, real CLI."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
import torch.utils.cpp_extension  # imported here: its import logs a CUDA line

from hydro.cli import main
from hydro.errors import ConfigError
from hydro.tuning import config
from hydro.tuning.config import resolve_callable

TOY = """
import functools
import logging
import subprocess
from collections import OrderedDict
from subprocess import run

import torch

def data(n=96):
    open("data_called", "w").close()  # a marker: the config's code was called
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(-1)
    return {"train": (x[:64], y[:64]), "val": (x[64:], y[64:])}

def build(width=16):
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 3))

small = functools.partial(build, width=16)  # a partial's own __module__ is functools
log = logging.getLogger("pkg")
evil = functools.partial(__import__("os").system, "touch pwned")
table = {}

class Zoo:
    class Inner:
        @staticmethod
        def build(width=32):
            return build(width)

    @classmethod
    def make(cls, width=32):
        return build(width)

class Box:
    @property
    def opener(self):
        open("property_read", "w").close()
        return build

box = Box()

class Data:
    @staticmethod
    def make(n=96):
        return data(n)
"""

CONFIG = """
study: names
trust: [torch]  # a trusted package still cannot lead into the standard library
storage: sqlite:///names.db
trials: 2
ratio: 2
fuse: 2
task:
  model: {model}
  data: {data}
  steps: 4
  eval_every: 2
space:
  lr: {{type: float, low: 1.0e-3, high: 1.0e-1, log: true}}
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text(TOY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("pkg", "pkg.mod"):  # each test imports its own copy
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


def _refused(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "key, spec, args, message",
    [
        ("data", "torch:os.system", "{command: 'touch pwned'}",
         "'torch:os.system' reaches the standard library module 'os' through the attribute 'os'"),
        ("data", "torch.utils.cpp_extension:subprocess.run", "{args: 'touch pwned', shell: true}",
         "reaches the standard library module 'subprocess' through the attribute 'subprocess'"),
        ("data", "os:system", "{command: 'touch pwned'}", "names the standard library module 'os'"),
        ("data", "builtins:eval", "{}", "names the standard library module 'builtins'"),
        ("model", "torch:__builtins__", "{}", "names a private attribute"),
        # the user's module imported subprocess.run: its home is still the standard library
        ("data", "pkg.mod:run", "{args: 'touch pwned', shell: true}",
         "'pkg.mod:run' is a callable of the standard library module 'subprocess'"),
        ("data", "pkg.mod:subprocess.run", "{args: 'touch pwned', shell: true}",
         "reaches the standard library module 'subprocess'"),
        ("data", "pkg:mod.data", "{}",
         "'pkg:mod.data' reaches the module 'pkg.mod' through an attribute; a module goes "
         "before the colon: name it pkg.mod:data"),
        ("model", "torch:nn", "{}", "reaches the module 'torch.nn' through an attribute"),
    ],
)
def test_a_config_cannot_reach_the_standard_library(project, capsys, key, spec, args, message):
    names = {"model": "pkg.mod:build", "data": "pkg.mod:data"}
    names[key] = spec
    text = CONFIG.format(**names).replace("  steps: 4", f"  steps: 4\n  {key}_args: {args}")
    (project / "tune.yaml").write_text(text)
    err = _refused(capsys, ["tune", "tune.yaml"])
    assert message in err and f"tune.yaml: task.{key}: " in err, err
    assert not (project / "pwned").exists()  # nothing named was called...
    assert not (project / "data_called").exists()  # ...not even the config's own data function
    assert not (project / "names.db").exists()


def test_loss_and_metric_are_refused_before_the_data_function_runs(project, capsys):
    for key in ("loss", "metric"):
        text = CONFIG.format(model="pkg.mod:build", data="pkg.mod:data")
        (project / "tune.yaml").write_text(text.replace("  steps: 4", f"  {key}: torch:os.system"))
        err = _refused(capsys, ["tune", "tune.yaml"])
        assert f"task.{key}: 'torch:os.system' reaches the standard library module 'os'" in err
        assert not (project / "data_called").exists()


@pytest.mark.parametrize(
    "spec, message",
    [
        ("torch:os.system", "model factory: 'torch:os.system' reaches the standard library "
                            "module 'os'"),
        ("torch.utils.cpp_extension:subprocess.run", "standard library module 'subprocess'"),
        ("pkg.mod:run", "is a callable of the standard library module 'subprocess'"),
        ("torch:nn.Linear", "a module goes before the colon: name it torch.nn:Linear"),
    ],
)
def test_inspect_refuses_the_same_names(project, capsys, spec, message):
    assert message in _refused(capsys, ["inspect", spec])


def test_legitimate_dotted_names_still_work(project, capsys):
    assert resolve_callable("torch.nn:Linear", "model", trust=["torch"]) is torch.nn.Linear
    assert resolve_callable("torch.nn.functional:cross_entropy", "loss", trust=["torch.nn"]) is (
        torch.nn.functional.cross_entropy
    )
    made = resolve_callable("pkg.mod:small", "model")
    assert isinstance(made, functools.partial) and made.keywords == {"width": 16}
    # a class's method (bound: its function's module counts), a nested class's static method
    assert isinstance(resolve_callable("pkg.mod:Zoo.make", "model")(), torch.nn.Sequential)
    assert main(["inspect", "pkg.mod:Zoo.Inner.build", "--ratio", "1"]) == 0
    assert "fewer parameters" in capsys.readouterr().out
    (project / "tune.yaml").write_text(CONFIG.format(model="pkg.mod:small",
                                                     data="pkg.mod:Data.make"))
    cfg = config.load("tune.yaml")
    assert cfg.task.model().state_dict()["0.weight"].shape == (16, 8)
    assert (project / "data_called").exists()  # a legitimate data function is called


def test_a_resolved_module_or_non_callable_is_refused(project):
    with pytest.raises(ConfigError, match="reaches the module 'torch.nn' through an attribute"):
        resolve_callable("torch:nn", "model", trust=["torch"])
    with pytest.raises(ConfigError, match="reads the property 'opener' of an object"):
        resolve_callable("pkg.mod:box.opener", "model")
    assert not (project / "property_read").exists()
    assert resolve_callable("pkg.mod:Box.opener.fget", "model")(None) is not None  # on a class
    with pytest.raises(ConfigError, match="model: torch:float32 is not callable"):
        resolve_callable("torch:float32", "model", trust=["torch"])
    # a standard-library class, bound method, C method or partial, reached from the user's module
    for spec, home in [("pkg.mod:OrderedDict", "collections"), ("pkg.mod:log.info", "logging"),
                       ("pkg.mod:table.get", "builtins"), ("pkg.mod:evil", "posix")]:
        with pytest.raises(ConfigError, match=f"callable of the standard library module '{home}'"):
            resolve_callable(spec, "model")

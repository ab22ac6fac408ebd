"""The examples in the docstrings run and print what they claim."""

import doctest
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import hydro_fluid

# every module of the package: a policy added in a module of its own has its example run too
ALL = sorted(m.name for m in pkgutil.walk_packages(hydro_fluid.__path__, "hydro_fluid."))
# these must have examples
MODULES = [
    "hydro_fluid.groups",
    "hydro_fluid.resources",
    "hydro_fluid.policy",
    "hydro_fluid.placement",
    "hydro_fluid.simulate",
    "hydro_fluid.profile",
    "hydro_fluid.executors.local",
    "hydro_fluid.executors.examples",
    "hydro_fluid.policies",
    "hydro_fluid.policies.base",
]


@pytest.mark.parametrize("name", ALL)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 or name not in MODULES, f"{name} has no examples"
    assert result.failed == 0


def test_import_needs_no_ray_and_exports_the_public_names():
    # In a fresh interpreter where Ray cannot be imported, the package still imports.
    code = "import sys; sys.modules['ray'] = None; import hydro_fluid; print('ok')"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(hydro_fluid.__file__).parents[1],
        timeout=120,
    )
    assert out.stdout.strip() == "ok", out.stderr

    for name in [
        "TrialGroup",
        "Device",
        "Cluster",
        "static_fluid",
        "dynamic_fluid",
        "simulate",
        "LocalExecutor",
        "RayExecutor",
        "fifo",
        "deadline",
    ]:
        assert name in hydro_fluid.__all__ and hasattr(hydro_fluid, name)
    # the lazy ones too (the executors, the coordinator), and submodules as attributes
    assert all(getattr(hydro_fluid, name) is not None for name in hydro_fluid.__all__)
    assert hydro_fluid.coordinator.PipelineJob is hydro_fluid.PipelineJob

"""What loads when: `hydro --help` and argument errors load no torch, `import hydro` is lazy.

The heavy libraries are checked in fresh processes: this test process has torch loaded already.
"""

from __future__ import annotations

import ast
import configparser
import gc
import json
import os
import pathlib
import subprocess
import sys

import pytest

import hydro

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEAVY = ("torch", "optuna", "ray", "matplotlib", "transformers", "numpy")

# runs hydro.cli.main (the console script's entry) on each argv in a fresh process and reports,
# for each, the exit code, stderr's first line and which heavy libraries were loaded by then
RUNNER = """
import contextlib, io, json, sys
from hydro.cli import build_parser, main
heavy = {heavy!r}
cases = json.loads(sys.argv[1])
subcommands = sorted(build_parser()._subparsers._group_actions[0].choices)
cases += [[name, "--help"] for name in subcommands]
out = []
for argv in cases:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    lines = err.getvalue().splitlines()
    out.append([argv, code, lines, [m for m in heavy if m in sys.modules]])
print(json.dumps({{"subcommands": subcommands, "results": out}}))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def test_the_console_script_is_hydro_cli_main():
    """The in-process runs below call the function the installed `hydro` command calls."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    scripts = cfg["options.entry_points"]["console_scripts"].split("\n")
    assert "hydro = hydro.cli:main" in [s.strip() for s in scripts]


def test_help_and_argument_errors_load_no_torch(tmp_path):
    cases = [
        (["--help"], 0, None),
        (["tune", "tune.yaml", "--bogus"], 2, "hydro: error: unrecognized arguments: --bogus"),
        (["tune", "tune.yaml", "--trials", "many"], 2, "argument --trials: must be an integer"),
        (["tune", "tune.yaml", "--ratio", "x"], 2, "argument --ratio: must be 'auto' or an"),
        (["tune", "tune.yaml", "--executor", "gpu"], 2, "argument --executor: invalid choice"),
        (["inspect"], 2, "the following arguments are required: model"),
        (
            ["tune", "missing.yaml"],
            2,
            "hydro tune: error: config file 'missing.yaml' does not exist: name a YAML config",
        ),
        (
            ["tune", str(tmp_path)],
            2,
            f"hydro tune: error: config file '{tmp_path}' is a directory",
        ),
        (["coord-check", "m:f", "--threshold", "1"], 2, "--threshold must be above 1"),
        (["coord-check", "m:f", "--ratios", "1,x"], 2, "--ratios must be integers"),
    ]
    (tmp_path / "tune.yaml").write_text("")  # exists: only the flag is wrong
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER.format(heavy=HEAVY), json.dumps([c[0] for c in cases])],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {"tune", "export", "report", "inspect", "coord-check"} <= set(report["subcommands"])
    results = report["results"]
    expected = cases + [([name, "--help"], 0, None) for name in report["subcommands"]]
    assert len(results) == len(expected)
    for (argv, code, lines, heavy), (_, want_code, want) in zip(results, expected):
        assert heavy == [], f"hydro {' '.join(argv)} imported {heavy}"
        assert code == want_code, (argv, lines)
        if want is not None:
            # argparse's own errors print the usage first; Hydro's checks print one line
            line = lines[-1] if want_code == 2 and "error:" in lines[-1] else lines[0]
            assert want in line, (argv, lines)
            assert not any("Traceback" in x for x in lines)
            if want.startswith("hydro tune: error: config file"):
                assert len(lines) == 1, lines


def test_module_run_of_the_cli_imports_no_torch():
    """`python -m hydro.cli tune --help` as a whole process: its import log names no torch."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hydro.cli", "tune", "--help"],
        env=_env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0 and "--trials" in proc.stdout, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
    assert "hydro.errors" in imported  # the log is complete: it names what the CLI imported
    assert not {m for m in imported if m.split(".")[0] in HEAVY}


def test_import_hydro_is_lazy_and_the_names_still_work():
    code = """
import sys
import hydro
assert not [m for m in {heavy!r} if m in sys.modules], sorted(sys.modules)
assert set(hydro.__all__) <= set(dir(hydro)) and "__version__" in dir(hydro)
assert "scaling" not in dir(hydro)  # a submodule is listed once imported, not before
scale = hydro.scale
import hydro.scaling
assert scale is hydro.scaling.scale and "scaling" in dir(hydro)
assert "torch" in sys.modules
from hydro import Task, fuse, tune
from hydro.fusion import fuse as fuse2
from hydro.tuning.task import Task as Task2
assert fuse is fuse2 and Task is Task2 and tune is sys.modules["hydro.tuning.tune"].tune
assert hydro.fusion.FusedModel is hydro.FusedModel  # a submodule as an attribute, as before
try:
    hydro.no_such_name
except AttributeError as exc:
    assert "no attribute 'no_such_name'" in str(exc)
else:
    raise AssertionError("hydro.no_such_name did not raise")
print("ok")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code.format(heavy=HEAVY)],
        env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize("name", hydro.__all__)
def test_every_public_name_resolves(name):
    value = getattr(hydro, name)
    assert value is not None
    assert getattr(hydro, name) is value  # cached: the second read is the same object


def test_a_command_loads_torch_with_the_collector_paused(tmp_path):
    """`hydro.cli.main` loads torch and Hydro with the garbage collector paused: no collection
    runs while they import (each full one traverses the hundreds of thousands of objects they
    leave). In a process that had not loaded torch (the console script's) what they leave is
    frozen, and the collector runs again for what comes after."""
    code = """
import gc, json, sys
seen = []  # per collection: did torch start loading, and had hydro.tuning.signals finished?
loaded = lambda: hasattr(sys.modules.get("hydro.tuning.signals"), "terminate_as_interrupt")
gc.callbacks.append(lambda phase, info: phase == "start" and seen.append(
    ["torch" in sys.modules, loaded()]))
from hydro.cli import main
code = main(["report", "--storage", "sqlite:///no-such.db", "--study", "x", "-o", "r.html"])
garbage = [[]]
garbage[0].append(garbage)  # a cycle made after the imports is still collected
del garbage
print(json.dumps({"code": code, "seen": seen, "enabled": gc.isenabled(),
                  "frozen": gc.get_freeze_count(), "collected": gc.collect(),
                  "torch": "torch" in sys.modules}))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path,
        env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["code"] == 2 and out["torch"] and out["enabled"]  # the storage is refused
    during = [s for s in out["seen"] if s == [True, False]]
    assert not during, f"{len(during)} collections while torch and Hydro loaded"
    assert out["frozen"] > 100_000 and out["collected"] >= 2


def test_collector_paused_freezes_only_when_asked():
    """A process that had torch loaded before `main` (this one) freezes nothing; the collector
    comes back as it was, an error inside included."""
    from hydro.cli import main
    from hydro.collector import collector_paused

    frozen = gc.get_freeze_count()
    assert main(["report", "--storage", "sqlite:///no-such.db", "--study", "x"]) == 2
    assert gc.get_freeze_count() == frozen and gc.isenabled()
    with pytest.raises(ValueError), collector_paused():
        assert not gc.isenabled()
        raise ValueError
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused(freeze=True):
            pass
        assert not gc.isenabled() and gc.get_freeze_count() == frozen  # left as it was found
    finally:
        gc.enable()


# --- the import graph -------------------------------------------------------------------------

PACKAGES = ("hydro", "hydro_fluid")


def _modules(root: pathlib.Path, packages: tuple[str, ...]) -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted name -> (file, is a package) for every module of ``packages`` under ``root``."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def import_graph(root: pathlib.Path, packages: tuple[str, ...] = PACKAGES):
    """Who imports whom among the modules of ``packages``, and the imports of a package's face
    from inside it.

    Every ``import`` and ``from ... import`` counts, at module level or inside a function,
    except under ``if TYPE_CHECKING:`` (never run). ``from pkg import name`` is an edge to
    the submodule ``pkg.name`` where there is one, else to ``pkg``. The parent packages Python
    runs first are not edges: ``hydro/__init__`` and ``hydro_fluid/__init__`` load lazily.

    Returns ``(graph, faces)``: module -> modules it imports; ``(module, line, statement)``
    for each ``import P`` / ``from P import ...`` of a package face ``P`` (``hydro``,
    ``hydro_fluid``) by any module but the face itself.
    """
    modules = _modules(root, packages)

    def resolve(name: str) -> str | None:  # the longest prefix that is one of the modules
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    faces = []
    for mod, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for node in ast.walk(tree)
                       if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                       for stmt in node.body for n in ast.walk(stmt)}
        here = mod if is_package else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
                faces += [(mod, node.lineno, f"import {t}") for t in targets
                          if t in packages and t != mod]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                if base in packages and base != mod:
                    faces.append((mod, node.lineno, f"from {base} import ..."))
                targets = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            graph[mod] |= {t for t in map(resolve, targets) if t and t != mod}
    return graph, faces


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_another_that_imports_it_back():
    graph, _ = import_graph(ROOT)
    assert len(graph) > 100  # the walk found the packages
    assert "hydro.tuning.verification" in graph["hydro.tuning.outputs"]  # and their imports
    assert _cycles(graph) == []


def test_no_module_imports_a_package_face():
    """``import hydro`` from a module of the packages runs the face from below (nine places
    did, most to read ``__version__``): modules import the module that defines what they use,
    the version comes from the leaf ``hydro._version``."""
    _, faces = import_graph(ROOT)
    assert faces == []


def test_the_graph_check_finds_a_circle_and_a_face_import(tmp_path):
    """What the two tests above would report on code that has either (the old code had five
    circles and nine imports of the face)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '1'\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nfrom pkg.sub import b\n"
                              "if TYPE_CHECKING:\n    from pkg import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import y\n")
    (pkg / "c.py").write_text("import os\nfrom .a import x\nfrom pkg import __version__\n")
    graph, faces = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"}
    assert _cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert faces == [("pkg.c", 3, "from pkg import ...")]

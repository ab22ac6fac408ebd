"""Start-up of the README's main job: time to its first fused step, phase by phase, with the
capture cache cold (an empty folder) and warm (a folder filled by one untimed run before).

Each figure is the median of fresh processes (``--runs``, 3 by default, in interleaved rounds)
that build the first fused group of ``examples/charlm/tune.yaml`` (16 trials at its ratio) from the
config and take one fused training step, as ``hydro tune examples/charlm/tune.yaml`` does first.
A phase is the time spent in its functions (``PHASES``), nested phases counted in their own
only: ``capture`` is ``torch.export`` or its load from the cache, ``scale`` the width analysis
and surrogate rebuild around it, ``members`` the 16 surrogates drawn from it, ``graph rewrite``
the fused graph built at the first forward, ``step`` the first step less that rewrite.
``import torch._dynamo`` is timed on its own (the first fake tensor, ``ShapeEnv`` or optimizer
step imports it, whichever comes first), so that no phase carries it.
The imports run as ``hydro tune`` runs them, ``import torch._dynamo`` included: with the
garbage collector paused and what they leave frozen (``hydro.collector.collector_paused``, which
``hydro.cli`` imports; a checkout without it imports with the collector running).
``to the first step`` counts from the interpreter's start to the first step's compute,
``total`` from after the imports to the end of the first step, ``next step`` is the second
step (what a step costs once warm). ``--baseline DIR`` (or ``NAME=DIR``, repeatable) measures
other checkouts of Hydro in the same rounds (``git archive <commit> | tar -x -C DIR``).

    python3 benchmarks/capture_cache.py [--runs 3] [--baseline [NAME=]DIR ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "charlm", "tune.yaml")


# the phases of the first fused step, each the time spent in these functions (nested ones
# counted in their own phase only): (phase, module, attribute path)
PHASES = (
    ("config", "hydro.tuning.config", "load"),
    ("group key", "hydro.tuning.group", "group_key"),
    ("target", "hydro.tuning.group", "_target"),
    ("validate", "hydro.tuning.task", "Task.validate"),
    ("capture", "hydro.fx.capture", "_export"),
    ("scale", "hydro.tuning.group", "build"),
    ("members", "hydro.tuning.group", "_Builder.make"),
    ("fuse", "hydro.tuning.group", "FusedModel|fuse"),  # the one the group calls
    ("graph rewrite", "hydro.fusion.model", "FusedModel._graph_for"),
    ("step", "hydro.tuning.group", "FusedGroup.step"),
)


def _instrument(spent: dict[str, float]) -> None:
    """Wrap each phase's function so that ``spent[phase]`` adds its own time (exclusive of the
    phases it calls)."""
    stack: list[list[float]] = []  # per open phase: [start, time in nested phases]

    def wrap(phase, fn):
        def timed(*a, **k):
            stack.append([time.perf_counter(), 0.0])
            try:
                return fn(*a, **k)
            finally:
                begun, nested = stack.pop()
                total = time.perf_counter() - begun
                spent[phase] = spent.get(phase, 0.0) + total - nested
                if stack:
                    stack[-1][1] += total

        return timed

    for phase, module, path in PHASES:
        for alternative in path.split("|"):
            owner = sys.modules[module]
            *outer, name = alternative.split(".")
            for part in outer:
                owner = getattr(owner, part)
            if hasattr(owner, name):
                setattr(owner, name, wrap(phase, getattr(owner, name)))
                break


def _child(start: float) -> dict:
    """One measurement in this (fresh) process."""
    import contextlib

    import hydro.cli  # the standard library only

    timings: dict[str, float] = {}
    paused = getattr(hydro.cli, "collector_paused", None)
    with paused(freeze=True) if paused else contextlib.nullcontext():
        t = time.perf_counter()
        import torch

        timings["import torch"] = time.perf_counter() - t
        t = time.perf_counter()
        import optuna

        timings["import optuna"] = time.perf_counter() - t
        t = time.perf_counter()
        import hydro
        import hydro.fusion.model
        import hydro.fx.capture  # phases patch it: its import is counted here
        from hydro.fx import cache
        from hydro.tuning import config
        from hydro.tuning.group import FusedGroup

        timings["import hydro"] = time.perf_counter() - t
        t = time.perf_counter()
        # imported by the first fake tensor, ShapeEnv or optimizer (add_param_group), whichever
        # comes first: timed on its own so that no phase carries it
        import torch._dynamo

        timings["import torch._dynamo"] = time.perf_counter() - t
    timings["imports"] = time.perf_counter() - start
    torch.set_num_threads(1)
    spent: dict[str, float] = {}
    _instrument(spent)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    cfg = config.load(CONFIG)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    members = []
    for i in range(int(cfg.fuse)):
        trial = study.ask(cfg.space)
        members.append((i, trial.params, i))
    group = FusedGroup(cfg.task, members, ratio=int(cfg.ratio))
    group.step()
    timings.update(spent)
    timings["total"] = time.perf_counter() - t0
    timings["other"] = timings["total"] - sum(spent.values())
    timings["process"] = time.perf_counter() - start
    timings["to the first step"] = timings["process"] - spent.get("step", 0.0)
    t = time.perf_counter()
    group.step()  # a step once warmed up: what the first one costs at least
    timings["next step"] = time.perf_counter() - t
    timings["hits"], timings["misses"] = cache.stats["hits"], cache.stats["misses"]
    timings["analysis hits"] = cache.stats.get("analysis_hits", 0)
    return timings


def _run(folder: str, code: str) -> dict:
    env = dict(os.environ, HYDRO_CACHE_DIR=folder, PYTHONPATH=code, OMP_NUM_THREADS="1")
    env.pop("HYDRO_CACHE", None)
    out = subprocess.run(
        [sys.executable, __file__, "--child"],
        env=env, capture_output=True, text=True, check=True, cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


ROWS = ("import torch", "import optuna", "import hydro", "import torch._dynamo",
        *(p[0] for p in PHASES), "other",
        "to the first step", "total", "process", "next step", "hits",
        "analysis hits")


def _load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--baseline", action="append", default=[],
                        help="another checkout of hydro (e.g. `git archive` of an earlier "
                        "commit): measured in the same rounds, interleaved; NAME=DIR names its "
                        "column, and the option may be given several times")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(START)))
        return
    codes = {}
    for i, given in enumerate(args.baseline):
        name, _, folder = given.rpartition("=") if "=" in given else ("", "", given)
        codes[name or ("before" if i == 0 else f"before{i + 1}")] = os.path.abspath(folder)
    codes["now"] = ROOT
    runs: dict[tuple[str, str], list[dict]] = {(c, s): [] for c in codes for s in ("cold", "warm")}
    print(f"load average at the start (1, 5, 15 min): {_load()}")
    for r in range(args.runs):  # rounds: every version and state once per round
        for (code, state), found in runs.items():
            with tempfile.TemporaryDirectory() as folder:
                if state == "warm":
                    _run(folder, codes[code])  # fills the cache
                found.append(_run(folder, codes[code]))
            print(f"  round {r + 1} {code:6} {state}: total {found[-1]['total']:.2f} s, "
                  f"process {found[-1]['process']:.2f} s", flush=True)
    cols = list(runs)
    print(f"\nload average at the end (1, 5, 15 min): {_load()}")
    print("\n| phase (s) | " + " | ".join(f"{c} {s}" for c, s in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for row in ROWS:
        meds = [statistics.median(r.get(row, 0.0) for r in runs[c]) for c in cols]
        cells = [f"{int(m)}" if row.endswith("hits") else f"{m:.2f}" for m in meds]
        print(f"| {row} | " + " | ".join(cells) + " |")
    print("\n" + ", ".join(f"{c}: {path}" for c, path in codes.items()))


if __name__ == "__main__":
    START = time.perf_counter()
    main()

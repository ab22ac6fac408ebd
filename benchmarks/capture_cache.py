"""What the capture cache saves: capture and the first fused step of the README's main job.

Every figure is the median of fresh processes (``--runs``, 3 by default), each with the cache
cold (an empty folder) or warm (a folder filled by one untimed run before):

* ``scale``: ``hydro.scale`` of examples/charlm's model as ``examples/charlm/tune.yaml`` builds
  it (4 layers, 256 wide, ratio 8), of which ``capture`` is the two ``torch.export`` calls or
  their loads;
* ``first step``: the first fused group of that job (16 trials, ratio 8) built from the config
  and one fused training step taken, as ``hydro tune examples/charlm/tune.yaml`` does first.

Seconds are counted from after the imports (``import torch`` alone takes seconds), and, for
``process``, from the start of the interpreter.

    python3 benchmarks/capture_cache.py [--runs 3]
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
    ("fuse", "hydro.tuning.group", "fuse"),
    ("graph rewrite", "hydro.fusion.model", "FusedModel._graph_for"),
    ("step", "hydro.tuning.group", "FusedGroup.step"),
)


def _instrument(spent: dict[str, float]) -> None:
    """Wrap each phase's function so that ``spent[phase]`` adds its own time (exclusive of the
    phases it calls)."""
    stack: list[list[float]] = []  # per open phase: [start, time in nested phases]

    def wrap(phase, fn):  # noqa: ANN001, ANN202
        def timed(*a, **k):  # noqa: ANN002, ANN003, ANN202
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
        owner = sys.modules[module]
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        setattr(owner, name, wrap(phase, getattr(owner, name)))


def _child(what: str, start: float) -> dict:
    """One measurement in this (fresh) process."""
    timings: dict[str, float] = {}
    t = time.perf_counter()
    import torch

    timings["import torch"] = time.perf_counter() - t
    t = time.perf_counter()
    import optuna

    timings["import optuna"] = time.perf_counter() - t
    t = time.perf_counter()
    import hydro
    import hydro.fusion.model
    import hydro.fx.capture
    from hydro.fx import cache
    from hydro.tuning import config
    from hydro.tuning.group import FusedGroup

    timings["import hydro"] = time.perf_counter() - t
    timings["imports"] = time.perf_counter() - start
    torch.set_num_threads(1)
    spent: dict[str, float] = {}
    _instrument(spent)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    cfg = config.load(CONFIG)
    if what == "scale":
        model = cfg.task.build_model()
        x = next(cfg.task.train_batches(2, seed=0))[0]
        hydro.scale(model, ratio=8, example_inputs=(x,))
    else:
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
    timings["hits"], timings["misses"] = cache.stats["hits"], cache.stats["misses"]
    return timings


def _run(what: str, folder: str) -> dict:
    env = dict(os.environ, HYDRO_CACHE_DIR=folder, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("HYDRO_CACHE", None)
    out = subprocess.run(
        [sys.executable, __file__, "--child", what],
        env=env, capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", choices=["scale", "step"])
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, START)))
        return
    rows = []
    for what, label in (("scale", "scale (capture)"), ("step", "first fused step")):
        for state in ("cold", "warm"):
            runs = []
            for _ in range(args.runs):
                with tempfile.TemporaryDirectory() as folder:
                    if state == "warm":
                        _run(what, folder)  # fills the cache
                    runs.append(_run(what, folder))
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append((label, state, med[what], med["capture"], med["process"], med["hits"]))
            print(f"  {label:18} {state}: {[round(r[what], 2) for r in runs]}", flush=True)
    print(f"\n| {'what':18} | cache | seconds | of which capture | process | cache hits |")
    print(f"|{'-' * 20}|-------|---------|------------------|---------|------------|")
    for label, state, total, cap, proc, hits in rows:
        print(f"| {label:18} | {state:5} | {total:7.2f} | {cap:16.2f} | {proc:7.2f} | "
              f"{int(hits):10d} |")  # fmt: skip


if __name__ == "__main__":
    START = time.perf_counter()
    main()

"""The GPU run in one script: what to measure the first time a GPU is lent, in at most 8 minutes.

Sections, in this order (the cheap and decisive first; each is skipped with a line when the
time left of ``--budget-s`` cannot hold what it is expected to need, :data:`NEEDS`; a section
that starts runs to its end, so the budget is a soft one):

0. **dropout**: the dropout draw on this device against the CPU's, bit for bit, and fused
   dropout's cost per element against torch's ``F.dropout`` (``benchmarks/dropout.py``).
1. **fusion**: one training step of ``n`` trials, as trial-steps per second, for the models of
   ``benchmarks/fusion.py --compile`` (the MLP of width 64 with 32 trials, the charlm GPT
   surrogate at ratio 8 and 4 with 16): ``n`` separate models one after another
   (``sequential``), PyTorch's own ensembling (``torch.func.stack_module_state``-style stacked
   parameters under ``vmap``), and ``hydro.fuse`` (``fused``), eager. The compiled rows come
   last (section 5).
2. **fuse auto**: the size ``fuse="auto"`` picks (:func:`hydro.tuning.sizing.fuse_size`) for
   the charlm example on this device, against the peak memory a group of that size measures
   over two steps (``torch.cuda.max_memory_allocated``; the CPU has no such counter: its row
   says so).
3. **data parallel**: with two GPUs or more, a fused group trained as two replicas over NCCL
   (:class:`hydro_fluid.LocalExecutor`, ``world_size=2``) against the same group on one device:
   the largest difference of the step losses and parameters. Fewer than two GPUs: skipped,
   with a line.
4. **end to end**: the short budget of ``benchmarks/end_to_end.py`` (its functions, in this
   process): plain Optuna on the full model against ``hydro.tune``, search time, trial-steps
   and the full model's final loss from each method's best configuration.
5. **precision**: a group of the charlm example at its config's ratio (``small``: the MLP)
   stepped under each ``Task.precision`` (fp32, bf16, fp16 with a loss scale per trial): ms
   per fused step, the speed against fp32, the first step's largest loss difference from fp32
   (same weights), and fp16's per-trial scales after the steps.
6. **compiled**: the fusion table's compiled rows: the vmap step through ``torch.compile``, the
   fused step compiled (``hydro.fuse(compile=True)``), and on a GPU the fused step with CUDA
   graphs (``compile="reduce-overhead"``: inductor records the step's kernels once per input
   shape and replays them; the shapes are static here). A row's ``compile s`` is its first
   call (cold caches take minutes: rows the budget cannot hold say so).

Every timing synchronizes the device after each step. The results go to ``DIR/gpu_suite.json``
(everything, with the device, torch and the time each section took) and
``DIR/gpu_suite.md`` (the tables). ``--device cpu --small`` runs every section at toy sizes in
well under a minute: the test suite runs it so that the script is known to work before a GPU
is.

    python benchmarks/gpu_suite.py --out results/gpu            # a GPU (cuda:0), ~8 minutes
    python benchmarks/gpu_suite.py --device cpu --small --out /tmp/suite
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import dropout as drop  # noqa: E402
import end_to_end as e2e  # noqa: E402
import fuse_auto  # noqa: E402
import fusion as B  # noqa: E402

BUDGET_S = 480  # 8 minutes on one GPU
# seconds a section is expected to need at most (GPU, full sizes): it starts only with this left
NEEDS = {"dropout": 20, "fusion eager": 60, "fuse auto": 30, "data parallel": 60, "end to end": 150,
         "precision": 30, "compiled": 45}


class Clock:
    """The suite's time budget: what is left, and whether a section still fits."""

    def __init__(self, budget_s: float) -> None:
        self.start, self.budget = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    def fits(self, need: float) -> bool:
        return self.left() >= need


def synced(step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``step`` followed by a device synchronization (a GPU's work is asynchronous: without
    it a timing measures the launches only)."""
    if device.type != "cuda":
        return step

    def run() -> None:
        step()
        torch.cuda.synchronize(device)

    return run


def models(small: bool) -> dict[str, tuple[Callable, int]]:
    """``name: (make, n)`` for the fusion table: ``benchmarks/fusion.py``'s compiled set, or
    (``small``) the MLP alone at ``n`` 4."""
    if small:
        return {"MLP w64": (B.mlp(64), 4)}
    return dict(B.COMPILED)


def compiled_builders(make: Callable, n: int, device: torch.device) -> dict[str, Callable]:
    """``method: build`` of the compiled rows: ``build()`` returns the step (compiling at its
    first call). CUDA graphs (inductor's ``mode="reduce-overhead"``: CUDA graph trees) on a
    GPU only."""
    builders = {"vmap": lambda: torch.compile(B.vmap_step(make, n)),
                "fused": lambda: B.compiled_pair(make, n, True)[0]}
    if device.type == "cuda":  # static shapes: the step's kernels recorded once, replayed
        builders["fused cudagraphs"] = lambda: cudagraph_steps(
            B.compiled_pair(make, n, "reduce-overhead")[0]
        )
    return builders


def cudagraph_steps(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` marked as a new iteration for CUDA graph trees at each call: its graphs then
    reuse their memory from the last step's (whose outputs are no longer read), whatever
    torch's heuristic makes of a forward, a backward and an optimizer step in one call."""

    def run() -> None:
        torch.compiler.cudagraph_mark_step_begin()
        step()

    return run


def fusion_table(device: torch.device, small: bool, clock: Clock) -> list[dict]:
    """Section 1: eager trial-steps per second per method and model (the module's notes)."""
    rows = []
    repeats, min_time = (2, 0.05) if small else (5, 0.5)
    for name, (make, n) in models(small).items():
        if not clock.fits(NEEDS["fusion eager"] / (4 if small else 1)):
            rows.append({"model": name, "n": n, "skipped": "time budget"})
            continue
        with torch.device(device):
            torch.manual_seed(0)
            steps = {
                "sequential": B.sequential_step(make, n),
                "vmap": B.vmap_step(make, n),
                "fused": B.compiled_pair(make, n, False)[0],
            }
            t = B.timed({k: synced(s, device) for k, s in steps.items()}, repeats, min_time)
        rows += [{"model": name, "n": n, "method": k, "mode": "eager", "trial_steps_per_s":
                  n / v, "ms_per_step": 1e3 * v} for k, v in t.items()]
    return rows


def compiled_table(device: torch.device, small: bool, clock: Clock) -> list[dict]:
    """Section 5: the compiled rows of the fusion table, last (a cold compile takes minutes),
    each only while :data:`NEEDS` ``["compiled"]`` seconds are left."""
    rows = []
    repeats, min_time = (2, 0.05) if small else (5, 0.5)
    for name, (make, n) in models(small).items():
        for method, build in compiled_builders(make, n, device).items():
            mode = "cudagraphs" if "cudagraphs" in method else "compiled"
            row = {"model": name, "n": n, "method": method.split()[0], "mode": mode}
            if not clock.fits(NEEDS["compiled"] / (4 if small else 1)):
                rows.append({**row, "skipped": "time budget"})
                continue
            try:
                with torch.device(device):
                    torch.manual_seed(0)
                    step = synced(build(), device)
                    start = time.perf_counter()
                    step()
                    row["compile_s"] = time.perf_counter() - start
                    v = B.timed({method: step}, repeats, min_time)[method]
                row.update(trial_steps_per_s=n / v, ms_per_step=1e3 * v)
            except Exception as exc:  # a backend that fails here is a finding
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            rows.append(row)
    return rows


def dropout_rows(device: torch.device, small: bool) -> dict:
    """Section 0: the dropout draw on this device equals the CPU's bit for bit (it relies on
    ``int32`` multiplies wrapping, and on little-endian halves), and its cost per element,
    forward + backward, against torch's ``F.dropout`` (``benchmarks/dropout.py``'s steps)."""
    from hydro.fusion import random as rng

    n, shapes = (4, [(2, 16, 15)]) if small else (16, [(8, 64, 64), (8, 64, 256)])
    keys = rng.stream_keys(torch.arange(n), torch.arange(n) * 7, 3)[2]
    same = all(torch.equal(rng.drop_bits(keys.to(device), s).cpu(), rng.drop_bits(keys, s))
               for s in shapes)
    repeats, min_time = (2, 0.02) if small else (5, 0.3)
    rows = []
    for shape in shapes:
        steps = drop.site_steps(n, shape, device)
        t = B.timed({k: synced(s, device) for k, s in steps.items()}, repeats, min_time)
        per = n * math.prod(shape)
        for m in ("torch", "streams v1", "streams"):
            both, fwd = t[f"{m} fwd+bwd"], t[f"{m} fwd"]
            rows.append({"shape": list(shape), "n": n, "method": m,
                         "fwd_bwd_ns_per_el": 1e9 * both / per, "fwd_ns_per_el": 1e9 * fwd / per,
                         "fwd_bwd_vs_torch": both / t["torch fwd+bwd"]})
    return {"same_as_cpu": same, "rows": rows}


def fuse_auto_row(device: torch.device, small: bool) -> dict:
    """Section 2: the size ``fuse="auto"`` picks for the charlm example (``small``: the MLP of
    ``benchmarks/fuse_auto.py`` with a budget of 16 MiB) against the measured peak."""
    from hydro.tuning.group import FusedGroup
    from hydro.tuning.sizing import fuse_size

    name = "mlp" if small else "charlm"
    task, params, ratio = fuse_auto.example(name)
    dev = str(device) if device.type != "cuda" else f"cuda:{device.index or 0}"
    size = fuse_size(task, params, ratio=ratio, device=dev, memory=1 / 64 if small else None)
    row: dict[str, Any] = {"example": name, "ratio": ratio, **size.as_dict(),
                           "predicted_bytes": size.used, "describe": size.describe()}
    members = [(k, dict(params), k) for k in range(size.n)]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    group = FusedGroup(task, members, ratio=ratio, device=dev)
    start = time.perf_counter()
    for _ in range(2):  # the optimizer's state exists from the first step: the second peaks
        group.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        row["measured_peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
        row["measured_over_predicted"] = row["measured_peak_bytes"] / max(size.used, 1)
        row["fits_budget"] = row["measured_peak_bytes"] <= size.budget
    else:
        row["measured_peak_bytes"] = None  # no allocator counter on the CPU
    row["two_steps_s"] = time.perf_counter() - start
    del group
    return row


def precision_rows(device: torch.device, small: bool) -> list[dict]:
    """Section 5: one group of the example stepped under each precision (see the module's
    docstring); each row times ``steps`` fused steps after a first one that builds the graphs."""
    import dataclasses

    from hydro.tuning.group import FusedGroup

    name = "mlp" if small else "charlm"
    task, params, ratio = fuse_auto.example(name)
    dev = str(device) if device.type != "cuda" else f"cuda:{device.index or 0}"
    n, steps = (4, 3) if small else (16, 10)
    members = [(k, {**params, "lr": float(params.get("lr", 1e-3)) * (1 + k / n)}, k)
               for k in range(n)]
    rows, first = [], None
    for precision in ("fp32", "bf16", "fp16"):
        group = FusedGroup(dataclasses.replace(task, precision=precision), members, ratio=ratio,
                           device=dev)
        step = synced(group.step, device)
        losses = group.step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        ms = (time.perf_counter() - start) / steps * 1e3
        first = losses if first is None else first
        row = {"example": name, "ratio": ratio, "n": n, "precision": precision, "ms_per_step": ms,
               "first_loss_diff": float((losses.float() - first.float()).abs().max())}
        if group.scales is not None:
            row["scales"] = sorted(set(group.scales.scales.tolist()))
        rows.append(row)
        del group
    for r in rows:
        r["speed_vs_fp32"] = rows[0]["ms_per_step"] / r["ms_per_step"]
    return rows


def _replica(steps: int, group: Any, ctx: Any) -> dict:
    """A worker's fn (module level: pickled by name): ``steps`` steps of a fused group of 4
    MLP trials on ``ctx.device``, as replica ``ctx.rank`` of ``ctx.world_size``."""
    from hydro.tuning.group import FusedGroup

    task, params, ratio = fuse_auto.example("mlp")
    members = [(k, {**params, "lr": params["lr"] * (1 + k)}, k) for k in range(4)]
    g = FusedGroup(task, members, ratio=ratio, device=ctx.device)
    g.distribute(ctx.rank, ctx.world_size)
    losses = [g.step().tolist() for _ in range(steps)]
    state = {k: v.detach().cpu().clone() for k, v in g.fused.state_dict().items()}
    return {"world_size": ctx.world_size, "losses": losses, "state": state}


def data_parallel_row(device: torch.device, small: bool, on_cpu: bool) -> dict:
    """Section 3: two replicas over NCCL (gloo with ``on_cpu``) against one device."""
    from hydro_fluid import LocalExecutor, TrialGroup

    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus < 2 and not on_cpu:
        return {"skipped": f"{gpus} GPU(s) visible: a data parallel group needs 2"}
    devices = [f"cuda:{k}" for k in range(2)] if gpus >= 2 else []
    steps = 3 if small else 10
    fn = functools.partial(_replica, steps)
    results = {}
    for world in (1, 2):
        ex = LocalExecutor(devices=devices[:world] if devices else [], num_workers=world,
                           threads=1)
        (res,) = ex.run([TrialGroup("dp", (0, 1, 2, 3), (steps,) * 4)], fn, world_size=world)
        if not res.ok:
            return {"error": res.error, "world_size": world}
        results[world] = res.value
    one, two = results[1], results[2]
    loss = max(abs(a - b) for sa, sb in zip(one["losses"], two["losses"]) for a, b in zip(sa, sb))
    # each parameter's difference relative to its size: Adam turns a rounding difference in a
    # near-zero gradient into a whole step of lr, so the largest element says little alone
    floats = [k for k in one["state"] if one["state"][k].is_floating_point()]
    rel = max(
        float(
            (one["state"][k].double() - two["state"][k].double()).norm()
            / one["state"][k].double().norm().clamp_min(1e-30)
        )
        for k in floats
    )
    param = max(float((one["state"][k].double() - two["state"][k].double()).abs().max())
                for k in floats)
    return {"backend": "nccl" if devices else "gloo", "steps": steps,
            "max_loss_diff": loss, "max_param_diff": param, "max_param_rel_diff": rel,
            "equal": loss <= 1e-4 and rel <= 1e-5}


def end_to_end_rows(device: torch.device, small: bool, out: Path) -> list[dict]:
    """Section 4: ``benchmarks/end_to_end.py``'s short budget, both searches in this process
    (capture cache in ``out``), and the full model trained from each one's best."""
    args = argparse.Namespace(budget="short", trials=32, ratio=4, fuse=16, width=256, layers=4,
                              heads=4, block=64, batch=None, steps=None, eval_every=None,
                              chars=None, seed=0, first_group="auto", storage="memory",
                              device=str(device), threads=torch.get_num_threads())
    if small:  # a toy search: every part runs, in seconds
        args.__dict__.update(trials=4, ratio=2, fuse=4, width=32, layers=1, heads=2, block=16,
                             batch=4, steps=4, eval_every=2, chars=4000)
    e2e.fill_budget(args)
    os.environ.setdefault("HYDRO_CACHE_DIR", str(out / "hydro-cache"))
    rows = []
    searches = {"plain": e2e.search_plain,
                "hydro": functools.partial(e2e.search_hydro, switches=set())}
    for method, search in searches.items():
        got = search(args)
        final = e2e.full_model_run(args, got["best"], e2e.check_seed(0, 0))
        rows.append({"method": method, "wall_s": got["wall"], "cpu_s": got["cpu"],
                     "first_eval_s": got["first_eval"], "trial_steps": got["states"]["trial_steps"],
                     "best": got["best"], "full_model_loss": final})
    plain = rows[0]
    for r in rows:
        r["speedup"] = plain["wall_s"] / r["wall_s"]
        r["gap"] = r["full_model_loss"] / plain["full_model_loss"] - 1
    return rows


def markdown(result: dict) -> str:
    """The tables of ``result`` (see :func:`main`) as markdown."""
    lines = [f"# GPU suite: {result['device_name']}", "",
             f"torch {result['torch']}, {result['device']}, {result['seconds']:.0f} s of "
             f"{result['budget_s']:.0f}", "", "## Fusion (trial-steps/s)", "",
             "| model | n | method | mode | trial-steps/s | ms/step | compile s | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["fusion"]:
        note = r.get("skipped") or r.get("error") or ""
        lines.append(
            f"| {r['model']} | {r['n']} | {r.get('method', '')} | {r.get('mode', '')} | "
            f"{r.get('trial_steps_per_s', math.nan):.1f} | {r.get('ms_per_step', math.nan):.2f} "
            f"| {r.get('compile_s', math.nan):.1f} | {note} |"
        )
    d = result["dropout"]
    lines += ["", "## Dropout per element (forward + backward, wall)", ""]
    if "rows" in d:
        lines += [f"The draw on this device equals the CPU's: {d['same_as_cpu']}", "",
                  "| per-trial shape | n | method | fwd+bwd ns/el | fwd ns/el | vs torch |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['n']} | {r['method']} | {r['fwd_bwd_ns_per_el']:.3f} | "
                  f"{r['fwd_ns_per_el']:.3f} | {r['fwd_bwd_vs_torch']:.2f}x |"
                  for r in d["rows"]]
    else:
        lines.append(d.get("skipped") or f"error: {d.get('error')}")
    a = result["fuse_auto"]
    lines += ["", "## fuse='auto' against the measured peak", ""]
    if "skipped" in a or "error" in a:
        lines.append(a.get("skipped") or a["error"])
    else:
        peak = a["measured_peak_bytes"]
        lines += ["| example | n | predicted MiB | measured MiB | measured / predicted | fits |",
                  "|---|---|---|---|---|---|",
                  f"| {a['example']} | {a['n']} | {a['predicted_bytes'] / 2**20:.1f} | "
                  + (f"{peak / 2**20:.1f} | {a['measured_over_predicted']:.2f} | "
                     f"{a['fits_budget']} |" if peak is not None
                     else "n/a (CPU) | n/a | n/a |"),
                  "", a["describe"]]
    d = result["data_parallel"]
    lines += ["", "## Data parallel (2 replicas against 1 device)", ""]
    if "max_loss_diff" in d:
        lines.append(f"{d['backend']}, {d['steps']} steps: largest loss difference "
                     f"{d['max_loss_diff']:.3g}, parameter difference {d['max_param_diff']:.3g}"
                     f" (relative to the parameter's norm {d['max_param_rel_diff']:.3g}); "
                     f"equal (loss 1e-4, parameters 1e-5 relative): {d['equal']}")
    else:
        lines.append(d.get("skipped") or f"error: {d.get('error')}")
    lines += ["", "## End to end (short budget)", ""]
    rows = result["end_to_end"]
    if isinstance(rows, dict):
        lines.append(rows.get("skipped") or f"error: {rows.get('error')}")
    else:
        lines += ["| method | search s | vs plain | trial-steps | full-model loss | gap |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['wall_s']:.1f} | {r['speedup']:.2f}x | "
                  f"{r['trial_steps']} | {r['full_model_loss']:.4f} | {r['gap']:+.2%} |"
                  for r in rows]
    rows = result.get("precision", {"skipped": "not run"})
    lines += ["", "## Precision (one fused group)", ""]
    if isinstance(rows, dict):
        lines.append(rows.get("skipped") or f"error: {rows.get('error')}")
    else:
        lines += ["| example | n | precision | ms/step | speed vs fp32 | first-step loss diff | "
                  "fp16 scales |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['example']} | {r['n']} | {r['precision']} | {r['ms_per_step']:.1f} | "
                  f"{r['speed_vs_fp32']:.2f}x | {r['first_loss_diff']:.2g} | "
                  f"{r.get('scales', '')} |" for r in rows]
    return "\n".join(lines) + "\n"


def _section(result: dict, key: str, clock: Clock, need: float, fn: Callable[[], Any]) -> None:
    """Run section ``key`` if ``need`` seconds are left; its time, or why not, is recorded."""
    if not clock.fits(need):
        result[key] = {"skipped": f"time budget ({clock.left():.0f} s left, {need:.0f} needed)"}
        return
    start = time.perf_counter()
    try:
        result[key] = fn()
    except Exception as exc:  # one section's failure must not lose the others
        result[key] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    result["section_s"][key] = time.perf_counter() - start
    print(f"{key}: {result['section_s'][key]:.1f} s", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> dict:
    """Run the suite; returns what it wrote to ``gpu_suite.json``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="toy sizes (the CPU smoke run)")
    p.add_argument("--out", default="gpu_suite_out", help="directory for the JSON and markdown")
    p.add_argument("--budget-s", type=float, default=BUDGET_S)
    p.add_argument("--no-compile", action="store_true", help="eager rows only")
    p.add_argument("--dp-on-cpu", action="store_true",
                   help="run the data parallel check with gloo on the CPU")
    p.add_argument("--skip", default="", help="comma-separated sections to leave out")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: this process sees no GPU; use --device cpu --small")
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
        # torch's default, said here: fp32 matmuls, so the figures and the data parallel check
        # are those of float32 whatever the environment set
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    clock, skip, scale = (
        Clock(a.budget_s),
        set(filter(None, a.skip.split(","))),
        0.1 if a.small else 1,
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    result: dict[str, Any] = {"device": str(device), "device_name": name or "cpu",
                              "torch": torch.__version__, "small": a.small,
                              "budget_s": a.budget_s, "section_s": {}}
    sections = [
        ("dropout", NEEDS["dropout"], lambda: dropout_rows(device, a.small)),
        ("fusion", NEEDS["fusion eager"], lambda: fusion_table(device, a.small, clock)),
        ("fuse_auto", NEEDS["fuse auto"], lambda: fuse_auto_row(device, a.small)),
        ("data_parallel", NEEDS["data parallel"],
         lambda: data_parallel_row(device, a.small, a.dp_on_cpu)),
        ("end_to_end", NEEDS["end to end"], lambda: end_to_end_rows(device, a.small, out)),
        ("precision", NEEDS["precision"], lambda: precision_rows(device, a.small)),
        ("compiled", NEEDS["compiled"], lambda: compiled_table(device, a.small, clock)),
    ]
    if a.no_compile:
        skip.add("compiled")
    for key, need, fn in sections:
        if key in skip:
            result[key] = {"skipped": "--skip" if key != "compiled" else "--no-compile"}
            continue
        _section(result, key, clock, need * scale, fn)
    for key in ("fusion", "compiled"):  # a table's own failure or skip, as one row
        if isinstance(result.get(key), dict):
            result[key] = [{"model": f"({key} rows)", "n": 0, **result[key]}]
    result["fusion"] = result["fusion"] + result.pop("compiled")
    result["seconds"] = time.perf_counter() - clock.start
    (out / "gpu_suite.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "gpu_suite.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()

"""The tuner's ``compile`` setting: whether a fused group trains through ``torch.compile``.

``compile=True`` (or a mode such as ``"max-autotune"``) compiles every group's fused model
(:meth:`hydro.fusion.FusedModel.compile`) and its optimizer's update; ``False`` trains eagerly;
``"auto"`` decides per group key at its first group, from measurements: the group's first
eager steps are timed, the compile time is estimated from the fused graph's size, and the
group compiles only where the time it would save over the fused steps left is more than twice
the compile estimate (:func:`decide`). The decision is said once per key, as one line.

The constants below were measured with ``python benchmarks/fusion.py --compile`` on a 2-core
CPU under load (docs/explanation/fusion.md, "Compiled fused step"): inductor's compile of a
fused training step as one graph (forward, backward and the optimizer's update,
:mod:`hydro.fusion.step`) is a
fixed cost (tracing, C++ compilation) plus a cost per node of the fused graph. Inductor's
on-disk FX graph cache and AOTAutograd's cache make a warm compile (a rerun, a later group of
the same structure) ~35x cheaper than a cold one on the charlm surrogate (395 to 11 s) and
~9x on the MLP anchor (50 to 5.6 s); the estimate is the cold one, so
"auto" errs towards eager.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from typing import Any

from hydro.errors import ConfigError
from hydro.tuning import compile_record

# compile seconds ~ BASE + PER_NODE * nodes of the fused graph (cold inductor cache), fitted to
# the whole training step as one graph (hydro.fusion.step: forward, backward and optimizer) of
# the MLP anchor (14 nodes: 55 s) and the charlm GPT surrogate (175 nodes: 451 s), on 2 cores
# under a load of ~8 (2026-11-26). Warm (inductor's and AOTAutograd's on-disk caches hit, a
# rerun or a later process: benchmarks/whole_step_compile.py) 5.6 s and 11 s, mostly the trace
COMPILE_BASE_S = 20.0
COMPILE_PER_NODE_S = 2.5
# compiled/eager fused step as one graph, about the GPT surrogate's 1.34x (wall and CPU time; its
# library kernels cap it at 1.62x on a CPU); the MLP anchor's is 2.3-2.5x
# (docs/explanation/fusion.md)
SPEEDUP = 1.3
MEASURED_STEPS = 3  # eager steps timed after the first (which builds the graphs)
FORMS = "True/'on', False/'off', 'auto', or a torch.compile mode ('default', 'max-autotune', ...)"


def check_compile(value: Any, where: str = "compile") -> bool | str:
    """``value`` as the tuner takes it: ``True``, ``False``, ``"auto"`` or a mode string.

    Raises:
        ConfigError: anything else, naming the accepted values.
    """
    from hydro.fusion.compiled import MODES

    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        low = value.lower()
        if low in ("on", "true"):
            return True
        if low in ("off", "false"):
            return False
        if low == "auto" or low in MODES:
            return low
    raise ConfigError(f"{where} must be {FORMS}; got {value!r}")


@functools.cache
def unavailable() -> str | None:
    """Why ``torch.compile`` cannot compile here (``None``: it can): inductor on a CPU needs a
    C++ compiler, checked once by compiling a one-op function."""
    import torch

    from hydro.fusion.compiled import quiet_cuda_home

    quiet_cuda_home()
    try:
        fn = torch.compile(lambda x: x * 2 + 1, backend="inductor", fullgraph=True)
        if not torch.equal(fn(torch.ones(3)), torch.full((3,), 3.0)):
            return "torch.compile gave a wrong result on a one-op check"
    except Exception as exc:  # any failure means: do not compile
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"torch.compile cannot run here ({type(exc).__name__}: {first})"
    return None


def estimate_compile_seconds(nodes: int) -> float:
    """Cold compile seconds of a fused training graph of ``nodes`` nodes and its optimizer."""
    return COMPILE_BASE_S + COMPILE_PER_NODE_S * nodes


def decide(
    eager_step_s: float, fused_steps_left: float, compile_s: float, speedup: float = SPEEDUP
) -> tuple[bool, str]:
    """Whether compiling pays: the seconds it saves over the steps left, ``steps_left x
    eager_step x (1 - 1/speedup)``, must exceed twice the compile estimate. Returns the
    decision and the line that says it.

    Example:
        >>> decide(0.74, 400, 45.0, speedup=1.5)[1]
        'compile: auto -> on (eager step 0.74 s x ~400 fused steps left = 296 s; compile est. 45 s, pays back after ~183 steps)'
    """  # noqa: E501
    saved_per_step = eager_step_s * (1.0 - 1.0 / speedup)
    on = fused_steps_left * saved_per_step > 2.0 * compile_s
    payback = math.ceil(compile_s / saved_per_step) if saved_per_step > 0 else math.inf
    return on, (
        f"compile: auto -> {'on' if on else 'off'} (eager step {eager_step_s:.2f} s x "
        f"~{fused_steps_left:.0f} fused steps left = {eager_step_s * fused_steps_left:.0f} s; "
        f"compile est. {compile_s:.0f} s, pays back after ~{payback} steps)"
    )


def time_eager_step(group: Any, start: float) -> None:
    """``compile="auto"``: time an eager step; after a few, decide and say so."""
    if str(group.device).startswith("cuda"):
        _sync(group.device)
    group._timings.append(time.perf_counter() - start)
    if len(group._timings) < MEASURED_STEPS:
        return
    step_s = statistics.median(group._timings)
    group._timings = None
    left = max(group._trials_left * group.task.steps / max(group.n, 1) - group.steps, 0.0)
    graphs = group.fused._graphs.values()
    nodes = sum(len(gm.graph.nodes) for gm in graphs)
    k = compile_record.key((gm.code for gm in graphs), group.n, group.device, True)
    measured = compile_record.load(k)
    if measured is None:
        on, line = decide(step_s, left, estimate_compile_seconds(nodes))
    else:  # what compiling this graph took (and gave) here last time: inductor caches it
        speedup = measured["speedup"] or SPEEDUP
        on, line = decide(step_s, left, measured["compile_s"], speedup)
        said = "measured here before" if measured["speedup"] else \
            "compile measured here before, speed-up assumed"
        line += f"; {said} (x{speedup:.2f})"
    if on and unavailable():
        on, line = False, f"compile: auto -> off ({unavailable()})"
    group._note(line)
    group.compile = on
    if on:
        compile_record.use_private_inductor_cache()
        group.fused.compile(True)
        group.opt.set_compile(True)  # its compiled update, from now on
        group._compiled = {"key": k, "mode": True, "eager_s": step_s, "times": []}


def time_compiled_step(group: Any, start: float) -> None:
    """After ``compile="auto"`` turned on: the first compiled step (which compiles) and a
    few more, kept as what compiling this graph cost and bought here
    (:mod:`hydro.tuning.compile_record`)."""
    if str(group.device).startswith("cuda"):
        _sync(group.device)
    c = group._compiled
    c["times"].append(time.perf_counter() - start)
    if c["key"] is None:  # compile=True: the graphs exist once the first step built them
        graphs = group.fused._graphs.values()
        c["key"] = compile_record.key((gm.code for gm in graphs), group.n, group.device, c["mode"])
    if len(c["times"]) <= MEASURED_STEPS:
        return
    group._compiled = None
    step_s = statistics.median(c["times"][1:])
    speedup = c["eager_s"] / max(step_s, 1e-9) if c["eager_s"] else None
    compile_record.store(c["key"], c["times"][0] - step_s, speedup)


def _sync(device: Any) -> None:
    import torch

    torch.cuda.synchronize(device)

"""Training throughput of n trials: sequential vs torch.func.vmap vs HFTA-style vs hydro.fuse.

Prints trial-steps per second (one trial-step = forward, backward and Adam step of one trial)
for n in 1, 4, 16, 32, 64 on a few models, all measured side by side in this run (medians of
several interleaved rounds), plus the fused model's achieved GFLOP/s against a large-matmul peak
measured in the same run. The HFTA-style column is a hand-written fused model in the manner of
the HFTA paper (``baddbmm`` linears, grouped convolutions with the trials' channels kept stacked
between layers, per-trial hyperparameters as broadcast tensors) trained with ``hydro.optim.Adam``;
the baddbmm column (MLPs only) is the MLP written by hand as directly as it goes (three
``baddbmm`` on ``[n, B, F]``, one cross-entropy over all trials). Ratios are given by wall time
and by this process's CPU time (``cpu``), and the ATen ops each step dispatches are counted.

    python benchmarks/fusion.py              # the full table
    python benchmarks/fusion.py --quick      # fewer models and n, for a smoke run
    python benchmarks/fusion.py --compile    # compiled fused step: two graphs, one graph, eager
    python benchmarks/fusion.py --anchors    # MLP/CNN/GPT at n 16, 32 and 1, 2 threads
    python benchmarks/fusion.py --optimizer  # optimizer step alone: old loop vs now vs compiled
    python benchmarks/fusion.py --convs      # one convolution: n separate vs one grouped
    python benchmarks/fusion.py --loss       # trial_loss cross-entropy: rows vs [n, C, B]
    python benchmarks/fusion.py --phases     # MLP step by phase: hydro.fuse vs baddbmm
    python benchmarks/fusion.py --anchors --before-rev REV  # also REV's fusion rewrite, beside
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import statistics
import subprocess
import sys
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydro.fusion.model
import hydro.fusion.ops as hydro_ops
import hydro.optim
from examples.charlm.model import GPT
from examples.models import ResNet
from hydro.fusion import fuse, trial_loss
from hydro.scaling import scale


def mlp(width: int) -> Callable[[], tuple[nn.Module, tuple, torch.Tensor, Callable]]:
    def make():
        model = nn.Sequential(
            nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, 10),
        )
        return model, (torch.randn(64, 32),), torch.randint(0, 10, (64,)), F.cross_entropy

    return make


def cnn():
    model = ResNet(width=16)
    return model, (torch.randn(32, 3, 16, 16),), torch.randint(0, 10, (32,)), F.cross_entropy


def gpt_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def gpt_surrogate():
    idx = torch.randint(0, 96, (8, 32))
    target = GPT(n_layer=2, n_head=8, n_embd=256, block_size=32, dropout=0.0)
    model = scale(target, ratio=4, example_inputs=(idx,))  # n_embd 256 -> 64, muP
    return model, (idx,), torch.randint(0, 96, (8, 32)), gpt_loss


MODELS = {
    "MLP w64": mlp(64),
    "MLP w256": mlp(256),
    "MLP w1024": mlp(1024),
    "CNN+BN": cnn,
    "GPT surrogate": gpt_surrogate,
}


def LRS(n: int) -> list[float]:  # a constant-like helper
    """A different learning rate per trial, as in a real study."""
    return [1e-3 * (1 + k / n) for k in range(n)]


def calibrate(step: Callable[[], None], min_time: float) -> int:
    """Warm ``step`` up and return how many calls make a run of at least ``min_time`` seconds."""
    step()
    step()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_time:
        step()
        calls += 1
    return max(1, calls)


def timed(
    steps: dict[str, Callable[[], None]],
    repeats: int,
    min_time: float,
    cpu: dict[str, float] | None = None,
) -> dict[str, float]:
    """Median seconds per call of each step (wall), measured in interleaved rounds; ``cpu``,
    where given, receives the medians of this process's CPU time per call
    (``time.process_time``: what other processes' load inflates least).

    Round r times every method once, so a burst of load from other processes hits all methods
    alike instead of one of them.
    """
    calls = {name: calibrate(step, min_time) for name, step in steps.items()}
    samples: dict[str, list[float]] = {name: [] for name in steps}
    cpu_samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(calls[name]):
                step()
            samples[name].append((time.perf_counter() - start) / calls[name])
            cpu_samples[name].append((time.process_time() - start_cpu) / calls[name])
    if cpu is not None:
        cpu.update({name: statistics.median(values) for name, values in cpu_samples.items()})
    return {name: statistics.median(values) for name, values in samples.items()}


class OpCount(TorchDispatchMode):
    """Counts the ATen ops dispatched inside the block (views included)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def aten_ops(step: Callable[[], None]) -> int:
    """ATen ops one call of ``step`` dispatches (after a warm-up call)."""
    step()
    with OpCount() as counter:
        step()
    return counter.count


# The kernels a compiler calls as they are (library GEMMs, attention): what it cannot speed up
EXTERN = ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward",
          "_scaled_dot_product_flash_attention_for_cpu",
          "_scaled_dot_product_flash_attention_for_cpu_backward")


class ExternCalls(TorchDispatchMode):
    """Records the :data:`EXTERN` calls dispatched inside the block, with their tensors'
    shapes, strides and dtypes, for :func:`extern_replay`."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in EXTERN:

            def meta(x):
                if isinstance(x, torch.Tensor):
                    return ("tensor", tuple(x.shape), x.stride(), x.dtype, x.storage_offset())
                return x

            self.calls.append(
                (func, [meta(a) for a in args], {k: meta(v) for k, v in kwargs.items()})
            )
        return func(*args, **kwargs)


def extern_replay(step: Callable[[], None]) -> Callable[[], None]:
    """The library kernels one call of ``step`` runs (:class:`ExternCalls`), replayed alone on
    tensors of the same shapes and strides: their time is what no compiler of the step removes."""
    step()
    with ExternCalls() as recorder:
        step()

    def real(x):
        if isinstance(x, tuple) and x and x[0] == "tensor":
            _, shape, stride, dtype, offset = x
            size = offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0)
            base = torch.randn(size, dtype=dtype) if dtype.is_floating_point else torch.zeros(
                size, dtype=dtype)
            return base.as_strided(shape, stride, offset)
        if isinstance(x, list):
            return [real(v) for v in x]
        return x

    calls = [(f, [real(a) for a in args], {k: real(v) for k, v in kw.items()})
             for f, args, kw in recorder.calls]

    def replay() -> None:
        for f, args, kw in calls:
            f(*args, **kw)

    return replay


def sequential_step(make, n: int) -> Callable[[], None]:
    built = [make() for _ in range(n)]
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for (m, *_), lr in zip(built, LRS(n))]

    def step() -> None:
        for (model, x, y, loss_fn), opt in zip(built, opts):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(*x), y).backward()
            opt.step()

    return step


def vmap_step(make, n: int) -> Callable[[], None]:
    built = [make() for _ in range(n)]
    _, x, y, loss_fn = built[0]
    # (stack_module_state refuses GraphModules: each has a class of its own)
    models = [m for m, *_ in built]
    params = {
        name: torch.stack([m.get_parameter(name).detach() for m in models]).requires_grad_()
        for name, _ in models[0].named_parameters()
    }
    buffers = {
        name: torch.stack([m.get_buffer(name) for m in models])
        for name, _ in models[0].named_buffers()
    }
    base = copy.deepcopy(built[0][0])
    for gm in getattr(base, "graphs", {}).values():
        # a captured graph views tensors whose layout vmap changes: reshape is the same
        # computation where the view was valid, and also valid under vmap
        for node in gm.graph.nodes:
            if node.target is torch.ops.aten.view.default:
                node.target = torch.ops.aten.reshape.default
        gm.recompile()

    def one(p, b, *inputs):
        return torch.func.functional_call(base, (p, b), inputs)

    forward = torch.func.vmap(one, in_dims=(0, 0) + (None,) * len(x), randomness="different")
    opt = hydro.optim.Adam(list(params.values()), lr=LRS(n))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = forward(params, buffers, *x)
        torch.func.vmap(loss_fn, in_dims=(0, None))(out, y).sum().backward()
        opt.step()

    return step


def fused_step(make, n: int, rewrite: types.ModuleType | None = None) -> Callable[[], None]:
    """``hydro.fuse`` + ``hydro.optim.Adam``; ``rewrite``: the graph built by another revision's
    rewrite (:func:`rewrite_at`), for a before/after comparison in one process."""
    built = [make() for _ in range(n)]
    _, x, y, loss_fn = built[0]
    fused = fuse([m for m, *_ in built])
    opt = hydro.optim.Adam(fused.parameters(), lr=LRS(n))
    forward = fused

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        trial_loss(loss_fn, forward(*x), y).sum().backward()
        opt.step()

    if rewrite is not None:
        with building_with(rewrite):
            step()  # captures and builds (and caches) the graph with that revision's rewrite
    return step


def charlm_surrogate(ratio: int = 8):
    """The charlm GPT of examples/charlm/tune.yaml (4 layers, 256 wide, block 64) at ``ratio``
    (8: 32 wide; 4, the example's: 64 wide; muP), batch 32."""
    idx = torch.randint(0, 96, (32, 64))
    target = GPT(n_layer=4, n_head=4, n_embd=256, block_size=64, dropout=0.1)
    model = scale(target, ratio=ratio, example_inputs=(idx,))
    return model, (idx,), torch.randint(0, 96, (32, 64)), gpt_loss


def compiled_pair(
    make, n: int, compile: object, whole: bool = False
) -> tuple[Callable[[], None], object]:
    """One fused training step (forward, per-trial losses, backward, AdamW) built with
    ``fuse(compile=compile)`` and the optimizer's matching ``compile``, as forward, backward and
    ``opt.step()`` or, with ``whole``, as :func:`hydro.fusion.step.train_step`'s one graph; and
    the fused model."""
    from hydro.fusion.step import train_step

    torch.manual_seed(0)
    built = [make() for _ in range(n)]
    _, x, y, loss_fn = built[0]
    fused = fuse([m for m, *_ in built], compile=compile)
    opt = hydro.optim.AdamW(fused.parameters(), lr=LRS(n), compile=bool(compile))

    def losses(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return trial_loss(loss_fn, out, target)

    if whole:
        graph = train_step(fused, opt, losses)

        def step() -> None:
            graph(x, y)
            if graph.reason is not None:
                raise RuntimeError(f"the whole-step graph does not apply: {graph.reason}")

        return step, fused

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        losses(fused(*x), y).sum().backward()
        opt.step()

    return step, fused


def graph_call(fused) -> Callable[[], None]:
    """The whole-step graph's compiled callable alone, on the inputs of its last call: the
    step less :class:`~hydro.fusion.step.TrainStep`'s Python (input gathering, key, lookup).
    Call after the step ran once with :func:`record_graph_inputs` in place."""
    fn, inputs = fused._compiler.hydro_last_call

    def call() -> None:
        with torch.no_grad():
            fn(*inputs)

    return call


def record_graph_inputs(fused) -> None:
    """Wrap the compiled whole-step graphs of ``fused`` to keep their last inputs."""
    compiler = fused._compiler
    for key, fn in list(compiler._steps.items()):

        def recording(*inputs: torch.Tensor, fn: Callable = fn) -> object:
            compiler.hydro_last_call = (fn, inputs)
            return fn(*inputs)

        compiler._steps[key] = recording


COMPILED = {"MLP w64": (mlp(64), 32), "GPT charlm r8": (charlm_surrogate, 16),
            "GPT charlm r4": (functools.partial(charlm_surrogate, 4), 16)}


def compile_table(args: argparse.Namespace) -> None:
    """Compiled fused step vs eager, medians of interleaved rounds (wall and CPU time): the
    two-graph step (compiled forward and backward, compiled update) and the whole step as one
    graph (:mod:`hydro.fusion.step`); that graph's compiled callable alone (``graph call``: the
    whole step less its Python); the step's library kernels (GEMMs, attention:
    :func:`extern_replay`) replayed alone, and the ceiling they leave a compiler (eager /
    library kernels); the whole step's compile seconds cold (an empty inductor cache) and warm
    (a second model of the same structure: inductor's on-disk FX graph cache hit), each its
    first step's wall time less an eager step."""
    import os
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="hydro-bench-inductor-")
    print(
        "| model | n | threads | nodes | eager ms | two-graph ms | whole ms | graph call ms | "
        "two-graph speed-up | whole speed-up | whole speed-up cpu | library kernels ms | "
        "ceiling | whole compile s cold | whole compile s warm |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.models or list(COMPILED):
            make, n = COMPILED[name]
            eager, _ = compiled_pair(make, n, False)
            eager()
            start = time.perf_counter()
            eager()
            t_eager = time.perf_counter() - start
            first = {}
            for run in ("cold", "warm"):  # the whole step first: its cold compile is cold
                whole, fused = compiled_pair(make, n, True, whole=True)
                start = time.perf_counter()
                whole()
                first[run] = time.perf_counter() - start - t_eager
            record_graph_inputs(fused)
            whole()
            two, _ = compiled_pair(make, n, True)
            two()
            two()  # the optimizer's compiled path settles after its first step
            cpu: dict[str, float] = {}
            steps = {"eager": eager, "two": two, "whole": whole, "call": graph_call(fused),
                     "extern": extern_replay(eager)}
            t = timed(steps, args.repeats, args.min_time, cpu)
            nodes = sum(len(gm.graph.nodes) for gm in fused._graphs.values())
            print(f"| {name} | {n} | {threads} | {nodes} | {1e3 * t['eager']:.1f} | "
                  f"{1e3 * t['two']:.1f} | {1e3 * t['whole']:.1f} | {1e3 * t['call']:.1f} | "
                  f"{t['eager'] / t['two']:.2f}x | {t['eager'] / t['whole']:.2f}x | "
                  f"{cpu['eager'] / cpu['whole']:.2f}x | {1e3 * t['extern']:.1f} | "
                  f"{t['eager'] / t['extern']:.2f}x | "
                  f"{first['cold']:.0f} | {first['warm']:.0f} |", flush=True)


def _source_at(rev: str, path: str) -> str | None:
    done = subprocess.run(
        ["git", "show", f"{rev}:{path}"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
    )
    return done.stdout if done.returncode == 0 else None


def _module_at(
    rev: str, path: str, name: str, extra: dict, replace: dict | None = None
) -> types.ModuleType:
    source = _source_at(rev, path)
    if source is None:
        raise FileNotFoundError(f"{path} at {rev}")
    module = types.ModuleType(name)
    module.__dict__.update(extra)
    sys.modules[name] = module  # dataclasses look their module up
    source = source.replace("from hydro.fusion import ops\n", "")
    for old, new in (replace or {}).items():
        source = source.replace(old, new)
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def rewrite_at(rev: str) -> types.ModuleType:
    """``hydro/fusion/rewrite.py`` with its ``ops.py`` (and ``handlers.py``, ``facts.py``,
    ``kinds.py``, ``stacked.py``, where the revision has them) as of git revision ``rev``: the
    fused graphs as that revision built them (the rest of ``hydro`` is this tree's)."""
    tag = rev.replace("/", "_").replace("-", "_").replace("~", "_").replace("^", "_")
    ops = _module_at(rev, "hydro/fusion/ops.py", f"hydro_fusion_ops_{tag}", {})
    replace = {}
    if _source_at(rev, "hydro/fusion/facts.py") is not None:
        facts = f"hydro_fusion_facts_{tag}"
        _module_at(rev, "hydro/fusion/facts.py", facts, {})
        replace["from hydro.fusion.facts import"] = f"from {facts} import"
    if _source_at(rev, "hydro/fusion/handlers.py") is not None:
        handlers = f"hydro_fusion_handlers_{tag}"
        own_ops = {
            "from hydro.fusion import factories, ops\n": "from hydro.fusion import factories\n"
        }
        _module_at(rev, "hydro/fusion/handlers.py", handlers, {"ops": ops}, own_ops)
        replace["from hydro.fusion.handlers import"] = f"from {handlers} import"
    for part in ("kinds", "stacked"):  # split out of rewrite.py (2026-11-26)
        if _source_at(rev, f"hydro/fusion/{part}.py") is not None:
            name = f"hydro_fusion_{part}_{tag}"
            _module_at(rev, f"hydro/fusion/{part}.py", name, {"ops": ops}, dict(replace))
            replace[f"from hydro.fusion.{part} import"] = f"from {name} import"
    return _module_at(
        rev, "hydro/fusion/rewrite.py", f"hydro_fusion_rewrite_{tag}", {"ops": ops}, replace
    )


@contextlib.contextmanager
def building_with(rewrite: types.ModuleType):
    """Fused graphs built inside this block come from ``rewrite`` (cached by the model after)."""
    saved = hydro.fusion.model.fuse_graph
    hydro.fusion.model.fuse_graph = rewrite.fuse_graph
    try:
        yield
    finally:
        hydro.fusion.model.fuse_graph = saved


# --- HFTA-style anchors: hand-written fused models -----------------------------------------------


def _stack(tensors: list[torch.Tensor], like: torch.Tensor | None = None) -> nn.Parameter:
    """A fused parameter ``[n, ...]``; keeps ``like``'s muP infshape for hydro.optim."""
    p = nn.Parameter(torch.stack([t.detach() for t in tensors]).contiguous())
    if like is not None and hasattr(like, "infshape"):
        p.infshape = like.infshape
    return p


class HftaMLP(nn.Module):
    """n MLPs ``Linear/ReLU/.../Linear``: one ``baddbmm`` per layer over ``[n, B, features]``."""

    def __init__(self, models: list[nn.Module]) -> None:
        super().__init__()
        layers = [i for i, m in enumerate(models[0]) if isinstance(m, nn.Linear)]
        self.w = nn.ParameterList(_stack([m[i].weight.t() for m in models]) for i in layers)
        self.b = nn.ParameterList(_stack([m[i].bias[None] for m in models]) for i in layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.expand(len(self.w[0]), *x.shape)  # the shared batch, read by every trial
        for j, (w, b) in enumerate(zip(self.w, self.b)):
            h = torch.baddbmm(b, h, w)
            if j < len(self.w) - 1:
                h = F.relu(h)
        return h


class HftaCNN(nn.Module):
    """n ``examples.models.ResNet``: channels of all trials stacked ``[B, n * C, H, W]`` from
    the first convolution (one convolution with ``n * C`` filters on the shared input) to the
    pooling; grouped convolutions (``groups=n``) and one BatchNorm over ``n * C`` channels."""

    def __init__(self, models: list[nn.Module]) -> None:
        super().__init__()
        self.n = len(models)
        convs = [(m.stem[0], m.body[0], m.body[3]) for m in models]
        bns = [(m.stem[1], m.body[1], m.body[4]) for m in models]
        self.convs = nn.ParameterList(_stack([c[j].weight for c in convs]) for j in range(3))
        self.gammas = nn.ParameterList(_stack([b[j].weight for b in bns]) for j in range(3))
        self.betas = nn.ParameterList(_stack([b[j].bias for b in bns]) for j in range(3))
        for j in range(3):
            self.register_buffer(f"mean{j}", torch.cat([b[j].running_mean for b in bns]))
            self.register_buffer(f"var{j}", torch.cat([b[j].running_var for b in bns]))
        self.strides = [c.stride for c in convs[0]]
        self.head_w = _stack([m.head.weight.t() for m in models])
        self.head_b = _stack([m.head.bias[None] for m in models])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for j, (w, g, b) in enumerate(zip(self.convs, self.gammas, self.betas)):
            groups = 1 if j == 0 else self.n  # the first layer reads the shared input once
            h = F.conv2d(h, w.flatten(0, 1), stride=self.strides[j], padding=1, groups=groups)
            mean, var = getattr(self, f"mean{j}"), getattr(self, f"var{j}")
            h = F.relu(F.batch_norm(h, mean, var, g.flatten(), b.flatten(), True, 0.1, 1e-5))
        pooled = h.mean(dim=(2, 3)).view(h.shape[0], self.n, -1).transpose(0, 1)
        return torch.baddbmm(self.head_b, pooled, self.head_w)


class HftaGPT(nn.Module):
    """n charlm GPT surrogates: ``baddbmm`` projections over ``[n, B * T, C]``, one SDPA over
    ``[n * B, heads, T, d]``, an embedding table ``[n * V, C]`` with per-trial row offsets, the
    tied readout as one ``bmm`` with the muP readout multiplier."""

    def __init__(self, models: list[nn.Module]) -> None:
        super().__init__()
        m0 = models[0]
        self.n = len(models)
        self.layers = len(
            {name.split(".")[1] for name, _ in m0.named_parameters() if name[:2] == "h."}
        )
        self.readout = float(m0.get_buffer("mup_readout.scale"))  # the muP readout multiplier
        self.wte = _stack([m.wte.weight for m in models], m0.wte.weight)
        self.wpe = _stack([m.wpe.weight for m in models], m0.wpe.weight)
        params = {}
        for name, p in m0.named_parameters():
            if name.startswith("h.") or name.startswith("ln_f"):
                ts = [m.get_parameter(name) for m in models]
                if name.endswith("weight") and p.dim() == 2:
                    params[name] = _stack([t.t() for t in ts], p)  # [n, in, out]
                elif name.endswith("bias") and "ln" not in name:
                    params[name] = _stack([t[None] for t in ts], p)  # [n, 1, out]
                else:
                    params[name] = _stack(ts, p)  # LayerNorm affine [n, C]
        self.p = nn.ParameterDict({k.replace(".", "_"): v for k, v in params.items()})
        self.vocab, self.c = m0.wte.weight.shape
        # the captured surrogate's head count (a view to (B, T, heads, C // heads))
        self.heads = next(
            node.args[1][2]
            for node in m0.graphs["train"].graph.nodes
            if node.target is torch.ops.aten.view.default and len(node.args[1]) == 4
        )

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w, b = self.p[f"{name}_weight"], self.p[f"{name}_bias"]
        return torch.addcmul(b[:, None], F.layer_norm(x, (self.c,)), w[:, None])

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.baddbmm(self.p[f"{name}_bias"], x, self.p[f"{name}_weight"])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n, (b, t), c, heads = self.n, idx.shape, self.c, self.heads
        offsets = torch.arange(n, device=idx.device)[:, None, None] * self.vocab
        x = F.embedding(idx[None] + offsets, self.wte.view(n * self.vocab, c))
        x = (x + self.wpe[:, None, :t]).view(n, b * t, c)
        for i in range(self.layers):
            qkv = self._lin(self._ln(x, f"h_{i}_ln_1"), f"h_{i}_attn_c_attn")
            q, k, v = qkv.view(n * b, t, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).reshape(n, b * t, c)
            x = x + self._lin(y, f"h_{i}_attn_c_proj")
            h = F.gelu(self._lin(self._ln(x, f"h_{i}_ln_2"), f"h_{i}_mlp_c_fc"))
            x = x + self._lin(h, f"h_{i}_mlp_c_proj")
        x = self._ln(x, "ln_f") * self.readout
        return torch.bmm(x, self.wte.transpose(1, 2)).view(n, b, t, self.vocab)


def baddbmm_step(name: str, make, n: int) -> Callable[[], None]:
    """The MLP written by hand as directly as it goes: weights ``[n, in, out]``, biases ``[n, 1,
    out]``, one ``baddbmm`` per layer on ``[n, B, F]`` (the shared input a stride-0 view), one
    ``F.cross_entropy`` over all trials, ``hydro.optim.Adam``."""
    if not name.startswith("MLP"):
        raise ValueError(f"no hand-written baddbmm model for {name}")
    built = [make() for _ in range(n)]
    _, (x,), y, _ = built[0]
    w1, w2, w3 = (_stack([m[i].weight.t() for m, *_ in built]) for i in (0, 2, 4))
    b1, b2, b3 = (_stack([m[i].bias[None] for m, *_ in built]) for i in (0, 2, 4))
    opt = hydro.optim.Adam([w1, b1, w2, b2, w3, b3], lr=LRS(n))
    xs = x.expand(n, *x.shape)
    targets = y.repeat(n)

    def forward() -> torch.Tensor:
        h = torch.relu(torch.baddbmm(b1, xs, w1))
        h = torch.relu(torch.baddbmm(b2, h, w2))
        return torch.baddbmm(b3, h, w3)

    with torch.no_grad():
        torch.testing.assert_close(forward()[n - 1], built[n - 1][0](x), rtol=1e-4, atol=1e-5)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = forward()
        (F.cross_entropy(out.view(targets.numel(), -1), targets) * n).backward()
        opt.step()

    return step


def hfta_model(name: str, models: list[nn.Module]) -> nn.Module:
    if name.startswith("MLP"):
        return HftaMLP(models)
    if name == "CNN+BN":
        return HftaCNN(models)
    if name == "GPT surrogate":
        return HftaGPT(models)
    raise ValueError(f"no HFTA-style model for {name}")


def hfta_step(name: str, make, n: int) -> Callable[[], None]:
    built = [make() for _ in range(n)]
    _, x, y, loss_fn = built[0]
    model = hfta_model(name, [m for m, *_ in built])
    with torch.no_grad():  # the anchor computes what the n models compute
        out = model(*x)
        for k in (0, n - 1):
            torch.testing.assert_close(out[k], built[k][0](*x), rtol=1e-4, atol=1e-5)
    opt = hydro.optim.Adam(model.parameters(), lr=LRS(n))
    targets = y.reshape(-1).repeat(n)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = model(*x)
        # sum over trials of each trial's mean loss (every trial has the same batch size)
        (F.cross_entropy(out.reshape(targets.numel(), -1), targets) * n).backward()
        opt.step()

    return step


def flops_per_trial(make) -> int:
    """Forward + backward FLOPs of one model (counted on the unfused model: the counter's
    formulas for grouped convolutions do not apply to the fused form)."""
    model, x, y, loss_fn = make()
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(*x), y).backward()
    return counter.get_total_flops()


def matmul_peak(size: int = 2048) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    seconds = timed({"mm": lambda: torch.mm(a, b)}, repeats=5, min_time=0.3)["mm"]
    return 2 * size**3 / seconds / 1e9


def stacked(model: nn.Module, n: int) -> list[nn.Parameter]:
    """``model``'s parameters stacked n times (``[n, ...]``, muP infshapes kept), each with a
    small random gradient: what a fused optimizer steps."""
    ps = []
    for q in model.parameters():
        t = nn.Parameter(q.detach()[None].repeat(n, *[1] * q.dim()).clone())
        if hasattr(q, "infshape"):
            t.infshape = q.infshape
        t.grad = torch.randn_like(t) * 1e-3
        ps.append(t)
    return ps


def old_optimizers(rev: str) -> types.ModuleType | None:
    """``hydro/optim/optimizers.py`` as of git revision ``rev`` (the per-trial loop), or None."""
    try:
        source = subprocess.run(
            ["git", "show", f"{rev}:hydro/optim/optimizers.py"],
            cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType("hydro_optim_old")
    exec(compile(source, f"{rev}:hydro/optim/optimizers.py", "exec"), module.__dict__)
    return module


def optimizer_table(args: argparse.Namespace) -> None:
    """The optimizer step alone at n trials: the old per-trial loop, now, now compiled."""
    old = old_optimizers(args.old_rev)
    n = args.optimizer_n
    print(f"\nOptimizer step alone (Adam, per-trial lr/betas/eps/wd, n = {n}), ms per step:")
    print("| model | threads | old (per-trial loop) | vectorized | compiled | old/vectorized | "
          "old/compiled | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in ("MLP w64", "CNN+BN", "GPT surrogate"):
            model = MODELS[name]()[0]
            params = {}
            for kind in ("old", "new", "compiled"):
                params[kind] = stacked(model, n)
            hp = dict(lr=LRS(n), betas=(0.9, [0.99 - 0.001 * k for k in range(n)]),
                      eps=1e-8, weight_decay=[0.01 * k / n for k in range(n)])
            steps = {}
            if old is not None:
                steps["old"] = old.Adam(params["old"], **hp).step
            steps["new"] = hydro.optim.Adam(params["new"], **hp).step
            compiled = hydro.optim.Adam(params["compiled"], **hp, compile=True)
            start = time.perf_counter()
            compiled.step()
            compile_s = time.perf_counter() - start
            steps["compiled"] = compiled.step
            t = timed(steps, args.repeats, args.min_time)
            t_old = t.get("old", float("nan"))
            print(
                f"| {name} | {threads} | {1e3 * t_old:.2f} | {1e3 * t['new']:.2f} | "
                f"{1e3 * t['compiled']:.2f} | {t_old / t['new']:.1f}x | "
                f"{t_old / t['compiled']:.1f}x | {compile_s:.0f} |",
                flush=True,
            )


# (name, C_in, C_out, kernel, stride, groups, H): convolutions of timm's resnet18 and convnext_atto
# at 32 x 32 pixels, as the real-model benchmark runs them
CONV_SHAPES = [
    ("resnet18 3x3 64 @ 8x8", 64, 64, 3, 1, 1, 8),
    ("resnet18 3x3 128 @ 4x4", 128, 128, 3, 1, 1, 4),
    ("resnet18 3x3 256 @ 2x2", 256, 256, 3, 1, 1, 2),
    ("resnet18 3x3 512 @ 1x1", 512, 512, 3, 1, 1, 1),
    ("resnet18 1x1 s2 128->256 @ 4x4", 128, 256, 1, 2, 1, 4),
    ("CNN anchor 3x3 16 @ 16x16", 16, 16, 3, 1, 1, 16),
    ("convnext dw 7x7 40 @ 8x8", 40, 40, 7, 1, 40, 8),
    ("convnext 1x1 40->160 @ 8x8", 40, 160, 1, 1, 1, 8),
    ("convnext 1x1 1280->320 @ 1x1", 1280, 320, 1, 1, 1, 1),
]


def _conv_steps(n: int, b: int, cin: int, cout: int, k: int, stride: int, groups: int, h: int):
    xs = [torch.randn(b, cin, h, h, requires_grad=True) for _ in range(n)]
    ws = [torch.randn(cout, cin // groups, k, k, requires_grad=True) for _ in range(n)]
    xg = torch.cat([x.detach() for x in xs], 1).requires_grad_()
    wg = torch.cat([w.detach() for w in ws], 0).requires_grad_()

    def separate() -> None:
        for x, w in zip(xs, ws):
            F.conv2d(x, w, None, stride, k // 2, 1, groups).sum().backward()

    def grouped() -> None:
        F.conv2d(xg, wg, None, stride, k // 2, 1, n * groups).sum().backward()

    wn = wg.detach().unflatten(0, (n, -1)).requires_grad_()

    def gemm() -> None:  # what hydro.fuse runs where ops.conv_as_bmm says so (groups 1)
        hydro_ops.bmm_conv(xg, wn, None, stride, k // 2, 1, n).sum().backward()

    return separate, grouped, (gemm if groups == 1 else None)


def conv_table(args: argparse.Namespace) -> None:
    """One convolution's forward + backward: n separate convolutions against one grouped
    convolution over channel-stacked ``[B, n * C, H, W]`` (what a fused step runs)."""
    n, b = args.conv_n, args.conv_batch
    print(f"\nConvolution forward + backward, n = {n}, batch {b}, ms (median of {args.repeats}):")
    print("| conv | threads | n separate | one grouped | one GEMM | separate/grouped | "
          "separate/GEMM | hydro.fuse runs |")
    print("|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, *shape in CONV_SHAPES:
            separate, grouped, gemm = _conv_steps(n, b, *shape)
            steps = {"sep": separate, "grp": grouped}
            if gemm is not None:
                steps["gemm"] = gemm
            t = timed(steps, args.repeats, args.min_time)
            t_gemm = t.get("gemm", float("nan"))
            cin, cout, k, stride, groups, h = shape
            x = torch.empty(b, n * cin, h, h)
            w = torch.empty(n, cout, cin // groups, k, k)
            runs = (
                "GEMM"
                if groups == 1 and hydro_ops.conv_as_bmm(x, w, stride, k // 2, 1)
                else "grouped"
            )
            print(
                f"| {name} | {threads} | {1e3 * t['sep']:.2f} | {1e3 * t['grp']:.2f} | "
                f"{1e3 * t_gemm:.2f} | {t['sep'] / t['grp']:.2f}x | {t['sep'] / t_gemm:.2f}x | "
                f"{runs} |",
                flush=True,
            )


def _phases(forward: Callable, loss: Callable, opt: torch.optim.Optimizer) -> list[float]:
    """CPU seconds of one step's forward, loss, backward and optimizer step."""
    opt.zero_grad(set_to_none=True)
    t0 = time.process_time()
    out = forward()
    t1 = time.process_time()
    value = loss(out)
    t2 = time.process_time()
    value.backward()
    t3 = time.process_time()
    opt.step()
    return [t1 - t0, t2 - t1, t3 - t2, time.process_time() - t3]


def _phase_sides(n: int) -> dict[str, tuple]:
    """``(forward, loss, optimizer)`` of ``hydro.fuse`` and of the hand-written ``baddbmm`` MLP."""
    built = [MODELS["MLP w64"]() for _ in range(n)]
    _, (x,), y, _ = built[0]
    fused = fuse([m for m, *_ in built])
    ws = [_stack([m[i].weight.t() for m, *_ in built]) for i in (0, 2, 4)]
    bs = [_stack([m[i].bias[None] for m, *_ in built]) for i in (0, 2, 4)]
    xs, targets = x.expand(n, *x.shape), y.repeat(n)

    def hand() -> torch.Tensor:
        h = torch.relu(torch.baddbmm(bs[0], xs, ws[0]))
        h = torch.relu(torch.baddbmm(bs[1], h, ws[1]))
        return torch.baddbmm(bs[2], h, ws[2])

    def hand_loss(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.view(targets.numel(), -1), targets) * n

    return {
        "fuse": (
            lambda: fused(x),
            lambda out: trial_loss(F.cross_entropy, out, y).sum(),
            hydro.optim.Adam(fused.parameters(), lr=LRS(n)),
        ),
        "hand": (hand, hand_loss, hydro.optim.Adam([*ws, *bs], lr=LRS(n))),
    }


def phase_table(args: argparse.Namespace) -> None:
    """One MLP w64 training step by phase: ``hydro.fuse`` against the hand-written ``baddbmm``
    MLP (CPU time, medians of interleaved rounds of 100 steps)."""
    names = ("forward", "loss", "backward", "optimizer", "step")
    print(f"\nMLP w64 step by phase, CPU ms (medians of {args.repeats} rounds of 100 steps):")
    print("| n | threads | phase | hydro.fuse | baddbmm | fuse - baddbmm |")
    print("|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for n in args.ns or [16, 32]:
            sides = _phase_sides(n)
            for side in sides.values():
                for _ in range(20):
                    _phases(*side)
            samples: dict[str, list[list[float]]] = {k: [] for k in sides}
            for _ in range(args.repeats):
                for key, side in sides.items():
                    total = [0.0] * 4
                    for _ in range(100):
                        total = [a + b for a, b in zip(total, _phases(*side))]
                    samples[key].append([t / 100 for t in total] + [sum(total) / 100])
            for i, name in enumerate(names):
                f, h = (1e3 * statistics.median(r[i] for r in samples[k]) for k in sides)
                print(f"| {n} | {threads} | {name} | {f:.3f} | {h:.3f} | {f - h:+.3f} |")


def loss_table(args: argparse.Namespace) -> None:
    """``trial_loss(F.cross_entropy)`` forward + backward on ``[n, B, C]`` logits: log_softmax
    over rows of C classes against over dimension 1 of ``[n, C, B]`` (what the fast path runs
    below ``hydro.fusion.loss.FEW_CLASSES``), timed side by side."""
    import hydro.fusion.loss as loss_module

    print(f"\ntrial_loss(F.cross_entropy) forward + backward, us (median of {args.repeats}):")
    print("| n | B | classes | threads | rows | dim 1 of [n, C, B] | rows/dim 1 | fast path runs |")
    print("|---|---|---|---|---|---|---|---|")
    saved = loss_module.FEW_CLASSES
    for threads in args.threads:
        torch.set_num_threads(threads)
        for n, b, c in ((16, 64, 4), (16, 64, 10), (16, 64, 15), (16, 64, 16), (16, 64, 32),
                        (32, 64, 10), (16, 256, 10), (16, 64, 100)):
            out = torch.randn(n, b, c, requires_grad=True)
            y = torch.randint(0, c, (b,))

            def run(few: int, out: torch.Tensor = out, y: torch.Tensor = y) -> None:
                loss_module.FEW_CLASSES = few
                out.grad = None
                trial_loss(F.cross_entropy, out, y).sum().backward()

            try:
                t = timed({"rows": lambda: run(0), "dim1": lambda: run(1 << 30)},
                          args.repeats, args.min_time)
            finally:
                loss_module.FEW_CLASSES = saved
            runs = "dim 1" if c < saved else "rows"
            print(
                f"| {n} | {b} | {c} | {threads} | {1e6 * t['rows']:.0f} | {1e6 * t['dim1']:.0f} | "
                f"{t['rows'] / t['dim1']:.2f}x | {runs} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two models, n in 1 and 32")
    parser.add_argument(
        "--compile", action="store_true",
        help="only the compiled fused step (MLP w64 n=32, charlm GPT ratio 8 n=16) vs eager",
    )
    parser.add_argument(
        "--anchors", action="store_true",
        help="MLP w64, CNN+BN, GPT surrogate at n 16 and 32, 1 and 2 threads",
    )
    parser.add_argument(
        "--optimizer", action="store_true", help="only the optimizer step: old vs now vs compiled"
    )
    parser.add_argument("--old-rev", default="13b3095", help="git revision of the old optimizer")
    parser.add_argument(
        "--convs", action="store_true",
        help="only single convolutions (resnet18/convnext shapes): n separate vs one grouped",
    )
    parser.add_argument(
        "--loss", action="store_true",
        help="only trial_loss(F.cross_entropy): log_softmax over rows vs over dim 1 of [n, C, B]",
    )
    parser.add_argument(
        "--phases", action="store_true",
        help="only the MLP w64 step by phase: hydro.fuse vs the hand-written baddbmm MLP",
    )
    parser.add_argument("--conv-n", type=int, default=8)
    parser.add_argument("--conv-batch", type=int, default=4)
    parser.add_argument("--optimizer-n", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="*", choices=list(MODELS) + list(COMPILED),
                        help="a subset of models")
    parser.add_argument(
        "--ns", nargs="*", type=int, help="numbers of trials (default 1 4 16 32 64)"
    )
    parser.add_argument(
        "--threads", type=int, nargs="*", default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per repeat")
    parser.add_argument(
        "--before-rev", default=None,
        help="also time hydro.fuse with the fusion rewrite (rewrite.py, ops.py) of this git "
        "revision, side by side: columns 'fuse@rev' and 'fuse/before'",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    ns = [1, 32] if args.quick else [1, 4, 16, 32, 64]
    models = ["MLP w64", "MLP w256"] if args.quick else list(MODELS)
    if args.anchors:
        ns, models = [16, 32], ["MLP w64", "CNN+BN", "GPT surrogate"]
        args.threads = args.threads or [1, 2]
    models = args.models or models
    ns = args.ns or ns
    args.threads = args.threads or [torch.get_num_threads()]
    if args.optimizer:
        print(f"torch {torch.__version__}")
        optimizer_table(args)
        return
    if args.convs:
        print(f"torch {torch.__version__}")
        conv_table(args)
        return
    if args.loss:
        print(f"torch {torch.__version__}")
        loss_table(args)
        return
    if args.phases:
        print(f"torch {torch.__version__}")
        phase_table(args)
        return
    if args.compile:
        print(f"torch {torch.__version__}")
        args.models = [m for m in (args.models or []) if m in COMPILED] or None
        compile_table(args)
        return

    torch.set_num_threads(args.threads[0])
    peak = matmul_peak()
    print(f"torch {torch.__version__}, threads {args.threads}")
    print(f"matmul peak (2048x2048 float32 mm, {args.threads[0]} threads): {peak:.1f} GFLOP/s\n")
    header = (
        "| model | n | threads | sequential | vmap | HFTA-style | baddbmm | hydro.fuse | "
        "fuse/HFTA | fuse/baddbmm | fuse/HFTA cpu | fuse/baddbmm cpu | ATen ops fuse/HFTA/baddbmm "
        "| fuse/seq | fuse/vmap | HFTA/seq | GFLOP/s | % peak |"
    )
    before = rewrite_at(args.before_rev) if args.before_rev else None
    if before is not None:
        header += f" fuse@{args.before_rev} | fuse/before |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    notes = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in models:
            make = MODELS[name]
            for n in ns:
                steps = {"seq": sequential_step(make, n)}
                for key, build, extra in (
                    ("vmap", vmap_step, ()),
                    ("hfta", hfta_step, (name,)),
                    ("hand", baddbmm_step, (name,)),
                    ("fuse", fused_step, ()),
                ):
                    try:
                        steps[key] = build(*extra, make, n)
                        steps[key]()
                    except Exception as exc:  # report, keep going
                        steps.pop(key, None)
                        if key != "hand":  # written for the MLP only
                            why = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                            notes.append(f"{key} cannot run {name} (n={n}): {why}")
                if before is not None:
                    steps["before"] = fused_step(make, n, rewrite=before)
                counts = {k: aten_ops(steps[k]) for k in ("fuse", "hfta", "hand") if k in steps}
                cpu: dict[str, float] = {}
                t = timed(steps, args.repeats, args.min_time, cpu)
                nan = float("nan")
                t_vmap, t_hfta, t_fuse = (t.get(k, nan) for k in ("vmap", "hfta", "fuse"))
                t_hand = t.get("hand", nan)
                c_hfta, c_hand, c_fuse = (cpu.get(k, nan) for k in ("hfta", "hand", "fuse"))
                ops = "/".join(str(counts.get(k, "-")) for k in ("fuse", "hfta", "hand"))
                gflops = n * flops_per_trial(make) / t_fuse / 1e9
                row = (
                    f"| {name} | {n} | {threads} | {n / t['seq']:.0f} | {n / t_vmap:.0f} | "
                    f"{n / t_hfta:.0f} | {n / t_hand:.0f} | {n / t_fuse:.0f} | "
                    f"{t_hfta / t_fuse:.2f}x | {t_hand / t_fuse:.2f}x | {c_hfta / c_fuse:.2f}x | "
                    f"{c_hand / c_fuse:.2f}x | {ops} | "
                    f"{t['seq'] / t_fuse:.1f}x | {t_vmap / t_fuse:.2f}x | "
                    f"{t['seq'] / t_hfta:.1f}x | {gflops:.1f} | {100 * gflops / peak:.0f}% |"
                )
                if before is not None:
                    row += f" {n / t['before']:.0f} | {t['before'] / t_fuse:.2f}x |"
                print(row, flush=True)
    print(
        "\nColumns sequential/vmap/HFTA-style/hydro.fuse: trial-steps per second (higher is "
        "better); ratios are speed-ups of the first over the second (nan: could not run)."
    )
    for note in notes:
        print(f"  note: {note}")


if __name__ == "__main__":
    main()

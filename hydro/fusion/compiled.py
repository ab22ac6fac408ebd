"""The compiled fused step: fused graphs through ``torch.compile``, compiled once per structure.

:class:`~hydro.fusion.model.FusedModel` rebuilds its fused ``GraphModule`` after every refill
(``load_trial``) and every change of fusion size (``select``). Compiling each rebuilt module
would compile again at every refill (``torch.compile`` guards on the module instance), so the
graph is *lifted* first: every ``get_attr`` (parameters, buffers, per-trial literal tensors,
random-stream counters) becomes an explicit input, in a fixed order, and the lifted graph holds
no tensor at all. Its code and the lifted tensors' shapes, dtypes and devices key the compiled
callable; each call feeds it the current tensors. A refill builds a graph of the same code and
shapes, so it hits the cache with no compilation; a new fusion size or structure compiles once.

Compilations are counted by wrapping the backend (:attr:`Compiler.stats`), so tests and the
tuner can see them. A compiler failure warns once, naming the error, and the model runs eagerly
from then on (same results).
"""

from __future__ import annotations

import copy
import inspect
import logging
import operator
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx
from torch.fx import _pytree as fx_pytree
from torch.utils._pytree import tree_unflatten

from hydro.errors import FuseError

CompileSpec = bool | str | Mapping[str, Any] | None
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
KEYS = ("mode", "options", "dynamic", "fullgraph", "backend")
FORMS = (
    "False (eager), True (inductor, default mode), a mode string "
    f"({', '.join(repr(m) for m in MODES)}) or a dict of torch.compile keyword arguments "
    f"({', '.join(KEYS)})"
)


def compile_options(value: CompileSpec) -> dict[str, Any] | None:
    """``fuse(compile=...)`` as ``torch.compile`` keyword arguments (``None``: eager).

    Raises:
        FuseError: anything but the accepted forms, naming them.
    """
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, str):
        if value == "auto":
            raise FuseError(
                "compile='auto' is a tuner setting (hydro.tune(compile='auto') decides from the "
                f"study's budget); a fused model takes {FORMS}"
            )
        if value not in MODES:
            raise FuseError(f"compile={value!r} is not a torch.compile mode; expected {FORMS}")
        return {"mode": value}
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(KEYS))
        if unknown:
            raise FuseError(f"compile: unknown torch.compile argument(s) {unknown}; "
                            f"expected {FORMS}")
        out = dict(value)
        if out.get("mode") is not None and out["mode"] not in MODES:
            raise FuseError(f"compile: mode {out['mode']!r} is not a torch.compile mode ({MODES})")
        if out.get("backend") is not None and (out.get("mode") or out.get("options")):
            raise FuseError(
                "compile: mode and options configure inductor; give them or a backend, not both"
            )
        return out
    raise FuseError(f"compile={value!r} ({type(value).__name__}) is not accepted; expected {FORMS}")


class Lifted:
    """A fused graph with its ``get_attr`` nodes turned into leading inputs.

    ``targets`` are the attribute paths fed, in order, before the graph's own (flattened)
    inputs; ``module`` holds no tensor, so one compiled form serves every graph of this code.
    """

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        nodes = list(gm.graph.nodes)
        self.targets: list[str] = []
        for node in nodes:  # lifted tensors first, one input per distinct attribute
            if node.op == "get_attr" and node.target not in self.targets:
                self.targets.append(node.target)
        lifted = {t: graph.placeholder(f"lifted_{i}") for i, t in enumerate(self.targets)}
        root = torch.nn.Module()
        for node in nodes:
            if node.op == "get_attr":
                env[node] = lifted[node.target]
            elif node.op == "output":  # the flat outputs; the caller rebuilds the structure
                graph.output(torch.fx.node.map_arg(node.args[0], env.__getitem__))
            else:
                if node.op == "call_module":  # a vmap fallback: a stateless wrapper of one op
                    root.add_module(node.target, gm.get_submodule(node.target))
                env[node] = graph.node_copy(node, env.__getitem__)
        self.module = torch.fx.GraphModule(root, graph, "LiftedFusedGraph")
        self.code = self.module.code
        self._get = [operator.attrgetter(t) for t in self.targets]
        codegen = gm.graph._codegen
        self._info = getattr(codegen, "pytree_info", None)
        self._signature = inspect.signature(gm.forward)

    def tensors(self, gm: torch.fx.GraphModule) -> list[Any]:
        """The current values of the lifted attributes of ``gm`` (a graph of this code)."""
        return [get(gm) for get in self._get]

    def flatten(self, args: tuple, kwargs: Mapping[str, Any]) -> list[Any]:
        """The graph's own inputs, flat, as its generated ``forward`` flattens them."""
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = list(bound.arguments.values())
        info = self._info
        if info is None or info.in_spec is None:
            return values
        spec = info.in_spec
        if (spec.type is tuple and spec.num_children == 2 and spec.child(0).type is tuple
                and spec.child(1).type is dict):
            count = spec.child(0).num_children
            names = dict(zip(info.orig_args[count:], values[count:]))
            keywords = {k: names[v] for k, v in zip(spec.child(1).context, info.orig_args[count:])}
            return fx_pytree.tree_flatten_spec((values[:count], keywords), spec)
        return fx_pytree.tree_flatten_spec(values, spec)

    def unflatten(self, out: Any) -> Any:
        """The flat outputs with the structure the fused graph returns."""
        info = self._info
        if info is None or info.out_spec is None:
            return out
        if not isinstance(out, (list, tuple)):
            out = [out]
        return tree_unflatten(list(out), info.out_spec)


def quiet_cuda_home() -> None:
    """Silence torch's "No CUDA runtime is found, using CUDA_HOME=..." at the first compile on
    a host without a GPU (a CUDA build of torch on a CPU machine): it asks nothing of the user."""
    if not torch.cuda.is_available():
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (x.shape, x.stride(), x.dtype, x.device, x.requires_grad)
    # a Python value is a constant of the traced graph: another value needs another graph
    return (type(x), x if isinstance(x, (int, float, bool, str, type(None))) else repr(x))


class Compiler:
    """Compiled callables of lifted fused graphs, one per (code, lifted tensors' metadata).

    Args:
        options: ``torch.compile`` keyword arguments (from :func:`compile_options`).

    ``stats`` counts the graphs the backend compiled (``"compiles"``; a training graph's forward
    and backward count once) and the seconds they took (``"seconds"``: the forward's compile
    and, at the first backward, the backward's).
    """

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = dict(options)
        self.stats: dict[str, float] = {"compiles": 0, "seconds": 0.0}
        self.failed: str | None = None
        self._cache: dict[tuple, Callable] = {}
        self._shaped: set[tuple] = set()  # codes compiled for one input shape
        self._dynamic: dict[tuple, Callable] = {}  # codes compiled for every input shape
        self._noted: set[str] = set()
        self._inside = threading.local()

    def same(self, other: Compiler | None) -> bool:
        """Whether ``other`` compiles with these options (its graphs can serve this model)."""
        return other is not None and other.options == self.options

    @staticmethod
    def summary(compiler: Compiler | None) -> dict[str, Any]:
        """``stats`` (zeros without a compiler), with ``"failed"`` naming the error after a
        fallback to eager."""
        if compiler is None:
            return {"compiles": 0, "seconds": 0.0}
        return dict(compiler.stats, **({"failed": compiler.failed} if compiler.failed else {}))

    def __call__(self, gm: torch.fx.GraphModule, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        """Run ``gm`` on ``(args, kwargs)`` through its compiled form (eagerly after a failure)."""
        if self.failed is not None:
            return gm(*args, **kwargs)
        lifted = getattr(gm, "hydro_lifted", None)
        if lifted is None:  # once per rebuilt graph (milliseconds): no compilation
            lifted = gm.hydro_lifted = Lifted(gm)
        inputs = lifted.tensors(gm)
        count = len(inputs)
        inputs += lifted.flatten(args, kwargs)
        grad = torch.is_grad_enabled()
        # this key is the only guard where the compiled callable runs without dynamo's:
        # (code, (the lifted tensors' metadata..., grad mode, the inputs' metadata...))
        metas = tuple(_meta(t) for t in inputs[:count])
        code = (lifted.code, grad, metas)
        key = (lifted.code, (*metas, grad, *(_meta(t) for t in inputs[count:])))
        fn = self._cache.get(key)
        first = fn is None
        if first:
            try:
                fn = self._cache[key] = self._compile(lifted.module, inputs, code)
            except Exception as exc:  # any compiler failure: fall back, say so
                self._fail(exc)
                return gm(*args, **kwargs)
        try:
            out = fn(*inputs)
        except Exception as exc:  # any compiler failure: fall back, say so
            if not first and not _from_compiler(exc):
                raise
            self._fail(exc)
            return gm(*args, **kwargs)
        return lifted.unflatten(out)

    def _compile(self, module: torch.fx.GraphModule, inputs: list, code: tuple) -> Callable:
        """The compiled form of ``module`` for ``inputs``. On a CPU, the backend called
        directly (no dynamo: no guards, no frame evaluation per call; the caller's key guards),
        and at a second input shape of one code (a dynamic sequence length, a last short batch)
        one graph with dynamic shapes through ``torch.compile``, which then serves every shape.
        On CUDA, or with ``dynamic`` given, ``torch.compile`` (dynamo) throughout."""
        from hydro.fusion import random as _random

        torch.compiler.assume_constant_result(_random._keep_scale)  # marks it, in place
        quiet_cuda_home()
        options = dict(self.options)
        backend = options.pop("backend", None)
        mode = options.pop("mode", None)
        inductor = options.pop("options", None)
        dynamic = options.pop("dynamic", None)
        options.pop("fullgraph", None)  # a lifted graph is one graph, whole
        like = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
        cpu = like is None or like.device.type != "cuda"
        if cpu and mode in ("reduce-overhead", "max-autotune"):
            # CUDA graphs capture device kernels: a CPU graph has none (inductor would skip them)
            self._note(
                mode,
                f"hydro.fuse(compile={mode!r}): CUDA graphs need a CUDA device; this model is on "
                "the CPU, so it compiles in the default mode"
                + (" with max-autotune's kernel search" if mode == "max-autotune" else ""),
            )
            mode = "max-autotune-no-cudagraphs" if mode == "max-autotune" else None
        if backend is None:
            inner = _timed_inductor(
                torch._TorchCompileInductorWrapper(mode, inductor, dynamic), self
            )
        else:
            inner = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend

        def counting(graph: torch.fx.GraphModule, example: list) -> Callable:
            start = time.perf_counter()
            self._inside.active = True
            try:
                # Views recomputable in the backward: otherwise AOTAutograd saves a view of an
                # activation for a matmul's gradient and, the activation itself unsaved, a bool
                # mask for ReLU's (``le``) that inductor's vectorized CPU kernels store with
                # masked byte stores, ~15x slower than eager on AVX-512 AMD
                # (docs/explanation/fusion.md)
                with torch._functorch.config.patch(recompute_views=True):
                    return inner(graph, example)
            finally:
                self._inside.active = False
                self.stats["compiles"] += 1
                self.stats["seconds"] += time.perf_counter() - start

        if dynamic or not cpu or code in self._dynamic:
            # dynamo on CUDA: its CUDA graphs (reduce-overhead) take their static inputs from
            # dynamo's tracing context; the direct call is measured on CPUs only
            if code not in self._dynamic:
                self._dynamic[code] = torch.compile(module, backend=counting, dynamic=dynamic)
            return self._dynamic[code]
        if not _direct_cached(module):
            # inductor's on-disk FX graph cache refuses what AOTAutograd makes of such a graph
            # called directly (a warm start would compile it all again); from dynamo's trace
            # through hydro's functions it does not
            self._dynamic[code] = torch.compile(module, backend=counting, dynamic=dynamic)
            return self._dynamic[code]
        if code in self._shaped:  # a second shape: one dynamic graph for this and the next
            self._dynamic[code] = torch.compile(module, backend=counting, dynamic=True)
            return self._dynamic[code]
        self._shaped.add(code)
        # a copy: the backend's passes rewrite the graph in place, and others of this code
        # (other shapes) compile from the lifted module
        graph = torch.fx.GraphModule(module, copy.deepcopy(module.graph), module.__class__.__name__)
        return counting(graph, list(inputs))

    def _fail(self, exc: BaseException) -> None:
        while True:  # dynamo wraps the backend's own error
            inner = getattr(exc, "inner_exception", None) or exc.__cause__
            if inner is None:
                break
            exc = inner
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.failed = f"{type(exc).__name__}: {first}"
        self._cache.clear()
        self._dynamic.clear()
        warnings.warn(
            f"hydro.fuse(compile=...): torch.compile failed ({self.failed}); this fused model runs "
            "eagerly from now on (same results, slower)",
            RuntimeWarning,
            stacklevel=4,
        )

    def _note(self, key: str, message: str) -> None:
        if key not in self._noted:
            self._noted.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=5)


# hydro's functions with which a directly compiled graph still hits inductor's on-disk cache
# (measured: the MLP's graph; a random stream or an embedding made it bypass the cache)
_DIRECT_CACHED = {"to_trials", "trial_linear"}


def _direct_cached(module: torch.fx.GraphModule) -> bool:
    """Whether ``module`` calls only torch's functions and those of :data:`_DIRECT_CACHED`."""
    for node in module.graph.nodes:
        if node.op == "call_module":
            return False
        if node.op == "call_function":
            where = getattr(node.target, "__module__", None) or ""
            if where.startswith("hydro") and node.target.__name__ not in _DIRECT_CACHED:
                return False
    return True


def _from_compiler(exc: BaseException) -> bool:
    """Whether ``exc`` came from dynamo or a backend (not from running the model)."""
    names = {"BackendCompilerFailed", "Unsupported", "TorchRuntimeError",
             "InternalTorchDynamoError"}
    return type(exc).__name__ in names or type(exc).__module__.startswith("torch._dynamo")


def _timed_inductor(wrapper: Any, compiler: Compiler) -> Callable:
    """Inductor with ``wrapper``'s configuration, whose lazily compiled backward graphs add
    their compile time to ``compiler.stats`` (the forward's is timed by the caller)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(*a: Any, **k: Any) -> Any:
        if getattr(compiler._inside, "active", False):
            return compile_fx_inner(*a, **k)
        start = time.perf_counter()
        try:
            return compile_fx_inner(*a, **k)
        finally:
            compiler.stats["seconds"] += time.perf_counter() - start

    def backend(graph: torch.fx.GraphModule, example: list) -> Any:
        return compile_fx(graph, example, inner_compile=inner, config_patches=wrapper.config)

    return backend

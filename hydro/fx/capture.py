"""Capture a model's graph by running it on example inputs.

Symbolic tracing cannot pass the Python that real models contain (shape asserts, dtype checks,
decorated forwards, optional arguments). Here the model runs for real under ``torch.export``
(non-strict), so every such branch resolves as it does at run time, and what is recorded is the
ATen graph of that run: ``aten.linear``, ``aten.conv2d``, ``aten.batch_norm``, ``aten.view`` ...
with parameters and buffers read by ``get_attr`` under their original names.

The batch (dimension 0 of every tensor input) stays symbolic, so sizes derived from it are graph
nodes (``aten.sym_size``) rather than constants. A sequence length can too, where the model allows
it (:func:`dynamic_shapes`): ``dynamic="auto"`` offers dimension 1 of integer (token) inputs to
export, which keeps it unless the model fixes it (a positional table used whole);
``dynamic={"seq": 1}`` names the dimensions and requires them. Training and evaluation modes can
differ in their graphs (dropout, batch statistics, ``if self.training``), so both are captured.

:class:`Captured` is the result: an ``nn.Module`` that holds the model's parameters and buffers
under the same names (same ``state_dict`` keys, the very same tensors) and runs the graph of the
current mode. It is called with the same arguments and returns the same output type as the model.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch
import torch.fx
from torch import nn
from torch.export import Dim
from torch.fx import Node
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx._pytree import tree_flatten_spec
from torch.utils._pytree import tree_flatten, tree_map

from hydro.errors import TraceError
from hydro.fx import cache as _cache
from hydro.fx import host_random, modules
from hydro.fx.explain import explain
from hydro.fx.paths import register_at

MODES = ("train", "eval")


class Captured(nn.Module):
    """A captured model: its parameters and buffers plus one graph per mode.

    Attributes:
        graphs: ``{"train": GraphModule, "eval": GraphModule}``. Each graph's code reads
            parameters as ``self.<name>``; it runs with ``self`` bound to this module, so a pass
            that edits a graph (``gm.graph`` then ``gm.recompile()``) changes what this module
            computes, and ``.to()``, ``.double()`` or ``load_state_dict`` on this module are what
            the graphs see.
    """

    def __init__(
        self,
        graphs: Mapping[str, torch.fx.GraphModule],
        name: str = "Captured",
        state: nn.Module | None = None,
        non_persistent: set[str] = frozenset(),
    ) -> None:
        super().__init__()
        source = state if state is not None else next(iter(graphs.values()))
        for key, value in source.named_parameters(remove_duplicate=False):
            register_at(self, key, value, "param")
        for key, value in source.named_buffers(remove_duplicate=False):
            register_at(self, key, value, "buffer", persistent=key not in non_persistent)
        for gm in graphs.values():
            for key, sub in gm.named_children():  # subgraphs of `with` regions: code, not state
                if isinstance(sub, torch.fx.GraphModule):
                    object.__setattr__(self, key, sub)
            for node in gm.graph.nodes:  # tensors created in forward, lifted as constants
                if node.op == "get_attr" and not _has(self, node.target):
                    value = _get(gm, node.target)
                    if isinstance(value, torch.Tensor):
                        register_at(self, node.target, value, "buffer", persistent=False)
        # not registered as submodules: the graphs share this module's tensors, not own copies
        object.__setattr__(self, "graphs", dict(graphs))
        object.__setattr__(self, "captured_name", name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        gm = self.graphs["train" if self.training else "eval"]
        if isinstance(gm, _LazyGraphModule):  # a copy's code is generated at its first run
            gm.real_recompile()
        self._in_spec, self._out_spec = gm._in_spec, gm._out_spec
        _check_shapes(self, gm, args, kwargs)
        if modules.has_hooks(self):  # node by node, so that submodule hooks see their calls
            return modules.run_hooked(self, gm, args, kwargs)
        return type(gm).forward(self, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Captured:
        return copy_captured(self, memo=memo)

    def extra_repr(self) -> str:
        return f"captured {self.captured_name}, graphs: {', '.join(self.graphs)}"


def copy_captured(
    cap: Captured,
    edit: Callable[[str, torch.fx.Graph], None] | None = None,
    memo: dict | None = None,
    *,
    graphs: Mapping[str, torch.fx.GraphModule] | None = None,
) -> Captured:
    """A deep copy of ``cap``; ``edit(mode, graph)`` changes each copied graph. A copied
    graph's code is generated when it first runs or is read (``gm.code``), not before: a fused
    model reads its members' graphs and never runs them. ``graphs``: graph modules to hold
    for some modes instead of copies of ``cap``'s, unedited (modules holding the same graph
    module share every later edit of it: a caller that edits a shared graph copies it first).
    A function, not a method: a captured model's attributes are the user's submodule names."""
    memo = {} if memo is None else memo
    given = graphs or {}
    graphs = {mode: given[mode] if mode in given else _copy_graph_module(gm, mode, edit)
              for mode, gm in cap.graphs.items()}
    new = Captured.__new__(Captured)
    memo[id(cap)] = new
    nn.Module.__init__(new)
    modules.copy_tree(cap, new)  # the user's classes at the user's paths
    for key, value in cap.named_parameters(remove_duplicate=False):
        register_at(new, key, copy.deepcopy(value, memo), "param")
    for key, value in cap.named_buffers(remove_duplicate=False):
        keep = _persistent(cap, key)
        register_at(new, key, copy.deepcopy(value, memo), "buffer", persistent=keep)
    for key, value in cap.__dict__.items():
        if key not in new.__dict__ and not key.startswith("_") and key != "graphs":
            object.__setattr__(new, key, copy.deepcopy(value, memo))
    object.__setattr__(new, "graphs", graphs)
    new.train(cap.training)
    return new


def _captured_shapes(gm: torch.fx.GraphModule) -> list[tuple[str, tuple] | None]:
    """Each graph input's name and shape as captured: an ``int`` where a dimension is fixed,
    ``(symbol, low, high)`` where it is dynamic (``high`` ``None`` when unbounded)."""
    shapes = getattr(gm, "_hydro_shapes", None)
    if shapes is None:
        shapes = []
        tables = _table_bounds(gm)
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                val = node.meta.get("val")
                dims = tuple(_dim(d, tables) for d in getattr(val, "shape", ()))
                shapes.append((node.name, dims) if isinstance(val, torch.Tensor) else None)
        gm._hydro_shapes = shapes
    return shapes


def _dim(size: Any, tables: Mapping[Any, int]) -> int | tuple[str, int, int | None]:
    if type(size) is int:
        return size
    expr = size.node.expr
    if expr.is_number:  # a dimension offered to export that the model fixed
        return int(expr)
    low, high = 0, None
    try:  # the range export proved (a slice of a positional table bounds the length)
        vr = size.node.shape_env.bound_sympy(expr)
        low = int(vr.lower) if vr.lower.is_finite else 0
        high = int(vr.upper) if vr.upper.is_finite else None
    except Exception:
        pass
    if expr in tables:
        high = tables[expr] if high is None else min(high, tables[expr])
    return str(expr), low, high


_PASS = {"view", "reshape", "_unsafe_view", "unsqueeze", "expand", "clone", "to", "_to_copy",
         "alias", "contiguous", "lift_fresh_copy"}


def _opname(node: Any) -> str | None:
    if isinstance(node, Node) and node.op == "call_function":
        return getattr(node.target, "_opname", None)
    return None


def _table_bounds(gm: torch.fx.GraphModule) -> dict[Any, int]:
    """Sizes bounded by a table read at ``arange(size)`` (``wpe(torch.arange(T))``): export
    proves no range for an embedding's indices, so a longer sequence would fail inside with an
    index error; ``{symbol: rows}``."""
    out: dict[Any, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.embedding.default:
            continue
        weight, idx = node.args[0], node.args[1]
        offset = 0  # positions past a prefix: arange(T) + start (a constant here)
        while _opname(idx) in _PASS or (_opname(idx) == "add" and type(idx.args[1]) is int):
            offset += idx.args[1] if _opname(idx) == "add" else 0
            idx = idx.args[0]
        is_arange = _opname(idx) == "arange"
        rows = getattr(weight.meta.get("val"), "shape", None) if isinstance(weight, Node) else None
        if not is_arange or not rows or type(rows[0]) is not int:
            continue
        ends = [a for a in idx.args[:2] if isinstance(a, torch.fx.Node)]
        val = ends[-1].meta.get("val") if len(ends) == 1 and idx.args[-1] is ends[-1] else None
        if isinstance(val, torch.SymInt) and val.node.expr.is_Symbol:
            # the last index read is end - 1 + offset, whatever arange's start
            sym, most = val.node.expr, rows[0] - offset
            out[sym] = min(out.get(sym, most), most)
    return out


def dynamic_dims(gm: torch.fx.GraphModule) -> dict[str, dict[int, str]]:
    """The dynamic dimensions of each graph input other than the batch: ``{input: {dim:
    symbol}}`` (empty when only the batch is dynamic)."""
    out: dict[str, dict[int, str]] = {}
    for want in _captured_shapes(gm):
        if want is not None:
            name, dims = want
            syms = {i: d[0] for i, d in enumerate(dims) if i and type(d) is tuple}
            if syms:
                out[name] = syms
    return out


def _check_shapes(cap: nn.Module, gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """Sizes other than the dynamic ones (the batch, a sequence length the model leaves free) were
    fixed at capture: another size would run a graph built for the example's, so it fails here,
    clearly, rather than deep inside (or, worse, reshapes silently). So does a dynamic size
    outside the range export proved, or two sizes that must agree (one symbol) and do not.
    ``cap`` names the model (a :class:`Captured`, or the module a fused model captured)."""
    model_name = getattr(cap, "captured_name", type(cap).__name__)
    try:
        flat = tree_flatten_spec((tuple(args), dict(kwargs)), gm._in_spec)
    except Exception:
        return  # a call of another structure: the graph's own error says which
    seen: dict[str, tuple[int, str]] = {}
    for x, want in zip(flat, _captured_shapes(gm)):
        if want is None or not isinstance(x, torch.Tensor):
            continue
        name, dims = want
        fixed = [type(d) is int for d in dims]
        bad = [i for i, (got, d) in enumerate(zip(x.shape, dims)) if type(d) is int and got != d]
        shown = _shown(dims)
        if x.dim() != len(dims) or bad:
            if bad == [0] and dims[0] == 1:
                raise TraceError(
                    f"{model_name} was captured with a batch of 1 in input '{name}', which "
                    "torch.export fixes (a size of 1 is never dynamic); called with batch "
                    f"{x.shape[0]}. Capture with an example batch of 2 or more"
                )
            free = (
                "the batch dimension is"
                if sum(not f for f in fixed) <= 1
                else ("the dimensions shown as letters are")
            )
            raise TraceError(
                f"{model_name} was captured with input '{name}' of shape {shown}; called with "
                f"{tuple(x.shape)}. Only {free} dynamic: every other size (sequence length, "
                "image size) is fixed by the example inputs (or by the model: a positional "
                "table it adds whole). Capture again with example inputs of this size "
                "(hydro.scale/hydro.tune/Task(example_inputs=...)), or pad or crop the inputs "
                f"to {shown}"
            )
        for i, d in enumerate(dims):
            if type(d) is int:
                continue
            sym, low, high = d
            got = int(x.shape[i])
            if (high is not None and got > high) or (low > 2 and got < low):
                allowed = f"{low} to {high}" if high is not None else f"at least {low}"
                raise TraceError(
                    f"{model_name} was captured with dimension {i} of input '{name}' dynamic "
                    f"from {allowed} (shape {shown}: the model bounds it, e.g. by a table of "
                    f"positions); called with {got}. Pad or crop the inputs to that range"
                )
            if sym in seen and seen[sym][0] != got:
                raise TraceError(
                    f"{model_name} was called with {got} in dimension {i} of input '{name}' but "
                    f"{seen[sym][0]} in {seen[sym][1]}: the model needs these sizes equal"
                )
            seen.setdefault(sym, (got, f"dimension {i} of input '{name}'"))


def _shown(dims: tuple) -> str:
    letters = {}
    for i, d in enumerate(dims):
        if type(d) is tuple and d[0] not in letters:
            letters[d[0]] = "B" if i == 0 else "T" if "T" not in letters.values() else d[0]
    return "(" + ", ".join(str(d) if type(d) is int else letters[d[0]] for d in dims) + ")"


def _persistent(root: nn.Module, path: str) -> bool:
    *parents, leaf = path.split(".")
    owner = _get(root, ".".join(parents)) if parents else root
    return leaf not in owner._non_persistent_buffers_set


def _copy_graph_module(
    gm: torch.fx.GraphModule, mode: str = "", edit: Callable | None = None
) -> torch.fx.GraphModule:
    # the graph is copied (passes edit it in place); tensors stay with the owning Captured
    graph = copy.deepcopy(gm.graph)
    if edit is not None:
        edit(mode, graph)
    # an empty root: the code reads every attribute from the Captured it runs bound to; lazy:
    # its code is generated when first needed (Captured.forward, gm.code)
    new = _LazyGraphModule(nn.Module(), torch.fx.Graph(), type(gm).__name__)
    for name, sub in gm.named_children():  # subgraphs of `with` regions: code, kept along
        if isinstance(sub, torch.fx.GraphModule):
            new.add_submodule(name, copy.deepcopy(sub))
    new.graph = graph
    new._in_spec, new._out_spec = gm._in_spec, gm._out_spec
    return new


def _get(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part, None)
    return root


def _has(root: nn.Module, path: str) -> bool:
    return _get(root, path) is not None


Dynamic = Mapping[str, Any] | Literal["auto"] | None
"""What :func:`capture`'s ``dynamic=`` takes (see there)."""


def check_dynamic(dynamic: Dynamic) -> None:
    """A :class:`TraceError` naming what is wrong with a ``dynamic=`` argument."""
    how = ('pass dynamic={"seq": 1} (a name for each dimension index, applied to every tensor '
           'input with that dimension) or {"input_ids": {1: "seq"}} (per input)')
    if dynamic is None or dynamic is False or dynamic == "auto":
        return
    if not isinstance(dynamic, Mapping):
        raise TraceError(f"dynamic= must be 'auto' or a mapping, got {dynamic!r}; {how}")
    if len({isinstance(v, Mapping) for v in dynamic.values()}) > 1:
        raise TraceError(f"dynamic={dict(dynamic)!r} mixes the two forms; {how}")
    for value in dynamic.values():
        dims = value.keys() if isinstance(value, Mapping) else [value]
        for d in dims:
            if type(d) is not int or d < 1:
                raise TraceError(
                    f"dynamic={dict(dynamic)!r}: {d!r} is not a dimension index >= 1 (dimension "
                    f"0 is the batch, always dynamic); {how}"
                )


def dynamic_shapes(
    names: list[str], args: tuple, kwargs: dict, dynamic: Dynamic = None
) -> tuple[dict[str, Any], list[tuple[str, int]]]:
    """``dynamic_shapes`` for ``torch.export`` and the dimensions the user asked for.

    Dimension 0 of every tensor of rank >= 1 is the batch. ``dynamic`` adds others:

    * ``None`` (default): the batch only.
    * ``"auto"``: dimension 1 of every integer tensor of rank 2 or more (token ids ``[B, T]``):
      a sequence length, kept dynamic where the model allows it.
    * ``{"seq": 1}``: dimension 1 of every tensor input of rank 2 or more.
    * ``{"input_ids": {1: "seq"}}``: the named dimensions of the named inputs.

    All are ``Dim.AUTO``: export keeps a dimension dynamic where the model allows it and fixes it
    otherwise; the explicit ones (returned as ``(input, dim)``) must stay dynamic (see
    :func:`capture_graph`).
    """
    check_dynamic(dynamic)
    asked: list[tuple[str, int]] = []
    values = dict(zip(names, args)) | dict(kwargs)
    per_input = isinstance(dynamic, Mapping) and any(isinstance(v, Mapping)
                                                     for v in dynamic.values())
    if per_input:
        unknown = sorted(set(dynamic) - set(values))
        if unknown:
            raise TraceError(
                f"dynamic= names input {unknown[0]!r}, which the model's call does not take "
                f"(its inputs: {', '.join(values)})"
            )

    def spec(name: str, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            return None
        dims = {0: Dim.AUTO}
        if dynamic == "auto":
            extra = [1] if x.dim() >= 2 and not x.is_floating_point() and not x.is_complex() else []
        elif not dynamic:
            extra = []
        elif per_input:
            extra = list(dynamic.get(name, {}))
            for d in extra:
                if d >= x.dim():
                    raise TraceError(
                        f"dynamic= names dimension {d} of input {name!r}, which has shape "
                        f"{tuple(x.shape)} ({x.dim()} dimensions)"
                    )
        else:
            extra = [d for d in dynamic.values() if d < x.dim()]
        for d in extra:
            if dynamic != "auto" and x.shape[d] < 2:  # export fixes a size of 0 or 1
                raise TraceError(
                    f"dynamic= names dimension {d} of input {name!r}, of size {x.shape[d]} in "
                    "the example; torch.export fixes sizes 0 and 1: use an example of 2 or more"
                )
            dims[d] = Dim.AUTO
            if dynamic != "auto":
                asked.append((name, d))
        return dims

    out = {name: tree_map(functools.partial(spec, name), v) for name, v in values.items()}
    if isinstance(dynamic, Mapping) and not per_input and dynamic and not asked:
        shapes = {n: tuple(v.shape) for n, v in values.items() if isinstance(v, torch.Tensor)}
        raise TraceError(
            f"dynamic={dict(dynamic)!r} names a dimension no tensor input has (input shapes: "
            f"{shapes})"
        )
    return out, asked


def _fixed(gm: torch.fx.GraphModule, asked: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """The asked-for dimensions export fixed: ``(input, dim, size)``."""
    shapes = {}
    for want in _captured_shapes(gm):
        if want is not None:
            shapes[want[0]] = want[1]
    out = []
    for name, d in asked:
        dims = shapes.get(name) or next((v for k, v in shapes.items() if k.startswith(name)), None)
        if dims is not None and type(dims[d]) is int:
            out.append((name, d, dims[d]))
    return out


def _strip_guards(gm: torch.fx.GraphModule) -> None:
    # export's input guards and metadata asserts re-check the example call's shapes and dtypes;
    # transformed graphs (scaled, fused, folded batches) run with other ones on purpose
    for sub in gm.children():
        if isinstance(sub, torch.fx.GraphModule):  # `with` regions
            _strip_guards(sub)
    for node in list(gm.graph.nodes):
        guard = node.op == "call_module" and node.target.startswith("_guards")
        if guard or node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    for name, _ in list(gm.named_children()):
        if name.startswith("_guards"):
            delattr(gm, name)
    gm.recompile()


def _drop_opaque(out: Any) -> Any:
    """Outputs other than tensors, numbers and pytree containers become ``None``.

    Such objects (a generation cache, say) cannot be graph outputs, and training does not read
    them.
    """

    def keep(x: Any) -> Any:
        return x if x is None or isinstance(x, (torch.Tensor, int, float, bool, str)) else None

    return tree_map(keep, out)


def _rename_regions(gm: torch.fx.GraphModule, prefix: str) -> None:
    """Give the subgraphs of ``with`` regions (autocast, no_grad) names unique to one mode.

    Export keeps such regions as higher-order ops over parameter-free submodules
    (``submod_1``); the train and eval graphs both have them, and both are read from one
    :class:`Captured`.
    """
    renamed = False
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        sub = getattr(gm, node.target, None)
        if isinstance(sub, torch.fx.GraphModule) and "." not in node.target:
            new = f"{prefix}{node.target}"
            delattr(gm, node.target)
            gm.add_submodule(new, sub)
            node.target = new
            node._rename(new)  # export numbers these nodes its own way; a loaded program too
            renamed = True
    if renamed:
        gm.recompile()


def capture_graph(
    model: nn.Module,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    prefix: str = "",
    dynamic: Dynamic = None,
    cache: bool | None = None,
    state: _cache.ModelState | None = None,
) -> torch.fx.GraphModule:
    """The ATen graph of one call ``model(*args, **kwargs)`` in the model's current mode.

    ``dynamic`` says which dimensions besides the batch may stay dynamic
    (:func:`dynamic_shapes`). With ``"auto"`` a sequence length is tried, and the batch alone
    kept if export fails with it; a dimension asked for explicitly that the model fixes is an
    error. ``cache``: read and write the capture cache (:mod:`hydro.fx.cache`; ``None``: unless
    ``HYDRO_CACHE=0``); ``state``: the model's part of the cache key, taken before this
    capture's first export (:func:`hydro.fx.cache.model_state`); ``None``: the model as it is.
    """
    args, kwargs = _unalias(tuple(args), dict(kwargs or {}))
    names = [n for n, _ in _arg_names(model, len(args), args)]
    shapes, asked = dynamic_shapes(names, args, kwargs, dynamic)
    try:
        gm = _export(model, args, kwargs, shapes, prefix, cache, state)
    except TraceError:
        if dynamic != "auto":
            raise
        # the sequence length was only a guess: a model may fail with it and pass without
        shapes, _ = dynamic_shapes(names, args, kwargs, None)
        gm = _export(model, args, kwargs, shapes, prefix, cache, state)
    fixed = _fixed(gm, asked)
    if fixed:
        name, d, size = fixed[0]
        raise TraceError(
            f"cannot capture {type(model).__name__} with dimension {d} of input '{name}' "
            f"dynamic: the model fixes it to {size} (a table of positions used whole, a view "
            f"with that size); drop it from dynamic= and call the model at size {size}"
        )
    return gm


def _export(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    dynamic: dict,
    prefix: str,
    cache: bool | None = None,
    state: _cache.ModelState | None = None,
) -> torch.fx.GraphModule:
    # keyed before export runs the forward (which may change the model's attributes)
    key = _cache.key(model, args, kwargs, dynamic, state) if _cache.enabled(cache) else None
    gm = _cache.load(key, model, type(model).__name__) if key else None
    keyed = gm is not None
    if gm is None:
        host = host_random._state()
        gm = _export_program(model, args, kwargs, dynamic).module()
        _strip_guards(gm)
        # a forward that drew from the host's generators is caught by host_random.watch around
        # this capture; a cached program would skip that draw, and the error or warning with it
        if key and host_random._state() == host:
            keyed = _cache.store(key, gm, model)
    _rename_regions(gm, prefix)
    plain = torch.fx.GraphModule(gm, gm.graph, type(model).__name__)
    plain._in_spec, plain._out_spec = gm._in_spec, gm._out_spec
    if keyed:  # the key determines this program: analyses of it may be cached under it too
        plain.hydro_cache_key = key
    return plain


def _export_program(model: nn.Module, args: tuple, kwargs: dict, dynamic: dict) -> Any:
    """``torch.export`` of ``model`` (non-strict), its non-tensor outputs dropped."""
    forward = model.forward

    @functools.wraps(forward)
    def tensors_only(*a: Any, **k: Any) -> Any:
        return _drop_opaque(forward(*a, **k))

    model.forward = tensors_only  # instance attribute: the class stays untouched
    try:
        with _quiet_torch_logs():
            return torch.export.export(
                model, tuple(args), kwargs, dynamic_shapes=dynamic, strict=False
            )
    except Exception as exc:
        raise TraceError(explain(exc, model)) from exc
    finally:
        del model.forward


# Loggers through which torch.export reports a failing op (fake tensors, dynamo, export, fx's
# symbolic shapes) with its whole traceback, tens of lines, before it raises: the exception
# reaches the user anyway, as TraceError's one line.
_EXPORT_LOGGERS = (
    "torch._subclasses",
    "torch._dynamo",
    "torch._export",
    "torch.export",
    "torch.fx",
    "torch._functorch",
    "torch._guards",
)


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Silence torch.export's loggers for the duration (unless ``TORCH_LOGS`` asks for them)."""
    if os.environ.get("TORCH_LOGS"):
        yield
        return
    names = set(_EXPORT_LOGGERS) | {
        name
        for name in list(logging.root.manager.loggerDict)
        if name.startswith(tuple(p + "." for p in _EXPORT_LOGGERS))
    }
    loggers = [logging.getLogger(name) for name in sorted(names)]
    levels = [lg.level for lg in loggers]
    for lg in loggers:  # children created meanwhile inherit the level of these
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _unalias(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Copies of inputs passed twice (``input_ids=x, labels=x``).

    Export records one graph input for one tensor object; a later call with two different
    tensors there must not be read as one.
    """
    seen: set[int] = set()

    def fresh(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                return x.clone()
            seen.add(id(x))
        return x

    return tree_map(fresh, args), tree_map(fresh, kwargs)


def _arg_names(model: nn.Module, n: int, specs: tuple) -> list[tuple[str, Any]]:
    params = [
        p
        for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(params) < n:
        raise TraceError(
            f"{type(model).__name__}.forward takes {len(params)} positional arguments but "
            f"{n} example inputs were given; pass the extra ones as example_kwargs"
        )
    return [(params[i].name, specs[i]) for i in range(n)]


def capture(
    model: nn.Module,
    example_inputs: tuple = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    modes: tuple[str, ...] = MODES,
    dynamic: Dynamic = None,
    cache: bool | None = None,
) -> Captured:
    """Capture ``model`` by running it on ``example_inputs`` (and ``example_kwargs``).

    Args:
        model: any ``nn.Module``; it is not modified (its mode is restored afterwards).
        example_inputs: positional inputs of one call, batch in dimension 0 of every tensor.
        example_kwargs: keyword inputs of that call (``input_ids=``, ``labels=`` ...).
        modes: the modes to capture (``"train"``, ``"eval"``); both by default.
        dynamic: the dimensions besides the batch left dynamic, so that the captured model
            runs at other sizes there. ``None`` (default): the batch only. ``"auto"``:
            dimension 1 of integer inputs of rank >= 2 (token ids ``[B, T]``: the sequence
            length) where the model allows it, else fixed (capture takes ~1.5x as long).
            ``{"seq": 1}``: dimension 1 of every tensor input of rank >= 2;
            ``{"input_ids": {1: "seq"}}``: per input. An explicitly named dimension that the
            model fixes (a positional table added whole) is an error.
        cache: reuse the exported programs of an earlier capture of the same model (code,
            configuration, tensor shapes) on inputs of the same shapes, kept on disk
            (:mod:`hydro.fx.cache`). ``None`` (default): yes, unless ``HYDRO_CACHE=0``.

    Returns:
        A :class:`Captured` module with the model's parameters and buffers (the same tensors)
        and its train and eval graphs. A :class:`Captured` passed in is returned as it is.

    Raises:
        TraceError: naming the module, file and line where the run could not be captured;
            a malformed ``dynamic``, or a dimension in it that the model fixes.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from hydro.fx.capture import capture
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> cap = capture(net, (torch.randn(3, 4),))
        >>> sorted(cap.state_dict()) == sorted(net.state_dict())
        True
        >>> x = torch.randn(5, 4)   # another batch size
        >>> torch.equal(cap(x), net(x))
        True
    """
    if isinstance(model, Captured):
        return model
    if not isinstance(model, nn.Module):
        raise TraceError(
            f"expected an nn.Module to capture, got {type(model).__name__}; pass the model "
            "instance (not its class or a factory)"
        )
    if not tree_flatten((example_inputs, dict(example_kwargs or {})))[0]:
        raise TraceError(
            f"capturing {type(model).__name__} needs example inputs: pass example_inputs=(x,) "
            "or example_kwargs={...} with one small batch"
        )
    was_training = model.training
    graphs = {}
    states: dict[str, _cache.ModelState | None] = {}
    try:
        for mode in modes:  # every mode keyed on the model as found, before any forward runs
            model.train(mode == "train")
            states[mode] = _cache.model_state(model) if _cache.enabled(cache) else None
        for mode in modes:
            model.train(mode == "train")
            # host randomness (random, NumPy) would be frozen into the graph: say where
            with host_random.watch(model, tuple(example_inputs), example_kwargs or {}, mode):
                graphs[mode] = capture_graph(
                    model,
                    tuple(example_inputs),
                    example_kwargs,
                    prefix=f"{mode}_",
                    dynamic=dynamic,
                    cache=cache,
                    state=states[mode],
                )
    finally:
        model.train(was_training)
    keys = set(model.state_dict())
    non_persistent = {n for n, _ in model.named_buffers(remove_duplicate=False) if n not in keys}
    cap = Captured(graphs, type(model).__name__, state=model, non_persistent=non_persistent)
    modules.adopt(cap, model)
    cap.train(was_training)
    return cap

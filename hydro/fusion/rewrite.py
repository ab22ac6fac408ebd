"""The graph rewrite from one model to ``n`` fused trials.

Two small passes over the traced ``GraphModule`` of one trial:

1. :func:`batch_facts` propagates shapes (``ShapeProp``) twice, at the example batch size ``B`` and
   at ``2B``. A tensor whose leading dimension doubles (and nothing else changes) carries the batch;
   one that does not change is batch-free. Anything else means the batch left the leading position,
   which fusion cannot follow.
2. :func:`fuse_graph` rebuilds the graph for ``n`` trials. Batched tensors are *folded*: the ``n``
   per-trial batches stacked trial-major as ``[n * B, ...]``, so user code (``view(B, T, H, D)``,
   attention, pooling, residual adds) runs unchanged with ``B`` reading ``n * B``. Layers with
   parameters become fused layers (``ops.py``). Per-trial values without a batch (parameters read
   with ``get_attr``, embeddings of positions) are stacked ``[n, ...]``; elementwise ops that mix
   them with folded tensors are rewritten to broadcast over an explicit trial dimension, and other
   ops on them fall back to ``torch.func.vmap`` with a logged warning.

Layouts of values in the fused graph (see ``ops.py``): ``"F"`` folded, ``"T"`` trial-stacked,
``"S"`` shared by all trials, ``"SB"`` a shared model input that carries the batch (fed to the
layers that can read it without a copy, and expanded to ``"F"`` for everything else).
"""

from __future__ import annotations

import copy
import inspect
import logging
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from hydro.errors import FuseError
from hydro.fusion.ops import FusedModule, trial_linear, unfold

logger = logging.getLogger("hydro.fusion")

Node = torch.fx.Node


@dataclass
class Facts:
    """What shape propagation says about one node's value."""

    shapes: list[tuple[int, ...]]  # shapes of its tensor leaves at the example batch size
    batched: bool  # True: every tensor leaf carries the batch in dimension 0


def _leaf_shapes(node: Node) -> list[tuple[int, ...]] | None:
    meta = node.meta.get("tensor_meta")
    if meta is None:
        return None
    leaves, _ = tree_flatten(meta, is_leaf=lambda m: isinstance(m, TensorMetadata))
    return [tuple(m.shape) for m in leaves if isinstance(m, TensorMetadata)]


def _propagate(gm: torch.fx.GraphModule, inputs: tuple) -> dict[str, list[tuple[int, ...]] | None]:
    ShapeProp(gm).propagate(*inputs)
    return {node.name: _leaf_shapes(node) for node in gm.graph.nodes}


def _double_batch(x: object) -> object:
    return torch.cat([x, x]) if isinstance(x, torch.Tensor) and x.dim() > 0 else x


def batch_facts(gm: torch.fx.GraphModule, inputs: tuple) -> dict[str, Facts | None]:
    """Which values of ``gm`` carry the batch, from shape propagation at batch ``B`` and ``2B``.

    Runs on a ``meta`` copy when possible (no compute, no change to ``gm``'s buffers or the RNG);
    a model that creates tensors on a fixed device falls back to a real copy.

    Raises:
        FuseError: a value whose batch is not its leading dimension, naming the node.
    """
    try:
        probe = copy.deepcopy(gm).to("meta")
        args = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)
        small, big = _propagate(probe, args), _propagate(probe, tree_map(_double_batch, args))
    except Exception:  # noqa: BLE001 - any failure on meta: retry for real
        probe = copy.deepcopy(gm)
        with torch.random.fork_rng():
            small = _propagate(probe, inputs)
            big = _propagate(probe, tree_map(_double_batch, inputs))
    facts: dict[str, Facts | None] = {}
    for node in gm.graph.nodes:
        s1, s2 = small[node.name], big[node.name]
        if not s1:
            facts[node.name] = None
            continue
        kinds = {_batch_kind(a, b) for a, b in zip(s1, s2)}
        if "moved" in kinds or (len(kinds) > 1 and node.op != "output"):
            raise FuseError(
                f"cannot fuse node '{node.name}' ({node.format_node()}): its batch dimension is "
                f"not the leading one (shapes {s1} at the example batch size, {s2} at twice it). "
                "Fusion stacks trials along the batch; keep the batch first (e.g. batch_first=True)"
            )
        facts[node.name] = Facts(s1, kinds == {"batched"})
    return facts


def _batch_kind(small: tuple[int, ...], big: tuple[int, ...]) -> str:
    if small == big:
        return "free"
    if len(small) == len(big) and small[1:] == big[1:] and big[0] == 2 * small[0]:
        return "batched"
    return "moved"


# Ops that broadcast their tensor arguments elementwise (or over leading dims, like matmul): with a
# trial-stacked argument they run once on an explicit trial dimension instead of under vmap.
_BROADCASTING = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.pow, operator.neg,
    operator.matmul, operator.iadd, operator.imul, torch.add, torch.sub, torch.mul, torch.div,
    torch.matmul, torch.where, torch.maximum, torch.minimum, torch.exp, torch.tanh, torch.sigmoid,
    torch.relu, torch.sqrt, torch.rsqrt, torch.abs, F.relu, F.gelu, F.silu, F.tanh, F.sigmoid,
    "add", "sub", "mul", "div", "matmul", "masked_fill", "pow", "exp", "tanh", "sigmoid", "relu",
    "sqrt", "rsqrt", "abs", "neg", "to", "float", "double", "type_as", "clone", "contiguous",
}  # fmt: skip
_ELEMENTWISE_MODULES = (
    nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Identity,
)  # fmt: skip
_MATMULS = {operator.matmul, torch.matmul, "matmul"}

# Ops whose `dim` argument (at this position) would act across the batch if it were 0.
_DIM_POSITION = {
    "cat": 1, "concat": 1, "softmax": 1, "log_softmax": 1, "cumsum": 1, "cumprod": 1, "flip": 1,
    "roll": 2, "sort": 1, "argsort": 1, "split": 2, "chunk": 2, "index_select": 1, "gather": 1,
    "narrow": 1, "select": 1, "unbind": 1, "sum": 1, "mean": 1, "amax": 1, "amin": 1,
}  # fmt: skip


def _op_name(node: Node) -> str:
    if node.op == "call_method":
        return node.target
    return getattr(node.target, "__name__", str(node.target))


def _dims_of(value: object) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, (tuple, list)) and all(isinstance(v, int) for v in value):
        return list(value)
    return []


def _acts_on_batch_dim(node: Node, rank: int) -> bool:
    """Whether the op names dimension 0 of a batched tensor of rank ``rank`` as a `dim`."""
    dims = _dims_of(node.kwargs.get("dim", node.kwargs.get("dims")))
    pos = _DIM_POSITION.get(_op_name(node))
    if pos is not None and len(node.args) > pos:
        dims += _dims_of(node.args[pos])
    return any(d == 0 or d == -rank for d in dims)


class VmapOp(nn.Module):
    """Runs one op per trial under ``torch.func.vmap``: the fallback for ops without a fused form.

    ``layouts`` gives, for every leaf of ``(args, kwargs)``, ``"F"`` (folded, unfolded to
    ``[n, B, ...]`` and mapped), ``"T"`` (mapped) or ``None`` (passed to every trial as is).
    """

    def __init__(self, op: Callable | str, n: int, layouts: list, fold_out: bool) -> None:
        super().__init__()
        self.op, self.n, self.layouts, self.fold_out = op, n, layouts, fold_out

    def forward(self, *args: object, **kwargs: object) -> object:
        leaves, spec = tree_flatten((args, kwargs))
        mapped = [i for i, lay in enumerate(self.layouts) if lay in ("F", "T")]

        def one_trial(*xs: torch.Tensor) -> object:
            values = list(leaves)
            for i, x in zip(mapped, xs):
                values[i] = x
            a, k = tree_unflatten(values, spec)
            if isinstance(self.op, str):
                return getattr(a[0], self.op)(*a[1:], **k)
            return self.op(*a, **k)

        xs = [unfold(leaves[i], self.n) if self.layouts[i] == "F" else leaves[i] for i in mapped]
        out = torch.func.vmap(one_trial, randomness="different")(*xs)
        return tree_map(lambda t: t.flatten(0, 1), out) if self.fold_out else out


def fuse_graph(
    template: torch.fx.GraphModule,
    facts: dict[str, Facts | None],
    n: int,
    shared: bool,
    fused_layers: dict[str, FusedModule],
    tensors: dict[str, torch.Tensor],
    shared_tensors: set[str],
) -> torch.fx.GraphModule:
    """Rewrite one trial's graph into a graph that runs ``n`` trials.

    Args:
        template: one trial's traced graph.
        facts: :func:`batch_facts` of ``template`` for one trial's inputs.
        n: the number of trials.
        shared: inputs are one model's inputs fed to every trial (``True``), or carry a leading
            ``n`` with each trial's own batch (``False``).
        fused_layers: the fused layer for every ``call_module`` target that has parameters.
        tensors: the fused ``[n, ...]`` tensor for every ``get_attr`` target.
        shared_tensors: ``get_attr`` targets equal for every trial (read as trial 0's value).

    Returns:
        A ``GraphModule`` whose outputs all carry a leading trial dimension ``[n, ...]``.

    Raises:
        FuseError: naming the node that cannot be fused.
    """
    rewriter = _Rewriter(template, facts, n, shared, fused_layers, tensors, shared_tensors)
    for node in template.graph.nodes:
        rewriter.visit(node)
    rewriter.graph.lint()
    return torch.fx.GraphModule(rewriter.owners, rewriter.graph, "FusedGraph")


class _Rewriter:
    """The state of one :func:`fuse_graph` run: one method per kind of node.

    ``env`` maps each old node to its new node, ``layout`` each old node to its new value's layout
    (``"F"``, ``"T"``, ``"S"``, ``"SB"`` or ``None`` for non-tensors), ``owners`` collects the
    modules and tensors the new graph refers to.
    """

    def __init__(self, template, facts, n, shared, fused_layers, tensors, shared_tensors):  # noqa: ANN001
        self.template, self.facts, self.n, self.shared = template, facts, n, shared
        self.fused_layers, self.tensors, self.shared_tensors = fused_layers, tensors, shared_tensors
        self.graph = torch.fx.Graph()
        self.env: dict[Node, Node] = {}
        self.layout: dict[Node, str | None] = {}
        self.owners: dict[str, object] = {}
        self._expanded: dict[Node, Node] = {}

    # --- helpers ----------------------------------------------------------------------------

    def rank(self, node: Node) -> int:
        return len(self.facts[node.name].shapes[0])

    def method(self, name: str, *args: object) -> Node:
        return self.graph.call_method(name, args)

    def folded(self, node: Node) -> Node:
        """``node``'s new value, with a shared batched input expanded to layout F (once)."""
        if self.layout[node] != "SB":
            return self.env[node]
        if node not in self._expanded:
            grown = self.method("unsqueeze", self.env[node], 0)
            grown = self.method("expand", grown, self.n, *([-1] * self.rank(node)))
            self._expanded[node] = self.method("flatten", grown, 0, 1)
        return self._expanded[node]

    def copy(self, node: Node, convert: Callable[[Node], Node]) -> Node:
        """``node`` in the new graph, its inputs mapped through ``convert``."""
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), convert)
        return self.graph.create_node(node.op, node.target, args, kwargs)

    def out_layout(self, node: Node, inputs: set) -> str | None:
        f = self.facts[node.name]
        if f is None:
            return None
        if f.batched:
            return "F"
        if inputs & {"F", "SB"} and "T" not in inputs:
            raise FuseError(
                f"cannot fuse node '{node.name}' ({node.format_node()}): it reduces over the "
                "batch dimension (or mixes samples of a batch), which would mix trials. Keep "
                "reductions over the batch in the loss, outside the model"
            )
        return "T"

    # --- nodes ------------------------------------------------------------------------------

    def visit(self, node: Node) -> None:
        if node.op in ("placeholder", "get_attr", "output"):
            getattr(self, node.op)(node)
            return
        module = self.template.get_submodule(node.target) if node.op == "call_module" else None
        if module is not None and node.target in self.fused_layers:
            self.fused_layer(node, module)
            return
        if module is not None:
            if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
                raise FuseError(
                    f"cannot fuse node '{node.name}': module '{node.target}' "
                    f"({type(module).__name__}) has parameters or buffers but no fused form"
                )
            self.owners[node.target] = module  # parameterless: an op like any other
        found: list[Node] = []
        torch.fx.node.map_arg((node.args, node.kwargs), found.append)
        inputs = {self.layout[a] for a in found} - {None}
        if not inputs & {"F", "SB", "T"}:
            self.env[node] = self.copy(node, self.env.__getitem__)
            self.layout[node] = None if self.facts[node.name] is None else "S"
        elif "T" not in inputs:
            self.batched_op(node, found)
        elif node.target is F.linear and self._per_trial_linear(node):
            self.functional_linear(node)
        elif _broadcasts(node, module, [self.rank(a) for a in found if self.layout[a]]):
            self.broadcast_op(node, found, inputs)
        else:
            self.vmap_op(node, module, inputs)

    def placeholder(self, node: Node) -> None:
        default = node.args[0] if node.args else inspect.Signature.empty
        new = self.graph.placeholder(node.target, default_value=default)
        f = self.facts[node.name]
        if f is None:
            self.env[node], self.layout[node] = new, None
        elif not self.shared:  # [n, B, ...]: each trial's own batch, folded
            self.env[node], self.layout[node] = self.method("flatten", new, 0, 1), "F"
        else:
            self.env[node], self.layout[node] = new, ("SB" if f.batched else "S")

    def get_attr(self, node: Node) -> None:
        new = self.graph.get_attr(node.target)
        if node.target not in self.tensors:  # a constant the tracer made (not a weight): shared
            self.owners[node.target] = getattr(self.template, node.target)
            self.env[node], self.layout[node] = new, "S"
            return
        self.owners[node.target] = self.tensors[node.target]
        if node.target in self.shared_tensors:
            self.env[node] = self.graph.call_function(operator.getitem, (new, 0))
            self.layout[node] = "S"
        else:
            self.env[node], self.layout[node] = new, "T"

    def output(self, node: Node) -> None:
        def with_trials(a: Node) -> Node:
            if self.layout[a] == "F":
                return self.method("unflatten", self.env[a], 0, (self.n, -1))
            if self.layout[a] in ("S", "SB"):
                grown = self.method("unsqueeze", self.env[a], 0)
                return self.method("expand", grown, self.n, *([-1] * self.rank(a)))
            return self.env[a]

        self.graph.output(torch.fx.node.map_arg(node.args[0], with_trials))

    def fused_layer(self, node: Node, module: nn.Module) -> None:
        """A layer with parameters: call its fused form with its input's layout.

        Its main input may stay shared (the layer then returns ``[n, ...]``, folded here when it
        carries the batch); attention and any extra tensor inputs (masks) are folded.
        """
        self.owners[node.target] = self.fused_layers[node.target]
        x = node.args[0]
        keep_shared = not isinstance(module, nn.MultiheadAttention)
        in_layout = self.layout[x]
        if in_layout == "SB":
            in_layout = "S" if keep_shared else "F"

        def convert(a: Node) -> Node:
            if a is x and keep_shared:
                return self.env[a]
            return self.folded(a)

        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), convert)
        new = self.graph.call_module(node.target, args, {**kwargs, "layout": in_layout})
        if in_layout == "S":
            out = "F" if self.facts[node.name].batched else "T"
            if out == "F":
                new = self.method("flatten", new, 0, 1)
        else:
            out = self.out_layout(node, {in_layout})
        self.env[node], self.layout[node] = new, out

    def _per_trial_linear(self, node: Node) -> bool:
        x, weight, bias = _linear_args(node)
        return (
            isinstance(x, Node)
            and self.layout[x] in ("F", "SB", "S")
            and isinstance(weight, Node)
            and self.layout[weight] == "T"
            and self.rank(weight) == 2
            and (bias is None or isinstance(bias, Node) and self.layout[bias] == "T")
        )

    def functional_linear(self, node: Node) -> None:
        """``F.linear(x, w, b)`` with a per-trial weight: the fused linear op."""
        x, weight, bias = _linear_args(node)
        in_layout = {"SB": "S"}.get(self.layout[x], self.layout[x])
        args = (self.env[x], self.env[weight], None if bias is None else self.env[bias])
        new = self.graph.call_function(trial_linear, args, {"layout": in_layout})
        out = "F" if self.facts[node.name].batched else "T"
        if in_layout == "S" and out == "F":
            new = self.method("flatten", new, 0, 1)
        self.env[node], self.layout[node] = new, out

    def batched_op(self, node: Node, found: list[Node]) -> None:
        """Folded (and shared) operands only: the op runs unchanged on ``[n * B, ...]``."""
        for a in found:
            if self.layout[a] in ("F", "SB") and _acts_on_batch_dim(node, self.rank(a)):
                raise FuseError(
                    f"cannot fuse node '{node.name}' ({node.format_node()}): it works along the "
                    "batch dimension (dim 0), which would mix trials"
                )
        self.layout[node] = self.out_layout(node, {self.layout[a] for a in found})
        self.env[node] = self.copy(node, self.folded)

    def broadcast_op(self, node: Node, found: list[Node], inputs: set) -> None:
        """Trial-stacked operands of an elementwise op or matmul: lift every per-trial operand
        to ``[n, 1, ..., *its shape]`` (folded ones to ``[n, B, ...]``) and broadcast."""
        out = self.out_layout(node, inputs)
        top = max(self.rank(a) for a in found if self.layout[a] is not None)

        def lift(a: Node) -> Node:
            if self.layout[a] in (None, "S"):
                return self.env[a]
            v = self.folded(a)
            if self.layout[a] in ("F", "SB"):
                v = self.method("unflatten", v, 0, (self.n, -1))
            for _ in range(top - self.rank(a)):
                v = self.method("unsqueeze", v, 1)
            return v

        new = self.copy(node, lift)
        self.env[node] = self.method("flatten", new, 0, 1) if out == "F" else new
        self.layout[node] = out

    def vmap_op(self, node: Node, module: nn.Module | None, inputs: set) -> None:
        """Anything else with per-trial operands: ``torch.func.vmap`` over the trials."""
        logger.warning(
            "hydro.fuse: node '%s' (%s) has no fused form for per-trial operands; running it "
            "under torch.func.vmap (slower)",
            node.name,
            node.format_node(),
        )
        out = self.out_layout(node, inputs)
        leaves, _ = tree_flatten((list(node.args), dict(node.kwargs)))
        lays = [self.layout[a] if isinstance(a, Node) else None for a in leaves]
        lays = [{"SB": "F"}.get(lay, lay) if lay in ("F", "SB", "T") else None for lay in lays]
        name = f"_hydro_vmap_{node.name}"
        op = module if module is not None else node.target
        self.owners[name] = VmapOp(op, self.n, lays, out == "F")
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), self.folded)
        self.env[node] = self.graph.call_module(name, args, kwargs)
        self.layout[node] = out


def _linear_args(node: Node) -> tuple[object, object, object]:
    """``(input, weight, bias)`` of an ``F.linear`` call, positional or keyword."""
    names = ("input", "weight", "bias")
    values = list(node.args) + [node.kwargs.get(k) for k in names[len(node.args) :]]
    return values[0], values[1], values[2] if len(values) > 2 else None


def _broadcasts(node: Node, module: nn.Module | None, ranks: list[int]) -> bool:
    """Whether the op broadcasts its operands (elementwise, or a matmul of matrices)."""
    if module is not None:
        return isinstance(module, _ELEMENTWISE_MODULES)
    if node.target in _MATMULS:
        return min(ranks) >= 2  # 1-d operands of matmul do not broadcast like batches
    return node.target in _BROADCASTING

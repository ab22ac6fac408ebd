"""Width analysis: which dimensions of a traced model are "width", by propagation over the graph.

Every dimension of every tensor in the graph (parameters and buffers included) gets a symbol.
Each node relates symbols: a linear layer ties its input's last dimension to its weight's fan-in,
a residual add ties aligned dimensions, a ``view`` that splits heads says ``C = H * D``, ``cat``
says the output is a sum, ``split`` cuts a dimension into proportional parts. Equal symbols are
merged with union-find; products, sums and proportions stay as constraints.

Classes reached from the graph's inputs and outputs are *fixed* (input features, classes,
vocabulary, sequence length, image size). Every other class holding a parameter dimension is
*width* and shrinks by ``ratio``; the rest (head counts, head dims, flattened sizes) are solved from
the constraints, with the head policy deciding between two unknowns. The result says the new size
of every dimension; :mod:`hydro.scaling` rebuilds the model from it and re-propagates shapes to
check.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx
from torch import nn

from hydro.errors import ScaleError
from hydro.fx.paths import get_path
from hydro.fx.shapes import propagate

_TORCH_DIR = os.path.dirname(torch.__file__)

HeadPolicy = Literal["keep_head_dim", "keep_head_count"]

# Ops whose output has the shape of their (broadcast) tensor inputs with dimensions in place.
_POOLS = (
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
    nn.Upsample, nn.PixelShuffle,
)  # fmt: skip
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV_TRANSPOSES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_REDUCTIONS = {
    "sum", "mean", "amax", "amin", "max", "min", "std", "var", "norm", "logsumexp", "prod",
    "argmax", "argmin", "nansum", "nanmean",
}  # fmt: skip
_PERMUTES = {"transpose", "swapaxes", "swapdims", "permute", "t", "movedim", "moveaxis"}
_RESHAPES = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as"}
_CREATORS = {"zeros", "ones", "empty", "full", "rand", "randn", "new_zeros", "new_ones",
             "new_empty", "new_full"}  # fmt: skip


@dataclass
class Product:
    """``prod(lhs) * lhs_const == prod(rhs) * rhs_const``, from a reshape."""

    node: str
    lhs: list[int]
    rhs: list[int]
    lhs_const: int = 1
    rhs_const: int = 1


@dataclass
class Sum:
    """``out == sum(parts) + const``, from a concatenation."""

    node: str
    out: int
    parts: list[int]
    const: int = 0


@dataclass
class Proportion:
    """``part == whole * num / den``: a split keeps each part's share of the whole."""

    node: str
    part: int
    whole: int
    num: int
    den: int


@dataclass
class ParamUse:
    """How one op uses a parameter: which of its dimensions are fan-in and fan-out."""

    node: str
    fan_in: tuple[int, ...]
    fan_out: tuple[int, ...]


@dataclass
class WidthPlan:
    """The outcome of width analysis: old and new size of every dimension of the graph.

    Attributes:
        gm: the traced target.
        ratio: the width ratio the plan was solved for.
        values: each node's value when run on the example inputs (fake tensors, ints, tuples).
        node_syms: each node's symbols (a nested structure mirroring its value).
        param_syms: symbols of each parameter or buffer, keyed by ``id(tensor)``.
        tensor_names: the qualified names of each parameter or buffer (tied tensors have several).
        new_size: the solved new size of every class root.
        width: the class roots whose size follows the width: shrunk by ``ratio`` directly, or
            solved from such classes (a concatenation of width and fixed parts, a head count).
        fixed: the class roots tied to inputs or outputs.
        uses: for each parameter id, how ops use it (for roles).
        head_decisions: per product constraint resolved by the head policy, what was kept.
    """

    gm: torch.fx.GraphModule
    ratio: int
    values: dict[torch.fx.Node, Any]
    node_syms: dict[torch.fx.Node, Any]
    param_syms: dict[int, list[int]]
    tensor_names: dict[int, list[str]]
    sizes: list[int]
    parent: list[int]
    new_size: dict[int, int]
    width: set[int]
    fixed: set[int]
    uses: dict[int, list[ParamUse]]
    head_decisions: list[str] = field(default_factory=list)

    def find(self, s: int) -> int:
        while self.parent[s] != s:
            self.parent[s] = self.parent[self.parent[s]]
            s = self.parent[s]
        return s

    def new_dim(self, s: int) -> int:
        return self.new_size.get(self.find(s), self.sizes[s])

    def is_width(self, s: int) -> bool:
        return self.find(s) in self.width

    def param_shape(self, t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(old_shape, new_shape)`` of a parameter or buffer of the target."""
        syms = self.param_syms[id(t)]
        return tuple(self.sizes[s] for s in syms), tuple(self.new_dim(s) for s in syms)

    def width_mask(self, t: torch.Tensor) -> tuple[bool, ...]:
        """Which dimensions of a parameter are width."""
        return tuple(self.is_width(s) for s in self.param_syms[id(t)])

    def new_shape(self, syms: Any) -> Any:
        """Map a node's symbol structure to its expected new shape structure."""
        if isinstance(syms, _TensorSyms):
            return tuple(self.new_dim(s) for s in syms)
        if isinstance(syms, (tuple, list)):
            return type(syms)(self.new_shape(s) for s in syms)
        if isinstance(syms, _IntSym):
            return self.new_dim(syms.sym) if syms.sym is not None else None
        return None


class _TensorSyms(tuple):
    """The symbols of a tensor's dimensions."""


@dataclass
class _IntSym:
    """An int in the graph (from ``x.size(i)``), with the symbol of the dimension it reads."""

    sym: int | None


def op_name(node: torch.fx.Node) -> str:
    """A uniform name for call_function and call_method nodes (``"view"``, ``"matmul"``...)."""
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return node.op


def node_arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    """An argument by position or keyword (position counts ``self`` for methods)."""
    if name in node.kwargs:
        return node.kwargs[name]
    if index < len(node.args):
        return node.args[index]
    return default


def describe(node: torch.fx.Node) -> str:
    """'node NAME (op TARGET) at FILE, line N (`code`)' for error messages."""
    where = ""
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i]
        if line.startswith("File ") and _TORCH_DIR not in line:
            where = " at " + line.replace("File ", "").replace('"', "")
            if i + 1 < len(lines) and not lines[i + 1].startswith("File "):
                where += f" (`{lines[i + 1]}`)"
            break
    target = node.target if isinstance(node.target, str) else op_name(node)
    return f"node '{node.name}' ({node.op} {target}){where}"


class _Analysis:
    """Builds symbols and relations for one graph, then solves them for a ratio."""

    def __init__(self, gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any]) -> None:
        self.gm = gm
        self.values = values
        self.sizes: list[int] = []
        self.parent: list[int] = []
        self.fixed_syms: set[int] = set()
        self.derived_syms: set[int] = set()
        self.param_dim_syms: set[int] = set()
        self.products: list[Product] = []
        self.sums: list[Sum] = []
        self.props: list[Proportion] = []
        self.node_syms: dict[torch.fx.Node, Any] = {}
        self.param_syms: dict[int, list[int]] = {}
        self.tensor_names: dict[int, list[str]] = {}
        self.uses: dict[int, list[ParamUse]] = {}
        for name, t in gm.named_parameters(remove_duplicate=False):
            self._register_tensor(name, t, is_param=True)
        for name, t in gm.named_buffers(remove_duplicate=False):
            self._register_tensor(name, t, is_param=False)

    # --- symbols ---------------------------------------------------------------------------

    def new_sym(self, size: int) -> int:
        s = len(self.sizes)
        self.sizes.append(int(size))
        self.parent.append(s)
        if size == 1:
            self.fixed_syms.add(s)  # a unit dimension is a broadcast, never a width
        return s

    def find(self, s: int) -> int:
        while self.parent[s] != s:
            self.parent[s] = self.parent[self.parent[s]]
            s = self.parent[s]
        return s

    def union(self, a: int, b: int, node: torch.fx.Node | None = None) -> None:
        if self.sizes[a] != self.sizes[b]:
            if self.sizes[a] == 1 or self.sizes[b] == 1:
                return  # broadcasting
            raise ScaleError(
                f"internal width analysis error at {describe(node) if node else 'a node'}: "
                f"tying dimensions of sizes {self.sizes[a]} and {self.sizes[b]}"
            )
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)

    def _register_tensor(self, name: str, t: torch.Tensor, is_param: bool) -> None:
        key = id(t)
        self.tensor_names.setdefault(key, []).append(name)
        if key in self.param_syms:
            return
        syms = [self.new_sym(d) for d in t.shape]
        self.param_syms[key] = syms
        if is_param:
            self.param_dim_syms.update(syms)

    def tensor_syms(self, value: torch.Tensor) -> _TensorSyms:
        return _TensorSyms(self.new_sym(d) for d in value.shape)

    def fresh(self, value: Any) -> Any:
        """Fresh symbols mirroring a value's structure."""
        if isinstance(value, torch.Tensor):
            return self.tensor_syms(value)
        if isinstance(value, torch.Size):
            return tuple(_IntSym(self.new_sym(d)) for d in value)
        if isinstance(value, (tuple, list)):  # named tuples (torch.return_types) become tuples
            return (
                [self.fresh(v) for v in value]
                if isinstance(value, list)
                else tuple(self.fresh(v) for v in value)
            )
        if isinstance(value, int) and not isinstance(value, bool):
            return _IntSym(None)
        return None

    def fix(self, syms: Any) -> None:
        if isinstance(syms, _TensorSyms):
            self.fixed_syms.update(syms)
        elif isinstance(syms, (tuple, list)):
            for s in syms:
                self.fix(s)
        elif isinstance(syms, _IntSym) and syms.sym is not None:
            self.fixed_syms.add(syms.sym)

    def syms_of(self, arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node):
            return self.node_syms.get(arg)
        return None

    def use(self, t: torch.Tensor, node: torch.fx.Node, fan_in: Sequence[int],
            fan_out: Sequence[int]) -> None:  # fmt: skip
        self.uses.setdefault(id(t), []).append(ParamUse(node.name, tuple(fan_in), tuple(fan_out)))

    # --- relations -------------------------------------------------------------------------

    def tie_all(self, a: Sequence[int], b: Sequence[int], node: torch.fx.Node) -> None:
        for x, y in zip(a, b):
            self.union(x, y, node)

    def broadcast(self, out: Sequence[int], ins: Iterable[Any], node: torch.fx.Node) -> None:
        """Tie trailing-aligned dimensions of equal size (sizes of one broadcast)."""
        for syms in ins:
            if not isinstance(syms, _TensorSyms):
                continue
            for o, i in zip(reversed(out), reversed(syms)):
                if self.sizes[o] == self.sizes[i] and self.sizes[i] != 1:
                    self.union(o, i, node)

    def reshape(self, src: Sequence[int], dst: Sequence[int], node: torch.fx.Node) -> None:
        """Group dimensions of equal products; tie 1-to-1 groups, constrain the others."""
        a = [s for s in src if self.sizes[s] != 1]
        b = [s for s in dst if self.sizes[s] != 1]
        i = j = 0
        while i < len(a) and j < len(b):
            ga, gb = [a[i]], [b[j]]
            pa, pb = self.sizes[a[i]], self.sizes[b[j]]
            i, j = i + 1, j + 1
            while pa != pb:
                if pa < pb and i < len(a):
                    ga.append(a[i])
                    pa *= self.sizes[a[i]]
                    i += 1
                elif pb < pa and j < len(b):
                    gb.append(b[j])
                    pb *= self.sizes[b[j]]
                    j += 1
                else:
                    break
            if len(ga) == 1 and len(gb) == 1:
                self.union(ga[0], gb[0], node)
            else:
                self.products.append(Product(node.name, ga, gb))

    # --- per-op rules ----------------------------------------------------------------------

    def run(self) -> None:
        for node in self.gm.graph.nodes:
            value = self.values.get(node)
            if node.op in ("call_function", "call_method"):
                syms = self.fresh(value)
                self.node_syms[node] = syms
                self.function_rule(node, syms)
                continue
            if node.op == "placeholder":
                syms = self.fresh(value)
                self.fix(syms)
            elif node.op == "get_attr":
                t = get_path(self.gm, node.target)
                syms = (
                    _TensorSyms(self.param_syms[id(t)])
                    if isinstance(t, torch.Tensor) and id(t) in self.param_syms
                    else self.fresh(value)
                )
            elif node.op == "output":
                self.fix(self.syms_of_structure(node.args[0]))
                continue
            else:
                syms = self.fresh(value)
                self.module_rule(node, self.gm.get_submodule(node.target), syms)
            self.node_syms[node] = syms

    def syms_of_structure(self, arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node):
            return self.node_syms.get(arg)
        if isinstance(arg, (tuple, list)):
            return [self.syms_of_structure(a) for a in arg]
        if isinstance(arg, dict):
            return [self.syms_of_structure(a) for a in arg.values()]
        return None

    def module_rule(self, node: torch.fx.Node, m: nn.Module, out: Any) -> None:
        x = self.syms_of(node.args[0]) if node.args else None
        p = lambda t: self.param_syms[id(t)]  # noqa: E731
        if isinstance(m, nn.Linear):
            w = p(m.weight)
            self.union(x[-1], w[1], node)
            self.union(out[-1], w[0], node)
            self.tie_all(out[:-1], x[:-1], node)
            if m.bias is not None:
                self.union(p(m.bias)[0], w[0], node)
            self.use(m.weight, node, (1,), (0,))
        elif isinstance(m, _CONVS + _CONV_TRANSPOSES):
            w = p(m.weight)
            transposed = isinstance(m, _CONV_TRANSPOSES)
            w_in, w_out = (0, 1) if transposed else (1, 0)
            self.fixed_syms.update(w[2:])  # kernel size
            self.fixed_syms.update(out[2:])  # spatial sizes follow the input's, never width
            self.union(out[0], x[0], node)
            out_ch = w[w_out] if not transposed else None
            depthwise = m.groups > 1 and m.groups == m.in_channels
            if depthwise:
                # one filter group per channel: groups follow the channel count
                self.union(x[1], w[0] if not transposed else w[w_in], node)
                if not transposed and m.out_channels == m.in_channels:
                    self.union(out[1], w[0], node)
                else:
                    self.products.append(
                        Product(
                            node.name, [out[1]], [x[1]], rhs_const=m.out_channels // m.in_channels
                        )
                    )
                self.fixed_syms.add(w[1] if not transposed else w[0])
            elif transposed:
                self.union(x[1], w[0], node)
                self.grouped(out[1], w[1], m.groups, node)
            else:
                self.grouped(x[1], w[1], m.groups, node)
                self.union(out[1], out_ch, node)
            if m.bias is not None:
                self.union(p(m.bias)[0], out[1], node)
            fan_in = tuple(range(1, len(w))) if not transposed else (0,)
            fan_out = (0,) if not transposed else tuple(range(1, len(w)))
            if depthwise:
                fan_in, fan_out = tuple(range(1, len(w))), (0,)
            self.use(m.weight, node, fan_in, fan_out)
        elif isinstance(m, _BATCHNORMS):
            self.tie_all(out, x, node)
            for t in (m.weight, m.bias, m.running_mean, m.running_var):
                if t is not None:
                    self.union(p(t)[0], x[1], node)
        elif isinstance(m, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))):
            self.tie_all(out, x, node)
            k = len(m.normalized_shape)
            for t in (m.weight, getattr(m, "bias", None)):
                if t is not None:
                    self.tie_all(p(t), x[len(x) - k :], node)
        elif isinstance(m, nn.GroupNorm):
            self.tie_all(out, x, node)
            for t in (m.weight, m.bias):
                if t is not None:
                    self.union(p(t)[0], x[1], node)
        elif isinstance(m, nn.Embedding):
            w = p(m.weight)
            self.fixed_syms.add(w[0])  # rows are indexed by input values: vocabulary, positions
            self.tie_all(out[:-1], x, node)
            self.union(out[-1], w[1], node)
            self.use(m.weight, node, (0,), (1,))
        elif isinstance(m, nn.MultiheadAttention):
            self.mha_rule(node, m, out)
        elif isinstance(m, _POOLS):
            nd = next((d for d in (3, 2, 1) if f"{d}d" in type(m).__name__), 2)
            keep = len(x) - nd
            self.tie_all(out[:keep], x[:keep], node)
            self.fixed_syms.update(out[keep:])
        elif isinstance(m, nn.Flatten):
            self.reshape(x, out, node)
        elif isinstance(m, nn.Unflatten):
            self.reshape(x, out, node)
        elif any(True for _ in m.parameters(recurse=True)):
            raise ScaleError(
                f"module '{node.target}' ({type(m).__name__}) has parameters but Hydro has no "
                "width rule for it. Supported layers: Linear, Conv1d/2d/3d (grouped and "
                "depthwise), ConvTranspose1d/2d/3d, BatchNorm1d/2d/3d, LayerNorm, RMSNorm, "
                "GroupNorm, Embedding, MultiheadAttention. Rewrite it with those, or with raw "
                "nn.Parameters used in forward (which Hydro traces through)."
            )
        else:
            # activations, dropout, identity, softmax...: the output has the input's dimensions
            self.generic(node, out)

    def grouped(self, channels: int, per_group: int, groups: int, node: torch.fx.Node) -> None:
        """``channels == per_group * groups`` for a convolution with a fixed number of groups."""
        if groups == 1:
            self.union(channels, per_group, node)
        else:
            self.derived_syms.add(per_group)  # follows the channel count, not scaled on its own
            self.products.append(
                Product(node.name, [channels], [per_group], lhs_const=1, rhs_const=groups)
            )

    def mha_rule(self, node: torch.fx.Node, m: nn.MultiheadAttention, out: Any) -> None:
        if not m._qkv_same_embed_dim:
            raise ScaleError(
                f"module '{node.target}' (MultiheadAttention) uses kdim/vdim different from "
                "embed_dim; Hydro scales only attention with one embedding width"
            )
        p = lambda t: self.param_syms[id(t)]  # noqa: E731
        q = self.syms_of(node_arg(node, 0, "query"))
        k = self.syms_of(node_arg(node, 1, "key"))
        v = self.syms_of(node_arg(node, 2, "value"))
        e = q[-1]
        w_in = p(m.in_proj_weight)
        self.union(w_in[1], e, node)
        self.derived_syms.add(w_in[0])
        self.products.append(Product(node.name, [w_in[0]], [e], rhs_const=3))
        if m.in_proj_bias is not None:
            self.union(p(m.in_proj_bias)[0], w_in[0], node)
        w_out = p(m.out_proj.weight)
        self.union(w_out[0], e, node)
        self.union(w_out[1], e, node)
        if m.out_proj.bias is not None:
            self.union(p(m.out_proj.bias)[0], e, node)
        for other in (k, v):
            if other is not None:
                self.union(other[-1], e, node)
        self.tie_all(out[0], q, node)
        self.use(m.in_proj_weight, node, (1,), (0,))
        self.use(m.out_proj.weight, node, (1,), (0,))

    def generic(self, node: torch.fx.Node, out: Any) -> None:
        """Elementwise-like ops: tie dimensions that line up with a tensor input's."""
        if not isinstance(out, _TensorSyms):
            return
        ins = [self.syms_of(a) for a in node.all_input_nodes]
        ins = [s for s in ins if isinstance(s, _TensorSyms)]
        out_shape = [self.sizes[s] for s in out]
        same_rank = [s for s in ins if len(s) == len(out)]
        if any([self.sizes[x] for x in s] == out_shape for s in ins) or not same_rank:
            self.broadcast(out, ins, node)
        else:
            # shape-changing op we have no rule for (pad, roll...): tie dimensions kept in place
            for s in same_rank:
                for o, i in zip(out, s):
                    if self.sizes[o] == self.sizes[i] and self.sizes[i] != 1:
                        self.union(o, i, node)

    def function_rule(self, node: torch.fx.Node, out: Any) -> None:
        # a rule may replace the node's fresh symbols (size(), .shape, getitem of a tuple)
        self._pending = None
        self._function_rule(node, out)
        if self._pending is not None:
            self.node_syms[node] = self._pending

    def _function_rule(self, node: torch.fx.Node, out: Any) -> None:
        name = op_name(node)
        args = node.args
        x = self.syms_of(args[0]) if args else None
        xv = self.values.get(args[0]) if args and isinstance(args[0], torch.fx.Node) else None
        if name == "getattr":
            if args[1] == "shape" and isinstance(x, _TensorSyms):
                self._replace(out, tuple(_IntSym(s) for s in x))
            elif args[1] in ("T", "mT") and isinstance(x, _TensorSyms):
                self.permute_rule(
                    node,
                    x,
                    out,
                    list(range(len(x)))[::-1]
                    if args[1] == "T"
                    else list(range(len(x) - 2)) + [len(x) - 1, len(x) - 2],
                )
            return
        if name == "size" and isinstance(x, _TensorSyms):
            dim = node_arg(node, 1, "dim")
            if dim is None:
                self._replace(out, tuple(_IntSym(s) for s in x))
            else:
                self._replace(out, _IntSym(x[dim]))
            return
        if name == "dim" or name == "numel":
            return
        if name == "getitem":
            self.getitem_rule(node, x, xv, out)
            return
        if name in ("linear",):
            w_node = node_arg(node, 1, "weight")
            w = self.syms_of(w_node)
            self.union(x[-1], w[1], node)
            self.union(out[-1], w[0], node)
            self.tie_all(out[:-1], x[:-1], node)
            b = self.syms_of(node_arg(node, 2, "bias"))
            if b is not None:
                self.union(b[0], w[0], node)
            self._use_node_param(w_node, node, (1,), (0,))
            return
        if name == "embedding":
            w_node = node_arg(node, 1, "weight")
            w = self.syms_of(w_node)
            self.fixed_syms.add(w[0])
            self.tie_all(out[:-1], x, node)
            self.union(out[-1], w[1], node)
            self._use_node_param(w_node, node, (0,), (1,))
            return
        if name in ("matmul", "bmm", "mm", "__matmul__"):
            self.matmul_rule(node, out)
            return
        if name == "scaled_dot_product_attention":
            q, k, v = (self.syms_of(node_arg(node, i, n)) for i, n in
                       enumerate(("query", "key", "value")))  # fmt: skip
            self.union(q[-1], k[-1], node)
            self.union(k[-2], v[-2], node)
            self.union(out[-1], v[-1], node)
            self.union(out[-2], q[-2], node)
            self.broadcast(out[:-2], [_TensorSyms(q[:-2]), _TensorSyms(k[:-2])], node)
            return
        if name in _PERMUTES:
            self.permute_rule(node, x, out, _permutation(node, len(x)))
            return
        if name in _RESHAPES or (name in ("contiguous", "clone", "detach")):
            if isinstance(x, _TensorSyms) and isinstance(out, _TensorSyms):
                self.reshape(x, out, node)
            return
        if name in ("expand", "expand_as", "broadcast_to"):
            self.broadcast(out, [x], node)
            self.size_args_rule(node, out, start=1)
            if name == "expand_as":
                self.broadcast(out, [self.syms_of(args[1])], node)
            return
        if name in ("cat", "concat", "concatenate"):
            self.cat_rule(node, out)
            return
        if name == "stack":
            tensors = [self.syms_of(t) for t in node_arg(node, 0, "tensors")]
            dim = node_arg(node, 1, "dim", 0)
            dim = dim % len(out)
            for t in tensors:
                self.tie_all([s for i, s in enumerate(out) if i != dim], t, node)
            return
        if name in ("split", "chunk", "tensor_split", "unbind"):
            self.split_rule(node, x, out, name)
            return
        if name in _REDUCTIONS and isinstance(out, _TensorSyms | tuple) and isinstance(
                x, _TensorSyms):  # fmt: skip
            self.reduction_rule(node, x, out)
            return
        if name == "arange":
            end = args[1] if len(args) > 1 else (args[0] if args else node.kwargs.get("end"))
            e = self.syms_of(end)
            if isinstance(e, _IntSym) and e.sym is not None:
                self.union(out[0], e.sym, node)
            return
        if name in _CREATORS:
            self.size_args_rule(node, out, start=1 if node.op == "call_method" else 0)
            return
        self.generic(node, out)

    def _replace(self, out: Any, new: Any) -> None:
        self._pending = new

    def getitem_rule(self, node: torch.fx.Node, x: Any, xv: Any, out: Any) -> None:
        idx = node.args[1]
        if isinstance(x, (tuple, list)) and isinstance(idx, int):
            self._replace(out, x[idx] if idx < len(x) else out)
            return
        if not isinstance(x, _TensorSyms):
            return
        items = list(idx) if isinstance(idx, tuple) else [idx]
        if any(isinstance(i, torch.fx.Node) and isinstance(self.values.get(i), torch.Tensor)
               for i in items):  # fmt: skip
            self.generic(node, out)  # advanced indexing: leave to the generic rule
            return
        n_real = sum(1 for i in items if i is not None and i is not Ellipsis)
        expanded: list[Any] = []
        for i in items:
            if i is Ellipsis:
                expanded.extend([slice(None)] * (len(x) - n_real))
            else:
                expanded.append(i)
        expanded.extend([slice(None)] * (len(x) - sum(1 for i in expanded if i is not None)))
        src, dst = 0, 0
        for i in expanded:
            if i is None:
                dst += 1
                continue
            if isinstance(i, slice):
                if i == slice(None):
                    self.union(out[dst], x[src], node)
                elif i.start in (None, 0) and i.step in (None, 1):
                    stop = self.syms_of(i.stop)
                    if isinstance(stop, _IntSym) and stop.sym is not None:
                        self.union(out[dst], stop.sym, node)
                dst += 1
            src += 1

    def _use_node_param(self, w_node: Any, node: torch.fx.Node, fan_in, fan_out) -> None:
        if isinstance(w_node, torch.fx.Node) and w_node.op == "get_attr":
            t = get_path(self.gm, w_node.target)
            self.use(t, node, fan_in, fan_out)

    def permute_rule(self, node, x, out, perm: list[int]) -> None:
        for o, i in enumerate(perm):
            self.union(out[o], x[i], node)

    def matmul_rule(self, node: torch.fx.Node, out: Any) -> None:
        a_node, b_node = node.args[0], node.args[1]
        a, b = self.syms_of(a_node), self.syms_of(b_node)
        if len(a) == 1 and len(b) == 1:
            self.union(a[0], b[0], node)
            return
        a_m = list(a) if len(a) > 1 else [None, a[0]]
        b_m = list(b) if len(b) > 1 else [b[0], None]
        self.union(a_m[-1], b_m[-2], node)
        out_l = list(out)
        if b_m[-1] is not None:
            self.union(out_l.pop(), b_m[-1], node)
        if a_m[-2] is not None:
            self.union(out_l.pop(), a_m[-2], node)
        self.broadcast(out_l, [_TensorSyms(a_m[:-2]), _TensorSyms(b_m[:-2])], node)
        for w_node, fan_in, fan_out in ((b_node, (len(b) - 2,), (len(b) - 1,)),):
            if len(b) == 2:
                self._use_node_param(w_node, node, fan_in, fan_out)

    def cat_rule(self, node: torch.fx.Node, out: Any) -> None:
        tensors = [self.syms_of(t) for t in node_arg(node, 0, "tensors")]
        dim = node_arg(node, 1, "dim", 0) % len(out)
        for t in tensors:
            self.tie_all([s for i, s in enumerate(out) if i != dim],
                         [s for i, s in enumerate(t) if i != dim], node)  # fmt: skip
        self.sums.append(Sum(node.name, out[dim], [t[dim] for t in tensors]))

    def split_rule(self, node: torch.fx.Node, x: Any, out: Any, name: str) -> None:
        if name == "unbind":
            dim = node_arg(node, 1, "dim", 0) % len(x)
            for o in out:
                self.tie_all(o, [s for i, s in enumerate(x) if i != dim], node)
            return
        default_dim = 0
        dim = node_arg(node, 2, "dim", default_dim) % len(x)
        for o in out:
            self.tie_all([s for i, s in enumerate(o) if i != dim],
                         [s for i, s in enumerate(x) if i != dim], node)  # fmt: skip
            whole = self.sizes[x[dim]]
            part = self.sizes[o[dim]]
            g = math.gcd(part, whole)
            if part == whole:
                self.union(o[dim], x[dim], node)
            else:
                self.props.append(Proportion(node.name, o[dim], x[dim], part // g, whole // g))

    def reduction_rule(self, node: torch.fx.Node, x: Any, out: Any) -> None:
        dims = node_arg(node, 1, "dim")
        keepdim = node_arg(node, 2, "keepdim", False)
        if isinstance(out, tuple) and not isinstance(out, _TensorSyms):
            outs = [o for o in out if isinstance(o, _TensorSyms)]
        else:
            outs = [out]
        if dims is None:
            return
        dims = [dims] if isinstance(dims, int) else list(dims)
        dims = {d % len(x) for d in dims}
        kept = [s for i, s in enumerate(x) if keepdim or i not in dims]
        for o in outs:
            if keepdim:
                self.tie_all([s for i, s in enumerate(o) if i not in dims],
                             [s for i, s in enumerate(x) if i not in dims], node)  # fmt: skip
            else:
                self.tie_all(o, kept, node)

    def size_args_rule(self, node: torch.fx.Node, out: Any, start: int) -> None:
        sizes = _size_args(node, start)
        if sizes is None or not isinstance(out, _TensorSyms):
            return
        for o, a in zip(reversed(out), reversed(sizes)):
            s = self.syms_of(a)
            if isinstance(s, _IntSym) and s.sym is not None:
                self.union(o, s.sym, node)


def _size_args(node: torch.fx.Node, start: int) -> list[Any] | None:
    """The size arguments of view/reshape/expand/zeros-like calls, as a flat list."""
    args = list(node.args[start:])
    name = op_name(node)
    if name in ("new_full", "full"):
        args = args[:1]
    if "size" in node.kwargs:
        args = [node.kwargs["size"]]
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return list(args[0])
    return args


def _permutation(node: torch.fx.Node, rank: int) -> list[int]:
    """For each output dimension, the input dimension it comes from."""
    name = op_name(node)
    args = node.args[1:]
    perm = list(range(rank))
    if name == "t":
        return perm[::-1]
    if name == "permute":
        dims = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
        dims = node.kwargs.get("dims", dims)
        return [d % rank for d in dims]
    if name in ("transpose", "swapaxes", "swapdims"):
        a = node_arg(node, 1, "dim0") % rank
        b = node_arg(node, 2, "dim1") % rank
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    src = node_arg(node, 1, "source")
    dst = node_arg(node, 2, "destination")
    srcs = [src] if isinstance(src, int) else list(src)
    dsts = [dst] if isinstance(dst, int) else list(dst)
    srcs, dsts = [s % rank for s in srcs], [d % rank for d in dsts]
    rest = [d for d in range(rank) if d not in srcs]
    result = [None] * rank
    for s, d in zip(srcs, dsts):
        result[d] = s
    it = iter(rest)
    return [r if r is not None else next(it) for r in result]


def _divisor_suggestions(sizes: Iterable[int], ratio: int) -> str:
    g = 0
    for s in sizes:
        g = math.gcd(g, s)
    divisors = [d for d in range(1, g + 1) if g % d == 0]
    below = [d for d in divisors if d < ratio]
    above = [d for d in divisors if d > ratio]
    options = ([below[-1]] if below else []) + ([above[0]] if above else [])
    return ", ".join(str(d) for d in options) or "1"


def analyze(
    gm: torch.fx.GraphModule,
    example_inputs: tuple[Any, ...],
    ratio: int,
    *,
    head_policy: HeadPolicy = "keep_head_dim",
) -> WidthPlan:
    """Find the width dimensions of a traced model and solve their sizes at ``ratio``.

    Args:
        gm: the traced target (from :func:`hydro.fx.trace`).
        example_inputs: inputs shaped like real ones (only their shapes and dtypes are used).
        ratio: the width divisor.
        head_policy: how a head split ``C = H * D`` shrinks: ``"keep_head_dim"`` (default, fewer
            heads of the same size; falls back to smaller heads when ``H`` is not divisible) or
            ``"keep_head_count"`` (same heads, each smaller; falls back the other way).

    Raises:
        ScaleError: a width that ``ratio`` does not divide, or a head split that cannot shrink,
            naming the module or node and the nearest ratios that would work.
    """
    values = propagate(gm, example_inputs)
    a = _Analysis(gm, values)
    a.run()
    return _solve(a, ratio, head_policy)


def _solve(a: _Analysis, ratio: int, head_policy: HeadPolicy) -> WidthPlan:
    roots = {a.find(s) for s in range(len(a.sizes))}
    fixed = {a.find(s) for s in a.fixed_syms}
    derived = {a.find(c.out) for c in a.sums} | {a.find(c.part) for c in a.props}
    derived |= {a.find(s) for s in a.derived_syms}
    touching = {a.find(s) for s in a.param_dim_syms}
    width = (touching - fixed) - derived
    new: dict[int, int] = {r: a.sizes[r] for r in fixed}

    names = _dim_names(a)
    bad = [r for r in sorted(width) if a.sizes[r] % ratio]
    if bad:
        r = bad[0]
        raise ScaleError(
            f"width {a.sizes[r]} of {names.get(r, 'a hidden dimension')} is not divisible by "
            f"ratio {ratio}. Nearest ratios that divide every width: "
            f"{_divisor_suggestions((a.sizes[w] for w in width), ratio)}; or change the width."
        )
    for r in width:
        new[r] = a.sizes[r] // ratio
    # classes whose size follows the width (directly, or through a constraint); at ratio 1
    # nothing changes size, so this, not a size comparison, says which dimensions are width
    dep: set[int] = set(width)

    decisions: list[str] = []
    pending_products = list(a.products)

    def value(s: int) -> int | None:
        return new.get(a.find(s))

    def node_error(node: str, what: str) -> ScaleError:
        n = next((n for n in a.gm.graph.nodes if n.name == node), None)
        where = describe(n) if n is not None else f"node '{node}'"
        return ScaleError(f"cannot scale {where} by ratio {ratio}: {what}")

    changed = True
    while changed:
        changed = False
        for c in a.props:
            w, p = value(c.whole), value(c.part)
            if w is not None and p is None:
                if (w * c.num) % c.den:
                    raise node_error(
                        c.node,
                        f"a split part of {a.sizes[c.part]} out of "
                        f"{a.sizes[c.whole]} does not shrink to a whole number",
                    )
                new[a.find(c.part)] = w * c.num // c.den
                if a.find(c.whole) in dep:
                    dep.add(a.find(c.part))
                changed = True
        for c in a.sums:
            parts = [value(s) for s in c.parts]
            out = value(c.out)
            if out is None and all(p is not None for p in parts):
                new[a.find(c.out)] = sum(parts) + c.const
                if any(a.find(x) in dep for x in c.parts):
                    dep.add(a.find(c.out))
                changed = True
            elif out is not None and sum(p is None for p in parts) == 1:
                known = sum(p for p in parts if p is not None)
                missing = next(s for s, p in zip(c.parts, parts) if p is None)
                new[a.find(missing)] = out - known - c.const
                if any(a.find(x) in dep for x in [c.out, *c.parts]):
                    dep.add(a.find(missing))
                changed = True
        for c in list(pending_products):
            unknown = [s for s in c.lhs + c.rhs if value(s) is None]
            unknown_roots = {a.find(s) for s in unknown}
            if not unknown_roots:
                pending_products.remove(c)
                continue
            if len(unknown_roots) == 1:
                s = unknown[0]
                lhs = math.prod(value(x) or 1 for x in c.lhs if a.find(x) != a.find(s))
                rhs = math.prod(value(x) or 1 for x in c.rhs if a.find(x) != a.find(s))
                lhs *= c.lhs_const
                rhs *= c.rhs_const
                on_left = any(a.find(x) == a.find(s) for x in c.lhs)
                num, den = (rhs, lhs) if on_left else (lhs, rhs)
                if num % den:
                    raise node_error(
                        c.node, f"a dimension of size {a.sizes[s]} would have to become {num}/{den}"
                    )
                new[a.find(s)] = num // den
                if any(a.find(x) in dep for x in c.lhs + c.rhs):
                    dep.add(a.find(s))
                pending_products.remove(c)
                changed = True
        if not changed and pending_products:
            changed = _apply_head_policy(a, pending_products, new, value, head_policy, decisions,
                                         node_error, dep)  # fmt: skip

    for r in roots:
        new.setdefault(r, a.sizes[r])
    plan = WidthPlan(
        gm=a.gm, ratio=ratio, values=a.values, node_syms=a.node_syms, param_syms=a.param_syms,
        tensor_names=a.tensor_names, sizes=a.sizes, parent=a.parent, new_size=new,
        width=dep, fixed=fixed, uses=a.uses, head_decisions=decisions,
    )  # fmt: skip
    _verify(a, plan, node_error)
    return plan


def _apply_head_policy(a, pending, new, value, policy, decisions, node_error, dep) -> bool:
    """Resolve a split ``known = outer * inner`` with two unknowns by the head policy."""
    candidates = []
    for c in pending:
        for known_side, unknown_side in ((c.lhs, c.rhs), (c.rhs, c.lhs)):
            if all(value(s) is not None for s in known_side):
                unknown = [s for s in unknown_side if value(s) is None]
                if len({a.find(s) for s in unknown}) == 2:
                    candidates.append((c, known_side, unknown_side, unknown))
    if not candidates:
        return False
    c, known_side, unknown_side, (outer, inner) = candidates[0]
    known_const = c.lhs_const if known_side is c.lhs else c.rhs_const
    other_const = c.rhs_const if known_side is c.lhs else c.lhs_const
    total = math.prod(value(s) for s in known_side) * known_const
    rest = math.prod(value(s) for s in unknown_side if value(s) is not None) * other_const
    target = total // rest if total % rest == 0 else None
    heads, dim = a.sizes[outer], a.sizes[inner]
    orders = [("head dim", inner, outer), ("head count", outer, inner)]
    if policy == "keep_head_count":
        orders.reverse()
    for kept_name, keep, solve in orders:
        if target is not None and target % a.sizes[keep] == 0:
            new[a.find(keep)] = a.sizes[keep]
            new[a.find(solve)] = target // a.sizes[keep]
            if any(a.find(x) in dep for x in known_side):
                dep.add(a.find(solve))
            decisions.append(
                f"node '{c.node}': {heads} heads x {dim} -> {new[a.find(outer)]} heads x "
                f"{new[a.find(inner)]} (kept the {kept_name})"
            )
            pending.remove(c)
            return True
    raise node_error(
        c.node,
        f"a split of {heads * dim} into {heads} x {dim} (heads x head dim) cannot shrink to "
        f"{target}: neither {heads} heads nor head dim {dim} divides it. Choose a ratio that "
        f"divides the head count ({_divisor_suggestions([heads], 1)}...) or the head dim.",
    )


def _verify(a: _Analysis, plan: WidthPlan, node_error) -> None:
    v = plan.new_dim
    for c in a.products:
        lhs = math.prod(v(s) for s in c.lhs) * c.lhs_const
        rhs = math.prod(v(s) for s in c.rhs) * c.rhs_const
        if lhs != rhs:
            raise node_error(
                c.node,
                f"a reshape of {[a.sizes[s] for s in c.lhs]} into "
                f"{[a.sizes[s] for s in c.rhs]} would need {lhs} == {rhs}",
            )
    for c in a.sums:
        if v(c.out) != sum(v(s) for s in c.parts) + c.const:
            raise node_error(c.node, "a concatenation's parts do not add up after scaling")


def _dim_names(a: _Analysis) -> dict[int, str]:
    """A readable name for each class root: the first parameter dimension in it."""
    names: dict[int, str] = {}
    for key, syms in a.param_syms.items():
        for i, s in enumerate(syms):
            names.setdefault(a.find(s), f"'{a.tensor_names[key][0]}' (dimension {i})")
    return names


__all__ = ["WidthPlan", "analyze", "describe", "op_name", "node_arg"]

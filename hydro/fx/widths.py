"""Width analysis: which dimensions of a captured model are "width", by propagation over its graphs.

Every dimension of every tensor in the captured ATen graphs (parameters and buffers included)
gets a symbol. Each op relates symbols (the rules live in :mod:`hydro.fx.rules`, one module per op
family): ``aten.linear`` ties its input's last dimension to its weight's fan-in, a residual add
ties aligned dimensions, a ``view`` that splits heads says ``C = H * D``, ``cat`` says the output
is a sum, ``split``/``slice`` cut a dimension into proportional parts. Equal symbols are merged
with union-find; products, sums and proportions stay as constraints.

Classes reached from the graphs' inputs and outputs are *fixed* (input features, classes,
vocabulary, sequence length, image size), and so is a dimension only sliced or indexed by a fixed
quantity (a learned position table read as ``pos[:T]``). Every other class holding a parameter
dimension is *width* and shrinks by ``ratio``; the rest (head counts, head dims, concatenations)
are solved from the constraints, with the head policy deciding between two unknowns. Shape facts
come from running the graphs on fake tensors, never from guesses.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx
from torch._subclasses import FakeTensorMode
from torch.fx._pytree import tree_flatten_spec

from hydro.errors import ScaleError
from hydro.fx import pins
from hydro.fx.paths import get_path
from hydro.fx.rules import RULES
from hydro.fx.rules.common import IntSym, TensorSyms, bound, op_name
from hydro.fx.rules.rotary import RotaryTable, rotary_base
from hydro.fx.rules.shape import INT_RULES

_TORCH_DIR = os.path.dirname(torch.__file__)

HeadPolicy = Literal["keep_head_dim", "keep_head_count"]


@dataclass
class Product:
    """``prod(lhs) * lhs_const == prod(rhs) * rhs_const``, from a reshape."""

    node: torch.fx.Node
    lhs: list[int]
    rhs: list[int]
    lhs_const: int = 1
    rhs_const: int = 1


@dataclass
class Sum:
    """``out == sum(parts)``, from a concatenation."""

    node: torch.fx.Node
    out: int
    parts: list[int]


@dataclass
class Part:
    """``part == whole * num / den``: a split or slice keeps its share of the whole."""

    node: torch.fx.Node
    part: int
    whole: int
    num: int
    den: int
    sliced: bool = False


@dataclass
class ParamUse:
    """How one op uses a parameter: its fan-in and fan-out dimensions, and which argument of
    the op is the activation it multiplies (where the muP readout multiplier goes)."""

    node: torch.fx.Node
    fan_in: tuple[int, ...]
    fan_out: tuple[int, ...]
    act: int | None


@dataclass
class WidthPlan:
    """The outcome of width analysis: old and new size of every dimension of the graphs.

    Attributes:
        root: the captured target (:class:`hydro.fx.capture.Captured`).
        ratio: the width ratio the plan was solved for.
        values: each node's (fake) value on the example inputs, for every graph.
        node_syms: each node's symbols (a nested structure mirroring its value).
        param_syms: symbols of each parameter or buffer, keyed by ``id(tensor)``.
        tensor_names: the qualified names of each parameter or buffer (tied ones have several).
        new_size: the solved new size of every class root.
        width: the class roots whose size follows the width.
        fixed: the class roots tied to inputs or outputs.
        uses: for each parameter id, how ops use it (for muP roles).
        head_decisions: how each head split was resolved, in words.
        kept: parameter dimensions kept because they are only indexed or sliced by a fixed
            quantity (positions), as ``(name, dim, size)``.
        pinned: hidden widths kept whole by a use (an output beside no loss, an index outside
            the cut width), as ``(dimension in words, size, reason)`` (:mod:`hydro.fx.pins`).
        tables: ids of the parameters read by index (``table[index]``): not layers of a width.
        rotary: rotary frequency buffers rebuilt for a smaller head dim, by tensor id.
    """

    root: torch.nn.Module
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
    kept: list[tuple[str, int, int]] = field(default_factory=list)
    pinned: list[tuple[str, int, str]] = field(default_factory=list)
    tables: set[int] = field(default_factory=set)
    int_rewrites: dict = field(default_factory=dict)
    literal_rewrites: dict[torch.fx.Node, tuple[int, float]] = field(default_factory=dict)
    rotary: dict[int, RotaryTable] = field(default_factory=dict)

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
        if isinstance(syms, TensorSyms):
            return tuple(self.new_dim(s) for s in syms)
        if isinstance(syms, (tuple, list)):
            return type(syms)(self.new_shape(s) for s in syms)
        if isinstance(syms, IntSym):
            return self.new_dim(syms.sym) if syms.sym is not None else None
        return None


def describe(node: torch.fx.Node) -> str:
    """'node NAME (aten.op) in module PATH (Type) at FILE, line N (`code`)' for messages."""
    where = ""
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i]
        if line.startswith("File ") and _TORCH_DIR not in line:
            where = " at " + line.replace("File ", "").replace('"', "")
            if i + 1 < len(lines) and not lines[i + 1].startswith("File "):
                where += f" (`{lines[i + 1]}`)"
            break
    module = ""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, kind = list(stack.values())[-1]
        kind = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
        path = _clean_path(path)
        if path:
            module = f" in module '{path}' ({kind.rsplit('.', 1)[-1]})"
    return f"node '{node.name}' ({op_name(node)}){module}{where}"


def _clean_path(path: str) -> str:
    # export writes module paths as L['self'].h[0].attn or as plain dotted names
    path = path.replace("L['self']", "").replace("['", ".").replace("']", "")
    path = path.replace("[", ".").replace("]", "").replace("getattr(", "").replace(")", "")
    return path.strip(".")


def module_of(node: torch.fx.Node) -> tuple[str, str] | None:
    """``(path, type name)`` of the innermost module a node was recorded in."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path, kind = list(stack.values())[-1]
    kind = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    return _clean_path(path), kind.rsplit(".", 1)[-1]


# --- shape propagation ---------------------------------------------------------------------------


def subgraph_call(node: torch.fx.Node, root: torch.nn.Module) -> tuple[Any, int] | None:
    """For a higher-order op over a subgraph (``with`` regions): ``(subgraph, index of its first
    operand)``."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    for i, a in enumerate(node.args):
        if isinstance(a, torch.fx.Node) and a.op == "get_attr":
            sub = getattr(root, a.target, None)
            if isinstance(sub, torch.fx.GraphModule):
                return sub, i + 1
    return None


class _Recorder(torch.fx.Interpreter):
    """Runs a graph with ``self`` bound to the captured module, recording every node's value."""

    def __init__(self, root, graph, mode, values) -> None:  # noqa: ANN001
        super().__init__(root, graph=graph)
        self.mode, self.values, self.root = mode, values, root

    def run_node(self, n: torch.fx.Node) -> Any:
        sub = subgraph_call(n, self.root)
        try:
            if sub is not None:
                args, _ = self.fetch_args_kwargs_from_env(n)
                inner = _Recorder(self.root, sub[0].graph, self.mode, self.values)
                result = inner.run(*args[sub[1] :])
            else:
                with self.mode:
                    result = super().run_node(n)
        except Exception as exc:
            if not hasattr(exc, "hydro_node"):
                exc.hydro_node = n  # the node that failed, for error messages
            raise
        self.values[n] = result
        return result


def flat_inputs(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> list[Any]:
    """The graph's placeholder values for one call ``model(*args, **kwargs)``."""
    return list(tree_flatten_spec((tuple(args), dict(kwargs)), gm._in_spec))


def propagate(
    root: torch.nn.Module, gm: torch.fx.GraphModule, args: tuple, kwargs: dict
) -> dict[torch.fx.Node, Any]:
    """Every node's value when ``gm`` runs on fake copies of the inputs (no memory, no compute)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    on_meta = any(t.is_meta for t in root.parameters())
    inputs = []
    for x in flat_inputs(gm, args, kwargs):
        if isinstance(x, torch.Tensor):
            x = mode.from_tensor(x.to("meta") if on_meta else x)
        inputs.append(x)
    values: dict[torch.fx.Node, Any] = {}
    _Recorder(root, gm.graph, mode, values).run(*inputs)
    return values


# --- the analysis --------------------------------------------------------------------------------


class Analysis:
    """Symbols and relations over the graphs of one captured model (the rules' view of it)."""

    def __init__(self, root: torch.nn.Module, values: dict[torch.fx.Node, Any]) -> None:
        self.root = root
        self.values = values
        self.sizes: list[int] = []
        self.parent: list[int] = []
        self.fixed_syms: set[int] = set()
        self.derived_syms: set[int] = set()
        self.param_dim_syms: set[int] = set()
        self.buffer_dim_syms: dict[int, tuple[str, int]] = {}
        self.products: list[Product] = []
        self.sums: list[Sum] = []
        self.parts: list[Part] = []
        self.indexed: set[int] = set()
        self.tables: set[int] = set()  # dimensions read by an index tensor's values (x[idx])
        self.pins: list[pins.Pin] = []  # outputs kept whole (the model returns no loss)
        self.selects: list[pins.Select] = []  # integer indices, x[:, :, -1]
        self.depthwise: set[torch.fx.Node] = set()
        self.node_syms: dict[torch.fx.Node, Any] = {}
        self.param_syms: dict[int, list[int]] = {}
        self.tensor_names: dict[int, list[str]] = {}
        self.uses: dict[int, list[ParamUse]] = {}
        self._replaced: dict[torch.fx.Node, Any] = {}
        self.batch_multiple: dict[int, int] = {}  # dims of size k * batch (MHA's B * heads)
        self._pending_splits: dict[int, tuple[int, int]] = {}
        for name, t in root.named_parameters(remove_duplicate=False):
            self._register(name, t, is_param=True)
        for name, t in root.named_buffers(remove_duplicate=False):
            self._register(name, t, is_param=False)

    # --- symbols --------------------------------------------------------------------------------

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
        if a is None or b is None:
            return
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

    def _register(self, name: str, t: torch.Tensor, is_param: bool) -> None:
        key = id(t)
        self.tensor_names.setdefault(key, []).append(name)
        if key in self.param_syms:
            return
        syms = [self.new_sym(d) for d in t.shape]
        self.param_syms[key] = syms
        if is_param:
            self.param_dim_syms.update(syms)
        else:
            self.buffer_dim_syms.update({s: (name, i) for i, s in enumerate(syms)})

    def fresh(self, value: Any) -> Any:
        """Fresh symbols mirroring a value's structure."""
        if isinstance(value, torch.Tensor):
            return TensorSyms(self.new_sym(d) for d in value.shape)
        if isinstance(value, (tuple, list)):
            return [self.fresh(v) for v in value] if isinstance(value, list) else tuple(
                self.fresh(v) for v in value)  # fmt: skip
        if isinstance(value, int) and not isinstance(value, bool):
            return IntSym(None)
        return None

    def fix(self, syms: Any) -> None:
        if isinstance(syms, TensorSyms):
            self.fixed_syms.update(syms)
        elif isinstance(syms, (tuple, list)):
            for s in syms:
                self.fix(s)
        elif isinstance(syms, IntSym) and syms.sym is not None:
            self.fixed_syms.add(syms.sym)

    def fix_syms(self, syms: Iterable[int]) -> None:
        self.fixed_syms.update(syms)

    def syms_of(self, arg: Any) -> Any:
        return self.node_syms.get(arg) if isinstance(arg, torch.fx.Node) else None

    def name(self, node: torch.fx.Node) -> str:
        return op_name(node)

    def replace(self, node: torch.fx.Node, syms: Any) -> None:
        """A rule's own symbols for a node (``sym_size`` reads a dimension, ``getitem`` picks)."""
        self._replaced[node] = syms

    # --- relations (what rules call) ------------------------------------------------------------

    def tie_all(self, a: Sequence[int], b: Sequence[int], node: torch.fx.Node) -> None:
        for x, y in zip(a, b):
            self.union(x, y, node)

    def broadcast(self, out: Sequence[int], ins: Iterable[Any], node: torch.fx.Node) -> None:
        """Tie trailing-aligned dimensions of equal size (sizes of one broadcast)."""
        for syms in ins:
            if not isinstance(syms, TensorSyms):
                continue
            for o, i in zip(reversed(out), reversed(syms)):
                if self.sizes[o] == self.sizes[i] and self.sizes[i] != 1:
                    self.union(o, i, node)

    def reshape(self, src: Sequence[int], dst: Sequence[int], node: torch.fx.Node) -> None:
        """Group dimensions of equal products; tie 1-to-1 groups, constrain the others.

        A merged ``k * batch`` dimension is split into batch and ``k`` first, in whichever
        order lines up with the other side (MHA folds heads into the batch as ``B * H`` and
        tokens as ``T * B``).
        """
        best = None
        for a in self._expansions(src):
            for b in self._expansions(dst):
                groups = self._groups([s for s in a if self.sizes[s] != 1],
                                      [s for s in b if self.sizes[s] != 1])  # fmt: skip
                score = sum(len(ga) + len(gb) for ga, gb in groups)
                if best is None or score < best[0]:
                    best = (score, groups, a, b)
        _, groups, a, b = best
        for split in (a, b):  # record the splits actually used
            for s, parts in self._pending_splits.items():
                if all(p in split for p in parts):
                    self.fixed_syms.add(parts[0])  # the batch
                    self.products.append(Product(node, [s], list(parts)))
        self._pending_splits = {}
        for ga, gb in groups:
            if len(ga) == 1 and len(gb) == 1:
                self.union(ga[0], gb[0], node)
            else:
                self.products.append(Product(node, ga, gb))

    def _expansions(self, dims: Sequence[int]) -> list[list[int]]:
        options: list[list[int]] = [[]]
        for s in dims:
            k = self.batch_multiple.get(s)
            if k is None or self.sizes[s] % k or self.sizes[s] == k:
                options = [o + [s] for o in options]
                continue
            if s not in self._pending_splits:
                self._pending_splits[s] = (self.new_sym(self.sizes[s] // k), self.new_sym(k))
            batch, factor = self._pending_splits[s]
            options = [o + order for o in options for order in ([batch, factor], [factor, batch])]
        return options

    def _groups(self, a: list[int], b: list[int]) -> list[tuple[list[int], list[int]]]:
        groups = []
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
            groups.append((ga, gb))
        return groups

    def product(self, node, lhs, rhs, lhs_const: int = 1, rhs_const: int = 1) -> None:  # noqa: ANN001
        self.products.append(Product(node, list(lhs), list(rhs), lhs_const, rhs_const))

    def sum(self, node: torch.fx.Node, out: int, parts: list[int]) -> None:
        if len(parts) == 1:
            self.union(out, parts[0], node)
        else:
            self.sums.append(Sum(node, out, parts))

    def part(self, node: torch.fx.Node, part: int, whole: int, sliced: bool = False) -> None:
        p, w = self.sizes[part], self.sizes[whole]
        if p == w:
            self.union(part, whole, node)
            return
        g = math.gcd(p, w)
        self.parts.append(Part(node, part, whole, p // g, w // g, sliced))

    def grouped(self, channels: int, per_group: int, groups: int, node: torch.fx.Node) -> None:
        """``channels == per_group * groups`` for a convolution with a fixed number of groups."""
        if groups == 1:
            self.union(channels, per_group, node)
        else:
            self.derived_syms.add(per_group)
            self.products.append(Product(node, [channels], [per_group], 1, groups))

    def use_param(self, w_node: Any, node: torch.fx.Node, fan_in, fan_out, act) -> None:  # noqa: ANN001
        t = self.param_of(w_node)
        if t is not None:
            self.uses.setdefault(id(t), []).append(
                ParamUse(node, tuple(fan_in), tuple(fan_out), act))  # fmt: skip

    def param_of(self, arg: Any) -> torch.Tensor | None:
        """The parameter an argument reads (through dtype casts), if any."""
        while isinstance(arg, torch.fx.Node):
            if arg.op == "get_attr":
                t = get_path(self.root, arg.target)
                return t if isinstance(t, torch.Tensor) else None
            # a weight-normalized weight is read as its direction ``v`` (rules/weight_norm.py)
            if op_name(arg) in ("to", "_to_copy", "alias", "detach", "contiguous", "clone",
                                "_weight_norm"):  # fmt: skip
                arg = arg.args[0]
                continue
            return None
        return None

    def generic(self, node: torch.fx.Node, out: Any) -> None:
        """Elementwise-like ops: tie dimensions that line up with a tensor input's."""
        if not isinstance(out, TensorSyms):
            return
        ins = [self.syms_of(a) for a in node.all_input_nodes]
        ins = [s for s in ins if isinstance(s, TensorSyms)]
        out_shape = [self.sizes[s] for s in out]
        same_rank = [s for s in ins if len(s) == len(out)]
        pointwise = torch.Tag.pointwise in getattr(node.target, "tags", ())
        if pointwise or any([self.sizes[x] for x in s] == out_shape for s in ins) or not same_rank:
            self.broadcast(out, ins, node)
        else:
            # a shape-changing op without a rule (pad, roll...): tie dimensions kept in place
            for s in same_rank:
                for o, i in zip(out, s):
                    if self.sizes[o] == self.sizes[i] and self.sizes[i] != 1:
                        self.union(o, i, node)

    # --- walking the graphs -----------------------------------------------------------------------

    def run_graph(self, graph: torch.fx.Graph, inputs: list[Any] | None) -> Any:
        """Relate the symbols of one graph; returns its output's symbols.

        ``inputs`` are the symbols of a subgraph's operands; ``None`` for a top-level graph,
        whose inputs and outputs are fixed.
        """
        placeholders = iter(inputs or [])
        for node in graph.nodes:
            value = self.values.get(node)
            if node.op == "placeholder":
                syms = next(placeholders, None) if inputs is not None else self.fresh(value)
                if inputs is None:
                    self.fix(syms)
                self.node_syms[node] = syms
            elif node.op == "get_attr":
                t = get_path(self.root, node.target)
                known = isinstance(t, torch.Tensor) and id(t) in self.param_syms
                self.node_syms[node] = TensorSyms(self.param_syms[id(t)]) if known else None
            elif node.op == "output":
                out = self._structure(node.args[0])
                if inputs is None:  # outputs pin their sizes unless one of them is the loss
                    self.pins.extend(pins.output_pins(self, node.args[0]))
                return out
            elif node.op == "call_function":
                self.node_syms[node] = self._call(node, value)
            else:
                raise ScaleError(f"{describe(node)}: unexpected {node.op} in a captured graph")
        return None

    def _note_batch_multiples(self, node: torch.fx.Node, syms: Any) -> None:
        """Dimensions export knows as ``k * batch`` (a merged batch and head dimension)."""
        val = node.meta.get("val")
        if not isinstance(syms, TensorSyms) or not isinstance(val, torch.Tensor):
            return
        for s, d in zip(syms, val.shape):
            if isinstance(d, torch.SymInt):
                expr = d.node.expr
                coeff, rest = expr.as_coeff_Mul()
                if coeff != 1 and rest.is_Symbol and int(coeff) > 1:
                    self.batch_multiple[s] = int(coeff)

    def _structure(self, arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node):
            return self.node_syms.get(arg)
        if isinstance(arg, (tuple, list)):
            return tuple(self._structure(a) for a in arg)
        if isinstance(arg, dict):
            return tuple(self._structure(a) for a in arg.values())
        return None

    def _call(self, node: torch.fx.Node, value: Any) -> Any:
        sub = subgraph_call(node, self.root)
        if sub is not None:
            operands = [self.syms_of(a) for a in node.args[sub[1] :]]
            out = self.run_graph(sub[0].graph, operands)
            return out if isinstance(out, tuple) else (out,)
        out = self.fresh(value)
        self._note_batch_multiples(node, out)
        name = op_name(node)
        builtin = not isinstance(node.target, torch._ops.OpOverload)
        rule = INT_RULES.get(name) if builtin and name in INT_RULES else RULES.get(name)
        self._replaced.pop(node, None)
        if rule is None:
            self._no_rule(node)
            self.generic(node, out)
        else:
            rule(self, node, out)
        return self._replaced.pop(node, out)

    def _no_rule(self, node: torch.fx.Node) -> None:
        if torch.Tag.pointwise in getattr(node.target, "tags", ()):
            return  # elementwise: the generic rule is the rule
        for arg in node.all_input_nodes:
            t = self.param_of(arg)
            if isinstance(t, torch.nn.Parameter) and t.dim() >= 2:
                name = self.tensor_names[id(t)][0]
                raise ScaleError(
                    f"{describe(node)} reads the parameter '{name}' but Hydro has no width rule "
                    f"for {node.target}. Supported with parameters: linear, addmm, matmul, "
                    "convolutions, batch/layer/group/RMS norm, embedding, elementwise ops. Write "
                    "the layer with those (nn.Linear, nn.Conv2d...), or keep its width fixed."
                )


# --- solving -------------------------------------------------------------------------------------


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
    root: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    example_kwargs: dict[str, Any],
    ratio: int,
    *,
    head_policy: HeadPolicy = "keep_head_dim",
) -> WidthPlan:
    """Find the width dimensions of a captured model and solve their sizes at ``ratio``.

    Args:
        root: the captured target (:func:`hydro.fx.capture.capture`); all its graphs are read.
        example_inputs: positional inputs of one call (shapes and dtypes are used).
        example_kwargs: keyword inputs of that call.
        ratio: the width divisor.
        head_policy: how a head split ``C = H * D`` shrinks: ``"keep_head_dim"`` (default,
            fewer heads of the same size; when ``ratio`` does not divide the head count, the
            head count is kept and the head dim shrinks) or ``"keep_head_count"``.

    Raises:
        ScaleError: a width that ``ratio`` does not divide, a head split that cannot shrink, or
            a buffer derived from a width that would have to be cut (other than a rotary
            table, which is rebuilt for the new head dim), naming the node, module or buffer
            and the ratios that would work.
    """
    return _solve(analysis(root, example_inputs, example_kwargs), ratio, head_policy)


def analysis(
    root: torch.nn.Module, example_inputs: tuple[Any, ...], example_kwargs: dict[str, Any]
) -> Analysis:
    """The width symbols and relations of every graph of ``root``, before any ratio is solved
    (:func:`analyze` solves one ratio; ``ratio="auto"`` solves several from one analysis)."""
    values: dict[torch.fx.Node, Any] = {}
    for gm in root.graphs.values():
        values.update(propagate(root, gm, example_inputs, example_kwargs))
    a = Analysis(root, values)
    for gm in root.graphs.values():
        a.run_graph(gm.graph, None)
    return a


def _close_fixed(a: Analysis, extra: Iterable[int] = ()) -> set[int]:
    """Fixed classes (and ``extra`` symbols, pinned), closed over slices, products and sums
    whose other side is fixed."""
    fixed = {a.find(s) for s in a.fixed_syms} | {a.find(s) for s in extra}
    changed = True
    while changed:
        changed = False
        for c in a.parts:
            p, w = a.find(c.part), a.find(c.whole)
            if c.sliced and p in fixed and w not in fixed:
                fixed.add(w)  # a table sliced by a fixed length (positions) keeps its rows
                changed = True
            elif w in fixed and p not in fixed:
                fixed.add(p)
                changed = True
        for c in a.products:
            for one, other in ((c.lhs, c.rhs), (c.rhs, c.lhs)):
                if all(a.find(s) in fixed for s in one):
                    free = {a.find(s) for s in other} - fixed
                    if len(free) == 1:
                        fixed |= free
                        changed = True
        for c in a.sums:
            if all(a.find(s) in fixed for s in c.parts) and a.find(c.out) not in fixed:
                fixed.add(a.find(c.out))
                changed = True
    return fixed


def _solve(a: Analysis, ratio: int, head_policy: HeadPolicy) -> WidthPlan:
    """Solve every size at ``ratio``: outputs beside no loss and integer indices into
    anything but a width are pinned first; an index into a width is pinned, and the sizes
    solved again, only where it would fall outside the cut width."""
    sources = _width_sources(a)
    fixed_selects, into_width = pins.select_pins(a, sources)
    chosen = list(a.pins)
    while True:
        pinned = fixed_selects + [s for p in chosen for s in p.syms]
        plan = _solve_pinned(a, ratio, head_policy, pinned)
        more = [p for p in pins.out_of_range(plan, into_width) if p not in chosen]
        if not more:
            break
        chosen += more
    plan.pinned = _pinned_widths(a, chosen, sources, fixed_selects)
    plan.tables = _table_keys(a)
    return plan


def _pinned_widths(a: Analysis, chosen: list[pins.Pin], sources: set[int],
                   base: list[int]) -> list[tuple[str, int, str]]:  # fmt: skip
    """The hidden widths that only the pins keep whole, each with the first pin's reason."""
    if not chosen:
        return []
    unpinned = _close_fixed(a, base)
    closures = [_close_fixed(a, base + p.syms) for p in chosen]
    hidden = pins.hidden_classes(a)
    names = _dim_names(a)
    out = []
    for r in sorted(set().union(*closures) - unpinned):
        why = [p for p, c in zip(chosen, closures) if r in c and (r in hidden or not p.hidden_only)]
        if r in sources and why:
            out.append((names.get(r, "a hidden dimension"), a.sizes[r], why[0].reason))
    return out


def _solve_pinned(a: Analysis, ratio: int, head_policy: HeadPolicy,
                  pinned: list[int]) -> WidthPlan:  # fmt: skip
    roots = {a.find(s) for s in range(len(a.sizes))}
    fixed = _close_fixed(a, pinned)
    derived = {a.find(c.out) for c in a.sums} | {a.find(c.part) for c in a.parts}
    derived |= {a.find(s) for s in a.derived_syms}
    touching = {a.find(s) for s in a.param_dim_syms}
    width = (_width_sources(a) - fixed) - derived
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
    # classes whose size follows the width; at ratio 1 nothing changes size, so this (not a
    # size comparison) says which dimensions are width
    dep: set[int] = set(width)
    decisions: list[str] = []
    pending = list(a.products)

    def value(s: int) -> int | None:
        return new.get(a.find(s))

    def follow(target: int, sources: Iterable[int]) -> None:
        if any(a.find(x) in dep for x in sources):
            dep.add(a.find(target))

    def node_error(node: torch.fx.Node, what: str) -> ScaleError:
        return ScaleError(f"cannot scale {describe(node)} by ratio {ratio}: {what}")

    changed = True
    while changed:
        changed = False
        for c in a.parts:
            w, p = value(c.whole), value(c.part)
            if w is not None and p is None:
                if (w * c.num) % c.den:
                    what = f"a part of {a.sizes[c.part]} out of {a.sizes[c.whole]}"
                    raise node_error(c.node, f"{what} does not shrink to a whole number")
                new[a.find(c.part)] = w * c.num // c.den
                follow(c.part, [c.whole])
                changed = True
            elif p is not None and w is None and a.find(c.part) in dep:
                new[a.find(c.whole)] = p * c.den // c.num
                follow(c.whole, [c.part])
                changed = True
        for c in a.sums:
            parts = [value(s) for s in c.parts]
            out = value(c.out)
            missing = {a.find(s) for s, v in zip(c.parts, parts) if v is None}
            if out is None and not missing:
                new[a.find(c.out)] = sum(parts)
                follow(c.out, c.parts)
                changed = True
            elif out is not None and len(missing) == 1:
                root = missing.pop()
                count = sum(1 for s in c.parts if a.find(s) == root)
                rest = out - sum(v for v in parts if v is not None)
                if rest % count:
                    raise node_error(c.node, "a concatenation's parts do not add up after scaling")
                new[root] = rest // count
                follow(root, [c.out, *c.parts])
                changed = True
        for c in list(pending):
            unknown = {a.find(s) for s in c.lhs + c.rhs if value(s) is None}
            if not unknown:
                pending.remove(c)
                continue
            if len(unknown) == 1:
                root = unknown.pop()
                lhs = math.prod(value(x) for x in c.lhs if a.find(x) != root) * c.lhs_const
                rhs = math.prod(value(x) for x in c.rhs if a.find(x) != root) * c.rhs_const
                on_left = sum(1 for x in c.lhs if a.find(x) == root)
                on_right = sum(1 for x in c.rhs if a.find(x) == root)
                num, den = (rhs, lhs) if on_left else (lhs, rhs)
                power = on_left or on_right
                if on_left and on_right or num % den:
                    raise node_error(c.node, f"a dimension of size {a.sizes[root]} would have to "
                                     f"become {num}/{den}" + _heads_hint(c, a, ratio))  # fmt: skip
                size = round((num // den) ** (1 / power))
                new[root] = size
                follow(root, c.lhs + c.rhs)
                pending.remove(c)
                changed = True
        if not changed and pending:
            changed = _head_policy(a, pending, new, value, head_policy, decisions, node_error, dep)
    for r in roots:
        new.setdefault(r, a.sizes[r])
    plan = WidthPlan(
        root=a.root, ratio=ratio, values=a.values, node_syms=a.node_syms, param_syms=a.param_syms,
        tensor_names=a.tensor_names, sizes=a.sizes, parent=a.parent, new_size=new,
        width=dep, fixed=fixed, uses=a.uses, head_decisions=decisions,
    )  # fmt: skip
    _verify(a, plan, node_error)
    _check_buffers(a, plan, touching)
    plan.literal_rewrites = _attention_scales(a, plan, decisions)
    for key, syms in a.param_syms.items():
        name = a.tensor_names[key][0]
        if key in {id(p) for p in a.root.parameters()}:
            for i, s in enumerate(syms):
                if s in a.indexed or any(a.find(s) == a.find(c.whole) and c.sliced
                                         for c in a.parts):  # fmt: skip
                    if not plan.is_width(s) and a.sizes[s] > 1:
                        plan.kept.append((name, i, a.sizes[s]))
    return plan


def _table_keys(a: Analysis) -> set[int]:
    """The ids of the parameters read by an index tensor's values (``table[index]``)."""
    return {key for key, syms in a.param_syms.items() if any(s in a.tables for s in syms)}


def _width_sources(a: Analysis) -> set[int]:
    """Classes holding a dimension of a parameter other than a table read by index.

    A table read as ``table[index]`` (Swin's relative-position bias, ``heads`` columns) adds its
    rows to what it is added to: its other dimensions follow those (a head count solved by the
    head policy), they do not make a width of their own.
    """
    tables = _table_keys(a)
    return {a.find(s) for key, syms in a.param_syms.items() if key not in tables for s in syms
            if s in a.param_dim_syms}  # fmt: skip


def _heads_hint(c: Product, a: Analysis, ratio: int) -> str:
    sizes = [a.sizes[s] for s in c.lhs + c.rhs]
    return (f" (a reshape of {[a.sizes[s] for s in c.lhs]} into {[a.sizes[s] for s in c.rhs]}; "
            f"with grouped-query attention both the query and the key/value head counts must "
            f"stay whole: try a ratio dividing {math.gcd(*sizes)})")  # fmt: skip


def _head_policy(a, pending, new, value, policy, decisions, node_error, dep) -> bool:  # noqa: ANN001
    """Resolve a split ``known = outer * inner`` with two unknowns by the head policy.

    Head splits (``C = H * D``) go before packed projections (``3C = 3 * C``): the split with
    the smallest inner size first.
    """

    def inner_size(c: Product) -> int:
        sides = [x for x in (c.lhs, c.rhs) if len(x) > 1]
        return min((a.sizes[x[-1]] for x in sides), default=0)

    for c in sorted(pending, key=inner_size):
        for known_side, unknown_side in ((c.lhs, c.rhs), (c.rhs, c.lhs)):
            if not all(value(s) is not None for s in known_side):
                continue
            unknown = [s for s in unknown_side if value(s) is None]
            if len({a.find(s) for s in unknown}) != 2 or len(unknown) != 2:
                continue
            known_const = c.lhs_const if known_side is c.lhs else c.rhs_const
            other_const = c.rhs_const if known_side is c.lhs else c.lhs_const
            total = math.prod(value(s) for s in known_side) * known_const
            rest = math.prod(value(s) for s in unknown_side if value(s) is not None) * other_const
            target = total // rest if total % rest == 0 else None
            outer, inner = unknown
            heads, dim = a.sizes[outer], a.sizes[inner]
            orders = [("head dim", inner, outer), ("head count", outer, inner)]
            if policy == "keep_head_count":
                orders.reverse()
            for kept, keep, solve in orders:
                if target is not None and target % a.sizes[keep] == 0 and target >= a.sizes[keep]:
                    new[a.find(keep)] = a.sizes[keep]
                    new[a.find(solve)] = target // a.sizes[keep]
                    if any(a.find(x) in dep for x in known_side):
                        dep.add(a.find(solve))
                    why = "" if kept == orders[0][0] else f"; whole heads of {dim} do not fit"
                    text = (f"{describe(c.node)}: {heads} heads x {dim} -> {new[a.find(outer)]} "
                            f"heads x {new[a.find(inner)]} (kept the {kept}{why})")  # fmt: skip
                    if text not in decisions:  # the train and eval graphs split alike
                        decisions.append(text)
                    pending.remove(c)
                    return True
            raise node_error(
                c.node,
                f"a split of {heads * dim} into {heads} x {dim} (heads x head dim) cannot shrink "
                f"to {target}: neither {heads} heads nor head dim {dim} divides it. Choose a "
                f"ratio that divides the head count ({_divisor_suggestions([heads], 1)}...) or "
                "the head dim.",
            )
    return False


def _verify(a: Analysis, plan: WidthPlan, node_error) -> None:  # noqa: ANN001
    v = plan.new_dim
    for c in a.products:
        lhs = math.prod(v(s) for s in c.lhs) * c.lhs_const
        rhs = math.prod(v(s) for s in c.rhs) * c.rhs_const
        if lhs != rhs:
            raise node_error(c.node, f"a reshape of {[a.sizes[s] for s in c.lhs]} into "
                             f"{[a.sizes[s] for s in c.rhs]} would need {lhs} == {rhs}"
                             + _heads_hint(c, a, plan.ratio))  # fmt: skip
    for c in a.sums:
        if v(c.out) != sum(v(s) for s in c.parts):
            raise node_error(c.node, "a concatenation's parts do not add up after scaling")


def _check_buffers(a: Analysis, plan: WidthPlan, touching: set[int]) -> None:
    """A buffer computed from a width is never cut: a rotary table (``1 / base ** (2i / d)``,
    recognized by its values) is rebuilt for the new head dim (``plan.rotary``); any other
    is an error."""
    for s, (name, dim) in a.buffer_dim_syms.items():
        r = a.find(s)
        if r in touching or plan.new_dim(s) == a.sizes[s]:
            continue  # running statistics follow their layer's channels; fine
        t = get_path(a.root, name)
        base = rotary_base(t) if isinstance(t, torch.Tensor) else None
        if base is not None:
            new = plan.new_dim(s)
            plan.rotary[id(t)] = RotaryTable(name, 2 * a.sizes[s], 2 * new, base)
            continue
        raise ScaleError(
            f"buffer '{name}' (dimension {dim}, size {a.sizes[s]}) is computed from a width "
            f"that would shrink to {plan.new_dim(s)} at ratio {plan.ratio}, and its values are "
            "not a rotary table 1 / base ** (arange(0, d, 2) / d) that Hydro could rebuild; "
            "cutting it would change what it encodes. Keep the head dim: use "
            "head_policy='keep_head_dim' with a ratio that divides the head count (and the "
            "key/value head count), or give the model more heads."
        )


_PASS_THROUGH = ("view", "reshape", "_unsafe_view", "transpose", "permute", "t", "contiguous",
                 "clone", "to", "_to_copy", "expand", "unsqueeze", "alias")  # fmt: skip


def _scalar_factor(node: torch.fx.Node) -> tuple[int, float, bool] | None:
    """``(argument index, literal, divides)`` of a ``mul``/``div`` of a tensor by a number."""
    name = op_name(node)
    if name not in ("mul", "div") or len(node.args) != 2:
        return None
    for i, arg in enumerate(node.args):
        other = node.args[1 - i]
        if isinstance(arg, (int, float)) and not isinstance(arg, bool):
            if isinstance(other, torch.fx.Node) and (name == "mul" or i == 1):
                return i, float(arg), name == "div"
    return None


def _attention_scales(a: Analysis, plan: WidthPlan, decisions: list[str]) -> dict:
    """Literal attention scales rewritten for muP: ``q @ k^T * s`` (or ``/ s``, or ``q * s``
    before the product) where the product of two activations contracts a dimension that shrinks
    from ``d`` to ``d'`` becomes ``s * d / d'`` (``/ s`` becomes ``/ (s * d' / d)``): logits
    scale as ``1/d`` relative to the target, as SDPA's ``scale=`` is set. The scale is found by
    the symbol of the contracted dimension, never by its value; at ratio 1 nothing changes.
    """
    rewrites: dict[torch.fx.Node, tuple[int, float]] = {}
    for node in list(a.node_syms):
        if node.op != "call_function" or op_name(node) not in ("matmul", "bmm"):
            continue
        x, y = node.args[0], node.args[1]
        if a.param_of(x) is not None or a.param_of(y) is not None:
            continue  # a layer's weight: not attention
        xs = a.syms_of(x)
        if not isinstance(xs, TensorSyms) or len(xs) < 2:
            continue
        d_old, d_new = a.sizes[xs[-1]], plan.new_dim(xs[-1])
        if d_old == d_new or not plan.is_width(xs[-1]):
            continue
        found = _find_scale(node)
        if found is None:
            continue
        mul, (i, value, divides) = found
        new = value * d_new / d_old if divides else value * d_old / d_new
        rewrites[mul] = (i, new)
        op = "/" if divides else "x"
        text = (f"{describe(mul)}: attention scale {op} {value:g} -> {op} {new:g} "
                f"(muP 1/d for head dim {d_old} -> {d_new})")  # fmt: skip
        if text not in decisions:
            decisions.append(text)
    return rewrites


def _find_scale(matmul: torch.fx.Node) -> tuple[torch.fx.Node, tuple[int, float, bool]] | None:
    """The scalar ``mul``/``div`` applied to an attention product's output (first) or to one of
    its operands, through views and transposes."""
    node = matmul
    while len(node.users) == 1:
        node = next(iter(node.users))
        found = _scalar_factor(node)
        if found is not None:
            return node, found
        if op_name(node) not in _PASS_THROUGH:
            break
    for arg in matmul.args[:2]:
        while isinstance(arg, torch.fx.Node) and arg.op == "call_function":
            found = _scalar_factor(arg)
            if found is not None:
                return arg, found
            if op_name(arg) not in _PASS_THROUGH:
                break
            arg = arg.args[0]
    return None


def _dim_names(a: Analysis) -> dict[int, str]:
    """A readable name for each class root: the first parameter dimension in it."""
    names: dict[int, str] = {}
    for key, syms in a.param_syms.items():
        for i, s in enumerate(syms):
            names.setdefault(a.find(s), f"'{a.tensor_names[key][0]}' (dimension {i})")
    return names


__all__ = ["Analysis", "HeadPolicy", "WidthPlan", "analyze", "bound", "describe", "op_name"]

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

This module holds the plan (:class:`WidthPlan`, what the rest of Hydro reads), shape propagation
and the symbols and relations (:class:`Analysis`, which the rules fill); solving them at a ratio
is :mod:`hydro.fx.solve` (:func:`hydro.fx.solve.analyze`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx
from torch._subclasses import FakeTensor, FakeTensorMode
from torch.fx._pytree import tree_flatten_spec

from hydro.errors import ScaleError
from hydro.fx import pins
from hydro.fx.nodes import describe
from hydro.fx.paths import get_path
from hydro.fx.rules import RULES
from hydro.fx.rules.common import IntSym, TensorSyms, op_name
from hydro.fx.rules.rotary import RotaryTable
from hydro.fx.rules.shape import INT_RULES, TRANSPOSES, transpose_perm
from hydro.fx.rules.tables import Table

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
        structured: parameters and buffers rebuilt by the rule of their values (sinusoids,
            sequences, identities: :mod:`hydro.fx.rules.tables`), by tensor id.
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
    structured: dict[int, Table] = field(default_factory=dict)

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

    def __init__(self, root, graph, mode, values) -> None:
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
            if (
                sub is None
                and "leaf Variable that requires grad is being used in an in-place" in str(exc)
            ):
                raise ScaleError(
                    f"{describe(n)} writes a parameter in place during forward: a model that "
                    "rescales or edits its own weights when called (HuggingFace RWKV in eval "
                    "mode, with config.rescale_every > 0) cannot be scaled or fused, since "
                    "Hydro trains the parameters as tensors of its own. Turn it off (RWKV: "
                    "rescale_every=0) or change the weights outside forward"
                ) from exc
            if not hasattr(exc, "hydro_node"):
                exc.hydro_node = n  # the node that failed, for error messages
            raise
        self.values[n] = result
        return result

    def get_attr(self, target: Any, args: tuple, kwargs: dict) -> Any:
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            # a fake of the model's tensor (one per tensor: the mode remembers it), so that an
            # in-place op of the graph (batch norm's num_batches_tracked += 1) does not write it
            value = self.mode.from_tensor(value)
        return value


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
                self.fresh(v) for v in value)
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
                                      [s for s in b if self.sizes[s] != 1])
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

    def product(self, node, lhs, rhs, lhs_const: int = 1, rhs_const: int = 1) -> None:
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

    def use_param(self, w_node: Any, node: torch.fx.Node, fan_in, fan_out, act) -> None:
        """Record that ``node`` uses the parameter ``w_node`` reads, with ``fan_in`` and
        ``fan_out`` given as dimensions of ``w_node`` (mapped back to the parameter's own
        through transposes: ``x @ W.T`` uses ``W`` as ``F.linear`` does)."""
        found = self.param_dims(w_node)
        if found is not None:
            t, dims = found
            fan_in, fan_out = tuple(dims[d] for d in fan_in), tuple(dims[d] for d in fan_out)
            self.uses.setdefault(id(t), []).append(ParamUse(node, fan_in, fan_out, act))

    def param_of(self, arg: Any) -> torch.Tensor | None:
        """The parameter an argument reads (through dtype casts and transposes), if any."""
        found = self.param_dims(arg)
        return found[0] if found is not None else None

    def param_dims(self, arg: Any) -> tuple[torch.Tensor, list[int]] | None:
        """``(parameter, dims)`` when ``arg`` reads a parameter or buffer through dtype casts,
        copies and transposes (``W.T``, ``W.mT``, ``W.t()``, ``permute``): ``dims[i]`` is the
        parameter's dimension that dimension ``i`` of ``arg`` is."""
        perms: list[list[int]] = []
        while isinstance(arg, torch.fx.Node):
            if arg.op == "get_attr":
                t = get_path(self.root, arg.target)
                if not isinstance(t, torch.Tensor):
                    return None
                dims = list(range(t.dim()))
                for perm in reversed(perms):  # from the parameter out to the argument
                    dims = [dims[p] for p in perm]
                return t, dims
            # a weight-normalized weight is read as its direction ``v`` (rules/weight_norm.py)
            name = op_name(arg)
            if name in TRANSPOSES and isinstance(self.values.get(arg), torch.Tensor):
                perms.append(transpose_perm(arg, self.values[arg].dim()))
            elif name not in ("to", "_to_copy", "alias", "detach", "contiguous", "clone",
                              "_weight_norm"):
                return None
            arg = arg.args[0]
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
                    f"for {node.target}. Supported with parameters: linear, addmm, matmul (also "
                    "through a transpose), convolutions, batch/layer/group/RMS norm, embedding, "
                    "recurrent layers (LSTM, GRU, RNN and their cells), elementwise ops. Write "
                    "the layer with those (nn.Linear, nn.Conv2d...)."
                )

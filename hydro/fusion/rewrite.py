"""The graph rewrite from one captured model to ``n`` fused trials.

Two small passes over one trial's captured ATen graph (:mod:`hydro.fx.capture`):

1. :func:`~hydro.fusion.facts.batch_facts` (:mod:`hydro.fusion.facts`) reads, from the symbolic
   shapes that capture recorded, where every value carries the batch: ``Batch(dim, outer,
   inner)`` says that dimension ``dim`` is ``outer * B * inner`` (a ``view`` may merge the batch
   with other dimensions, on either side). Values without the batch symbol are batch-free.
2. :func:`fuse_graph` rebuilds the graph for ``n`` trials in the layouts of ``ops.py``: batched
   values folded (trials stacked inside the batch), parameters and buffers stacked ``[n, ...]``,
   shared values kept once. Ops on folded values alone run unchanged; ops that meet a per-trial
   value become the fused functions of ``ops.py``; any full reduction of a folded value (a loss
   computed inside the model) becomes one result per trial. Values from convolutions and
   normalizations stay channel-stacked (``[B, n * C, H, W]``) through the channel-wise ops that
   follow and are folded only where an op needs it (:mod:`hydro.fusion.stacked`).

This module holds the walk: layouts, the general rules (unchanged on folded values,
broadcast over the trials, one result per trial for a reduction, the ``torch.func.vmap``
fallback) and the dispatch. The fused form of each op kind (linear, embedding, norms,
convolutions, dropout and random ops, attention) is its handler's, in :mod:`hydro.fusion.handlers`;
the channel-stacked layout's rules are in :mod:`hydro.fusion.stacked`, the kinds of ops both
tell apart in :mod:`hydro.fusion.kinds`.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Mapping

import sympy
import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from hydro.errors import FuseError
from hydro.fusion import ops
from hydro.fusion.facts import FREE, MIXED, Batch, batch_facts, batch_symbols
from hydro.fusion.handlers import HANDLERS as _HANDLERS
from hydro.fusion.handlers import arg as _arg
from hydro.fusion.handlers import draws as _draws
from hydro.fusion.kinds import _is_aten, _literal_dtype, _pointwise
from hydro.fusion.stacked import _Env, _StackedLayout

logger = logging.getLogger("hydro.fusion")

Node = torch.fx.Node
aten = torch.ops.aten

# ops that combine entries along their ``dim``: on the batch dimension they would mix trials
_MIXING = {
    "softmax", "_softmax", "log_softmax", "_log_softmax", "cumsum", "cumprod", "cat", "stack",
    "flip", "roll", "sort", "argsort", "topk", "gather", "scatter", "scatter_add", "index_select",
    "diff", "narrow", "select", "split", "split_with_sizes", "chunk", "unbind", "slice",
    "logsumexp", "max", "min", "amax", "amin", "sum", "mean", "var", "std", "norm", "any", "all",
    "argmax", "argmin", "index_add", "index_copy", "take_along_dim", "tensor_split",
}
_LOSSES = {
    # op: (position of reduction, of target, of ignore_index or None, of class weights or None)
    aten.cross_entropy_loss.default: (3, 1, 4, 2),
    aten.nll_loss.default: (3, 1, 4, 2),
    aten.nll_loss_nd.default: (3, 1, 4, 2),
    aten.mse_loss.default: (2, 1, None, None),
    aten.l1_loss.default: (2, 1, None, None),
    aten.smooth_l1_loss.default: (2, 1, None, None),
    aten.huber_loss.default: (2, 1, None, None),
    aten.binary_cross_entropy_with_logits.default: (4, 1, None, None),
    aten.binary_cross_entropy.default: (3, 1, None, None),
}


def _random(target: object) -> bool:
    return _is_aten(target) and torch.Tag.nondeterministic_seeded in target.tags


def mutated_targets(gm: torch.fx.GraphModule) -> set[str]:
    """Buffers the graph writes in place: BatchNorm statistics, ``add_`` on a counter."""
    out: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not _is_aten(node.target):
            continue
        written = []
        if node.target is aten.batch_norm.default:
            if node.args[5]:  # training: the running statistics are updated (eval: read only)
                written = [node.args[3], node.args[4]]
        elif node.target._schema.is_mutable:
            written = [node.args[0]]
        out |= {a.target for a in written if isinstance(a, Node) and a.op == "get_attr"}
    return out


# --- the rewrite --------------------------------------------------------------------------------


def fuse_graph(
    template: torch.fx.GraphModule,
    n: int,
    shared: bool,
    tensors: Mapping[str, torch.Tensor],
    shared_names: set[str],
    literals: Mapping[str, Mapping[int, list[float]]],
) -> torch.fx.GraphModule:
    """Rewrite one trial's captured graph into a graph that runs ``n`` trials.

    Args:
        template: one trial's captured graph (``hydro.fx.capture``).
        n: the number of trials.
        shared: inputs are one model's inputs fed to every trial (``True``), or carry a leading
            ``n`` with each trial's own batch (``False``).
        tensors: the stacked ``[n, ...]`` tensor for every parameter and buffer name.
        shared_names: buffers equal in every trial (read once, as trial 0's).
        literals: per node name, the arguments whose literal differs between trials (one value
            per trial).

    Returns:
        A ``GraphModule`` called like the model, whose tensor outputs carry a leading ``[n]``.

    Raises:
        FuseError: naming the node that cannot be fused.
    """
    rw = _Rewriter(template, n, shared, tensors, shared_names, literals)
    for node in template.graph.nodes:
        rw.visit(node)
    rw.graph.lint()
    gm = torch.fx.GraphModule(rw.owners, rw.graph, "FusedGraph")
    gm._in_spec, gm._out_spec = template._in_spec, template._out_spec
    gm.hydro_fallbacks = rw.fallbacks
    return gm


class _Rewriter(_StackedLayout):
    """The state of one :func:`fuse_graph` run: ``env`` maps old nodes to new ones, ``spec`` old
    nodes to the layout spec of their new value (``ops.Spec``, or a list for several tensors)."""

    def __init__(self, template, n, shared, tensors, shared_names, literals) -> None:
        self.template, self.n, self.shared = template, n, shared
        self.tensors, self.shared_names, self.literals = tensors, shared_names, literals
        self.facts = batch_facts(template)
        self.syms = batch_symbols(template)
        self.graph = torch.fx.Graph()
        self.graph._codegen = template.graph._codegen
        self.env: dict[Node, Node] = _Env(self)
        self.spec: dict[Node, object] = {}
        # values held channel-stacked: old node -> (new node, dimension of the trials' channels);
        # ``env`` then gets the folded form only when an op asks for it (``_Env``)
        self.stacked: dict[Node, tuple[Node, int]] = {}
        self.derived_f: set[Node] = set()  # env entry converted from the stacked value
        self.derived_c: set[Node] = set()  # stacked entry converted from the folded value
        self.owners: dict[str, object] = {}
        self._expanded: dict[Node, Node] = {}
        self.fallbacks: list[str] = []  # nodes run under torch.func.vmap
        # dynamic sizes other than the batch (a sequence length): where to read them at run time
        self._sym_sizes: dict[sympy.Symbol, tuple[Node, int]] = {}
        self._runtime: dict[sympy.Expr, Node] = {}
        device = next(iter(tensors.values())).device if tensors else None
        self.device = device

    # --- helpers ----------------------------------------------------------------------------

    def fn(self, f: object, *args: object, **kwargs: object) -> Node:
        return self.graph.call_function(f, args, kwargs)

    def error(self, node: Node, why: str) -> FuseError:
        return FuseError(f"cannot fuse node '{node.name}' ({node.format_node()}): {why}")

    def out_spec(self, node: Node, fact: object = None, *, shared_ok: bool = False) -> object:
        fact = self.facts[node] if fact is None else fact
        if isinstance(fact, list):
            return [self.out_spec(node, f, shared_ok=shared_ok) for f in fact]
        if isinstance(fact, Batch):
            return ("SB" if shared_ok else "F", fact.dim, self.outer(fact))
        return None if fact is None else "?"

    def outer(self, fact: Batch) -> int | Node:
        """``fact.outer`` as the fused graph's ops take it: an int, or (a product of dynamic
        sizes, ``T`` from ``view(T * B, C)``) a node that computes it at run time, one per
        expression so that equal specs stay equal."""
        if isinstance(fact.outer, int):
            return fact.outer
        if fact.outer not in self._runtime:
            coeff, rest = fact.outer.as_coeff_Mul()
            value: object = int(coeff)
            for f in sympy.Mul.make_args(rest):
                base, exp = (f.base, int(f.exp)) if f.is_Pow else (f, 1)
                if base not in self._sym_sizes:
                    raise FuseError(f"cannot fuse: the size {fact.outer} is read from no input")
                new, d = self._sym_sizes[base]
                size = self.fn(aten.sym_size.int, new, d)
                for _ in range(exp):
                    value = self.fn(operator.mul, value, size)
            self._runtime[fact.outer] = value
        return self._runtime[fact.outer]

    def folded(self, a: Node) -> Node:
        """``a``'s new value, a shared batched value expanded to a folded one (once)."""
        spec = self.spec.get(a)
        if not (isinstance(spec, tuple) and spec[0] == "SB"):
            return self.env[a]
        if a not in self._expanded:
            self._expanded[a] = self.fn(ops.expand_shared, self.env[a], self.n, spec)
        return self._expanded[a]

    def as_trial(self, a: Node | None) -> Node | None:
        """A per-trial or shared (a frozen parameter read once) operand as ``[n, ...]``."""
        if a is None:
            return None
        if self.spec.get(a) == ("S",):
            return self.fn(ops.expand_trials, self.env[a], self.n)
        return self.env[a]

    def literal(self, node: Node, pos: int) -> Node | None:
        """A per-trial literal of ``node`` at ``pos`` as a ``[n]`` float64 tensor, or ``None``."""
        values = self.literals.get(node.name, {}).get(pos)
        if values is None:
            return None
        name = f"_hydro_literal_{node.name}_{pos}"
        self.owners[name] = torch.tensor(values, dtype=torch.float64, device=self.device)
        return self.graph.get_attr(name)

    def copy(self, node: Node, convert) -> Node:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), convert)
        new = self.graph.create_node(node.op, node.target, args, kwargs, name=node.name)
        new.meta = dict(node.meta)
        return new

    def kinds(self, found: list[Node]) -> set[str]:
        out = set()
        for a in found:
            s = self.spec.get(a)
            if isinstance(s, tuple):
                out.add(s[0])
        return out

    # --- nodes ------------------------------------------------------------------------------

    def visit(self, node: Node) -> None:
        if node.op in ("placeholder", "get_attr", "output"):
            getattr(self, node.op)(node)
            return
        if node.op != "call_function":
            raise self.error(node, f"unexpected {node.op} node in a captured graph")
        found: list[Node] = []
        torch.fx.node.map_arg((node.args, node.kwargs), found.append)
        kinds = self.kinds(found)
        target = node.target
        if target is operator.getitem:
            src = self.spec.get(node.args[0])
            self.env[node] = self.copy(node, self.env.__getitem__)
            self.spec[node] = src[node.args[1]] if isinstance(src, list) else None
            return
        if target is aten.sym_size.int:
            self.sym_size(node)
            return
        if not _is_aten(target):  # SymInt arithmetic, higher-order ops (no_grad, autocast)
            self.plain(node, found, kinds)
            return
        # a random op's rate (a recurrent stack's dropout included) may differ per trial
        if node.name in self.literals and not _draws(node) and not _pointwise(target):
            raise self.error(
                node,
                f"its arguments {sorted(self.literals[node.name])} differ between the trials "
                "and this op has no per-trial form; make them equal in every model",
            )
        if _pointwise(target):
            # the batch size used as a value (``x.sum() / B``), not as a shape: one trial's
            saved = {a: self.env[a] for a in found if self._batch_size_value(a)}
            for a in saved:
                self.env[a] = self.fn(operator.floordiv, saved[a], self.n)
            try:
                self._dispatch(node, found, kinds)
            finally:
                self.env.update(saved)
        else:
            self._dispatch(node, found, kinds)
        self._after_write(node)

    def _after_write(self, node: Node) -> None:
        """An op that writes its first operand in place, held in both layouts: the other form
        (a converted copy, perhaps viewed already) is refreshed, as an alias would be."""
        x = node.args[0] if node.args else None
        if not (isinstance(x, Node) and node.target._schema.is_mutable and x in self.stacked):
            return
        held, cdim = self.stacked[x]
        if node in self.stacked:  # written stacked: the folded copy, if one was made, follows
            if x in self.derived_f:
                folded = self.fn(ops.from_channels, self.stacked[node][0], self.n, cdim)
                self.graph.call_method("copy_", (self.env[x], folded))
            return
        to = ops.shared_to_channels if self.spec[x][0] == "SB" else ops.to_channels
        self.graph.call_method("copy_", (held, self.fn(to, self.env[x], self.n, cdim)))

    def _batch_size_value(self, a: Node) -> bool:
        val = a.meta.get("val")
        if not isinstance(val, torch.SymInt) or self.spec.get(a) is not None:
            return False
        return bool(val.node.expr.free_symbols & self.syms)

    def _dispatch(self, node: Node, found: list[Node], kinds: set) -> None:
        target = node.target
        if self.stacked_op(node, found):
            return
        handler = _HANDLERS.get(target)
        if handler is not None and handler(self, node, found, kinds):
            return
        if _random(target) and not _draws(node):
            logger.warning("hydro.fuse: node '%s' (%s) draws from torch's generator, not from each "
                           "trial's own stream: with it a trial's result depends on its group",
                           node.name, node.format_node())
        if kinds & {"T"} or node.name in self.literals:
            if _pointwise(target):
                self.pointwise(node, found)
            elif not kinds & {"F", "SB"} and self.trial_structural(node):
                pass
            else:
                self.vmap(node, found)
            return
        if kinds & {"F", "SB"}:
            fact = self.facts[node]
            if fact == MIXED or (isinstance(fact, list) and MIXED in fact):
                self.per_trial(node, found, "pairs every sample with every other")
                return
            self.batched(node, found, kinds)
            return
        self.env[node] = self.copy(node, self.env.__getitem__)
        self.spec[node] = self.out_spec(node)
        if self.spec[node] == "?":
            self.spec[node] = ("S",)
        self._fix_free(node)

    def _fix_free(self, node: Node) -> None:
        s = self.spec[node]
        if s == "?":
            self.spec[node] = ("S",)
        elif isinstance(s, list):
            self.spec[node] = [("S",) if x == "?" else x for x in s]

    def placeholder(self, node: Node) -> None:
        default = node.args[0] if node.args else torch.fx.node.inspect.Signature.empty
        new = self.graph.placeholder(node.target, default_value=default)
        fact = self.facts[node]
        val = node.meta.get("val")
        for d, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            if expr is not None and expr.is_Symbol and expr not in self.syms:
                self._sym_sizes.setdefault(expr, (new, d if self.shared else d + 1))
        if fact is None:
            self.env[node], self.spec[node] = new, None
        elif not self.shared:  # [n, B, ...] each trial's own batch, folded / [n, ...]
            if isinstance(fact, Batch):
                self.env[node] = self.graph.call_method("flatten", (new, 0, 1))
                self.spec[node] = ("F", 0, 1)
            else:
                self.env[node], self.spec[node] = new, ("T",)
        else:
            self.env[node] = new
            self.spec[node] = ("SB", 0, 1) if isinstance(fact, Batch) else ("S",)

    def get_attr(self, node: Node) -> None:
        new = self.graph.get_attr(node.target)
        if node.target in self.tensors:
            self.owners[node.target] = self.tensors[node.target]
            if node.target in self.shared_names:
                self.env[node] = self.fn(operator.getitem, new, 0)
                self.spec[node] = ("S",)
            else:
                self.env[node], self.spec[node] = new, ("T",)
            return
        value = _get(self.template, node.target)
        self.owners[node.target] = value
        self.env[node] = new
        self.spec[node] = ("S",) if isinstance(value, torch.Tensor) else None

    def output(self, node: Node) -> None:
        def with_trials(a: Node) -> Node:
            s = self.spec.get(a)
            if not isinstance(s, tuple):
                return self.env[a]
            if s[0] == "F":
                return self.fn(ops.to_trials, self.env[a], self.n, s)
            if s[0] in ("S", "SB"):
                v = self.env[a]
                rank = a.meta["val"].dim()
                grown = self.graph.call_method("unsqueeze", (v, 0))
                return self.graph.call_method("expand", (grown, self.n, *([-1] * rank)))
            return self.env[a]

        self.graph.output(torch.fx.node.map_arg(node.args[0], with_trials))

    def sym_size(self, node: Node) -> None:
        x, d = node.args
        s = self.spec[x]
        if x in self.stacked and x not in self.derived_c and x not in self.env:
            # read from the stacked value: no conversion just to read a size
            new, cdim = self.stacked[x]
            d = d % x.meta["val"].dim()
            size = self.fn(aten.sym_size.int, new, d)
            if d == 0:
                size = self.fn(operator.mul, size, self.n)
            elif d == cdim:
                size = self.fn(operator.floordiv, size, self.n)
            self.env[node], self.spec[node] = size, None
            return
        if s and s[0] == "T":
            self.env[node] = self.fn(aten.sym_size.int, self.env[x], d + 1 if d >= 0 else d)
        else:
            self.env[node] = self.copy(node, self.env.__getitem__)
            rank = x.meta["val"].dim()
            if s and s[0] == "SB" and d % rank == s[1]:
                self.env[node] = self.fn(ops.shared_size, self.env[node], self.n)
        self.spec[node] = None

    def plain(self, node: Node, found: list[Node], kinds: set) -> None:
        """Python-level nodes: SymInt arithmetic, and higher-order ops over parameter-free
        subgraphs (``no_grad``, ``autocast`` regions), which run as they are on folded values."""
        if "T" in kinds:
            raise self.error(
                node,
                "a no_grad/autocast region reads per-trial parameters; fusion cannot rewrite "
                "inside it. Move the parameter use out of the region",
            )
        self.env[node] = self.copy(node, self.folded)
        shared_ok = False
        self.spec[node] = self.out_spec(node, shared_ok=shared_ok)
        self._fix_free(node)

    def batched(self, node: Node, found: list[Node], kinds: set) -> None:
        """Folded and shared operands only: the op runs unchanged on ``[n * B, ...]``."""
        keeps_shared = (
            kinds <= {"SB", "S"}
            and not _random(node.target)
            and all(isinstance(self.spec.get(a), tuple) for a in found)
        )
        fact = self.facts[node]
        if not keeps_shared and "F" in kinds | ({"F"} if "SB" in kinds else set()):
            if fact == FREE or (isinstance(fact, list) and FREE in fact):
                if node.target in _LOSSES or _full_reduction(node):
                    self.trial_reduction(node, found)
                    return
                self.per_trial(node, found, "reduces over the samples of a batch")
                return
        if not keeps_shared:
            self._check_batch_dim(node, found)
        convert = self.env.__getitem__ if keeps_shared else self.folded
        self.env[node] = self.copy(node, convert)
        self.spec[node] = self.out_spec(node, shared_ok=keeps_shared)
        self._fix_free(node)

    def _check_batch_dim(self, node: Node, found: list[Node]) -> None:
        name = node.target._overloadpacket.__name__
        if node.target is aten.index.Tensor:
            x, indices = node.args[0], node.args[1]
            s = self.spec.get(x)
            if isinstance(s, tuple) and s[0] in ("F", "SB") and len(indices) > s[1]:
                idx = indices[s[1]]
                if idx is not None and self.spec.get(idx, ("S",))[0] not in ("F", "SB"):
                    raise self.error(node, "it indexes the batch dimension, mixing trials")
            return
        if name not in _MIXING:
            return
        schema = node.target._schema
        x = node.args[0]
        tensors = x if isinstance(x, (list, tuple)) else [x]
        for t in tensors:
            s = self.spec.get(t)
            if not (isinstance(t, Node) and isinstance(s, tuple) and s[0] in ("F", "SB")):
                continue
            rank = t.meta["val"].dim()
            for i, arg in enumerate(schema.arguments):
                if arg.name not in ("dim", "dims"):
                    continue
                value = _arg(node, i, arg.name)
                dims = value if isinstance(value, (list, tuple)) else [value]
                if not any(isinstance(v, int) and rank and v % rank == s[1] for v in dims):
                    continue
                if name == "slice" and _full_slice(node):
                    continue
                raise self.error(node, "it works along the batch dimension, which would mix trials")

    def trial_reduction(self, node: Node, found: list[Node]) -> None:
        """A full reduction or a loss of folded values: one result per trial, ``[n]``."""
        target = node.target
        if target in _LOSSES:
            red_pos, tgt_pos, ii_pos, w_pos = _LOSSES[target]
            schema = target._schema.arguments
            args = [
                _arg(node, i, a.name, a.default_value if a.has_default_value() else None)
                for i, a in enumerate(schema)
            ]
            reduction = args[red_pos]
            args[red_pos] = 0
            ignore = args[ii_pos] if ii_pos is not None else None
            weight_pos = w_pos if (w_pos is not None and args[w_pos] is not None) else None
            specs = [self.spec.get(a) if isinstance(a, Node) else None for a in args]
            new_args = [self.env[a] if isinstance(a, Node) else a for a in args]
            self.env[node] = self.fn(
                ops.trial_loss_op, target, self.n, specs, reduction, ignore, tgt_pos, weight_pos,
                *new_args,
            )
        else:
            x = node.args[0]
            kind = target._overloadpacket.__name__
            self.env[node] = self.fn(ops.trial_reduce, kind, self.env[x], self.n, self.spec[x])
        self.spec[node] = ("T",)

    def pointwise(self, node: Node, found: list[Node]) -> None:
        """A broadcasting op with per-trial operands: once over an explicit trial dimension."""
        val = node.meta["val"]
        rank = val.dim() if isinstance(val, torch.Tensor) else 0
        args = list(node.args)
        specs: list = []
        new_args: list = []
        for i, a in enumerate(args):
            lit = self.literal(node, i)
            if lit is not None:
                lit = self.graph.call_method("to", (lit, _literal_dtype(node, val)))
                new_args.append(lit)
                specs.append(("T",))
            elif isinstance(a, Node):
                new_args.append(self.env[a])
                specs.append(self.spec.get(a))
            else:
                new_args.append(a)
                specs.append(None)
        fact = self.facts[node]
        out = ("F", fact.dim, self.outer(fact)) if isinstance(fact, Batch) else ("T",)
        kwargs = torch.fx.node.map_arg(dict(node.kwargs), self.env.__getitem__)
        target = node.target
        if node.name in self.literals and target._overloadname == "Scalar":
            # a per-trial literal arrives as a tensor: ``le.Scalar`` becomes ``le.Tensor``
            target = getattr(target._overloadpacket, "Tensor", target)
        self.env[node] = self.graph.call_function(
            ops.pointwise, (target, self.n, specs, out, rank, *new_args), kwargs
        )
        self.spec[node] = out

    def trial_structural(self, node: Node) -> bool:
        """Shape ops on per-trial values (no batch): the same op one dimension further in."""
        x = node.args[0]
        if not isinstance(x, Node) or self.spec.get(x) != ("T",):
            return False
        rank = x.meta["val"].dim()
        target = node.target
        rest = list(torch.fx.node.map_arg(tuple(node.args[1:]), self.env.__getitem__))
        new_x = self.env[x]
        fact = self.facts[node]
        if target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            args = (new_x, [self.n, *rest[0]])
        elif target is aten.expand.default:
            if isinstance(fact, Batch):  # a per-trial value grown to the batch (a CLS token)
                spec = ("F", fact.dim, self.outer(fact))
                self.env[node] = self.fn(_trial_expand, new_x, rest[0], self.n, fact.dim, spec)
                self.spec[node] = spec
                return True
            args = (new_x, [-1, *rest[0]])
        elif target is aten.permute.default:
            args = (new_x, [0, *[d % rank + 1 for d in rest[0]]])
        elif target is aten.t.default:
            args = (new_x, -2, -1) if rank == 2 else (new_x, 0, 0)
            target = aten.transpose.int
        elif target is aten.index.Tensor:
            if any(isinstance(i, Node) and self.spec.get(i) != ("S",) for i in node.args[1]):
                return False
            idx = [None, *rest[0]]
            args = (new_x, idx)
        elif target in (aten.sum.default, aten.mean.default):  # (before "sum" of _SHIFTABLE)
            self.env[node] = self.fn(ops.trial_reduce, target._overloadpacket.__name__, new_x,
                                     self.n, ("T",))
            self.spec[node] = ("T",)
            return True
        elif target._overloadpacket.__name__ in _SHIFTABLE:
            if any(isinstance(a, Node) for a in rest) or isinstance(fact, Batch):
                return False
            names = [a.name for a in target._schema.arguments]
            shifted = []
            for i, a in enumerate(rest, start=1):
                if names[i] in ("dim", "dim0", "dim1", "start_dim", "end_dim", "dims"):
                    a = _shift(a)
                shifted.append(a)
            args = (new_x, *shifted)
            if node.kwargs:
                return False
        else:
            return False
        self.env[node] = self.graph.call_function(target, tuple(args), dict(node.kwargs))
        spec = self.out_spec(node)
        self.spec[node] = [("T",)] * len(spec) if isinstance(spec, list) else ("T",)
        return True

    def per_trial(self, node: Node, found: list[Node], what: str) -> None:
        """An op that mixes the samples of a batch (a contrastive loss's similarity matrix,
        batch statistics): folded, it would mix the trials too, so it runs on each trial's own
        batch (``torch.func.vmap`` over the trials) and its value is per trial from here on."""
        logger.info("hydro.fuse: node '%s' (%s) %s: computed per trial", node.name,
                    node.format_node(), what)
        self.vmap(node, found)

    def vmap(self, node: Node, found: list[Node]) -> None:
        """Anything else with per-trial operands: ``torch.func.vmap`` over the trials."""
        logger.warning(
            "hydro.fuse: node '%s' (%s) has no fused form for per-trial operands; running it "
            "under torch.func.vmap (slower)",
            node.name,
            node.format_node(),
        )
        self.fallbacks.append(f"{node.name} ({node.target})")
        leaves, treespec = tree_flatten((list(node.args), dict(node.kwargs)))
        specs = []
        for a in leaves:
            s = self.spec.get(a) if isinstance(a, Node) else None
            specs.append(s if isinstance(s, tuple) and s[0] != "S" else None)
        out = self.out_spec(node)
        outs = out if isinstance(out, list) else [out]
        outs = [("T",) if o == "?" else o for o in outs]
        name = f"_hydro_vmap_{node.name}"
        self.owners[name] = _VmapOp(node.target, self.n, specs, outs, treespec)
        new = [self.env[a] if isinstance(a, Node) else a for a in leaves]
        self.env[node] = self.graph.call_module(name, tuple(new))
        self.spec[node] = outs if isinstance(out, list) else outs[0]


class _VmapOp(torch.nn.Module):
    """Calls :func:`ops.vmap_call` for one node (holds what a graph argument cannot)."""

    def __init__(self, op, n, specs, outs, treespec) -> None:
        super().__init__()
        self.op, self.n, self.specs, self.outs, self.treespec = op, n, specs, outs, treespec

    def forward(self, *leaves: object) -> object:
        return ops.vmap_call(self.op, self.n, self.specs, self.outs, self.treespec, *leaves)


_SHIFTABLE = {
    "slice", "select", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind",
    "transpose", "softmax", "log_softmax", "flatten", "unflatten", "narrow", "cumsum", "sum",
    "mean", "amax", "amin", "movedim", "diagonal",
}


def _shift(dim: object) -> object:
    if isinstance(dim, (list, tuple)):
        return [_shift(d) for d in dim]
    return dim + 1 if isinstance(dim, int) and dim >= 0 else dim


def _trial_expand(t: torch.Tensor, sizes, n: int, dim: int, spec) -> torch.Tensor:
    per = list(sizes)
    per[dim] = per[dim] // n
    missing = len(per) - (t.dim() - 1)  # expand may add leading dimensions
    t = t.view(n, *([1] * missing), *t.shape[1:]) if missing > 0 else t
    return ops.settle(t.expand(n, *per), spec)


def _get(root: torch.nn.Module, path: str) -> object:
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _full_slice(node: Node) -> bool:
    start = _arg(node, 2, "start", None)
    end = _arg(node, 3, "end", None)
    step = _arg(node, 4, "step", 1)
    return (
        start in (None, 0)
        and (end is None or isinstance(end, Node) or end >= 2**62)
        and (step == 1)
    )


def _full_reduction(node: Node) -> bool:
    t = node.target
    if t in (aten.sum.default, aten.mean.default):
        return True
    if t in (aten.sum.dim_IntList, aten.mean.dim):
        dims = _arg(node, 1, "dim", None)
        keep = _arg(node, 2, "keepdim", False)
        rank = node.args[0].meta["val"].dim()
        return not keep and (not dims or {d % rank for d in dims} == set(range(rank)))
    return False

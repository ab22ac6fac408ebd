"""The channel-stacked layout of the fusion rewrite: a folded value whose batch leads, held as
``[B, n * C, H, W]`` (HFTA's layout) from a convolution or normalization through the channel-wise
ops that follow, and folded only where an op needs it (:class:`_Env`). :class:`_StackedLayout`
holds these rules for :class:`hydro.fusion.rewrite._Rewriter`, which derives from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from hydro.fusion import ops
from hydro.fusion.handlers import arg as _arg
from hydro.fusion.kinds import (
    _ACTIVATIONS,
    _REDUCTIONS,
    _SPATIAL,
    _leading_batch,
    _literal_dtype,
    _packet,
    _pointwise,
)

if TYPE_CHECKING:
    from hydro.fusion.rewrite import _Rewriter

Node = torch.fx.Node
aten = torch.ops.aten


class _StackedLayout:
    """The channel-stacked methods of :class:`~hydro.fusion.rewrite._Rewriter` (its ``stacked``,
    ``derived_c``, ``spec``, ``env``, ``graph`` and ``n``)."""

    def held(self, a: Node) -> bool:
        """``a`` was computed channel-stacked (its folded form, if any, is a converted copy)."""
        return a in self.stacked and a not in self.derived_c

    def stacked_value(self, a: Node, cdim: int) -> Node:
        """``a``'s value channel-stacked on ``cdim``: as computed, or converted once from its
        folded (or shared) form."""
        st = self.stacked.get(a)
        if st is not None and st[1] == cdim:
            return st[0]
        to = ops.shared_to_channels if self.spec[a][0] == "SB" else ops.to_channels
        new = self.fn(to, self.env[a], self.n, cdim)
        if st is None:
            self.stacked[a] = (new, cdim)
            self.derived_c.add(a)
        return new

    def set_stacked(self, node: Node, new: Node, cdim: int) -> None:
        self.stacked[node] = (new, cdim)
        self.spec[node] = ("F", 0, 1)

    def stacked_op(self, node: Node, found: list[Node]) -> bool:
        """Run ``node`` on channel-stacked operands, its result staying stacked, when an operand
        is held stacked and the op works within each sample's channels: pointwise ops (per-trial
        and shared operands broadcast on the stacked channels), pooling, padding, upsampling,
        spatial reductions, dropout, permutes that keep the batch first, and a ``layer_norm`` over
        stacked channels in the last dimension. Anything else reads the folded form."""
        held = [a for a in found if self.held(a)]
        val = node.meta.get("val")
        fact = self.facts.get(node)
        if not held or not isinstance(val, torch.Tensor) or not _leading_batch(fact):
            return False
        target = node.target
        if _pointwise(target) or _packet(target) in _ACTIVATIONS:
            return self._stacked_pointwise(node, held, val)
        if target is aten.cat.default:
            return self._stacked_cat(node, held, val)
        x = node.args[0]
        if x not in held:
            return False
        cdim = self.stacked[x][1]
        rank = x.meta["val"].dim()
        if rank != val.dim() and target not in _REDUCTIONS:
            return False
        if target is aten.layer_norm.default:
            return self._stacked_layer_norm(node, x, cdim, rank)
        if any(a is not x and self.spec.get(a) is not None for a in found):
            return False
        name = _packet(target)
        if target is aten.dropout.default:
            if node.name in self.literals:
                return False  # per-trial rates: ``trial_dropout`` on the folded value
        elif target is aten.permute.default:
            dims = [d % rank for d in node.args[1]]
            if dims[0] != 0:
                return False
            cdim = dims.index(cdim)
        elif name in _SPATIAL:
            if cdim != 1 or rank != _SPATIAL[name] + 2:
                return False
        elif name in ("constant_pad_nd", "pad"):
            if rank - len(node.args[1]) // 2 <= cdim:
                return False
        elif target in _REDUCTIONS:
            dims = _arg(node, 1, "dim", None)
            dims = {d % rank for d in dims} if dims else set()
            if not dims or dims & {0, cdim}:
                return False
            if not _arg(node, 2, "keepdim", False):
                cdim -= sum(d < cdim for d in dims)
        else:
            return False
        args = (self.stacked[x][0], *torch.fx.node.map_arg(node.args[1:], self.env.__getitem__))
        kwargs = torch.fx.node.map_arg(dict(node.kwargs), self.env.__getitem__)
        self.set_stacked(node, self.graph.call_function(target, args, kwargs), cdim)
        return True

    def _stacked_cat(self, node: Node, held: list[Node], val: torch.Tensor) -> bool:
        """``cat`` of batched values (a U-Net's skip connection, a DenseNet's features), one of
        them held stacked: along the stacked channels each trial's parts are joined within its
        own block of channels; along another dimension the stacked values join as they are."""
        parts, rank = node.args[0], val.dim()
        if not all(isinstance(a, Node) and self.spec.get(a) is not None
                   and self.spec[a][0] in ("F", "SB") and tuple(self.spec[a][1:]) == (0, 1)
                   and a.meta["val"].dim() == rank for a in parts):
            return False
        cdim = self.stacked[held[0]][1]
        dim = _arg(node, 1, "dim", 0) % rank
        if dim == 0:
            return False
        stacked = [self.stacked_value(a, cdim) for a in parts]
        if dim == cdim:
            new = self.fn(ops.stacked_cat, stacked, self.n, cdim)
        else:
            new = self.graph.call_function(aten.cat.default, (stacked, dim))
        self.set_stacked(node, new, cdim)
        return True

    def _stacked_pointwise(self, node: Node, held: list[Node], val: torch.Tensor) -> bool:
        rank = val.dim()
        cdim = self.stacked[held[0]][1]
        if any(isinstance(v, Node) for v in tree_flatten(dict(node.kwargs))[0]):
            return False
        x = node.args[0]
        if node.target._schema.is_mutable and not (x in held and self.stacked[x][1] == cdim):
            return False  # written in place: only where it is held stacked
        plan = []  # (kind, operand): validate every operand before adding conversions
        for i, a in enumerate(node.args):
            if self.literals.get(node.name, {}).get(i) is not None:
                plan.append(("literal", i))
            elif isinstance(a, (list, tuple)) and any(isinstance(v, Node) for v in a):
                return False
            elif not isinstance(a, Node):
                plan.append(("as is", a))
            else:
                s = self.spec.get(a)
                if isinstance(s, tuple) and s[0] in ("F", "SB"):
                    if s[1] != 0 or s[2] != 1 or a.meta["val"].dim() != rank:
                        return False
                    plan.append(("stacked", a))
                elif isinstance(s, tuple) and s[0] in ("T", "S"):
                    plan.append(("lift", a))
                else:
                    plan.append(("env", a))
        args: list = []
        specs: list = []
        for kind, a in plan:
            if kind == "literal":
                lit = self.literal(node, a)
                args.append(self.graph.call_method("to", (lit, _literal_dtype(node, val))))
                specs.append(("T",))
            elif kind == "stacked":
                args.append(self.stacked_value(a, cdim))
                specs.append("stacked")
            elif kind == "lift":
                args.append(self.env[a])
                specs.append(self.spec[a])
            else:
                args.append(self.env[a] if kind == "env" else a)
                specs.append(None)
        if all(s is None or s == "stacked" for s in specs):
            new = self.graph.call_function(node.target, tuple(args), dict(node.kwargs))
        else:
            new = self.graph.call_function(
                ops.stacked_pointwise,
                (node.target, self.n, cdim, rank, specs, *args),
                dict(node.kwargs),
            )
        self.set_stacked(node, new, cdim)
        return True

    def _stacked_layer_norm(self, node: Node, x: Node, cdim: int, rank: int) -> bool:
        shape = node.args[1]
        w, b = _arg(node, 2, "weight"), _arg(node, 3, "bias")
        eps = _arg(node, 4, "eps", 1e-5)
        if cdim != rank - 1 or len(shape) != 1 or not isinstance(shape[0], int):
            return False
        specs = {self.spec.get(a) for a in (w, b) if a is not None}
        if not specs <= {("T",), ("S",)}:
            return False
        per_trial = ("T",) in specs
        w_new = None if w is None else (self.as_trial(w) if per_trial else self.env[w])
        b_new = None if b is None else (self.as_trial(b) if per_trial else self.env[b])
        new = self.fn(ops.stacked_layer_norm, self.stacked[x][0], shape[0], w_new, b_new, eps,
                      self.n, per_trial)
        self.set_stacked(node, new, cdim)
        return True


class _Env(dict):
    """A rewrite's ``env``: a value held only channel-stacked gets its folded form the first
    time an op reads it that way (one conversion, placed before that op)."""

    def __init__(self, rw: _Rewriter) -> None:
        super().__init__()
        self.rw = rw

    def __missing__(self, node: Node) -> Node:
        rw = self.rw
        if node not in rw.stacked:
            raise KeyError(node)
        new, cdim = rw.stacked[node]
        folded = rw.fn(ops.from_channels, new, rw.n, cdim)
        self[node] = folded
        rw.derived_f.add(node)
        return folded

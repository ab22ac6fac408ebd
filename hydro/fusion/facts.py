"""Batch facts: where every value of one trial's captured graph carries the batch.

Capture (:mod:`hydro.fx.capture`) records symbolic shapes whose batch dimension is a symbol.
:func:`batch_facts` reads from them, for every node, whether its value carries the batch and
where: ``Batch(dim, outer, inner)`` says that dimension ``dim`` is ``outer * B * inner`` (a
``view`` may merge the batch with other dimensions, on either side). Values without the batch
symbol are batch-free (``FREE``). The rewrite (:mod:`hydro.fusion.rewrite`) folds the trials
into the batch along these facts, and refuses (``FuseError``) values whose batch it could not
keep apart per trial (a view that splits it, a concatenation along it).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx

from hydro.errors import FuseError

Node = torch.fx.Node
aten = torch.ops.aten


@dataclass(frozen=True)
class Batch:
    """Dimension ``dim`` of the value is ``outer * B * inner``.

    ``outer`` and ``inner`` are ints, or products of other dynamic sizes (a sequence length
    ``T`` merged with the batch by ``view(B * T, C)``) as sympy expressions.
    """

    dim: int
    outer: int | sympy.Expr
    inner: int | sympy.Expr


FREE = "free"  # a tensor without the batch
# the batch in several dimensions: every sample against every other (in-batch negatives, a
# contrastive loss's similarity matrix): each trial's own, computed per trial by the rewrite
MIXED = "mixed"

_VIEWS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default,
    aten.flatten.using_ints, aten.unflatten.int,
}


def batch_symbols(gm: torch.fx.GraphModule) -> set:
    """The symbols of the batch: dimension 0 of every tensor input, as capture left it."""
    syms: set = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim():
            size = val.shape[0]
            if isinstance(size, torch.SymInt):
                syms |= size.node.expr.free_symbols
    return syms


def _locate(val: torch.Tensor, syms: set) -> list[tuple[int, sympy.Expr]]:
    """The dimensions of ``val`` that carry the batch, with their sizes."""
    found = []
    for d, size in enumerate(val.shape):
        if isinstance(size, torch.SymInt) and size.node.expr.free_symbols & syms:
            found.append((d, size.node.expr))
    return found


def _coefficient(node: Node, expr: sympy.Expr, syms: set) -> sympy.Expr:
    sym = next(iter(expr.free_symbols & syms))
    coeff = sympy.simplify(expr / sym)
    if not _multiple(coeff, syms):
        raise FuseError(
            f"cannot fuse node '{node.name}' ({node.format_node()}): its size {expr} is not a "
            "multiple of the batch (a concatenation along the batch?), which would mix trials"
        )
    return coeff


def _multiple(e: sympy.Expr, syms: set) -> bool:
    """Whether ``e`` is a positive whole factor: an int >= 1 times other dynamic sizes (a
    sequence length), never the batch itself."""
    e = sympy.expand(e)
    coeff, rest = e.as_coeff_Mul()
    if not coeff.is_Integer or coeff < 1 or rest.free_symbols & syms:
        return False
    factors = sympy.Mul.make_args(rest)
    return all(f == 1 or f.is_Symbol or (f.is_Pow and f.base.is_Symbol and f.exp.is_Integer
                                         and f.exp > 0) for f in factors)


def _size(size: object) -> sympy.Expr:
    # the expression, never ``int(size)``: that would specialize a dynamic size in the shape
    # environment the captured graph shares, fixing it for every later reader
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def _prod(sizes: object) -> sympy.Expr:
    return sympy.Mul(*[_size(s) for s in sizes])


def _plain(e: sympy.Expr) -> int | sympy.Expr:
    """An int where the expression is a number (the common, static case)."""
    return int(e) if e.is_Integer else e


def _fact(node: Node, val: object, syms: set, facts: dict) -> object:
    if isinstance(val, (list, tuple)):
        return [_fact(node, v, syms, facts) for v in val]
    if not isinstance(val, torch.Tensor):
        return None
    loc = _locate(val, syms)
    if not loc:
        return FREE
    if len(loc) > 1:
        return MIXED
    d, expr = loc[0]
    coeff = _coefficient(node, expr, syms)
    inner = None
    src = node.args[0] if node.args else None
    if node.target in _VIEWS and isinstance(src, Node) and isinstance(facts.get(src), Batch):
        b = facts[src]
        shape = src.meta["val"].shape
        flat = b.inner * _prod(shape[b.dim + 1 :])
        inner = sympy.simplify(flat / _prod(val.shape[d + 1 :]))
        if not _multiple(inner, syms) or not _multiple(sympy.simplify(coeff / inner), syms):
            raise FuseError(
                f"cannot fuse node '{node.name}' ({node.format_node()}): this view splits the "
                "batch dimension, which would mix trials"
            )
    if inner is None:
        for a in node.all_input_nodes:
            b = facts.get(a)
            if isinstance(b, Batch) and sympy.expand(b.outer * b.inner - coeff) == 0:
                inner = b.inner
                break
    if inner is None:
        inner = coeff
    return Batch(d, _plain(sympy.simplify(coeff / inner)), _plain(sympy.expand(inner)))


def batch_facts(gm: torch.fx.GraphModule) -> dict[Node, object]:
    """Where every value of a captured graph carries the batch.

    Returns:
        For every node: a :class:`Batch`, ``FREE`` (a tensor without the batch), ``MIXED`` (the
        batch in several dimensions: samples against samples), ``None`` (not a tensor) or a
        list of these (ops returning several tensors).

    Raises:
        FuseError: a value whose batch fusion cannot follow, naming the node.
    """
    syms = batch_symbols(gm)
    facts: dict[Node, object] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            src = facts.get(node.args[0])
            facts[node] = src[node.args[1]] if isinstance(src, list) else None
            continue
        facts[node] = _fact(node, node.meta.get("val"), syms, facts)
    return facts

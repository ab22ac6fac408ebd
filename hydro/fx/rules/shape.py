"""Shape ops: views and reshapes (head splits), permutes, expand, cat/split, slicing, indexing."""

from __future__ import annotations

from typing import Any

import torch

from hydro.fx.rules.common import IntSym, TensorSyms, bound, is_int, op_name

SIZE_ARG = {"view": "size", "reshape": "shape", "_unsafe_view": "size", "expand": "size",
            "new_ones": "size", "new_zeros": "size", "new_empty": "size", "new_full": "size",
            "zeros": "size", "ones": "size", "empty": "size", "full": "size", "rand": "size",
            "randn": "size"}


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def sym_size(a, node, out) -> None:
    x = a.syms_of(node.args[0])
    a.replace(node, IntSym(x[node.args[1]]))


def getitem(a, node, out) -> None:
    x = a.syms_of(node.args[0])
    if isinstance(x, (tuple, list)) and not isinstance(x, TensorSyms):
        a.replace(node, x[node.args[1]])


def reshape(a, node, out) -> None:
    x = a.syms_of(node.args[0])
    if isinstance(x, TensorSyms) and isinstance(out, TensorSyms):
        a.reshape(x, out, node)
        size_args(a, node, out)


def size_args(a, node, out) -> None:
    """Tie output dimensions to the ints (``x.size(0)``...) their sizes were given as."""
    key = SIZE_ARG.get(a.name(node))
    sizes = bound(node).get(key) if key else None
    if not isinstance(sizes, (list, tuple)) or not isinstance(out, TensorSyms):
        return
    for o, s in zip(reversed(out), reversed(sizes)):
        sym = a.syms_of(s)
        if isinstance(sym, IntSym) and sym.sym is not None:
            a.union(o, sym.sym, node)


TRANSPOSES = ("permute", "transpose", "t", "swapaxes", "swapdims", "numpy_T", "mT", "mH",
              "adjoint")


def transpose_perm(node: Any, rank: int) -> list[int]:
    """Which input dimension each output dimension of a transposing op is (``out[o] =
    x[perm[o]]``): ``permute``, ``transpose``/``swapaxes``, ``t`` and ``.T`` (all reversed),
    ``.mT``/``.mH``/``adjoint`` (the last two swapped)."""
    name = op_name(node)
    perm = list(range(rank))
    if name == "permute":
        return [d % rank for d in node.args[1]]
    if name in ("t", "numpy_T"):
        return perm[::-1]
    if name in ("mT", "mH", "adjoint"):
        i, j = rank - 2, rank - 1
    else:
        i, j = node.args[1] % rank, node.args[2] % rank
    perm[i], perm[j] = perm[j], perm[i]
    return perm


def permute(a, node, out) -> None:
    x = a.syms_of(node.args[0])
    for o, i in enumerate(transpose_perm(node, len(x))):
        a.union(out[o], x[i], node)


def expand(a, node, out) -> None:
    a.broadcast(out, [a.syms_of(node.args[0])], node)
    size_args(a, node, out)


def cat(a, node, out) -> None:
    b = bound(node)
    parts = [a.syms_of(t) for t in b["tensors"]]
    parts = [p for p in parts if isinstance(p, TensorSyms) and len(p) == len(out)]
    dim = b.get("dim", 0) % len(out)
    for p in parts:
        a.tie_all([s for i, s in enumerate(out) if i != dim],
                  [s for i, s in enumerate(p) if i != dim], node)
    a.sum(node, out[dim], [p[dim] for p in parts])


def stack(a, node, out) -> None:
    b = bound(node)
    dim = b.get("dim", 0) % len(out)
    for t in b["tensors"]:
        a.tie_all([s for i, s in enumerate(out) if i != dim], a.syms_of(t), node)


def split(a, node, out) -> None:
    b = bound(node)
    x = a.syms_of(b["self"])
    dim = b.get("dim", 0) % len(x)
    for o in out:
        a.tie_all([s for i, s in enumerate(o) if i != dim],
                  [s for i, s in enumerate(x) if i != dim], node)
        a.part(node, o[dim], x[dim])


def unbind(a, node, out) -> None:
    b = bound(node)
    x = a.syms_of(b["self"])
    dim = b.get("dim", 0) % len(x)
    a.fix_syms([x[dim]])  # a packed q/k/v axis: its count is structure, not width
    for o in out:
        a.tie_all(o, [s for i, s in enumerate(x) if i != dim], node)


def select(a, node, out) -> None:
    from hydro.fx.pins import Select  # pins imports the rules' helpers

    b = bound(node)
    x = a.syms_of(b["self"])
    dim = b["dim"] % len(x)
    if is_int(b["index"]):
        # pinned where it is not a width (q/k/v of a packed projection, a CLS position), or
        # where the index falls outside the cut width (hydro.fx.pins)
        a.selects.append(Select(node, x[dim], b["index"]))
    a.tie_all(out, [s for i, s in enumerate(x) if i != dim], node)


def slice_(a, node, out) -> None:
    b = bound(node)
    x = a.syms_of(b["self"])
    dim = b.get("dim", 0) % len(x)
    a.tie_all([s for i, s in enumerate(out) if i != dim],
              [s for i, s in enumerate(x) if i != dim], node)
    a.part(node, out[dim], x[dim], sliced=True)


def index(a, node, out) -> None:
    """``x[i, j]`` with index tensors: indexed dimensions are read by value, the others move as
    NumPy's advanced indexing moves them (never matched by size)."""
    b = bound(node)
    x = a.syms_of(b["self"])
    idx = list(b["indices"]) + [None] * (len(x) - len(b["indices"]))
    given = [i for i, t in enumerate(idx) if t is not None]
    if not given or not isinstance(out, TensorSyms):
        return
    shapes = [a.values.get(idx[i]) for i in given]
    k = max((t.dim() for t in shapes if isinstance(t, torch.Tensor)), default=1)
    rest = [s for i, s in enumerate(x) if i not in given]
    if given == list(range(given[0], given[-1] + 1)):  # adjacent: the index dims stay in place
        d = given[0]
        a.tie_all(out[:d], x[:d], node)
        a.tie_all(out[d + k :], x[given[-1] + 1 :], node)
        index_out = out[d : d + k]
    else:  # separated: the index dims go first
        a.tie_all(out[k:], rest, node)
        index_out = out[:k]
    a.broadcast(TensorSyms(index_out), [a.syms_of(idx[i]) for i in given], node)
    table = a.param_of(b["self"]) is not None
    for i, t in zip(given, shapes):
        a.indexed.add(x[i])
        integer = isinstance(t, torch.Tensor) and t.dtype not in (torch.bool, *_FLOATS)
        if table and integer:
            # a table of the model read by value (a relative-position table's rows, positions):
            # the index's values were drawn for this size, so it is never a width, as an
            # embedding's rows are not. An activation indexed along a width is left to the
            # index-range check of scaling, which names it.
            a.fix_syms([x[i]])
            a.tables.add(x[i])


def repeat(a, node, out) -> None:
    """``x.repeat(*reps)``: a dimension repeated ``r`` times is ``r`` times the input's (a
    product, so ``slopes.repeat(B, 1, 1)`` of ``[H, 1, T]`` is ``B * H`` as a ``B * H`` reshape
    is: BLOOM's ALiBi); ``r = 1`` passes it through; leading new dimensions are the counts."""
    x = a.syms_of(node.args[0])
    reps = list(node.args[1]) if len(node.args) > 1 else []
    if not isinstance(x, TensorSyms) or not isinstance(out, TensorSyms) or len(reps) != len(out):
        return
    lead = len(out) - len(x)
    for o, r in zip(out[:lead], reps[:lead]):
        sym = a.syms_of(r)
        if isinstance(sym, IntSym) and sym.sym is not None:
            a.union(o, sym.sym, node)
    for o, i, r in zip(out[lead:], x, reps[lead:]):
        sym = a.syms_of(r)
        if is_int(r) and r == 1:
            a.union(o, i, node)
        elif is_int(r):
            a.product(node, [o], [i], rhs_const=int(r))
        elif isinstance(sym, IntSym) and sym.sym is not None:
            a.product(node, [o], [sym.sym, i])


def pad(a, node, out) -> None:
    """Padding changes the last ``len(pad) // 2`` dimensions; the others pass through."""
    b = bound(node)
    x = a.syms_of(b.get("self", b.get("input", node.args[0])))
    widths = b.get("pad", b.get("padding", node.args[1] if len(node.args) > 1 else ()))
    padded = len(widths) // 2 if isinstance(widths, (list, tuple)) else len(x)
    for o, i in list(zip(out, x))[: len(x) - padded]:
        a.union(o, i, node)
    for o, i, (lo, hi) in zip(out[len(x) - padded :], x[len(x) - padded :],
                              reversed(list(zip(widths[::2], widths[1::2])))):
        if lo == 0 and hi == 0:
            a.union(o, i, node)


def loss(a, node, out) -> None:
    """A classification loss: ``reduction='none'`` gives the target's shape; reduced, a scalar."""
    b = bound(node)
    target = a.syms_of(b.get("target"))
    x = a.syms_of(b.get("self"))
    if isinstance(x, TensorSyms) and x:
        a.fix_syms([x[1 if len(x) > 1 else 0]])  # the classes: the target's values index them
    if isinstance(out, TensorSyms) and isinstance(target, TensorSyms) and len(out) == len(target):
        a.tie_all(out, target, node)


# ops that turn an arange's values into constants of a rule of their count (ALiBi's slopes
# ``base ** arange(1, H + 1)`` with ``base = 2 ** (-8 / H)`` computed in Python)
_EXPONENTIALS = ("pow", "exp", "exp2", "float_power")


def arange(a, node, out) -> None:
    b = bound(node)
    end = a.syms_of(b.get("end"))
    if isinstance(end, IntSym) and end.sym is not None:
        a.union(out[0], end.sym, node)
    if _feeds_exponential(node):
        # per-head constants built in Python: their count is structure, kept whole (a cut
        # arange would keep the target's first slopes, not the slopes of the new count)
        a.fix_syms([out[0]])


def _feeds_exponential(node: Any) -> bool:
    """Whether an ``arange``'s values reach an exponential through casts and scalings."""
    seen, todo = set(), list(node.users)
    while todo:
        user = todo.pop()
        if user in seen:
            continue
        seen.add(user)
        name = op_name(user)
        if name in _EXPONENTIALS:
            return True
        if name in ("to", "_to_copy", "mul", "div", "neg", "sub", "add", "unsqueeze", "view"):
            todo.extend(user.users)
    return False


def identity(a, node, out) -> None:
    x = a.syms_of(node.args[0])
    if isinstance(x, TensorSyms) and isinstance(out, TensorSyms):
        a.tie_all(out, x, node)


def _int_op(a: Any, node: Any, out: Any) -> None:
    a.replace(node, IntSym(None))


RULES = {
    "sym_size": sym_size, "getitem": getitem,
    "view": reshape, "reshape": reshape, "_unsafe_view": reshape, "flatten": reshape,
    "unflatten": reshape, "squeeze": reshape, "unsqueeze": reshape, "view_as": reshape,
    "contiguous": identity, "clone": identity, "alias": identity, "detach": identity,
    "to": identity, "_to_copy": identity, "type_as": identity, "lift_fresh_copy": identity,
    **{name: permute for name in TRANSPOSES},
    "expand": expand, "new_ones": size_args, "new_zeros": size_args, "new_empty": size_args,
    "new_full": size_args, "zeros": size_args, "ones": size_args, "empty": size_args,
    "full": size_args, "rand": size_args, "randn": size_args,
    "cat": cat, "concat": cat, "stack": stack, "split": split, "split_with_sizes": split,
    "chunk": split, "tensor_split": split, "unbind": unbind, "select": select,
    "slice": slice_, "narrow": slice_, "index": index, "arange": arange,
    "repeat": repeat, "pad": pad, "constant_pad_nd": pad, "reflection_pad1d": pad,
    "reflection_pad2d": pad, "replication_pad1d": pad, "replication_pad2d": pad,
    "cross_entropy_loss": loss, "nll_loss": loss, "nll_loss_nd": loss, "nll_loss2d": loss,
}
# Python's own operators on ints (sizes computed from ``x.size(0)``): their values are not widths
INT_RULES = {name: _int_op for name in ("mul", "add", "sub", "floordiv", "truediv", "neg")}

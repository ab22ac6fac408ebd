"""Linear layers and matrix products: ``linear``, ``addmm`` (HF's Conv1D), ``mm``, ``matmul``."""

from __future__ import annotations

from hydro.fx.rules.common import TensorSyms, bound


def linear(a, node, out) -> None:
    b = bound(node)
    x, w = a.syms_of(b["input"]), a.syms_of(b["weight"])
    a.union(x[-1], w[1], node)
    a.union(out[-1], w[0], node)
    a.tie_all(out[:-1], x[:-1], node)
    if b.get("bias") is not None:
        a.union(a.syms_of(b["bias"])[-1], w[0], node)
    a.use_param(b["weight"], node, (1,), (0,), act=0)


def addmm(a, node, out) -> None:
    b = bound(node)
    bias, x, w = a.syms_of(b["self"]), a.syms_of(b["mat1"]), a.syms_of(b["mat2"])
    a.union(x[-1], w[0], node)
    a.union(out[-1], w[1], node)
    a.union(out[0], x[0], node)
    a.broadcast(out, [bias], node)
    a.use_param(b["mat2"], node, (0,), (1,), act=1)


def matmul(a, node, out) -> None:
    x, y = a.syms_of(node.args[0]), a.syms_of(node.args[1])
    if len(x) == 1 and len(y) == 1:
        a.union(x[0], y[0], node)
        return
    xm = list(x) if len(x) > 1 else [None, x[0]]
    ym = list(y) if len(y) > 1 else [y[0], None]
    a.union(xm[-1], ym[-2], node)
    rest = list(out)
    if ym[-1] is not None:
        a.union(rest.pop(), ym[-1], node)
    if xm[-2] is not None:
        a.union(rest.pop(), xm[-2], node)
    a.broadcast(rest, [TensorSyms(xm[:-2]), TensorSyms(ym[:-2])], node)
    if len(y) == 2:
        a.use_param(node.args[1], node, (0,), (1,), act=0)


def outer(a, node, out) -> None:
    """``outer(x, y)[i, j] = x[i] * y[j]`` (rotary angles: positions x frequencies)."""
    x, y = a.syms_of(node.args[0]), a.syms_of(node.args[1])
    a.union(out[0], x[0], node)
    a.union(out[1], y[0], node)


RULES = {"linear": linear, "addmm": addmm, "mm": matmul, "bmm": matmul, "matmul": matmul,
         "outer": outer, "ger": outer}

"""Convolutions (plain, grouped, depthwise, transposed) as ATen ops."""

from __future__ import annotations

from hydro.fx.rules.common import bound


def conv(a, node, out) -> None:  # noqa: ANN001
    b = bound(node)
    transposed = bool(b.get("transposed", False)) or "transpose" in str(node.target)
    x, w = a.syms_of(b["input"]), a.syms_of(b["weight"])
    groups = int(b.get("groups", 1))
    a.fix_syms(w[2:])  # kernel size
    a.fix_syms(out[2:])  # spatial sizes follow the input's
    a.union(out[0], x[0], node)
    in_ch = a.sizes[x[1]]
    depthwise = groups > 1 and groups == in_ch
    if depthwise:
        # one filter group per channel: the group count follows the channels
        a.depthwise.add(node)
        a.union(x[1], w[0], node) if transposed else a.union(out[1], w[0], node)
        if a.sizes[out[1]] == in_ch:
            a.union(out[1], x[1], node)
        else:
            a.product(node, [out[1]], [x[1]], rhs_const=a.sizes[out[1]] // in_ch)
        a.fix_syms([w[1]])
        fan_in, fan_out = tuple(range(1, len(w))), (0,)
    elif transposed:
        a.union(x[1], w[0], node)
        a.grouped(out[1], w[1], groups, node)
        fan_in, fan_out = (0,), tuple(range(1, len(w)))
    else:
        a.grouped(x[1], w[1], groups, node)
        a.union(out[1], w[0], node)
        fan_in, fan_out = tuple(range(1, len(w))), (0,)
    if b.get("bias") is not None:
        a.union(a.syms_of(b["bias"])[0], out[1], node)
    a.use_param(b["weight"], node, fan_in, fan_out, act=0)


RULES = {
    name: conv
    for name in ("conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d",
                 "conv_transpose2d", "conv_transpose3d", "_convolution")
}  # fmt: skip

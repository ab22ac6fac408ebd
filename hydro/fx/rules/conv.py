"""Convolutions (plain, grouped, depthwise, transposed) as ATen ops."""

from __future__ import annotations

from hydro.fx.rules.common import TensorSyms, bound


def conv(a, node, out) -> None:
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
        a.union(x[1] if transposed else out[1], w[0], node)
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
}


def pool(a, node, out) -> None:
    """Pooling and resampling: channels pass through, spatial sizes are fixed."""
    x = a.syms_of(node.args[0])
    name = a.name(node)
    nd = next((d for d in (3, 2, 1) if f"{d}d" in name), 2)
    keep = len(x) - nd
    for o in (
        [out] if isinstance(out, TensorSyms) else [o for o in out if isinstance(o, TensorSyms)]
    ):
        a.tie_all(o[:keep], x[:keep], node)
        a.fix_syms(o[keep:])


RULES.update({
    name: pool
    for name in ("max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices",
                 "max_pool3d_with_indices", "avg_pool1d", "avg_pool2d", "avg_pool3d",
                 "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
                 "_adaptive_avg_pool2d", "adaptive_max_pool1d", "adaptive_max_pool2d",
                 "upsample_nearest1d", "upsample_nearest2d", "upsample_bilinear2d",
                 "upsample_nearest3d", "upsample_bicubic2d", "_upsample_bilinear2d_aa")
})

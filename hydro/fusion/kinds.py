"""Kinds of ATen ops, as the fusion rewrite (:mod:`hydro.fusion.rewrite`) and its channel-stacked
layout (:mod:`hydro.fusion.stacked`) tell them apart."""

from __future__ import annotations

import torch
import torch.fx

from hydro.fusion.facts import Batch

Node = torch.fx.Node
aten = torch.ops.aten

_ELEMENTWISE = {
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.clone.default,
    aten.contiguous.default, aten.detach.default, aten.alias.default, aten.type_as.default,
    aten.lift_fresh_copy.default, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
}


def _is_aten(target: object) -> bool:
    return isinstance(target, torch._ops.OpOverload)


def _pointwise(target: object) -> bool:
    return _is_aten(target) and (torch.Tag.pointwise in target.tags or target in _ELEMENTWISE)


def _literal_dtype(node: Node, val: torch.Tensor) -> torch.dtype:
    """The dtype a per-trial float literal takes as a tensor operand: the result's, except for a
    comparison (a boolean result), which compares in the floating operand's dtype (as a Python
    float does) or, beside integers only, in the default float dtype."""
    if val.dtype != torch.bool:
        return val.dtype
    for a in node.args:
        v = a.meta.get("val") if isinstance(a, Node) else None
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.dtype
    return torch.get_default_dtype()


def _leading_batch(fact: object) -> bool:
    return isinstance(fact, Batch) and fact.dim == 0 and fact.outer == 1


def _packet(target: object) -> str:
    return target._overloadpacket.__name__ if _is_aten(target) else ""


# per-sample, per-channel ops over the spatial dimensions: name -> number of spatial dimensions
_SPATIAL = {
    **{f"{p}pool{k}d": k for p in ("max_", "avg_", "adaptive_avg_") for k in (1, 2, 3)},
    "_adaptive_avg_pool2d": 2, "_adaptive_avg_pool3d": 3,
    **{f"{p}_pad{k}d": k for p in ("reflection", "replication") for k in (1, 2, 3)},
    "upsample_nearest1d": 1, "upsample_nearest2d": 2, "upsample_nearest3d": 3,
    "_upsample_nearest_exact1d": 1, "_upsample_nearest_exact2d": 2,
    "_upsample_nearest_exact3d": 3, "upsample_linear1d": 1, "upsample_bilinear2d": 2,
    "upsample_bicubic2d": 2, "upsample_trilinear3d": 3, "_upsample_bilinear2d_aa": 2,
}
_REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default}
# element-wise activations without the pointwise tag
_ACTIVATIONS = {
    "hardswish", "hardswish_", "hardtanh", "hardtanh_", "relu6", "mish", "mish_", "elu", "elu_",
    "leaky_relu", "leaky_relu_", "silu", "silu_", "gelu", "gelu_", "celu", "selu", "softplus",
    "hardsigmoid", "hardsigmoid_",
}

"""Normalization: batch norm (running buffers included), layer norm, RMS norm, group norm."""

from __future__ import annotations

from hydro.fx.rules.common import bound


def batch_norm(a, node, out) -> None:
    b = bound(node)
    x = a.syms_of(b["input"])
    a.tie_all(out, x, node)
    for key in ("weight", "bias", "running_mean", "running_var"):
        if b.get(key) is not None:
            a.union(a.syms_of(b[key])[0], x[1], node)


def layer_norm(a, node, out) -> None:
    b = bound(node)
    x = a.syms_of(b["input"])
    a.tie_all(out, x, node)
    k = len(b["normalized_shape"])
    for key in ("weight", "bias"):
        if b.get(key) is not None:
            a.tie_all(a.syms_of(b[key]), x[len(x) - k :], node)


def group_norm(a, node, out) -> None:
    b = bound(node)
    x = a.syms_of(b["input"])
    a.tie_all(out, x, node)
    for key in ("weight", "bias"):
        if b.get(key) is not None:
            a.union(a.syms_of(b[key])[0], x[1], node)


RULES = {
    "batch_norm": batch_norm, "_native_batch_norm_legit_no_training": batch_norm,
    "instance_norm": batch_norm, "layer_norm": layer_norm, "rms_norm": layer_norm,
    "group_norm": group_norm,
}

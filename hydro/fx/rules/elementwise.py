"""Reductions over named dimensions; everything elementwise-like goes to the generic rule."""

from __future__ import annotations

from hydro.fx.rules.common import TensorSyms, bound


def reduction(a, node, out) -> None:
    b = bound(node)
    x = a.syms_of(b.get("self", node.args[0]))
    dims = b.get("dim")
    if not isinstance(x, TensorSyms) or dims is None:
        return
    outs = (
        [o for o in out if isinstance(o, TensorSyms)] if not isinstance(out, TensorSyms) else [out]
    )
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = {d % len(x) for d in dims} if dims else set(range(len(x)))
    kept = [s for i, s in enumerate(x) if i not in dims]
    for o in outs:
        if len(o) == len(x):
            a.tie_all([s for i, s in enumerate(o) if i not in dims], kept, node)
        else:
            a.tie_all(o, kept, node)


RULES = {
    name: reduction
    for name in ("sum", "mean", "amax", "amin", "max", "min", "std", "var", "norm",
                 "logsumexp", "prod", "argmax", "argmin", "nansum", "nanmean", "var_mean",
                 "std_mean", "linalg_vector_norm")
}

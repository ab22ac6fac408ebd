"""Scaled dot-product attention (grouped-query attention included)."""

from __future__ import annotations

from hydro.fx.rules.common import TensorSyms, bound


def sdpa(a, node, out) -> None:
    b = bound(node)
    q, k, v = (a.syms_of(b[n]) for n in ("query", "key", "value"))
    a.union(q[-1], k[-1], node)
    a.union(k[-2], v[-2], node)
    a.union(out[-1], v[-1], node)
    a.union(out[-2], q[-2], node)
    if b.get("enable_gqa") and len(q) >= 3 and a.sizes[q[-3]] != a.sizes[k[-3]]:
        # query heads = kv heads * group size, the group size kept
        a.product(node, [q[-3]], [k[-3]], rhs_const=a.sizes[q[-3]] // a.sizes[k[-3]])
        a.union(k[-3], v[-3], node)
        a.union(out[-3], q[-3], node)
        a.broadcast(out[:-3], [TensorSyms(q[:-3]), TensorSyms(k[:-3]), TensorSyms(v[:-3])], node)
    else:
        a.broadcast(out[:-2], [TensorSyms(q[:-2]), TensorSyms(k[:-2]), TensorSyms(v[:-2])], node)
    mask = a.syms_of(b.get("attn_mask"))
    if isinstance(mask, TensorSyms):
        # the mask broadcasts against the attention weights [..., L_q, L_k], not the output
        # [..., L_q, D_v]: aligning it with the output ties key length to head dim by value
        a.broadcast(TensorSyms((*out[:-2], q[-2], k[-2])), [mask], node)


RULES = {"scaled_dot_product_attention": sdpa}

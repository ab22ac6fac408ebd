"""Embeddings: rows are indexed by input values (vocabulary, positions), so they stay fixed."""

from __future__ import annotations

from hydro.fx.rules.common import bound


def embedding(a, node, out) -> None:
    b = bound(node)
    w, idx = a.syms_of(b["weight"]), a.syms_of(b["indices"])
    a.fix_syms([w[0]])
    a.indexed.add(w[0])
    a.tie_all(out[:-1], idx, node)
    a.union(out[-1], w[1], node)
    a.use_param(b["weight"], node, (0,), (1,), act=None)


RULES = {"embedding": embedding}

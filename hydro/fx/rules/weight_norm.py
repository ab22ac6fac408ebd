"""Weight normalization (``torch.nn.utils.weight_norm`` and its ``parametrizations`` form):
``w = g * v / ||v||``, the norm taken over every dimension but ``dim``, as one ATen op.

Width: ``w`` has ``v``'s shape and ``g`` is ``v``'s size along ``dim`` (ones elsewhere). muP:
the layer that reads ``w`` gives ``v`` its role (``param_of`` reads through this op), and since
only ``v``'s direction matters, the scale of ``w`` is ``g``'s. A surrogate starts as weight
normalization itself starts, ``g = ||v||`` for its own ``v`` (:func:`reset_gains`), so its
effective weight is exactly its muP-initialized ``v``; ``g`` keeps its own (vector) role.
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from hydro.fx.rules.common import bound

_OP = torch.ops.aten._weight_norm.default


def weight_norm(a, node, out) -> None:
    b = bound(node)
    v, g = a.syms_of(b["v"]), a.syms_of(b["g"])
    a.tie_all(out, v, node)
    dim = b.get("dim", 0)
    if dim == -1 or len(g) != len(v):
        return  # one norm over the whole tensor: g is a scalar
    a.union(g[dim % len(v)], v[dim % len(v)], node)


RULES = {"_weight_norm": weight_norm}


def gain_pairs(graphs: dict[str, torch.fx.GraphModule]) -> list[tuple[str, str, int]]:
    """``(v, g, dim)`` names of every weight-normalized parameter pair read by the graphs."""
    pairs: list[tuple[str, str, int]] = []
    for gm in graphs.values():
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target is not _OP:
                continue
            b = bound(node)
            v, g = b["v"], b["g"]
            if all(isinstance(x, torch.fx.Node) and x.op == "get_attr" for x in (v, g)):
                pair = (v.target, g.target, int(b.get("dim", 0)))
                if pair not in pairs:
                    pairs.append(pair)
    return pairs


def layer_path(name: str) -> str:
    """The module path of a weight, through either weight-normalization naming
    (``fc.weight_v``, ``conv.parametrizations.weight.original1``)."""
    for suffix in (".parametrizations.weight.original1", ".parametrizations.weight.original0",
                   ".weight_v", ".weight_g", ".weight"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


@torch.no_grad()
def reset_gains(model: nn.Module, pairs: list[tuple[str, str, int]]) -> None:
    """Set each gain ``g`` to the norm of its ``v`` (over all dimensions but ``dim``), as weight
    normalization does when it is applied: the effective weight is then ``v`` itself."""
    for v_name, g_name, dim in pairs:
        v, g = model.get_parameter(v_name), model.get_parameter(g_name)
        g.copy_(torch.norm_except_dim(v, 2, dim).view_as(g))


__all__ = ["RULES", "gain_pairs", "layer_path", "reset_gains", "weight_norm"]

"""Tensor factories in a fused graph: ``x.new_ones(())``, ``x.new_zeros(size)``, ``new_full``.

Such an op reads only its operand's dtype and device, never its values, so where its result
has no batch dimension it is one value for every trial, whatever layout the operand is in (a
folded batch, a per-trial stack). Attention-mask code builds its constants this way from
batched position indices (``q_idx.new_ones((), dtype=torch.bool)`` in HF's mask functions);
read as an ordinary op on a batched operand with a batch-free result, it looked like a
reduction over the batch.
"""

from __future__ import annotations

import torch
import torch.fx

from hydro.fusion.facts import FREE

aten = torch.ops.aten

# ops whose tensor operand lends only its dtype and device to the result
METADATA_ONLY = frozenset(
    op.default for op in (aten.new_ones, aten.new_zeros, aten.new_full, aten.new_empty)
) | {aten.new_empty_strided.default}


def shared_factory(rw, node: torch.fx.Node, found: list[torch.fx.Node], kinds: set) -> bool:  # noqa: ANN001
    """A batch-free result of a factory is shared by the trials: copy the op as it is.

    Returns ``False`` (the usual rules apply) where the result carries the batch (a size read
    from the batch) or its arguments differ between the trials.
    """
    if rw.facts.get(node) != FREE or node.name in rw.literals:
        return False
    rw.env[node] = rw.copy(node, rw.env.__getitem__)
    rw.spec[node] = ("S",)
    return True


HANDLERS = dict.fromkeys(METADATA_ONLY, shared_factory)

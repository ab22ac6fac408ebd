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


def shared_factory(rw, node: torch.fx.Node, found: list[torch.fx.Node], kinds: set) -> bool:
    """A batch-free result of a factory is shared by the trials: copy the op as it is.

    Returns ``False`` (the usual rules apply) where the result carries the batch (a size read
    from the batch) or its arguments differ between the trials.
    """
    if rw.facts.get(node) != FREE or node.name in rw.literals:
        return False
    rw.env[node] = rw.copy(node, rw.env.__getitem__)
    rw.spec[node] = ("S",)
    return True


def batch_arange(rw, node: torch.fx.Node, found: list[torch.fx.Node], kinds: set) -> bool:
    """``arange`` as long as the batch (in-batch labels ``arange(B)``, a contrastive loss's
    targets): each trial counts its own samples, ``0 .. B-1``, not the folded batch's
    ``0 .. n*B-1``. Returns ``False`` for any other ``arange`` (positions along a sequence)."""
    from hydro.fusion.facts import Batch
    from hydro.fusion.ops import from_trials

    fact = rw.facts.get(node)
    args = list(node.args)
    if not isinstance(fact, Batch) or node.name in rw.literals or len(args) > 2:
        return False
    if len(args) == 2 and args[0] != 0:
        return False
    end = rw.env[args[-1]] if isinstance(args[-1], torch.fx.Node) else args[-1]
    spec = ("F", fact.dim, rw.outer(fact))
    kwargs = {k: v for k, v in node.kwargs.items() if k != "pin_memory"}
    per = rw.fn(torch.floor_divide, end, rw.n) if isinstance(end, torch.fx.Node) else end // rw.n
    counted = rw.fn(torch.arange, per, **kwargs)
    grown = rw.graph.call_method("expand", (rw.graph.call_method("unsqueeze", (counted, 0)),
                                            rw.n, -1))
    rw.env[node] = rw.fn(from_trials, grown, spec)
    rw.spec[node] = spec
    return True


HANDLERS = dict.fromkeys(METADATA_ONLY, shared_factory)
HANDLERS.update({aten.arange.default: batch_arange, aten.arange.start: batch_arange})

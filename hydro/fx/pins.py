"""Pins: dimensions kept whole for what a use needs, not for what they are.

Width analysis fixes what the data fixes (input features, a loss's classes, table rows read by
index). Two more things can hold a width whole, and each is a *pin* with its reason:

* an output of the model. A model that returns its loss is trained on that loss; what else it
  returns (the encoder's last hidden state of a seq2seq model, hidden states) is a by-product
  and pins nothing. A model that returns no loss is trained on its outputs by code Hydro does
  not see, so every returned dimension keeps its size.
* an integer index into a dimension (``x[:, :, -1]``, ``qkv[0]``). Into a width, it pins only
  where the index would fall outside the cut width (``-1`` and ``0`` never do); into anything
  else (a packed q/k/v axis) it fixes that dimension, as before.

A pin that keeps a width the model's layers would otherwise cut is reported: ``hydro.scale``
warns naming it and its reason, and ``hydro.inspect`` lists it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from hydro.errors import HydroWarning
from hydro.fx.nodes import describe
from hydro.fx.rules.common import TensorSyms

# ops that compute a loss against a target: a scalar output computed by one is the model's loss
LOSS_OPS = frozenset({
    "cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d", "mse_loss", "l1_loss",
    "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "kl_div", "soft_margin_loss", "multilabel_margin_loss", "margin_ranking_loss",
})


@dataclass
class Pin:
    """Symbols kept whole by one use, and why (in words, for warnings and ``inspect``).

    ``hidden_only``: report only hidden widths it keeps (an output keeps its classes by design;
    an index keeps whatever width it reaches into).
    """

    syms: list[int]
    reason: str
    hidden_only: bool = True


@dataclass
class Select:
    """``x.select(dim, index)`` with an integer ``index``: ``sym`` is the dimension indexed."""

    node: torch.fx.Node
    sym: int
    index: int


def _leaves(arg: Any) -> list[torch.fx.Node | None]:
    if isinstance(arg, torch.fx.Node):
        return [arg]
    if isinstance(arg, (tuple, list)):
        return [leaf for a in arg for leaf in _leaves(a)]
    if isinstance(arg, dict):
        return [leaf for a in arg.values() for leaf in _leaves(a)]
    return [None]


def computes_loss(node: torch.fx.Node, value: Any) -> bool:
    """Whether an output is a loss: a floating scalar computed by a loss op."""
    from hydro.fx.rules.common import op_name

    if not isinstance(value, torch.Tensor) or value.dim() != 0 or not value.is_floating_point():
        return False
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and op_name(n) in LOSS_OPS:
            return True
        todo.extend(n.all_input_nodes)
    return False


def output_pins(a: Any, output: Any) -> list[Pin]:
    """The pins of a top-level graph's outputs: none if one of them is the model's loss."""
    leaves = _leaves(output)
    if any(n is not None and computes_loss(n, a.values.get(n)) for n in leaves):
        return []
    pins = []
    for i, n in enumerate(leaves):
        syms = a.node_syms.get(n) if n is not None else None
        if isinstance(syms, TensorSyms):
            pins.append(Pin(list(syms), f"returned by the model (output {i}) beside no loss: "
                            "code outside the model reads it at full size"))
    return pins


def select_pins(a: Any, sources: set[int]) -> tuple[list[int], list[Select]]:
    """Split the integer selects: dimensions to fix (not a width: a packed q/k/v axis, a CLS
    position), and selects into a width, pinned only if the index falls outside the cut."""
    fixed, into_width = [], []
    for sel in a.selects:
        (into_width if a.find(sel.sym) in sources else fixed).append(sel)
    return [s.sym for s in fixed], into_width


def out_of_range(plan: Any, selects: Iterable[Select]) -> list[Pin]:
    """Selects whose index no longer lands inside the width they index, at ``plan``'s sizes."""
    pins = []
    for sel in selects:
        size = plan.new_dim(sel.sym)
        if not -size <= sel.index < size:
            pins.append(Pin([sel.sym], f"{describe(sel.node)} picks index {sel.index}, outside "
                            f"the width cut to {size}", hidden_only=False))
    return pins


def hidden_classes(a: Any) -> set[int]:
    """Classes that are a fan-out of one parameter use and a fan-in of another: hidden widths,
    the ones a user expects cut (not input features, not classes)."""
    fan_in, fan_out = set(), set()
    for key, uses in a.uses.items():
        syms = a.param_syms[key]
        for u in uses:
            fan_in |= {a.find(syms[d]) for d in u.fan_in}
            fan_out |= {a.find(syms[d]) for d in u.fan_out}
    return fan_in & fan_out


def warn_pinned(plan: Any, stacklevel: int = 3) -> None:
    """Warn (:class:`HydroWarning`) naming each hidden width a pin kept whole, with the reason."""
    if plan.ratio == 1 or not plan.pinned:
        return
    shown = "; ".join(f"{what} ({size}): {why}" for what, size, why in plan.pinned)
    warnings.warn(HydroWarning(
        f"ratio {plan.ratio} keeps {len(plan.pinned)} hidden width(s) whole, so the surrogate is "
        f"larger than it could be: {shown}. Return the loss from the model (outputs beside a "
        "loss are not kept whole), or read the width differently; `hydro inspect` lists them."
    ), stacklevel=stacklevel)


__all__ = ["Pin", "Select", "hidden_classes", "output_pins", "out_of_range", "select_pins",
           "warn_pinned"]

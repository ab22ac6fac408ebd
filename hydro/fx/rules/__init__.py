"""Width rules by op family: how each ATen op relates the dimensions of its inputs and outputs.

A rule is ``rule(a, node, out)``: ``a`` is the :class:`hydro.fx.widths.Analysis` being built,
``node`` the graph node and ``out`` its fresh output symbols. Rules tie symbols (``a.union``),
add constraints (products, sums, proportions) and record how parameters are used (fan-in and
fan-out dimensions, for muP roles). Ops without a rule get the elementwise rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hydro.fx.rules import (
    attention,
    conv,
    elementwise,
    embedding,
    linear,
    norm,
    recurrent,
    shape,
    weight_norm,
)

Rule = Callable[[Any, Any, Any], None]

RULES: dict[str, Rule] = {}
for _family in (linear, conv, norm, embedding, attention, shape, weight_norm, elementwise,
                recurrent):
    RULES.update(_family.RULES)

__all__ = ["RULES", "Rule"]

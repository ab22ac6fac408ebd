"""Index ranges of a scaled graph: every read by index still lands inside its table.

Shape propagation on fake tensors checks sizes, never values, so a table whose rows shrank
(a 32-row position table cut to 4) passes it and fails at the first real call. This pass reads,
for every op that picks rows by an index tensor (``table[index]``, ``embedding``), the table's
size along the indexed dimension in the target and in the surrogate: the target's index values
were valid for the target's size, so the surrogate must keep it. Where the index is a constant
of the model (a buffer such as Swin's ``relative_position_index``) its values are read too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx

from hydro.fx.paths import get_path
from hydro.fx.rules.common import TensorSyms, bound, op_name

_THROUGH = ("view", "reshape", "_unsafe_view", "flatten", "contiguous", "clone", "to",
            "_to_copy", "alias", "expand", "unsqueeze", "squeeze")


def index_reads(node: torch.fx.Node) -> Iterator[tuple[torch.fx.Node, int, Any]]:
    """``(table node, indexed dimension, index argument)`` for each read by index of ``node``."""
    if node.op != "call_function":
        return
    name = op_name(node)
    b = bound(node)
    if name == "index":
        for dim, idx in enumerate(b.get("indices") or ()):
            if isinstance(idx, torch.fx.Node):
                yield b["self"], dim, idx
    elif name == "embedding":
        yield b["weight"], 0, b["indices"]


def constant_index(root: torch.nn.Module, idx: Any) -> torch.Tensor | None:
    """The value of an index that is a tensor of the model (through views), else ``None``."""
    while isinstance(idx, torch.fx.Node) and idx.op == "call_function":
        if op_name(idx) not in _THROUGH:
            return None
        idx = idx.args[0]
    if isinstance(idx, torch.fx.Node) and idx.op == "get_attr":
        t = get_path(root, idx.target)
        if isinstance(t, torch.Tensor) and not t.is_meta and not t.is_floating_point():
            return t
    return None


def out_of_range(
    root: torch.nn.Module,
    values: dict[torch.fx.Node, Any],
    old_of: Callable[[torch.fx.Node], torch.fx.Node | None],
    old_size: Callable[[Any, int], int | None],
) -> tuple[torch.fx.Node, str] | None:
    """The first read by index of ``root``'s graphs that the scaling broke, and why.

    Args:
        root: the scaled model (its constant index buffers are read).
        values: each new node's propagated (fake) value.
        old_of: the target's node for a new node.
        old_size: the target's size of dimension ``dim`` of an old node's symbols.
    """
    for new in values:
        old = old_of(new)
        if old is None:
            continue
        for table, dim, idx in index_reads(new):
            t = values.get(table)
            if not isinstance(t, torch.Tensor) or dim >= t.dim():
                continue
            size = t.shape[dim]
            want = old_size(old_of(table), dim) if old_of(table) is not None else None
            if want is not None and size < want:
                return old, (f"reads rows of a table by index, but the table's dimension {dim} "
                             f"shrank from {want} to {size}: index values up to {want - 1} "
                             "would be out of range")
            const = constant_index(root, idx)
            if const is not None and const.numel() and int(const.max()) >= size:
                return old, (f"reads rows up to {int(const.max())} of a table of {size} rows "
                             "(its index is a buffer of the model)")
    return None


def sym_size(plan: Any) -> Callable[[Any, int], int | None]:
    """``old_size(node, dim)`` for :func:`out_of_range` from a width plan's node symbols."""

    def size(node: torch.fx.Node | None, dim: int) -> int | None:
        syms = plan.node_syms.get(node) if node is not None else None
        if node is not None and node.op == "get_attr" and not isinstance(syms, TensorSyms):
            return None
        return plan.sizes[syms[dim]] if isinstance(syms, TensorSyms) and dim < len(syms) else None

    return size

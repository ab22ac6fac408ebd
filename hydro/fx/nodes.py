"""Where a captured node comes from, in words: its module, its source line.

A leaf of :mod:`hydro.fx`: the width analysis, the pins and the depth rules all name nodes in
their messages, and none of them has to import another for it.
"""

from __future__ import annotations

import os

import torch
import torch.fx

from hydro.fx.rules.common import op_name

__all__ = ["clean_path", "describe", "module_of"]

_TORCH_DIR = os.path.dirname(torch.__file__)


def describe(node: torch.fx.Node) -> str:
    """'node NAME (aten.op) in module PATH (Type) at FILE, line N (`code`)' for messages."""
    where = ""
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i]
        if line.startswith("File ") and _TORCH_DIR not in line:
            where = " at " + line.replace("File ", "").replace('"', "")
            if i + 1 < len(lines) and not lines[i + 1].startswith("File "):
                where += f" (`{lines[i + 1]}`)"
            break
    module = ""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, kind = list(stack.values())[-1]
        kind = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
        path = clean_path(path)
        if path:
            module = f" in module '{path}' ({kind.rsplit('.', 1)[-1]})"
    return f"node '{node.name}' ({op_name(node)}){module}{where}"


def clean_path(path: str) -> str:
    """A module path as recorded in a node's ``nn_module_stack``, as dotted names."""
    # export writes module paths as L['self'].h[0].attn or as plain dotted names
    path = path.replace("L['self']", "").replace("['", ".").replace("']", "")
    path = path.replace("[", ".").replace("]", "").replace("getattr(", "").replace(")", "")
    return path.strip(".")


def module_of(node: torch.fx.Node) -> tuple[str, str] | None:
    """``(path, type name)`` of the innermost module a node was recorded in."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path, kind = list(stack.values())[-1]
    kind = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    return clean_path(path), kind.rsplit(".", 1)[-1]

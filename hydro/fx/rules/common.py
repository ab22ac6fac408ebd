"""Helpers shared by the rule modules: op names, bound arguments, symbol structures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx


class TensorSyms(tuple):
    """The symbols of a tensor's dimensions."""


@dataclass
class IntSym:
    """An int in the graph (from ``aten.sym_size``), with the symbol of the dimension it reads."""

    sym: int | None


def op_name(node: torch.fx.Node) -> str:
    """``"linear"``, ``"view"``, ``"getitem"``... for a call_function node."""
    if node.op != "call_function":
        return node.op
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def bound(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in (ATen ops); else by position."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return {str(i): a for i, a in enumerate(node.args)} | dict(node.kwargs)
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def arg_index(node: torch.fx.Node, name: str) -> int | None:
    """The position of argument ``name`` in the op's schema."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.name == name:
            return i
    return None


def set_arg(node: torch.fx.Node, name: str, value: Any) -> None:
    """Set argument ``name`` of a node, positional or keyword as it was given."""
    i = arg_index(node, name)
    if i is not None and i < len(node.args):
        node.update_arg(i, value)
    else:
        node.update_kwarg(name, value)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)

"""Dotted attribute paths (``"h.0.attn.c_attn.weight"``): how graphs name modules and tensors."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def get_path(root: nn.Module, path: str) -> Any:
    """The attribute at a dotted ``path`` (a submodule, parameter, buffer or plain attribute)."""
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def has_path(root: nn.Module, path: str) -> bool:
    """Whether ``root`` has something at ``path``."""
    try:
        get_path(root, path)
    except AttributeError:
        return False
    return True


def register_at(
    root: nn.Module, path: str, value: torch.Tensor, kind: str, persistent: bool = True
) -> None:
    """Register ``value`` (``kind`` "param" or "buffer") at a dotted ``path`` of ``root``,
    making plain containers for the modules on the way."""
    *parents, leaf = path.split(".")
    mod = root
    for part in parents:
        child = mod._modules.get(part)
        if child is None:
            child = nn.Module()
            mod.add_module(part, child)
        mod = child
    if kind == "param":
        mod.register_parameter(leaf, value)
    else:
        mod.register_buffer(leaf, value, persistent=persistent)

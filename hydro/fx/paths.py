"""Dotted attribute paths (``"h.0.attn.c_attn.weight"``): how graphs name modules and tensors."""

from __future__ import annotations

from typing import Any

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

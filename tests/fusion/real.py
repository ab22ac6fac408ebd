"""Helpers for the real-model fusion tests."""

from __future__ import annotations

from torch import nn


def no_dropout(model: nn.Module) -> nn.Module:
    """``model`` with every dropout rate 0 (modules and the float rates attention code reads)."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for key, value in list(vars(m).items()):
            if "drop" in key and isinstance(value, float):
                setattr(m, key, 0.0)
    return model

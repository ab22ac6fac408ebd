"""Rotary position tables: a buffer ``inv_freq = 1 / base ** (arange(0, d, 2) / d)`` is a
function of the head dim ``d`` and its base, so a surrogate whose head dim shrinks gets the table
rebuilt for its own head dim (same base, same formula) rather than a cut of the target's.

The formula is recognized from the buffer's values, never from a class or attribute name: the
base is recovered from the last entry and every entry must then match.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RotaryTable:
    """A rotary frequency buffer the surrogate rebuilds: its name, head dims and base."""

    name: str
    head_dim: int
    new_head_dim: int
    base: float

    def __str__(self) -> str:
        return (f"rotary table rebuilt for head dim {self.new_head_dim} (base "
                f"{format_base(self.base)}): '{self.name}', head dim {self.head_dim} -> "
                f"{self.new_head_dim}")


def format_base(base: float) -> str:
    """``10000``, ``500000``, ``1e+06``-free: integral bases as integers."""
    return str(int(base)) if float(base).is_integer() else f"{base:g}"


def rotary_base(t: torch.Tensor) -> float | None:
    """The base ``B`` if ``t`` equals ``1 / B ** (arange(0, d, 2) / d)`` with ``d = 2 * len(t)``,
    else ``None``. Bases within float32 rounding of an integer are returned as that integer."""
    if t.dim() != 1 or t.numel() < 2 or not t.is_floating_point() or t.is_meta:
        return None
    x = t.detach().to("cpu", torch.float64)
    d = 2 * x.numel()
    last = float(x[-1])
    if not 0.0 < last < 1.0 or abs(float(x[0]) - 1.0) > 1e-6:
        return None
    # the last entry is B ** (-(d - 2) / d): its rounding error reaches the base about 1:1
    base = last ** (-d / (d - 2))
    if not math.isfinite(base) or base <= 1.0:
        return None
    if abs(base - round(base)) <= 1e-4 * base:
        base = float(round(base))
    want = table(d, base, torch.float64)
    tol = 1e-2 if t.element_size() < 4 else 1e-5  # half-precision tables: their rounding
    if not torch.allclose(x, want, rtol=tol, atol=0.0):
        return None
    return base


def table(head_dim: int, base: float, dtype: torch.dtype) -> torch.Tensor:
    """``1 / base ** (arange(0, head_dim, 2) / head_dim)``, computed in float32 as the common
    implementations do (Llama, Qwen2, GPT-NeoX), then cast to ``dtype``."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return (1.0 / (base**exponent)).to(dtype)


__all__ = ["RotaryTable", "format_base", "rotary_base", "table"]

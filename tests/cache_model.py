"""The model of tests/fx/test_cache.py, in a module pytest does not rewrite (its assertion
rewriting changes a test module's code, and a key follows the code a process runs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    """Dropout (a literal of the train graph), LayerNorm, a no_grad region, a plain buffer."""

    def __init__(self, width: int = 16, p: float = 0.25) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, width)
        self.norm = nn.LayerNorm(width)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(width, 3)
        self.register_buffer("shift", torch.full((width,), 0.25), persistent=False)
        self.act = "relu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.fc1(x)) + self.shift
        if self.act in {"relu", "gelu", "silu"}:  # a frozenset constant: hash-ordered
            h = getattr(torch, self.act)(h) if self.act != "gelu" else F.gelu(h)
        h = self.drop(h)
        with torch.no_grad():
            scale = h.abs().mean() + 1
        return self.fc2(h) / scale


def forward_backward(model: nn.Module, x: tuple, train: bool) -> tuple:
    """``model(*x)`` and its parameters' gradients of ``(out ** 2).sum()``, in train or eval
    mode, with the same dropout masks every call: what a cache hit and a fresh build must agree
    on bit for bit."""
    model.train(train)
    model.zero_grad()
    torch.manual_seed(5)
    out = model(*x)
    (out**2).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]

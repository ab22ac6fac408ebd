"""Memory-aware fusion size from the analytic (meta device) estimate."""

import pytest
import torch
from torch import nn

from hydro_fluid import Device
from hydro_fluid.profile import GIB, estimate_memory, fusion_size


class FusedMLP(nn.Module):
    """n independent MLPs evaluated as batched matrix products, like a fused surrogate."""

    def __init__(self, n, width=64):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(n, 32, width))
        self.w2 = nn.Parameter(torch.zeros(n, width, 1))
        self.act = nn.ReLU()

    def forward(self, x):  # x: (batch, 32), shared by all trials
        h = self.act(torch.einsum("bi,nio->nbo", x, self.w1))
        return h @ self.w2


def batch(n):
    return torch.zeros(128, 32)


def test_analytic_estimate_counts_weights_optimizer_and_activations():
    m = estimate_memory(
        lambda n: nn.Linear(100, 50), lambda n: torch.zeros(4, 100), 1, optimizer_slots=2
    )
    weights = (100 * 50 + 50) * 4
    assert m == weights * 4 + 4 * 50 * 4 + 4 * 100 * 4
    sgd = estimate_memory(
        lambda n: nn.Linear(100, 50), lambda n: torch.zeros(4, 100), 1, optimizer_slots=0
    )
    assert m - sgd == 2 * weights


def test_cpu_counts_what_meta_counts_over_a_real_forward():
    assert estimate_memory(FusedMLP, batch, 3, device="cpu") == estimate_memory(FusedMLP, batch, 3)


def test_memory_grows_linearly_with_fusion_size():
    m1, m2, m4 = (estimate_memory(FusedMLP, batch, n) for n in (1, 2, 4))
    assert m1 < m2 < m4
    assert m4 - m2 == pytest.approx(2 * (m2 - m1), rel=0.01)


def test_fusion_size_fits_memory_with_margin():
    per_trial = estimate_memory(FusedMLP, batch, 2) - estimate_memory(FusedMLP, batch, 1)
    size = fusion_size(FusedMLP, batch, "cpu", memory=0.01, margin=0.8)
    assert size >= 2
    assert estimate_memory(FusedMLP, batch, size) <= 0.8 * 0.01 * GIB
    assert estimate_memory(FusedMLP, batch, size) + per_trial > 0.8 * 0.01 * GIB
    bigger = fusion_size(FusedMLP, batch, Device("cpu0", kind="cpu", memory=0.02))
    assert bigger > size


def test_fusion_size_errors():
    with pytest.raises(RuntimeError, match="One trial needs"):
        fusion_size(FusedMLP, batch, "cpu", memory=1e-6)
    with pytest.raises(ValueError, match="memory=<GiB>"):
        fusion_size(FusedMLP, batch, "cpu")
    with pytest.raises(ValueError, match="margin"):
        fusion_size(FusedMLP, batch, "cpu", memory=1.0, margin=0)
    with pytest.raises(ValueError, match="meta"):
        estimate_memory(FusedMLP, batch, 1, device="mps")
    with pytest.raises(ValueError, match="n must be >= 1"):
        estimate_memory(FusedMLP, batch, 0)

"""A fused model trains under autocast (bf16 on the CPU) as each trial's model does alone: the
same outputs and gradients, to bf16's precision, with gradients in the parameters' dtype."""

from __future__ import annotations

import torch

import hydro


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def test_fused_linear_layers_train_under_bf16_autocast_as_alone():
    models = [_mlp(s) for s in range(3)]
    fused = hydro.fuse([_mlp(s) for s in range(3)])
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused(x)
        alone = [m(x) for m in models]
    assert out.dtype == torch.bfloat16
    for k, a in enumerate(alone):
        torch.testing.assert_close(out[k], a, rtol=2e-2, atol=2e-2)
    out.float().square().mean(dim=(1, 2)).sum().backward()
    for a in alone:
        a.float().square().mean().backward()
    for k, m in enumerate(models):
        for (name, p), fp in zip(m.named_parameters(), fused.parameters()):
            assert fp.grad.dtype == torch.float32, name
            torch.testing.assert_close(fp.grad[k], p.grad, rtol=5e-2, atol=5e-3, msg=name)

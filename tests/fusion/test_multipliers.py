"""Per-trial plain attributes through select: muP output multipliers and dropout rates."""

from __future__ import annotations

import torch

import hydro
from tests.zoo import ZOO


def test_output_multiplier_per_trial_matches_separate_models():
    case = ZOO["gpt"]()
    model = case.model.double()
    mults = [1.0, 0.5, 2.0]
    surs = [
        hydro.scale(model, 4, example_inputs=case.inputs, seed=k, output_mult=m)
        for k, m in enumerate(mults)
    ]
    fused = hydro.fuse(surs)
    out = fused(*case.inputs)
    for k, sur in enumerate(surs):
        assert torch.allclose(out[k], sur(*case.inputs), rtol=1e-12, atol=1e-12)
        assert fused.trial(k).get_buffer("mup_readout.scale").item() == 4.0 * mults[k]
    fused.select([2, 0])
    out = fused(*case.inputs)
    assert torch.allclose(out[0], surs[2](*case.inputs), rtol=1e-12, atol=1e-12)
    assert torch.allclose(out[1], surs[0](*case.inputs), rtol=1e-12, atol=1e-12)
    assert fused.trial(0).get_buffer("mup_readout.scale").item() == 8.0


def test_dropout_rates_follow_select():
    models = [
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(p)) for p in (0.1, 0.2, 0.3)
    ]
    fused = hydro.fuse(models)
    fused.select([2, 0])
    assert [fused.trial(k)[1].p for k in range(2)] == [0.3, 0.1]

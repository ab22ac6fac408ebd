"""A fused model trained with hydro.optim equals n models trained alone with torch.optim."""

from __future__ import annotations

import pytest
import torch

import hydro
from tests.fusion.exactness import build, train_and_compare
from tests.zoo import Case

SMALL = {
    "mlp": dict(width=32, batch=8),
    "resnet": dict(width=8, batch=4),
    "gpt": dict(n_embd=32, n_head=4, batch=2),
    "encoder": dict(d_model=32, batch=3),
    "convnext": dict(dim=16, batch=2),
    "mixed": dict(width=16, batch=3),
}


@pytest.mark.parametrize("name", list(SMALL))
@pytest.mark.parametrize("opt", ["adam", "adamw", "sgd"])
def test_shared_batch_float64(name: str, opt: str) -> None:
    run, cases = build(name, 3, opt, **SMALL[name])
    train_and_compare(run, cases, steps=3, shared=True)


@pytest.mark.parametrize("name", list(SMALL))
def test_per_trial_batches_float64(name: str) -> None:
    run, cases = build(name, 3, "adamw", **SMALL[name])
    train_and_compare(run, cases, steps=3, shared=False)


@pytest.mark.parametrize("name", ["mlp", "resnet", "gpt"])
def test_float32(name: str) -> None:
    run, cases = build(name, 2, "adam", dtype=torch.float32, **SMALL[name])
    train_and_compare(run, cases, steps=3, shared=True, dtype=torch.float32)


class MaskedAttention(torch.nn.Module):
    """Manual causal attention reading a mask buffer and a raw nn.Parameter (get_attr nodes)."""

    def __init__(self, d: int = 16, t: int = 6) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.scale = torch.nn.Parameter(torch.rand(d) + 0.5)
        self.register_buffer("mask", torch.tril(torch.ones(t, t)))
        self.out = torch.nn.Linear(d, 3)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = (q @ k.transpose(-2, -1)).masked_fill(self.mask == 0, float("-inf"))
        y = torch.softmax(att, dim=-1) @ v
        return self.out(self.scale * y).mean(dim=1)


def test_mask_buffer_and_raw_parameter(monkeypatch) -> None:
    from tests import zoo

    def masked(seed: int = 0, batch: int = 4) -> zoo.Case:
        g = torch.Generator().manual_seed(seed + 1000)
        torch.manual_seed(seed)
        x = torch.randn(batch, 6, 16, generator=g)
        return zoo.Case(
            MaskedAttention(),
            (x,),
            torch.randint(0, 3, (batch,), generator=g),
            torch.nn.functional.cross_entropy,
        )

    monkeypatch.setitem(zoo.ZOO, "masked", masked)
    for opt in ("adamw", "sgd"):
        run, cases = build("masked", 3, opt)
        assert "mask" in run.fused.shared_tensors  # one causal mask, read once for all trials
        train_and_compare(run, cases, steps=3, shared=True)
        run, cases = build("masked", 3, opt)
        train_and_compare(run, cases, steps=2, shared=False)


def test_eval_mode_outputs_after_training() -> None:
    run, cases = build("resnet", 3, "sgd", **SMALL["resnet"])
    train_and_compare(run, cases, steps=2)
    run.fused.eval()
    x = cases[0].inputs[0].double()
    out = run.fused(x)
    for k, model in enumerate(run.models):
        model.eval()
        torch.testing.assert_close(out[k], model(x), rtol=1e-9, atol=1e-12)


def surrogate(case: Case) -> torch.nn.Module:
    """The case's model as a Hydro muP surrogate at half width (parameters carry infshape)."""
    return hydro.scale(case.model, ratio=2, example_inputs=case.inputs)


@pytest.mark.parametrize("name", list(SMALL))
def test_surrogates_adamw(name: str) -> None:
    run, cases = build(name, 3, "adamw", make_model=surrogate, **SMALL[name])
    assert any(hasattr(p, "infshape") for p in run.fused.parameters())
    train_and_compare(run, cases, steps=3, shared=True)
    assert all(
        hasattr(p, "infshape") == hasattr(q, "infshape")
        for p, q in zip(run.fused.trial(2).parameters(), run.models[2].parameters())
    )


@pytest.mark.parametrize("name", ["mlp", "resnet", "gpt"])
def test_surrogates_sgd_per_trial_batches(name: str) -> None:
    run, cases = build(name, 3, "sgd", make_model=surrogate, **SMALL[name])
    train_and_compare(run, cases, steps=3, shared=False)

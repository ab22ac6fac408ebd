"""HF GPT-2 with its ``lm_head`` tied to the token embedding: the tie survives fusion and both
uses (the embedding lookup and the readout matmul) take their fused forms, never the vmap
fallback, also when the members' dropout rates differ (one of them 0, which capture leaves out of
the graph) and for ``hydro.scale`` surrogates. Training exactness of the tied model is in
``test_real_models.py`` (``hf_gpt2``)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import hydro
from hydro.fusion import fuse
from tests.real_models import build

transformers = pytest.importorskip("transformers")


def _gpt2(seed: int, dropout: float) -> torch.nn.Module:
    model, make = build("hf_gpt2", seed=seed)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = dropout
    model.transformer.h[0].attn.attn_dropout.p = dropout
    return model.double(), make


def test_tied_head_takes_the_fused_path(caplog) -> None:
    members, make = zip(*(_gpt2(k, p) for k, p in enumerate([0.0, 0.1, 0.2])))
    assert members[0].lm_head.weight is members[0].transformer.wte.weight
    _, kwargs = make[0](3, torch.Generator().manual_seed(0))
    fused = fuse([copy.deepcopy(m) for m in members])
    assert fused.get_parameter("lm_head.weight") is fused.get_parameter("transformer.wte.weight")
    with caplog.at_level(logging.WARNING, logger="hydro.fusion"):
        out = fused(**kwargs)
        out.loss.sum().backward()
        fused.eval()
        logits = fused(**kwargs).logits
    assert fused.fallbacks == [] and "vmap" not in caplog.text
    assert out.loss.shape == (3,)
    for k, m in enumerate(members):  # eval mode: no dropout, each trial equals its model
        m.eval()
        torch.testing.assert_close(logits[k], m(**kwargs).logits, rtol=1e-12, atol=1e-12)


def test_tied_head_of_surrogates_takes_the_fused_path() -> None:
    model, make = build("hf_gpt2", seed=0)
    _, kwargs = make(3, torch.Generator().manual_seed(0))
    sur = hydro.scale(model.double(), 2, example_kwargs=kwargs)
    fused = fuse(sur, n=3, seed=1)
    fused(**kwargs).loss.sum().backward()
    assert fused.fallbacks == []

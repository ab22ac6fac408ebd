"""``hydro.tune`` end to end on every model of issue 8, as its authors publish it.

Tiny runs (2 trials fused into one group of 2, a few steps at ratio 8, or the largest ratio the
model's widths allow) on real Optuna with an in-memory SQLite storage: every trial must complete
with a finite value, and both must have trained in one fused group.
"""

from __future__ import annotations

import math

import optuna
import pytest
import torch
from torch import nn

import hydro
from tests.real_models import MODELS, TIMM_MODELS, build, timm_available

SPACE = {"lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)}
# efficientnet_b0's squeeze-excitation layers are 4 wide (see test_capture.test_timm_model_scales)
RATIO = {"timm_efficientnet_b0": 2}
CLASSES = {"encoder_batch_first": 5, "encoder_seq_first": 5}


class OwnLoss(nn.Module):
    """nanoGPT returns ``(logits, loss)``; ``loss="model"`` reads ``.loss`` or ``["loss"]``."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        logits, loss = self.gpt(idx, targets)
        return {"logits": logits, "loss": loss}


def _task(name: str) -> hydro.Task:
    model, make = build(name)
    g = torch.Generator().manual_seed(0)
    (train_args, train_kwargs), (val_args, val_kwargs) = make(16, g), make(8, g)
    common = dict(steps=3, eval_every=3, batch_size=4, checkpoint_every=0)
    if name == "nanogpt":
        train = {"idx": train_args[0], "targets": train_kwargs["targets"]}
        val = {"idx": val_args[0], "targets": val_kwargs["targets"]}
        return hydro.Task(model=OwnLoss(model), train_data=train, val_data=val, loss="model",
                          target_key="targets", **common)
    if train_kwargs:  # HuggingFace: keyword batches with labels, the model's own loss
        return hydro.Task(model=model, train_data=train_kwargs, val_data=val_kwargs,
                          loss="model", **common)
    classes = CLASSES.get(name, 7)
    train = (train_args[0], torch.randint(0, classes, (16,), generator=g))
    val = (val_args[0], torch.randint(0, classes, (8,), generator=g))
    return hydro.Task(model=model, train_data=train, val_data=val, loss="cross_entropy", **common)


def _needs(name: str) -> None:
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    if name.startswith("timm_") and not timm_available():
        pytest.skip("timm needs a torchvision that imports")


@pytest.mark.parametrize("name", [*MODELS, *TIMM_MODELS])
def test_tune_end_to_end_fused(name: str) -> None:
    _needs(name)
    task = _task(name)
    result = hydro.tune(task, SPACE, n_trials=2, ratio=RATIO.get(name, 8), fuse=2, seed=0,
                        storage="sqlite:///:memory:")
    rows = result.trials
    assert len(rows) == 2, rows
    assert all(r["state"] == "COMPLETE" for r in rows), rows
    assert all(math.isfinite(r["value"]) for r in rows), rows
    assert len({r["group"] for r in rows}) == 1, rows  # one group...
    assert {t.user_attrs["fused"] for t in result.study.trials} == {2}  # ...of 2, fused
    assert "lr" in result.best_params

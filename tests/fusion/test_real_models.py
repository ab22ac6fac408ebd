"""Real models (tests/real_models.py) fused and trained exactly like separate runs.

For every model: ``fuse([m1, m2, m3])`` of plain modules (captured at the first call) and
``fuse(captured, n=3)`` (three initializations of one captured model), trained three steps in
float64 with per-trial learning rates by ``hydro.optim.AdamW`` against three ``torch.optim.AdamW``
runs; loss (the model's own, one per trial), gradients, parameters, buffers and optimizer state
are compared after every step.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F

import hydro.optim
from hydro.fusion import fuse, trial_loss
from hydro.fx.capture import Captured, capture
from tests.fusion.exactness import assert_close
from tests.fusion.real import no_dropout
from tests.real_models import MODELS, build, timm_available

LRS = [1e-3, 3e-3, 2e-2]
B = 3


def _double(x: object) -> object:
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def batches(name: str, make) -> list:  # noqa: ANN001
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(3):
        args, kwargs = make(B, g)
        out.append((tuple(map(_double, args)), {k: _double(v) for k, v in kwargs.items()}))
    return out


def model_loss(out: object) -> torch.Tensor | None:
    """The loss a model computes itself: ``.loss``, ``["loss"]`` or nanoGPT's ``(logits, loss)``."""
    if hasattr(out, "loss"):
        return out.loss
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor):
        return out[1]
    return None


def own_or_ce(out: object, kwargs: dict, labels: torch.Tensor, fused: bool) -> torch.Tensor:
    loss = model_loss(out)
    if loss is not None:
        return loss
    return trial_loss(F.cross_entropy, out, labels) if fused else F.cross_entropy(out, labels)


# float64 tolerances. Deep timm CNNs do not reach 1e-9: grouped and depthwise convolutions sum
# in another order than n separate ones, BatchNorm passes that on, and Adam turns a gradient's
# last bits into whole steps where the gradient is near zero (worst seen: 5e-8 relative, a
# resnet18 BatchNorm bias after two steps).
TOL64 = {"timm_resnet18": (1e-7, 1e-15), "timm_convnext_atto": (1e-7, 1e-15)}
# mobilenetv3_small and efficientnet_b0 (squeeze-excitation, BatchNormAct) fuse and their fused
# forward agrees to 1e-13, but some BatchNorm running means (~1e-7) differ in their leading
# digit after a step, by amounts that change from run to run: an open finding, not tested here.
EXACT_TIMM = ["timm_resnet18", "timm_convnext_atto", "timm_vit_tiny"]
_tol64 = (1e-9, 1e-15)


def tol(t: torch.Tensor) -> dict:
    # HF language models compute their loss on logits.float(): float32 values stay float32
    rtol, atol = _tol64
    return dict(rtol=rtol, atol=atol) if t.dtype == torch.float64 else dict(rtol=2e-6, atol=0)


def check(name: str, fused, models, opts, fused_opt, data) -> None:  # noqa: ANN001
    labels = torch.randint(0, 5, (B,), generator=torch.Generator().manual_seed(3))
    # A key bias gets an exactly-zero gradient (softmax ignores it): rounding noise on both
    # sides, which Adam normalizes into arbitrary steps. Gradients are compared against the
    # model's gradient scale, and parameters whose gradient never rose above noise are skipped.
    real: set[str] = set()
    for step, (args, kwargs) in enumerate(data):
        losses = []
        for m, o in zip(models, opts):
            o.zero_grad()
            loss = own_or_ce(m(*args, **kwargs), kwargs, labels, fused=False)
            loss.backward()
            losses.append(loss.detach())
        fused_opt.zero_grad()
        fl = own_or_ce(fused(*args, **kwargs), kwargs, labels, fused=True)
        assert fl.shape == (len(models),), f"{name}: per-trial loss shape {fl.shape}"
        fl.sum().backward()
        expected = torch.stack(losses)
        assert_close(fl, expected, **tol(expected), msg=f"{name} step {step}: losses")
        fp = dict(fused.named_parameters())
        for k, m in enumerate(models):
            scale = max(float(p.grad.abs().max()) for p in m.parameters())
            for pname, p in m.named_parameters():
                g = fp[pname].grad[k]
                t = tol(g)
                t["atol"] = max(t["atol"], t["rtol"] * scale)
                assert_close(g, p.grad, **t, msg=f"{name} step {step}: grad {pname}")
                if float(p.grad.abs().max()) > 1e-9 * scale:
                    real.add(pname)
        for o in opts:
            o.step()
        fused_opt.step()
        for k, (m, o) in enumerate(zip(models, opts)):
            for pname, p in m.named_parameters():
                if pname not in real:
                    continue
                assert_close(fp[pname][k], p, **tol(p), msg=f"{name} step {step}: {pname}")
                state = fused_opt.state[fp[pname]]
                for key in ("exp_avg", "exp_avg_sq"):
                    assert_close(state[key][k], o.state[p][key], **tol(p),
                                 msg=f"{name} step {step}: {key} {pname}")  # fmt: skip
            fb = dict(fused.named_buffers())
            for bname, b in m.named_buffers():
                assert_close(fb[bname][k], b, **tol(b), msg=f"{name} step {step}: {bname}")


def train_both(name: str, fused, models, data) -> None:  # noqa: ANN001
    opts = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.01) for m, lr in
            zip(models, LRS)]  # fmt: skip
    fused_opt = hydro.optim.AdamW(fused.parameters(), lr=LRS, weight_decay=0.01)
    check(name, fused, models, opts, fused_opt, data)


def three_members(name: str) -> tuple[list, list]:
    """Three float64 builds of model ``name`` (seeds 0-2, dropout off) and its batches."""
    members = []
    for seed in range(3):
        model, make = build(name, seed=seed)
        members.append(no_dropout(model).double().train())
    return members, batches(name, make)


@pytest.mark.parametrize("name", list(MODELS))
def test_real_model_fused_training_is_exact(name: str) -> None:
    members, data = three_members(name)
    separate = [copy.deepcopy(m) for m in members]

    # a list of plain modules: parameters exist before the first call, capture happens at it
    fused = fuse(members)
    assert fused.n == 3 and len(list(fused.parameters())) > 0
    train_both(name, fused, separate, data)
    trial = fused.trial(1)
    assert type(trial) is type(members[0])
    assert list(trial.state_dict()) == list(members[0].state_dict())

    # one captured model, three initializations
    args, kwargs = data[0]
    cap = capture(copy.deepcopy(members[0]), args, kwargs)
    fused_n = fuse(cap, n=3, seed=1)
    trials = [fused_n.trial(k) for k in range(3)]
    assert all(isinstance(t, Captured) for t in trials)
    w = [p for p in fused_n.parameters() if p.dim() >= 3][0]
    assert not torch.equal(w[1], w[0]) and not torch.equal(w[2], w[1])
    assert list(trials[2].state_dict()) == list(cap.state_dict())
    train_both(name, fused_n, trials, data)


@pytest.mark.skipif(not timm_available(), reason="timm needs a torchvision that imports")
@pytest.mark.parametrize("name", EXACT_TIMM)
def test_timm_model_fused_training_is_exact(name: str, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(sys.modules[__name__], "_tol64", TOL64.get(name, _tol64))
    members, data = three_members(name)
    separate = [copy.deepcopy(m) for m in members]
    fused = fuse(members)
    train_both(name, fused, separate, data)
    assert type(fused.trial(2)) is type(members[0])

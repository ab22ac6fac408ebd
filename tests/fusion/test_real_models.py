"""Real models (tests/real_models.py) fused and trained exactly like separate runs.

For every model: ``fuse([m1, m2, m3])`` of plain modules (captured at the first call) and
``fuse(captured, n=3)`` (three initializations of one captured model), trained three steps in
float64 with per-trial learning rates by ``hydro.optim.AdamW`` against three ``torch.optim.AdamW``
runs (timm CNNs: ``hydro.optim.SGD`` with momentum against ``torch.optim.SGD``); loss (the
model's own, one per trial), gradients, parameters, buffers (BatchNorm running statistics) and
optimizer state are compared after every step, in float64 to 1e-9 relative.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import hydro.optim
from hydro.fusion import fuse, trial_loss
from hydro.fx.capture import Captured, capture
from tests.fusion.exactness import assert_close
from tests.fusion.real import no_dropout
from tests.real_models import MODELS, TIMM_MODELS, build, timm_available

LRS = [1e-3, 3e-3, 2e-2]
B = 3


def _double(x: object) -> object:
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def batches(name: str, make) -> list:
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


# float64, 1e-9 relative for every model.
_tol64 = (1e-9, 1e-15)
# Deep timm CNNs train with SGD (momentum, per-trial learning rates). With Adam, whose update
# lr * m / (sqrt(v) + eps) moves an entry by up to lr / eps ~ 1e5 times any change in a gradient
# near zero, two torch-only runs whose parameters differ by 1e-16 (one rounding) after the first
# step already differ by 1e-8 in gradients and parameters two steps later (measured on
# mobilenetv3_small and efficientnet_b0 at this size), so no two implementations can agree to
# 1e-9 there; SGD keeps rounding at rounding (the fused runs below are bit-identical on this CPU).
TIMM_LRS = [1e-2, 3e-2, 1e-1]
# At 32 x 32 pixels the last stages of mobilenetv3_small and efficientnet_b0 normalize 1 x 1
# maps over a batch of 3: training is chaotic there (torch-only runs 1e-16 apart differ by 1e-5
# in gradients after two SGD steps). At 64 x 64 with a batch of 4 they stay within 1e-12.
TIMM_DATA = {"timm_mobilenetv3_small": (4, 64), "timm_efficientnet_b0": (4, 64)}


def tol(t: torch.Tensor) -> dict:
    # HF language models compute their loss on logits.float(): float32 values stay float32
    rtol, atol = _tol64
    return dict(rtol=rtol, atol=atol) if t.dtype == torch.float64 else dict(rtol=2e-6, atol=0)


def check(name: str, fused, models, opts, fused_opt, data) -> None:
    batch = next(t for t in (*data[0][0], *data[0][1].values()) if isinstance(t, torch.Tensor))
    labels = torch.randint(0, 5, (batch.shape[0],), generator=torch.Generator().manual_seed(3))
    # A key bias gets an exactly-zero gradient (softmax ignores it): rounding noise on both
    # sides, which Adam normalizes into arbitrary steps. Gradients are compared against the
    # model's gradient scale, and (under Adam) parameters whose gradient never rose above noise
    # are skipped. SGD moves such a parameter by lr times the noise: everything is compared.
    adam = not isinstance(fused_opt, hydro.optim.SGD)
    real: set[str] = set()
    gscale = [0.0] * len(models)  # each model's largest gradient entry so far
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
            gscale[k] = max(gscale[k], scale)
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
                if adam and pname not in real:
                    continue
                t = tol(p)
                if not adam:
                    # SGD moves a parameter by lr times its gradient, which agrees to rtol on
                    # the model's gradient scale: a parameter whose exact gradient is 0 (a
                    # BatchNorm bias before the next BatchNorm) holds lr times rounding noise
                    t["atol"] = max(t["atol"], t["rtol"] * o.param_groups[0]["lr"] * gscale[k])
                assert_close(fp[pname][k], p, **t, msg=f"{name} step {step}: {pname}")
                state = fused_opt.state[fp[pname]]
                if adam:
                    for key in ("exp_avg", "exp_avg_sq"):
                        assert_close(state[key][k], o.state[p][key], **tol(p),
                                     msg=f"{name} step {step}: {key} {pname}")
                else:
                    t = tol(p)
                    t["atol"] = max(t["atol"], t["rtol"] * gscale[k])
                    assert_close(state["momentum_buffer"][k], o.state[p]["momentum_buffer"],
                                 **t, msg=f"{name} step {step}: momentum {pname}")
            fb = dict(fused.named_buffers())
            for bname, b in m.named_buffers():
                t = tol(b)
                if bname.endswith("running_mean"):
                    # on the activations' scale: a channel whose exact batch mean is 0 (a
                    # BatchNorm output with zero bias, through a bias-free 1x1 convolution into
                    # the next BatchNorm) holds rounding noise on both sides
                    spread = float(m.get_buffer(bname[: -len("mean")] + "var").max()) ** 0.5
                    t["atol"] = max(t["atol"], t["rtol"] * spread)
                assert_close(fb[bname][k], b, **t, msg=f"{name} step {step}: {bname}")


def train_both(name: str, fused, models, data, sgd: bool = False) -> None:
    if sgd:
        opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9, weight_decay=0.01)
                for m, lr in zip(models, TIMM_LRS)]
        fused_opt = hydro.optim.SGD(fused.parameters(), lr=TIMM_LRS, momentum=0.9,
                                    weight_decay=0.01)
    else:
        opts = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.01) for m, lr in
                zip(models, LRS)]
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
    assert fused.fallbacks == [] and fused_n.fallbacks == []  # every op took its fused form


@pytest.mark.skipif(not timm_available(), reason="timm needs a torchvision that imports")
@pytest.mark.parametrize("name", list(TIMM_MODELS))
def test_timm_model_fused_training_is_exact(name: str) -> None:
    members, data = three_members(name)
    if name in TIMM_DATA:
        batch, size = TIMM_DATA[name]
        g = torch.Generator().manual_seed(7)
        data = [((torch.randn(batch, 3, size, size, generator=g, dtype=torch.float64),), {})
                for _ in range(3)]
    separate = [copy.deepcopy(m) for m in members]
    fused = fuse(members)
    train_both(name, fused, separate, data, sgd=True)
    assert type(fused.trial(2)) is type(members[0])
    assert fused.fallbacks == []

"""Shared frozen computation: a frozen backbone, equal in every member, is stored once and run
once for the whole fused group, and training equals separate runs (float64, step by step)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import hydro.optim
from hydro.fusion import fuse, trial_loss
from tests.fusion.exactness import assert_close

LRS = [1e-3, 3e-3, 1e-2]
TOL = dict(rtol=1e-9, atol=1e-15)


class FineTune(nn.Module):
    """A backbone (frozen by the tests) and a trainable head."""

    def __init__(self, cnn: bool) -> None:
        super().__init__()
        if cnn:
            self.backbone = nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.ReLU(),
                nn.AdaptiveAvgPool2d(2), nn.Flatten(),
            )
            width = 32
        else:
            self.backbone = nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh())
            width = 32
        self.head = nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def _members(cnn: bool, n: int = 3) -> list[FineTune]:
    torch.manual_seed(0)
    pretrained = FineTune(cnn).double()
    if cnn:  # "pretrained" running statistics, not the defaults
        pretrained.backbone[1].running_mean.uniform_(-1, 1)
        pretrained.backbone[1].running_var.uniform_(0.5, 2)
    out = []
    for k in range(n):
        torch.manual_seed(100 + k)
        m = FineTune(cnn).double()
        m.backbone.load_state_dict(pretrained.backbone.state_dict())  # the same backbone
        m.backbone.requires_grad_(False)
        m.train()
        m.backbone.eval()  # frozen BatchNorm: its statistics stay as loaded
        out.append(m)
    return out


def _data(cnn: bool, steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (6, 3, 8, 8) if cnn else (6, 6)
    out = []
    for _ in range(steps):
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        out.append((x, torch.randint(0, 5, (6,), generator=g)))
    return out


@pytest.mark.parametrize("cnn", [False, True], ids=["mlp", "cnn"])
def test_frozen_backbone_is_shared_and_training_is_exact(cnn: bool) -> None:
    members = _members(cnn)
    separate = [copy.deepcopy(m) for m in members]
    fused = fuse(members)
    frozen = {name for name, p in members[0].named_parameters() if not p.requires_grad}
    assert fused.frozen_shared == frozen and frozen
    for name in frozen:  # stored once: every trial reads the same memory
        p = fused.get_parameter(name)
        assert p.stride(0) == 0 and not p.requires_grad
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr,
                              weight_decay=0.01) for m, lr in zip(separate, LRS)]
    fopt = hydro.optim.AdamW(fused.parameters(), lr=LRS, weight_decay=0.01)
    for step, (x, y) in enumerate(_data(cnn)):
        losses = []
        for m, o in zip(separate, opts):
            o.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            losses.append(loss.detach())
        fopt.zero_grad()
        fl = trial_loss(F.cross_entropy, fused(x), y)
        fl.sum().backward()
        assert_close(fl, torch.stack(losses), **TOL, msg=f"step {step}: losses")
        for o in opts:
            o.step()
        fopt.step()
        fp, fb = dict(fused.named_parameters()), dict(fused.named_buffers())
        for k, (m, o) in enumerate(zip(separate, opts)):
            for name, p in m.named_parameters():
                assert_close(fp[name][k], p, **TOL, msg=f"step {step}: {name}")
                if p.requires_grad:
                    assert_close(fp[name].grad[k], p.grad, **TOL, msg=f"step {step}: grad {name}")
                    for key in ("exp_avg", "exp_avg_sq"):
                        assert_close(fopt.state[fp[name]][key][k], o.state[p][key], **TOL,
                                     msg=f"step {step}: {key} {name}")
                else:
                    assert fp[name].grad is None
            for name, b in m.named_buffers():
                assert_close(fb[name][k], b, **TOL, msg=f"step {step}: {name}")
    assert fused.fallbacks == []


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_frozen_backbone_runs_once_for_the_group() -> None:
    n = 8
    members = _members(cnn=True, n=n)
    x, _ = _data(cnn=True, steps=1)[0]
    one = _flops(lambda: members[0](x))
    features = members[0].backbone(x)
    head = _flops(lambda: members[0].head(features))
    backbone = one - head
    assert backbone > 5 * head  # a backbone worth sharing
    fused = fuse(members)
    fused(x)  # capture
    # the backbone once, the heads n times (as one GEMM each)
    assert _flops(lambda: fused(x)) == backbone + n * head
    unshared = fuse(members, share_frozen=False)  # every trial computes its own backbone
    assert unshared.frozen_shared == set()
    unshared(x)
    assert _flops(lambda: unshared(x)) == n * one


def test_only_equal_frozen_parameters_are_shared() -> None:
    members = _members(cnn=False)
    with torch.no_grad():
        members[2].backbone[2].weight.add_(1e-12)  # frozen, but not equal: per trial
    members[1].head[2].requires_grad_(False)  # frozen in one member only: per trial
    x, _ = _data(cnn=False, steps=1)[0]
    fused = fuse([copy.deepcopy(m) for m in members])
    assert fused.frozen_shared == {"backbone.0.weight", "backbone.0.bias", "backbone.2.bias"}
    out = fused(x)
    for k, m in enumerate(members):
        assert_close(out[k], m(x), **TOL, msg=f"trial {k}")


def test_trials_in_and_out_keep_the_shared_copy() -> None:
    members = _members(cnn=False, n=4)
    x, _ = _data(cnn=False, steps=1)[0]
    fused = fuse([copy.deepcopy(m) for m in members])
    w = fused.get_parameter("backbone.0.weight")
    fused.select([3, 1])
    assert fused.n == 2 and w.stride(0) == 0 and w.shape[0] == 2
    assert torch.equal(fused.trial(0).backbone[0].weight, members[3].backbone[0].weight)
    fused.load_trial(1, copy.deepcopy(members[0]))  # the same backbone: still shared
    assert w.stride(0) == 0
    other = copy.deepcopy(members[0])
    with torch.no_grad():
        other.backbone[0].weight.mul_(2)
    fused.load_trial(0, other)  # another backbone: that tensor goes per trial
    assert w.stride(0) != 0 and "backbone.0.weight" not in fused.frozen_shared
    out = fused(x)
    assert_close(out[0], other(x), **TOL, msg="loaded trial")
    assert_close(out[1], members[0](x), **TOL, msg="kept trial")
    # fuse(model, n): frozen parameters are part of the task, not redrawn
    fused_n = fuse(copy.deepcopy(members[0]), n=3, seed=2)
    assert fused_n.frozen_shared == fused.frozen_shared | {"backbone.0.weight"}
    assert not torch.equal(fused_n.get_parameter("head.0.weight")[1], members[0].head[0].weight)


def test_eval_graph_built_before_training_follows_the_statistics() -> None:
    """An evaluation graph built first reads BatchNorm statistics equal in every trial (fresh)
    once; the first training step writes them per trial, and evaluation must follow."""
    torch.manual_seed(0)
    models = [FineTune(cnn=True).double() for _ in range(3)]  # nothing frozen
    x, y = _data(cnn=True, steps=1)[0]
    fused = fuse([copy.deepcopy(m) for m in models])
    fused.eval()
    fused(x)
    fused.train()
    fused(x)  # running statistics move, differently per trial
    fused.eval()
    out = fused(x)
    for k, m in enumerate(models):
        m.train()
        m(x)
        m.eval()
        assert_close(out[k], m(x), **TOL, msg=f"trial {k}")

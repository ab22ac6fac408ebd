"""Fused linear layers: few layout ops per layer, and the same numbers on both input paths.

A fused ``Linear`` runs as one ``baddbmm`` over ``[n, rows, in]``; between consecutive layers the
folded value ``[n * B, F]`` is that tensor as it lies, so a layer needs one view in and one out,
and no copy. A shared input narrower than ``ops.NARROW_SHARED`` features is read by every trial
through a stride-0 view; a wider one meets all trials' weights in one GEMM.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hydro.fusion.model as model_module
from hydro import TraceError
from hydro.fusion import fuse, loss, ops, trial_loss
from tests.fusion.exactness import TOL, assert_close

N = 3


class _Count(TorchDispatchMode):
    """The ATen ops dispatched inside the block, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _mlp(d_in: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d_in, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)
    ).double()


def test_fused_mlp_forward_and_backward_copy_nothing() -> None:
    """Three fused linears: no copy, no permute, at most two views per layer, each way."""
    fused = fuse([_mlp(4, k) for k in range(N)])
    x = torch.randn(5, 4, dtype=torch.float64)
    fused(x)  # builds the graph
    with _Count() as forward:
        out = fused(x)
    with _Count() as backward:
        out.square().sum().backward()
    for count in (forward, backward):
        copies = {op: count.ops[op] for op in ("clone", "_unsafe_view", "permute", "copy_")}
        assert not any(copies.values()), f"layout copies in the fused MLP: {dict(count.ops)}"
        views = count.ops["view"] + count.ops["reshape"] + count.ops["unsqueeze"]
        # one in and one out per layer, the bias's ``[n, 1, out]``, and the output's ``[n, ...]``
        assert views <= 3 * 3 + 1, f"{views} views in three fused linears: {dict(count.ops)}"
    assert forward.ops["baddbmm"] == 3


@pytest.mark.parametrize("d_in", [ops.NARROW_SHARED // 8, ops.NARROW_SHARED + 16])
def test_shared_input_paths_match_separate_models(d_in: int) -> None:
    """A narrow shared input (a view per trial) and a wide one (one GEMM): each trial's loss,
    output and gradients are those of its own model, in float64."""
    models = [_mlp(d_in, k) for k in range(N)]
    fused = fuse([copy.deepcopy(m) for m in models])
    x = torch.randn(6, d_in, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    out = fused(x)
    trial_loss(F.cross_entropy, out, y).sum().backward()
    grads = dict(fused.named_parameters())
    for k, m in enumerate(models):
        mine = m(x)
        F.cross_entropy(mine, y).backward()
        assert_close(out[k], mine, **TOL[torch.float64], msg=f"trial {k}: output")
        for name, p in m.named_parameters():
            assert_close(grads[name].grad[k], p.grad, **TOL[torch.float64], msg=f"{k}: {name}")


@pytest.mark.parametrize("classes", [loss.FEW_CLASSES - 6, loss.FEW_CLASSES + 4])
@pytest.mark.parametrize("shared", [True, False])
def test_trial_cross_entropy_is_each_trials_own(classes: int, shared: bool) -> None:
    """``trial_loss(F.cross_entropy)`` on ``[n, B, C]`` logits, below ``FEW_CLASSES`` (classes
    along dim 1 of ``[n, C, B]``) and from it on (rows): each trial's loss and gradient are its
    own mean cross-entropy's, ignored targets (-100) left out of the mean, in float64."""
    torch.manual_seed(0)
    out = torch.randn(N, 7, classes, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, classes, (N, 7) if not shared else (7,))
    target[..., 2] = -100
    if not shared:
        target[1, 4] = -100  # trials count different numbers of targets
    with _Count() as count:
        losses = trial_loss(F.cross_entropy, out, target, shared=shared)
    # below FEW_CLASSES the classes lie along dim 1 (the spatial kernel), else along rows
    kernel = "nll_loss2d_forward" if classes < loss.FEW_CLASSES else "nll_loss_forward"
    assert count.ops[kernel] == 1, dict(count.ops)
    (losses * torch.arange(1.0, N + 1, dtype=torch.float64)).sum().backward()
    for k in range(N):
        mine = out.detach()[k].requires_grad_()
        want = F.cross_entropy(mine, target if shared else target[k])
        ((k + 1) * want).backward()
        assert_close(losses[k], want, **TOL[torch.float64], msg=f"trial {k}: loss")
        assert_close(out.grad[k], mine.grad, **TOL[torch.float64], msg=f"trial {k}: gradient")


def test_forward_checks_each_input_shape_once_and_still_refuses_a_wrong_one(monkeypatch) -> None:
    """The input-shape check runs at the first call of a graph with given shapes, not at every
    step; a batch not seen yet is checked, and a wrong feature size still gets its clear error
    after the graph has run many times."""
    checks = []
    real = model_module._check_shapes
    monkeypatch.setattr(
        model_module, "_check_shapes", lambda *a: checks.append(a[2][0].shape) or real(*a)
    )
    fused = fuse([_mlp(4, k) for k in range(N)])
    x = torch.randn(5, 4, dtype=torch.float64)
    for _ in range(3):
        fused(x)
    fused(torch.randn(7, 4, dtype=torch.float64))
    fused(x)
    assert checks == [(5, 4), (7, 4)]
    with pytest.raises(TraceError, match=r"called with \(5, 6\)"):
        fused(torch.randn(5, 6, dtype=torch.float64))

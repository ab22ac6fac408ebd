"""Fused graphs as a user sees them: launches independent of n, fuse(sur, n=k), dropout rates,
lazy capture, output structures, per-trial losses, errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hydro
from hydro.errors import FuseError
from hydro.fusion import fuse, trial_loss
from hydro.fx.capture import Captured, capture
from tests.fusion.real import no_dropout
from tests.real_models import build
from tests.zoo import ZOO


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _aten_ops(make, n: int) -> list[str]:
    fused, call = make(n)
    call(fused)  # capture and build the graph outside the count
    with _Count() as counter:
        loss = call(fused)
        loss.sum().backward()
    return counter.ops


def _zoo(name: str, **kw: object):
    def make(n: int):
        case = ZOO[name](**kw)
        fused = fuse(case.model, n=n)

        def call(f):
            return trial_loss(case.loss, f(*case.inputs), case.target)

        return fused, call

    return make


def _nanogpt(n: int):
    model, make = build("nanogpt")
    args, kwargs = make(2, torch.Generator().manual_seed(0))
    fused = fuse(model, n=n)
    return fused, lambda f: f(*args, **kwargs)[1]


@pytest.mark.parametrize(
    "make",
    [_zoo("mlp", width=32, batch=8), _zoo("resnet", width=8, batch=4), _nanogpt],
    ids=["mlp", "cnn_bn", "nanogpt"],
)
def test_aten_ops_per_step_do_not_grow_with_n(make) -> None:
    small, large = _aten_ops(make, 2), _aten_ops(make, 64)
    assert len(small) == len(large), (len(small), len(large))
    assert sorted(small) == sorted(large)


def test_readme_line_fuse_scaled_surrogate_n_16() -> None:
    case = ZOO["mlp"](width=64, batch=8)
    sur = hydro.scale(case.model, 8, example_inputs=case.inputs)
    fused = hydro.fuse(sur, n=16)
    out = fused(*case.inputs)
    assert out.shape == (16, 8, 10)
    torch.testing.assert_close(out[0], sur(*case.inputs))
    w = fused.get_parameter("hidden.1.weight")  # a readout may start at zero: a hidden layer
    assert len({float(w[k].detach().sum()) for k in range(16)}) == 16
    # the same from a captured model: redrawn per tensor from its statistics, by seed
    cap = capture(case.model, case.inputs)
    a, b, c = fuse(cap, n=16, seed=3), fuse(cap, n=16, seed=3), fuse(cap, n=16, seed=4)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(p[0], cap.get_parameter(name))
        if p[0].numel() > 1 and float(p[0].detach().std()) > 0:
            assert not torch.equal(p[1:], r[1:]), name
            assert abs(float(p[1:].detach().std()) / float(p[0].detach().std()) - 1) < 0.2, name
    trial = a.trial(5)
    assert isinstance(trial, Captured)
    torch.testing.assert_close(trial(*case.inputs), a(*case.inputs)[5], rtol=1e-6, atol=1e-6)


def test_fuse_n_validation() -> None:
    model = nn.Linear(3, 2)
    for bad in (0, -1, 2.5):
        with pytest.raises(FuseError, match="n="):
            fuse(model, n=bad)
    with pytest.raises(FuseError, match="n="):
        fuse(model)


def test_dropout_per_trial_rates_and_trial_eval_outputs() -> None:
    rates = [0.0, 0.3, 0.6]
    members = []
    for k, p in enumerate(rates):
        model, make = build("nanogpt", seed=k)
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = p
        for blk in model.transformer.h:
            blk.attn.dropout = p
        members.append(model.train())
    (idx,), kw = make(4, torch.Generator().manual_seed(0))
    fused = fuse(members)
    logits, loss = fused(idx, **kw)
    assert loss.shape == (3,) and logits.shape[:2] == (3, 4)
    # trial 0 has no dropout: equal to its model in train mode; the others are not
    ref0 = members[0](idx, **kw)
    torch.testing.assert_close(logits[0], ref0[0], rtol=1e-5, atol=1e-6)
    for k in (1, 2):
        assert not torch.allclose(logits[k], members[k](idx, **kw)[0], atol=1e-3)
    # the per-trial rate takes effect: the drop fraction of the embedding dropout
    x = torch.ones(2000, 8)
    lin = [nn.Sequential(nn.Linear(8, 8), nn.Dropout(p)) for p in rates]
    out = fuse(lin)(x)
    clean = torch.stack([m[0](x) for m in lin])
    for k, p in enumerate(rates):
        dropped = ((out[k] == 0) & (clean[k] != 0)).float().mean().item()
        assert abs(dropped - p) < 0.03, (k, dropped)
    fused.eval()
    logits, loss = fused(idx, **kw)
    for k in range(len(members)):
        trial = fused.trial(k).eval()
        assert trial.transformer.drop.p == rates[k]
        t_logits, t_loss = trial(idx, **kw)
        torch.testing.assert_close(logits[k], t_logits, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(loss[k], t_loss, rtol=1e-5, atol=1e-6)


def test_lazy_capture_optimizer_first_and_recapture_for_new_call_structure() -> None:
    model, make = build("nanogpt")
    fused = fuse(copy.deepcopy(model), n=2)
    opt = hydro.optim.AdamW(fused.parameters(), lr=[1e-3, 2e-3])  # before any call
    assert fused._captures == {}
    (idx,), kw = make(2, torch.Generator().manual_seed(0))
    logits, loss = fused(idx, **kw)  # captured here, from this call
    loss.sum().backward()
    opt.step()
    assert len(fused._captures) == 1
    # without targets: another structure, captured again (the model's own inference branch)
    logits, loss = fused(idx)
    assert loss is None and logits.shape == (2, 2, 1, 61)
    assert len(fused._captures) == 2


def test_shared_false_per_trial_batches() -> None:
    model, make = build("hf_gpt2")
    fused = fuse(no_dropout(model), n=2, seed=0)
    g = torch.Generator().manual_seed(0)
    per = [make(3, g)[1] for _ in range(2)]
    stacked = {k: torch.stack([p[k] for p in per]) for k in per[0]}
    out = fused(shared=False, **stacked)
    assert out.loss.shape == (2,) and out.logits.shape == (2, 3, 12, 61)
    for k in range(2):
        single = fused.trial(k)
        ref = single(**per[k])
        torch.testing.assert_close(out.loss[k], ref.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.logits[k], ref.logits, rtol=1e-5, atol=1e-5)


def test_dict_outputs_and_ignore_index_per_trial() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x, labels):
            logits = self.fc(x)
            return {"logits": logits, "loss": F.cross_entropy(logits, labels, ignore_index=-100)}

    nets = [Net().double() for _ in range(3)]
    fused = fuse(nets)
    x = torch.randn(6, 4, dtype=torch.float64)
    labels = torch.tensor([0, 1, -100, 2, -100, 1])
    out = fused(x, labels)
    assert set(out) == {"logits", "loss"} and out["loss"].shape == (3,)
    for k, net in enumerate(nets):
        ref = net(x, labels)
        torch.testing.assert_close(out["loss"][k], ref["loss"], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(out["logits"][k], ref["logits"], rtol=1e-12, atol=1e-14)


def test_structural_difference_is_an_error_naming_the_node() -> None:
    class Flip(nn.Module):
        def __init__(self, flip: bool) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.flip = flip

        def forward(self, x):
            h = self.fc(x)
            return h.flip(-1) if self.flip else h.roll(1, -1)

    fused = fuse([Flip(True), Flip(False)])
    with pytest.raises(FuseError, match="graphs differ"):
        fused(torch.randn(3, 4))


class TimmStyle(nn.Module):
    """What timm's ViT and friends contain: a CLS token expanded to the batch, a learned position
    table sliced by the sequence length, qkv moved ahead of the batch then unbound, a SiLU MLP,
    ``F.layer_norm(x, self.w.shape, ...)``, and a loss computed but not returned (dead)."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(8, d) * 0.1)
        self.proj = nn.Linear(4, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.w = nn.Parameter(torch.rand(d) + 0.5)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.head = nn.Linear(d, 3)
        self.heads = heads

    def forward(self, x, y):
        h = self.proj(x)
        B, N, C = h.shape
        h = torch.cat([self.cls.expand(B, -1, -1), h], dim=1) + self.pos[: N + 1]
        qkv = self.qkv(h).reshape(B, N + 1, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N + 1, C)
        h = F.layer_norm(h + a, self.w.shape, self.w, None, 1e-5)
        h = h + self.fc2(F.silu(self.fc1(h)))
        logits = self.head(h[:, 0])
        F.cross_entropy(logits, y)  # unused: removed before fusing
        return logits


def test_timm_style_patterns_fuse_exactly() -> None:
    models = []
    for k in range(3):
        torch.manual_seed(k)
        models.append(TimmStyle().double())
    x = torch.randn(5, 6, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    fused = fuse([copy.deepcopy(m) for m in models])
    losses = trial_loss(F.cross_entropy, fused(x, y), y)
    losses.sum().backward()
    params = dict(fused.named_parameters())
    for k, m in enumerate(models):
        loss = F.cross_entropy(m(x, y), y)
        loss.backward()
        torch.testing.assert_close(losses[k], loss, rtol=1e-12, atol=1e-14)
        for name, p in m.named_parameters():
            torch.testing.assert_close(params[name].grad[k], p.grad, rtol=1e-9, atol=1e-13)


def test_batch_size_read_as_a_value_is_one_trials() -> None:
    class ManualMean(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x):
            h = self.fc(x)
            return h.sum() / x.shape[0]  # a mean written by hand: B must read one trial's

    nets = [ManualMean().double() for _ in range(3)]
    x = torch.randn(5, 4, dtype=torch.float64)
    out = fuse([copy.deepcopy(m) for m in nets])(x)
    assert out.shape == (3,)
    for k, net in enumerate(nets):
        torch.testing.assert_close(out[k], net(x), rtol=1e-12, atol=1e-14)

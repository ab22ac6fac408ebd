"""Attention with a per-trial mask or bias (issue 18): a learned relative-position bias given to
``scaled_dot_product_attention`` as ``attn_mask`` differs between trials, and fuses into one
attention call (the trials folded into the heads) whose backward reaches each trial's table.

The models are written as real ones write them: Swin's window attention with a relative-position
table read by an index buffer, T5's bucketed relative bias from an ``nn.Embedding``, a local
attention whose boolean mask comes from a per-trial radius, and the same window attention with a
fixed bias buffer shared by every trial.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hydro.optim
from hydro.fusion import fuse, ops, trial_loss
from tests import zoo
from tests.fusion.exactness import build, train_and_compare
from tests.fusion.test_exactness import surrogate
from tests.fusion.test_random import _same

VOCAB = 19


class WindowAttention(nn.Module):
    """Swin-style: a ``6 x 6`` token map cut into ``3 x 3`` windows (the batch merged with the
    windows), attention in each window with a bias per head and relative position read from a
    ``(2w - 1)^2``-row table by an index buffer (a shared buffer when ``learned`` is off)."""

    def __init__(self, width: int = 16, heads: int = 2, window: int = 3, side: int = 6,
                 drop: float = 0.0, learned: bool = True) -> None:
        super().__init__()
        self.heads, self.window, self.side, self.drop = heads, window, side, drop
        rows = (2 * window - 1) ** 2
        if learned:
            self.table = nn.Parameter(torch.randn(rows, heads) * 0.5)
        else:  # the same values in every model: one buffer for all trials
            g = torch.Generator().manual_seed(0)
            self.register_buffer("table", torch.randn(rows, heads, generator=g))
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window),
                                            indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("index", rel[..., 0] * (2 * window - 1) + rel[..., 1], False)
        self.embed = nn.Linear(3, width)
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, w, s = x.shape[0], self.window, self.side
        h = self.embed(x)  # [B, S, S, C]
        c = h.shape[-1]
        win = h.view(b, s // w, w, s // w, w, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, c)
        t = win.shape[1]
        qkv = self.qkv(self.norm(win)).reshape(-1, t, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        bias = self.table[self.index.view(-1)].view(t, t, -1).permute(2, 0, 1).unsqueeze(0)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=self.drop if self.training else 0.0
        )
        win = win + self.proj(y.transpose(1, 2).reshape(-1, t, c))
        return self.head(win.view(b, -1, c).mean(1))


class T5Attention(nn.Module):
    """T5's relative attention: bidirectional log-spaced buckets of ``key - query`` read from an
    ``nn.Embedding(buckets, heads)``, added through ``attn_mask``, unscaled scores."""

    def __init__(self, width: int = 16, heads: int = 2, buckets: int = 8,
                 max_distance: int = 12) -> None:
        super().__init__()
        self.heads, self.buckets, self.max_distance = heads, buckets, max_distance
        self.tok = nn.Embedding(VOCAB, width)
        self.rel = nn.Embedding(buckets, heads)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.out = nn.Linear(width, VOCAB)

    def bucket(self, t: int, device: torch.device) -> torch.Tensor:
        pos = torch.arange(t, dtype=torch.long, device=device)
        rel = pos[None, :] - pos[:, None]
        half = self.buckets // 2
        out = (rel > 0).long() * half
        dist = rel.abs()
        exact = half // 2
        scaled = torch.log(dist.float() / exact) / math.log(self.max_distance / exact)
        far = exact + (scaled * (half - exact)).long()
        far = torch.min(far, torch.full_like(far, half - 1))
        return out + torch.where(dist < exact, dist, far)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        h = self.tok(ids)
        q, k, v = (f(h).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k,
                                                                             self.v))
        bias = self.rel(self.bucket(t, ids.device)).permute(2, 0, 1).unsqueeze(0)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        h = h + self.o(y.transpose(1, 2).reshape(b, t, -1))
        return self.out(h)


class LocalAttention(nn.Module):
    """Attention to the tokens within ``radius`` positions (a per-trial hyperparameter): a
    boolean mask that differs between trials."""

    def __init__(self, width: int = 16, heads: int = 2, radius: float = 1.0) -> None:
        super().__init__()
        self.heads, self.radius = heads, radius
        self.tok = nn.Embedding(VOCAB, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        h = self.tok(ids)
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        pos = torch.arange(t, device=ids.device)
        near = (pos[:, None] - pos[None, :]).abs().to(h.dtype) <= self.radius
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=near)
        return self.out(h + y.transpose(1, 2).reshape(b, t, -1))


def _window(seed: int = 0, batch: int = 2, learned: bool = True) -> zoo.Case:
    g = torch.Generator().manual_seed(seed + 1000)
    torch.manual_seed(seed)
    x = torch.randn(batch, 6, 6, 3, generator=g)
    y = torch.randint(0, 4, (batch,), generator=g)
    return zoo.Case(WindowAttention(learned=learned), (x,), y, F.cross_entropy)


def _t5(seed: int = 0, batch: int = 2) -> zoo.Case:
    g = torch.Generator().manual_seed(seed + 1000)
    torch.manual_seed(seed)
    ids, y = torch.randint(0, VOCAB, (2, batch, 10), generator=g)
    return zoo.Case(T5Attention(), (ids,), y, zoo.gpt_loss)


def _local(seed: int = 0, batch: int = 2) -> zoo.Case:
    g = torch.Generator().manual_seed(seed + 1000)
    torch.manual_seed(seed)
    ids, y = torch.randint(0, VOCAB, (2, batch, 8), generator=g)
    return zoo.Case(LocalAttention(radius=1.0 + 1.5 * seed), (ids,), y, zoo.gpt_loss)


CASES = {
    "window": _window,
    "t5": _t5,
    "local_bool": _local,
    "window_shared": lambda seed=0, batch=2: _window(seed, batch, learned=False),
}


def _fused_op(fused: object) -> set:
    return {n.target for gm in fused._graphs.values() for n in gm.graph.nodes}


@pytest.mark.parametrize("name", list(CASES))
def test_per_trial_attention_bias_trains_like_separate_surrogates(
    name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(zoo.ZOO, name, CASES[name])
    # a fixed bias buffer has a width (the heads) a surrogate cannot cut: plain models there
    make = None if name == "window_shared" else surrogate
    with caplog.at_level(logging.WARNING, logger="hydro.fusion"):
        run, cases = build(name, 3, "adamw", make_model=make)
        train_and_compare(run, cases, steps=3, shared=name != "t5")
    assert run.fused.fallbacks == [] and "vmap" not in caplog.text
    targets = _fused_op(run.fused)
    if name == "window_shared":  # one bias for all trials: torch's kernel on the folded batch
        assert "table" in run.fused.shared_tensors
        assert torch.ops.aten.scaled_dot_product_attention.default in targets
    else:
        assert ops.trial_masked_attention in targets
    learned = {"window": "table", "t5": "rel.weight"}.get(name)
    if learned:  # the bias was learned: each trial's table got its own gradient
        grad = run.fused.get_parameter(learned).grad
        assert all(float(grad[k].abs().max()) > 0 for k in range(3))
        assert not torch.equal(grad[0], grad[1])


def _window_dropout(rate: float, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return WindowAttention(drop=rate).double()


def _train(members: list[nn.Module], slot: int, seed: int, steps: int) -> list:
    """``steps`` fused SGD steps; slot ``slot`` (stream ``seed``): loss, gradients, weights.

    SGD, not Adam: the key bias's exact gradient is 0 (softmax ignores it), rounding noise that
    Adam would normalize into steps differing with the group's summation order."""
    fused = fuse([copy.deepcopy(m) for m in members])
    fused.reseed_trial(slot, seed)
    opt = hydro.optim.SGD(fused.parameters(), lr=[0.1] * len(members), momentum=0.9,
                          weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        x = torch.randn(2, 6, 6, 3, generator=g, dtype=torch.float64)
        losses = trial_loss(F.cross_entropy, fused(x), torch.tensor([1, 3]))
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
        grads = {n: p.grad[slot].clone() for n, p in fused.named_parameters()}
        weights = {n: p[slot].detach().clone() for n, p in fused.named_parameters()}
        out.append((losses[slot].item(), grads, weights))
    assert fused.fallbacks == [] and ops.trial_attention in _fused_op(fused)
    return out


def test_attention_dropout_with_a_per_trial_bias_is_each_trials_own() -> None:
    me = _window_dropout(0.2, 7)
    alone = _train([me], 0, seed=42, steps=3)
    # in a group with per-trial rates, in another slot: the same losses, gradients, weights
    _same(_train([_window_dropout(0.1, 1), _window_dropout(0.4, 2), me], 2, 42, 3), alone)
    assert float(alone[0][1]["table"].abs().max()) > 0  # the bias table learns through dropout
    # the drops act: another stream trains differently
    assert _train([me], 0, seed=43, steps=1)[0][0] != pytest.approx(alone[0][0], rel=1e-9)


@pytest.mark.parametrize(
    "q_shape, kv_heads, mask_shape",
    [
        ((2, 4, 5, 8), 2, (5, 5)),  # grouped-query heads, one mask broadcast over the heads
        ((2, 4, 5, 8), 4, (1, 4, 5, 5)),  # a mask per head
        ((2, 4, 5, 8), 2, (4, 1, 5)),  # per head, broadcast over the queries
        ((2, 5, 8), None, (5, 5)),  # no head dimension
    ],
)
@pytest.mark.parametrize("boolean", [False, True])
def test_masked_attention_equals_each_trials_own_call(q_shape, kv_heads, mask_shape, boolean):
    """The fused op against one SDPA call per trial, values and gradients (the mask's too)."""
    n, g = 3, torch.Generator().manual_seed(0)
    kv_shape = q_shape if kv_heads is None else (*q_shape[:1], kv_heads, *q_shape[2:])
    q, k, v = (torch.randn(n, *s, generator=g, dtype=torch.float64, requires_grad=True)
               for s in (q_shape, kv_shape, kv_shape))
    raw = torch.randn(n, *mask_shape, generator=g, dtype=torch.float64)
    mask = (raw > -1).logical_or(torch.eye(5, dtype=torch.bool)[0]) if boolean else raw
    mask.requires_grad_(not boolean)
    gqa = kv_heads not in (None, q_shape[1])
    spec = ("F", 0, 1)
    folded = [t.flatten(0, 1) for t in (q, k, v)]
    fused = ops.trial_masked_attention(*folded, mask, False, None, gqa, n, [spec] * 3, spec)
    sdpa = F.scaled_dot_product_attention
    alone = torch.stack([sdpa(q[t], k[t], v[t], attn_mask=mask[t], enable_gqa=gqa)
                         for t in range(n)])
    torch.testing.assert_close(fused.unflatten(0, (n, -1)), alone, rtol=1e-12, atol=1e-14)
    seed = torch.randn(alone.shape, generator=g, dtype=torch.float64)
    inputs = (q, k, v) if boolean else (q, k, v, mask)
    got = torch.autograd.grad((fused.unflatten(0, (n, -1)) * seed).sum(), inputs)
    want = torch.autograd.grad((alone * seed).sum(), inputs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)

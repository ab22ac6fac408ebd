"""Small models written the way real ones are, for the patterns width analysis once got wrong.

Each reads a learned table by a precomputed index, builds a mask with tensor factories, or
returns or indexes a width beside its loss: Swin's relative-position bias, a decoder's learned
position table read by position ids, a sliding-window causal mask as Mistral/Qwen2 build it, an
encoder-decoder returning its encoder's last hidden state, a score read from the last channel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 23


class WindowAttention(nn.Module):
    """Swin-style attention over windows of ``window x window`` tokens with a learned bias per
    relative position: a ``(2w-1)^2``-row table read as ``table[index.view(-1)]``."""

    def __init__(self, width: int = 64, heads: int = 4, window: int = 4) -> None:
        super().__init__()
        self.heads, self.window = heads, window
        self.table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads) * 0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window),
                                            indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("index", rel[..., 0] * (2 * window - 1) + rel[..., 1], False)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q * (c // self.heads) ** -0.5) @ k.transpose(-2, -1)
        bias = self.table[self.index.view(-1)].view(n, n, -1).permute(2, 0, 1)
        attn = (attn + bias.unsqueeze(0)).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class SwinTiny(nn.Module):
    """Patch embedding, one window-attention block, a classifier; ``(loss, logits)``."""

    def __init__(self, width: int = 64, window: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(3, width)
        self.norm = nn.LayerNorm(width)
        self.attn = WindowAttention(width, 4, window)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple:
        h = self.embed(x)
        h = h + self.attn(self.norm(h))
        logits = self.head(h.mean(1))
        return F.cross_entropy(logits, labels), logits


class PositionDecoder(nn.Module):
    """A decoder with a 32-row learned position table read by position ids (``pos(position_ids)``
    through ``table[ids]``), as GPT-style decoders that take ``position_ids`` do."""

    def __init__(self, width: int = 64, max_len: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.randn(max_len, width) * 0.02)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )
        self.out = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor):
        h = self.tok(ids) + self.pos[position_ids]
        h = h + self.mlp(h)
        logits = self.out(h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


class SlidingWindowLM(nn.Module):
    """Causal attention restricted to the last ``window`` positions, the mask built as Mistral's
    and Qwen2's mask functions build it: from position indices and tensor factories."""

    def __init__(self, width: int = 64, heads: int = 4, window: int | None = 3) -> None:
        super().__init__()
        self.heads, self.window = heads, window
        self.tok = nn.Embedding(VOCAB, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.out = nn.Linear(width, VOCAB)

    def mask(self, position_ids: torch.Tensor) -> torch.Tensor:
        """``[B, 1, T, T]`` additive mask from each sample's positions (as models taking
        ``position_ids`` build it), its constants made by factories of the batched indices."""
        q_idx, kv_idx = position_ids[:, :, None], position_ids[:, None, :]
        allowed = kv_idx <= q_idx
        if self.window is not None:  # HF's and_masks/or_masks start from new_ones/new_zeros
            inside = (q_idx - kv_idx) < q_idx.new_full((), self.window)
            inside = inside | q_idx.new_zeros((), dtype=torch.bool)
            allowed = q_idx.new_ones((), dtype=torch.bool) & allowed & inside
        bias = torch.zeros_like(allowed, dtype=torch.float32).masked_fill(~allowed, float("-inf"))
        return (bias + torch.ones_like(bias) - 1).unsqueeze(1)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor):
        b, t = ids.shape
        h = self.tok(ids)
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        positions = torch.arange(t, device=ids.device).expand(b, t)
        bias = self.mask(positions).to(h.dtype)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        h = h + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        logits = self.out(h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


class EncoderDecoder(nn.Module):
    """An encoder-decoder returning ``(loss, logits, encoder_last_hidden_state)``, as HF's
    seq2seq models return it beside the loss."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.enc = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )
        self.dec = nn.Linear(2 * width, width)
        self.out = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor):
        enc = self.tok(ids)
        enc = enc + self.enc(enc)
        ctx = enc.mean(1, keepdim=True).expand_as(enc)
        h = self.dec(torch.cat([self.tok(labels), ctx], -1))
        logits = self.out(h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits, enc


class LastChannel(nn.Module):
    """A regressor whose score is the last channel of its hidden state, ``h[:, :, -1]``."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.mlp = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        h = self.mlp(F.gelu(self.inp(x)))
        score = h[:, :, -1]
        return F.mse_loss(score, y), score


class EncoderFeatures(EncoderDecoder):
    """The same encoder-decoder returning ``(logits, encoder_last_hidden_state)`` and no loss:
    its training loss is computed outside, from both."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor):
        return super().forward(ids, labels)[1:]


class ChannelAt(LastChannel):
    """``h[:, :, index]``: an index that a cut width may no longer reach."""

    def __init__(self, width: int = 64, index: int = 40) -> None:
        super().__init__(width)
        self.index = index

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        h = self.mlp(F.gelu(self.inp(x)))
        score = h[:, :, self.index]
        return F.mse_loss(score, y), score

"""A GPT-2 style decoder for character-level language modelling (pre-LN, tied embeddings).

Written to be read top to bottom; the attention splits heads with ``view``/``transpose``, the
pattern Hydro's width analysis understands and rescales.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from examples.charlm.data import VOCAB_SIZE


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused query/key/value projection."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # [B, H, T, D]
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """The feed-forward block: expand by 4, GELU, project back."""

    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, a final LayerNorm, a tied readout."""

    def __init__(self, n_layer: int, n_head: int, n_embd: int, block_size: int, dropout: float):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(VOCAB_SIZE, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, VOCAB_SIZE, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: the embedding is also the readout

        # GPT-2 init: N(0, 0.02) everywhere, and the projections that write into the residual
        # stream scaled down by sqrt(2 * n_layer) so the stream's variance does not grow with depth.
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, VOCAB_SIZE]`` for token ids ``idx`` of shape ``[B, T]``."""
        _, t = idx.size()
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt(
    n_layer: int = 4, n_head: int = 4, n_embd: int = 256, block_size: int = 64, dropout: float = 0.0
) -> nn.Module:
    """A freshly initialized character-level GPT over ``VOCAB_SIZE`` characters.

    Args:
        n_layer: transformer blocks.
        n_head: attention heads (must divide ``n_embd``).
        n_embd: model width (the dimension Hydro divides by ``ratio``).
        block_size: longest sequence (size of the position table).
        dropout: dropout probability after embeddings, attention and MLP (tunable per trial).
    """
    return GPT(n_layer, n_head, n_embd, block_size, dropout)

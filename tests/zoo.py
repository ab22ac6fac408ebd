"""A zoo of small models covering the layers Hydro must scale and fuse.

Each builder returns a ``Case``: a freshly initialized model, example inputs, targets and a loss.
Sizes are small so that tests run in seconds on a 2-core CPU, but every hidden width is divisible
by 8 so that ratios 1, 2, 4 and 8 all apply.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Case:
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# --- MLP ---------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, width: int = 128, d_out: int = 10, depth: int = 3):
        super().__init__()
        dims = [d_in] + [width] * (depth - 1)
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.out = nn.Linear(width, d_out)

    def forward(self, x):
        for layer in self.hidden:
            x = F.relu(layer(x))
        return self.out(x)


def mlp(width: int = 128, batch: int = 32, seed: int = 0) -> Case:
    g = torch.Generator().manual_seed(seed + 1000)
    torch.manual_seed(seed)
    model = MLP(width=width)
    x = torch.randn(batch, 16, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return Case(model, (x,), y, F.cross_entropy)


# --- CIFAR-style ResNet ------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width: int = 16, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.layer1 = BasicBlock(width, width, 1)
        self.layer2 = BasicBlock(width, 2 * width, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = self.layer2(self.layer1(x))
        x = torch.flatten(self.pool(x), 1)
        return self.fc(x)


def resnet(width: int = 16, batch: int = 8, seed: int = 0) -> Case:
    g = torch.Generator().manual_seed(seed + 1000)
    torch.manual_seed(seed)
    model = ResNet(width)
    x = torch.randn(batch, 3, 8, 8, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return Case(model, (x,), y, F.cross_entropy)


# --- GPT-style decoder -------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, use_sdpa: bool):
        super().__init__()
        self.n_head, self.n_embd, self.use_sdpa = n_head, n_embd, use_sdpa
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        mask = torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
        self.register_buffer("mask", mask)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (k.size(-1) ** -0.5)
            att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, use_sdpa: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, use_sdpa)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int = 65,
        block_size: int = 16,
        n_layer: int = 2,
        n_head: int = 8,
        n_embd: int = 128,
        use_sdpa: bool = True,
    ):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head, block_size, use_sdpa) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embedding
        # GPT-2 style initialization
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
            elif p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def gpt(n_embd: int = 128, n_head: int = 8, batch: int = 4, seed: int = 0, sdpa=True) -> Case:
    g = torch.Generator().manual_seed(seed + 1000)
    torch.manual_seed(seed)
    model = GPT(n_embd=n_embd, n_head=n_head, use_sdpa=sdpa)
    idx = torch.randint(0, 65, (batch, 16), generator=g)
    y = torch.randint(0, 65, (batch, 16), generator=g)
    return Case(model, (idx,), y, gpt_loss)


# --- nn.TransformerEncoder ---------------------------------------------------------------------


class EncoderClassifier(nn.Module):
    def __init__(self, vocab: int = 50, d_model: int = 64, nhead: int = 8, num_classes: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead, dim_feedforward=2 * d_model, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, tokens):
        h = self.encoder(self.embed(tokens))
        return self.head(h.mean(dim=1))


def encoder(d_model: int = 64, batch: int = 4, seed: int = 0) -> Case:
    g = torch.Generator().manual_seed(seed + 1000)
    torch.manual_seed(seed)
    model = EncoderClassifier(d_model=d_model)
    x = torch.randint(0, 50, (batch, 12), generator=g)
    y = torch.randint(0, 5, (batch,), generator=g)
    return Case(model, (x,), y, F.cross_entropy)


# --- ConvNeXt-style ----------------------------------------------------------------------------


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, layer_scale: float = 1e-6):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(layer_scale * torch.ones(dim))

    def forward(self, x):
        shortcut = x
        x = self.dwconv(x).permute(0, 2, 3, 1)  # channels-last for LayerNorm and Linear
        x = self.pwconv2(F.gelu(self.pwconv1(self.norm(x))))
        x = (self.gamma * x).permute(0, 3, 1, 2)
        return shortcut + x


class ConvNeXt(nn.Module):
    def __init__(self, dim: int = 32, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, kernel_size=2, stride=2)
        self.blocks = nn.Sequential(ConvNeXtBlock(dim, 0.1), ConvNeXtBlock(dim, 0.1))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.head(self.norm(x.mean(dim=(-2, -1))))


def convnext(dim: int = 32, batch: int = 4, seed: int = 0) -> Case:
    g = torch.Generator().manual_seed(seed + 1000)
    torch.manual_seed(seed)
    model = ConvNeXt(dim)
    x = torch.randn(batch, 3, 8, 8, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return Case(model, (x,), y, F.cross_entropy)


# --- odds and ends: Conv1d, BatchNorm1d, GroupNorm, ConvTranspose2d, cat, dropout, pooling ------


class Mixed(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.conv1d = nn.Conv1d(4, width, 3, padding=1)
        self.bn1d = nn.BatchNorm1d(width)
        self.enc = nn.Conv2d(3, width, 3, stride=2, padding=1)
        self.gn = nn.GroupNorm(8, width)
        self.grouped = nn.Conv2d(width, width, 3, padding=1, groups=4)
        self.up = nn.ConvTranspose2d(width, width, 2, stride=2)
        self.merge = nn.Conv2d(width + 3, width, 1)
        self.drop = nn.Dropout(0.0)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(width * 4 * 4 + width, 6)

    def forward(self, img, seq):
        s = F.relu(self.bn1d(self.conv1d(seq))).mean(dim=-1)  # [B, width]
        h = F.silu(self.gn(self.enc(img)))  # [B, width, 4, 4]
        h = self.up(F.relu(self.grouped(h)))  # [B, width, 8, 8]
        h = self.merge(torch.cat([h, img], dim=1))  # skip connection by concatenation
        h = self.drop(self.pool(h)).flatten(1)  # [B, width * 16]
        return self.head(torch.cat([h, s], dim=1))


def mixed(width: int = 32, batch: int = 4, seed: int = 0) -> Case:
    g = torch.Generator().manual_seed(seed + 1000)
    torch.manual_seed(seed)
    model = Mixed(width)
    img = torch.randn(batch, 3, 8, 8, generator=g)
    seq = torch.randn(batch, 4, 10, generator=g)
    y = torch.randint(0, 6, (batch,), generator=g)
    return Case(model, (img, seq), y, F.cross_entropy)


ZOO: dict[str, Callable[..., Case]] = {
    "mlp": mlp,
    "resnet": resnet,
    "gpt": gpt,
    "encoder": encoder,
    "convnext": convnext,
    "mixed": mixed,
}

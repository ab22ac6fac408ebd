"""Models as their authors publish them, built small from configs with random weights.

Each entry builds ``(model, make_batch)``: ``make_batch(batch_size, generator)`` returns
``(args, kwargs)`` for one call. Models that compute their own loss get their labels among the
kwargs (``labels=``, ``targets=``). Nothing is downloaded: HuggingFace models come from configs,
the nanoGPT model below is written in the style of nanoGPT's published ``model.py`` (its
``assert`` on the sequence length, optional ``targets``, ``F.layer_norm(x, self.weight.shape,
...)``, a weight-tied head, a ``(logits, loss)`` tuple).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[tuple, dict]
Builder = Callable[[], tuple[nn.Module, Callable[[int, torch.Generator], Batch]]]

VOCAB, SEQ = 61, 12


def _ids(b: int, g: torch.Generator, t: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=g)


# --- nanoGPT, published style -------------------------------------------------------------------


@dataclass
class NanoConfig:
    block_size: int = 16
    vocab_size: int = VOCAB
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    flash: bool = True  # nanoGPT picks SDPA when torch has it; False: its manual attention


class NanoLayerNorm(nn.Module):
    """LayerNorm with an optional bias, calling the functional form like nanoGPT."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoAttention(nn.Module):
    def __init__(self, cfg: NanoConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout
        self.flash = cfg.flash
        if not self.flash:
            n = cfg.block_size
            self.register_buffer("bias", torch.tril(torch.ones(n, n)).view(1, 1, n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                is_causal=True,
            )
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = self.attn_dropout(att) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class NanoMLP(nn.Module):
    def __init__(self, cfg: NanoConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class NanoBlock(nn.Module):
    def __init__(self, cfg: NanoConfig) -> None:
        super().__init__()
        self.ln_1 = NanoLayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = NanoAttention(cfg)
        self.ln_2 = NanoLayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = NanoMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, cfg: NanoConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([NanoBlock(cfg) for _ in range(cfg.n_layer)]),
                ln_f=NanoLayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        else:
            logits = self.lm_head(x[:, [-1], :])  # inference: only the last position
            loss = None
        return logits, loss


def nanogpt() -> tuple[nn.Module, Callable]:
    model = NanoGPT(NanoConfig())

    def batch(b: int, g: torch.Generator) -> Batch:
        x = _ids(b, g)
        return (x,), {"targets": torch.roll(x, -1, dims=1)}

    return model, batch


# --- torch.nn -------------------------------------------------------------------------------------


class EncoderClassifier(nn.Module):
    """``nn.TransformerEncoder`` over embedded tokens, mean-pooled into classes."""

    def __init__(self, batch_first: bool, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(VOCAB, d)
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        if not self.batch_first:
            h = h.transpose(0, 1)
        h = self.encoder(h)
        return self.head(h.mean(1 if self.batch_first else 0))


def _encoder(batch_first: bool) -> Builder:
    def build() -> tuple[nn.Module, Callable]:
        def batch(b: int, g: torch.Generator) -> Batch:
            return (_ids(b, g),), {}

        return EncoderClassifier(batch_first), batch

    return build


# --- HuggingFace transformers ---------------------------------------------------------------------


def _hf_lm(kind: str) -> Builder:
    def build() -> tuple[nn.Module, Callable]:
        import transformers as T

        if kind == "gpt2":
            cfg = T.GPT2Config(
                vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                bos_token_id=0, eos_token_id=0, use_cache=False,
            )
            model = T.GPT2LMHeadModel(cfg)
        else:
            cfg = T.LlamaConfig(
                vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=32,
                bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False,
            )
            model = T.LlamaForCausalLM(cfg)

        def batch(b: int, g: torch.Generator) -> Batch:
            x = _ids(b, g)
            return (), {"input_ids": x, "labels": x}

        return model, batch

    return build


def hf_bert() -> tuple[nn.Module, Callable]:
    import transformers as T

    cfg = T.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=32, num_labels=3, pad_token_id=0,
    )
    model = T.BertForSequenceClassification(cfg)

    def batch(b: int, g: torch.Generator) -> Batch:
        x = _ids(b, g)
        mask = torch.ones_like(x)
        mask[:, -3:] = 0  # padded tails exercise the attention mask
        labels = torch.randint(0, 3, (b,), generator=g)
        return (), {"input_ids": x, "attention_mask": mask, "labels": labels}

    return model, batch


def hf_vit() -> tuple[nn.Module, Callable]:
    import transformers as T

    cfg = T.ViTConfig(
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, num_labels=5,
    )
    model = T.ViTForImageClassification(cfg)

    def batch(b: int, g: torch.Generator) -> Batch:
        pixels = torch.randn(b, 3, 32, 32, generator=g)
        return (), {"pixel_values": pixels, "labels": torch.randint(0, 5, (b,), generator=g)}

    return model, batch


# --- timm (needs an importable torchvision) ------------------------------------------------------


def timm_available() -> bool:
    if importlib.util.find_spec("timm") is None:
        return False
    try:
        import timm  # noqa: F401
    except Exception:  # a registry torchvision beside a CPU torch fails at import
        return False
    return True


def _timm(name: str, size: int, stages: tuple[int, ...] | None = None,
          **kwargs: object) -> Builder:
    """timm's ``name`` for ``size`` x ``size`` images; ``stages``: how many blocks of each stage
    of ``model.blocks`` to keep (the first ones), for the deep CNNs whose repeated blocks are
    the same code at the same widths as the block before them: fewer of them test nothing less
    and cost far less to capture and train."""

    def build() -> tuple[nn.Module, Callable]:
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=7, **kwargs)
        if stages is not None:
            assert len(stages) == len(model.blocks), (name, len(model.blocks))
            model.blocks = nn.Sequential(*[s[:k] for s, k in zip(model.blocks, stages)])

        def batch(b: int, g: torch.Generator) -> Batch:
            return (torch.randn(b, 3, size, size, generator=g),), {}

        return model, batch

    return build


MODELS: dict[str, Builder] = {
    "nanogpt": nanogpt,
    "encoder_batch_first": _encoder(True),
    "encoder_seq_first": _encoder(False),
    "hf_gpt2": _hf_lm("gpt2"),
    "hf_llama": _hf_lm("llama"),
    "hf_bert": hf_bert,
    "hf_vit": hf_vit,
}
TIMM_MODELS: dict[str, Builder] = {
    "timm_resnet18": _timm("resnet18", 32),
    # stages of 2, 2, 6, 2 blocks (all alike in a stage, the downsampling outside them): kept,
    # one block a stage and a block after a block
    "timm_convnext_atto": _timm("convnext_atto", 32, depths=(1, 1, 2, 1)),
    # 2 of its 12 blocks, which are all alike
    "timm_vit_tiny": _timm("vit_tiny_patch16_224", 32, img_size=32, depth=2),
    # stages of 1, 2, 3, 2, 3, 1 blocks: kept, every kind of block (with and without
    # squeeze-excitation, with and without the residual sum, ReLU and hard-swish)
    "timm_mobilenetv3_small": _timm("mobilenetv3_small_100", 32, stages=(1, 2, 2, 1, 1, 1)),
    # stages of 1, 2, 2, 3, 3, 4, 1 blocks: kept, the first block of each (channels and stride
    # change there) and one residual block with squeeze-excitation
    "timm_efficientnet_b0": _timm("efficientnet_b0", 32, stages=(1, 2, 1, 1, 1, 1, 1)),
}


def build(name: str, seed: int = 0) -> tuple[nn.Module, Callable]:
    """Build model ``name`` with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return {**MODELS, **TIMM_MODELS}[name]()


# --- sized variants (size coincidences: sequence == head dim, == width, == heads...) -------------


def sized(name: str, width: int, heads: int, seq: int) -> tuple[nn.Module, Callable]:
    """One-layer model ``name`` of ``width`` with ``heads`` heads, its batches ``seq`` long
    (for ``hf_vit``: ``seq`` patches of 4 pixels per side)."""
    if name == "nanogpt":
        model: nn.Module = NanoGPT(NanoConfig(block_size=max(seq, 16), n_layer=1, n_head=heads,
                                              n_embd=width))

        def with_targets(b: int, g: torch.Generator) -> Batch:
            x = _ids(b, g, seq)
            return (x,), {"targets": x}

        return model, with_targets
    if name in ("encoder_batch_first", "encoder_seq_first"):
        model = EncoderClassifier(name == "encoder_batch_first", width, heads)

        def plain(b: int, g: torch.Generator) -> Batch:
            return (_ids(b, g, seq),), {}

        return model, plain
    import transformers as T

    if name == "hf_vit":
        side = 4 * math.isqrt(seq)
        cfg = T.ViTConfig(image_size=side, patch_size=4, hidden_size=width, num_hidden_layers=1,
                          num_attention_heads=heads, intermediate_size=2 * width,
                          num_labels=5)

        def pixels(b: int, g: torch.Generator) -> Batch:
            x = torch.randn(b, 3, side, side, generator=g)
            return (), {"pixel_values": x, "labels": torch.randint(0, 5, (b,), generator=g)}

        return T.ViTForImageClassification(cfg), pixels
    common = dict(vocab_size=VOCAB, num_hidden_layers=1, num_attention_heads=heads,
                  hidden_size=width, intermediate_size=2 * width)
    if name == "hf_gpt2":
        cfg = T.GPT2Config(vocab_size=VOCAB, n_positions=max(seq, 16), n_embd=width, n_layer=1,
                           n_head=heads, bos_token_id=0, eos_token_id=0,
                           use_cache=False)
        model = T.GPT2LMHeadModel(cfg)
    elif name == "hf_llama":
        cfg = T.LlamaConfig(**common, num_key_value_heads=heads // 2,
                            max_position_embeddings=max(seq, 16), bos_token_id=0,
                            eos_token_id=0, pad_token_id=0, use_cache=False)
        model = T.LlamaForCausalLM(cfg)
    elif name == "hf_bert":
        cfg = T.BertConfig(**common, max_position_embeddings=max(seq, 16), num_labels=3,
                           pad_token_id=0)

        def masked(b: int, g: torch.Generator) -> Batch:
            x = _ids(b, g, seq)
            mask = torch.ones_like(x)
            mask[:, -1:] = 0
            labels = torch.randint(0, 3, (b,), generator=g)
            return (), {"input_ids": x, "attention_mask": mask, "labels": labels}

        return T.BertForSequenceClassification(cfg), masked
    else:
        raise KeyError(name)

    def lm(b: int, g: torch.Generator) -> Batch:
        x = _ids(b, g, seq)
        return (), {"input_ids": x, "labels": x}

    return model, lm

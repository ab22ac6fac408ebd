"""Does the best learning rate transfer when the head dim is cut and the rotary table rebuilt?

A character LM of the charlm data (``examples/charlm``) written as Qwen2/Llama write attention:
grouped-query attention with 14 query and 2 key/value heads of dim 16 (width 224), rotary
positions from a registered ``inv_freq`` buffer, RMSNorm, a SwiGLU-free GELU MLP, 2 blocks. The
AdamW learning rate is swept on a log grid for the full model and for Hydro surrogates:

* ``r2 heads``: ratio 2, head dim kept (7 query heads, 1 key/value head, the same rotary table);
* ``r2 dim``: ratio 2, head count kept (``head_policy="keep_head_count"``): head dim 8, the
  rotary table rebuilt for it with the same base;
* ``r4 dim``: ratio 4, the head count 14 cannot shrink by 4: head dim 4, table rebuilt.

Each grid trains as one fused model (:func:`benchmarks.transfer.fused_grid`, the same numbers as
training each point alone). It prints the median validation loss per rate and model, each
model's best rate and its shift from the full model's, and the Spearman correlation over the
grid. Not a test; on a busy 2-core CPU, one thread, ``nice``, 2 seeds of 120 steps took 16
minutes (docs/explanation/transfer.md, "Rotary attention")::

    nice python benchmarks/transfer_rotary.py --seeds 2 --steps 120 --warmup 12
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hydro
from benchmarks.transfer import fused_grid
from examples.charlm.data import VOCAB_SIZE, load
from hydro.errors import HydroWarning
from hydro.tuning.verification import spearman


class RotaryAttention(nn.Module):
    """Grouped-query causal attention with rotary positions (``inv_freq`` a buffer)."""

    def __init__(self, width: int, heads: int, kv_heads: int, base: float = 10000.0) -> None:
        super().__init__()
        self.h, self.kv, self.d = heads, kv_heads, width // heads
        self.q = nn.Linear(width, heads * self.d, bias=True)
        self.k = nn.Linear(width, kv_heads * self.d, bias=True)
        self.v = nn.Linear(width, kv_heads * self.d, bias=True)
        self.o = nn.Linear(heads * self.d, width, bias=False)
        inv_freq = 1.0 / base ** (torch.arange(0, self.d, 2).float() / self.d)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.h, self.d).transpose(1, 2)
        k = self.k(x).view(B, T, self.kv, self.d).transpose(1, 2)
        v = self.v(x).view(B, T, self.kv, self.d).transpose(1, 2)
        angles = torch.arange(T, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        q, k = self.rotate(q, emb.cos(), emb.sin()), self.rotate(k, emb.cos(), emb.sin())
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(width), nn.RMSNorm(width)
        self.attn = RotaryAttention(width, heads, kv_heads)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class RotaryLM(nn.Module):
    def __init__(self, width: int = 224, heads: int = 14, kv_heads: int = 2, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB_SIZE, width)
        self.blocks = nn.ModuleList(Block(width, heads, kv_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, VOCAB_SIZE, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# name: (ratio, head policy)
MODELS = {"full": (1, "keep_head_dim"), "r2 heads": (2, "keep_head_dim"),
          "r2 dim": (2, "keep_head_count"), "r4 dim": (4, "keep_head_count")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--lr-exp", type=int, nargs=2, default=[-12, -5], help="log2 lr range")
    p.add_argument("--val-windows", type=int, default=256)
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=HydroWarning)  # ratio 4 is below the floor
    lrs = [2.0**e for e in range(args.lr_exp[0], args.lr_exp[1] + 1)]
    data = load(block_size=args.block_size)
    vx, vy = data["val"]
    every = max(1, len(vx) // args.val_windows)
    data["val"] = (vx[::every][: args.val_windows], vy[::every][: args.val_windows])
    runs: dict[str, list[list[float]]] = {name: [] for name in MODELS}
    start = time.time()
    for seed in range(args.seeds):
        g = torch.Generator().manual_seed(seed)
        batches = torch.randint(len(data["train"][0]), (args.steps, args.batch_size), generator=g)
        torch.manual_seed(seed)
        target = RotaryLM()
        example = (data["train"][0][:2],)
        for name, (ratio, policy) in MODELS.items():
            sur = hydro.scale(target, ratio, example_inputs=example, head_policy=policy, seed=seed)
            if seed == 0:
                table = sur.get_buffer("blocks.0.attn.inv_freq")
                q = tuple(sur.get_parameter("blocks.0.attn.q.weight").shape)
                print(f"{name:>8}: q {q}, inv_freq {table.numel()} entries", flush=True)
            trials = [{"lr": lr, "weight_decay": 0.0, "warmup": args.warmup} for lr in lrs]
            runs[name].append(fused_grid(sur, trials, data, batches, args))
            best = lrs[int(np.nanargmin(runs[name][-1]))]
            print(f"seed {seed} {name:>8} done at {time.time() - start:5.0f} s: best lr "
                  f"2^{int(math.log2(best))}, losses {np.round(runs[name][-1], 3).tolist()}",
                  flush=True)
    med = {n: np.nanmedian(np.array(v, dtype=float), axis=0) for n, v in runs.items()}
    print(f"\nValidation loss after {args.steps} steps, median of {args.seeds} seeds; * = best")
    print("lr     | " + " ".join(f"{n:>9}" for n in MODELS))
    for i, lr in enumerate(lrs):
        cells = [f"{med[n][i]:8.3f}{'*' if med[n][i] == np.nanmin(med[n]) else ' '}"
                 for n in MODELS]
        print(f"2^{int(math.log2(lr)):<4} | " + " ".join(cells))
    full = int(np.nanargmin(med["full"]))
    for name in MODELS:
        best = int(np.nanargmin(med[name]))
        per_seed = [f"2^{int(math.log2(lrs[int(np.nanargmin(r))]))}" for r in runs[name]]
        print(f"{name:>8}: best 2^{int(math.log2(lrs[best]))} ({best - full:+d} steps vs full; "
              f"per seed {', '.join(per_seed)}), Spearman vs full "
              f"{spearman(med[name], med['full']):+.3f}")
    print(f"elapsed {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

"""ALiBi slopes built in Python from the head count (BLOOM's ``build_alibi_tensor``) are
per-head constants: the head count is kept whole and the head dim is cut, so the surrogate's
slopes are the target's, value for value (a cut ``arange`` would keep only the first ones)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx
from torch import nn

import hydro
import hydro.optim

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::hydro.errors.HydroWarning")]


def build_alibi_tensor(mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """BLOOM's slopes ``2 ** (-8 i / H)`` times the positions, ``[B * H, 1, T]``."""
    batch, seq = mask.shape
    closest = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    powers = torch.arange(1, 1 + closest, dtype=torch.int32)
    slopes = torch.pow(base, powers)
    positions = ((mask.cumsum(dim=-1) - 1) * mask)[:, None, :]
    return (slopes[..., None] * positions).reshape(batch * num_heads, 1, seq).to(dtype)


class AlibiLM(nn.Module):
    def __init__(self, d: int = 64, heads: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(50, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.emb(ids)
        alibi = build_alibi_tensor(torch.ones_like(ids), self.heads, x.dtype)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.qkv(x).split(x.shape[-1], -1))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + alibi.view(b, -1, 1, t)
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
        return self.head(x + self.proj(y))


def _slopes(model: torch.nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
    """The value of the graph's ``pow`` node (the slopes) when the captured model runs."""
    gm = model.graphs["eval"]
    seen = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op == "call_function" and "pow" in str(n.target):
                seen["pow"] = out
            return out

    model.eval()
    Recorder(model, graph=gm.graph).run(*inputs)  # (get_attr reads the model's tensors)
    return seen["pow"]


@pytest.mark.parametrize("ratio", [8, 4, 2])
def test_alibi_keeps_its_heads_and_slopes(ratio):
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 6))
    model = AlibiLM()
    sur = hydro.scale(model, ratio, example_inputs=(ids,), seed=0)
    one = hydro.scale(model, 1, example_inputs=(ids,), seed=0)
    assert sur.get_parameter("qkv.weight").shape == (3 * 64 // ratio, 64 // ratio)
    assert torch.equal(_slopes(sur, ids), _slopes(one, ids))
    assert _slopes(sur, ids).shape == (8,)
    assert sur(ids).shape == (2, 6, 50)


def _bloom(seed: int) -> torch.nn.Module:
    """HuggingFace's BLOOM as published (random init, nothing downloaded): its ALiBi slopes are
    built in Python from the head count and repeated over the batch (``slopes.repeat(B, 1,
    1)``), added to the scores by ``baddbmm``."""
    import transformers as T

    torch.manual_seed(seed)
    cfg = T.BloomConfig(vocab_size=50, hidden_size=64, n_layer=2, n_head=8, use_cache=False,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return T.BloomForCausalLM(cfg).double()


@pytest.mark.parametrize("ratio", [2, 4])
def test_hf_bloom_keeps_its_heads_and_trains_fused_exactly(ratio):
    from hydro.parametrize import param_groups
    from tests.fusion.exactness import clone
    from tests.fusion.real import no_dropout
    from tests.fusion.test_real_models import LRS, batches, check

    ids = torch.randint(1, 50, (3, 10), generator=torch.Generator().manual_seed(0))
    kwargs = {"input_ids": ids, "labels": ids}
    target = no_dropout(_bloom(0))
    sur = hydro.scale(target, ratio, example_kwargs=kwargs, seed=0)
    one = hydro.scale(target, 1, example_kwargs=kwargs, seed=0)
    qkv = "transformer.h.0.self_attention.query_key_value.weight"
    assert sur.get_parameter(qkv).shape == (3 * 64 // ratio, 64 // ratio)
    inputs = [kwargs[n.target] for n in sur.graphs["eval"].graph.nodes if n.op == "placeholder"]
    slopes = _slopes(sur, *inputs)
    assert slopes.shape == (8,) and torch.equal(slopes, _slopes(one, *inputs))
    members = [hydro.scale(target, ratio, example_kwargs=kwargs, seed=k).train()
               for k in range(3)]
    fused = hydro.fuse([clone(m) for m in members])  # clone keeps muP's infshape
    separate = members  # the originals keep their muP shapes for param_groups

    def make(b: int, g: torch.Generator) -> tuple:
        x = torch.randint(1, 50, (b, 10), generator=g)
        return (), {"input_ids": x, "labels": x}

    # muP surrogates: each separate run with muP's learning rates, as the fused optimizer has them
    opts = [torch.optim.AdamW(param_groups(m, lr=lr, weight_decay=0.01))
            for m, lr in zip(separate, LRS)]
    fused_opt = hydro.optim.AdamW(fused.parameters(), lr=LRS, weight_decay=0.01)
    check(f"bloom ratio {ratio}", fused, separate, opts, fused_opt, batches("bloom", make))

"""Rotary embeddings under grouped-query attention whose head counts the ratio does not divide
(14 query / 2 key-value heads): the head dim is cut and the rotary table rebuilt for it, with
the same base and formula, recognized from the buffer's values."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hydro
from hydro import cli
from hydro.errors import HydroWarning
from hydro.fx.rules.rotary import rotary_base, table
from tests.fusion.exactness import build, train_and_compare
from tests.zoo import ZOO, Case


class Rotary(nn.Module):
    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(torch.arange(t, dtype=self.inv_freq.dtype), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GQALM(nn.Module):
    """A Qwen2/Llama-style layer: 14 query heads, 2 key/value heads, rotary positions."""

    def __init__(self, width: int = 224, heads: int = 14, kv: int = 2, base: float = 5e5):
        super().__init__()
        self.h, self.kv, self.d = heads, kv, width // heads
        self.emb = nn.Embedding(50, width)
        self.q = nn.Linear(width, heads * self.d)
        self.k = nn.Linear(width, kv * self.d)
        self.v = nn.Linear(width, kv * self.d)
        self.o = nn.Linear(heads * self.d, width)
        self.rope = Rotary(self.d, base)
        self.head = nn.Linear(width, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.h, self.d).transpose(1, 2)
        k = self.k(x).view(B, T, self.kv, self.d).transpose(1, 2)
        v = self.v(x).view(B, T, self.kv, self.d).transpose(1, 2)
        cos, sin = self.rope(T)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.head(x + self.o(y.transpose(1, 2).reshape(B, T, -1)))


IDS = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))


def test_rotary_table_is_recognized_by_its_values():
    for d, base in ((64, 10000.0), (32, 500000.0), (128, 1e6), (4, 10000.0)):
        assert rotary_base(Rotary(d, base).inv_freq) == base
        assert torch.equal(table(d, base, torch.float32), Rotary(d, base).inv_freq)
    assert rotary_base(torch.rand(8)) is None
    assert rotary_base(Rotary(16, 10000.0).inv_freq * 0.5) is None  # linear-scaled: not this one
    assert rotary_base(torch.ones(3, 4)) is None
    assert rotary_base(Rotary(32, 10000.0).inv_freq.double()) == 10000.0
    off = Rotary(32, 10000.0).inv_freq.double()
    off[5] *= 1.001  # one entry off the formula
    assert rotary_base(off) is None


def small_gqa() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """For ``hydro inspect tests.fx.rules.test_rotary:small_gqa``."""
    torch.manual_seed(0)
    return GQALM(), (IDS,)


def test_head_dim_cut_rebuilds_the_rotary_table_with_the_same_base(tmp_path, capsys):
    model, _ = small_gqa()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HydroWarning)  # ratio 4 is below the width floor here
        sur = hydro.scale(model, 4, example_inputs=(IDS,), seed=0)
        plan = tmp_path / "plan.json"
        code = cli.main(
            ["inspect", "tests.fx.rules.test_rotary:small_gqa", "--ratio", "4", "--json", str(plan)]
        )
    assert code in (0, None)
    line = "rotary table rebuilt for head dim 4 (base 500000): 'rope.inv_freq', head dim 16 -> 4"
    assert line in capsys.readouterr().out
    assert json.loads(plan.read_text())["rotary"] == [line]
    # 14 heads of 16 -> 14 heads of 4: the table is the one a native head dim 4 model has
    assert sur.get_parameter("q.weight").shape == (56, 56)
    assert torch.equal(sur.get_buffer("rope.inv_freq"), GQALM(width=56).rope.inv_freq)
    assert sur(torch.randint(0, 50, (3, 8))).shape == (3, 8, 50)
    # ratio 1 is the model itself, table and outputs bit for bit
    same = hydro.scale(model, 1, example_inputs=(IDS,), seed=0)
    assert torch.equal(same.get_buffer("rope.inv_freq"), model.rope.inv_freq)
    same.load_state_dict(model.state_dict())
    model.eval(), same.eval()
    assert torch.equal(same(IDS), model(IDS))


def test_a_width_derived_buffer_that_is_not_a_rotary_table_still_refuses():
    model = GQALM()
    model.rope.inv_freq = torch.rand(8)  # derived from the head dim by length, not a table
    with pytest.raises(hydro.ScaleError, match=r"'rope.inv_freq'.*not a rotary table"):
        hydro.scale(model, 4, example_inputs=(IDS,))


def test_auto_ratio_cuts_the_head_dim_instead_of_falling_back():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HydroWarning)  # no fallback warning
        sur = hydro.scale(GQALM(width=896), "auto", example_inputs=(IDS,))
    # ratio 2 (7 heads) was all main could build; now the head dim is cut where heads cannot be
    assert sur.hydro.ratio >= 4
    assert sur.get_buffer("rope.inv_freq").shape == (64 // sur.hydro.ratio // 2,)
    # where even ratio 2 takes a layer below its floor, 'auto' says so, loudly, and why
    with pytest.warns(HydroWarning, match=r"ratio='auto' chose 1 for GQALM.*because ratio 2"):
        hydro.scale(GQALM(width=56), "auto", example_inputs=(IDS,))


def test_qwen2_with_14_query_and_2_kv_heads_scales_at_ratio_8_head_dim_2():
    transformers = pytest.importorskip("transformers")

    def config(hidden: int):
        return transformers.Qwen2Config(
            vocab_size=61, hidden_size=hidden, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32,
            use_cache=False, rope_theta=1e6,
        )

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config(224))
    ids = torch.randint(0, 61, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HydroWarning)
        sur = hydro.scale(model, 8, example_kwargs={"input_ids": ids}, seed=0)
    native = transformers.Qwen2ForCausalLM(config(28))  # Qwen2's own table for head dim 4
    assert torch.equal(
        sur.get_buffer("model.rotary_emb.inv_freq"), native.model.rotary_emb.inv_freq
    )
    assert sur(input_ids=ids).logits.shape == (2, 8, 61)


def rotary_case(width: int = 112, batch: int = 2, seed: int = 0) -> Case:
    g = torch.Generator().manual_seed(seed + 1000)
    torch.manual_seed(seed)
    ids = torch.randint(0, 50, (batch, 6), generator=g)
    target = torch.randint(0, 50, (batch, 6), generator=g)
    return Case(
        GQALM(width), (ids,), target, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())
    )


def test_head_dim_cut_surrogates_fuse_exactly(monkeypatch):
    monkeypatch.setitem(ZOO, "rotary", rotary_case)

    def surrogate(case: Case) -> nn.Module:  # 14 heads of 8 -> 14 heads of 2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", HydroWarning)
            return hydro.scale(case.model, 4, example_inputs=case.inputs)

    run, cases = build("rotary", 3, "adam", make_model=surrogate)
    assert run.models[0].get_buffer("rope.inv_freq").shape == (1,)
    train_and_compare(run, cases, steps=3, shared=True)

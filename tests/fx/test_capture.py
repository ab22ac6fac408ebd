"""Models as their authors publish them: captured by example, scaled, inspected.

Every model of ``tests.real_models.MODELS`` (nanoGPT in its published style, HF GPT-2, LLaMA with
grouped-query attention, BERT, ViT, ``nn.TransformerEncoder`` both ways) is captured once per
dtype; the surrogate at ratio 1 must be the model bit for bit (float64 and float32, train and
eval), and at ratio 8 it must be called like the model and return the same output type.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

import hydro
from hydro.fx.capture import Captured, capture
from tests.real_models import (
    MODELS,
    TIMM_MODELS,
    NanoConfig,
    NanoGPT,
    build,
    sized,
    timm_available,
)
from tests.test_scaling_modules import assert_hooks_as_model

# parameter cut at ratio 8 measured on these configs (target / surrogate parameters), rounded down
MIN_CUT = {"nanogpt": 40, "encoder_batch_first": 40, "encoder_seq_first": 40, "hf_gpt2": 30,
           "hf_llama": 20, "hf_bert": 30, "hf_vit": 20}


def _batch(batch, n, dtype, seed=0):
    args, kwargs = batch(n, torch.Generator().manual_seed(seed))
    cast = lambda t: t.to(dtype) if torch.is_floating_point(t) else t
    return tree_map(cast, args), tree_map(cast, kwargs)


def _same(a, b) -> bool:
    la, lb = tree_leaves(a), tree_leaves(b)
    return (
        type(a) is type(b)
        and len(la) == len(lb)
        and all(
            torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb)
        )
    )


def _n(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("name", list(MODELS))
def test_real_model_scales_exactly_and_keeps_its_calling_convention(name):
    for dtype in (torch.float64, torch.float32):
        model, batch = build(name)
        model.to(dtype)
        args, kwargs = _batch(batch, 2, dtype)
        cap = capture(model, args, kwargs)
        args5, kwargs5 = _batch(batch, 5, dtype, seed=1)  # another batch size
        one = hydro.scale(cap, 1, example_inputs=args, example_kwargs=kwargs, seed=0)
        assert set(one.state_dict()) == set(model.state_dict())
        one.load_state_dict(model.state_dict())
        for mode in (True, False):  # dropout draws the same numbers from the same seed
            model.train(mode)
            one.train(mode)
            torch.manual_seed(0)
            want = model(*args5, **kwargs5)
            torch.manual_seed(0)
            assert _same(one(*args5, **kwargs5), want), (name, dtype, mode)
        if dtype is not torch.float64:
            continue
        assert_hooks_as_model(model, one, args5, kwargs5, exact=True)  # a module tree again
        sur = hydro.scale(cap, 8, example_inputs=args, example_kwargs=kwargs, seed=0)
        assert isinstance(sur, Captured) and set(sur.state_dict()) == set(model.state_dict())
        out, want = sur(*args5, **kwargs5), model(*args5, **kwargs5)
        assert type(out) is type(want)
        if "labels" in kwargs5:  # HF: a ModelOutput with the loss the model computes itself
            assert out.loss is not None and out.loss.dim() == 0 and torch.isfinite(out.loss)
            assert out.logits.shape == want.logits.shape
            out.loss.backward()
        elif name == "nanogpt":  # (logits, loss) with targets
            assert out[0].shape == want[0].shape and torch.isfinite(out[1])
            out[1].backward()
        else:
            assert out.shape == want.shape
            out.sum().backward()
        assert all(p.grad is not None for p in sur.parameters() if p.requires_grad)
        assert _n(model) / _n(sur) > MIN_CUT[name], _n(model) / _n(sur)
        assert_hooks_as_model(model, sur, args5, kwargs5, exact=False)
        report = hydro.inspect(cap, 8, example_inputs=args, example_kwargs=kwargs)
        assert report.totals["target_params"] == _n(model)
        assert report.totals["surrogate_params"] == _n(sur)
        assert report.totals["target_flops"] > 8 * report.totals["surrogate_flops"]
        assert "fewer FLOPs" in str(report)


def test_nanogpt_with_and_without_targets():
    torch.manual_seed(0)
    model = NanoGPT(NanoConfig())
    idx = torch.randint(0, 61, (2, 12))
    sur = hydro.scale(model, 8, example_inputs=(idx,), seed=0)  # inference: last position only
    logits, loss = sur(torch.randint(0, 61, (3, 12)))
    assert logits.shape == (3, 1, 61) and loss is None
    sur_t = hydro.scale(model, 8, example_inputs=(idx,), example_kwargs={"targets": idx}, seed=0)
    logits, loss = sur_t(idx, targets=idx)
    assert logits.shape == (2, 12, 61) and loss.dim() == 0
    # wpe is indexed by positions (arange of the sequence length): its rows stay
    assert sur_t.get_parameter("transformer.wpe.weight").shape == (16, 8)


class LearnedPositions(nn.Module):
    """A learned position table sliced by the sequence length, as ViT-like code does."""

    def __init__(self, width: int = 64, max_len: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.pos = nn.Parameter(torch.randn(max_len, width) * 0.02)
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        h = self.inp(x) + self.pos[: x.size(1)]
        return self.out(F.gelu(h))


def test_position_table_sliced_by_sequence_length_keeps_its_rows():
    x = torch.randn(2, 10, 4)
    for ratio in (1, 2, 8):
        sur = hydro.scale(LearnedPositions(), ratio, example_inputs=(x,))
        assert sur.get_parameter("pos").shape == (16, 64 // ratio)
        assert sur(torch.randn(3, 10, 4)).shape == (3, 10, 3)
    report = hydro.inspect(LearnedPositions(), 8, example_inputs=(x,))
    assert report.kept == [("pos", 0, 16)]
    assert (
        "fixed: 'pos' dimension 0 (16) is indexed or sliced by a fixed size (vocabulary, positions)"
        in str(report)
    )


def test_rotary_frequencies_are_rebuilt_not_cut():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=61, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 61, (2, 8))
    # ratio 2 keeps the head dim (2 query heads, 1 key/value head): fine
    sur = hydro.scale(model, 2, example_kwargs={"input_ids": ids}, seed=0)
    assert sur.get_buffer("model.rotary_emb.inv_freq").shape == (8,)
    assert sur(input_ids=ids).logits.shape == (2, 8, 61)
    # ratio 8 needs heads of 2: the rotary table is rebuilt for head dim 2 (test_rotary.py)
    sur = hydro.scale(model, 8, example_kwargs={"input_ids": ids})
    assert sur.get_buffer("model.rotary_emb.inv_freq").tolist() == [1.0]


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x):
        if x.sum().item() > 0:
            return self.fc(x)
        return -self.fc(x)


def test_untraceable_code_names_module_file_and_line():
    model = nn.Sequential(nn.Linear(4, 4), Branchy())
    with pytest.raises(hydro.TraceError) as err:
        capture(model, (torch.randn(2, 4),))
    msg = str(err.value)
    assert "module '1' (Branchy)" in msg and "test_capture.py:" in msg
    assert "x.sum().item() > 0" in msg and "data-dependent" in msg
    with pytest.raises(hydro.TraceError, match="needs example inputs"):
        capture(model)
    with pytest.raises(hydro.TraceError, match="runs on them as given"):
        capture(nn.Linear(4, 2), (torch.randn(2, 5),))  # wrong feature size


def test_inputs_passed_twice_stay_two_inputs():
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 8)

        def forward(self, input_ids, labels):
            return F.cross_entropy(self.emb(input_ids).flatten(0, 1), labels.flatten())

    ids = torch.randint(0, 8, (2, 5))
    cap = capture(LM(), (), {"input_ids": ids, "labels": ids})  # the same tensor twice
    other = torch.randint(0, 8, (2, 5))
    assert torch.equal(cap(input_ids=ids, labels=other), cap.__class__.forward(cap, ids, other))
    assert not torch.equal(cap(input_ids=ids, labels=other), cap(input_ids=ids, labels=ids))


def test_captured_keeps_non_persistent_buffers_out_of_the_state_dict():
    transformers = pytest.importorskip("transformers")
    model, batch = build("hf_bert")
    args, kwargs = batch(2, torch.Generator().manual_seed(0))
    cap = capture(model, args, kwargs)
    assert set(cap.state_dict()) == set(model.state_dict())
    assert "bert.embeddings.position_ids" in dict(cap.named_buffers())
    del transformers


@pytest.mark.skipif(not timm_available(), reason="timm needs a torchvision that imports")
@pytest.mark.parametrize("name", list(TIMM_MODELS))
def test_timm_model_scales(name: str) -> None:
    model, make = build(name)
    model = model.double()
    args, _ = make(4, torch.Generator().manual_seed(0))
    args = tuple(a.double() for a in args)
    same = hydro.scale(model, ratio=1, example_inputs=args)
    same.load_state_dict(model.state_dict())
    same.eval(), model.eval()
    assert torch.equal(same(*args), model(*args))
    assert_hooks_as_model(model, same, args, {}, exact=True)
    ratio = 8
    if name == "timm_efficientnet_b0":  # a squeeze-excitation width of 4
        with pytest.raises(hydro.ScaleError, match="not divisible by ratio 8.*Nearest ratios"):
            hydro.scale(model, ratio=8, example_inputs=args)
        ratio = 2
    sur = hydro.scale(model, ratio=ratio, example_inputs=args)
    full = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in sur.parameters()) < full / ratio
    assert sur(*args).shape == model(*args).shape
    assert_hooks_as_model(model, sur, args, {}, exact=False)


# (model, width, heads, sequence, batch) where a sequence or batch size equals a width, a head
# dim or a head count; each against the same model at sizes that coincide with nothing
COINCIDENCES = [
    ("hf_gpt2", 256, 4, 64, 2),  # seq == head dim (4 heads kept, head dim 64 -> 8)
    ("hf_gpt2", 64, 4, 64, 2),  # seq == width
    ("hf_bert", 64, 4, 16, 2),  # seq == head dim, with a padding mask
    ("hf_llama", 128, 16, 8, 16),  # seq == head dim, batch == head count
    ("nanogpt", 64, 4, 16, 64),  # seq == head dim, batch == width
    ("encoder_seq_first", 64, 4, 4, 16),  # seq == head count, batch == head dim ([T, B, C])
    ("encoder_batch_first", 64, 4, 64, 4),  # seq == width, batch == head count
    ("hf_vit", 64, 4, 64, 2),  # image patches == width
]


@pytest.mark.parametrize(("name", "width", "heads", "seq", "batch"), COINCIDENCES)
def test_sizes_that_coincide_with_widths_are_not_widths(name, width, heads, seq, batch):
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    shapes = {}
    for s, b in ((seq, batch), (9 if name != "hf_vit" else 36, 3)):  # 36 patches: nothing equal
        torch.manual_seed(0)
        model, make = sized(name, width, heads, s)
        args, kwargs = make(b, torch.Generator().manual_seed(0))
        sur = hydro.scale(model, 8, example_inputs=args, example_kwargs=kwargs, seed=0)
        shapes[s] = {k: tuple(v.shape) for k, v in sur.state_dict().items()}
        full = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if s == seq:
            rows = {k: v[:-1] for k, v in full.items()}
        out = sur(*args, **kwargs)
        loss = out.loss if hasattr(out, "loss") else out[1] if isinstance(out, tuple) else out.sum()
        assert torch.isfinite(loss)
    coincident, plain = shapes.values()
    for key, shape in plain.items():
        if "position" in key or "wpe" in key:  # tables sized by the sequence keep their rows
            assert coincident[key] == (*rows[key], shape[-1]), key
        else:
            assert coincident[key] == shape, key
    assert any(shape != full[k] for k, shape in plain.items())


@pytest.mark.parametrize("ratio", [1, 8])
def test_manual_attention_scale_follows_mup_like_sdpa(ratio):
    """nanoGPT's manual path ``q @ k^T * (1 / sqrt(d))`` and its SDPA path give one surrogate
    function: the literal scale is rewritten to muP's ``1/d`` relative to the target, exactly as
    SDPA's ``scale=`` is (4 heads at ratio 8: the head dim shrinks 16 -> 2)."""
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    surs, models = [], []
    for flash in (True, False):
        torch.manual_seed(0)
        model = NanoGPT(NanoConfig(n_layer=1, flash=flash)).double()
        scaled = capture(model, (idx,), {"targets": idx})
        sur = hydro.scale(scaled, ratio, example_inputs=(idx,), example_kwargs={"targets": idx},
                          seed=0)
        surs.append(sur.eval())
        models.append(model.eval())
    sdpa, manual = surs
    manual.load_state_dict(sdpa.state_dict(), strict=False)  # the manual path adds its mask
    logits, loss = manual(idx, targets=idx)
    want_logits, want_loss = sdpa(idx, targets=idx)
    torch.testing.assert_close(logits, want_logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
    report = str(hydro.inspect(models[1], ratio, example_inputs=(idx,),
                               example_kwargs={"targets": idx}))
    if ratio == 1:  # the target itself, bit for bit
        manual.load_state_dict(models[1].state_dict())
        assert torch.equal(manual(idx, targets=idx)[0], models[1](idx, targets=idx)[0])
        assert "attention scale" not in report
    else:
        assert "attention scale x 0.25 -> x 2 (muP 1/d for head dim 16 -> 2)" in report


def test_sequence_length_is_fixed_at_capture_and_says_so():
    pytest.importorskip("transformers")
    model, make = build("hf_gpt2")
    args, kwargs = make(2, torch.Generator().manual_seed(0))  # sequence length 12
    sur = hydro.scale(model, 8, example_inputs=args, example_kwargs=kwargs, seed=0)
    ids = torch.randint(0, 61, (5, 12))
    assert sur(input_ids=ids, labels=ids).logits.shape == (5, 12, 61)  # any batch size
    short = ids[:, :8]
    with pytest.raises(hydro.TraceError) as err:
        sur(input_ids=short, labels=short)
    msg = str(err.value)
    assert "captured with input 'input_ids' of shape (B, 12); called with (5, 8)" in msg
    assert "Only the batch dimension is dynamic" in msg and "Capture again" in msg
    one = capture(nn.Linear(4, 2), (torch.randn(1, 4),))  # export fixes a batch of 1
    with pytest.raises(hydro.TraceError, match="batch of 1.*example batch of 2 or more"):
        one(torch.randn(3, 4))

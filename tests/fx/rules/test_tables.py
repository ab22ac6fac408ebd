"""Tables read by index, mask factories, widths kept whole by an output or an index.

The models of ``tests.table_models`` are written the way real ones are (Swin's relative-position
bias, a decoder reading a position table by ids, a Mistral-style sliding-window mask, an
encoder-decoder returning its encoder state, a score read from one channel); the HF ones are
built tiny from configs. Each is scaled and run; the surrogates of the mask models are fused
and compared with separate surrogates in float64.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import hydro
from hydro import scaling
from hydro.errors import HydroWarning
from hydro.fusion import fuse
from hydro.fx import floor
from tests.table_models import (
    VOCAB,
    ChannelAt,
    EncoderDecoder,
    EncoderFeatures,
    LastChannel,
    PositionDecoder,
    SlidingWindowLM,
    SwinTiny,
)


def _n(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _build(model, ratio, args=(), kwargs=None, seed=0):
    """``hydro.scale`` (with its width plan) and the warnings about widths kept whole it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaled = scaling.build(model, ratio, example_inputs=args, example_kwargs=kwargs, seed=seed)
    pinned = [str(w.message) for w in caught if "whole, so the surrogate" in str(w.message)]
    return scaled, pinned


def _scale(model, ratio, args=(), kwargs=None, seed=0):
    scaled, pinned = _build(model, ratio, args, kwargs, seed)
    return scaled.surrogate, pinned


def _ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("ratio", [8, 2])
def test_relative_position_table_keeps_its_rows_and_follows_the_heads(ratio):
    torch.manual_seed(0)
    model = SwinTiny()
    x, labels = torch.randn(2, 16, 3), torch.tensor([1, 3])
    scaled, pinned = _build(model, ratio, (x, labels))
    sur = scaled.surrogate
    # 49 = (2 * 4 - 1)^2 relative positions: rows read by index, never a width; its columns
    # follow the head count (4 heads of 16: ratio 8 keeps the 4 heads, ratio 2 drops 2)
    heads = 4 if ratio == 8 else 4 // ratio
    assert sur.get_parameter("attn.table").shape == (49, heads)
    assert sur.get_parameter("attn.qkv.weight").shape == (3 * 64 // ratio, 64 // ratio)
    assert torch.equal(sur.get_buffer("attn.index"), model.attn.index)
    loss, logits = sur(torch.randn(3, 16, 3), torch.tensor([0, 1, 4]))
    assert logits.shape == (3, 5) and torch.isfinite(loss) and not pinned
    assert ("attn.table", 0, 49) in scaled.plan.kept
    # a table is no layer of its own: it never bounds ratio="auto" (its heads would, at 4)
    assert "attn.table" not in {lw.path for lw in floor.layer_widths(scaled.plan)}


def test_timm_swin_scales_with_its_bias_tables():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=28,
                              embed_dim=32, depths=(1,), num_heads=(2,), window_size=7,
                              num_classes=5)
    x = torch.randn(2, 3, 28, 28)
    sur, pinned = _scale(model, 8, (x,))
    table = "layers.0.blocks.0.attn.relative_position_bias_table"
    assert sur.get_parameter(table).shape == (169, 2)  # (2 * 7 - 1)^2 rows, heads kept
    assert sur.get_parameter("layers.0.blocks.0.attn.qkv.weight").shape == (12, 4)
    assert sur(torch.randn(3, 3, 28, 28)).shape == (3, 5) and not pinned
    assert _n(model) / _n(sur) > 15  # the two 169 x 2 tables stay whole


def test_position_table_read_by_position_ids_keeps_its_rows():
    torch.manual_seed(0)
    model = PositionDecoder()
    pos = torch.arange(20, 28).expand(2, 8)  # positions past the 4 rows a cut table would keep
    sur, pinned = _scale(model, 8, (_ids(2, 8), pos, _ids(2, 8, seed=1)))
    assert sur.get_parameter("pos").shape == (32, 8)
    loss, logits = sur(_ids(3, 8, seed=2), torch.arange(24, 32).expand(3, 8), _ids(3, 8))
    assert logits.shape == (3, 8, VOCAB) and torch.isfinite(loss) and not pinned


def test_scale_checks_index_ranges_not_only_shapes():
    torch.manual_seed(0)
    args = (_ids(2, 8), torch.arange(20, 28).expand(2, 8), _ids(2, 8, seed=1))
    scaled = scaling.build(PositionDecoder(), 8, example_inputs=args)
    sur = scaled.surrogate
    # a table cut to 4 rows still propagates on fake tensors: only the index check sees it
    sur.pos = torch.nn.Parameter(sur.pos.detach()[:4].clone())
    with pytest.raises(hydro.ScaleError, match=r"node 'index'.*shrank from 32 to 4"):
        scaling._check(sur, scaled.plan, scaled.node_map, scaled.inputs, scaled.kwargs)


def _trials(sur: torch.nn.Module, n: int) -> list[torch.nn.Module]:
    """``sur`` and ``n - 1`` copies with other weights (one scale: capture is the cost)."""
    out = [sur]
    for k in range(1, n):
        other = copy.deepcopy(sur)
        with torch.no_grad():
            g = torch.Generator().manual_seed(k)
            for p in other.parameters():
                p.mul_(1 + 0.5 * torch.rand(p.shape, generator=g, dtype=p.dtype))
        out.append(other)
    return out


def _fused_vs_separate(model, args, ratio=4, n=2):
    surs = _trials(_scale(model.double(), ratio, args)[0], n)
    fused = fuse(surs)
    loss, logits = fused(*args)
    loss.sum().backward()
    fp = dict(fused.named_parameters())
    for k, sur in enumerate(surs):
        own_loss, own_logits = sur(*args)
        own_loss.backward()
        assert loss[k].item() == pytest.approx(own_loss.item(), rel=1e-12, abs=0)
        assert torch.allclose(logits[k], own_logits, rtol=1e-12, atol=1e-14)
        for name, p in sur.named_parameters():
            assert torch.allclose(fp[name].grad[k], p.grad, rtol=1e-10, atol=1e-13), name
    return fused, surs


@pytest.mark.parametrize("window", [3, None])
def test_sliding_window_mask_fuses_exactly(window):
    torch.manual_seed(0)
    args = (_ids(2, 8), _ids(2, 8, seed=1))
    fused, surs = _fused_vs_separate(SlidingWindowLM(window=window), args)
    # another sequence length: the fused model says what the surrogate says
    short = (_ids(2, 6), _ids(2, 6, seed=1))
    with pytest.raises(hydro.TraceError) as own:
        surs[0](*short)
    with pytest.raises(hydro.TraceError) as fused_error:
        fused(*short)
    assert str(fused_error.value) == str(own.value)
    assert "input 'ids' of shape (B, 8); called with (2, 6)" in str(own.value)


def test_hf_sliding_window_attention_fuses_exactly():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False, sliding_window=3,
    )
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg).double()
    ids = _ids(2, 8)
    kwargs = {"input_ids": ids, "labels": ids}
    surs = _trials(_scale(model, 2, (), kwargs)[0], 2)
    out = fuse(surs)(**kwargs)
    for k, sur in enumerate(surs):
        own = sur(**kwargs)
        assert torch.allclose(out.logits[k], own.logits, rtol=1e-12, atol=1e-14)
        assert out.loss[k].item() == pytest.approx(own.loss.item(), rel=1e-6)  # HF: float32 loss


def test_encoder_state_beside_the_loss_is_cut_and_without_a_loss_warns():
    torch.manual_seed(0)
    args = (_ids(2, 8), _ids(2, 8, seed=1))
    model = EncoderDecoder()
    sur, pinned = _scale(model, 8, args)
    loss, logits, enc = sur(*args)
    assert enc.shape == (2, 8, 8) and logits.shape == (2, 8, VOCAB) and not pinned
    assert _n(model) / _n(sur) > 30  # was 5.7: the encoder width was kept whole
    # the same model returning no loss: its outputs are read outside, at full size, and
    # scale says which hidden width that keeps
    with pytest.warns(HydroWarning) as caught:  # inspect builds it as scale does
        report = hydro.inspect(EncoderFeatures(), 8, example_inputs=args)
    pinned = [str(w.message) for w in caught if "whole, so the surrogate" in str(w.message)]
    assert len(pinned) == 1
    assert "'tok.weight' (dimension 1) (64): returned by the model (output 1)" in pinned[0]
    assert [p[:2] for p in report.pinned] == [("'tok.weight' (dimension 1)", 64)]
    assert {r.path: r.surrogate_shape for r in report.rows}["enc.2"] == (64, 16)
    assert "kept whole: 'tok.weight' (dimension 1) (64), a hidden width" in str(report)


def test_hf_bart_encoder_state_beside_the_loss_is_cut():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=32, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(cfg)
    kwargs = {"input_ids": _ids(2, 8), "labels": _ids(2, 8, seed=1)}
    sur, pinned = _scale(model, 8, (), kwargs)
    out = sur(**kwargs)
    assert out.encoder_last_hidden_state.shape == (2, 8, 8) and out.logits.shape[-1] == VOCAB
    # was 3.5x: every width stayed whole for the returned encoder state; the learned position
    # tables (34 rows, read by position) stay whole
    assert _n(model) / _n(sur) > 30 and not pinned


def test_an_integer_index_into_a_width_pins_only_where_it_falls_outside():
    torch.manual_seed(0)
    x, y = torch.randn(2, 8, 4), torch.randn(2, 8)
    for model in (LastChannel(), ChannelAt(index=3)):  # h[:, :, -1], h[:, :, 3]: still inside
        sur, pinned = _scale(model, 8, (x, y))
        assert sur.get_parameter("mlp.weight").shape == (8, 8) and not pinned
        assert sur(x, y)[1].shape == (2, 8)
    sur, pinned = _scale(ChannelAt(index=40), 8, (x, y))
    assert sur.get_parameter("mlp.weight").shape == (64, 8)
    assert len(pinned) == 1
    assert "'mlp.weight' (dimension 0) (64)" in pinned[0] and "picks index 40" in pinned[0]
    assert "h[:, :, self.index]" in pinned[0]

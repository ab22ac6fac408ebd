"""Randomness drawn outside torch while a model is captured: NumPy's is frozen into the graph
(a warning naming the line), Python's ``random`` deciding a branch (layerdrop) stops capture with
what to set; wav2vec2's own SpecAugment and layerdrop say the same."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import hydro
from hydro import cli
from hydro.errors import HydroWarning
from hydro.fx.capture import capture


class SpecAugmentNet(nn.Module):
    """Frames masked by a NumPy draw in training, as SpecAugment implementations do."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(4, 32), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.training:
            masked = torch.from_numpy(np.random.rand(x.shape[1]) < 0.5)  # the frozen line
            h = h.masked_fill(masked[None, :, None], 0.0)
        return self.out(h)


class LayerDropNet(nn.Module):
    def __init__(self, layerdrop: float = 0.3) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(4, 32), nn.Linear(32, 3)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.layerdrop = layerdrop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            if self.training and random.random() < self.layerdrop:
                continue
            h = h + layer(h)
        return self.out(h)


def test_numpy_draw_in_forward_warns_naming_the_line_and_the_mask_is_frozen():
    model = SpecAugmentNet()
    x = torch.randn(2, 40, 4)
    np.random.seed(0)
    with pytest.warns(HydroWarning) as record:
        cap = capture(model, (x,))
    text = " ".join(str(w.message) for w in record if "NumPy" in str(w.message))
    assert "test_host_random.py:" in text and "np.random.rand(x.shape[1]) < 0.5" in text
    assert "torch.rand" in text and "train mode" in text
    # what the warning is about: two training steps of the capture mask the same frames
    cap.train()
    y = torch.ones(2, 40, 4)
    assert torch.equal(cap(y), cap(y))
    state = np.random.get_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # eval mode draws nothing: no warning
        capture(SpecAugmentNet(), (x,), modes=("eval",))
        capture(nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),))
    assert np.random.get_state()[2] == state[2]


def test_python_random_layerdrop_stops_capture_saying_what_to_set():
    x = torch.randn(2, 4)
    state = random.getstate()
    with pytest.raises(hydro.TraceError) as err:
        hydro.scale(LayerDropNet(), 2, example_inputs=(x,))
    msg = str(err.value)
    assert "\n" not in msg and "Python's random module" in msg
    assert "random.random() < self.layerdrop" in msg and "test_host_random.py:" in msg
    assert "set `self.layerdrop` to 0" in msg
    random.setstate(state)
    sur = hydro.scale(LayerDropNet(layerdrop=0.0), 2, example_inputs=(x,))  # what it says works
    assert sur(torch.randn(3, 4)).shape == (3, 3)


def layerdrop_net() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """For ``hydro inspect tests.fx.test_host_random:layerdrop_net``."""
    return LayerDropNet(), (torch.randn(2, 4),)


def test_layerdrop_error_through_the_cli(capsys):
    code = cli.main(["inspect", "tests.fx.test_host_random:layerdrop_net", "--ratio", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    first = err.strip().splitlines()[0]
    assert first.startswith("hydro inspect: error: cannot capture LayerDropNet")
    assert "set `self.layerdrop` to 0" in first


def _wav2vec2(**kw: object) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, feat_extract_norm="group",
        **{"mask_time_prob": 0.0, "layerdrop": 0.0, **kw},
    )
    torch.manual_seed(0)
    return transformers.Wav2Vec2ForCTC(cfg)


def test_wav2vec2_weight_norm_specaugment_and_layerdrop():
    x = torch.randn(2, 800)
    # positional conv under parametrizations.weight_norm (dim=2, grouped): scales
    sur = hydro.scale(_wav2vec2(), 2, example_inputs=(x,), seed=0)
    conv = "wav2vec2.encoder.pos_conv_embed.conv.parametrizations.weight"
    assert sur.get_parameter(f"{conv}.original1").shape == (16, 4, 8)
    assert sur.get_parameter(f"{conv}.original0").shape == (1, 1, 8)
    assert sur(torch.randn(3, 800)).logits.shape == (3, 79, 12)
    # SpecAugment with NumPy: a warning naming transformers' line
    with pytest.warns(HydroWarning, match=r"NumPy's random generator.*modeling_wav2vec2"):
        capture(_wav2vec2(mask_time_prob=0.5, mask_time_length=2), (x,), modes=("train",))
    # layerdrop (a torch draw turned into a Python branch): what to set
    with pytest.raises(hydro.TraceError, match=r"set `self.config.layerdrop` to 0"):
        capture(_wav2vec2(layerdrop=0.5), (x,), modes=("train",))

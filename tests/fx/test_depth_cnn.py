"""Depth scaling on the ResNet stages of ``examples.cnn.model.deep_cnn`` (transfer_cnn.py)."""

from __future__ import annotations

import pytest
import torch

import hydro
from examples.cnn.model import deep_cnn

X = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def test_both_stages_are_cut_and_the_strided_block_stays() -> None:
    torch.manual_seed(0)
    sur = hydro.scale(deep_cnn(32, 4), 2, depth_ratio=2, example_inputs=(X.float(),))
    stacks = {s.path: s for s in sur.hydro.stacks}
    assert set(stacks) == {"stage1", "stage2"}  # `down` is one block, not a container
    for p in ("stage1", "stage2"):
        assert stacks[p].reason is None and stacks[p].kept == [f"{p}.0", f"{p}.2"]
        assert stacks[p].multiplier == 2.0
    names = set(sur.state_dict())
    assert "down.shortcut.0.weight" in names and "stage2.2.conv1.weight" in names
    gone = ("stage1.1.", "stage1.3.", "stage2.1.", "stage2.3.")
    assert not any(n.startswith(gone) for n in names)
    assert sur.get_parameter("stage2.0.conv1.weight").shape == (32, 32, 3, 3)
    text = str(hydro.inspect(deep_cnn(32, 4), 2, depth_ratio=2, example_inputs=(X.float(),)))
    assert "stack 'stage1' keeps 2 of 4 blocks (stage1.0, stage1.2), residual branches x 2" in text


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_cut_cnn_is_the_shallow_cnn_with_branches_times_4(mode: str) -> None:
    """At width ratio 1 the (1, 4) surrogate computes deep_cnn(blocks=1) with each stage block's
    residual branch (its second BatchNorm's output) multiplied by 4, BatchNorm statistics in both
    modes included."""
    torch.manual_seed(0)
    model = deep_cnn(8, 4).double()
    for m in model.modules():  # non-trivial running statistics for the eval mode
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    sur = hydro.scale(model, 1, depth_ratio=4, example_inputs=(X,))
    assert [s.kept for s in sur.hydro.stacks] == [["stage1.0"], ["stage2.0"]]
    ref = deep_cnn(8, 1).double()
    ref.load_state_dict(sur.state_dict(), strict=True)
    for stage in (ref.stage1, ref.stage2):
        stage[0].bn2.register_forward_hook(lambda _m, _i, out: out * 4.0)
    sur.train(mode == "train")
    ref.train(mode == "train")
    torch.testing.assert_close(sur(X), ref(X), rtol=1e-12, atol=1e-12)
    if mode == "train":  # the running statistics moved alike
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(sur.state_dict()[k], v, rtol=1e-12, atol=1e-12)

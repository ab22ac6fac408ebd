"""A sequence length left dynamic at capture (``dynamic="auto"`` or ``dynamic={"seq": 1}``).

A surrogate, and a fused group of them, trained at one length runs at another exactly as a
surrogate captured at that length would; where the model bounds the length (a table of positions
sliced or indexed by it) a longer call says so clearly, and where it fixes the length (a table
added whole) the clear "only the batch is dynamic" error stays, on the fused path too.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hydro
from hydro.fusion import fuse, trial_loss
from hydro.fx.capture import dynamic_dims
from tests.zoo import GPT

VOCAB = 65


pytestmark = pytest.mark.usefixtures("one_thread")


class SlicedPositions(nn.Module):
    """An encoder with learned positions up to ``max_len``, sliced to the input's length."""

    def __init__(self, d: int = 32, max_len: int = 20, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(1, max_len, d) * 0.02)
        self.layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.size(1)]
        return self.head(self.layer(x).mean(dim=1))


class WholeTable(nn.Module):
    """Positions added whole: the model only runs at ``length`` tokens."""

    def __init__(self, d: int = 32, length: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(1, length, d) * 0.02)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.embed(idx) + self.pos)))


def _tokens(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _scale(model: nn.Module, t: int, seed: int = 0, **kw) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # below the width floor: tiny on purpose
        return hydro.scale(model, 2, example_inputs=(_tokens(2, t),), seed=seed, **kw)


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=4, n_embd=32).double()


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    return SlicedPositions().double()


def _loss(out: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    if out.dim() == 3:  # next-token logits [B, T, V]
        return F.cross_entropy(out.reshape(-1, out.size(-1)), idx.reshape(-1))
    return F.cross_entropy(out, idx[:, 0] % out.size(-1))


@pytest.mark.parametrize(
    "make, name, bound", [(_gpt, "idx", 16), (_encoder, "tokens", 20)], ids=["gpt", "encoder"]
)
def test_surrogate_trained_at_16_runs_at_8_and_12_like_one_captured_there(make, name, bound):
    model = make()
    sur = _scale(model, 16, dynamic="auto")
    assert dynamic_dims(sur.graphs["train"]) and dynamic_dims(sur.graphs["eval"])
    opt = torch.optim.SGD(sur.parameters(), lr=0.1)
    for step in range(2):  # trained at 16 tokens
        x = _tokens(4, 16, seed=step)
        opt.zero_grad()
        _loss(sur(x), x).backward()
        opt.step()
    sur.eval()
    for t in (8, 12):
        there = _scale(model, t)  # captured at this length, only the batch dynamic
        there.load_state_dict(sur.state_dict())
        there.eval()
        x = _tokens(3, t, seed=10 + t)
        assert torch.equal(sur(x), there(x))
        with pytest.raises(hydro.TraceError, match=rf"shape \(B, {t}\); called with \(3, 16\)"):
            there(_tokens(3, 16))  # the static one keeps its clear error
    with pytest.raises(hydro.TraceError) as err:  # the table of positions bounds the length
        sur(_tokens(3, bound + 1))
    assert f"input '{name}' dynamic from 2 to {bound}" in str(err.value)
    assert f"called with {bound + 1}" in str(err.value)


def test_fused_group_trained_at_16_evaluates_at_8_as_the_separate_surrogates():
    model = _gpt()
    surs = [_scale(model, 16, seed=k, dynamic={"seq": 1}) for k in range(2)]
    alone = [copy.deepcopy(s) for s in surs]
    fused = fuse(surs)
    opt = torch.optim.SGD(fused.parameters(), lr=0.1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in alone]
    for step in range(3):
        x = _tokens(4, 16, seed=step)
        out = fused(x)
        opt.zero_grad()
        trial_loss(_loss, out, x).sum().backward()
        opt.step()
        for k, (m, o) in enumerate(zip(alone, opts)):
            mine = m(x)
            torch.testing.assert_close(out[k], mine, rtol=1e-12, atol=1e-14)
            o.zero_grad()
            _loss(mine, x).backward()
            o.step()
    fused.eval()
    x = _tokens(3, 8, seed=9)
    out = fused(x)
    assert out.shape == (2, 3, 8, VOCAB)
    for k, m in enumerate(alone):
        m.eval()
        torch.testing.assert_close(out[k], m(x), rtol=1e-12, atol=1e-14)
    with pytest.raises(hydro.TraceError, match="dynamic from 2 to 16.*called with 17"):
        fused(_tokens(3, 17))


def test_a_whole_table_keeps_the_length_fixed_with_its_clear_error_also_fused():
    torch.manual_seed(0)
    model = WholeTable()
    with pytest.raises(hydro.TraceError, match="dimension 1 of input 'idx'.*fixes it to 16"):
        _scale(model, 16, dynamic={"seq": 1})
    surs = [_scale(model, 16, seed=k, dynamic="auto") for k in range(2)]
    assert not dynamic_dims(surs[0].graphs["train"])  # auto: left fixed, no error
    want = r"captured with input 'idx' of shape \(B, 16\); called with \(3, 8\)\. Only the batch"
    with pytest.raises(hydro.TraceError, match=want):
        surs[0](_tokens(3, 8))
    fused = fuse(surs)
    assert fused(_tokens(3, 16)).shape == (2, 3, 16, VOCAB)
    with pytest.raises(hydro.TraceError, match=want):
        fused(_tokens(3, 8))


@pytest.mark.parametrize(
    "dynamic, message",
    [
        ({"seq": 0}, r"0 is not a dimension index >= 1 \(dimension 0 is the batch"),
        ({"seq": 2}, r"names a dimension no tensor input has \(input shapes: \{'idx': \(2, 16\)"),
        ({"idx": {2: "seq"}}, r"dimension 2 of input 'idx', which has shape \(2, 16\)"),
        ({"ids": {1: "seq"}}, r"names input 'ids', which the model's call does not take"),
        ({"seq": "1"}, r"'1' is not a dimension index"),
        ("yes", r"dynamic= must be 'auto' or a mapping, got 'yes'"),
    ],
)
def test_a_bad_dynamic_argument_says_what_is_wrong(dynamic, message):
    with pytest.raises(hydro.TraceError, match=message):
        _scale(WholeTable(), 16, dynamic=dynamic)


def test_task_dynamic_is_checked_up_front():
    x = _tokens(8, 16)
    assert hydro.Task(model=WholeTable(), train_data=(x, x), val_data=(x, x)).dynamic is None
    with pytest.raises(hydro.ConfigError, match=r"dynamic= must be 'auto' or a mapping, got 1"):
        hydro.Task(model=WholeTable(), train_data=(x, x), val_data=(x, x), dynamic=1)

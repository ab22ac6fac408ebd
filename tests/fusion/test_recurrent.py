"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``): width rules (hidden and input sizes are
widths, the gates keep their blocks; multi-layer, bidirectional, ``proj_size``, ``batch_first``,
a tied decoder), muP roles, and a fused form whose training equals separate training step by
step in float64 (losses, gradients, parameters, optimizer state)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import hydro
from hydro.errors import FuseError
from tests.fusion.exactness import build, train_and_compare

VOCAB = 65  # the zoo's "gpt" case: token ids [4, 16] and next-token targets


class RecurrentLM(nn.Module):
    """PyTorch's word-language-model example, sized down: embedding, a recurrent stack,
    a decoder (optionally tied to the embedding), called with ``[batch, time]`` token ids."""

    def __init__(self, kind: str = "LSTM", hidden: int = 64, emb: int = 64, layers: int = 2,
                 tie: bool = False, bidirectional: bool = False, proj: int = 0,
                 batch_first: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, emb)
        extra = {"proj_size": proj} if proj else {}
        self.rnn = getattr(nn, kind)(emb, hidden, layers, bidirectional=bidirectional,
                                     batch_first=batch_first, **extra)  # fmt: skip
        self.decoder = nn.Linear((proj or hidden) * (2 if bidirectional else 1), VOCAB)
        if tie:
            self.decoder.weight = self.encoder.weight
        self.batch_first = batch_first

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.encoder(ids if self.batch_first else ids.t())  # [T, B, E] unless batch-first
        out, _ = self.rnn(x)
        logits = self.decoder(out)
        return logits if self.batch_first else logits.transpose(0, 1)


CONFIGS = {
    "lstm": dict(),
    "lstm_tied": dict(tie=True),
    "gru_bidirectional": dict(kind="GRU", bidirectional=True),
    "lstm_proj_batch_first": dict(proj=32, batch_first=True, layers=3),
    "rnn": dict(kind="RNN", layers=1),
    "lstm_bidirectional_proj": dict(bidirectional=True, proj=32),
    "lstm_bidirectional": dict(bidirectional=True, batch_first=True),
}
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _ids(b: int = 4, t: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", CONFIGS)
def test_widths_gates_and_roles(name):
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    model = RecurrentLM(**cfg).double()
    ids = _ids()
    sur = hydro.scale(model, 8, example_inputs=(ids,), seed=1)
    g = GATES[cfg.get("kind", "LSTM")]
    params = dict(sur.named_parameters())
    hidden, proj = 64 // 8, cfg.get("proj", 0) // 8
    out = proj or hidden
    dirs = 2 if cfg.get("bidirectional") else 1
    assert params["rnn.weight_ih_l0"].shape == (g * hidden, 8)
    assert params["rnn.weight_hh_l0"].shape == (g * hidden, out)
    assert params["rnn.bias_hh_l0"].shape == (g * hidden,)
    if cfg.get("layers", 2) > 1:
        assert params["rnn.weight_ih_l1"].shape == (g * hidden, dirs * out)
    if proj:
        assert params["rnn.weight_hr_l0"].shape == (proj, hidden)
    roles = sur.hydro.roles
    assert roles["rnn.weight_hh_l0"] == "hidden" and roles["rnn.bias_ih_l0"] == "vector"
    if cfg.get("tie"):  # one tensor, the embedding, read out too: muP's output role
        assert "decoder.weight" not in params and roles["encoder.weight"] == "output"
    else:
        assert roles["encoder.weight"] == "input"
        assert roles["decoder.weight"] == "output"
    assert sur(ids).shape == (4, 16, VOCAB)
    # ratio 1 is the model itself, bit for bit
    one = hydro.scale(model, 1, example_inputs=(ids,))
    one.load_state_dict(model.state_dict())
    assert torch.equal(one(ids), model(ids))


def test_the_input_size_is_a_width_unless_fixed():
    class Features(nn.Module):  # real-valued inputs: their feature count is fixed
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.GRU(10, 64, batch_first=True)
            self.head = nn.Linear(64, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(x)[0][:, -1])

    sur = hydro.scale(Features(), 4, example_inputs=(torch.randn(2, 5, 10),), seed=0)
    assert sur.get_parameter("rnn.weight_ih_l0").shape == (3 * 16, 10)
    assert sur.hydro.roles["rnn.weight_ih_l0"] == "input"


@pytest.mark.parametrize("name", ["lstm_tied", "gru_bidirectional", "lstm_proj_batch_first",
                                  "rnn", "lstm_bidirectional"])  # fmt: skip
def test_fused_recurrent_training_equals_separate_training(name):
    seeds = itertools.count()

    def surrogate(case):
        torch.manual_seed(next(seeds))
        model = RecurrentLM(**CONFIGS[name]).double()
        return hydro.scale(model, 4, example_inputs=case.inputs, seed=next(seeds))

    run, cases = build("gpt", 3, "adam", make_model=surrogate)
    train_and_compare(run, cases, steps=3)


def test_dropout_between_layers_is_refused_naming_the_node():
    torch.manual_seed(0)
    model = RecurrentLM()
    model.rnn.dropout = 0.2
    sur = hydro.scale(model, 4, example_inputs=(_ids(),))
    with pytest.raises(FuseError, match="dropout 0.2 between the layers"):
        hydro.fuse(sur, n=2)(_ids())


class Cells(nn.Module):
    """A hand-written loop over ``nn.LSTMCell`` then ``nn.GRUCell`` and ``nn.RNNCell``."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, width)
        self.lstm = nn.LSTMCell(width, width)
        self.gru = nn.GRUCell(width, width)
        self.rnn = nn.RNNCell(width, width, nonlinearity="relu")
        self.decoder = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.encoder(ids)
        h = c = g = r = x.new_zeros(x.shape[0], self.lstm.hidden_size)
        outs = []
        for t in range(x.shape[1]):
            h, c = self.lstm(x[:, t], (h, c))
            g = self.gru(h, g)
            r = self.rnn(g, r)
            outs.append(r)
        return self.decoder(torch.stack(outs, 1))


def test_cells_scale_and_fuse_exactly():
    sur = hydro.scale(Cells(), 4, example_inputs=(_ids(),), seed=0)
    assert sur.get_parameter("lstm.weight_hh").shape == (4 * 8, 8)
    assert sur.get_parameter("gru.weight_ih").shape == (3 * 8, 8)
    assert sur.hydro.roles["gru.weight_hh"] == "hidden"
    seeds = itertools.count()

    def surrogate(case):
        torch.manual_seed(next(seeds))
        ids = case.inputs[0][:, :5]
        return hydro.scale(Cells().double(), 4, example_inputs=(ids,), seed=next(seeds))

    run, cases = build("gpt", 2, "adam", make_model=surrogate)
    for case in cases:  # five steps of the loop
        case.inputs = (case.inputs[0][:, :5],)
        case.target = case.target[:, :5]
    train_and_compare(run, cases, steps=2)

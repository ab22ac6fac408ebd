"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``): width rules (hidden and input sizes are
widths, the gates keep their blocks; multi-layer, bidirectional, ``proj_size``, ``batch_first``,
a tied decoder), muP roles, and a fused form whose training equals separate training step by
step in float64 (losses, gradients, parameters, optimizer state)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hydro
import hydro.optim
from hydro.errors import TraceError
from hydro.fusion import random as rng
from tests.fusion.exactness import build, train_and_compare

VOCAB = 65  # the zoo's "gpt" case: token ids [4, 16] and next-token targets


class RecurrentLM(nn.Module):
    """PyTorch's word-language-model example, sized down: embedding, a recurrent stack,
    a decoder (optionally tied to the embedding), called with ``[batch, time]`` token ids."""

    def __init__(self, kind: str = "LSTM", hidden: int = 64, emb: int = 64, layers: int = 2,
                 tie: bool = False, bidirectional: bool = False, proj: int = 0,
                 batch_first: bool = False) -> None:
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, emb)
        extra = {"proj_size": proj} if proj else {}
        self.rnn = getattr(nn, kind)(emb, hidden, layers, bidirectional=bidirectional,
                                     batch_first=batch_first, **extra)
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
                                  "rnn", "lstm_bidirectional"])
def test_fused_recurrent_training_equals_separate_training(name):
    seeds = itertools.count()

    def surrogate(case):
        torch.manual_seed(next(seeds))
        model = RecurrentLM(**CONFIGS[name]).double()
        return hydro.scale(model, 4, example_inputs=case.inputs, seed=next(seeds))

    run, cases = build("gpt", 3, "adam", make_model=surrogate)
    train_and_compare(run, cases, steps=3)


def _dropout_lm(p: float, seed: int, kind: str = "LSTM") -> nn.Module:
    torch.manual_seed(seed)
    model = RecurrentLM(kind, hidden=16, emb=16, layers=3).double()
    model.rnn.dropout = p  # nn.LSTM(..., dropout=p): between the layers, not after the last
    return model


def _train_slot(members: list[nn.Module], slot: int, seed: int, steps: int) -> list:
    """``steps`` fused Adam steps; slot ``slot`` (stream ``seed``): loss, grads, weights."""
    fused = hydro.fuse([copy.deepcopy(m) for m in members])
    fused.reseed_trial(slot, seed)
    lrs = [1e-2 * (k + 1) for k in range(len(members))]
    lrs[slot] = 3e-3
    opt = hydro.optim.Adam(fused.parameters(), lr=lrs)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (4, 8), generator=g)
        losses = hydro.trial_loss(F.cross_entropy, fused(ids).flatten(1, 2), ids.flatten())
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
        params = list(fused.named_parameters())
        grads = {n: p.grad[slot].clone() for n, p in params}
        out.append((losses[slot].item(), grads, {n: p[slot].detach().clone() for n, p in params}))
    return out


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_dropout_between_layers_is_each_trials_own_in_any_group_and_slot(kind):
    me = _dropout_lm(0.3, 7, kind)
    alone = _train_slot([me], 0, seed=42, steps=3)
    group = [_dropout_lm(0.1, 1, kind), _dropout_lm(0.0, 2, kind), me]  # per-trial rates
    for got in (_train_slot(group, 2, seed=42, steps=3),
                _train_slot([me, _dropout_lm(0.5, 3, kind)], 0, seed=42, steps=3)):
        for (la, ga, wa), (lb, gb, wb) in zip(got, alone, strict=True):
            assert la == pytest.approx(lb, rel=1e-12, abs=1e-14)
            for name in ga:
                torch.testing.assert_close(ga[name], gb[name], rtol=1e-12, atol=1e-14)
                torch.testing.assert_close(wa[name], wb[name], rtol=1e-12, atol=1e-14)
    # the masks act: another seed trains differently
    other = _train_slot([me], 0, seed=43, steps=2)
    assert other[1][0] != pytest.approx(alone[1][0], rel=1e-9)


def test_dropout_between_layers_equals_the_layers_with_the_trials_masks():
    """The fused stack is the stack run layer by layer with each trial's mask between layers
    (scaled by 1 / (1 - p)), none after the last; eval mode draws nothing."""
    torch.manual_seed(0)
    rnn = nn.LSTM(6, 5, num_layers=3, dropout=0.25).double()

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = rnn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rnn(x)[0]

    x = torch.randn(7, 3, 6, dtype=torch.float64)
    fused = hydro.fuse([Stack(), copy.deepcopy(Stack())], seed=5)
    y = fused(x)  # [2, T, B, H]
    keys = rng.stream_keys(torch.tensor([5, 6]), torch.zeros(2, dtype=torch.int64), 1)[0]
    masks = rng.dropout(torch.ones(2, 2, 7, 3, 5, dtype=torch.float64), 0.25, keys)
    assert (masks == 0).any() and (masks != 0).any()
    for k in range(2):
        h = x
        for layer in range(3):
            one = nn.LSTM(6 if layer == 0 else 5, 5).double()
            with torch.no_grad():
                for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                    getattr(one, f"{name}_l0").copy_(getattr(rnn, f"{name}_l{layer}"))
            h = one(h)[0]
            if layer < 2:
                h = h * masks[k, layer]
        torch.testing.assert_close(y[k], h, rtol=1e-12, atol=1e-14)
    fused.eval()
    torch.testing.assert_close(fused(x)[0], rnn.eval()(x)[0], rtol=1e-12, atol=1e-14)


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


class Packed(nn.Module):
    """Variable-length sequences through ``pack_padded_sequence`` -> LSTM -> ``pad_packed``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, 32)
        self.rnn = nn.LSTM(32, 32, batch_first=True)
        self.decoder = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(self.encoder(ids), lengths, batch_first=True,
                                                   enforce_sorted=False)
        out, _ = self.rnn(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True,
                                                  total_length=ids.shape[1])
        return self.decoder(out)


def test_packed_sequences_are_refused_naming_the_op_and_what_to_do():
    ids, lengths = _ids(), torch.tensor([16, 9, 4, 12])
    for call in (lambda: hydro.scale(Packed(), 4, example_inputs=(ids, lengths)),
                 lambda: hydro.fuse(Packed(), n=2)(ids, lengths)):
        with pytest.raises(TraceError, match=r"self.rnn\(packed\).*PackedSequence") as err:
            call()
        assert "Call the layer on the padded tensor" in str(err.value)
        assert "ignore_index" in str(err.value)


class LearnedState(nn.Module):
    """An LSTM (bidirectional, 2 layers) from a learned initial state, read out by its outputs
    and its final ``(h, c)``: the fused layer's gradients for ``h0``, ``c0`` and the final
    state, both directions."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(6, 8, num_layers=2, bidirectional=True)
        self.h0 = nn.Parameter(torch.randn(4, 1, 8) * 0.5)
        self.c0 = nn.Parameter(torch.randn(4, 1, 8) * 0.5)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = tuple(s.expand(-1, x.shape[0], -1).contiguous() for s in (self.h0, self.c0))
        out, (h, c) = self.rnn(x.transpose(0, 1), state)
        return self.head(out).sum(0) + (h * c).sum(0).sum(-1, keepdim=True)


def test_fused_lstm_gradients_equal_separate_ones_with_a_given_state():
    torch.manual_seed(0)
    models = [LearnedState().double() for _ in range(3)]
    fused = hydro.fuse([copy.deepcopy(m) for m in models])
    x = torch.randn(4, 7, 6, dtype=torch.float64)  # [B, T, features]
    y = torch.randn(4, 3, dtype=torch.float64)
    hydro.trial_loss(F.mse_loss, fused(x), y).sum().backward()
    params = dict(fused.named_parameters())
    for k, m in enumerate(models):
        out = m(x)
        torch.testing.assert_close(fused(x)[k], out, rtol=1e-12, atol=1e-13)
        F.mse_loss(out, y).backward()
        for name, p in m.named_parameters():
            torch.testing.assert_close(params[name].grad[k], p.grad, rtol=1e-10, atol=1e-13,
                                       msg=name)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("steps", [1, 4])
def test_the_fused_lstm_layer_passes_gradcheck(steps, reverse):
    """The hand-written backward against finite differences, every input (the layer's input,
    weights, summed bias, h0, c0) and output (outputs, last h, last c); gradcheck runs the
    backward many times on one graph, as retain_graph does."""
    from hydro.fusion.recurrent import _lstm_layer

    g = torch.Generator().manual_seed(steps)
    x, w_ih, w_hh, b, h0, c0 = (torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()
                                for s in [(2, steps, 3, 4), (2, 20, 4), (2, 20, 5), (2, 20),
                                          (2, 3, 5), (2, 3, 5)])

    def layer(x, w_ih, w_hh, b, h0, c0):
        return _lstm_layer(x, h0, c0, [w_ih, w_hh, b, None, None], reverse)

    assert torch.autograd.gradcheck(layer, (x, w_ih, w_hh, b, h0, c0))

"""Structured values are rebuilt, not redrawn or cut: a parameter or buffer whose values follow a
rule of its width (a sinusoid position table, ``log(arange(1, N + 1))``, an identity) is, in the
surrogate, what the same module builds at the surrogate's width; a structured table of no known
rule is refused with an error naming it. Every model here is written in the test."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hydro
from hydro.errors import ScaleError

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::hydro.errors.HydroWarning")]

VOCAB, SEQ, RATIO = 50, 12, 8


def tutorial_table(max_len: int, d: int) -> torch.Tensor:
    """The PyTorch tutorial's ``PositionalEncoding``: sines and cosines interleaved."""
    position = torch.arange(max_len).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
    pe = torch.zeros(max_len, d)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe


def halves_table(n_pos: int, d: int) -> torch.Tensor:
    """Marian's and Pegasus' frozen table: all sines, then all cosines (NumPy, float64)."""
    import numpy as np

    enc = np.array([[pos / np.power(10000, 2 * (j // 2) / d) for j in range(d)]
                    for pos in range(n_pos)])
    out = torch.empty(n_pos, d)
    out[:, : d // 2] = torch.FloatTensor(np.sin(enc[:, 0::2]))
    out[:, d // 2 :] = torch.FloatTensor(np.cos(enc[:, 1::2]))
    return out


class BufferPositions(nn.Module):
    """Token embedding plus the tutorial's sinusoid held as a buffer ``[1, max_len, d]``."""

    def __init__(self, d: int = 64, values: torch.Tensor | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        table = tutorial_table(32, d) if values is None else values
        self.register_buffer("pe", table.unsqueeze(0))
        self.hidden = nn.Linear(d, d)
        self.out = nn.Linear(d, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + self.pe[:, : ids.shape[1]]
        return self.out(self.hidden(h).relu()).mean(1)


class FrozenPositions(nn.Embedding):
    """A position table held as a frozen parameter, read at ``arange(T)`` (Marian, Pegasus)."""

    def __init__(self, n_pos: int, d: int) -> None:
        super().__init__(n_pos, d)
        self.weight = nn.Parameter(halves_table(n_pos, d), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.arange(ids.shape[1], device=ids.device))


class ParameterPositions(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.pos = FrozenPositions(32, d)
        self.hidden = nn.Linear(d, d)
        self.out = nn.Linear(d, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + self.pos(ids)
        return self.out(self.hidden(h).relu()).mean(1)


class StateSpace(nn.Module):
    """A diagonal state-space mixer as Mamba initializes it: ``A_log = log(1..N)`` on every
    channel, ``D`` ones; the state size ``N`` is a width (the input projection makes it)."""

    def __init__(self, d: int = 64, n: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.x_proj = nn.Linear(d, n)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1, dtype=torch.float32)
                                            .repeat(d, 1)))
        self.D = nn.Parameter(torch.ones(d))
        self.out = nn.Linear(d, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)  # [B, T, d]
        decay = torch.exp(-torch.exp(self.A_log))  # [d, N]
        state = x.unsqueeze(-1) * decay * self.x_proj(x).unsqueeze(2)  # [B, T, d, N]
        y = state.sum(-1) + x * self.D
        return self.out(y).mean(1)


class IdentityInit(nn.Module):
    """A square mixing matrix initialized to the identity (a residual-friendly start)."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.mix = nn.Parameter(torch.eye(d))
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out((self.inp(x) @ self.mix).relu())


class SortedParameter(nn.Module):
    """A parameter sorted along its width (a cumulative table): structured, of no known rule."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.offset = nn.Parameter(torch.rand(d).cumsum(0) ** 1.5)
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out((self.inp(x) + self.offset).relu())


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def test_a_sinusoid_buffer_is_the_table_at_the_new_width():
    torch.manual_seed(0)
    sur = hydro.scale(BufferPositions(), RATIO, example_inputs=(_ids(),))
    want = BufferPositions(64 // RATIO).pe
    assert sur.pe.shape == want.shape == (1, 32, 8)
    torch.testing.assert_close(sur.pe, want, rtol=0, atol=1e-6)
    # not the old table's first columns: those are other frequencies
    assert not torch.allclose(sur.pe, BufferPositions().pe[..., :8], atol=1e-3)
    report = hydro.inspect(BufferPositions(), RATIO, example_inputs=(_ids(),))
    assert "'pe': sinusoid table (base 10000, interleaved)" in str(report)
    one = hydro.scale(BufferPositions(), 1, example_inputs=(_ids(),))
    assert torch.equal(one.pe, BufferPositions().pe)  # ratio 1: the target's, bit for bit


def test_a_frozen_sinusoid_parameter_is_rebuilt_not_drawn():
    torch.manual_seed(0)
    sur = hydro.scale(ParameterPositions(), RATIO, example_inputs=(_ids(),), seed=1)
    table = sur.get_parameter("pos.weight")
    assert not table.requires_grad
    torch.testing.assert_close(table, halves_table(32, 8), rtol=0, atol=1e-6)
    assert "pos.weight" in sur.hydro.structured
    fused = hydro.fuse(sur, n=3, seed=4)  # other trials: other draws, the same table
    for k in range(3):
        torch.testing.assert_close(fused.trial(k).get_parameter("pos.weight"), table,
                                   rtol=0, atol=0)


def test_log_arange_state_table_is_rebuilt_for_the_new_state_size():
    torch.manual_seed(0)
    target = StateSpace()
    sur = hydro.scale(target, RATIO, example_inputs=(_ids(),), seed=2)
    a_log = sur.get_parameter("A_log")
    assert a_log.shape == (8, 2)
    torch.testing.assert_close(a_log, StateSpace(8, 2).A_log, rtol=0, atol=1e-7)
    assert torch.equal(sur.get_parameter("D"), torch.ones(8))
    fused = hydro.fuse(sur, n=2, seed=5)
    assert torch.equal(fused.trial(1).get_parameter("A_log"), a_log)
    # the surrogate starts where the model starts: the same loss scale on the same data
    ids = _ids()
    assert torch.isfinite(sur(ids)).all()


def test_an_identity_parameter_stays_an_identity():
    torch.manual_seed(0)
    sur = hydro.scale(IdentityInit(), RATIO, example_inputs=(torch.randn(2, 16),), seed=3)
    assert torch.equal(sur.get_parameter("mix"), torch.eye(8))
    assert sur.hydro.roles["mix"] == "hidden"  # its learning rate is still muP's


def test_a_buffer_of_no_known_rule_is_refused_naming_it():
    torch.manual_seed(0)
    model = BufferPositions(values=torch.randn(32, 64))  # a frozen random table
    with pytest.raises(ScaleError, match=r"buffer 'pe' \(dimension 2, size 64 -> 8 at ratio 8\)"):
        hydro.scale(model, RATIO, example_inputs=(_ids(),))
    hydro.scale(model, 1, example_inputs=(_ids(),))  # nothing is cut at ratio 1


def test_a_structured_parameter_of_no_known_rule_is_refused_naming_it():
    torch.manual_seed(0)
    with pytest.raises(ScaleError, match=r"parameter 'offset' \(dimension 0, size 64 -> 8"):
        hydro.scale(SortedParameter(), RATIO, example_inputs=(torch.randn(2, 16),))


def test_constants_stay_constants():
    class Constants(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(16, 64)
            self.register_buffer("shift", torch.full((64,), 0.25))
            self.gain = nn.Parameter(torch.full((64,), 1.5))
            self.out = nn.Linear(64, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out((self.inp(x) * self.gain + self.shift).relu())

    sur = hydro.scale(Constants(), RATIO, example_inputs=(torch.randn(2, 16),))
    assert torch.equal(sur.shift, torch.full((8,), 0.25))
    assert torch.equal(sur.get_parameter("gain"), torch.full((8,), 1.5))


def test_a_float32_linspace_cast_to_float64_keeps_both_ends():
    class Shifted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(16, 64)
            self.register_buffer("shift", torch.linspace(0, 1, 64))  # float32, then .double()
            self.out = nn.Linear(64, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out((self.inp(x) + self.shift).relu())

    sur = hydro.scale(Shifted().double(), 2, example_inputs=(torch.randn(2, 16).double(),))
    torch.testing.assert_close(sur.shift, torch.linspace(0, 1, 32, dtype=torch.float64))


def fairseq_table(n_pos: int, d: int, padding_idx: int) -> torch.Tensor:
    """fairseq's ``SinusoidalPositionalEmbedding.get_embedding`` (and M2M100's, XGLM's): sines
    then cosines, frequencies ``10000 ** (-i / (d/2 - 1))``, the padding row zeroed."""
    half = d // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
    angle = torch.arange(n_pos, dtype=torch.float).unsqueeze(1) * freq.unsqueeze(0)
    table = torch.cat([torch.sin(angle), torch.cos(angle)], dim=1)
    table[padding_idx, :] = 0
    return table


class PaddedPositions(nn.Module):
    """Token embedding plus fairseq's position table (a buffer), positions counted from
    ``padding_idx + 1`` over the non-padding tokens, padding tokens at the padding row."""

    def __init__(self, d: int = 64, padding_idx: int = 1) -> None:
        super().__init__()
        self.pad = padding_idx
        self.emb = nn.Embedding(VOCAB, d, padding_idx=padding_idx)
        self.register_buffer("weights", fairseq_table(32 + padding_idx + 1, d, padding_idx),
                             persistent=False)
        self.out = nn.Linear(d, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = ids.ne(self.pad).int()
        positions = (torch.cumsum(mask, dim=1) * mask).long() + self.pad
        pos = self.weights.index_select(0, positions.view(-1)).view(*ids.shape, -1)
        return self.out((self.emb(ids) * 8.0 + pos).relu()).mean(1)


@pytest.mark.parametrize("padding_idx", [1, 0])
def test_a_fairseq_table_with_a_padding_row_is_rebuilt_with_it(padding_idx):
    ids = _ids().clamp_min(2)
    ids[0, -3:] = padding_idx
    torch.manual_seed(0)
    model = PaddedPositions(padding_idx=padding_idx)
    sur = hydro.scale(model, RATIO, example_inputs=(ids,), seed=1)
    want = fairseq_table(32 + padding_idx + 1, 64 // RATIO, padding_idx)
    assert sur.weights.shape == want.shape
    torch.testing.assert_close(sur.weights, want, rtol=0, atol=1e-6)
    assert not sur.weights[padding_idx].any()  # the padding row stays zero
    report = str(hydro.inspect(model, RATIO, example_inputs=(ids,)))
    assert f"'weights': sinusoid table (base 10000, sin | cos, zero rows [{padding_idx}])" in report
    fused = hydro.fuse(sur, n=2, seed=3)
    for k in range(2):  # every trial keeps the table
        torch.testing.assert_close(fused.trial(k).weights, want, rtol=0, atol=1e-6)
    one = hydro.scale(model, 1, example_inputs=(ids,))
    assert torch.equal(one.weights, model.weights)

"""Per-trial random streams (issue 10, point 2's reproducibility): a trial's dropout masks, and so
its result, depend on its seed and step only, not on its slot, its group or its neighbours.

Statistical checks use tolerances of 5 standard deviations: they fail for a biased or correlated
generator (a keep rate off by 0.5%, masks shared between trials), not by chance.
"""

from __future__ import annotations

import copy
import functools
import math

import optuna
import pytest
import torch
import torch.nn.functional as F
from optuna.distributions import FloatDistribution
from torch import nn

import hydro
from hydro.errors import FuseError, HydroWarning
from hydro.fusion import fuse, trial_loss
from hydro.fusion import random as rng
from hydro.integrations.optuna import optimize
from hydro.tuning.group import FusedGroup
from tests.fusion.test_fused_ops import _Count

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _lowbias32(x: int) -> int:
    """The reference mixer in plain Python integers (no overflow at all)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_equals_the_reference_over_the_whole_32_bit_range() -> None:
    g = torch.Generator().manual_seed(0)
    xs = torch.randint(0, 2**32, (4000,), generator=g, dtype=torch.int64)
    xs = torch.cat([xs, torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1])])
    assert rng.mix32(xs).tolist() == [_lowbias32(int(x)) for x in xs]
    assert rng.as_int64(2**64 + 5) == 5 and rng.as_int64(2**63) == -(2**63)
    assert rng.as_int64(-1) == -1


def _keys(seeds: list[int], step: int = 0, count: int = 1) -> torch.Tensor:
    seed = torch.tensor([rng.as_int64(s) for s in seeds], dtype=torch.int64)
    return rng.stream_keys(seed, torch.full_like(seed, step), count)


def _within(observed: float, expected: float, count: int, prob: float) -> bool:
    return abs(observed - expected) <= 5 * math.sqrt(prob * (1 - prob) / count)


def test_keep_rate_is_one_minus_p_per_trial() -> None:
    rates = torch.tensor([0.05, 0.1, 0.5, 0.9], dtype=torch.float64)
    x = torch.ones(4, 300, 400)
    out = rng.dropout(x, rates, _keys([1, 2, 3, 4])[0])
    for k, p in enumerate(rates.tolist()):
        kept = (out[k] != 0).double().mean().item()
        assert _within(kept, 1 - p, out[k].numel(), p), (p, kept)


def test_uniform_bits_are_uniform_and_seeds_of_any_size_work() -> None:
    # the 256 leading-byte bins: chi-square with 255 degrees of freedom (mean 255, sd 22.6)
    bits = rng.uniform_bits(_keys([2**40 + 3, -(2**62), 0])[0], (200_000,))
    assert bits.min() >= 0 and bits.max() < 2**24
    for row in bits:
        counts = torch.bincount(row >> 16, minlength=256).double()
        expected = row.numel() / 256
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 255 + 5 * 22.6, chi2
        # low bits too: parity is fair
        assert _within((row & 1).double().mean().item(), 0.5, row.numel(), 0.5)


def test_masks_are_independent_across_trials_steps_ops_and_neighbours() -> None:
    p, size = 0.5, 200_000
    x = torch.ones(1, size)
    seed = torch.tensor([11], dtype=torch.int64)

    def mask(seed_: int, step: int, salt: int) -> torch.Tensor:
        keys = rng.stream_keys(torch.tensor([seed_]), torch.tensor([step]), salt + 1)[salt]
        return rng.dropout(x, p, keys)[0] != 0

    base = mask(11, 0, 0)
    for other in (mask(12, 0, 0), mask(11, 1, 0), mask(11, 0, 1), mask(2**32 + 11, 0, 0)):
        both = (base & other).double().mean().item()
        assert _within(both, (1 - p) ** 2, size, (1 - p) ** 2), both
    # neighbouring elements of one mask
    both = (base[1:] & base[:-1]).double().mean().item()
    assert _within(both, (1 - p) ** 2, size - 1, (1 - p) ** 2), both
    # deterministic: the same seed, step and salt give the same mask
    assert torch.equal(base, mask(int(seed), 0, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kept_values_are_scaled_exactly_and_dropped_ones_are_zero(dtype) -> None:
    rates = [0.0, 0.1, 0.3, 1.0]
    x = torch.randn(4, 50, 60, dtype=dtype)
    out = rng.dropout(x, torch.tensor(rates, dtype=torch.float64), _keys([5, 6, 7, 8])[0])
    for k, p in enumerate(rates):
        q = torch.tensor(1 - p, dtype=torch.float64).to(dtype)
        scale = 1 / q if p < 1 else torch.tensor(0.0, dtype=dtype)
        kept = out[k] != 0
        assert torch.equal(out[k][kept], x[k][kept] * scale)
        assert torch.equal(out[k][~kept], torch.zeros_like(out[k][~kept]))
    assert torch.equal(out[0], x[0])  # p = 0: every element, unchanged
    assert not out[3].any()  # p = 1: none
    # one rate for all (a plain float): the very same values as that rate given per trial
    keys = _keys([5, 6, 7, 8])[0]
    for k, p in enumerate(rates):
        same = rng.dropout(x, p, keys)
        per = rng.dropout(x, torch.full((4,), p, dtype=torch.float64), keys)
        assert torch.equal(same, per) and torch.equal(same[k], out[k]), p


def _mlp(p: float, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(p), nn.Linear(32, 32),
                         nn.ReLU(), nn.Dropout(p), nn.Linear(32, 3)).double()


def test_dropout_zero_is_an_exact_identity_forward_and_backward() -> None:
    x = torch.randn(16, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (16,))

    def run(rates: list[float]) -> tuple:
        fused = fuse([_mlp(p, k) for k, p in enumerate(rates)])
        out = fused(x)
        trial_loss(F.cross_entropy, out, y).sum().backward()
        return out[0], {n: p.grad[0] for n, p in fused.named_parameters()}

    # trial 0 at rate 0 beside a trial that drops (a per-trial rate: the stream runs) is
    # bit-for-bit trial 0 in a group where no dropout runs at all
    (out_a, grads_a), (out_b, grads_b) = run([0.0, 0.4]), run([0.0, 0.0])
    assert torch.equal(out_a, out_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    ref = _mlp(0.0, 0)
    torch.testing.assert_close(out_a, ref(x), rtol=1e-12, atol=1e-14)


def test_eval_mode_draws_nothing() -> None:
    fused = fuse([_mlp(0.3, 0), _mlp(0.5, 1)])
    x = torch.randn(16, 6, dtype=torch.float64)
    state = torch.get_rng_state()
    fused(x)  # training: the fused streams, not torch's generator
    assert torch.equal(torch.get_rng_state(), state)
    assert fused.trial_step.tolist() == [1, 1]
    fused.eval()
    a, b = fused(x), fused(x)
    assert torch.equal(a, b) and fused.trial_step.tolist() == [1, 1]
    assert torch.equal(torch.get_rng_state(), state)
    for k in range(2):
        torch.testing.assert_close(a[k], fused.trial(k).eval()(x), rtol=1e-12, atol=1e-14)


def test_fuse_seeds_trials_by_index_and_reseed_restarts_a_stream() -> None:
    model = nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5))
    x = torch.randn(8, 4)
    a, b, c = fuse(model, n=3, seed=5), fuse(model, n=3, seed=5), fuse(model, n=3, seed=6)
    assert a.trial_seed.tolist() == [5, 6, 7]
    zero_a, zero_c = a(x) == 0, c(x) == 0
    assert torch.equal(zero_a, b(x) == 0)
    assert not torch.equal(zero_a[0], zero_c[0])
    # trial 1 of seed 5 and trial 0 of seed 6 share stream seed 6, but not weights: same mask
    d = fuse([model] * 2, seed=6)
    e = fuse([model] * 2, seed=5)
    assert torch.equal(d(x)[0] == 0, e(x)[1] == 0)
    # masks change from step to step, and restart with the stream
    first = d(x) == 0  # the second training forward
    assert not torch.equal(first[0], d(x)[0] == 0)
    d.reseed_trial(0, 6)
    assert d.trial_step.tolist() == [0, 3]
    assert torch.equal(d(x)[0] == 0, fuse([model], seed=6)(x)[0] == 0)
    with pytest.raises(IndexError):
        d.reseed_trial(2, 1)


def test_streams_follow_select_load_trial_and_state_dict() -> None:
    models = [_mlp(p, k) for k, p in enumerate([0.2, 0.3, 0.4])]
    x = torch.randn(8, 6, dtype=torch.float64)
    fused = fuse([copy.deepcopy(m) for m in models], seed=20)
    fused(x)
    state = copy.deepcopy(fused.state_dict())
    assert state["trial_step"].tolist() == [1, 1, 1]
    after = fused(x)
    again = fuse([copy.deepcopy(m) for m in models])
    again.load_state_dict(state)  # a checkpoint resumes each stream where it stopped
    assert torch.equal(again(x), after)
    fused.select([2])  # trial 2 keeps its own stream
    ref = fuse([copy.deepcopy(m) for m in models], seed=20)
    ref(x), ref(x)
    torch.testing.assert_close(fused(x)[0], ref(x)[2], rtol=1e-12, atol=1e-14)
    # load_trial: a new trial in the slot, its stream from the given seed
    fused.load_trial(0, models[1], seed=99)
    assert fused.trial(0).state_dict().keys() == models[1].state_dict().keys()
    alone = fuse([copy.deepcopy(models[1])], seed=99)
    torch.testing.assert_close(fused(x), alone(x), rtol=1e-12, atol=1e-14)


def test_a_random_op_too_large_for_the_stream_index_is_an_error() -> None:
    with pytest.raises(FuseError, match="2\\*\\*32 elements"):
        rng.uniform_bits(_keys([0])[0], (2**16, 2**16))


def test_rand_randn_and_bernoulli_have_their_distributions() -> None:
    keys, size = _keys([3, 4]), 200_000
    u = rng.uniform(keys[0], (size,), torch.float64)
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / size)
    z = rng.normal(keys[0], (size,), torch.float64)
    for row in z:
        assert abs(float(row.mean())) < 5 / math.sqrt(size)
        assert abs(float(row.var()) - 1) < 5 * math.sqrt(2 / size)
        assert _within(float((row.abs() < 1).double().mean()), 0.682689, size, 0.682689)
    assert abs(float((z[0] * u[0]).mean()) - 0) < 5 * math.sqrt(1 / 3 / size)  # two streams
    rates = torch.tensor([0.2, 0.7], dtype=torch.float64)
    b = rng.bernoulli(keys[0], (size,), rates, torch.float32)
    assert set(b.unique().tolist()) == {0.0, 1.0}
    for row, p in zip(b, (0.2, 0.7)):
        assert _within(float(row.double().mean()), p, size, p)


class _Noisy(nn.Module):
    """Random ops beside dropout, as models write them: timm's drop-path (``bernoulli_`` on a
    fresh ``new_empty``), noise injection (``randn_like``, ``rand_like``), sampled gates."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        keep = h.new_empty((h.shape[0], 1)).bernoulli_(1 - self.rate)
        h = h * keep / (1 - self.rate)
        h = h + 0.1 * torch.randn_like(h) + 0.1 * torch.rand_like(h)
        h = h * torch.bernoulli(torch.sigmoid(h))
        return self.fc2(h)


def test_other_random_ops_draw_from_each_trials_stream() -> None:
    def make(rate: float, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return _Noisy(rate).double()

    me = make(0.25, 7)
    group = fuse([make(0.1, 1), make(0.5, 2), copy.deepcopy(me)])  # per-trial drop-path rates
    alone = fuse([copy.deepcopy(me)])
    group.reseed_trial(2, 5)
    alone.reseed_trial(0, 5)
    x = torch.randn(32, 6, dtype=torch.float64)
    state = torch.get_rng_state()
    for _ in range(3):
        a, b = group(x)[2], alone(x)[0]
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert torch.equal(torch.get_rng_state(), state)
    assert group.fallbacks == [] and not torch.equal(group(x)[2], group(x)[2])


# --- (a) a trial's training does not depend on its group or slot ------------------------------


def _charlm(p: float, seed: int) -> nn.Module:
    from examples.charlm.model import gpt

    torch.manual_seed(seed)
    return gpt(n_layer=2, n_head=2, n_embd=16, block_size=8, dropout=p).double()


def _nanogpt(p: float, seed: int) -> nn.Module:
    """nanoGPT with SDPA: dropout inside attention (``dropout_p``) and on the residuals."""
    from tests.real_models import NanoConfig, NanoGPT

    torch.manual_seed(seed)
    return NanoGPT(NanoConfig(block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=p)).double()


def _train(members: list[nn.Module], slot: int, seed: int, steps: int, kind: str) -> list:
    """``steps`` fused steps; slot ``slot`` (stream ``seed``): its loss, gradients and weights."""
    fused = fuse([copy.deepcopy(m) for m in members])
    fused.reseed_trial(slot, seed)
    lrs = [1e-2 * (k + 1) for k in range(len(members))]
    lrs[slot] = 3e-3
    opt = hydro.optim.AdamW(fused.parameters(), lr=lrs, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        if kind == "nanogpt":  # the model's own loss, one per trial
            idx = torch.randint(0, 60, (4, 8), generator=g)
            losses = fused(idx, idx)[1]
        elif kind == "charlm":
            idx = torch.randint(0, 60, (4, 8), generator=g)
            losses = trial_loss(F.cross_entropy, fused(idx).flatten(1, 2), idx.flatten())
        else:
            x = torch.randn(16, 6, generator=g, dtype=torch.float64)
            losses = trial_loss(F.cross_entropy, fused(x), x[:, :3].argmax(-1))
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
        grads = {n: p.grad[slot].clone() for n, p in fused.named_parameters()}
        weights = {n: p[slot].detach().clone() for n, p in fused.named_parameters()}
        out.append((losses[slot].item(), grads, weights))
    return out


def _same(a: list, b: list) -> None:
    for step, ((la, ga, wa), (lb, gb, wb)) in enumerate(zip(a, b, strict=True)):
        assert la == pytest.approx(lb, rel=1e-12, abs=1e-14), step
        for name in ga:
            torch.testing.assert_close(ga[name], gb[name], rtol=1e-12, atol=1e-14,
                                       msg=f"grad {name} at step {step}")
            torch.testing.assert_close(wa[name], wb[name], rtol=1e-12, atol=1e-14,
                                       msg=f"weight {name} at step {step}")


@pytest.mark.parametrize("build", [_mlp, _charlm, _nanogpt], ids=["mlp", "charlm", "nanogpt"])
def test_trial_equals_itself_in_any_group_and_slot(build) -> None:
    kind = build.__name__.strip("_")
    me = build(0.2, 7)
    steps = 4
    group3 = [build(0.1, 1), build(0.3, 2), me]  # slot 2, per-trial rates
    alone = _train([me], 0, seed=42, steps=steps, kind=kind)  # one rate for all
    _same(_train(group3, 2, seed=42, steps=steps, kind=kind), alone)
    _same(_train([me, build(0.0, 3)], 0, seed=42, steps=steps, kind=kind), alone)
    # and the masks do act: another seed trains differently
    other = _train([me], 0, seed=43, steps=2, kind=kind)
    assert other[1][0] != pytest.approx(alone[1][0], rel=1e-9)


# --- (b) tuning: a trial's reported values do not depend on ``fuse`` -----------------------------


def _dropout_net(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 64),
                         nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 3)).double()


def _tune(fuse_: int) -> dict[int, tuple]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g, dtype=torch.float64)
    y = (x @ torch.randn(8, 3, generator=g, dtype=torch.float64)).argmax(-1)
    task = hydro.Task(model=_dropout_net, train_data=(x[:192], y[:192]),
                      val_data=(x[192:], y[192:]), steps=8, eval_every=4,
                      batch_size=16)
    space = {"lr": FloatDistribution(1e-3, 1e-1, log=True),
             "dropout": FloatDistribution(0.1, 0.5)}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    optimize(study, task, space, n_trials=3, ratio=2, fuse=fuse_, seed=3)
    return {t.number: (t.params, t.intermediate_values, t.value) for t in study.trials}


def test_tuned_trial_values_do_not_depend_on_fuse() -> None:
    one, three = _tune(1), _tune(3)
    assert one.keys() == three.keys() == {0, 1, 2}
    for number in one:
        p1, inter1, v1 = one[number]
        p3, inter3, v3 = three[number]
        assert p1 == p3
        assert inter1.keys() == inter3.keys() and len(inter1) == 2
        for step in inter1:
            assert inter1[step] == pytest.approx(inter3[step], rel=1e-9), (number, step)
        assert v1 == pytest.approx(v3, rel=1e-9)
    # dropout acts in these runs: the trials' values differ from a dropout-free run's
    assert len({v for _, _, v in one.values()}) == 3


def test_late_trial_with_dropout_equals_it_alone() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 8, generator=g, dtype=torch.float64)
    y = x[:, :3].argmax(-1)
    task = hydro.Task(model=functools.partial(_dropout_net), train_data=(x, y),
                      val_data=(x[:32], y[:32]), steps=6, batch_size=16)
    group = FusedGroup(task, [(0, {"dropout": 0.2}, 1), (1, {"dropout": 0.4}, 2)], ratio=2)
    for _ in range(3):
        group.step()
    group.put(0, 5, {"dropout": 0.3}, 9)  # joins late, in a slot that has run 3 steps
    late = [float(group.step()[0]) for _ in range(4)]
    alone = FusedGroup(task, [(5, {"dropout": 0.3}, 9)], ratio=2)
    assert late == pytest.approx([float(alone.step()[0]) for _ in range(4)], rel=1e-12)


# --- ATen ops per step do not grow with n ---------------------------------------------------


@pytest.mark.parametrize("per_trial", [False, True], ids=["one_rate", "per_trial_rates"])
def test_aten_ops_of_a_step_with_dropout_do_not_grow_with_n(per_trial) -> None:
    idx = torch.randint(0, 60, (2, 8), generator=torch.Generator().manual_seed(0))

    def ops(n: int) -> list[str]:
        base = _nanogpt(0.1, 0).float()
        members = [copy.deepcopy(base) for _ in range(n)]
        if per_trial:
            for k, m in enumerate(members):
                for mod in m.modules():
                    if isinstance(mod, nn.Dropout):
                        mod.p = 0.05 * (k % 3 + 1)
                for blk in m.transformer.h:
                    blk.attn.dropout = 0.05 * (k % 3 + 1)
        fused = fuse(members)
        fused(idx, idx)  # capture and build the graph outside the count
        with _Count() as counter:
            fused(idx, idx)[1].sum().backward()
        return counter.ops

    small, large = ops(2), ops(64)
    assert len(small) == len(large), (len(small), len(large))
    assert sorted(small) == sorted(large)
    assert any("bitwise_xor" in op for op in small)  # the streams are in the count


def _reference_drop_bits(seed: int, step: int, salt: int, numel: int) -> list[int]:
    """Draw version 2 in plain Python integers: pair j hashes to lowbias32(lowbias32(j) ^ key),
    its low half deciding element 2j and its high half element 2j + 1, each read as a signed
    16-bit integer (``u - 2**15`` for the uniform ``u``: the half with its top bit flipped)."""
    key = int(rng.stream_keys(torch.tensor([seed]), torch.tensor([step]), salt + 1)[salt, 0, 0])
    out = []
    for j in range((numel + 1) // 2):
        h = _lowbias32(_lowbias32(j) ^ key)
        out += [((h & 0xFFFF) ^ 0x8000) - 2**15, ((h >> 16) ^ 0x8000) - 2**15]
    return out[:numel]


@pytest.mark.parametrize("numel", [1, 7, 64])
def test_dropout_draw_equals_its_python_reference(numel: int) -> None:
    seeds = [3, 2**40 + 1]
    keys = _keys(seeds, step=5, count=2)[1]
    bits = rng.drop_bits(keys, (numel,))
    assert bits.dtype == torch.int16 and bits.shape == (2, numel)
    for k, seed in enumerate(seeds):
        assert bits[k].tolist() == _reference_drop_bits(rng.as_int64(seed), 5, 1, numel)


def test_dropout_halves_are_uniform_16_bit_draws_and_rates_are_quantized_to_16_bits() -> None:
    bits = rng.drop_bits(_keys([9, 10])[0], (300_001,)).to(torch.int64) + 2**15
    assert bits.min() >= 0 and bits.max() < 2**16
    for row in bits:
        for part in (row >> 8, row & 0xFF, row[0::2] >> 8, row[1::2] >> 8):  # high, low bytes
            counts = torch.bincount(part, minlength=256).double()
            expected = part.numel() / 256
            chi2 = float(((counts - expected) ** 2 / expected).sum())
            assert chi2 < 255 + 5 * 22.6, chi2
    # an element is kept iff its 16-bit uniform reaches ceil(p * 2**16): exactly, per element
    x = torch.ones(2, 300_001, dtype=torch.float64)
    for p in (0.1, 1e-6, 0.99999):
        kept = rng.dropout(x, p, _keys([9, 10])[0]) != 0
        assert torch.equal(kept, bits >= min(math.ceil(p * 2**16), 2**16 - 1))


def test_the_cached_index_half_is_not_taken_from_a_trace() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    rng._cached_counters.cache_clear()
    keys, x = _keys([1, 2])[0], torch.ones(2, 999)
    traced = make_fx(lambda t, k: rng.dropout(t, 0.5, k), tracing_mode="fake")(x, keys)
    assert rng._cached_counters.cache_info().currsize == 0  # nothing fake was kept
    assert torch.equal(traced(x, keys), rng.dropout(x, 0.5, keys))
    assert rng._cached_counters.cache_info().currsize == 1


def test_a_state_of_the_older_draw_is_refused_where_the_model_drops() -> None:
    """A checkpoint written with draw version 1 (no ``trial_draw``) cannot go on bit-identically
    where the model draws dropout masks: refused with a line that says why and what to do. A
    model without dropout takes it (nothing it trains depends on the draw)."""
    x = torch.randn(8, 6, dtype=torch.float64)
    fused = fuse([_mlp(0.2, 0), _mlp(0.3, 1)], seed=1)
    fused(x)
    assert fused.trial_draw.tolist() == [rng.DRAW_VERSION] * 2
    old = {k: v for k, v in fused.state_dict().items() if k != rng.DRAW}
    with pytest.raises(FuseError, match="dropout draw version 1.*delete the checkpoint"):
        fuse([_mlp(0.2, 0), _mlp(0.3, 1)]).load_state_dict(old)
    trial = {k: v for k, v in fused.trial_state(1).items() if k != rng.DRAW}
    with pytest.raises(FuseError, match="dropout draw version 1"):
        fused.load_trial_state(0, trial)
    with pytest.raises(FuseError, match="draw version 7"):
        fused.load_trial_state(0, {**trial, rng.DRAW: torch.tensor(7)})
    fused.load_trial_state(0, fused.trial_state(1))  # this draw's: taken
    # no dropout (rate 0 everywhere): the state is taken, and marked this draw's
    plain = fuse([_mlp(0.0, 0), _mlp(0.0, 1)], seed=1)
    plain(x)
    state = {k: v for k, v in plain.state_dict().items() if k != rng.DRAW}
    again = fuse([_mlp(0.0, 0), _mlp(0.0, 1)])
    again(x)
    again.load_state_dict(state)
    again.load_trial_state(1, {k: v for k, v in plain.trial_state(0).items() if k != rng.DRAW})
    assert again.trial_draw.tolist() == [rng.DRAW_VERSION] * 2


@pytest.mark.filterwarnings("ignore:ratio 2 takes")  # the tiny MLP is below the width floor
def test_a_group_checkpoint_of_the_older_draw_is_refused_and_a_trial_one_set_aside(tmp_path):
    """Through the tuner: a group checkpoint written with draw version 1 refuses to resume a
    group with dropout (one line, before any step); a trial checkpoint of version 1 is set
    aside and its trial starts afresh (``resume_slot``). Without dropout either resumes (the
    test above, and tests/tuning/test_faults.py's checkpoint from before random streams)."""
    from hydro.tuning import checkpoint
    from hydro.tuning.lockstep import train_group
    from hydro.tuning.slots import resume_slot
    from tests.tuning.test_data_parallel import dropout_task
    from tests.tuning.test_faults import stopped_at_8

    task, params = dropout_task(steps=8), [{"lr": 1e-2}, {"lr": 3e-2}]
    stopped_at_8(task, params, tmp_path)
    saved = checkpoint.load(tmp_path)
    del saved["model"][rng.DRAW]  # as the hydro before draw version 2 wrote it
    checkpoint.save(tmp_path, saved)
    with pytest.raises(FuseError, match="dropout draw version 1"):
        train_group(task, params, ratio=2, seeds=[0, 1], checkpoint=tmp_path, checkpoint_every=5)

    group = FusedGroup(task, [(0, {"lr": 1e-2}, 0)], ratio=2)
    group.step()
    state = group.trial_state(0)
    del state["model"][rng.DRAW]

    class Files:
        def __init__(self) -> None:
            self.aside: list[str] = []

        def load(self, number, seed, params):
            return state

        def path(self, number):
            (tmp_path / "trial-0.pt").touch()
            return tmp_path / "trial-0.pt"

    fresh = FusedGroup(task, [(0, {"lr": 1e-2}, 0)], ratio=2)
    with pytest.warns(HydroWarning, match="dropout draw version 1"):
        assert resume_slot(fresh, 0, Files()) == 0  # afresh: step 0


def test_per_trial_rates_kept_per_tensor_are_read_again_when_they_change() -> None:
    keys, x = _keys([1, 2])[0], torch.randn(2, 1000, dtype=torch.float64)
    p = torch.tensor([0.1, 0.5], dtype=torch.float64)
    a = rng.dropout(x, p, keys)
    assert torch.equal(rng.dropout(x, p, keys), a)  # kept: the same threshold and scale
    p[1] = 0.0  # in place: a new version of the tensor
    b = rng.dropout(x, p, keys)
    assert torch.equal(b[0], a[0]) and torch.equal(b[1], x[1])
    # another dtype: the same mask; the scale in that dtype (as torch's), so the values agree
    # to its rounding, not bit for bit (x * scale rounds differently in float32 and float64)
    single, double = rng.dropout(x.float(), p, keys), rng.dropout(x, p, keys)
    assert torch.equal(single == 0, double == 0)
    torch.testing.assert_close(single, double.float(), rtol=2e-7, atol=0)

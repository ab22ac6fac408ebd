"""``Task(precision=...)``: the forward pass and the losses run under bfloat16 or float16
autocast in training and evaluation, fused equal to separate within the format's rounding;
parameters and the optimizer stay float32. float16 keeps a loss scale per trial
(:mod:`hydro.tuning.loss_scale`): GradScaler's rule run per trial, an overflow that skips its
own trial's step only, and a scale that a checkpoint carries."""

from __future__ import annotations

import pytest
import torch

from hydro.errors import ConfigError
from hydro.tuning.group import FusedGroup
from hydro.tuning.loss_scale import LossScales
from tests import toy

pytestmark = pytest.mark.usefixtures("one_thread")
PARAMS = [{"lr": 0.01}, {"lr": 0.03}, {"lr": 0.1}]


def _train(task, members, steps=4, scale=None):
    group = FusedGroup(task, members, ratio=2)
    if scale is not None:
        group.scales.scales[:] = torch.tensor(scale)
    losses = [group.step() for _ in range(steps)]
    return group, torch.stack(losses), group.evaluate()


# bf16 keeps 8 bits of mantissa, fp16 11: a bmm and an mm round differently, at that size
@pytest.mark.parametrize("precision, tol", [("bf16", 2e-2), ("fp16", 5e-3)])
def test_fused_equals_separate_within_the_formats_rounding(precision, tol):
    task = toy.task(precision=precision, steps=8, eval_every=4)
    members = [(k, p, k) for k, p in enumerate(PARAMS)]
    group, losses, values = _train(task, members)
    assert all(p.dtype == torch.float32 for p in group.fused.parameters())
    assert losses.dtype == torch.float32
    if precision == "fp16":
        # the toy's first backward at 2**16 overflows float16, as torch's GradScaler would find
        assert group.scales.scales.tolist() == [2.0**15] * 3
    for k, member in enumerate(members):
        _, alone, value = _train(task, [member])
        torch.testing.assert_close(losses[:, k], alone[:, 0], rtol=tol, atol=tol)
        assert values[k] == pytest.approx(value[0], rel=tol)
    # autocast was on: the same weights in float32 give other numbers
    _, fp32, _ = _train(toy.task(steps=8, eval_every=4), members)
    assert not torch.equal(fp32[0], losses[0])
    torch.testing.assert_close(fp32[0], losses[0], rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "value, message",
    [("float16", "did you mean .fp16."), ("int8", "precision must be one of fp32")],
)
def test_other_precisions_are_refused(value, message):
    with pytest.raises(ConfigError, match=message):
        toy.task(precision=value)


def test_the_rule_is_torch_gradscalers_per_trial():
    """The same overflow sequence gives each trial the scale torch's own update gives."""
    pattern = torch.tensor([[False, True, False], [False, False, True], [True, False, False],
                            [False, False, False], [False, True, True]])
    mine = LossScales(3, "cpu", init=1024.0, interval=2)
    theirs = [(torch.full((1,), 1024.0), torch.zeros(1, dtype=torch.int32)) for _ in range(3)]
    for found in pattern:
        mine.update(found)
        for k, (scale, tracker) in enumerate(theirs):
            torch._amp_update_scale_(scale, tracker, found[k : k + 1].float(), 2.0, 0.5, 2)
        assert mine.scales.tolist() == [float(s) for s, _ in theirs]
        assert mine.clean.tolist() == [int(t) for _, t in theirs]


def test_an_overflow_skips_its_own_trials_step_only():
    """Trial 1 starts at a scale that overflows float16: its steps are skipped (weights and
    optimizer state untouched, not failed) while it backs off; the others train as without it."""
    task = toy.task(precision="fp16", steps=8, eval_every=4)
    members = [(k, p, k) for k, p in enumerate(PARAMS)]
    start = FusedGroup(task, members, ratio=2).trial_state(1)
    huge = 2.0**50
    group, losses, _ = _train(task, members, steps=2, scale=[2.0**10, huge, 2.0**10])
    assert not bool(group.fused.diverged.any())
    assert group.scales.scales[1].item() == huge / 4  # two overflows: halved twice
    after = group.trial_state(1)
    for name, value in start["model"].items():
        if torch.is_tensor(value) and value.is_floating_point():
            assert torch.equal(value, after["model"][name]), name  # no update
    assert after["loss_scale"] == {"scale": huge / 4, "clean": 0}
    plain, plain_losses, _ = _train(task, members, steps=2, scale=[2.0**10] * 3)
    torch.testing.assert_close(losses[:, [0, 2]], plain_losses[:, [0, 2]], rtol=0, atol=0)
    for k in (0, 2):
        for name, value in group.trial_state(k)["model"].items():
            if torch.is_tensor(value):
                assert torch.equal(value, plain.trial_state(k)["model"][name]), name


def test_a_checkpoint_carries_the_scale():
    task = toy.task(precision="fp16", steps=8, eval_every=4)
    members = [(k, p, k) for k, p in enumerate(PARAMS)]
    group, _, _ = _train(task, members, steps=2, scale=[2.0**60, 2.0**16, 2.0**16])
    state = group.trial_state(0)
    other = FusedGroup(task, [(9, PARAMS[1], 9)], ratio=2)
    other.resume(0, state)
    assert other.scales.trial_state(0) == state["loss_scale"] == group.scales.trial_state(0)
    torch.testing.assert_close(other.step(), group.step()[:1], rtol=0, atol=0)


def test_a_search_trains_in_fp16_from_a_config(tmp_path, monkeypatch):
    import optuna

    import hydro
    from hydro.tuning import config

    text = toy.config("toymod", task="  precision: fp16\n")
    toy.project(tmp_path, monkeypatch, "toymod", toy.source(), text)
    cfg = config.load("tune.yaml")
    assert cfg.task.precision == "fp16"
    study = optuna.create_study()
    hydro.tune(toy.task(precision="fp16", steps=8, eval_every=4),
               {"lr": optuna.distributions.FloatDistribution(1e-3, 1e-1, log=True)},
               n_trials=4, ratio=2, fuse=2, seed=1, study=study, progress=False)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 4 and all(t.value == t.value for t in done)  # finite, not NaN

"""``Task(precision="bf16")`` (issue 34, point 6): the forward pass and the losses run under
bfloat16 autocast in training and evaluation, fused equal to separate within bfloat16's
rounding; parameters and the optimizer stay float32; float16 is refused, naming why."""

from __future__ import annotations

import pytest
import torch

from hydro.errors import ConfigError
from hydro.tuning.group import FusedGroup
from tests import toy

pytestmark = pytest.mark.usefixtures("one_thread")
PARAMS = [{"lr": 0.01}, {"lr": 0.03}, {"lr": 0.1}]


def _train(task, members, steps=4):
    group = FusedGroup(task, members, ratio=2)
    losses = [group.step() for _ in range(steps)]
    return group, torch.stack(losses), group.evaluate()


def test_bf16_fused_equals_separate_within_its_rounding():
    task = toy.task(precision="bf16", steps=8, eval_every=4)
    members = [(k, p, k) for k, p in enumerate(PARAMS)]
    group, losses, values = _train(task, members)
    assert all(p.dtype == torch.float32 for p in group.fused.parameters())
    assert losses.dtype == torch.float32
    for k, member in enumerate(members):
        _, alone, value = _train(task, [member])
        # bf16 keeps 8 bits of mantissa: a bmm and an mm round differently, at that size
        torch.testing.assert_close(losses[:, k], alone[:, 0], rtol=2e-2, atol=2e-2)
        assert values[k] == pytest.approx(value[0], rel=2e-2)
    # autocast was on: the same trials in float32 give other numbers
    _, fp32, _ = _train(toy.task(steps=8, eval_every=4), members)
    assert not torch.equal(fp32, losses)
    torch.testing.assert_close(fp32, losses, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize(
    "value, message",
    [("fp16", "float16 needs loss scaling per trial"), ("int8", "precision must be one of fp32")],
)
def test_other_precisions_are_refused(value, message):
    with pytest.raises(ConfigError, match=message):
        toy.task(precision=value)

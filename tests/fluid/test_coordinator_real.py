"""A real 2-stage gloo pipeline with a fused guest trial group in its receive waits."""

import pytest
import torch

from examples.coordinator.pipeline import run_pipeline

SETTINGS = dict(steps=3, micro_batches=4, width=1024, batch=128, warmup=2, seed=3)


def test_guest_trains_in_the_bubbles_and_leaves_the_host_bit_identical():
    alone, shared = run_pipeline(guest=[False, True], guest_trials=4, **SETTINGS)
    for stage in range(2):
        assert alone.params[stage].keys() == shared.params[stage].keys()
        for name, value in alone.params[stage].items():
            assert torch.equal(value, shared.params[stage][name]), (stage, name)
    # the host really trained: its weights moved from their initialization
    torch.manual_seed(SETTINGS["seed"])
    first = torch.nn.Linear(32, 1024).weight
    assert not torch.equal(first, alone.params[0]["0.weight"])
    assert alone.guest_steps == [0, 0] and alone.trial_steps == 0
    # the guest runs where a bubble had room for two of its steps; a loaded machine can balance
    # the stages until no wait has room, and then it rightly stays out
    for stage in range(2):
        roomy = any(w > 2 * shared.guest_step[stage] for w in shared.expected_wait[stage].values())
        if roomy:
            assert shared.guest_steps[stage] > 0, (stage, shared.expected_wait[stage])
            assert shared.guest_loss[stage] is not None
    assert shared.trial_steps == 4 * sum(shared.guest_steps)
    for steps, loss in zip(shared.guest_steps, shared.guest_loss):
        if steps >= 10:  # the guest learns: its mean loss over the trials falls
            assert loss[1] < loss[0]
    assert len(shared.iteration_times) == SETTINGS["steps"]
    assert (sum(shared.guest_time) > 0) == (sum(shared.guest_steps) > 0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="steps must be >= 1"):
        run_pipeline(steps=0)
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        run_pipeline(micro_batches=0)
    with pytest.raises(ValueError, match="guest_trials"):
        run_pipeline(guest_trials=0)
    with pytest.raises(ValueError, match="empty sequence"):
        run_pipeline(guest=[])

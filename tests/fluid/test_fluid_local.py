"""LocalExecutor with real worker processes on the CPU: packing, pruning, kills, OOM, DDP."""

import functools
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hydro_fluid import LocalExecutor, TrialGroup

# --- worker functions (module level, so worker processes can unpickle them) ---------------


def wait_for_peers(folder: Path, name: str, peers: int, timeout: float = 60.0) -> None:
    """Block until ``peers`` workers have checked in, which proves they run at the same time."""
    (folder / name).touch()
    deadline = time.monotonic() + timeout
    while len(list(folder.iterdir())) < peers:
        if time.monotonic() > deadline:
            raise RuntimeError("peers never showed up: the groups did not run concurrently")
        time.sleep(0.02)


def train_fused_regression(group, ctx, barrier: str, steps: int = 30):
    """A real fused model: one linear regression per trial, trained together with bmm."""
    wait_for_peers(Path(barrier), ctx.group_name, peers=2)
    torch.manual_seed(0)
    n = group.size
    x = torch.randn(64, 4)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
    w = torch.zeros(n, 4, 1, requires_grad=True)
    lrs = torch.tensor([0.01 * (i + 1) for i in range(n)]).view(n, 1, 1)
    first = last = None
    for step in range(steps):
        pred = torch.bmm(x.expand(n, -1, -1), w).squeeze(-1)  # (n, 64)
        losses = ((pred - y) ** 2).mean(dim=1)
        losses.sum().backward()
        with torch.no_grad():
            w -= lrs * w.grad
            w.grad.zero_()
        for i, trial in enumerate(group.trial_ids):
            ctx.report(trial, step, losses[i].item())
        first = losses.detach() if first is None else first
        last = losses.detach()
    return {
        "threads": torch.get_num_threads(),
        "device": ctx.device,
        "first": first.tolist(),
        "last": last.tolist(),
    }


def slow_counter(group, ctx, steps: int = 40):
    """Reports every live trial each step; returns the last step each trial was trained."""
    last = {}
    for step in range(steps):
        for trial in group.trial_ids:
            if not ctx.is_pruned(trial):
                ctx.report(trial, step, float(step))
                last[trial] = step
        time.sleep(0.03)
    return last


def checkpointed_counter(group, ctx, pid_file: str, steps: int = 30):
    Path(pid_file).write_text(str(os.getpid()))
    state = ctx.load_checkpoint() or {"step": 0}
    for step in range(state["step"], steps):
        ctx.report(group.trial_ids[0], step, float(step))
        ctx.save_checkpoint({"step": step + 1})
        time.sleep(0.05)
    return {"resumed_from": state["step"], "attempt": ctx.attempt}


def kill_myself(group, ctx):
    os.kill(os.getpid(), signal.SIGKILL)


def divide_by_zero(group, ctx):
    return 1 / 0


def quick(group, ctx):
    return group.size


def runs_out_of_memory_above(group, ctx, limit: int, huge=()):
    if group.size > limit or set(huge) & set(group.trial_ids):
        raise MemoryError(f"{group.size} fused trials do not fit")
    return sorted(group.trial_ids)


def ddp_gradient(group, ctx):
    """One data-parallel step: each rank takes half the batch, DDP averages the gradients."""
    assert ctx.world_size == 2 and dist.get_world_size() == 2 and dist.get_rank() == ctx.rank
    model = make_model()
    x, y = make_batch()
    half = len(x) // 2
    shard = slice(ctx.rank * half, (ctx.rank + 1) * half)
    ddp = nn.parallel.DistributedDataParallel(model)
    loss = nn.functional.mse_loss(ddp(x[shard]), y[shard])
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def make_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)


# --- tests --------------------------------------------------------------------------------


def test_two_fused_groups_run_at_once_with_threads_split(tmp_path):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    groups = [TrialGroup("a", (0, 1, 2), (30, 30, 30)), TrialGroup("b", (3, 4), (30, 30))]
    reports = []
    executor = LocalExecutor(devices=[], num_workers=2, threads=4)
    results = executor.run(
        groups,
        functools.partial(train_fused_regression, barrier=str(barrier)),
        report=lambda trial, step, value: reports.append((trial, step, value)),
    )
    assert [r.group.name for r in results] == ["a", "b"]
    for result in results:
        assert result.ok and result.attempts == 1
        assert result.value["threads"] == 2  # 4 threads split over 2 workers
        assert result.value["device"] == "cpu"
        assert all(
            last < first
            for first, last in zip(result.value["first"], result.value["last"], strict=True)
        )
        assert all(o.state == "COMPLETE" for o in result.trials.values())
    # Every value of every trial streamed back, in step order per trial.
    for trial in range(5):
        steps = [s for t, s, _ in reports if t == trial]
        assert steps == list(range(30))


def test_pruned_trial_is_dropped_by_the_worker():
    group = TrialGroup("g", ("keep", "drop"), (40, 40))

    def report(trial, step, value):
        return trial == "drop" and step >= 3

    [result] = LocalExecutor(devices=[], num_workers=1).run([group], slow_counter, report=report)
    assert result.trials["drop"].state == "PRUNED"
    assert result.trials["keep"].state == "COMPLETE"
    assert result.value["keep"] == 39
    assert result.value["drop"] < 39  # the worker saw the pruning and stopped training it


def test_killed_worker_resumes_from_its_checkpoint(tmp_path):
    pid_file = tmp_path / "pid"
    killed = []

    def kill_at_step_5(trial, step, value):
        if step == 5 and not killed:
            pid = int(pid_file.read_text())
            os.kill(pid, signal.SIGKILL)  # a real worker process, really killed
            killed.append(pid)

    executor = LocalExecutor(
        devices=[], num_workers=1, max_retries=1, checkpoint_dir=tmp_path / "ckpt"
    )
    [result] = executor.run(
        [TrialGroup("g", (7,), (30,))],
        functools.partial(checkpointed_counter, pid_file=str(pid_file)),
        report=kill_at_step_5,
    )
    assert killed
    assert result.ok and result.attempts == 2
    assert result.trials[7].state == "COMPLETE"
    assert result.value["attempt"] == 1
    assert result.value["resumed_from"] >= 5  # not from scratch
    assert (tmp_path / "ckpt" / "g" / "checkpoint.pt").exists()


def test_worker_that_keeps_dying_fails_its_trials_with_a_reason():
    executor = LocalExecutor(devices=[], num_workers=2, max_retries=1)
    results = executor.run([TrialGroup("doomed", (0, 1), (5, 5))], kill_myself)
    [result] = results
    assert result.attempts == 2 and not result.ok
    assert "killed by signal 9" in result.error
    for outcome in result.trials.values():
        assert outcome.state == "FAIL" and "killed by signal 9" in outcome.reason


def test_exception_in_fn_fails_with_traceback_and_others_still_run():
    groups = [TrialGroup("bad", (0,), (1,)), TrialGroup("good", (1,), (1,))]
    results = LocalExecutor(devices=[], num_workers=2, max_retries=0).run(groups, divide_by_zero)
    assert all("ZeroDivisionError" in r.error for r in results)
    results = LocalExecutor(devices=[], num_workers=1, max_retries=0).run(groups[1:], quick)
    assert results[0].value == 1


def test_out_of_memory_halves_the_group_and_loses_no_trial():
    groups = [TrialGroup("big", tuple(range(8)), (10,) * 8), TrialGroup("huge", (99,), (10,))]
    executor = LocalExecutor(devices=[], num_workers=2)
    results = executor.run(groups, functools.partial(runs_out_of_memory_above, limit=2, huge=[99]))
    by_name = {r.group.name: r for r in results}
    assert sorted(by_name) == ["big/0/0", "big/0/1", "big/1/0", "big/1/1", "huge"]
    done = sorted(t for r in results if r.ok for t in r.value)
    assert done == list(range(8))
    assert all(r.trials[t].state == "COMPLETE" for r in results if r.ok for t in r.value)
    huge = by_name["huge"]
    assert huge.trials[99].state == "FAIL"
    assert "out of memory even with a single trial" in huge.trials[99].reason


def test_data_parallel_gloo_gradients_equal_full_batch_gradients():
    group = TrialGroup("dp", (0,), (1,))
    [result] = LocalExecutor(devices=[], num_workers=2).run([group], ddp_gradient, world_size=2)
    assert result.ok, result.error
    model = make_model()
    x, y = make_batch()
    nn.functional.mse_loss(model(x), y).backward()
    for averaged, full in zip(result.value, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(averaged, full, rtol=1e-5, atol=1e-6)


def test_bad_input_raises_clear_errors():
    executor = LocalExecutor(devices=[], num_workers=2)
    group = TrialGroup("g", (0,), (1,))
    with pytest.raises(ValueError, match="world_size=3"):
        executor.run([group], quick, world_size=3)
    with pytest.raises(ValueError, match="picklable"):
        executor.run([group], lambda g, ctx: None)
    with pytest.raises(ValueError, match="one group"):
        executor.run([group, TrialGroup("h", (0,), (1,))], quick)
    with pytest.raises(ValueError, match="TrialGroup"):
        executor.run(["not a group"], quick)
    with pytest.raises(ValueError, match="cuda:0"):
        LocalExecutor(devices=["tpu0"])
    with pytest.raises(ValueError, match="max_retries"):
        LocalExecutor(devices=[], max_retries=-1)

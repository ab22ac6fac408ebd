"""``data_mode: shared`` (issue 21 point 4): a fused group loads one batch per step for all its
members, and each member then trains exactly as the same trial alone on that sequence of
batches (float64, step by step). Per-trial streams stay the default."""

from __future__ import annotations

import copy
from collections import Counter

import optuna
import pytest
import torch
from optuna.distributions import FloatDistribution

import hydro
from hydro.errors import ConfigError
from hydro.tuning.group import FusedGroup
from hydro.tuning.slots import _group_state, _restore_group

optuna.logging.set_verbosity(optuna.logging.WARNING)
BATCH = 8


class Loader:
    """A data function ``batch_size -> batches`` that counts the batches it makes (a loader
    that decodes and augments pays per batch). Its order is fixed: every stream reads the same
    sequence, so a trial alone sees what a shared group's members see."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y, self.loads = x, y, Counter()

    def __call__(self, batch_size: int):  # a generator
        for i in range(0, len(self.y) - batch_size + 1, batch_size):
            self.loads[batch_size] += 1
            yield self.x[i : i + batch_size].flip(0), self.y[i : i + batch_size].flip(0)


def make_task(data_mode: str = "per_trial", steps: int = 6) -> tuple[hydro.Task, Loader]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g, dtype=torch.float64)
    y = (x @ torch.randn(8, 3, generator=g, dtype=torch.float64)).argmax(-1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 3)).double()
    loader = Loader(x[:64], y[:64])
    task = hydro.Task(model=model, train_data=loader, val_data=(x[64:], y[64:]), steps=steps,
                      batch_size=BATCH, eval_every=3, data_mode=data_mode)
    return task, loader


MEMBERS = [(0, {"lr": 3e-2, "warmup": 1}, 10), (1, {"lr": 1e-2}, 11),
           (2, {"lr": 5e-2, "weight_decay": 0.1}, 12), (3, {"lr": 2e-3}, 13)]


def run(group: FusedGroup, steps: int) -> tuple[torch.Tensor, list[float]]:
    """``steps`` steps: the losses ``[steps, n]`` and every member's validation value."""
    losses = torch.stack([group.step() for _ in range(steps)])
    return losses, group.evaluate()


def test_shared_group_loads_one_batch_per_step_and_equals_each_trial_alone():
    """Every stream of this loader reads one sequence, so with per-trial streams each member
    trains as it would alone (per-trial exactness, tests/tuning/test_continuous_batching.py),
    here checked once more against one trial in a group of its own."""
    steps = 6  # fewer than the loader's 8 batches per epoch: one epoch, one call
    task, loader = make_task("shared", steps)
    group = FusedGroup(task, MEMBERS, ratio=2)
    loader.loads.clear()
    losses, values = run(group, steps)
    assert loader.loads[BATCH] == steps  # one load per step for the whole group of 4
    per_trial, counted = make_task("per_trial", steps)
    separate = FusedGroup(per_trial, MEMBERS, ratio=2)
    counted.loads.clear()
    separate_losses, separate_values = run(separate, steps)
    assert counted.loads[BATCH] == steps * len(MEMBERS)  # the default: one stream per trial
    alone = FusedGroup(per_trial, MEMBERS[2:3], ratio=2, like=separate)
    alone_losses, _ = run(alone, steps)
    torch.testing.assert_close(losses[:, 2], alone_losses[:, 0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(losses, separate_losses, rtol=1e-10, atol=1e-12)
    assert values == pytest.approx(separate_values, rel=1e-10)
    for k in range(len(MEMBERS)):
        for name, p in separate.fused.trial(k).state_dict().items():
            assert p.dtype == torch.float64
            torch.testing.assert_close(group.fused.trial(k).state_dict()[name], p, rtol=1e-10,
                                       atol=1e-12, msg=name)


def tensor_task(data_mode: str) -> hydro.Task:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 8, generator=g, dtype=torch.float64)
    y = (x @ torch.randn(8, 3, generator=g, dtype=torch.float64)).argmax(-1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 3)).double()
    return hydro.Task(model=model, train_data=(x, y), val_data=(x[:32], y[:32]), steps=8,
                      batch_size=BATCH, data_mode=data_mode)


def test_shared_stream_is_the_groups_and_a_restored_group_goes_on_with_it():
    """Random batches from tensors: a shared group reads its first member's seed's stream (the
    same composition and seed, the same batches); a group rebuilt from its checkpoint, with
    another member first, goes on with that stream bit for bit."""
    task = tensor_task("shared")
    members = [(5, {"lr": 1e-2}, 21), (6, {"lr": 3e-2}, 22)]
    group = FusedGroup(task, members, ratio=2)
    # one trial alone on its per-trial stream, seed 21: the shared group's member 0 exactly
    alone = FusedGroup(tensor_task("per_trial"), members[:1], ratio=2)
    first, _ = run(group, 3)
    torch.testing.assert_close(first[:, 0], run(alone, 3)[0][:, 0], rtol=1e-10, atol=1e-12)
    saved = copy.deepcopy(_group_state(group))  # as written to disk: not the live tensors
    rest, _ = run(group, 3)
    rebuilt = FusedGroup(task, members[::-1], ratio=2)  # seed 22 first: another stream as built
    rebuilt.put(0, *members[0])  # the checkpoint's members in their slots
    rebuilt.put(1, *members[1])
    _restore_group(rebuilt, saved)
    assert rebuilt.data_seed == 21
    torch.testing.assert_close(run(rebuilt, 3)[0], rest, rtol=0, atol=0)


def test_data_mode_is_checked_recorded_with_each_trial_and_travels_to_executors(tmp_path):
    from hydro_fluid import LocalExecutor

    with pytest.raises(ConfigError, match=r"^data_mode must be 'per_trial' .* got 'group'$"):
        tensor_task("group")
    space = {"lr": FloatDistribution(1e-3, 1e-1, log=True)}
    kw = {"n_trials": 2, "ratio": 2, "fuse": 2, "seed": 0}
    storage = f"sqlite:///{tmp_path / 'h.db'}"
    trials = hydro.tune(tensor_task("shared"), space, storage=storage, **kw).study.trials
    assert [t.user_attrs.get("data_mode") for t in trials] == ["shared", "shared"]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    # a worker process trains the group the same way: the mode travels with the task
    ex = LocalExecutor(devices=[], num_workers=1)
    remote = hydro.tune(tensor_task("shared"), space, executor=ex,
                        storage=f"sqlite:///{tmp_path / 'ex.db'}", **kw).study.trials
    assert [t.value for t in remote] == pytest.approx([t.value for t in trials], rel=1e-9)
    per_trial = hydro.tune(tensor_task("per_trial"), space,
                           storage=f"sqlite:///{tmp_path / 'p.db'}", **kw).study.trials
    assert per_trial[1].value != pytest.approx(trials[1].value, rel=1e-6)  # other batches
    # a resume in the other mode would mix them: refused, naming the change
    with pytest.raises(ConfigError, match="changed: recipe data_mode shared→per_trial"):
        hydro.tune(tensor_task("per_trial"), space, storage=storage, **{**kw, "n_trials": 3})


def test_config_key_data_mode(tmp_path, monkeypatch, capsys):
    """``task.data_mode: shared`` in a config reaches the Task; a bad value exits 2, one line."""
    from hydro.cli import main
    from hydro.tuning.config import load

    (tmp_path / "sharedmod.py").write_text(
        "import torch\n"
        "def model():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),"
        " torch.nn.Linear(8, 2))\n"
        "def data():\n"
        "    x = torch.randn(32, 4)\n"
        "    y = torch.randint(0, 2, (32,))\n"
        "    return {'train': (x, y), 'val': (x, y)}\n"
    )
    config = (
        "task:\n  model: sharedmod:model\n  data: sharedmod:data\n  steps: 2\n"
        "  data_mode: {mode}\nspace:\n  lr: {{type: float, low: 0.001, high: 0.1}}\n"
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tune.yaml").write_text(config.format(mode="shared"))
    assert load("tune.yaml").task.data_mode == "shared"
    (tmp_path / "tune.yaml").write_text(config.format(mode="per-trial"))
    assert main(["tune", "tune.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("hydro tune: error: tune.yaml: task: data_mode must be 'per_trial'")
    assert "got 'per-trial'" in err


def test_train_group_resumed_from_its_checkpoint_goes_on_with_the_shared_stream(tmp_path):
    """``train_group`` stopped after a checkpoint at step 3 and run again ends exactly as
    a run never stopped: the group's stream is read up to the checkpoint's step."""
    from hydro.tuning.lockstep import train_group

    task = tensor_task("shared")
    params, seeds = [{"lr": 1e-2}, {"lr": 3e-2}], [4, 5]
    full, _ = train_group(task, params, ratio=2, seeds=seeds)

    class Stop(Exception):
        pass

    def stop_at_4(k: int, step: int, value: float) -> bool:
        if step == 4:
            raise Stop
        return False

    task = tensor_task("shared")  # evaluations every 2 steps (steps // 4)
    with pytest.raises(Stop):
        train_group(task, params, ratio=2, seeds=seeds, report=stop_at_4, checkpoint=tmp_path,
                    checkpoint_every=3)
    again, _ = train_group(task, params, ratio=2, seeds=seeds, checkpoint=tmp_path,
                           checkpoint_every=3)
    assert [(o.state, o.value, o.history) for o in again] == [
        (o.state, o.value, o.history) for o in full]

"""Continuous batching: a freed slot of a fused group takes a new trial, which then trains
exactly as it would alone (float64, step by step), without disturbing the other slots."""

from __future__ import annotations

import optuna
import pytest
import torch
from optuna.distributions import FloatDistribution, IntDistribution
from optuna.trial import TrialState

import hydro
from hydro.errors import ConfigError
from hydro.integrations.optuna import optimize
from hydro.tuning.group import FusedGroup
from hydro.tuning.lockstep import train_group

optuna.logging.set_verbosity(optuna.logging.WARNING)


def make_task(steps: int = 12, dtype: torch.dtype = torch.float64, **kw) -> hydro.Task:
    """A dropout-free MLP; float64 model and data so that per-trial exactness can be checked
    to 1e-9."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g, dtype=dtype)
    y = (x @ torch.randn(8, 3, generator=g, dtype=dtype)).argmax(-1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 3)).to(dtype)
    kw.setdefault("eval_every", 4)
    kw.setdefault("batch_size", 16)
    return hydro.Task(model=model, train_data=(x[:192], y[:192]), val_data=(x[192:], y[192:]),
                      steps=steps, **kw)


def trajectory(group: FusedGroup, slot: int, steps: int) -> list[tuple[float, dict]]:
    """``steps`` steps of ``group``: slot ``slot``'s loss and parameters after each."""
    out = []
    for _ in range(steps):
        loss = float(group.step()[slot])
        out.append((loss, {k: v.clone() for k, v in group.fused.trial(slot).state_dict().items()}))
    return out


def assert_same(a: list[tuple[float, dict]], b: list[tuple[float, dict]]) -> None:
    assert len(a) == len(b)
    for step, ((la, pa), (lb, pb)) in enumerate(zip(a, b)):
        assert la == pytest.approx(lb, rel=1e-9, abs=1e-12), step
        assert pa.keys() == pb.keys()
        for name in pa:
            assert pa[name].dtype == torch.float64
            torch.testing.assert_close(pa[name], pb[name], rtol=1e-9, atol=1e-12,
                                       msg=f"{name} at step {step + 1}")


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_late_trial_equals_that_trial_alone(optimizer):
    task = make_task(scheduler="cosine", optimizer=optimizer)
    a = {"lr": 3e-2, "weight_decay": 0.1, "warmup": 2}
    b = {"lr": 1e-2, "weight_decay": 0.0}
    late = {"lr": 5e-2, "weight_decay": 0.05, "warmup": 3, "grad_clip": 0.5}
    if optimizer == "sgd":
        late["momentum"] = 0.9
    group = FusedGroup(task, [(0, a, 10), (1, b, 11)], ratio=2)
    first = trajectory(group, 0, 5)
    group.put(1, 2, late, 12)  # trial 2 joins late, in the slot trial 1 had
    both = trajectory(group, 1, task.steps)
    alone = FusedGroup(task, [(2, late, 12)], ratio=2)
    assert_same(both, trajectory(alone, 0, task.steps))
    # the slot that kept its trial went on as if nothing happened: trial 0 alone, same steps
    group0 = FusedGroup(task, [(0, a, 10)], ratio=2)
    assert_same(first, trajectory(group0, 0, 5))


def test_result_does_not_depend_on_slot_or_group():
    """A trial trained in slot 2 of a group of three equals it trained first in a group of two
    with other companions, and alone: seed and parameters alone decide."""
    task = make_task(steps=8)
    p = {"lr": 2e-2, "weight_decay": 0.05, "warmup": 1}
    g3 = FusedGroup(task, [(0, {"lr": 1e-3}, 1), (1, {"lr": 1e-1}, 2), (7, p, 7)], ratio=2)
    g2 = FusedGroup(task, [(7, p, 7), (3, {"lr": 3e-3, "warmup": 4}, 3)], ratio=2)
    g1 = FusedGroup(task, [(7, p, 7)], ratio=2)
    t1 = trajectory(g1, 0, 8)
    assert_same(trajectory(g3, 2, 8), t1)
    assert_same(trajectory(g2, 0, 8), t1)


def test_member_data_orders_differ():
    task = make_task()
    group = FusedGroup(task, [(0, {"lr": 1e-2}, 0), (1, {"lr": 1e-2}, 1)], ratio=2)
    x0 = next(group.members[0].batches)[0]
    x1 = next(group.members[1].batches)[0]
    assert not torch.equal(x0, x1)


def test_put_refuses_a_trial_of_another_structure():
    task = make_task()
    group = FusedGroup(task, [(0, {"lr": 1e-2}, 0)], ratio=2)
    with pytest.raises(ConfigError, match="cannot join this fused group"):
        group.put(0, 1, {"lr": 1e-2, "batch_size": 8}, 1)


def test_pruned_study_keeps_groups_full_and_trials_reproducible():
    task = make_task(steps=12)
    space = {"lr": FloatDistribution(1e-3, 3e-1, log=True), "warmup": IntDistribution(0, 3)}
    study = optuna.create_study(
        sampler=optuna.samplers.TPESampler(seed=0),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=0),
    )
    # first_group=0: groups of 4 from the start (else the pruner's start-up of 3 trains
    # alone first, leaving a slot empty)
    optimize(study, task, space, n_trials=16, ratio=2, fuse=4, seed=5, first_group=0)
    trials = study.trials
    assert len(trials) == 16 and all(t.state.is_finished() for t in trials)
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    assert pruned, "the median pruner should stop some trials"
    occ = study.user_attrs["hydro_occupancy"]
    # one architecture: every freed slot is refilled until the budget is spent
    assert occ["while_asking"] == 1.0 and occ["fuse"] == 4
    assert 0.5 < occ["overall"] <= 1.0
    groups = {t.user_attrs["group"] for t in trials}
    assert len(groups) == 1  # a single group trained the whole study
    # a trial that joined late (after trial 3 was asked) equals the same trial trained alone
    late = [t for t in trials if t.state == TrialState.COMPLETE and t.number >= 4]
    assert late
    for t in late[:2]:
        (alone,), _ = train_group(task, [t.params], ratio=2, seeds=[5 + t.number])
        assert alone.state == "complete"
        assert alone.value == pytest.approx(t.value, rel=1e-9)
        assert [v for _, v in alone.history] == pytest.approx(
            [t.intermediate_values[s] for s, _ in alone.history], rel=1e-9
        )


# -- device ------------------------------------------------------------------------------------


def test_device_cpu_and_a_clear_error_for_missing_cuda():
    from hydro.tuning.group import check_device

    assert check_device("cpu") == "cpu"
    with pytest.raises(ConfigError, match="not a torch device"):
        check_device("gpu0")
    with pytest.raises(ConfigError, match="'cpu' or 'cuda"):
        check_device("meta")
    task = make_task(steps=4)
    space = {"lr": FloatDistribution(1e-3, 1e-1, log=True)}
    result = hydro.tune(task, space, n_trials=2, ratio=2, fuse=2, storage="sqlite:///:memory:",
                        device="cpu")
    assert len(result.study.trials) == 2
    assert result.occupancy["fuse"] == 2 and result.occupancy["overall"] == 1.0
    if torch.cuda.is_available():
        assert check_device("cuda").startswith("cuda")
        return
    with pytest.raises(ConfigError, match="CUDA is not available"):
        check_device("cuda")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        hydro.tune(task, space, n_trials=2, ratio=2, storage="sqlite:///:memory:", device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error path needs a machine without CUDA")
def test_cli_device_flag_and_config_key(tmp_path, monkeypatch, capsys):
    from hydro.cli import main
    from tests.cli.test_commands import CONFIG, TOY

    (tmp_path / "toymod.py").write_text(TOY)
    (tmp_path / "tune.yaml").write_text(CONFIG)
    (tmp_path / "gpu.yaml").write_text("device: cuda\n" + CONFIG)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "toymod", raising=False)
    assert main(["tune", "tune.yaml", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert main(["tune", "gpu.yaml"]) == 2
    err = capsys.readouterr().err
    assert "gpu.yaml: device:" in err and "CUDA is not available" in err
    assert main(["tune", "gpu.yaml", "--device", "cpu", "--trials", "2"]) == 0


def _mlp(width: int = 16) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 3)).double()


def test_trials_that_do_not_fit_wait_for_a_group_of_their_own():
    from optuna.distributions import CategoricalDistribution

    base = make_task(steps=4)
    task = hydro.Task(model=_mlp, train_data=base.train_data, val_data=base.val_data, steps=4,
                      eval_every=2, batch_size=16)
    space = {"lr": FloatDistribution(1e-3, 1e-1, log=True),
             "width": CategoricalDistribution([16, 32])}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1),
                                pruner=optuna.pruners.NopPruner())
    optimize(study, task, space, n_trials=10, ratio=2, fuse=3)
    trials = study.trials
    assert len(trials) == 10 and all(t.state == TrialState.COMPLETE for t in trials)
    by_group: dict[int, set] = {}
    for t in trials:
        by_group.setdefault(t.user_attrs["group"], set()).add(t.params["width"])
    assert len(by_group) >= 2 and all(len(widths) == 1 for widths in by_group.values())


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_group_that_grows_and_shrinks_trains_each_trial_as_alone(optimizer):
    """``add`` grows a group by a slot, ``drop`` shrinks it: a trial that joins a group of one,
    sees a neighbour leave and another join, equals it trained alone, step by step (float64)."""
    task = make_task(scheduler="cosine", optimizer=optimizer)
    a = {"lr": 3e-2, "weight_decay": 0.1, "warmup": 2}
    b = {"lr": 1e-2, "weight_decay": 0.0, "warmup": 3, "grad_clip": 0.5}
    c = {"lr": 5e-2, "weight_decay": 0.05}
    if optimizer == "sgd":
        b["momentum"] = 0.9
    group = FusedGroup(task, [(0, a, 10)], ratio=2)
    first = trajectory(group, 0, 3)
    assert group.add(1, b, 11) == 1 and group.n == 2  # trial 1 joins a group of one
    seen = trajectory(group, 1, 4)
    group.drop([0])  # trial 0 leaves: trial 1 is now in slot 0
    seen += trajectory(group, 0, 2)
    assert group.add(2, c, 12) == 1  # and another joins beside it
    seen += trajectory(group, 0, task.steps - 6)
    assert [m.id for m in group.members] == [1, 2]
    assert_same(seen, trajectory(FusedGroup(task, [(1, b, 11)], ratio=2), 0, task.steps))
    assert_same(first, trajectory(FusedGroup(task, [(0, a, 10)], ratio=2), 0, 3))
    # the trial that joined last, and the one that had the group to itself, as alone
    grown = FusedGroup(task, [(0, a, 10)], ratio=2)
    grown.add(2, c, 12)
    both = trajectory(grown, 1, 5)
    assert_same(both, trajectory(FusedGroup(task, [(2, c, 12)], ratio=2), 0, 5))


def test_add_refuses_another_key_and_an_empty_group():
    task = make_task()
    group = FusedGroup(task, [(0, {"lr": 1e-2}, 0)], ratio=2)
    with pytest.raises(ConfigError, match="cannot join this fused group"):
        group.add(1, {"lr": 1e-2, "batch_size": 8}, 1)
    assert group.n == 1  # nothing changed
    group.drop([0])
    with pytest.raises(ConfigError, match="no slot left"):
        group.add(1, {"lr": 1e-2}, 1)

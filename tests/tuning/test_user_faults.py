"""User code that raises while a group trains, and corrupt group checkpoints (issue 19, points
3 and 5): the trials fail with one line naming the trial, the group, the callable and the
user's file:line; the study goes on, unless every trial failed alike (then the run stops with
that line); an executor does not retry such an error; an unusable group checkpoint is moved
aside and its group starts from step 0."""

from __future__ import annotations

import functools
import os
import pickle
import sys
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState

import hydro
from hydro.errors import UserCodeError
from hydro.integrations.optuna import optimize
from hydro.tuning import checkpoint
from hydro.tuning.group import FusedGroup
from tests.tuner_child import SPACE, make_task

optuna.logging.set_verbosity(optuna.logging.WARNING)
HERE = os.path.basename(__file__)


def _line(marker: str) -> int:
    """The line of this file holding ``marker`` (where a test's user code raises)."""
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if marker in text and "_line(" not in text)


class Shards:
    """A data callable ``(batch_size) -> batches`` whose shard is bad for batch size 16."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __call__(self, batch_size: int):
        for i in range(0, len(self.x) - batch_size + 1, batch_size):
            if batch_size == 16:
                raise ValueError(f"bad shard {i}")  # RAISES-DATA
            yield self.x[i : i + batch_size], self.y[i : i + batch_size]


def test_data_that_raises_for_some_trials_fails_those_and_the_others_complete():
    base = make_task(6)
    x, y = base.train_data
    task = hydro.Task(model=base.model, train_data=Shards(x, y), val_data=base.val_data,
                      steps=6, eval_every=3, batch_size=8)
    space = {"lr": SPACE["lr"],
             "batch_size": optuna.distributions.CategoricalDistribution([8, 16])}
    study = optuna.create_study()  # in memory
    hydro.tune(task, space, n_trials=6, ratio=2, fuse=2, seed=1, study=study)
    trials = study.trials
    assert {t.state for t in trials} <= {TrialState.COMPLETE, TrialState.FAIL}
    bad = [t for t in trials if t.params["batch_size"] == 16]
    good = [t for t in trials if t.params["batch_size"] == 8]
    assert bad and good
    assert all(t.state == TrialState.COMPLETE for t in good)
    where = f"at {HERE}:{_line('RAISES-DATA')}"
    for t in bad:
        reason = t.user_attrs["fail_reason"]
        assert t.state == TrialState.FAIL and "\n" not in reason
        assert reason.startswith(f"trial {t.number} (group {t.user_attrs['group']}): data ")
        assert "Shards.__call__' raised ValueError: bad shard 0 " + where in reason, reason


def factory(width: int = 32) -> torch.nn.Module:
    if width == 16:
        raise ValueError("width 16 is not supported")  # RAISES-FACTORY
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 3)
    )


def test_a_model_factory_that_raises_for_some_arguments_fails_those_trials_only():
    base = make_task(2)
    task = hydro.Task(model=factory, train_data=base.train_data, val_data=base.val_data,
                      steps=2, eval_every=2, batch_size=16)
    study = optuna.create_study()
    for width in (16, 32, 16):
        study.enqueue_trial({"lr": 0.01, "width": width})
    space = {"lr": SPACE["lr"], "width": optuna.distributions.CategoricalDistribution([16, 32])}
    optimize(study, task, space, n_trials=3, ratio=2, fuse=2)
    states = [t.state for t in study.trials]
    assert states == [TrialState.FAIL, TrialState.COMPLETE, TrialState.FAIL]
    for t in (study.trials[0], study.trials[2]):
        assert t.user_attrs["fail_reason"] == (
            f"trial {t.number} (group {t.user_attrs['group']}): model '{__name__}:factory' "
            f"raised ValueError: width 16 is not supported at {HERE}:{_line('RAISES-FACTORY')}"
        )


TOY_LOSS = """

def bad_loss(out, y):
    if len(y) > 2:  # the model's check runs a batch of 2: training batches are larger
        raise ValueError("labels out of range")  # RAISES-LOSS
    return torch.nn.functional.cross_entropy(out, y)
"""


def test_a_loss_that_always_raises_stops_the_cli_with_one_line(tmp_path, monkeypatch, capsys):
    from hydro.cli import main
    from tests.cli.test_commands import CONFIG, TOY

    (tmp_path / "toymod.py").write_text(TOY + TOY_LOSS)
    (tmp_path / "tune.yaml").write_text(
        CONFIG.replace("trials: 4", "trials: 8").replace("  steps: 10", "  steps: 10\n"
                                                         "  loss: toymod:bad_loss"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "toymod", raising=False)
    assert main(["tune", "tune.yaml"]) == 2
    err = capsys.readouterr().err
    said = [t for t in err.splitlines() if t.startswith("hydro tune: error:")]
    assert len(said) == 1 and err.rstrip().endswith(said[0]), err  # the last line, alone
    first = said[0]
    line = next(i for i, t in enumerate((TOY + TOY_LOSS).splitlines(), 1) if "RAISES-LOSS" in t)
    assert first.startswith(
        "hydro tune: error: trial 0 (group 0): loss 'toymod:bad_loss' "
        f"raised ValueError: labels out of range at toymod.py:{line} "
        "(every trial of this run failed this way, in 3 groups"
    ), err
    assert "Traceback" not in err
    study = optuna.load_study(study_name="toy", storage="sqlite:///toy.db")
    # the run stopped after 3 groups of 2 instead of burning all 8 trials
    assert [t.state for t in study.trials] == [TrialState.FAIL] * 6
    assert all(t.user_attrs["fail_reason"].startswith(f"trial {t.number} (group ")
               and "\n" not in t.user_attrs["fail_reason"] for t in study.trials)


class CountingLoss:
    """Cross-entropy that raises on training batches (the model's check runs one of 2), after
    writing a line per call to ``log`` (attempts are counted across worker processes)."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if len(y) > 2:
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()}\n")
            raise RuntimeError("loss exploded")  # RAISES-EXECUTOR
        return torch.nn.functional.cross_entropy(out, y)


def test_a_deterministic_error_is_not_retried_on_the_local_executor(tmp_path):
    from hydro_fluid import LocalExecutor

    log = tmp_path / "calls"
    task = make_task(4)
    task.loss = CountingLoss(str(log))
    study = optuna.create_study()
    executor = LocalExecutor(devices=[], num_workers=1, max_retries=2)
    with pytest.raises(UserCodeError, match="in 1 group: fix it"):
        optimize(study, task, SPACE, n_trials=2, ratio=2, fuse=2, executor=executor,
                 policy="fifo")
    assert len(set(log.read_text().split())) == 1  # one worker process: not retried
    where = f"at {HERE}:{_line('RAISES-EXECUTOR')}"
    for t in study.trials:
        assert t.state == TrialState.FAIL
        assert t.user_attrs["fail_reason"] == (
            f"trial {t.number} (group 0): loss '{__name__}:CountingLoss.__call__' raised "
            f"RuntimeError: loss exploded {where}"
        )


def test_the_executor_retries_other_errors_and_reports_them_in_one_line():
    from hydro_fluid import LocalExecutor, TrialGroup

    results = LocalExecutor(devices=[], num_workers=1, max_retries=1).run(
        [TrialGroup("g", (0,), (1,)), TrialGroup("d", (1,), (1,))], _raise
    )
    by_name = {r.group.name: r for r in results}
    assert by_name["g"].attempts == 2 and not by_name["g"].deterministic
    assert by_name["g"].error == ("failed after 2 attempt(s): ZeroDivisionError: division by "
                                  f"zero at {HERE}:{_line('RAISES-ZERO')}")
    assert by_name["d"].attempts == 1 and by_name["d"].deterministic
    assert by_name["d"].error == "data 'x' raised OSError: gone at x.py:1"
    assert by_name["d"].trials[1].reason == by_name["d"].error


def _raise(group, ctx):
    if group.name == "d":
        raise UserCodeError("data 'x' raised OSError: gone at x.py:1")
    return 1 / 0  # RAISES-ZERO


@pytest.mark.parametrize("kind", ["truncated", "planted pickle", "another model"])
def test_an_unusable_group_checkpoint_is_set_aside_and_its_group_starts_afresh(tmp_path, kind):
    """A group on a LocalExecutor whose checkpoint directory holds, for this study and these
    trials, a truncated file, a planted pickle or another model's checkpoint: the file is
    moved aside and the group trains from step 0 to the end."""
    from hydro.tuning.slots import _group_state
    from hydro_fluid import LocalExecutor

    study = optuna.create_study()  # in memory: its group checkpoints are the executor's
    first = [[0, {"lr": 0.01}, 0], [1, {"lr": 0.03}, 1]]  # (trial, params, seed), as asked
    for _, params, _ in first:
        study.enqueue_trial(params)
    task = make_task(4)
    wide = make_task(4)
    wide.model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(),
                                     torch.nn.Linear(64, 3))
    group = FusedGroup(wide, [tuple(m) for m in first], ratio=2)
    group.step()
    state = {"groups": [_group_state(group)], "waiting": [], "rounds": 1, "cursor": 1,
             "asking": False, "occupancy": [1, 2, 1, 2], "rng": checkpoint.rng_state(),
             "study": checkpoint.study_id(study), "first": first}
    path = checkpoint.save(tmp_path / "ex" / "group-0", state)
    if kind == "truncated":
        path.write_bytes(path.read_bytes()[:300])
    flag = tmp_path / "pwned"
    if kind == "planted pickle":

        class Payload:
            def __reduce__(self):
                return (os.system, (f"touch {flag}",))

        path.write_bytes(pickle.dumps({**state, "study": Payload()}, protocol=2))
    executor = LocalExecutor(devices=[], num_workers=1, checkpoint_dir=tmp_path / "ex")
    optimize(study, task, SPACE, n_trials=2, ratio=2, fuse=2, executor=executor,
             checkpoint_every=2, policy="fifo")
    assert not flag.exists()
    assert len(list(path.parent.glob(f"{checkpoint.FILE}.set-aside-*"))) == 1
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    # from step 0: the values of the same trials trained in this process, from scratch
    fresh = _fresh(tuple(p["lr"] for _, p, _ in first))
    assert [t.value for t in study.trials] == pytest.approx(fresh, rel=1e-6)


@functools.cache
def _fresh(lrs: tuple[float, ...]) -> list[float]:
    """The values of trials of learning rates ``lrs`` (seeds 0, 1, ...) trained in this
    process from step 0, as the executor's group is trained in
    :func:`test_an_unusable_group_checkpoint_is_set_aside_and_its_group_starts_afresh`."""
    study = optuna.create_study()
    for lr in lrs:
        study.enqueue_trial({"lr": lr})
    optimize(study, make_task(4), SPACE, n_trials=len(lrs), ratio=2, fuse=len(lrs))
    return [t.value for t in study.trials]

"""The Executor protocol: both executors satisfy it, the tuner reads features from the type."""

from __future__ import annotations

import inspect

import optuna
import pytest
from optuna.distributions import FloatDistribution

from hydro.errors import ConfigError
from hydro.integrations.optuna import optimize
from hydro_fluid import (
    Executor,
    LocalExecutor,
    PlacingExecutor,
    RayExecutor,
    check_executor,
)
from tests import toy


def _params(fn) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)


@pytest.mark.parametrize("cls", [LocalExecutor, RayExecutor])
def test_both_executors_take_every_argument_of_the_protocol(cls):
    """What a type checker would check (Ray is not started here): every parameter of
    PlacingExecutor.run, of the same kind and default, and the other members."""
    theirs = _params(cls.run)
    for name, param in _params(PlacingExecutor.run).items():
        assert name in theirs, f"{cls.__name__}.run lacks {name}"
        assert theirs[name].kind == param.kind, name
        assert theirs[name].default == param.default, name
    assert callable(cls.placement_devices)
    if cls is RayExecutor:  # LocalExecutor sets slots in __init__: checked on an instance below
        assert isinstance(cls.slots, property)


def test_a_local_executor_is_a_placing_executor():
    executor = LocalExecutor(devices=[], num_workers=1)
    assert isinstance(executor, Executor) and isinstance(executor, PlacingExecutor)
    assert check_executor(executor) is executor


class _Plain:
    """An executor of one's own without placement: it runs groups on a LocalExecutor."""

    def __init__(self) -> None:
        self.inner = LocalExecutor(devices=[], num_workers=1)
        self.slots = self.inner.slots
        self.calls: list[dict] = []

    def run(self, groups, fn, **kw):
        self.calls.append(kw)
        return self.inner.run(groups, fn, **kw)


class _Recording(LocalExecutor):
    calls: list[dict]

    def run(self, groups, fn, **kw):
        self.calls = [*getattr(self, "calls", []), kw]
        return super().run(groups, fn, **kw)


def test_check_executor_refuses_what_lacks_a_member_and_names_it():
    assert check_executor(_Plain()).slots == ["cpu"]
    assert not isinstance(_Plain(), PlacingExecutor)
    with pytest.raises(ConfigError, match=r"executor object\(\) is not a hydro_fluid.Executor: "
                                          "it lacks run, slots"):
        check_executor(object())
    with pytest.raises(ConfigError, match="executor 'gpu' .* lacks run, slots"):
        check_executor("gpu")

    class NoSlots:
        def run(self, groups, fn, **kw):
            return []

    with pytest.raises(ConfigError, match=r"NoSlots\(\) is not .* it lacks slots \("):
        check_executor(NoSlots())


def test_the_tuner_asks_a_policy_only_of_a_placing_executor():
    space = {"lr": FloatDistribution(1e-3, 1e-1, log=True)}
    for executor, placed in ((_Plain(), False), (_Recording(devices=[], num_workers=1), True)):
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        optimize(study, toy.task(steps=4), space, n_trials=2, ratio=2, fuse=2,
                 executor=executor, policy="fifo")
        assert [t.state.name for t in study.trials] == ["COMPLETE"] * 2
        (kw,) = executor.calls
        assert ("policy" in kw) is placed and kw.get("policy", "fifo") == "fifo"

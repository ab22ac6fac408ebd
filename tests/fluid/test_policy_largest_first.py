"""The ``largest_first`` policy: registered by its module alone, and it shortens the tail."""

import pytest

from hydro.cli import build_parser
from hydro.errors import ConfigError
from hydro_fluid import Cluster, Device, TrialGroup, simulate
from hydro_fluid.placement import Placer
from hydro_fluid.policies import check_policy, get_policy, policy_names
from hydro_fluid.policies.largest_first import LargestFirst
from hydro_fluid.simulate import lower_bound


def _work() -> list[TrialGroup]:
    """Twelve short groups that arrive before two long ones."""
    short = [TrialGroup(f"s{i}", (i,), (100,), utilization=0.9) for i in range(12)]
    return short + [TrialGroup(f"l{i}", (100 + i,), (600,), utilization=0.9) for i in range(2)]


def test_it_is_registered_everywhere_by_its_module_alone():
    assert "largest_first" in policy_names()
    assert get_policy("largest_first") is LargestFirst
    check_policy("largest_first")
    with pytest.raises(ConfigError, match="only used by policy 'deadline', not 'largest_first'"):
        check_policy("largest_first", 30.0)
    # the CLI offers it: its choices come from the registry
    tune = build_parser()._subparsers._group_actions[0].choices["tune"]
    policy = next(a for a in tune._actions if a.dest == "policy")
    assert "largest_first" in policy.choices and "largest_first" in policy.help


def test_long_groups_start_first_and_the_tail_is_at_the_lower_bound():
    cluster = Cluster.homogeneous(1, 4)
    spans = {p: simulate(_work(), cluster, p, c=1, d=1).makespan
             for p in ("fifo", "dynamic", "largest_first")}
    bound = lower_bound(_work(), cluster, d=1)
    assert spans["largest_first"] == pytest.approx(bound)  # 600 s: the long group itself
    assert spans["dynamic"] >= 1.4 * spans["largest_first"]  # 900 s: the long ones start last
    assert spans["fifo"] >= 1.4 * spans["largest_first"]


def test_the_placer_starts_the_longest_waiting_group():
    devices = [Device("cpu0", "cpu"), Device("cpu1", "cpu")]
    placer = Placer("largest_first", devices, c=1, d=1)
    for group in _work()[:3] + _work()[-1:]:
        placer.wait(group)
    plan = placer.decide()
    assert set(plan) == {"l1", "s0"}  # the long one, then arrival order among equals
    for name, slots in plan.items():
        placer.started(name, slots)
    assert placer.room() == 0.0  # c=1: no packing next to a running group
    placer.ended("s0")
    assert placer.room() == 1.0 and set(placer.decide()) == {"l1", "s1"}

"""TrialGroup, Device and Cluster: the cost model and input validation."""

import pytest

from hydro_fluid import Cluster, Device, TrialGroup


def test_group_work_and_split_keep_every_trial():
    g = TrialGroup("g", trial_ids=(0, 1, 2, 3, 4), budgets=(50, 10, 40, 20, 30), cost_per_step=2.0)
    assert g.size == 5 and g.max_budget == 50
    assert g.work == pytest.approx(2.0 * 150)
    first, second = g.split()
    assert sorted(first.trial_ids + second.trial_ids) == [0, 1, 2, 3, 4]
    assert (first.size, second.size) == (3, 2)
    # Sorted by budget, so each half has similar budgets.
    assert max(first.budgets) <= min(second.budgets)
    assert first.name == "g/0" and second.name == "g/1"


def test_speedup_is_sublinear_and_grows_with_utilization():
    big = TrialGroup("big", (0,), (1,), utilization=1.0, comm=0.05)
    small = TrialGroup("small", (0,), (1,), utilization=0.2, comm=0.05)
    assert big.speedup(1) == pytest.approx(1.0)
    for w in (2, 4, 8):
        assert 1 < big.speedup(w) < w
        assert small.speedup(w) < big.speedup(w)
    assert big.speedup(8) > big.speedup(4) > big.speedup(2)


def test_without_drops_members_and_returns_none_when_empty():
    g = TrialGroup("g", (0, 1, 2), (10, 20, 30))
    assert g.without([1]).trial_ids == (0, 2)
    assert g.without([1]).budgets == (10, 30)
    assert g.without([0, 1, 2]) is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(trial_ids=(), budgets=()), "no trials"),
        (dict(trial_ids=(0, 1), budgets=(10,)), "one budget"),
        (dict(trial_ids=(0, 0), budgets=(1, 1)), "unique"),
        (dict(trial_ids=(0,), budgets=(-1,)), "budgets must be >= 0"),
        (dict(trial_ids=(0,), budgets=(1,), cost_per_step=0), "cost_per_step"),
        (dict(trial_ids=(0,), budgets=(1,), utilization=1.5), "utilization"),
        (dict(trial_ids=(0,), budgets=(1,), comm=1.0), "comm"),
    ],
)
def test_bad_group_raises_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrialGroup("bad", **kwargs)


def test_single_trial_group_cannot_split():
    with pytest.raises(ValueError, match="cannot be split"):
        TrialGroup("g", (0,), (1,)).split()


def test_device_validation():
    with pytest.raises(ValueError, match="kind"):
        Device("x", kind="tpu")
    with pytest.raises(ValueError, match="memory"):
        Device("x", memory=0)
    with pytest.raises(ValueError, match="speed"):
        Device("x", speed=-1)


def test_cluster_nodes_and_events():
    cluster = Cluster.homogeneous(2, 4)
    assert [len(v) for v in cluster.nodes.values()] == [4, 4]
    extra = Device("node2/gpu0", node="node2")
    cluster = cluster.with_events([(20.0, "join", extra), (10.0, "leave", cluster.devices[0])])
    assert [e.time for e in cluster.events] == [10.0, 20.0]  # sorted
    assert len(cluster.devices_at(0)) == 8
    assert len(cluster.devices_at(10)) == 7
    names = {d.name for d in cluster.devices_at(25)}
    assert "node2/gpu0" in names and "node0/gpu0" not in names


def test_cluster_rejects_inconsistent_history():
    dev = Device("a")
    with pytest.raises(ValueError, match="appears twice"):
        Cluster([dev, Device("a")])
    with pytest.raises(ValueError, match="not present"):
        Cluster([], [(1.0, "leave", dev)])
    with pytest.raises(ValueError, match="already present"):
        Cluster([dev], [(1.0, "join", dev)])
    with pytest.raises(ValueError, match="'join' or 'leave'"):
        Cluster([dev], [(1.0, "explode", dev)])
    with pytest.raises(ValueError, match="at least one"):
        Cluster.homogeneous(0, 4)

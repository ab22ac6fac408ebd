"""Allocation policies: the 1/c and d bounds, conservation, and the rules themselves."""

import time

import numpy as np
import pytest

from hydro_fluid import Cluster, Device, TrialGroup, deadline, dynamic_fluid, fifo, static_fluid
from hydro_fluid.simulate import check_allocation


def random_groups(rng, n, memory=(0.0, 3.0)):
    return [
        TrialGroup(
            f"g{i}",
            trial_ids=tuple(range(4 * i, 4 * i + 4)),
            budgets=tuple(float(b) for b in rng.integers(10, 5000, size=4)),
            cost_per_step=float(rng.uniform(0.01, 1.0)),
            memory_per_trial=float(rng.uniform(*memory)),
            utilization=float(rng.uniform(0.1, 1.0)),
        )
        for i in range(n)
    ]


def mixed_cluster(rng, nodes):
    """Nodes of 1 to 8 devices with different memory and speed."""
    devices = []
    for n in range(nodes):
        for i in range(int(rng.integers(1, 9))):
            devices.append(
                Device(
                    f"n{n}/d{i}",
                    memory=float(rng.choice([16.0, 40.0, 80.0])),
                    speed=float(rng.choice([0.5, 1.0, 2.0])),
                    node=f"n{n}",
                )
            )
    return devices


def assert_valid(alloc, devices, groups, c, d):
    """Bounds and conservation, checked independently of the library's own checker."""
    by_dev = {dev.name: dev for dev in devices}
    by_group = {g.name: g for g in groups}
    share, count, memory = {}, {}, {}
    for name, slots in alloc.items():
        assert 1 <= len(slots) <= d, (name, slots)  # never more than d devices
        assert len({dev for dev, _ in slots}) == len(slots)
        for dev, s in slots:
            assert s >= 1 / c - 1e-9, (name, s)  # never less than 1/c of a device
            assert s <= 1 + 1e-9
            if len(slots) > 1:
                assert s == 1.0  # data parallel only over whole devices
            share[dev] = share.get(dev, 0) + s
            count[dev] = count.get(dev, 0) + 1
            memory[dev] = memory.get(dev, 0) + by_group[name].memory
    for dev in share:  # no device over-committed
        assert share[dev] <= 1 + 1e-9
        assert count[dev] <= c
        assert memory[dev] <= by_dev[dev].memory + 1e-9
    check_allocation(alloc, devices, groups, c, d)  # and the library agrees


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("c, d", [(1, 1), (2, 4), (4, 8), (8, 3)])
def test_static_fluid_respects_bounds_and_capacity(seed, c, d):
    rng = np.random.default_rng(seed)
    devices = mixed_cluster(rng, nodes=int(rng.integers(1, 5)))
    groups = random_groups(rng, int(rng.integers(1, 4 * len(devices) + 2)))
    alloc = static_fluid(groups, devices, c=c, d=d)
    assert_valid(alloc, devices, groups, c, d)
    assert alloc, "something must be placed when devices are idle"
    # Work-conserving: with fewer groups than devices, no admitted group waits.
    if len(groups) <= len(devices):
        assert set(alloc) == {g.name for g in groups}


@pytest.mark.parametrize("seed", range(8))
def test_dynamic_fluid_and_deadline_respect_bounds_with_running_groups(seed):
    rng = np.random.default_rng(100 + seed)
    devices = mixed_cluster(rng, nodes=3)
    groups = random_groups(rng, 3 * len(devices))
    running = static_fluid(groups[: len(devices)], devices, c=4, d=8)
    survivors = devices[1:]  # one device left the cluster
    alloc = dynamic_fluid(groups, survivors, c=4, d=8, running=running, restart_cost=5.0)
    assert_valid(alloc, survivors, groups, 4, 8)
    scored = [
        TrialGroup(
            g.name,
            g.trial_ids,
            g.budgets,
            utilization=g.utilization,
            memory_per_trial=g.memory_per_trial,
            score=float(i),
        )
        for i, g in enumerate(groups)
    ]
    alloc = deadline(scored, survivors, c=4, d=8, now=50.0, end=100.0, running=running)
    assert_valid(alloc, survivors, scored, 4, 8)


def test_static_fluid_shares_follow_budget():
    devices = Cluster.homogeneous(1, 8).devices
    groups = [
        TrialGroup("long", (0,), (8000,)),
        TrialGroup("mid", (1,), (4000,)),
        TrialGroup("short", (2,), (100,)),
    ]
    alloc = static_fluid(groups, devices, c=4, d=8)
    assert len(alloc["long"]) > len(alloc["mid"]) >= 1
    assert len(alloc["short"]) == 1 and alloc["short"][0][1] <= 1.0
    assert sum(len(s) for s in alloc.values() if s[0][1] == 1.0) <= 8


def test_static_fluid_packs_many_groups_and_queues_beyond_c_per_device():
    devices = Cluster.homogeneous(1, 2).devices
    groups = [TrialGroup(f"g{i}", (i,), (100,)) for i in range(10)]
    alloc = static_fluid(groups, devices, c=4, d=8)
    assert list(alloc) != [] and len(alloc) == 8  # 2 devices * c, the rest wait
    assert set(alloc) == {f"g{i}" for i in range(8)}  # first come, first placed
    assert all(slots[0][1] == pytest.approx(0.25) for slots in alloc.values())


def test_data_parallel_group_stays_on_one_node_when_it_can():
    devices = Cluster.homogeneous(2, 4).devices
    devices = devices[:3] + devices[4:]  # node0 has 3 idle devices, node1 has 4
    alloc = static_fluid([TrialGroup("g", (0,), (1000,))], devices, c=4, d=4)
    assert len(alloc["g"]) == 4
    assert {dev.split("/")[0] for dev, _ in alloc["g"]} == {"node1"}


def test_memory_limits_packing():
    devices = [Device("small", memory=10.0), Device("large", memory=80.0)]
    groups = [TrialGroup(f"g{i}", (i,), (100,), memory_per_trial=30.0) for i in range(3)]
    alloc = static_fluid(groups, devices, c=4, d=1)
    assert all(slots[0][0] == "large" for slots in alloc.values())
    assert len(alloc) == 2  # 2 * 30 GiB fit in 80 GiB, the third waits


def test_fifo_is_one_group_per_device_in_order():
    devices = Cluster.homogeneous(1, 3).devices
    groups = [TrialGroup(f"g{i}", (i,), (10 * (5 - i),)) for i in range(5)]
    alloc = fifo(groups, devices)
    assert list(alloc) == ["g0", "g1", "g2"]
    assert [slots[0][0] for slots in alloc.values()] == [d.name for d in devices]
    assert all(slots[0][1] == 1.0 and len(slots) == 1 for slots in alloc.values())


def test_dynamic_fluid_moves_only_when_gain_beats_restart_cost():
    devices = Cluster.homogeneous(1, 4).devices
    current = {"g": ((devices[0].name, 1.0),)}
    long_group = TrialGroup("g", (0,), (10_000,), cost_per_step=1.0)
    assert len(dynamic_fluid([long_group], devices, running=current, restart_cost=60)["g"]) == 4
    short_group = TrialGroup("g", (0,), (50,), cost_per_step=1.0)
    kept = dynamic_fluid([short_group], devices, running=current, restart_cost=60)
    assert kept["g"] == current["g"]
    # A new group still gets the devices the pinned one did not take.
    other = TrialGroup("h", (1,), (50,))
    both = dynamic_fluid([short_group, other], devices, running=current, restart_cost=60)
    assert both["g"] == current["g"] and "h" in both


def test_dynamic_fluid_moves_groups_off_a_device_that_left():
    devices = Cluster.homogeneous(1, 2).devices
    current = {"g": ((devices[0].name, 1.0),)}
    group = TrialGroup("g", (0,), (10,))
    alloc = dynamic_fluid([group], devices[1:], running=current, restart_cost=1e9)
    assert alloc["g"] == ((devices[1].name, 1.0),)


def test_deadline_shifts_devices_to_best_group_as_deadline_nears():
    devices = Cluster.homogeneous(1, 8).devices
    groups = [TrialGroup(f"g{i}", (i,), (2000,), score=float(i)) for i in range(8)]
    early = deadline(groups, devices, c=4, d=8, now=0.0, end=1000.0)
    late = deadline(groups, devices, c=4, d=8, now=900.0, end=1000.0)
    assert len(early["g0"]) == 1  # exploring: everyone gets the same
    # Exploiting: 90% of the way to the deadline, 90% of the devices (7 of 8) go to the best.
    assert len(late["g0"]) == 7
    assert all(len(slots) == 1 and slots[0][1] < 1 for name, slots in late.items() if name != "g0")


def test_policy_input_errors_are_clear():
    devices = Cluster.homogeneous(1, 2, memory=16.0).devices
    group = TrialGroup("g", (0,), (10,))
    with pytest.raises(ValueError, match="c .*int >= 1"):
        static_fluid([group], devices, c=0)
    with pytest.raises(ValueError, match="d .*int >= 1"):
        static_fluid([group], devices, d=0)
    with pytest.raises(ValueError, match="appears twice"):
        static_fluid([group, group], devices)
    huge = TrialGroup("huge", (0, 1), (10, 10), memory_per_trial=10.0)
    with pytest.raises(ValueError, match="split it"):
        static_fluid([huge], devices)
    with pytest.raises(ValueError, match="TrialGroup"):
        static_fluid(["not a group"], devices)
    with pytest.raises(ValueError, match="after start"):
        deadline([group], devices, now=0.0, end=0.0)


def test_check_allocation_catches_over_commitment():
    devices = Cluster.homogeneous(1, 1).devices
    groups = [TrialGroup(f"g{i}", (i,), (1,)) for i in range(2)]
    bad = {"g0": ((devices[0].name, 0.75),), "g1": ((devices[0].name, 0.5),)}
    with pytest.raises(RuntimeError, match="over-committed"):
        check_allocation(bad, devices, groups, c=4, d=8)


def test_planning_10k_trials_on_1k_devices_is_fast():
    rng = np.random.default_rng(0)
    groups = [
        TrialGroup(f"g{i}", (i,), (float(rng.integers(100, 10_000)),), utilization=0.3)
        for i in range(10_000)
    ]
    devices = Cluster.homogeneous(125, 8).devices
    start = time.perf_counter()
    alloc = static_fluid(groups, devices, c=4, d=8)
    elapsed = time.perf_counter() - start
    assert len(alloc) == 4_000  # c * devices placed, the rest wait
    # The target is < 1 s; allow slack for a loaded CI machine but catch a blow-up.
    assert elapsed < 3.0, f"planning took {elapsed:.2f} s"

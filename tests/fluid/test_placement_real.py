"""The placement policies decide where real groups run on LocalExecutor's worker processes.

Every test runs real workers (hydro_fluid.executors.examples.placed_steps) and asserts on what
the policy decided (``executor.decisions``) and on what the workers saw (threads, world size,
every step trained), never on wall time.
"""

import functools
import time
from pathlib import Path

import pytest

from hydro_fluid import LocalExecutor, TrialGroup
from hydro_fluid.executors.examples import placed_steps
from hydro_fluid.placement import Placer, check_policy


def executor(**kwargs) -> LocalExecutor:
    # 2 devices of 2 threads each: a packed pair splits a device's threads 1 + 1
    return LocalExecutor(devices=[], num_workers=2, threads=4, restart_cost=0.0, **kwargs)


def steps(seconds: float = 0.02):
    return functools.partial(placed_steps, seconds=seconds)


def long_first(group, ctx, folder: str, seconds: float):
    """placed_steps, but the short groups start only once the long one trains, so that they
    end while it still has most of its steps to go, however loaded the machine is."""
    if group.name == "long":
        (Path(folder) / "long").touch()
    else:
        deadline = time.monotonic() + 120
        while not (Path(folder) / "long").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    return placed_steps(group, ctx, seconds)


def by_name(results):
    return {r.group.name: r for r in results}


def one_long_two_short(long: int = 80):
    return [
        TrialGroup("long", (0,), (long,)),
        TrialGroup("short-a", (1,), (10,)),
        TrialGroup("short-b", (2,), (10,)),
    ]


def test_dynamic_packs_then_widens_and_moves_a_group_with_its_checkpoint(tmp_path):
    ex = executor()
    fn = functools.partial(long_first, folder=str(tmp_path), seconds=0.02)
    results = by_name(ex.run(one_long_two_short(120), fn, policy="dynamic"))

    first = ex.decisions[0].allocation
    # the long group gets a whole device; the two short ones share the other, half each
    assert first["long"] == (("cpu0", 1.0),) or first["long"] == (("cpu1", 1.0),)
    (dev_a, share_a), = first["short-a"]
    (dev_b, share_b), = first["short-b"]
    assert dev_a == dev_b != first["long"][0][0] and share_a == share_b == 0.5
    # ... and their worker processes split that device's 2 threads
    assert results["short-a"].value["placements"] == [[1, 1, 0]]
    assert results["short-b"].value["placements"] == [[1, 1, 0]]

    # once the short ones end, the long one is stopped after a checkpoint and widened to
    # data parallel over both devices: a move, not a retry, and no step lost or repeated
    long = results["long"]
    assert long.moves == 1 and long.attempts == 1 and long.ok
    (ws0, threads0, at0), (ws1, _, at1) = long.value["placements"]
    assert (ws0, threads0, at0) == (1, 2, 0)
    assert ws1 == 2 and 0 < at1 < 120
    assert long.value["trained"] == list(range(120))
    assert any(len(d.allocation.get("long", ())) == 2 for d in ex.decisions)
    assert all(o.state == "COMPLETE" for r in results.values() for o in r.trials.values())


def test_fifo_is_the_fixed_pool_one_group_per_device_and_never_moves():
    ex = executor()
    results = by_name(ex.run(one_long_two_short(), steps(), policy="fifo"))
    for decision in ex.decisions:
        for slots in decision.allocation.values():
            assert len(slots) == 1 and slots[0][1] == 1.0
        devices = [slots[0][0] for slots in decision.allocation.values()]
        assert len(devices) == len(set(devices))  # never two groups on one device
    assert all(r.moves == 0 and r.value["placements"][0][:2] == [1, 2] for r in results.values())
    assert results["long"].value["trained"] == list(range(80))


def test_static_packs_idle_devices_but_never_moves_a_running_group():
    ex = executor()
    results = by_name(ex.run(one_long_two_short(), steps(), policy="static"))
    first = ex.decisions[0].allocation
    assert first["short-a"][0][0] == first["short-b"][0][0]  # packed on one device
    assert all(r.moves == 0 for r in results.values())
    assert [p[0] for p in results["long"].value["placements"]] == [1]


def test_a_thinned_group_leaves_room_that_a_new_group_of_another_key_takes():
    ex = LocalExecutor(devices=[], num_workers=1, threads=2, restart_cost=0.0)
    # three members end at step 5, one trains on: the device is a quarter used
    thin = TrialGroup("thin", (0, 1, 2, 3), (5, 5, 5, 120))
    rooms: list[float] = []

    def more(room: float) -> list[TrialGroup]:
        rooms.append(room)
        if len(rooms) == 1:
            return [thin]
        # on a loaded machine the busy loop's measured utilization may fall below 1 before
        # the group thins: wait for the room its three ended members leave
        if room >= 0.75 - 1e-9 and "other" not in placed:
            placed.append("other")
            return [TrialGroup("other-key", (10, 11), (20, 20))]
        return []

    placed: list[str] = []
    results = by_name(ex.run([], steps(0.02), more=more, policy="dynamic"))
    assert rooms[0] == 1.0 and placed == ["other"]
    placed = next(d for d in ex.decisions if "other-key" in d.allocation)
    assert placed.event == "new group"
    assert placed.allocation["thin"][0][0] == placed.allocation["other-key"][0][0] == "cpu0"
    assert results["thin"].moves == 0  # packing beside it did not restart it
    assert results["thin"].value["trained"] == list(range(120))
    assert results["other-key"].value["trained"] == list(range(20))


def test_deadline_ticks_and_reserves_whole_devices_for_the_best_group():
    ex = executor()
    groups = [TrialGroup("best", (0,), (100,)), TrialGroup("worse", (1,), (100,))]
    results = by_name(ex.run(groups, steps(0.02), policy="deadline", deadline=1.5))
    ticks = [d for d in ex.decisions if d.event == "tick"]
    assert ticks, "the deadline policy was never asked on a tick"
    # late ticks reserve whole devices for the best-ranked group (lowest score: trial 0)
    late = [d for d in ticks if d.seconds >= 0.75 and "best" in d.allocation]
    assert late and all(share == 1.0 for _, share in late[-1].allocation["best"])
    assert results["best"].value["trained"] == list(range(100))
    assert results["worse"].value["trained"] == list(range(100))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "fastest"}, "unknown placement policy 'fastest'"),
        ({"policy": "deadline"}, "needs a deadline"),
        ({"policy": "deadline", "deadline": -1}, "deadline must be a number of seconds > 0"),
        ({"policy": "dynamic", "deadline": 10}, "only used by policy 'deadline'"),
        ({"policy": "dynamic", "max_world_size": 0}, "max_world_size must be an int >= 1"),
    ],
)
def test_bad_placement_arguments_are_refused_before_any_worker_starts(kwargs, message):
    ex = executor()
    with pytest.raises(ValueError, match=message) as info:
        ex.run([TrialGroup("g", (0,), (3,))], steps(), **kwargs)
    assert "\n" not in str(info.value)


def test_executor_arguments_of_placement_are_checked():
    with pytest.raises(ValueError, match="max_packed must be an int >= 1"):
        LocalExecutor(devices=[], num_workers=1, max_packed=0)
    with pytest.raises(ValueError, match="restart_cost must be >= 0"):
        LocalExecutor(devices=[], num_workers=1, restart_cost=-1.0)
    with pytest.raises(ValueError, match="memory_budget must be > 0"):
        LocalExecutor(devices=[], num_workers=1, memory_budget=0)


def test_placer_feeds_the_policy_what_the_workers_measured():
    from hydro_fluid import Device

    placer = Placer("dynamic", [Device("cpu0", "cpu", 8.0)], restart_cost=0.0)
    placer.wait(TrialGroup("g", (0, 1, 2, 3), (100, 100, 100, 100)))
    placer.started("g", (("cpu0", 1.0),))
    assert placer.room() == 0.0  # not measured yet: it uses the whole device
    assert not placer.observe("g", 10, 4, 0.4, 1.0)
    view = placer.view("g")
    assert view.cost_per_step == pytest.approx(0.1)  # 0.4 s per fused step of 4 members
    assert view.utilization == 1.0 and view.budgets == (90, 90, 90, 90)
    assert placer.room() == 0.0  # full and busy
    assert not placer.observe("g", 11, 4, 0.4, 0.5)
    assert placer.room() == 0.0  # a low busy fraction is contention on a CPU, not room
    assert placer.observe("g", 12, 1, 0.1, 1.0)  # thinned: an event
    assert placer.room() == pytest.approx(0.75)
    check_policy("fifo")
    with pytest.raises(ValueError, match="use one of fifo, static, dynamic, deadline"):
        check_policy("lifo")


def test_placer_moves_groups_off_a_device_that_left():
    from hydro_fluid import Device

    cpu0, cpu1 = Device("cpu0", "cpu", 8.0), Device("cpu1", "cpu", 8.0)
    placer = Placer("dynamic", [cpu0, cpu1], d=1, restart_cost=1e9)
    placer.wait(TrialGroup("g", (0,), (100,)))
    placer.started("g", (("cpu1", 1.0),))
    assert placer.decide()["g"] == (("cpu1", 1.0),)  # a move never pays at this restart cost
    placer.set_devices([cpu0])  # cpu1 left: g must move whatever it costs
    assert placer.decide()["g"] == (("cpu0", 1.0),)
    with pytest.raises(ValueError, match="at least one device"):
        placer.set_devices([])

"""The simulator: every trial finishes, bounds hold, dependencies and device churn are honoured."""

import numpy as np
import pytest

from hydro.errors import ConfigError
from hydro_fluid import Cluster, TrialGroup, simulate
from hydro_fluid.simulate import lower_bound

POLICIES = ["fifo", "static_fluid", "dynamic_fluid"]


def sha_workload(rng, trials=32, eta=4, rungs=3):
    groups, previous, n = [], (), trials
    for rung in range(rungs):
        names = []
        for k in range(0, n, 4):
            name = f"r{rung}-{k // 4}"
            size = min(4, n - k)
            groups.append(
                TrialGroup(
                    name,
                    tuple(f"{name}-t{i}" for i in range(size)),
                    (100.0 * eta**rung,) * size,
                    cost_per_step=float(rng.uniform(0.05, 0.15)),
                    utilization=float(rng.uniform(0.2, 1.0)),
                    after=previous,
                )
            )
            names.append(name)
        previous, n = tuple(names), n // eta
    return groups


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(3))
def test_every_trial_finishes_and_no_policy_beats_the_lower_bound(policy, seed):
    rng = np.random.default_rng(seed)
    groups = sha_workload(rng)
    cluster = Cluster.homogeneous(2, 4)
    leaving = cluster.devices[5]
    cluster = cluster.with_events([(30.0, "leave", leaving), (200.0, "join", leaving)])
    result = simulate(groups, cluster, policy, c=4, d=4, restart_cost=5.0)
    trials = {t for g in groups for t in g.trial_ids}
    assert set(result.trial_finish) == trials
    assert set(result.group_finish) == {g.name for g in groups}
    assert result.makespan == pytest.approx(max(result.trial_finish.values()))
    assert result.makespan >= lower_bound(groups, cluster, d=4) * (1 - 1e-9)
    assert 0 < result.mean_utilization <= 1
    # A group never starts before the groups it waits for have finished.
    start = {}
    for seg in result.segments:
        start[seg.group] = min(start.get(seg.group, seg.start), seg.start)
    for g in groups:
        for dep in g.after:
            assert start[g.name] >= result.group_finish[dep] - 1e-9
    # Nothing runs on the device while it is away.
    for seg in result.segments:
        if seg.device == leaving.name:
            assert seg.end <= 30.0 + 1e-9 or seg.start >= 200.0 - 1e-9


def test_no_device_is_over_committed_at_any_time():
    rng = np.random.default_rng(7)
    groups = sha_workload(rng, trials=64)
    result = simulate(groups, Cluster.homogeneous(1, 4), "dynamic_fluid", c=3, d=4)
    times = sorted({s.start for s in result.segments})
    for t in times:
        live = [s for s in result.segments if s.start <= t < s.end]
        for dev in {s.device for s in live}:
            on_dev = [s for s in live if s.device == dev]
            assert sum(s.share for s in on_dev) <= 1 + 1e-9
            assert len(on_dev) <= 3


def test_fluid_beats_fifo_when_small_models_leave_devices_idle():
    groups = [
        TrialGroup(f"g{i}", (i,), (1000,), cost_per_step=0.1, utilization=0.25) for i in range(16)
    ]
    cluster = Cluster.homogeneous(1, 4)
    fifo = simulate(groups, cluster, "fifo")
    static = simulate(groups, cluster, "static_fluid")
    dynamic = simulate(groups, cluster, "dynamic_fluid")
    assert fifo.makespan == pytest.approx(4 * 100.0)  # four waves of one group per device
    # Four groups of utilization 0.25 fill one device: one wave, plus interference.
    assert static.makespan == pytest.approx(100.0 * 1.09)
    assert dynamic.makespan <= static.makespan + 1e-9
    assert dynamic.mean_utilization > 2 * fifo.mean_utilization


def test_data_parallel_speeds_up_the_long_tail():
    groups = [
        TrialGroup("long", (0,), (10_000,), cost_per_step=0.1, utilization=1.0),
        TrialGroup("short", (1,), (100,), cost_per_step=0.1, utilization=1.0),
    ]
    cluster = Cluster.homogeneous(1, 8)
    fifo = simulate(groups, cluster, "fifo")
    dynamic = simulate(groups, cluster, "dynamic_fluid", d=8, restart_cost=10.0)
    assert fifo.makespan == pytest.approx(1000.0)
    assert dynamic.makespan < 0.3 * fifo.makespan
    # After scaling out and its restart, the long group keeps 8 devices busy (sublinearly).
    assert dynamic.utilization[-1][1] == pytest.approx(groups[0].speedup(8) / 8)


def test_deadline_policy_trains_the_best_group_first():
    groups = [
        TrialGroup(f"g{i}", (i,), (3000,), cost_per_step=0.1, score=float(i)) for i in range(8)
    ]
    cluster = Cluster.homogeneous(1, 8)
    fair = simulate(groups, cluster, "dynamic_fluid")
    rushed = simulate(groups, cluster, "deadline", end=200.0, restart_cost=1.0)
    assert rushed.group_finish["g0"] < fair.group_finish["g0"]
    assert rushed.group_finish["g0"] == min(rushed.group_finish.values())


def test_gantt_chart_is_written(tmp_path):
    groups = sha_workload(np.random.default_rng(0))
    result = simulate(groups, Cluster.homogeneous(1, 4), "dynamic_fluid")
    path = tmp_path / "gantt.png"
    fig = result.plot_gantt(str(path))
    assert path.stat().st_size > 10_000
    assert fig.axes[0].get_yticklabels()[0].get_text() == "node0/gpu0"


def test_custom_policy_that_over_commits_is_rejected():
    groups = [TrialGroup(f"g{i}", (i,), (10,)) for i in range(2)]
    cluster = Cluster.homogeneous(1, 1)

    def greedy(now, ready, devices, running):
        return {g.name: ((devices[0].name, 1.0),) for g in ready}

    with pytest.raises(RuntimeError, match="over-committed"):
        simulate(groups, cluster, greedy)


def test_simulate_input_errors():
    cluster = Cluster.homogeneous(1, 1)
    group = TrialGroup("g", (0,), (10,))
    with pytest.raises(ConfigError, match="unknown placement policy 'round_robin': use one of "
                       "fifo, static, dynamic, deadline"):
        simulate([group], cluster, "round_robin")
    with pytest.raises(ValueError, match="needs end="):
        simulate([group], cluster, "deadline")
    with pytest.raises(ValueError, match="not in the workload"):
        simulate([TrialGroup("g", (0,), (10,), after=("missing",))], cluster)
    with pytest.raises(ValueError, match="unique"):
        simulate([group, group], cluster)
    cycle = [TrialGroup("a", (0,), (1,), after=("b",)), TrialGroup("b", (1,), (1,), after=("a",))]
    with pytest.raises(RuntimeError, match="stuck"):
        simulate(cycle, cluster)
    with pytest.raises(ValueError, match="cycle"):
        lower_bound(cycle, cluster)


def _pack_all_on_first_device(now, ready, devices, running):
    """Every ready group on the first device, half of it each (a custom policy)."""
    return {g.name: ((devices[0].name, 0.5),) for g in ready}


def test_startup_is_latency_before_the_first_step():
    group = TrialGroup("g", (0,), (100,), cost_per_step=0.1, startup=5.0)
    run = simulate([group], Cluster.homogeneous(1, 1), "fifo")
    assert run.makespan == pytest.approx(5.0 + 100 * 0.1)
    # while it starts the device does no useful work
    assert run.utilization[0] == (0.0, 0.0)


def test_a_starting_group_does_not_slow_the_group_packed_with_it():
    # Both compute bound (utilization 1) on one device; b's worker takes 4 s to start.
    a = TrialGroup("a", (0,), (10,), cost_per_step=1.0, utilization=1.0)
    b = TrialGroup("b", (1,), (10,), cost_per_step=1.0, utilization=1.0, startup=4.0)
    run = simulate([a, b], Cluster.homogeneous(1, 1), _pack_all_on_first_device)
    shared = 2 * 1.03  # time-sliced between two groups, with the interference per co-tenant
    # a runs alone for 4 steps while b starts, then the two share the device
    a_done = 4.0 + 6 * shared
    assert run.trial_finish[0] == pytest.approx(a_done)
    # b made 6 steps while sharing, then runs its last 4 alone
    assert run.trial_finish[1] == pytest.approx(a_done + 4.0)


def test_a_starting_group_does_not_delay_other_devices():
    a = TrialGroup("a", (0,), (10,), cost_per_step=1.0)
    b = TrialGroup("b", (1,), (10,), cost_per_step=1.0, startup=3.0)
    run = simulate([a, b], Cluster.homogeneous(1, 2), "fifo")
    assert run.trial_finish[0] == pytest.approx(10.0)
    assert run.makespan == pytest.approx(13.0)


def test_a_moved_group_pays_restart_cost_not_its_startup():
    # dynamic widens the last group over both devices once the other ends: one restart
    a = TrialGroup("a", (0,), (5,), cost_per_step=1.0, startup=2.0)
    b = TrialGroup("b", (1,), (100,), cost_per_step=1.0, startup=2.0, comm=0.0)
    run = simulate([a, b], Cluster.homogeneous(1, 2), "dynamic_fluid", d=2, restart_cost=1.0)
    assert len({s.device for s in run.segments if s.group == "b"}) == 2
    # b: 2 s start, 5 steps alone until a ends at 7 s, 1 s restart, 95 steps twice as fast
    assert run.makespan == pytest.approx(7.0 + 1.0 + 95 / 2)


def test_negative_startup_is_rejected():
    with pytest.raises(ValueError, match="startup must be >= 0"):
        TrialGroup("g", (0,), (10,), startup=-1.0)

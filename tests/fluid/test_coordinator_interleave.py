"""The interleaving policy and the coordinator simulator."""

import random

import pytest

from hydro_fluid import TrialGroup
from hydro_fluid.coordinator import PipelineJob, interleave, simulate_coordinator


def _random_study(rng, n_groups, memory=1.0):
    out = []
    for k in range(n_groups):
        size = rng.randint(1, 12)
        out.append(
            TrialGroup(
                f"g{k}",
                trial_ids=[(k, t) for t in range(size)],
                budgets=[rng.randint(20, 400) for _ in range(size)],
                cost_per_step=rng.uniform(0.002, 0.05),
                memory_per_trial=rng.uniform(0.1, 1.0) * memory,
            )
        )
    return out


def _random_job(rng):
    p = rng.randint(2, 10)
    m = rng.randint(1, 3 * p)
    return PipelineJob(
        p,
        m,
        forward=[rng.uniform(0.05, 0.4) for _ in range(p)],
        backward=[rng.uniform(0.1, 0.8) for _ in range(p)],
        schedule=rng.choice(["1f1b", "gpipe"]) if m <= 8 else "1f1b",
        static_memory=[rng.uniform(10, 40) for _ in range(p)],
        activation_memory=[rng.uniform(0.5, 3.0) for _ in range(p)],
    )


def _check_runs(job, plan, groups):
    """Every run fits memory and its bubble, runs never overlap, and steps add up."""
    one = job.timeline()
    size = {}
    for g in groups:
        for t in g.trial_ids:
            size[t] = g.memory_per_trial
    by_stage = {}
    for r in plan.runs:
        free = job.device_memory - one.peak_memory(r.stage)
        assert sum(size[t] for t in r.trial_ids) <= free + 1e-9
        assert r.steps >= 1 and r.end > r.start
        by_stage.setdefault(r.stage, []).append(r)
    for runs in by_stage.values():
        runs.sort(key=lambda r: r.start)
        for a, b in zip(runs, runs[1:]):
            assert b.start >= a.end - 1e-9
    budget = {t: b for g in groups for t, b in zip(g.trial_ids, g.budgets)}
    for t, b in budget.items():
        assert 0 <= plan.left[t] <= b
        assert (plan.left[t] == 0) == (t in plan.trial_finish)
    left_over = {t: b for g in plan.leftover for t, b in zip(g.trial_ids, g.budgets)}
    assert left_over == {t: v for t, v in plan.left.items() if v > 0}


@pytest.mark.parametrize("seed", range(16))
def test_host_is_never_delayed_with_the_default_bound(seed):
    rng = random.Random(seed)
    job = _random_job(rng)
    groups = _random_study(rng, rng.randint(1, 12))
    n = rng.randint(1, 6)
    plan = interleave(job, groups, iterations=n)
    host = job.timeline(n, guest=plan.guest_delays())
    nominal = job.timeline(n)
    assert host.makespan == pytest.approx(nominal.makespan, rel=1e-12, abs=1e-12)
    for a, b in zip(host.ops, nominal.ops):  # not a single op moved
        assert [op.start for op in a] == pytest.approx([op.start for op in b], abs=1e-9)
    assert len(plan.runs) > 0
    _check_runs(job, plan, groups)
    # steps run by each run add up to what the trials did
    steps = {t: 0 for g in groups for t in g.trial_ids}
    for r in plan.runs:
        for t in r.trial_ids:
            steps[t] += r.steps
    for g in groups:
        for t, b in zip(g.trial_ids, g.budgets):
            assert steps[t] >= b - plan.left[t]  # members pass their budget only by < 1 step


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("bound", [0.01, 0.1])
def test_host_delay_stays_within_a_positive_bound(seed, bound):
    rng = random.Random(1000 + seed)
    job = _random_job(rng)
    groups = _random_study(rng, 8)
    n = 4
    plan = interleave(job, groups, iterations=n, delay_bound=bound)
    host = job.timeline(n, guest=plan.guest_delays())
    assert host.makespan <= n * plan.iteration_time * (1 + bound) + 1e-9
    _check_runs(job, plan, groups)


def test_target_p8_m16_guests_use_most_of_the_bubbles_without_slowing_the_host():
    job = PipelineJob(8, 16, forward=0.1, backward=0.2, static_memory=20, activation_memory=3)
    study = [
        TrialGroup(
            f"g{k}",
            range(16 * k, 16 * k + 16),
            [10**5] * 16,
            cost_per_step=0.002,
            memory_per_trial=0.5,
        )
        for k in range(16)
    ]
    r = simulate_coordinator(job, study, iterations=30)
    assert r.bubble_fraction == pytest.approx(7 / 23)
    assert r.host_slowdown <= 1e-12
    assert r.bubble_use >= 0.7
    assert r.utilization[1] > r.utilization[0] + 0.7 * r.bubble_fraction - 1e-9


def test_fusion_size_follows_the_free_memory_of_each_stage():
    job = PipelineJob(8, 16, static_memory=40, activation_memory=4)
    study = [
        TrialGroup(
            f"g{k}",
            range(40 * k, 40 * k + 40),
            [100] * 40,
            cost_per_step=0.001,
            memory_per_trial=2.0,
        )
        for k in range(8)
    ]
    plan = interleave(job, study, iterations=2, fit_bubbles=False)
    # stage i holds 8 - i micro-batches of 4 GiB: free 8 + 4 i GiB -> 4 + 2 i trials
    assert plan.fusion["g0"] == [4 + 2 * i for i in range(8)]
    for i in range(8):
        assert max(len(r.trial_ids) for r in plan.runs if r.stage == i) == 4 + 2 * i
    _check_runs(job, plan, study)


def test_fitting_the_fusion_size_to_short_bubbles_uses_more_of_them():
    # heterogeneous stages leave short gaps in the steady phase that a 16-trial step misses
    job = PipelineJob(
        8, 32, forward=[0.1] * 7 + [0.13], backward=[0.2] * 7 + [0.26], activation_memory=1.0
    )
    study = [
        TrialGroup(f"g{k}", range(16 * k, 16 * k + 16), [10**5] * 16, cost_per_step=0.004)
        for k in range(16)
    ]
    fitted = interleave(job, study, iterations=5)
    largest = interleave(job, study, iterations=5, fit_bubbles=False)
    assert {len(r.trial_ids) for r in largest.runs} == {16}
    assert min(len(r.trial_ids) for r in fitted.runs) < 16
    assert fitted.bubble_use > largest.bubble_use + 0.05
    for plan in (fitted, largest):
        host = job.timeline(5, guest=plan.guest_delays())
        assert host.makespan == pytest.approx(5 * plan.iteration_time, rel=1e-12)


def test_non_resident_guests_fit_each_bubble_and_pay_for_swaps():
    job = PipelineJob(4, 8, forward=0.5, backward=1.0, static_memory=40, activation_memory=8)
    study = [
        TrialGroup(
            f"g{k}", range(10 * k, 10 * k + 10), [50] * 10, cost_per_step=0.01, memory_per_trial=5.0
        )
        for k in range(4)
    ]
    resident = interleave(job, study, iterations=3)
    loaded = interleave(job, study, iterations=3, resident=False, swap_bandwidth=10.0)
    assert resident.fusion["g0"][0] == 1  # stage 0 peaks at 72 of 80 GiB
    assert all(len(r.trial_ids) == 1 for r in resident.runs if r.stage == 0)
    three = job.timeline(3)
    assert loaded.runs
    for r in loaded.runs:
        assert r.swap == pytest.approx(2 * 5.0 * len(r.trial_ids) / 10.0)
        free = job.device_memory - three.memory(r.stage, r.start + 1e-9)
        assert len(r.trial_ids) * 5.0 <= free + 1e-9
    host = job.timeline(3, guest=loaded.guest_delays())
    assert host.makespan == pytest.approx(three.makespan)


def test_long_trials_pause_at_step_boundaries_and_resume():
    job = PipelineJob(4, 4, forward=0.1, backward=0.2)
    g = TrialGroup("g", (0, 1), (1000, 1000), cost_per_step=0.01)
    plan = interleave(job, [g], iterations=40)
    stages = {r.stage for r in plan.runs}
    assert len(stages) == 1  # a group stays on its stage
    assert len(plan.runs) > 10  # and resumes bubble after bubble
    assert plan.completion is not None
    assert all(r.end - r.start == pytest.approx(r.steps * 0.02) for r in plan.runs)


def test_dependent_groups_start_after_their_predecessors():
    job = PipelineJob(4, 8, forward=0.1, backward=0.2)
    a = TrialGroup("a", (0, 1), (300, 300), cost_per_step=0.01)
    b = TrialGroup("b", (2,), (100,), cost_per_step=0.01, after=("a",))
    plan = interleave(job, [b, a], iterations=200)
    first_b = min(r.start for r in plan.runs if r.group.startswith("b"))
    assert first_b >= max(plan.trial_finish[0], plan.trial_finish[1]) - 1e-9


def test_unfinished_study_continues_on_the_freed_devices():
    job = PipelineJob(4, 8, forward=0.1, backward=0.2, static_memory=30, activation_memory=4)
    study = [
        TrialGroup(
            f"g{k}",
            range(4 * k, 4 * k + 4),
            [5000] * 4,
            cost_per_step=0.01,
            memory_per_trial=2.0,
            after=(f"g{k - 1}",) if k else (),
        )
        for k in range(3)
    ]
    r = simulate_coordinator(job, study, iterations=20)
    assert not r.plan.finished and r.plan.leftover
    assert r.study_coordinator > r.plan.host_time
    assert r.study_coordinator < r.study_separate
    assert r.host_time_sharing > r.plan.host_time


def test_plot_gantt_writes_a_png(tmp_path):
    job = PipelineJob(4, 4, forward=0.1, backward=0.2)
    study = [TrialGroup("g", range(4), [200] * 4, cost_per_step=0.005)]
    path = tmp_path / "g.png"
    fig = simulate_coordinator(job, study, iterations=5).plot_gantt(str(path))
    assert path.stat().st_size > 1000 and len(fig.axes) == 2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(iterations=0), "iterations must be an int >= 1"),
        (dict(iterations=2, delay_bound=-0.1), "delay_bound must be a fraction >= 0"),
        (dict(iterations=2, speed=0), "speed must be > 0"),
        (dict(iterations=2, swap_bandwidth=0), "swap_bandwidth must be > 0"),
    ],
)
def test_bad_arguments(kwargs, match):
    job = PipelineJob(2, 2)
    with pytest.raises(ValueError, match=match):
        interleave(job, [TrialGroup("g", (0,), (1,))], **kwargs)


def test_memory_that_fits_no_trial_and_bad_studies():
    job = PipelineJob(4, 8, static_memory=70, activation_memory=2)
    big = TrialGroup("big", (0,), (10,), memory_per_trial=20.0)
    with pytest.raises(ValueError, match="'big': one trial needs 20.0 GiB .* at most 8.00 GiB"):
        interleave(job, [big], iterations=2)
    with pytest.raises(ValueError, match="unique"):
        interleave(job, [TrialGroup("g", (0,), (1,)), TrialGroup("g", (1,), (1,))], 2)
    with pytest.raises(ValueError, match="waits for 'x'"):
        interleave(job, [TrialGroup("g", (0,), (1,), after=("x",))], 2)
    with pytest.raises(ValueError, match="check_iterations"):
        simulate_coordinator(job, [TrialGroup("g", (0,), (1,))], 2, check_iterations=0)

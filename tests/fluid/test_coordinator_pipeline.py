"""The host job model: schedules, bubbles and memory against their closed forms."""

import doctest
import importlib
import random

import pytest

from hydro_fluid.coordinator import PipelineJob, periodic_bubbles


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (3, 2), (4, 4), (4, 8), (8, 16), (16, 5), (7, 29)])
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (0.3, 0.3)])
def test_uniform_stages_idle_for_the_closed_form_fraction(schedule, p, m, f, b):
    t = PipelineJob(p, m, forward=f, backward=b, schedule=schedule).timeline()
    assert t.makespan == pytest.approx((m + p - 1) * (f + b), rel=1e-12)
    assert t.idle_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    for i in range(p):
        assert t.busy(i) == pytest.approx(m * (f + b))


@pytest.mark.parametrize("p,m", [(4, 8), (8, 16), (8, 3), (5, 5)])
def test_activation_peaks_per_stage(p, m):
    job = PipelineJob(p, m, static_memory=10.0, activation_memory=1.5)
    t = job.timeline()
    for i in range(p):
        assert t.peak_in_flight(i) == min(p - i, m) == job.max_in_flight(i)
        assert t.peak_memory(i) == pytest.approx(10.0 + 1.5 * min(p - i, m))
        # memory over time, sampled at every op start, reaches and never passes the peak
        samples = [t.memory(i, op.start) for op in t.ops[i]]
        assert max(samples) == pytest.approx(t.peak_memory(i))
    gpipe = PipelineJob(p, m, schedule="gpipe", activation_memory=1.0).timeline()
    assert [gpipe.peak_in_flight(i) for i in range(p)] == [m] * p


def _random_job(rng, schedule=None, **kw):
    p, m = rng.randint(1, 9), rng.randint(1, 12)
    return PipelineJob(
        p,
        m,
        forward=[rng.uniform(0.05, 1.0) for _ in range(p)],
        backward=[rng.uniform(0.05, 2.0) for _ in range(p)],
        schedule=schedule or rng.choice(["1f1b", "gpipe"]),
        **kw,
    )


@pytest.mark.parametrize("seed", range(12))
def test_random_schedules_respect_dependencies_and_bubbles_fill_the_idle_time(seed):
    rng = random.Random(seed)
    job = _random_job(rng, static_memory=5.0, activation_memory=0.5)
    t = job.timeline(iterations=2)
    p, m = job.stages, job.micro_batches
    end = {(op.stage, op.kind, op.micro_batch, op.iteration): op for s in t.ops for op in s}
    assert len(end) == 2 * 2 * p * m
    for (i, kind, j, it), op in end.items():
        if kind == "F" and i > 0:
            assert op.start >= end[(i - 1, "F", j, it)].end - 1e-12
        if kind == "B":
            assert op.start >= end[(i, "F", j, it)].end - 1e-12
            if i < p - 1:
                assert op.start >= end[(i + 1, "B", j, it)].end - 1e-12
    for i, ops in enumerate(t.ops):
        for a, b in zip(ops, ops[1:]):
            assert b.start >= a.end - 1e-12  # one op at a time per device
        bubbles = [x for x in t.bubbles() if x.stage == i]
        assert sum(x.duration for x in bubbles) == pytest.approx(t.makespan - t.busy(i))
        for x in bubbles:
            assert not any(op.start < x.end - 1e-12 and op.end > x.start + 1e-12 for op in ops)
            assert x.free_memory == pytest.approx(80.0 - t.memory(i, x.start + 1e-12))
    idle = sum(x.duration for x in t.bubbles()) / (p * t.makespan)
    assert idle == pytest.approx(t.idle_fraction)


@pytest.mark.parametrize("seed", range(6))
def test_periodic_bubbles_match_a_simulated_multi_iteration_run(seed):
    job = _random_job(random.Random(100 + seed))
    n = 3
    want = [(b.stage, b.start, b.end, b.before) for b in job.timeline(n).bubbles()]
    got = [(b.stage, b.start, b.end, b.before) for b in periodic_bubbles(job.timeline(), n)]
    assert len(got) == len(want)
    for g, w in zip(sorted(got), sorted(want)):
        assert g[0] == w[0] and g[3] == w[3]
        assert g[1] == pytest.approx(w[1], abs=1e-9) and g[2] == pytest.approx(w[2], abs=1e-9)


def test_guest_time_before_an_op_delays_the_host_by_at_most_the_overrun():
    job = PipelineJob(4, 8, forward=1.0, backward=2.0)
    t = job.timeline()
    gap = next(b for b in t.bubbles() if b.before not in (None, 0) and b.duration > 0)
    same = job.timeline(guest={(gap.stage, gap.before): gap.duration})
    assert same.makespan == pytest.approx(t.makespan)
    later = job.timeline(guest={(gap.stage, gap.before): gap.duration + 0.5})
    assert t.makespan < later.makespan <= t.makespan + 0.5 + 1e-9


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(stages=0, micro_batches=4), "stages must be an int >= 1"),
        (dict(stages=4, micro_batches=0), "micro_batches must be an int >= 1"),
        (dict(stages=2.5, micro_batches=4), "stages must be an int"),
        (dict(stages=True, micro_batches=4), "stages must be an int"),
        (dict(stages=2, micro_batches=4, forward=-1.0), "forward must be finite and >= 0"),
        (dict(stages=2, micro_batches=4, backward=[1.0, -2.0]), "backward must be finite"),
        (dict(stages=2, micro_batches=4, forward=[1.0]), "1 values for 2 stages"),
        (dict(stages=2, micro_batches=4, forward=0.0, backward=0.0), "all 0"),
        (dict(stages=2, micro_batches=4, schedule="zb"), "schedule must be one of"),
        (dict(stages=2, micro_batches=4, device_memory=0), "device_memory must be > 0"),
        (
            dict(stages=2, micro_batches=64, schedule="gpipe", activation_memory=2.0),
            "stage 0 needs 128.00 GiB",
        ),
    ],
)
def test_bad_jobs_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineJob(**kwargs)


def test_bad_timeline_arguments():
    job = PipelineJob(2, 2)
    with pytest.raises(ValueError, match="iterations must be >= 1"):
        job.timeline(0)
    with pytest.raises(ValueError, match="not valid"):
        job.timeline(guest={(5, 0): 1.0})
    with pytest.raises(ValueError, match="single iteration"):
        list(periodic_bubbles(job.timeline(2), 2))


@pytest.mark.parametrize(
    "name",
    [
        "hydro_fluid.coordinator.pipeline",
        "hydro_fluid.coordinator.interleave",
        "hydro_fluid.coordinator.simulate",
    ],
)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_the_examples_in_docs_coordinator_md_run():
    import re
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "how-to" / "pipeline-bubbles.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 3
    scope: dict = {}
    for block in blocks:
        if "run_pipeline" in block:  # the real run is tested in test_coordinator_real.py
            continue
        exec(compile(block, "docs/how-to/pipeline-bubbles.md", "exec"), scope)
    assert scope["plan"].bubble_use > 0.7

"""RayExecutor applies each placement policy's decisions on a real local Ray (127.0.0.1 only).

Every test runs real Ray tasks (hydro_fluid.executors.examples.placed_steps) and asserts on what
the policy decided (``executor.decisions``) and on what the workers saw (threads, world size,
every step trained), never on wall time.
"""

import functools
import os
import sys
import time
from pathlib import Path

import pytest

from hydro_fluid import TrialGroup
from hydro_fluid.executors.examples import placed_steps

ray = pytest.importorskip("ray")

from hydro_fluid import RayExecutor  # noqa: E402
from hydro_fluid.executors.ray import _init_ray  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray on 127.0.0.1 with 4 CPUs (2 devices of 2 CPUs); workers import this checkout."""
    if ray.is_initialized():
        ray.shutdown()
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), *sys.path])
    _init_ray(ray, None, {"num_cpus": 4, "num_gpus": 0, "log_to_driver": False,
                          "runtime_env": {"env_vars": {"PYTHONPATH": path}}})
    yield
    ray.shutdown()


@pytest.fixture
def executor(local_ray):
    made = RayExecutor(cpus_per_worker=2, restart_cost=0.0)
    yield made
    made.shutdown()


def long_first(group, ctx, folder: str, seconds: float):
    """placed_steps, but the long group trains only once both short ones have started, and
    they only once it has: they end while it still has most of its steps to go, however
    slowly Ray starts its workers on a loaded machine."""
    (Path(folder) / group.name).touch()
    wait_for = ["short-a", "short-b"] if group.name == "long" else ["long"]
    deadline = time.monotonic() + 120
    while not all((Path(folder) / name).exists() for name in wait_for):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{wait_for} never started")
        time.sleep(0.02)
    return placed_steps(group, ctx, seconds)


def by_name(results):
    return {r.group.name: r for r in results}


def one_long_two_short(long: int = 60):
    return [
        TrialGroup("long", (0,), (long,)),
        TrialGroup("short-a", (1,), (8,)),
        TrialGroup("short-b", (2,), (8,)),
    ]


def test_devices_are_the_nodes_cpus_split_into_worker_slots(executor):
    devices = executor.placement_devices()
    assert [d.kind for d in devices] == ["cpu", "cpu"]
    assert devices[0].name.endswith("/cpu0") and devices[1].name.endswith("/cpu1")
    assert devices[0].node == devices[1].node == ray.get_runtime_context().get_node_id()


def test_fifo_never_packs_nor_moves(executor):
    fn = functools.partial(placed_steps, seconds=0.01)
    results = by_name(executor.run(one_long_two_short(20), fn, policy="fifo"))
    for decision in executor.decisions:
        for slots in decision.allocation.values():
            assert len(slots) == 1 and slots[0][1] == 1.0
        devices = [slots[0][0] for slots in decision.allocation.values()]
        assert len(devices) == len(set(devices))  # never two groups on one device
    assert all(r.moves == 0 and r.value["placements"][0][:2] == [1, 2] for r in results.values())
    assert results["long"].value["trained"] == list(range(20))


def test_dynamic_packs_then_widens_and_moves_a_group_with_its_checkpoint(executor, tmp_path):
    fn = functools.partial(long_first, folder=str(tmp_path), seconds=0.03)
    results = by_name(executor.run(one_long_two_short(80), fn, policy="dynamic"))

    first = executor.decisions[0].allocation
    # the long group gets a whole device; the two short ones share the other, half each
    ((dev_long, share_long),) = first["long"]
    ((dev_a, share_a),) = first["short-a"]
    ((dev_b, share_b),) = first["short-b"]
    assert share_long == 1.0 and dev_a == dev_b != dev_long and share_a == share_b == 0.5
    # ... as Ray tasks of one CPU each: the device's 2 threads split 1 + 1
    assert results["short-a"].value["placements"][0] == [1, 1, 0]
    assert results["short-b"].value["placements"][0] == [1, 1, 0]

    # once the short ones end, the long one is stopped through the hub after a checkpoint and
    # widened over both devices: a move, not a retry, and no step lost or repeated (on a
    # loaded machine the policy may also widen a short group that outlives its twin)
    long = results["long"]
    assert long.moves >= 1 and long.attempts == 1 and long.ok
    assert long.value["placements"][0] == [1, 2, 0]
    assert any(ws == 2 and 0 < at < 80 for ws, _, at in long.value["placements"][1:])
    for r in results.values():
        assert r.value["trained"] == list(range(max(r.group.budgets)))
        assert r.moves == len(r.value["placements"]) - 1 and r.attempts == 1
    # the workers' step times reached the placer through the hub
    assert executor.measured["long"]["seconds_per_step"] > 0
    assert all(o.state == "COMPLETE" for r in results.values() for o in r.trials.values())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "fastest"}, "unknown placement policy 'fastest'"),
        ({"policy": "deadline"}, "needs a deadline"),
        ({"policy": "dynamic", "max_world_size": 0}, "max_world_size must be an int >= 1"),
    ],
)
def test_bad_placement_arguments_are_refused_before_any_task_starts(executor, kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        executor.run([TrialGroup("g", (0,), (3,))], placed_steps, **kwargs)
    assert "\n" not in str(info.value)


def test_optimize_places_its_groups_on_ray_with_the_dynamic_policy(executor, tmp_path):
    import optuna
    import torch
    from optuna.trial import TrialState

    import hydro
    from hydro.integrations.optuna import optimize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(-1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    task = hydro.Task(model=model, train_data=(x[:96], y[:96]), val_data=(x[96:], y[96:]),
                      steps=8, eval_every=4, batch_size=32,
                      loss=torch.nn.functional.cross_entropy)
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}",
                                sampler=optuna.samplers.RandomSampler(seed=0))
    space = {"lr": optuna.distributions.FloatDistribution(1e-3, 1e-1, log=True)}
    optimize(study, task, space, n_trials=4, ratio=2, fuse=2, executor=executor,
             policy="dynamic", checkpoint_dir=str(tmp_path / "checkpoints"))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    assert study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING)) == []
    # the policy placed the tuner's groups: its decisions name them
    assert executor.decisions and any(d.allocation for d in executor.decisions)

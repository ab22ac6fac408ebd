"""RayExecutor on a real local Ray with fake GPUs: packing, streaming, a killed worker, DDP."""

import functools
import os
import signal
import stat
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from hydro_fluid import RayExecutor, TrialGroup

from .test_fluid_local import ddp_gradient, make_batch, make_model, wait_for_peers

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray on 127.0.0.1 with 2 CPUs and 2 fake GPUs; workers import this checkout."""
    from hydro_fluid.executors.ray import _init_ray

    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), *sys.path])
    _init_ray(ray, None, {"num_cpus": 2, "num_gpus": 2, "log_to_driver": False,
                          "runtime_env": {"env_vars": {"PYTHONPATH": path}}})
    yield
    ray.shutdown()


@pytest.fixture
def make_executor(local_ray):
    """Build RayExecutors and stop their reporting actors after the test."""
    made = []

    def make(**kwargs):
        made.append(RayExecutor(**kwargs))
        return made[-1]

    yield make
    for executor in made:
        executor.shutdown()


def packed_worker(group, ctx, barrier: str):
    """Checks in with its peer, reports, and tells what Ray gave it."""
    wait_for_peers(Path(barrier), ctx.group_name, peers=2)
    for step in range(5):
        for trial in group.trial_ids:
            if not ctx.is_pruned(trial):
                ctx.report(trial, step, float(step))
        time.sleep(0.05)
    return {"gpu_ids": ray.get_gpu_ids(), "device": ctx.device, "threads": ctx.num_threads}


def checkpointed_counter(group, ctx, pid_file: str, steps: int = 30):
    Path(pid_file).write_text(str(os.getpid()))
    state = ctx.load_checkpoint() or {"step": 0}
    for step in range(state["step"], steps):
        ctx.report(group.trial_ids[0], step, float(step))
        ctx.save_checkpoint({"step": step + 1})
        time.sleep(0.05)
    return {"resumed_from": state["step"], "attempt": ctx.attempt}


def oom_above_one(group, ctx):
    if group.size > 1:
        raise MemoryError("too many fused trials")
    return list(group.trial_ids)


def test_two_groups_share_one_fake_gpu_and_stream_reports(make_executor, tmp_path):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    groups = [TrialGroup("a", (0, 1), (5, 5)), TrialGroup("b", (2,), (5,))]
    reports = []
    executor = make_executor(groups_per_device=2)
    assert executor.use_gpus and executor.gpus == 2
    results = executor.run(
        groups,
        functools.partial(packed_worker, barrier=str(barrier)),
        report=lambda trial, step, value: reports.append((trial, step)),
    )
    assert [r.group.name for r in results] == ["a", "b"]
    for result in results:
        assert result.ok, result.error
        assert len(result.value["gpu_ids"]) == 1  # half of one fake GPU each
        assert result.value["device"] == "cpu"  # fake GPUs: no CUDA behind them
        assert all(o.state == "COMPLETE" for o in result.trials.values())
    for trial in (0, 1, 2):
        assert [s for t, s in reports if t == trial] == list(range(5))


def test_killed_ray_worker_is_retried_from_checkpoint(make_executor, tmp_path):
    pid_file = tmp_path / "pid"
    killed = []

    def kill_at_step_5(trial, step, value):
        if step >= 5 and not killed:
            pid = int(pid_file.read_text())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    executor = make_executor(max_retries=1, checkpoint_dir=tmp_path / "ckpt")
    [result] = executor.run(
        [TrialGroup("g", (7,), (30,))],
        functools.partial(checkpointed_counter, pid_file=str(pid_file)),
        report=kill_at_step_5,
    )
    assert killed
    assert result.ok, result.error
    assert result.attempts == 2
    assert result.trials[7].state == "COMPLETE"
    assert result.value["resumed_from"] >= 5
    for d in (tmp_path / "ckpt", tmp_path / "ckpt" / "g"):  # private, not only from a save on
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


def test_ray_out_of_memory_splits_the_group(make_executor):
    results = make_executor().run([TrialGroup("g", (0, 1, 2), (1, 1, 1))], oom_above_one)
    assert sorted(t for r in results for t in r.value) == [0, 1, 2]
    assert all(r.trials[t].state == "COMPLETE" for r in results for t in r.group.trial_ids)


def test_ray_does_not_retry_a_deterministic_error(make_executor):
    """As on the LocalExecutor: an error marked deterministic (user code raised) ends the
    group after one attempt, its one-line message the trials' reason (a dead worker is still
    retried: test_killed_ray_worker_is_retried_from_checkpoint)."""
    from tests.tuning.test_user_faults import _raise

    [result] = make_executor(max_retries=1).run([TrialGroup("d", (1,), (1,))], _raise)
    assert result.attempts == 1 and result.deterministic
    assert result.trials[1].reason == "data 'x' raised OSError: gone at x.py:1"


def test_ray_data_parallel_group_in_a_placement_group(make_executor):
    [result] = make_executor().run([TrialGroup("dp", (0,), (1,))], ddp_gradient, world_size=2)
    assert result.ok, result.error
    model = make_model()
    x, y = make_batch()
    nn.functional.mse_loss(model(x), y).backward()
    for averaged, full in zip(result.value, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(averaged, full, rtol=1e-5, atol=1e-6)


def test_ray_bad_input(make_executor):
    with pytest.raises(ValueError, match="world_size=3"):
        make_executor().run([TrialGroup("g", (0,), (1,))], oom_above_one, world_size=3)
    with pytest.raises(ValueError, match="groups_per_device"):
        make_executor(groups_per_device=0)


def test_missing_ray_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(RuntimeError, match=r"pip install 'hydro-surrogate\[ray\]'"):
        RayExecutor()


LOCAL_RAY_SCRIPT = """
import json, sys
import ray
from hydro_fluid import RayExecutor

def listening(port):
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                found.append(address)
    return found

def off_loopback():
    import psutil  # Ray ships it

    bad = []
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            sockets = proc.net_connections(kind="tcp")
        except psutil.Error:  # ended meanwhile
            continue
        bad += [f"{proc.name()} {a.ip}" for s in sockets for a in (s.laddr, s.raddr)
                if a and a.ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    return bad

ex = RayExecutor(init_kwargs={"num_cpus": 1})
ray.get(ray.remote(lambda: None).remote())  # a worker process too
gcs = ray.get_runtime_context().gcs_address
print(json.dumps({"nodes": [n["NodeManagerAddress"] for n in ray.nodes()], "gcs": gcs,
                  "listening": listening(int(gcs.rsplit(":", 1)[1])),
                  "off_loopback": off_loopback()}))
ex.shutdown()
"""


def test_a_local_ray_started_by_the_executor_listens_on_loopback_only():
    """Ray has no authentication by default: a cluster RayExecutor() starts itself must not be
    reachable from the network (without Hydro's setting Ray binds every interface)."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", LOCAL_RAY_SCRIPT], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["nodes"] == ["127.0.0.1"] and seen["gcs"].startswith("127.0.0.1:")
    # the GCS port's sockets: 127.0.0.1 (IPv4 0100007F, or IPv4-mapped in IPv6), never any-address
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}
    assert seen["listening"] and set(seen["listening"]) <= loopback
    assert seen["off_loopback"] == []  # no socket of any Ray process, listening or connected

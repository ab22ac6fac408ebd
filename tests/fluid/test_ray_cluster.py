"""RayExecutor on a real two-node Ray cluster on this machine, on loopback only: a study spreads
over both nodes, and losing a node mid-group loses, duplicates and strands nothing.

The cluster is two raylets (``ray.cluster_utils.Cluster``) sharing one GCS, every process bound
to 127.0.0.1; the checkpoint root is a temporary directory both nodes see (they share this
machine's file system). The study is a real ``optimize`` on a real SQLite file.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState

from hydro.integrations.optuna import optimize
from tests import toy

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from hydro_fluid import RayExecutor, TrialGroup  # noqa: E402
from hydro_fluid.executors.base import Stopped  # noqa: E402
from hydro_fluid.executors.examples import count_steps  # noqa: E402
from hydro_fluid.executors.ray import _init_ray, _loopback_only  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)
ROOT = Path(__file__).resolve().parents[2]
SPACE = {
    "lr": optuna.distributions.FloatDistribution(1e-3, 1e-1, log=True),
    "weight_decay": optuna.distributions.FloatDistribution(0.0, 0.1),
}
# One CPU per node, so one group per node at a time, and small object stores.
NODE = {"node_ip_address": "127.0.0.1", "num_cpus": 1, "object_store_memory": 80 * 2**20}
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
STEPS, EVERY, BATCH = 12, 4, 32  # steps per trial; evaluation and checkpoint period
STALL_AT = 10  # the step at which the group on the worker node stops: after its checkpoint at 8


def started_here() -> list:
    """The processes this process started (and theirs) since this module's cluster fixture
    began: the Ray processes of both nodes and their workers."""
    import psutil  # Ray ships it

    return [p for p in psutil.Process().children(recursive=True) if p.pid not in EARLIER]


EARLIER: set[int] = set()  # processes started here before the cluster (by other tests)


def off_loopback() -> tuple[list[str], Counter]:
    """TCP sockets (listening or connected) of this process and the Ray processes it started
    whose local or remote address is not loopback; and how many processes of each name were
    looked at."""
    import psutil

    bad, seen = [], Counter()
    for proc in [psutil.Process(), *started_here()]:
        try:
            name, sockets = proc.name(), proc.net_connections(kind="tcp")
        except psutil.Error:  # it ended meanwhile
            continue
        seen[name] += 1
        for s in sockets:
            for addr in (s.laddr, s.raddr):
                if addr and addr.ip not in LOOPBACK:
                    bad.append(f"{name} (pid {proc.pid}) {s.status} {addr.ip}:{addr.port}")
    return bad, seen


def ray_processes() -> list[str]:
    """The Ray processes of this module's cluster still running."""
    import psutil

    found = []
    for proc in started_here():
        try:
            found.append(f"{proc.name()} (pid {proc.pid})")
        except psutil.Error:
            pass
    return found


@pytest.fixture(scope="module")
def cluster():
    """A head and a worker node on 127.0.0.1; stopped, with every process it started, at the end."""
    import psutil

    assert not ray.is_initialized()
    EARLIER.update(p.pid for p in psutil.Process().children(recursive=True))
    # Cluster would write its address to /tmp/ray/ray_current_cluster, where any ray.init()
    # on this machine (other tests running meanwhile) would find and join it, and its
    # shutdown would remove that file whoever wrote it: neither happens here.
    with pytest.MonkeyPatch.context() as mp, _loopback_only():
        mp.setattr(ray._private.utils, "write_ray_address", lambda *args, **kwargs: None)
        c = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    try:
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ray._common.utils, "reset_ray_address", lambda *args, **kwargs: None)
            c.shutdown()
        deadline = time.monotonic() + 30
        while ray_processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray_processes() == []  # no stray raylet, GCS or worker


@pytest.fixture
def two_nodes(cluster):
    """The cluster with exactly two live nodes (a worker node removed by a test is replaced):
    ``(cluster, head node id, worker Node)``."""
    if not cluster.worker_nodes:
        with _loopback_only():
            cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    [worker] = cluster.worker_nodes
    return cluster, cluster.head_node.node_id, worker


@pytest.fixture(scope="module")
def driver(cluster):
    """This process joins the cluster once, on loopback, as RayExecutor(address=...) does; its
    workers (which keep what they imported) serve every test."""
    path = os.pathsep.join([str(ROOT), *sys.path])
    env = {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    _init_ray(ray, cluster.address, {"runtime_env": {"env_vars": env}, "log_to_driver": False})
    yield
    ray.shutdown()


@pytest.fixture
def make_executor(two_nodes, driver):
    """RayExecutors on the cluster; their reporting actors are stopped after the test."""
    made = []

    def make(**kwargs) -> RayExecutor:
        made.append(RayExecutor(**kwargs))
        return made[-1]

    yield make
    for executor in made:
        executor.shutdown()


class NodeLog:
    """Cross-entropy that logs, for each attempt of a group, the node and process that trained
    it and how many training steps it took (``folder/<pid>-<uuid>.json``).

    On node ``stall_on`` it stops at training step ``stall_at`` (once: the file ``stalled``
    remembers it) until the test removes that node; after ``STALL_LIMIT`` seconds it gives up
    with an error, so that a test that never removes the node fails instead of hanging.
    """

    STALL_LIMIT = 120.0

    def __init__(self, folder: str, stall_on: str | None = None, stall_at: int = 0) -> None:
        self.folder, self.stall_on, self.stall_at = Path(folder), stall_on, stall_at
        self.steps, self.file, self.node = 0, None, None

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # a training step: gradients on and a full batch (evaluations run without gradients;
        # the task's check of the loss before training sees a sample batch of 2)
        if torch.is_grad_enabled() and out.shape[0] == BATCH:
            if self.file is None:  # a fresh copy of the task: a new attempt
                self.node = ray.get_runtime_context().get_node_id()
                self.file = self.folder / f"{os.getpid()}-{uuid.uuid4().hex}.json"
            self.steps += 1
            self.file.write_text(json.dumps({"node": self.node, "pid": os.getpid(),
                                             "steps": self.steps}))
            stalled = self.folder / "stalled"
            if self.node == self.stall_on and self.steps == self.stall_at \
                    and not stalled.exists():
                tmp = self.folder / f".stalled.{os.getpid()}"
                tmp.write_text(json.dumps({"node": self.node, "pid": os.getpid()}))
                os.replace(tmp, stalled)
                time.sleep(self.STALL_LIMIT)
                raise RuntimeError("the test never removed this node")
        return torch.nn.functional.cross_entropy(out, y)


def make_task(loss: NodeLog):
    return toy.task(steps=STEPS, eval_every=EVERY, batch_size=BATCH, loss=loss)


def attempts(folder: Path) -> list[dict]:
    """What each attempt of a group logged in the workers (see :class:`NodeLog`)."""
    logged = [json.loads(f.read_text()) for f in folder.glob("*.json")]
    return [a for a in logged if a["pid"] != os.getpid()]  # not a check the driver ran


def sqlite_study(tmp_path: Path) -> optuna.Study:
    return optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}",
                               sampler=optuna.samplers.RandomSampler(seed=0),
                               pruner=optuna.pruners.NopPruner())


def test_a_study_spreads_its_groups_over_both_nodes(two_nodes, make_executor, tmp_path):
    _, head, worker = two_nodes
    log = tmp_path / "log"
    log.mkdir()
    study = sqlite_study(tmp_path)
    executor = make_executor(checkpoint_dir=tmp_path / "checkpoints")
    assert len(executor.slots) == 2  # one CPU on each node
    optimize(study, make_task(NodeLog(str(log))), SPACE, n_trials=4, ratio=2, fuse=2,
             executor=executor, checkpoint_every=EVERY, policy="fifo")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    node_of = {a["pid"]: a["node"] for a in attempts(log)}
    # two groups of two trials, trained at once: one on each node
    assert {node_of[t.user_attrs["worker_pid"]] for t in study.trials} == {head, worker.node_id}
    assert ray.get(executor._hub.node.remote()) == head
    bad, seen = off_loopback()
    assert seen["raylet"] == 2 and seen["gcs_server"] == 1
    assert bad == []
    # without a shared checkpoint_dir a group retried elsewhere would restart: said at once
    with pytest.warns(UserWarning, match="no checkpoint_dir on a cluster of several nodes"):
        [result] = make_executor().run([TrialGroup("g", (0,), (3,))], count_steps)
    assert result.ok and result.value == 3


def lose_the_worker_node(two_nodes, executor, tmp_path, n_trials):
    """Run a study whose group on the worker node stops at its step ``STALL_AT`` (after its
    checkpoint); a thread then removes that node with SIGKILL. Returns the study, how often
    each trial was told, what the thread saw, and the attempts' logs."""
    cluster, _, worker = two_nodes
    log = tmp_path / "log"
    log.mkdir()
    study = sqlite_study(tmp_path)
    told = Counter()
    tell = study.tell

    def counting_tell(trial, *args, **kwargs):
        told[getattr(trial, "number", trial)] += 1
        return tell(trial, *args, **kwargs)

    study.tell = counting_tell
    watched: dict = {}

    def remove_the_worker_node_once_it_stalls() -> None:
        try:
            deadline = time.monotonic() + NodeLog.STALL_LIMIT
            while not (log / "stalled").exists():
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)
            watched["sockets"] = off_loopback()  # both nodes and their workers are up
            cluster.remove_node(worker, allow_graceful=False)  # SIGKILL: a lost node
            watched["removed"] = True
        except Exception as exc:  # reported by the assertions below
            watched["error"] = repr(exc)

    watcher = threading.Thread(target=remove_the_worker_node_once_it_stalls, daemon=True)
    watcher.start()
    task = make_task(NodeLog(str(log), stall_on=worker.node_id, stall_at=STALL_AT))
    # fifo: one group per node, so that one trains on the worker node (dynamic may pack both)
    optimize(study, task, SPACE, n_trials=n_trials, ratio=2, fuse=2, executor=executor,
             checkpoint_every=EVERY, policy="fifo")
    watcher.join(timeout=60)
    assert watched.get("removed"), watched
    assert json.loads((log / "stalled").read_text())["node"] == worker.node_id
    bad, seen = watched["sockets"]
    assert seen["raylet"] == 2 and seen["gcs_server"] == 1
    assert bad == []
    assert ray.get(executor._hub.node.remote()) == two_nodes[1]  # the hub stayed on the head
    assert study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING)) == []
    return study, told, attempts(log)


def test_losing_a_node_mid_group_loses_and_duplicates_nothing(two_nodes, make_executor, tmp_path):
    """The group on the worker node stops at its step 10 (checkpointed at 8); the node is
    removed with SIGKILL; the group resumes from step 8 on the head node: 2 steps retrained."""
    executor = make_executor(max_retries=1, checkpoint_dir=tmp_path / "checkpoints")
    study, told, logged = lose_the_worker_node(two_nodes, executor, tmp_path, n_trials=6)
    trials = study.trials
    # nothing lost: every trial ended COMPLETE, none FAIL, every evaluation reported
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 6, [
        t.user_attrs.get("fail_reason") for t in trials
    ]
    assert all(sorted(t.intermediate_values) == [4, 8, 12] for t in trials)
    # nothing duplicated: 6 trials asked, each told once, no parameter set asked twice
    assert [t.number for t in trials] == list(range(6))
    assert told == Counter(range(6))
    assert len({tuple(sorted(t.params.items())) for t in trials}) == 6
    # the lost node's trials finished on the head node
    node_of = {a["pid"]: a["node"] for a in logged}
    assert {node_of[t.user_attrs["worker_pid"]] for t in trials} == {two_nodes[1]}
    # the retried group resumed from its checkpoint: steps trained over all attempts exceed
    # those of an uninterrupted run (the occupancy counts, restored from the checkpoint) by
    # the steps since the checkpoint (9 and 10), not by the 10 steps from step 0
    trained = sum(a["steps"] for a in logged)
    retrained = trained - study.user_attrs["hydro_occupancy"]["steps"]
    assert retrained == STALL_AT - STALL_AT // EVERY * EVERY, (trained, retrained)
    assert len(logged) == 3  # one group per node, then the retry


def test_a_node_lost_without_retries_left_fails_its_trials_with_the_reason(
    two_nodes, make_executor, tmp_path
):
    """``max_retries=0``: the lost node's group is not retried; its two trials FAIL, saying
    that their node died, and the other node's trials complete. None is left RUNNING."""
    executor = make_executor(max_retries=0, checkpoint_dir=tmp_path / "checkpoints")
    study, told, _ = lose_the_worker_node(two_nodes, executor, tmp_path, n_trials=4)
    states = Counter(t.state for t in study.trials)
    assert states == {TrialState.COMPLETE: 2, TrialState.FAIL: 2}
    for t in study.trials:
        if t.state == TrialState.FAIL:
            assert "NodeDiedError" in t.user_attrs["fail_reason"], t.user_attrs["fail_reason"]
    assert told == Counter(range(4))


def steps_stalling_on(group, ctx, folder: str, node: str, at: int) -> dict:
    """A movable group (checkpoint, ``ctx.progress`` and ``ctx.should_stop`` every step) that,
    on node ``node``, stalls after its checkpoint at step ``at`` until the test removes the node.
    Returns every step trained (across attempts, from the checkpoint) and the nodes it ran on."""
    here = ray.get_runtime_context().get_node_id()
    state = ctx.load_checkpoint() or {"step": 0, "trained": [], "nodes": []}
    state["nodes"].append(here)
    for step in range(state["step"], max(group.budgets)):
        time.sleep(0.02)
        state["trained"].append(step)
        state["step"] = step + 1
        ctx.save_checkpoint(state)
        ctx.progress(step + 1, 1)
        if here == node and step + 1 == at:
            (Path(folder) / "stalled").touch()
            time.sleep(NodeLog.STALL_LIMIT)
            raise RuntimeError("the test never removed this node")
        if step + 1 < max(group.budgets) and ctx.should_stop():
            raise Stopped
    return state


def test_a_policy_sees_a_node_leave_and_resumes_its_group_elsewhere(
    two_nodes, make_executor, tmp_path
):
    """Under ``policy="dynamic"`` the two nodes are two devices; removing the worker node
    (SIGKILL) is a device-leave event, and its group resumes from its checkpoint on the head."""
    cluster, head, worker = two_nodes
    executor = make_executor(checkpoint_dir=tmp_path / "checkpoints", restart_cost=0.0)
    assert {d.node for d in executor.placement_devices()} == {head, worker.node_id}
    watched: dict = {}

    def remove_the_worker_node_once_it_stalls() -> None:
        deadline = time.monotonic() + NodeLog.STALL_LIMIT
        while not (tmp_path / "stalled").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        watched["sockets"] = off_loopback()
        cluster.remove_node(worker, allow_graceful=False)
        watched["removed"] = True

    watcher = threading.Thread(target=remove_the_worker_node_once_it_stalls, daemon=True)
    watcher.start()
    fn = functools.partial(steps_stalling_on, folder=str(tmp_path), node=worker.node_id, at=5)
    groups = [TrialGroup("a", (0,), (20,)), TrialGroup("b", (1,), (20,))]
    results = {r.group.name: r for r in executor.run(groups, fn, policy="dynamic",
                                                     max_world_size=1)}
    watcher.join(timeout=60)
    assert watched.get("removed") and watched["sockets"][0] == []  # nothing off loopback
    assert all(r.ok for r in results.values()), [(r.error, r.attempts) for r in results.values()]
    assert all(r.value["trained"] == list(range(20)) for r in results.values())
    [moved] = [r for r in results.values() if r.value["nodes"][0] == worker.node_id]
    assert moved.value["nodes"] == [worker.node_id, head]  # resumed on the head, at step 5
    left = [d for d in executor.decisions if d.event == "devices"]
    assert left, "the node leaving was never an event"
    assert all(not slots[0][0].startswith(worker.node_id[:8])
               for d in left for slots in d.allocation.values())


@pytest.mark.parametrize(
    ("address", "loopback"),
    [("127.0.0.1:6379", True), ("localhost:6379", True), ("[::1]:6379", True),
     ("10.0.0.1:6379", False), ("head:6379", False), ("ray://127.0.0.1:10001", False),
     ("auto", False)],
)
def test_which_addresses_a_driver_joins_on_loopback(address, loopback):
    """A driver joins a cluster at a loopback address on 127.0.0.1 (Ray would use the network
    address); a Ray Client address or ``auto`` is left to Ray."""
    from hydro_fluid.executors.ray import _is_loopback

    assert _is_loopback(address) is loopback

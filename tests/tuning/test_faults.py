"""Fault injection: real tuner processes SIGKILLed at known points, real worker kills, and
several real processes sharing one study (SQLite and a journal file). Every scenario ends with
the same counts: trials lost 0, complete trials retrained 0, duplicates 0, left RUNNING 0, and
exactly n_trials complete trials."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from hydro.integrations.optuna import is_void

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
N = 4  # trials; fuse 2 -> two groups


def child(storage: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tests.tuner_child", storage, str(N), "--fuse", "2", *extra]


def load(storage: str) -> optuna.Study:
    if storage.startswith("journal:"):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        storage = JournalStorage(JournalFileBackend(storage[len("journal:") :]))
    return optuna.load_study(study_name="hydro", storage=storage)


def run_until_marker(cmd: list[str], marker: Path) -> int:
    """Start ``cmd``, wait for it to reach its stop point, SIGKILL it; returns its pid."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV)
    try:
        while not marker.exists():
            assert proc.poll() is None, f"the tuner ended ({proc.returncode}) before its stop"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return proc.pid


def counts(study: optuna.Study, before: dict[int, tuple] | None = None) -> dict[str, int]:
    """The fault counts of a study (``before``: complete trials seen before a kill)."""
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    params = [tuple(sorted(t.params.items())) for t in complete]
    interrupted = [t for t in trials if t.user_attrs.get("fail_reason", "").startswith("interr")]
    before = before or {}
    lost = sum(1 for n, v in before.items() if trials[n].state != TrialState.COMPLETE
               or trials[n].value != v[1])
    lost += sum(1 for t in interrupted if t.params
                and sum(1 for c in complete if c.params == t.params) != 1)
    # another trial (not a void, interrupted row) with the parameters of a complete one
    retrained = sum(
        1 for n, (p, _) in before.items() for t in trials
        if t.number != n and t.params == p and not is_void(t)
    )
    return {
        "lost": lost,
        "retrained": retrained,
        "duplicates": len(params) - len(set(params)),
        "running": sum(1 for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)),
        "complete": len(complete),
        "failed": sum(1 for t in trials if t.state == TrialState.FAIL and not is_void(t)),
    }


EXPECTED = {"lost": 0, "retrained": 0, "duplicates": 0, "running": 0, "complete": N, "failed": 0}


def test_tuner_killed_at_three_moments_then_rerun(tmp_path):
    """One study, the tuner SIGKILLed during the first group, then (rerun) between groups, then
    (rerun) during the last group; a last rerun of the same command finishes the study."""
    storage = f"sqlite:///{tmp_path / 'hydro.db'}"
    optuna.create_study(storage=storage, study_name="hydro")
    before: dict[int, tuple] = {}
    # (where it stops, complete trials then, RUNNING trials then)
    for i, (stop, complete, running) in enumerate(
        [("train:1", 0, 2), ("ask:3", 2, 0), ("train:1", 2, 2)]
    ):
        marker = tmp_path / f"stop-{i}"
        run_until_marker([*child(storage), "--stop", stop, "--marker", str(marker)], marker)
        study = load(storage)
        assert sum(t.state == TrialState.COMPLETE for t in study.trials) == complete
        assert sum(t.state == TrialState.RUNNING for t in study.trials) == running
        before = {t.number: (t.params, t.value) for t in study.trials
                  if t.state == TrialState.COMPLETE}
        if i:  # what an earlier run completed is still there, untouched
            assert counts(study, before)["lost"] == 0
    subprocess.run(child(storage), cwd=ROOT, env=ENV, check=True, timeout=300)
    assert counts(load(storage), before) == EXPECTED


def test_worker_killed_mid_group(tmp_path):
    storage = f"sqlite:///{tmp_path / 'hydro.db'}"
    marker = tmp_path / "worker-killed"
    subprocess.run([*child(storage), "--executor", "local", "--kill-worker-at", "3", "--marker",
                    str(marker)], cwd=ROOT, env=ENV, check=True, timeout=300)
    assert marker.exists()  # a worker really was SIGKILLed
    assert not _alive(int(marker.read_text()))
    assert counts(load(storage)) == EXPECTED


@pytest.mark.parametrize("processes", [2, 4])
@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_concurrent_processes_share_one_study(tmp_path, processes, kind):
    if kind == "sqlite":
        storage = f"sqlite:///{tmp_path / 'hydro.db'}"
        optuna.create_study(storage=storage, study_name="hydro")
    else:
        storage = f"journal:{tmp_path / 'journal.log'}"
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        journal = JournalStorage(JournalFileBackend(str(tmp_path / "journal.log")))
        optuna.create_study(storage=journal, study_name="hydro")
    procs = [subprocess.Popen(child(storage), cwd=ROOT, env=ENV) for _ in range(processes)]
    assert [p.wait(timeout=300) for p in procs] == [0] * processes
    study = load(storage)
    assert counts(study) == EXPECTED
    # every trial trained once: no interrupted rows, so no live process's trial was taken away;
    # the only other rows are surplus asks of processes that raced for the last trials
    reasons = {t.user_attrs["fail_reason"] for t in study.trials if t.state == TrialState.FAIL}
    assert reasons <= {t.user_attrs["fail_reason"] for t in study.trials if is_void(t)}
    assert not any(r.startswith("interrupted") for r in reasons)
    assert not any(t.user_attrs.get("hydro_interrupted") for t in study.trials)  # none put back


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- checkpoints of a group (a worker killed mid-group resumes bit-identically) -------------


def _study_values(tmp_path: Path, name: str, kill_at: int) -> tuple[dict, list[int]]:
    from hydro.integrations.optuna import optimize
    from hydro_fluid import LocalExecutor
    from tests.tuner_child import SPACE, make_task

    marker = tmp_path / f"{name}-killed"
    task = make_task(12, kill_at, str(marker))
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    ex = LocalExecutor(devices=[], num_workers=1, max_retries=1)
    optimize(study, task, SPACE, n_trials=3, ratio=2, fuse=3, executor=ex, checkpoint_every=4)
    values = {t.number: (t.params, t.value, dict(t.intermediate_values)) for t in study.trials}
    return values, [int(marker.read_text())] if marker.exists() else []


def test_killed_worker_resumes_from_checkpoint_bit_identical(tmp_path):
    plain, _ = _study_values(tmp_path, "plain", 0)
    resumed, killed = _study_values(tmp_path, "resumed", 10)  # after the step-8 checkpoint
    assert killed and not _alive(killed[0])
    assert resumed == plain  # same trials, same values to the last bit
    assert all(v[1] is not None for v in plain.values())


def test_group_resumes_from_checkpoint_with_identical_state(tmp_path):
    """In process: stop a group after a checkpoint, resume it; every saved tensor (model,
    optimizer, RNG) at the last checkpoint equals an uninterrupted run's, bit for bit."""
    import torch

    from hydro.tuning import checkpoint
    from hydro.tuning.lockstep import train_group
    from tests.tuning.test_tune import make_task

    task = make_task(steps=24, eval_every=4, scheduler="cosine")
    params = [{"lr": 1e-2, "warmup": 3}, {"lr": 3e-2}, {"lr": 1e-3, "warmup": 2}]

    class Stop(Exception):
        pass

    def prune_one(k: int, step: int, value: float) -> bool:
        return k == 1 and step == 8

    def stop_at_16(k: int, step: int, value: float) -> bool:
        if step == 16:
            raise Stop
        return prune_one(k, step, value)

    def reseed() -> None:  # the process's global random state, as a fresh worker's
        import random

        import numpy as np

        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    reseed()
    full, _ = train_group(task, params, ratio=2, seeds=[0, 1, 2], report=prune_one,
                          checkpoint=whole, checkpoint_every=5)
    reseed()
    with pytest.raises(Stop):
        train_group(task, params, ratio=2, seeds=[0, 1, 2], report=stop_at_16, checkpoint=cut,
                    checkpoint_every=5)
    assert checkpoint.load(cut)["step"] == 15
    torch.manual_seed(123)  # the resumed run must not depend on the state it starts in
    again, _ = train_group(task, params, ratio=2, seeds=[0, 1, 2], report=prune_one,
                           checkpoint=cut, checkpoint_every=5)
    assert [(o.state, o.value, o.history) for o in again] == [
        (o.state, o.value, o.history) for o in full]
    a, b = checkpoint.load(whole), checkpoint.load(cut)
    assert a["step"] == b["step"] == 20 and a["alive"] == b["alive"] == [0, 2]

    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
        return x == y

    assert same(a["model"], b["model"]) and same(a["optimizer"], b["optimizer"])
    assert same(a["rng"], b["rng"])


def test_planted_pickle_is_refused(tmp_path):
    """A file with a pickle payload that would run code is refused, and the code never runs."""
    import pickle

    from hydro.tuning import checkpoint
    from hydro_fluid.executors.base import WorkerContext

    flag = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {flag}",))

    for name in (checkpoint.FILE, "checkpoint.pt"):
        (tmp_path / name).write_bytes(pickle.dumps({"step": Payload()}, protocol=2))
    with pytest.raises(checkpoint.CheckpointError, match="refusing to load"):
        checkpoint.load(tmp_path)
    ctx = WorkerContext("g", "cpu", 1, 0, 1, 0, tmp_path, channel=None)
    with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
        ctx.load_checkpoint()
    assert not flag.exists()
    saved = checkpoint.save(tmp_path / "new", {"step": 3})
    assert checkpoint.load(saved.parent) == {"step": 3}
    assert (saved.parent.stat().st_mode & 0o777) == 0o700


def test_killed_tuner_leaves_no_worker_running_and_no_temp_dir(tmp_path, tmp_path_factory,
                                                                monkeypatch):
    import tempfile

    # a temp folder of this test's own: another test's run would sweep the killed run's
    # scratch (its process is dead) before this one looks (short: AF_UNIX paths end at 107)
    temp = Path(tempfile.mkdtemp(prefix="hf-", dir=tmp_path_factory.getbasetemp()))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    storage = f"sqlite:///{tmp_path / 'hydro.db'}"
    marker = tmp_path / "m"
    proc = subprocess.Popen([*child(storage, "--steps", "100000"), "--executor", "local",
                             "--kill-worker-at", "50", "--marker", str(marker)],
                            cwd=ROOT, env={**ENV, "TMPDIR": str(temp)})
    try:
        while not marker.exists():  # the worker writes its pid at step 50, then dies, retried
            assert proc.poll() is None
            time.sleep(0.05)
        time.sleep(0.5)
        workers = _children(proc.pid)
        assert workers, "the tuner has worker processes"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.time() + 5
    while time.time() < deadline and any(_alive(p) for p in workers):
        time.sleep(0.1)
    assert not [p for p in workers if _alive(p)]
    scratch = Path(tempfile.gettempdir()) / f"hydro-fluid-{os.getuid()}"
    left = [d for d in scratch.glob(f"run-{proc.pid}-*")]
    assert left  # killed: it could not clean up; the next run does
    from hydro_fluid.executors.local import _scratch_dir

    fresh = _scratch_dir()
    fresh.rmdir()
    assert not [d for d in left if d.exists()]


def _children(pid: int) -> list[int]:
    """Every descendant pid of ``pid`` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in parents.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class Stop(Exception):
    """Raised from a report to stop a group mid-run."""


def stopped_at_8(task, params, folder) -> None:
    """Train ``params`` as one group (seeds 0, 1, ratio 2), checkpointing in ``folder`` every
    5 steps, and stop it at step 8: its checkpoint is step 5's."""
    from hydro.tuning.lockstep import train_group

    def stop_at_8(k: int, step: int, value: float) -> bool:
        if step == 8:
            raise Stop
        return False

    with pytest.raises(Stop):
        train_group(task, params, ratio=2, seeds=[0, 1], report=stop_at_8, checkpoint=folder,
                    checkpoint_every=5)


def test_a_checkpoint_from_before_random_streams_resumes(tmp_path):
    """Checkpoints written before per-trial random streams have no ``trial_seed`` and
    ``trial_step``: a resume still loads them, and (without dropout) ends as an uninterrupted
    run does."""
    from hydro.tuning import checkpoint
    from hydro.tuning.lockstep import train_group
    from tests.tuning.test_tune import make_task

    task = make_task(steps=12, eval_every=4)
    params = [{"lr": 1e-2}, {"lr": 3e-2}]
    full, _ = train_group(task, params, ratio=2, seeds=[0, 1])
    stopped_at_8(task, params, tmp_path)
    saved = checkpoint.load(tmp_path)
    assert saved["step"] == 5
    for name in ("trial_seed", "trial_step"):  # as an older Hydro wrote it
        del saved["model"][name]
    checkpoint.save(tmp_path, saved)
    again, _ = train_group(task, params, ratio=2, seeds=[0, 1], checkpoint=tmp_path,
                           checkpoint_every=5)
    assert [(o.state, o.value, o.history) for o in again] == [
        (o.state, o.value, o.history) for o in full]

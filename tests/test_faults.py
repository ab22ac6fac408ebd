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

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
N = 6  # trials; fuse 2 -> three groups


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
               or trials[n].value != v[1])  # fmt: skip
    lost += sum(1 for t in interrupted if t.params
                and sum(1 for c in complete if c.params == t.params) != 1)  # fmt: skip
    retrained = sum(1 for n, (p, _) in before.items()
                    for t in trials if t.number != n and t.params == p)  # fmt: skip
    return {
        "lost": lost,
        "retrained": retrained,
        "duplicates": len(params) - len(set(params)),
        "running": sum(1 for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)),
        "complete": len(complete),
        "failed": sum(1 for t in trials if t.state == TrialState.FAIL and not is_void(t)),
    }


EXPECTED = {"lost": 0, "retrained": 0, "duplicates": 0, "running": 0, "complete": N, "failed": 0}


@pytest.mark.parametrize(
    "stop", ["train:1", "ask:3", "train:3"], ids=["first-group", "between-groups", "last-group"]
)
def test_tuner_killed_then_rerun(tmp_path, stop):
    storage = f"sqlite:///{tmp_path / 'hydro.db'}"
    optuna.create_study(storage=storage, study_name="hydro")
    run_until_marker([*child(storage), "--stop", stop, "--marker", str(tmp_path / "m")],
                     tmp_path / "m")  # fmt: skip
    study = load(storage)
    before = {t.number: (t.params, t.value) for t in study.trials if t.state.name == "COMPLETE"}
    assert len(before) == {"train:1": 0, "ask:3": 2, "train:3": 4}[stop]
    assert sum(t.state == TrialState.RUNNING for t in study.trials) == (0 if stop == "ask:3" else 2)
    subprocess.run(child(storage), cwd=ROOT, env=ENV, check=True, timeout=300)
    assert counts(load(storage), before) == EXPECTED


def test_worker_killed_mid_group(tmp_path):
    storage = f"sqlite:///{tmp_path / 'hydro.db'}"
    marker = tmp_path / "worker-killed"
    subprocess.run([*child(storage), "--executor", "local", "--kill-worker-at", "3", "--marker",
                    str(marker)], cwd=ROOT, env=ENV, check=True, timeout=300)  # fmt: skip
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

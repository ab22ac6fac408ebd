"""A study database that another process holds locked, or that cannot be written, and owners of
trials on machines that share a hostname (issue 19, points 2 and 7).

The lock is real: a second SQLite connection holding ``BEGIN EXCLUSIVE`` from a thread, taken
while the run trains its first group, so the run meets it at its next storage call.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import threading
import time
from pathlib import Path

import optuna
import pytest
import torch
import torch.nn.functional as F
from optuna.trial import TrialState

import hydro
import hydro.tuning.bookkeeping as study_mod
from hydro.cli import main
from tests import toy

optuna.logging.set_verbosity(optuna.logging.WARNING)
SPACE = {"lr": optuna.distributions.FloatDistribution(1e-3, 1e-1, log=True)}


class Locker:
    """Holds the database EXCLUSIVE from a second connection for ``hold`` seconds, once: from
    the ``at``-th training call of the loss (see :meth:`loss`)."""

    def __init__(self, db: Path, hold: float, at: int = 3) -> None:
        self.db, self.hold, self.at, self.calls = db, hold, at, 0
        self.taken, self.released = threading.Event(), threading.Event()
        self.thread: threading.Thread | None = None

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls == self.at:
                self.thread = threading.Thread(target=self._hold, daemon=True)
                self.thread.start()
                assert self.taken.wait(20), "the second connection never got the lock"
        return F.cross_entropy(out, y)

    def _hold(self) -> None:
        con = sqlite3.connect(self.db, timeout=20, isolation_level=None)
        con.execute("BEGIN EXCLUSIVE")
        self.taken.set()
        time.sleep(self.hold)
        con.execute("COMMIT")
        con.close()
        self.released.set()


def tiny_task(loss) -> hydro.Task:
    return toy.task(n=96, n_train=64, steps=4, eval_every=1, loss=loss)


def test_a_lock_held_past_the_busy_timeout_mid_run_is_waited_out(tmp_path, monkeypatch):
    """Held 5.5 s, longer than SQLite's own wait here (2.5 s) and Optuna's default (5 s): the
    run retries, then completes every trial."""
    monkeypatch.setenv("HYDRO_STORAGE_TIMEOUT", "10")
    db = tmp_path / "study.db"
    locker = Locker(db, hold=5.5)
    start = time.monotonic()
    result = hydro.tune(tiny_task(locker.loss), SPACE, n_trials=2, ratio=2, fuse=2,
                        storage=f"sqlite:///{db}", seed=0)
    assert locker.released.is_set() and time.monotonic() - start > 5.5  # it did wait
    trials = result.study.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    assert all(t.user_attrs["hydro_owner"]["machine"] == study_mod.machine_id() for t in trials)


def test_a_lock_that_outlasts_the_run_stops_it_in_bounded_time_and_the_next_run_reclaims(
    tmp_path, monkeypatch
):
    """Timeout 0.5 s, lock 3 s: the run gives up while the lock is still held (its wait and
    its clean-up wait are bounded), so its two trials stay RUNNING; the next run, once the
    database is free, puts them back to WAITING and trains them."""
    monkeypatch.setenv("HYDRO_STORAGE_TIMEOUT", "0.5")
    db = tmp_path / "study.db"
    locker = Locker(db, hold=3.0)
    storage = f"sqlite:///{db}"
    with pytest.raises(hydro.errors.StorageError, match="stayed locked by another process"):
        hydro.tune(tiny_task(locker.loss), SPACE, n_trials=2, ratio=2, fuse=2,
                   storage=storage, seed=0)
    assert not locker.released.is_set()  # it did not wait for the lock to go
    assert locker.released.wait(10)
    study = optuna.load_study(study_name="hydro", storage=storage)
    left = study.get_trials(deepcopy=False)
    assert [t.state for t in left] == [TrialState.RUNNING] * 2
    # the same study, now without the locking loss (force: the recorded loss differs by name)
    result = hydro.tune(tiny_task("cross_entropy"), SPACE, n_trials=2, ratio=2, fuse=2,
                        storage=storage, seed=0, force_resume=True)
    trials = result.study.get_trials(deepcopy=False)
    # put back and taken up again: the same two trials, now complete, and no FAIL row
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    assert all(t.user_attrs["hydro_interrupted"] == 1 for t in trials)
    assert [t.params["lr"] for t in trials] == [t.params["lr"] for t in left]


LOSS = """
import torch.nn.functional as F

HOOK = None  # the test's Locker.loss

def loss(out, y):
    return HOOK(out, y) if HOOK is not None else F.cross_entropy(out, y)
"""
CONFIG = toy.config("storetoy", task="  loss: storetoy:loss\n", eval_every=1)


@pytest.fixture
def project(tmp_path, monkeypatch):
    toy.project(tmp_path, monkeypatch, "storetoy", toy.source(width=32, extra=LOSS), CONFIG)
    import storetoy

    yield tmp_path
    storetoy.HOOK = None


def _one_line(capsys, alone: bool = True) -> str:
    """The error line: all of stderr, or (``alone=False``, a run that had started) its last
    line after the run's header and progress bar; never a traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count(": error: ") == 1, err
    if alone:
        assert err.count("\n") == 1, err
    return err.rstrip("\n").splitlines()[-1]


def test_a_lock_held_too_long_is_one_line_and_leaves_no_trial_running(project, capsys,
                                                                       monkeypatch):
    """Timeout 5 s, lock 8 s: the run gives up at its next storage call if that call comes
    within 3 s of the lock (a loaded machine may take seconds to get there), then puts its two
    RUNNING trials back to WAITING once the lock is gone (its put-back waits up to 5 s more);
    the same command then finishes the study with them."""
    import storetoy

    monkeypatch.setenv("HYDRO_STORAGE_TIMEOUT", "5")
    locker = Locker(project / "toy.db", hold=8.0)
    storetoy.HOOK = locker.loss
    assert main(["tune", "tune.yaml"]) == 3
    line = _one_line(capsys, alone=False)
    assert line.startswith("hydro tune: error: the study database 'toy.db' stayed locked by "
                           "another process for 5 s: wait for that process")
    assert "--storage" in line and "HYDRO_STORAGE_TIMEOUT" in line
    assert locker.released.wait(10)
    study = optuna.load_study(study_name="toy", storage="sqlite:///toy.db")
    trials = study.get_trials(deepcopy=False)
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    stopped = [t for t in trials if t.state == TrialState.WAITING]  # taken up next run
    assert len(stopped) == 2 and not [t for t in trials if t.state == TrialState.FAIL]
    storetoy.HOOK = None
    assert main(["tune", "tune.yaml"]) == 0
    trials = optuna.load_study(study_name="toy", storage="sqlite:///toy.db").trials
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert sorted(t.params["lr"] for t in done) == sorted(t.params["lr"] for t in stopped)


def _made_study(project: Path) -> None:
    optuna.create_study(storage=f"sqlite:///{project / 'toy.db'}", study_name="toy")


def test_a_read_only_database_is_one_line(project, capsys):
    """An existing study in a database opened read-only (as SQLite sees a file it may not
    write): the first write (Optuna's create-or-load of the study) is one line, exit 3."""
    _made_study(project)
    ro = f"sqlite:///file:{project / 'toy.db'}?mode=ro&uri=true"
    assert main(["tune", "tune.yaml", "--storage", ro]) == 3
    line = _one_line(capsys)
    assert "cannot write the study database" in line and "readonly" in line
    assert "make the file and its directory writable" in line and "--storage" in line


def test_a_database_in_a_read_only_directory_is_one_line(project, capsys):
    """A writable database file in a directory that is not (SQLite cannot write its journal)."""
    _made_study(project)
    folder = project / "ro"
    folder.mkdir()
    os.replace(project / "toy.db", folder / "toy.db")
    folder.chmod(0o555)
    try:
        try:
            (folder / "probe").touch()
        except PermissionError:
            pass
        else:
            pytest.skip("chmod 0555 does not stop writes here (running as root)")
        assert main(["tune", "tune.yaml", "--storage", "sqlite:///ro/toy.db"]) == 3
        line = _one_line(capsys)
        assert "cannot write the study database 'ro/toy.db'" in line
        assert "make the file and its directory writable" in line
    finally:
        folder.chmod(0o755)


def test_a_bad_storage_timeout_is_one_line(project, capsys, monkeypatch):
    _made_study(project)
    monkeypatch.setenv("HYDRO_STORAGE_TIMEOUT", "soon")
    assert main(["export", "--storage", "sqlite:///toy.db"]) == 2
    assert "HYDRO_STORAGE_TIMEOUT must be a number of seconds above 0, got 'soon'" in \
        _one_line(capsys)


def _running(study: optuna.Study, owner: dict, beat: float) -> int:
    t = study.ask()
    t.suggest_float("lr", 1e-3, 1e-1, log=True)
    t.set_user_attr("hydro_owner", owner)
    t.set_user_attr("hydro_heartbeat", beat)
    return t.number


def test_owners_on_another_machine_with_this_hostname_are_judged_by_heartbeat(tmp_path):
    """Same hostname, another machine id: its pids mean nothing here, so its trial is alive
    while its heartbeat is fresh (even if that pid is free here) and stale once the heartbeat
    is old (even if that pid is alive here). This machine's records, and old ones without a
    machine id, are still judged by the pid table."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}", study_name="s")
    host, me, now = socket.gethostname(), study_mod.machine_id(), time.time()
    dead, alive, old = 2**22 + 7, os.getppid(), now - study_mod.STALE_SECONDS - 1
    twin = "0123-another-boot/pid:[1]"
    kept = [
        _running(study, {"host": host, "machine": twin, "pid": dead}, now),
        _running(study, {"host": host, "machine": me, "pid": alive}, old),
        _running(study, {"host": host, "pid": alive}, old),  # a record from before machine ids
    ]
    reclaimed = [
        _running(study, {"host": host, "machine": twin, "pid": alive}, old),
        _running(study, {"host": host, "machine": me, "pid": dead}, now),
        _running(study, {"host": host, "pid": dead}, now),
    ]
    assert study_mod.reclaim_stale(study) == 3
    trials = study.get_trials(deepcopy=False)
    assert [trials[n].state for n in kept] == [TrialState.RUNNING] * 3
    assert [trials[n].state for n in reclaimed] == [TrialState.WAITING] * 3
    assert study_mod._me()["machine"] == me

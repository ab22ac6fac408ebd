"""A WAITING trial of a shared study is taken once (issue 36, point 1).

Four tuners on one SQLite study lost two trials: a trial put back to WAITING (its tuner was
SIGKILLed) was taken by one tuner's ask, and before that tuner recorded itself as the owner,
another tuner's stale-owner sweep saw the dead owner's record and put it back again, so the
next ask of the same batch took it a second time (``trial_ids must be unique, got (17, 23,
23)``) and both were told FAIL. The interleavings are made here deterministically: the sweep
runs between the ask and the owner record, and two asks read the same WAITING row before either
writes it. The last test runs real processes, one SIGKILLed and restarted.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import pytest
from optuna.storages._rdb import models
from optuna.trial import TrialState

import hydro.tuning.bookkeeping as study_mod
from hydro.integrations.optuna import is_void
from hydro.tuning.storage import open_storage
from tests.waiting import patience

optuna.logging.set_verbosity(optuna.logging.WARNING)
ROOT = Path(__file__).resolve().parents[2]
DEAD = 2**22 + 7  # a pid no process has here


def _put_back_by_a_dead_tuner(study: optuna.Study) -> int:
    """Trial 0 RUNNING in a tuner on this machine that died, then put back by a sweep."""
    t = study.ask()
    t.suggest_float("lr", 1e-3, 1e-1, log=True)
    t.set_user_attr("hydro_owner", {"host": socket.gethostname(),
                                    "machine": study_mod.machine_id(), "pid": DEAD})
    t.set_user_attr("hydro_heartbeat", time.time())
    t.set_user_attr("hydro_taken", t._cached_frozen_trial.datetime_start.isoformat())
    assert study_mod.reclaim_stale(study) == 1
    assert study.trials[0].state == TrialState.WAITING
    return t._trial_id


@pytest.mark.parametrize("batch", [True, False], ids=["one batch", "one ask at a time"])
@pytest.mark.parametrize("kind", ["sqlite", "memory"])
def test_a_sweep_between_the_ask_and_the_owner_record_does_not_take_the_trial_twice(
    tmp_path, monkeypatch, caplog, kind, batch
):
    """Another process's sweep lands after this process's ask took the put-back trial, before
    its owner is recorded: the trial stays this process's, asked once; no trial fails."""
    storage = f"sqlite:///{tmp_path / 's.db'}" if kind == "sqlite" else None
    study = optuna.create_study(storage=storage, study_name="s")
    trial_id = _put_back_by_a_dead_tuner(study)
    own = study_mod.Heartbeat.own
    swept = []

    def own_after_a_sweep(self, trial):
        swept.append(study_mod.reclaim_stale(study))  # as another tuner would, right now
        own(self, trial)

    monkeypatch.setattr(study_mod.Heartbeat, "own", own_after_a_sweep)
    with study_mod.Heartbeat(study) as heart:
        if batch:  # a group callback's batch, or a fleet's ``more``
            asked = study_mod.ask(study, 3, 10, 0, heart)
        else:  # the in-process stream and the fleet ask one trial at a time
            asked = [t for _ in range(3) for t in study_mod.ask(study, 1, 10, 0, heart)]
        ids = [t._trial_id for t in asked]
        assert len(ids) == len(set(ids)) == 3, f"a trial asked twice: {ids}"
        assert ids[0] == trial_id
        assert swept == [0, 0, 0]  # the sweep left the trial being taken alone
        t = study.trials[0]
        assert t.state == TrialState.RUNNING
        assert t.user_attrs["hydro_owner"] == study_mod._me()
        assert not [u for u in study.trials if u.state == TrialState.FAIL]


def test_a_trial_this_process_holds_that_is_asked_again_is_skipped_and_logged(caplog):
    """Whatever let it happen (a storage without an atomic take, a process taken for dead), a
    trial this process already holds is not asked a second time: skipped, with a log line."""
    study = optuna.create_study()
    with study_mod.Heartbeat(study) as heart:
        first = study_mod.ask(study, 1, 10, 0, heart)[0]
        # put back from under this process, as a sweep that took it for dead would
        study._storage.set_trial_state_values(first._trial_id, TrialState.WAITING)
        study_mod._rewind_queue(study, first.number)
        with caplog.at_level("INFO", logger="hydro"):
            more = study_mod.ask(study, 2, 10, 0, heart)
    assert first.number not in [t.number for t in more] and len(more) == 2
    assert study.trials[first.number].state == TrialState.RUNNING  # still this process's
    assert any(f"trial {first.number}" in r.getMessage() and "skipped" in r.getMessage()
               for r in caplog.records)
    assert not [u for u in study.trials if u.state == TrialState.FAIL]


def test_two_asks_that_read_the_same_waiting_row_take_it_once(tmp_path, monkeypatch):
    """Optuna reads a WAITING trial, then writes it RUNNING; SQLite has no ``SELECT ... FOR
    UPDATE``, so two processes that both read it before either writes both took it. Here two
    storages on one file are made to read before either writes: one of them takes it."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(storage=url, study_name="s")
    study.enqueue_trial({"lr": 0.01})
    trial_id = study.trials[0]._trial_id
    both_read = threading.Barrier(2, timeout=3)
    find = models.TrialModel.find_or_raise_by_id

    def find_then_wait(trial_id, session, for_update=False):
        row = find(trial_id, session, for_update=for_update)
        if for_update:  # the read Optuna writes from: let the other process read too
            try:
                both_read.wait()
            except threading.BrokenBarrierError:
                pass
        return row

    monkeypatch.setattr(models.TrialModel, "find_or_raise_by_id", find_then_wait)
    took: list[bool] = []
    storages = [open_storage(url), open_storage(url)]

    def take(storage) -> None:
        took.append(storage.set_trial_state_values(trial_id, TrialState.RUNNING))

    threads = [threading.Thread(target=take, args=(s,)) for s in storages]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert sorted(took) == [False, True], f"taken {took.count(True)} times"


def test_a_sweep_that_read_the_trial_before_it_was_put_back_and_taken_leaves_it(tmp_path):
    """Two sweeps both see a dead owner's trial: one puts it back, a live process takes it,
    then the slower sweep (that read it before all that) writes: the live take stands."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}", study_name="s")
    t = study.ask()
    t.set_user_attr("hydro_owner", {"host": socket.gethostname(),
                                    "machine": study_mod.machine_id(), "pid": DEAD})
    t.set_user_attr("hydro_heartbeat", time.time())
    slow = study._storage.get_trial(t._trial_id)  # the slow sweep's read
    assert study_mod.reclaim_stale(study) == 1  # the fast sweep
    with study_mod.Heartbeat(study) as heart:
        again = study_mod.ask(study, 1, 10, 0, heart)[0]
        assert again.number == t.number
        assert not study_mod._to_waiting(study, slow)
        assert study.trials[0].state == TrialState.RUNNING
        assert study.trials[0].user_attrs["hydro_owner"] == study_mod._me()


# --- real processes ---------------------------------------------------------------------------

N_TRIALS = 8


def _tuner(storage: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tests.tuner_child", storage, str(N_TRIALS), "--fuse", "2",
            "--steps", "8", "--executor", "local", *extra]


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_four_tuners_share_a_study_one_killed_and_restarted(tmp_path, request, kind):
    """Four real tuners (local executor) on one study (an SQLite file, or a real PostgreSQL
    server started by the test), started a moment apart; one is SIGKILLed mid-group and
    started again. Every trial is trained and told once: none lost, none duplicated, none
    FAIL, none left RUNNING."""
    if kind == "sqlite":
        storage = f"sqlite:///{tmp_path / 'hydro.db'}"
    else:
        storage = request.getfixturevalue("postgres").createdb(f"race_{tmp_path.name[-20:]}")
    optuna.create_study(storage=storage, study_name="hydro")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    marker = tmp_path / "blocked"
    victim = subprocess.Popen(_tuner(storage, "--block-at", "3", "--marker", str(marker)),
                              cwd=ROOT, env=env)
    others = [subprocess.Popen(_tuner(storage), cwd=ROOT, env=env) for _ in range(3)]
    start = time.monotonic()
    try:
        while not marker.exists():  # it trains (its worker blocks at a known step): kill it
            assert victim.poll() is None, f"the tuner to kill ended ({victim.returncode})"
            assert time.monotonic() - start < patience(240), (
                "the tuner to kill never reached its step"
            )
            time.sleep(0.05)
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    _kill_blocked_worker(marker)
    again = subprocess.Popen(_tuner(storage), cwd=ROOT, env=env)
    codes = [p.wait(timeout=patience(300)) for p in [*others, again]]
    assert codes == [0, 0, 0, 0]
    trials = optuna.load_study(study_name="hydro", storage=storage).get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    configs = [tuple(sorted(t.params.items())) for t in complete]
    failed = [(t.number, t.user_attrs.get("fail_reason")) for t in trials
              if t.state == TrialState.FAIL and not is_void(t)]
    assert failed == []
    assert [t.number for t in trials if not t.state.is_finished()] == []  # RUNNING or WAITING
    assert len(configs) == len(set(configs)), "a configuration trained twice"
    assert len(complete) == N_TRIALS  # none lost
    assert any(t.user_attrs.get("hydro_interrupted") for t in complete)  # the kill put some back


def _kill_blocked_worker(marker: Path) -> None:
    """The killed tuner's worker (the process that blocked) may outlive it: end it too."""
    try:
        os.kill(int(marker.read_text()), signal.SIGKILL)
    except (ProcessLookupError, ValueError):
        pass

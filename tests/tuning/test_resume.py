"""Resumed and shared studies: no repeated configurations, and only dead owners' trials are
taken over."""

from __future__ import annotations

import os
import socket
import time

import optuna
from optuna.trial import TrialState

import hydro
import hydro.tuning.engine as driver
from tests.tuner_child import SPACE, make_task

optuna.logging.set_verbosity(optuna.logging.WARNING)


def configs(storage: str) -> list[tuple]:
    study = optuna.load_study(study_name="hydro", storage=storage)
    return [tuple(sorted(t.params.items())) for t in study.trials]


def test_resumed_runs_propose_new_configurations_reproducibly(tmp_path):
    """Three runs to 4, 8 and 12 trials, each building a fresh seeded sampler, as rerunning a
    command does: 12 distinct configurations, and the same 12 again for the same commands."""
    runs = []
    for name in ("a", "b"):
        storage = f"sqlite:///{tmp_path / name}.db"
        for n in (4, 8, 12):
            hydro.tune(make_task(2), SPACE, n_trials=n, ratio=2, fuse=4, storage=storage, seed=0)
        runs.append(configs(storage))
    assert len(runs[0]) == 12 and len(set(runs[0])) == 12
    assert runs[0] == runs[1]


def _running_trial(study: optuna.Study, **attrs) -> int:
    t = study.ask()
    t.suggest_float("lr", 1e-3, 1e-1, log=True)
    t.suggest_float("weight_decay", 0.0, 0.1)
    for k, v in attrs.items():
        t.set_user_attr(k, v)
    return t.number


def test_only_dead_owners_trials_are_reclaimed(tmp_path):
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    study = optuna.create_study(storage=storage, study_name="hydro")
    host = socket.gethostname()
    now = time.time()
    live_here = _running_trial(study, hydro_owner={"host": host, "pid": os.getppid()})
    dead_here = _running_trial(study, hydro_owner={"host": host, "pid": 2**22 + 7})
    live_there = _running_trial(study, hydro_owner={"host": "elsewhere", "pid": 1},
                                hydro_heartbeat=now)
    dead_there = _running_trial(study, hydro_owner={"host": "elsewhere", "pid": 1},
                                hydro_heartbeat=now - driver.STALE_SECONDS - 1)
    assert driver.reclaim_stale(study) == 2
    assert driver.reclaim_stale(study) == 0  # put back once
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == 4  # no new row: the same trials wait to be taken up again
    for number in (live_here, live_there):
        assert trials[number].state == TrialState.RUNNING
    for number in (dead_here, dead_there):
        assert trials[number].state == TrialState.WAITING
        assert trials[number].user_attrs["hydro_interrupted"] == 1
    # the next ask takes up a put-back trial, with its parameters
    t = study.ask()
    assert t.number in (dead_here, dead_there)
    assert t.suggest_float("lr", 1e-3, 1e-1, log=True) == trials[t.number].params["lr"]


def test_a_running_trial_of_another_process_counts_towards_n_trials(tmp_path):
    """n_trials is for the whole study: a live process's RUNNING trial is not asked again, and
    the run waits for it instead of training a surplus trial."""
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    study = optuna.create_study(storage=storage, study_name="hydro")
    other = _running_trial(study, hydro_owner={"host": "elsewhere", "pid": 1},
                           hydro_heartbeat=time.time())
    import threading

    def finish_later() -> None:
        time.sleep(3)
        optuna.load_study(study_name="hydro", storage=storage).tell(other, 1.0)

    threading.Thread(target=finish_later).start()
    hydro.tune(make_task(2), SPACE, n_trials=3, ratio=2, fuse=4, storage=storage, seed=0)
    trials = optuna.load_study(study_name="hydro", storage=storage).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert trials[other].value == 1.0

"""Half-written trial checkpoints (``.trial-N.pt.PID.tmp``) do not outlive their run (issue 36,
point 7): a save that fails (a full disk) removes its own, and the next run removes those of a
writer killed mid-write, as it removes other leftovers."""

from __future__ import annotations

import errno
import os
import socket
import time

import optuna
import pytest
import torch
from optuna.trial import TrialState

from hydro.integrations.optuna import optimize
from hydro.tuning import checkpoint
from hydro.tuning.group import FusedGroup
from tests.tuner_child import SPACE
from tests.tuner_child import make_task as child_task

pytestmark = pytest.mark.usefixtures("one_thread")
optuna.logging.set_verbosity(optuna.logging.WARNING)
DEAD = 2**22 + 11  # a pid no process has here


def _left(directory, name: str, age: float) -> os.PathLike:
    """A half-written checkpoint as a killed writer leaves it, last written ``age`` s ago."""
    path = directory / name
    path.write_bytes(b"PK\x03\x04 half a checkpoint")
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def test_the_next_run_removes_what_a_writer_killed_mid_write_left(tmp_path):
    storage = f"sqlite:///{tmp_path / 'hydro.db'}"
    study = optuna.create_study(storage=storage, study_name="hydro")
    t = study.ask(SPACE)  # RUNNING in a tuner that died
    t.set_user_attr("hydro_owner", {"host": socket.gethostname(), "pid": DEAD})
    store = checkpoint.for_study(study, tmp_path / "ck")
    checkpoint.private_dir(store.directory)
    killed = _left(store.directory, f".trial-0.pt.{DEAD}.tmp", age=120)
    # a live process here writing now, and a write in progress from another machine that
    # shares the directory (its pid means nothing here; written a moment ago): both kept
    live = _left(store.directory, f".trial-1.pt.{os.getppid()}.tmp", age=120)
    elsewhere = _left(store.directory, f".trial-2.pt.{DEAD + 1}.tmp", age=1)
    optimize(study, child_task(4), SPACE, n_trials=2, ratio=2, fuse=2, checkpoint_every=2,
             checkpoint_dir=tmp_path / "ck")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    assert not killed.exists()
    assert live.exists() and elsewhere.exists()


def test_a_save_that_fails_mid_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A full disk: the save raises, as before, and its temporary file is gone."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'hydro.db'}", study_name="s")
    store = checkpoint.for_study(study, tmp_path / "ck")
    group = FusedGroup(child_task(4), [(0, {"lr": 0.01, "weight_decay": 0.0}, 0)], ratio=2)
    group.step()
    real = torch.save

    def disk_full(obj, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"PK\x03\x04 the first blocks")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        store.save(group.trial_state(0))
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(tmp_path / "group", {"step": 1})
    assert [p.name for p in store.directory.iterdir()] == []
    assert [p.name for p in (tmp_path / "group").iterdir()] == []
    monkeypatch.setattr(torch, "save", real)
    store.save(group.trial_state(0))
    assert [p.name for p in store.directory.iterdir()] == ["trial-0.pt"]

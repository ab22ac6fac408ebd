"""Checkpoints: of a fused group (a retried or moved group resumes bit-identically) and of each
trial of a study (a trial re-asked after its tuner died resumes where it stopped).

A study's trial checkpoints live in a directory of their own, named by the study's identity (a
uuid kept in the study's user attrs, :data:`STUDY_UID`), one file per trial
(``trial-<number>.pt``) that names the study, the trial's seed and parameters: a file that does
not match the trial asking for it, or cannot be read, is moved aside with a warning and the
trial starts afresh. The default root is beside the study's SQLite file
(``hydro.db.checkpoints/``), so it outlives the tuner.

A checkpoint holds only tensors and plain containers of numbers and strings, and is read back
with ``torch.load(weights_only=True)``: a file planted in the checkpoint directory cannot run
code, it is refused with :class:`CheckpointError`. Files are written atomically (a temporary
file, then ``os.replace``) in a directory created only the user can enter (mode ``0o700``).
A save that fails removes its temporary file; one a killed writer left (``.trial-N.pt.PID.tmp``)
is removed by the next run (:meth:`TrialCheckpoints.sweep_partial`).
"""

from __future__ import annotations

import os
import pickle
import random
import re
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hydro.errors import HydroError, HydroWarning
from hydro_fluid.executors.scratch import check_private as _check_private
from hydro_fluid.executors.scratch import private_dir as _private_dir
from hydro_fluid.executors.worker import _alive

__all__ = ["CheckpointError", "TrialCheckpoints", "default_root", "for_study", "load", "save",
           "rng_state", "set_rng_state", "study_id"]

FILE = "group.pt"
STUDY_UID = "hydro_study_uid"  # the study's user attr naming its checkpoint directory
PARTIAL_SECONDS = 60.0  # a temporary file not written for this long is no save in progress
_PARTIAL = re.compile(r"\.trial-\d+\.pt\.(\d+)\.tmp")


class CheckpointError(HydroError, RuntimeError):
    """A checkpoint could not be read: unreadable, or not a checkpoint Hydro wrote."""


def private_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (and parents) if needed, readable and writable by the user only.

    Raises:
        CheckpointError: ``path`` exists but belongs to another user or others can write to
            it (one line naming it and what to do), or it cannot be created.
    """
    try:
        return _private_dir(path)
    except PermissionError as exc:
        raise CheckpointError(str(exc)) from exc


def check_private(path: str | os.PathLike) -> None:
    """A :class:`CheckpointError` if the directory ``path`` exists and belongs to another user
    or others can write to it: whoever can write there decides what a resumed trial loads."""
    if os.path.isdir(path):
        try:
            _check_private(path)
        except PermissionError as exc:
            raise CheckpointError(str(exc)) from exc


def save(directory: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``directory/group.pt`` atomically; returns the file."""
    d = private_dir(directory)
    tmp = d / f".{FILE}.{os.getpid()}.tmp"
    _save_whole(state, tmp, d / FILE)
    return d / FILE


def _save_whole(state: dict[str, Any], tmp: Path, target: Path) -> None:
    """``torch.save`` to ``tmp``, then rename it to ``target``; a failed save (a full disk,
    Ctrl-C) removes ``tmp``."""
    try:
        torch.save(state, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, target)


def load(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The state last saved in ``directory``, or ``None`` if there is none.

    Raises:
        CheckpointError: the file holds anything but tensors and plain containers (a planted
            pickle is refused before it can run), or cannot be read.
    """
    path = Path(directory) / FILE
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as exc:
        raise CheckpointError(
            f"refusing to load checkpoint {path}: it is not a checkpoint Hydro wrote (only "
            f"tensors and plain containers are accepted): {str(exc).splitlines()[0]}. Delete "
            "the file to start the group afresh, and check who can write to its directory."
        ) from exc


def why(exc: BaseException) -> str:
    """``exc`` in one short line, for a warning about a checkpoint."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:200]


def set_aside(path: str | os.PathLike, why: str) -> Path:
    """Move an unusable checkpoint out of the way (renamed, never deleted, for inspection)
    with a warning naming it; returns the new name."""
    path = Path(path)
    aside = path.with_name(f"{path.name}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
    os.replace(path, aside)
    warnings.warn(HydroWarning(f"checkpoint {path} {why}; moved aside to {aside.name}, "
                               "starting afresh"), stacklevel=2)
    return aside


def default_root(study: Any) -> Path | None:
    """Where a study's checkpoints go by default: beside its SQLite file
    (``hydro.db`` -> ``hydro.db.checkpoints``); ``None`` for a storage without a file (in
    memory, a database server: give ``checkpoint_dir`` for those to outlive the tuner)."""
    from sqlalchemy.engine import make_url

    backend = getattr(study._storage, "_backend", study._storage)
    url = getattr(backend, "url", None)
    if not isinstance(url, str) or not url.startswith("sqlite:"):
        return None
    db = make_url(url).database
    if not db or db == ":memory:" or db.startswith("file::memory:"):
        return None
    db = Path(db).resolve()
    return db.with_name(db.name + ".checkpoints")


@dataclass(frozen=True)
class TrialCheckpoints:
    """The trial checkpoints of one study: ``directory/trial-<number>.pt`` each (picklable,
    so a worker process writes its group's trials there itself).

    Attributes:
        directory: this study's own directory (see :func:`for_study`).
        study: the study's identity (:data:`STUDY_UID`); every file names it.
    """

    directory: Path
    study: str

    def path(self, number: int) -> Path:
        return self.directory / f"trial-{int(number)}.pt"

    def save(self, state: dict[str, Any]) -> None:
        """Write a trial's state (:meth:`FusedGroup.trial_state`) atomically."""
        target = self.path(state["id"])
        tmp = self.directory / f".{target.name}.{os.getpid()}.tmp"
        state = {**state, "study": self.study}
        try:
            private_dir(self.directory)
            _save_whole(state, tmp, target)
        except FileNotFoundError:  # another tuner of the study removed the empty directory
            private_dir(self.directory)
            _save_whole(state, tmp, target)

    def sweep_partial(self) -> int:
        """Remove the temporary files of saves that never finished (a writer killed
        mid-write): those not written for :data:`PARTIAL_SECONDS` whose writer is no live
        process here. A fresh one may be a save in progress on another machine sharing the
        directory, whose pid means nothing here. Returns how many."""
        removed, now = 0, time.time()
        for path in self.directory.glob(".trial-*.tmp"):
            match = _PARTIAL.fullmatch(path.name)
            try:
                idle = now - path.stat().st_mtime
            except FileNotFoundError:  # renamed meanwhile: its save finished
                continue
            if match is None or idle < PARTIAL_SECONDS or _alive(int(match.group(1)), None):
                continue
            path.unlink(missing_ok=True)
            removed += 1
        return removed

    def tidy(self) -> None:
        """Remove this study's directory once it holds nothing (files set aside stay)."""
        try:
            self.directory.rmdir()
        except OSError:
            pass

    def load(self, number: int, seed: int, params: dict[str, Any]) -> dict[str, Any] | None:
        """Trial ``number``'s checkpoint, or ``None``. A file that cannot be read, or that was
        not written for this study and a trial of this seed and these parameters, is moved
        aside with a warning (:func:`set_aside`) and ``None`` returned."""
        path = self.path(number)
        if not path.exists():
            return None
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # truncated, planted pickle, not torch at all
            set_aside(path, f"is unreadable ({why(exc)})")
            return None
        mine = {"study": self.study, "seed": int(seed), "params": dict(params)}
        if not isinstance(state, dict) or any(state.get(k) != v for k, v in mine.items()):
            set_aside(path, f"belongs to another study or trial, not trial {number} of study "
                      f"{self.study}")
            return None
        return state

    def claim(self, old: int, new: int) -> bool:
        """Hand trial ``old``'s checkpoint to trial ``new`` (its re-ask); True if there was one."""
        try:
            os.replace(self.path(old), self.path(new))
        except FileNotFoundError:
            return False
        return True

    def remove(self, number: int) -> None:
        self.path(number).unlink(missing_ok=True)

    def numbers(self) -> list[int]:
        """The trials that have a checkpoint here."""
        found = (re.fullmatch(r"trial-(\d+)\.pt", p.name) for p in self.directory.glob("trial-*"))
        return sorted(int(m.group(1)) for m in found if m)


def for_study(study: Any, root: str | os.PathLike) -> TrialCheckpoints:
    """``study``'s trial checkpoints under ``root``: a directory named by the study's name and
    identity (a uuid created on its first run, kept in its user attrs), so that two studies
    given one root, or a study deleted and created again under the same name, never read each
    other's files."""
    uid = study_id(study)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", study.study_name)[:64]
    checkpoints = TrialCheckpoints(Path(root).resolve() / f"{name}-{uid}", uid)
    check_private(checkpoints.directory.parent)  # before any trial runs, not at its first save
    check_private(checkpoints.directory)
    return checkpoints


def study_id(study: Any) -> str:
    """The study's identity for its checkpoints: a uuid created on its first run and kept in
    its user attrs (:data:`STUDY_UID`); a name can be reused, this cannot."""
    uid = study.user_attrs.get(STUDY_UID)
    if not isinstance(uid, str):
        uid = uuid.uuid4().hex
        study.set_user_attr(STUDY_UID, uid)
    return uid


def rng_state() -> dict[str, Any]:
    """The random states a training step draws from: torch (CPU and CUDA), Python, numpy."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "python": [version, list(internal), gauss]}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

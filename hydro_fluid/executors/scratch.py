"""Private directories, and the scratch a killed run leaves behind.

Checkpoint directories are created ``0o700`` from the start (parents included), and one that
already exists must belong to this user and be writable by nobody else: a checkpoint is loaded
into the next attempt, so whoever can write there chooses what it trains from.

A run also leaves multiprocessing's temporary directory (``$TMPDIR/pymp-*``, which holds the
fork server's socket): removed at a normal exit, Ctrl-C or SIGTERM, but not after SIGKILL.
:func:`claim_mp_tempdir` marks this process's one with its pid and start time and removes the
marked ones of processes no longer alive; a directory without the mark (another program's) or
of a live process is never touched.
"""

from __future__ import annotations

import multiprocessing.util as mp_util
import os
import shutil
import stat
from pathlib import Path

__all__ = [
    "check_private",
    "claim_mp_tempdir",
    "private_dir",
    "start_ticks",
    "sweep_mp_tempdirs",
]

OWNER = "hydro-owner"  # the mark in a pymp-* directory: "<pid> <start ticks>"


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, Linux), to tell a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, ticks: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return ticks is None or start_ticks(pid) in (None, ticks)


def check_private(
    path: str | os.PathLike,
    what: str = "checkpoint directory",
    *,
    holds: str = "checkpoints",
    other: str = "another checkpoint_dir",
) -> None:
    """Raise ``PermissionError`` (one line: the directory, what is wrong, what to do) unless
    the existing directory ``path`` belongs to this user and only this user can write to it.
    ``holds``: what others could plant there; ``other``: what to choose instead."""
    st = os.stat(path)
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise PermissionError(
            f"{what} {os.fspath(path)} belongs to another user (uid {st.st_uid}), who could "
            f"plant or replace {holds} there: choose {other} of your own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"{what} {os.fspath(path)} is writable by others (mode "
            f"{stat.S_IMODE(st.st_mode):o}), who could plant or replace {holds} there: run "
            f"`chmod 700 {os.fspath(path)}`, or choose {other}"
        )


def private_dir(path: str | os.PathLike, what: str = "checkpoint directory") -> Path:
    """``path`` as a directory only this user can enter: the missing part created ``0o700``
    (never wider for a moment, whatever the umask), an existing one checked
    (:func:`check_private`) and narrowed to ``0o700``."""
    path = Path(path)
    missing = []
    for p in (path, *path.parents):
        if p.exists():
            break
        missing.append(p)
    for p in reversed(missing):
        try:
            p.mkdir(mode=0o700)
        except FileExistsError:  # another process of the run made it meanwhile: checked below
            pass
    check_private(path, what)
    os.chmod(path, 0o700)  # readable by others before: narrowed (the umask may narrow, too)
    return path


def claim_mp_tempdir() -> Path:
    """Mark multiprocessing's temporary directory of this process as its own and remove those
    a killed run left beside it (:func:`sweep_mp_tempdirs`); returns this process's."""
    mine = Path(mp_util.get_temp_dir())
    mark = mine / OWNER
    if not mark.exists():
        ticks = start_ticks(os.getpid())
        mark.write_text(f"{os.getpid()} {'x' if ticks is None else ticks}\n")
    sweep_mp_tempdirs(mine.parent)
    return mine


def sweep_mp_tempdirs(folder: str | os.PathLike) -> None:
    """Remove the ``pymp-*`` directories in ``folder`` that :func:`claim_mp_tempdir` marked
    for a process no longer alive (its pid gone, or reused by a process started later) and
    that belong to this user; any other is left alone."""
    for old in Path(folder).glob("pymp-*"):
        try:
            st = old.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            pid, ticks = (old / OWNER).read_text().split()
            dead = not _alive(int(pid), None if ticks == "x" else int(ticks))
        except (OSError, ValueError):  # unmarked (not ours), or its mark half written
            continue
        if dead:
            shutil.rmtree(old, ignore_errors=True)

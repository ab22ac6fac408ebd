"""Files written for the user (exports, reports, plots) replace the old one whole or not at all.

Opening a file with ``"w"`` truncates it first: a kill or an error between the truncation and the
last write leaves an existing ``best.yaml`` empty or half written. Hydro writes a temporary file
beside the target instead and renames it over the target (``os.replace``, atomic on POSIX within
a directory), keeping the old file's permission bits.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

from hydro.errors import ConfigError


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path beside ``path``; on a clean exit it replaces ``path``.

    The temporary name ends with ``path``'s suffix, so writers that pick a format by extension
    (matplotlib's ``savefig``) still do. On an exception (``KeyboardInterrupt`` included) the
    temporary file is removed and ``path`` is left as it was. A symbolic link is followed: the
    file it points to is replaced, as writing through it would have.
    """
    target = os.path.realpath(os.fspath(path))
    folder, name = os.path.split(target)
    suffix = os.path.splitext(name)[1]
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=f".tmp{suffix}", dir=folder)
    except OSError as exc:
        raise ConfigError(
            f"cannot write {os.fspath(path)!r}: cannot create a file in {folder!r} "
            f"({exc.strerror or exc}). Name a path you can write."
        ) from exc
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb") as f:  # on disk before the rename, so a crash cannot swap in less
            os.fsync(f.fileno())
        os.chmod(tmp, _mode(target))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through :func:`replacing`."""
    with replacing(path) as tmp, open(tmp, "w") as f:
        f.write(text)


def _mode(path: str) -> int:
    """The old file's permission bits, else what ``open(path, "w")`` would have created
    (``mkstemp`` makes its file 0600, private to its owner)."""
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask

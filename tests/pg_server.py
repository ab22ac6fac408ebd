"""A throwaway PostgreSQL server on 127.0.0.1 for the database tests (issue 36, point 6).

The server binaries come from the system (Debian's ``postgresql`` package, which ``.ci/run``
installs where it is missing): ``initdb`` and ``pg_ctl`` on ``PATH`` or under
``/usr/lib/postgresql/*/bin``. PostgreSQL refuses to run as root, so as root the server runs as
the ``postgres`` OS user, on a data directory that user owns. It listens on 127.0.0.1 only, on a
free port, with its Unix socket in its own directory (never the system's), and trusts every
local connection: ``postgresql://postgres@127.0.0.1:PORT/DB`` needs no password.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

USER = "postgres"  # the database superuser initdb creates, and the OS user it runs as under root


def bindir() -> Path | None:
    """The directory of ``initdb`` and ``pg_ctl``, newest version first; None if absent."""
    found = shutil.which("initdb")  # a symlink on PATH: the real directory also holds createdb
    if found and (Path(found).resolve().parent / "pg_ctl").exists():
        return Path(found).resolve().parent

    def version(d: str) -> int:
        name = Path(d).parent.name
        return int(name) if name.isdigit() else 0

    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True):
        if (Path(d) / "initdb").exists() and (Path(d) / "pg_ctl").exists():
            return Path(d)
    return None


def missing() -> str | None:
    """Why no server can be started here, or None."""
    if bindir() is None:
        return ("the PostgreSQL server binaries (initdb, pg_ctl) are not installed: "
                "apt-get install postgresql (.ci/run does)")
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(USER)
        except KeyError:
            return f"running as root and there is no {USER!r} OS user to run the server as"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A PostgreSQL server of its own: :meth:`start`, :meth:`url`, :meth:`createdb`,
    :meth:`stop`."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.bin = bindir()
        assert self.bin is not None, missing()
        self.timeout = timeout
        # as root: the postgres OS user runs the server, so its directory must be reachable by
        # it (pytest's own temporary directories are root's, mode 0700)
        root = os.geteuid() == 0
        self.dir = Path(tempfile.mkdtemp(prefix="hydro-pg-", dir="/tmp" if root else None))
        self.as_user: list[str] = []
        if root:
            entry = pwd.getpwnam(USER)
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
            self.as_user = ["runuser", "-u", USER, "--"]
        self.data = self.dir / "data"
        self.port = 0

    def _run(self, *cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run([*self.as_user, *cmd], capture_output=True, text=True,
                              timeout=self.timeout + 30, cwd=self.dir)

    def start(self) -> Server:
        """initdb, then start on a free port (another one if that port was taken meanwhile)."""
        done = self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", USER, "-A", "trust",
                         "-E", "UTF8", "--locale=C", "--no-sync")
        if done.returncode:
            raise RuntimeError(f"initdb failed: {done.stderr or done.stdout}")
        for _ in range(5):
            self.port = _free_port()
            # durability off: the data are a test's, and fsync on a busy disk costs seconds
            opts = (f"-h 127.0.0.1 -p {self.port} -k {self.dir} -c fsync=off "
                    "-c synchronous_commit=off -c full_page_writes=off")
            done = self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l",
                             str(self.dir / "server.log"), "-w", "-t", str(int(self.timeout)),
                             "-o", opts, "start")
            if done.returncode == 0:
                return self
        log = (self.dir / "server.log").read_text()[-2000:] if (self.dir / "server.log").exists() \
            else ""
        raise RuntimeError(f"PostgreSQL did not start: {done.stderr or done.stdout}\n{log}")

    def url(self, db: str) -> str:
        """The documented URL form (``postgresql://user@host/db``) of database ``db``."""
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{db}"

    def createdb(self, db: str) -> str:
        """Create database ``db`` with the client tool a user runs; returns its URL."""
        done = subprocess.run([str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port),
                               "-U", USER, db], capture_output=True, text=True,
                              timeout=self.timeout)
        if done.returncode:
            raise RuntimeError(f"createdb {db} failed: {done.stderr}")
        return self.url(db)

    def stop(self) -> None:
        """Stop at once (no checkpoint: the data are thrown away) and remove the directory."""
        if self.port:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "stop", "-m", "immediate")
        shutil.rmtree(self.dir, ignore_errors=True)

"""The study's storage: Optuna's own RDBStorage, made patient with a busy database and plain
about one that fails.

Several processes share a study through one SQLite file, and anything else that opens it (a
dashboard, a backup, ``sqlite3``) can hold it locked for a while. SQLite waits for such a lock
itself (its busy timeout), but not in every case: a transaction that read first and then wants
to write gets "database is locked" at once when another writer is waiting, to avoid a deadlock.
So every storage call (ask, tell, attributes, heartbeats, reads) is retried as a whole, with
backoff, until ``HYDRO_STORAGE_TIMEOUT`` seconds have passed; what still fails is one
:class:`~hydro.errors.StorageError` line naming the database and what to do. A failed SQLite
transaction is rolled back, so retrying it whole never writes twice.
"""

from __future__ import annotations

import functools
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import optuna
from optuna.storages import RDBStorage
from optuna.storages._rdb import models
from optuna.storages._rdb.storage import _create_scoped_session
from optuna.trial import TrialState
from sqlalchemy import exc as sa_exc

from hydro.errors import ConfigError, StorageError

__all__ = ["DEFAULT_TIMEOUT", "ENV_TIMEOUT", "GuardedStorage", "cannot_open", "check_driver",
           "open_storage", "put_back_if_same", "redact", "storage_timeout"]

ENV_TIMEOUT = "HYDRO_STORAGE_TIMEOUT"
DEFAULT_TIMEOUT = 60.0
EXIT_CODE = 3  # the CLI's exit status for a storage that fails in use (2 is bad input)

_T = TypeVar("_T")
_local = threading.local()  # nesting depth of guarded calls: only the outermost one retries


def storage_timeout() -> float:
    """Seconds a storage call waits for a locked database: ``$HYDRO_STORAGE_TIMEOUT``, else 60."""
    text = os.environ.get(ENV_TIMEOUT, "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{ENV_TIMEOUT} must be a number of seconds above 0, got {text!r}: "
                          f"unset it for the default ({DEFAULT_TIMEOUT:g} s)")
    return value


def _database_error(exc: BaseException) -> BaseException | None:
    """The database's own error behind ``exc`` (Optuna wraps SQLAlchemy's), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (sa_exc.OperationalError, sqlite3.OperationalError)):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _kind(exc: BaseException) -> str | None:
    """What went wrong with the database: "locked", "readonly", "open", "disk", "other", or
    None for an error that is not the database's (a finished trial, a missing study...)."""
    err = _database_error(exc)
    if err is None:
        return None
    text = str(getattr(err, "orig", None) or err).lower()
    if "locked" in text or "busy" in text:
        return "locked"
    if "readonly" in text or "read-only" in text:
        return "readonly"
    if "unable to open" in text:
        return "open"
    if "disk" in text:  # "disk I/O error", "database or disk is full"
        return "disk"
    return "other"


def redact(url: str) -> str:
    """``url`` as a message may show it: a password in it replaced by ``***``."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception:  # a malformed URL is shown as given
        return url
    return parsed.render_as_string(hide_password=True) if parsed.password else url


def cannot_open(url: Any, exc: BaseException) -> StorageError:
    """One :class:`~hydro.errors.StorageError` line for a storage that does not open (a
    malformed URL, a missing directory, a server that does not answer): the URL (password
    hidden), what failed, without SQLAlchemy's SQL and links, and what to check."""
    shown = redact(url) if isinstance(url, str) else url
    lines = [line.strip() for line in str(exc).splitlines()]
    detail = " ".join(line for line in lines if line and not line.startswith(
        ("[SQL:", "[parameters:", "(Background on this error")))
    if not detail.startswith("("):  # SQLAlchemy's own text names the driver's error type
        detail = f"{type(exc).__name__}: {detail}"
    return StorageError(f"cannot open Optuna storage {shown!r}: {detail}. Check the URL "
                        "(e.g. sqlite:///path/to/hydro.db, postgresql://user@host/db) and that "
                        "its directory or server is reachable.")


def _where(url: str) -> str:
    """The database as a user named it: an SQLite file's path, else the URL sans password."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception:  # a malformed URL is shown as given
        return repr(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database:
        return repr(parsed.database)
    return repr(redact(url))


def _message(kind: str, url: str, exc: BaseException, timeout: float) -> str:
    where = _where(url)
    err = _database_error(exc)
    detail = str(getattr(err, "orig", None) or err).splitlines()[0]
    left = "trials it could not record are asked again by the next run"
    if kind == "locked":
        return (
            f"the study database {where} stayed locked by another process for {timeout:g} s: "
            "wait for that process to finish (or stop it) and run the same command again, or "
            f"use another database with --storage ({ENV_TIMEOUT} sets the wait); {left}"
        )
    if kind in ("readonly", "open"):
        return (f"cannot write the study database {where} ({detail}): make the file and its "
                "directory writable (SQLite writes a journal beside the file), or choose another "
                f"path with --storage; {left}")
    if kind == "disk":
        return (f"the study database {where} failed ({detail}): free space on its disk, or "
                f"choose another path with --storage; {left}")
    return (f"the study storage {where} failed ({detail}): check that it is reachable and run "
            f"the same command again (finished trials are kept); {left}")


def _storage_error(kind: str, url: str, exc: BaseException, timeout: float) -> StorageError:
    err = StorageError(_message(kind, url, exc, timeout))
    err.exit_code = EXIT_CODE  # type: ignore[attr-defined]  # read by hydro.cli.main
    return err


class GuardedStorage(RDBStorage):
    """Optuna's :class:`~optuna.storages.RDBStorage` whose every call retries a locked
    database with backoff for up to ``timeout`` seconds (SQLite's own busy timeout is a
    quarter of it), then raises a one-line :class:`~hydro.errors.StorageError`; so does any
    other failure of the database (read-only, unreachable, disk). Errors that are not the
    database's (a finished trial, a duplicated study name) pass through unchanged.

    After a failure a thread's calls (the driver failing its unfinished trials as interrupted,
    so that none stays RUNNING) share one more ``timeout``, then answer at once with the same
    error for three more, so a run whose database stays locked stops in about twice the
    timeout; a call that succeeds ends that state. It is kept per thread: the heartbeat thread
    failing must not cut short the driver's own wait.
    """

    def __init__(self, url: str, timeout: float | None = None) -> None:
        self.timeout = storage_timeout() if timeout is None else float(timeout)
        self._failures: dict[int, tuple[float, str, BaseException]] = {}  # thread -> last
        kwargs: dict[str, Any] = {}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"timeout": max(self.timeout / 4, 0.01)}
        self.url = url
        # opening: a malformed URL or a missing directory stays the caller's to explain
        self._retry(lambda: self._create(kwargs), only_lock=True)

    def _create(self, engine_kwargs: dict[str, Any]) -> None:
        """Optuna's opening, which creates the tables of a new database. Two processes doing
        that at once on a database server (tuners started together on a fresh PostgreSQL
        database) clash: one gets "duplicate key" or "already exists" once the other commits
        its tables. Those are there now: open again, and find them."""
        for attempt in range(5):
            try:
                RDBStorage.__init__(self, self.url, engine_kwargs=engine_kwargs)
                return
            except (sa_exc.IntegrityError, sa_exc.ProgrammingError) as exc:
                text = str(exc).lower()
                if attempt == 4 or not ("already exists" in text or "duplicate" in text):
                    raise
                if getattr(self, "engine", None) is not None:
                    self.engine.dispose()
                time.sleep(0.05 * (attempt + 1) * (0.5 + random.random()))

    def _retry(self, call: Callable[[], _T], only_lock: bool = False) -> _T:
        thread = threading.get_ident()
        start = time.monotonic()
        deadline = start + self.timeout
        failed = self._failures.get(thread)
        if failed is not None:
            since = start - failed[0]
            if since < self.timeout:  # this thread cleaning up: one more window in all
                deadline = failed[0] + self.timeout
            elif since < 4 * self.timeout:  # then at once, so the run stops in bounded time
                raise _storage_error(failed[1], self.url, failed[2], self.timeout) from None
        delay = 0.02
        while True:
            try:
                out = call()
            except Exception as exc:
                kind = _kind(exc)
                if kind is None or (only_lock and kind != "locked"):
                    raise
                now = time.monotonic()
                if kind == "locked" and now + delay < deadline:
                    time.sleep(delay * (0.5 + random.random()))  # jitter: racing processes part
                    delay = min(delay * 2, 1.0)
                    continue
                # a failure while an earlier one is still being handled does not start anew
                first = failed[0] if failed and start - failed[0] < 4 * self.timeout else now
                self._failures[thread] = (first, kind, exc)
                raise _storage_error(kind, self.url, exc, self.timeout) from exc
            if failed is not None:
                self._failures.pop(thread, None)
            return out

    def __getstate__(self) -> dict[Any, Any]:
        state = super().__getstate__()
        state["_failures"] = {}  # a failure is this process's
        return state


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: GuardedStorage, *args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "depth", 0):  # inside another guarded call: that one retries
            return method(self, *args, **kwargs)
        _local.depth = 1
        try:
            return self._retry(lambda: method(self, *args, **kwargs))
        finally:
            _local.depth = 0

    return call


# Optuna's public storage API, and the private calls its cache (_CachedStorage) makes on it
_GUARDED = sorted(
    {n for n in dir(optuna.storages.BaseStorage) if not n.startswith("_")}
    | {
        "record_heartbeat",
        "_create_new_trial",
        "_get_best_trial_id",
        "_get_stale_trial_ids",
        "_get_trials",
        "_set_trial_param",
    }
)
for _name in _GUARDED:
    _method = getattr(RDBStorage, _name, None)
    if callable(_method) and _name not in ("remove_session", "get_heartbeat_interval",
                                           "get_heartbeat_stale_trial_callback"):
        setattr(GuardedStorage, _name, _guarded(_method))


def _set_trial_state_values(self: GuardedStorage, trial_id: int, state: TrialState,
                            values: Any = None) -> bool:
    """Optuna's ``set_trial_state_values``, where taking a WAITING trial (``study.ask``) is one
    conditional UPDATE: Optuna reads the state, then writes it, and SQLite has no ``SELECT ...
    FOR UPDATE``, so two processes that read the same WAITING row both took it."""
    if state != TrialState.RUNNING or values is not None:
        return RDBStorage.set_trial_state_values(self, trial_id, state, values)
    with _create_scoped_session(self.scoped_session) as session:
        if _swap_state(session, trial_id, TrialState.WAITING, TrialState.RUNNING):
            # the row is this transaction's now: the start time through Optuna's own column
            row = models.TrialModel.find_or_raise_by_id(trial_id, session)
            row.datetime_start = datetime.now()
            return True
    self.check_trial_is_updatable(trial_id, self.get_trial(trial_id).state)  # finished: raises
    return False


GuardedStorage.set_trial_state_values = _guarded(_set_trial_state_values)  # type: ignore[method-assign]


def _swap_state(session: Any, trial_id: int, old: TrialState, new: TrialState) -> bool:
    """Set the trial's state from ``old`` to ``new`` in one UPDATE (it holds the row, or on
    SQLite the database, until the transaction ends); False if its state was not ``old``."""
    trial = models.TrialModel
    return bool(session.query(trial).filter(trial.trial_id == trial_id, trial.state == old)
                .update({trial.state: new}, synchronize_session=False))


def put_back_if_same(storage: RDBStorage, trial_id: int, started: datetime) -> bool:
    """Set a RUNNING trial back to WAITING, only if it is still in the take that started at
    ``started`` (its ``datetime_start`` as read), in one transaction: a process that read it
    before another put it back and a third took it up again must not undo that take. True if
    this call put it back."""

    def update() -> bool:
        with _create_scoped_session(storage.scoped_session) as session:
            if not _swap_state(session, trial_id, TrialState.RUNNING, TrialState.WAITING):
                return False
            if models.TrialModel.find_or_raise_by_id(trial_id, session).datetime_start \
                    != started:
                session.rollback()  # taken up again since it was read
                return False
        return True

    return storage._retry(update) if isinstance(storage, GuardedStorage) else update()


# (dialect, driver) as SQLAlchemy names them -> the driver, how to install it, the other way in.
# SQLAlchemy 2 maps ``postgresql://`` to psycopg 3 and ``mysql://`` to mysqlclient (MySQLdb).
_EXTRA = "pip install 'hydro-surrogate[postgres]'"
_DRIVERS: dict[tuple[str, str], tuple[str, str, str]] = {
    ("postgresql", "psycopg"): (
        "the PostgreSQL driver psycopg", _EXTRA,
        "use postgresql+psycopg2:// with psycopg2 installed (pip install psycopg2-binary)",
    ),
    ("postgresql", "psycopg2"): (
        "the PostgreSQL driver psycopg2", "pip install psycopg2-binary",
        f"use postgresql:// (psycopg 3): {_EXTRA}",
    ),
    ("postgresql", "pg8000"): (
        "the PostgreSQL driver pg8000", "pip install pg8000",
        f"use postgresql:// (psycopg 3): {_EXTRA}",
    ),
    ("mysql", "mysqldb"): (
        "the MySQL driver MySQLdb", "pip install mysqlclient",
        "use mysql+pymysql:// with pymysql installed (pip install pymysql)",
    ),
    ("mysql", "pymysql"): ("the MySQL driver pymysql", "pip install pymysql", ""),
}


def check_driver(url: str) -> None:
    """Raise a one-line :class:`~hydro.errors.StorageError` naming the package to install when
    the database driver that SQLAlchemy picks for ``url`` does not import.

    Optuna's own error for it ("Failed to import DB access module") names no module. A URL
    SQLAlchemy cannot parse, or whose dialect it does not know, is left to the storage's own
    error.
    """
    from sqlalchemy.engine import make_url

    try:
        dialect = make_url(url).get_dialect()
    except Exception:  # malformed URL, unknown dialect: said when it is opened
        return
    try:
        (getattr(dialect, "import_dbapi", None) or dialect.dbapi)()  # SQLAlchemy 2, else 1.4
    except ImportError as exc:
        name, driver = dialect.name, dialect.driver
        what, install, other = _DRIVERS.get((name, driver), (
            f"the database driver {exc.name or driver} (SQLAlchemy's {name}+{driver})",
            "install the package that provides it", ""))
        why = (str(exc) or type(exc).__name__).splitlines()[0]
        raise StorageError(f"storage {_where(url)} needs {what} ({why}): {install}"
                           f"{'; or ' + other if other else ''}") from exc


def open_storage(url: str) -> GuardedStorage:
    """The storage at ``url`` (any SQLAlchemy URL Optuna takes), guarded as described above.

    Raises:
        StorageError: the database is locked past the timeout, or cannot be read or written;
            or the URL's database driver is not installed (:func:`check_driver`).
        ConfigError: ``$HYDRO_STORAGE_TIMEOUT`` is not a number of seconds.
    """
    check_driver(url)
    return GuardedStorage(url)

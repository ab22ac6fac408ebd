"""A study on a real PostgreSQL server, through the ``hydro`` command (issue 36, point 6).

``postgresql://user@host/db`` is the URL the docs give; SQLAlchemy 2 opens it with psycopg 3,
which the ``postgres`` extra installs. A driver that is not installed is one line naming the
package, exit 2. The server is the ``postgres`` fixture's (tests/pg_server.py): started by the
test on 127.0.0.1, skipped only where the server binaries are not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import optuna
import pytest
import sqlalchemy
import yaml
from optuna.trial import TrialState
from sqlalchemy.engine import Engine

from hydro.cli import main
from hydro.tuning.bookkeeping import is_void
from hydro.tuning.storage import open_storage
from tests import toy
from tests.waiting import patience

ROOT = Path(__file__).resolve().parents[2]
TRIALS = 6
DASHBOARD = shutil.which("optuna-dashboard")

# the loss a config names, steered by the test through the environment, in the local executor's
# workers only (the tuner itself runs the loss once before any trial, as a check): with
# $PG_TEST_BLOCK set, the worker that makes the 3rd training call (mid-group) writes its pid
# there and blocks, for the test to SIGKILL its tuner at a known point; with $PG_TEST_HOLD
# set, training waits while that file exists
LOSS = """
import multiprocessing, os, time
from pathlib import Path

_calls = [0]

def loss(out, y):
    if torch.is_grad_enabled() and multiprocessing.parent_process() is not None:
        _calls[0] += 1
        marker = os.environ.get("PG_TEST_BLOCK")
        if marker and _calls[0] == 3:
            Path(marker).write_text(str(os.getpid()))
            while True:
                time.sleep(60)
        while os.path.exists(os.environ.get("PG_TEST_HOLD", "/nonexistent")):
            time.sleep(0.05)
    return torch.nn.functional.cross_entropy(out, y)
"""


def _project(folder: Path, url: str, trials: int = TRIALS) -> Path:
    (folder / "toymod.py").write_text(toy.source(extra=LOSS))
    task = "  loss: toymod:loss\n  checkpoint_every: 2\n"
    config = toy.config("toymod", storage=url, trials=trials, steps=8, eval_every=4,
                        top="pruner: none\n", task=task)
    (folder / "tune.yaml").write_text(config)
    return folder


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def _tune(folder: Path, log: Path, **env: str) -> subprocess.Popen:
    """``hydro tune`` as a user runs it, on the local executor, trial checkpoints in a folder
    both tuners see (a database server has no file for them to sit beside)."""
    cmd = [sys.executable, "-m", "hydro.cli", "tune", "tune.yaml", "--executor", "local",
           "--checkpoint-dir", "ckpt", "--no-progress"]
    with open(log, "a") as out:
        return subprocess.Popen(cmd, cwd=folder, env=_env(**env), stdout=out,
                                stderr=subprocess.STDOUT)


def _in_folder(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Run ``hydro.cli.main`` in this process as the user's shell would in ``folder``."""
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "toymod", raising=False)


def _running(storage: optuna.storages.BaseStorage, pid: int) -> list[int]:
    """The RUNNING trials of study ``toy`` that process ``pid`` holds."""
    trials = optuna.load_study(study_name="toy", storage=storage).get_trials(
        deepcopy=False, states=(TrialState.RUNNING,))
    return [t.number for t in trials if t.user_attrs.get("hydro_owner", {}).get("pid") == pid]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_missing_postgres_driver_is_one_line_naming_the_package(tmp_path):
    """``postgresql://`` with psycopg not importable (blocked in the process, as if not
    installed): exit 2 and one line naming the package, no traceback, before any connection
    (the port is closed)."""
    url = "postgresql://user@127.0.0.1:1/hydro"
    _project(tmp_path, url)
    # as if not installed: an import of a name that sys.modules maps to None fails
    block = "import sys; sys.modules['psycopg'] = None; from hydro.cli import main; exit(main())"
    done = subprocess.run([sys.executable, "-c", block, "tune", "tune.yaml"], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True,
                          timeout=patience(120))
    err = done.stderr.strip()
    assert done.returncode == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"hydro tune: error: storage '{url}' needs the PostgreSQL driver "
                          "psycopg"), err
    assert "pip install 'hydro-surrogate[postgres]'" in err and "postgresql+psycopg2://" in err


@pytest.mark.parametrize("url, module, install", [
    ("postgresql+psycopg2://u:secret@127.0.0.1:1/hydro", "psycopg2", "pip install psycopg2-binary"),
    ("mysql+pymysql://u@127.0.0.1:1/hydro", "pymysql", "pip install pymysql"),
    ("mysql://u@127.0.0.1:1/hydro", "MySQLdb", "pip install mysqlclient"),
])
def test_other_missing_drivers_name_their_package(monkeypatch, capsys, url, module, install):
    monkeypatch.setitem(sys.modules, module, None)  # not installed, whether or not it is
    assert main(["export", "--storage", url, "--study", "hydro"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert f"needs the {'PostgreSQL' if 'postgres' in url else 'MySQL'} driver {module}" in err
    assert install in err and "secret" not in err  # the password is not shown


def test_an_unreachable_server_is_one_line_without_the_password(capsys):
    """Nothing listens on the port: exit 2 and one line naming the URL, its password hidden."""
    assert main(["export", "--storage", "postgresql://u:secret@127.0.0.1:1/hydro"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("hydro export: error: cannot open Optuna storage "
                          "'postgresql://u:***@127.0.0.1:1/hydro'"), err
    assert "secret" not in err


def test_two_tuners_creating_a_fresh_database_at_once_both_open_it(postgres, monkeypatch):
    """Tuners started together on a new database both create its tables: on PostgreSQL the
    second's CREATE waits for the first's and then fails ("duplicate key value violates unique
    constraint", exit 2 for that tuner). Made certain here: both have checked that nothing
    exists before either creates anything. Both open the storage, and one study is made."""
    url = postgres.createdb("fresh")
    both_checked = threading.Barrier(2, timeout=patience(30))
    waited: set[int] = set()

    def wait_before_the_first_create(conn, cursor, statement, *args):
        if statement.lstrip().upper().startswith("CREATE") and threading.get_ident() not in waited:
            waited.add(threading.get_ident())
            both_checked.wait()

    sqlalchemy.event.listen(Engine, "before_cursor_execute", wait_before_the_first_create)
    opened: list[object] = []
    errors: list[BaseException] = []

    def open_and_create() -> None:
        try:
            storage = open_storage(url)
            optuna.create_study(storage=storage, study_name="s", load_if_exists=True)
            opened.append(storage)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    try:
        threads = [threading.Thread(target=open_and_create) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(patience(60))
    finally:
        sqlalchemy.event.remove(Engine, "before_cursor_execute", wait_before_the_first_create)
    assert errors == [] and len(opened) == 2, errors
    assert len(waited) == 2  # both really reached their first CREATE together
    assert optuna.get_all_study_names(storage=url) == ["s"]


def test_two_tuners_share_a_postgres_study_one_killed_restarted_then_exported(
    postgres, tmp_path, monkeypatch
):
    """Two ``hydro tune --executor local`` processes on one PostgreSQL study; one is SIGKILLed
    mid-group (its worker blocked in a known training step) and started again while the other
    holds trials of its own. Every configuration is trained once: none lost, none duplicated,
    none FAIL, none left RUNNING, as many trials as the budget, and both live tuners trained
    some. ``hydro export`` then writes the best of the resumed study."""
    url = postgres.createdb("shared")
    _project(tmp_path, url)
    marker, hold = tmp_path / "blocked", tmp_path / "hold"
    logs = {name: tmp_path / f"{name}.log" for name in ("victim", "other", "again")}
    hold.touch()  # the other tuner trains once the restarted one is up: both share the rest
    victim = _tune(tmp_path, logs["victim"], PG_TEST_BLOCK=str(marker))
    other = _tune(tmp_path, logs["other"], PG_TEST_HOLD=str(hold))
    procs = [victim, other]
    try:
        deadline = time.monotonic() + patience(120)
        while not marker.exists() or not marker.read_text():
            assert victim.poll() is None, logs["victim"].read_text()
            assert time.monotonic() < deadline, "the tuner to kill never reached its step"
            time.sleep(0.05)
        blocked = int(marker.read_text())
        assert blocked != victim.pid, "blocked in the tuner itself, not in a group's worker"
        polled = optuna.storages.RDBStorage(url)  # one engine for every poll
        while not _running(polled, other.pid):  # the kill lands while the other holds trials
            assert other.poll() is None, logs["other"].read_text()
            assert time.monotonic() < deadline, "the other tuner never took a trial"
            time.sleep(0.2)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        try:  # its worker: the watchdog on the tuner's pid may have ended it already
            os.kill(blocked, signal.SIGKILL)
        except ProcessLookupError:
            pass
        procs.append(again := _tune(tmp_path, logs["again"]))
        deadline = time.monotonic() + patience(120)
        while "resuming study 'toy'" not in logs["again"].read_text():
            assert again.poll() is None, logs["again"].read_text()
            assert time.monotonic() < deadline, "the restarted tuner never opened the study"
            time.sleep(0.05)
        hold.unlink()
        codes = [p.wait(timeout=patience(180)) for p in (other, again)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = "\n".join(f"--- {log.name}\n{log.read_text()}" for log in logs.values())
    assert codes == [0, 0], text
    assert "Traceback" not in text, text

    trials = optuna.load_study(study_name="toy", storage=url).get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    configs = [tuple(sorted(t.params.items())) for t in complete]
    counted = [t for t in trials if not is_void(t)]
    assert [(t.number, t.user_attrs.get("fail_reason")) for t in counted
            if t.state == TrialState.FAIL] == [], text
    assert [t.number for t in trials if not t.state.is_finished()] == [], text  # RUNNING, WAITING
    assert len(configs) == len(set(configs)), f"a configuration trained twice: {configs}"
    assert len(complete) == len(counted) == TRIALS, text  # none lost, the budget exactly
    assert any(t.user_attrs.get("hydro_interrupted") for t in complete), "the kill put none back"
    owners = {t.user_attrs["hydro_owner"]["pid"] for t in complete}
    assert owners == {other.pid, again.pid}, (owners, text)

    # the restarted tuner resumed the study; what it holds exports
    assert "resuming study 'toy'" in logs["again"].read_text()
    monkeypatch.chdir(tmp_path)
    assert main(["export", "--storage", url, "--study", "toy", "-o", "best.yaml"]) == 0
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert set(best["hyperparameters"]) == {"lr"}
    assert best["provenance"]["trials"]["complete"] == TRIALS


def test_optuna_dashboard_reads_a_postgres_study(postgres, tmp_path, monkeypatch):
    """``optuna-dashboard postgresql://...`` lists the study Hydro wrote, with its trials."""
    if not DASHBOARD:
        pytest.skip("optuna-dashboard is not installed (the dev extra installs it)")
    url = postgres.createdb("dashboard")
    _project(tmp_path, url, trials=2)
    _in_folder(monkeypatch, tmp_path)
    assert main(["tune", "tune.yaml", "--no-progress"]) == 0
    port = _free_port()
    log = tmp_path / "dashboard.log"
    with open(log, "w") as out:
        dash = subprocess.Popen([DASHBOARD, url, "--port", str(port), "--host", "127.0.0.1"],
                                stdout=out, stderr=subprocess.STDOUT, env=_env())
    try:
        deadline = time.monotonic() + patience(60)
        while True:
            assert dash.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5) as r:
                    studies = json.load(r)["study_summaries"]
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        assert [s["study_name"] for s in studies] == ["toy"]
        sid = studies[0]["study_id"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies/{sid}", timeout=30) as r:
            detail = json.load(r)
        assert [t["state"] for t in detail["trials"]] == ["Complete", "Complete"]
        assert all("lr" in {p["name"] for p in t["params"]} for t in detail["trials"])
    finally:
        dash.terminate()
        try:
            dash.wait(timeout=10)
        except subprocess.TimeoutExpired:
            dash.kill()
            dash.wait()

"""Signals and start-up failures of ``hydro tune`` as a user meets them (issue 36, point 4):
Ctrl-C (SIGINT) at any moment of start-up stops the run with the interrupted line and exit 130,
also when the shell started it with SIGINT ignored (a script's ``hydro tune ... &``); SIGTERM
on the Ray executor stops as on the local one (a line, trials requeued, exit 143, no Ray
process left); a Ray that does not start is one line and exit 3. Real processes, real Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import sqlalchemy
from optuna.trial import TrialState

from tests import toy
from tests.tuning.test_signals import _alive, _descendants
from tests.waiting import patience

ROOT = Path(__file__).resolve().parents[2]
TOY = toy.source(n=384, n_train=256, width=64)
# enough trials that no run ends by itself within a test
CONFIG = toy.config("toymod", trials=400, steps=2000, eval_every=100, top="pruner: none\n")
linux = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")


@pytest.fixture
def project(tmp_path):
    (tmp_path / "toymod.py").write_text(TOY)
    (tmp_path / "tune.yaml").write_text(CONFIG)
    return tmp_path


def _start(project: Path, *flags: str, env: dict | None = None, ignore_sigint: bool = False,
           session: bool = False) -> tuple[subprocess.Popen, Path]:
    err = project / "stderr.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}

    def background() -> None:  # what a shell does to a script's `cmd &`
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "hydro.cli", "tune", "tune.yaml",
                                 "--no-progress", *flags], cwd=project, env=env, stderr=stderr,
                                stdout=subprocess.DEVNULL, start_new_session=session,
                                preexec_fn=background if ignore_sigint else None)
    return proc, err


def _states(project: Path) -> list[TrialState]:
    if not (project / "toy.db").exists():
        return []
    try:
        study = optuna.load_study(study_name="toy", storage=f"sqlite:///{project / 'toy.db'}")
    except (KeyError, sqlalchemy.exc.OperationalError):  # the tuner is creating it now
        return []
    return [t.state for t in study.trials]


def _wait_for(proc: subprocess.Popen, err: Path, ready, seconds: float) -> None:
    until = time.monotonic() + patience(seconds)
    while not ready():
        assert proc.poll() is None, err.read_text()
        assert time.monotonic() < until, err.read_text()
        time.sleep(0.1)


def _stopped(proc: subprocess.Popen, err: Path, code: int, word: str) -> list[str]:
    assert proc.wait(timeout=patience(90)) == code, err.read_text()
    text = err.read_text()
    assert "Traceback" not in text, text
    # a Ray worker's own output, forwarded with its prefix, may come after the last line
    lines = [line for line in text.splitlines()
             if line.strip() and not line.lstrip("\x1b[0123456789m").startswith("(")]
    assert lines[-1].startswith(f"hydro tune: {word}"), text
    return lines


@linux
@pytest.mark.parametrize(
    "executor, moment",
    [("inline", 0.3), ("inline", 0.8), ("inline", 1.5), ("inline", "opening"),
     ("local", "opening"), ("local", "second-sigint")],
)
def test_sigint_at_start_up_stops_with_130_even_if_the_shell_ignored_it(project, moment,
                                                                       executor):
    proc, err = _start(project, "--executor", executor, ignore_sigint=True)
    try:
        if isinstance(moment, float):  # before any study exists: torch and Hydro loading (a
            time.sleep(moment)  # SIGINT inside torch's import once aborted the process)
        else:  # the study is open: the model is being built, groups started
            _wait_for(proc, err, lambda: "study 'toy'" in err.read_text(), 60)
        proc.send_signal(signal.SIGINT)
        if moment == "second-sigint":
            time.sleep(0.2)
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        _stopped(proc, err, 130, "interrupted")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert TrialState.RUNNING not in _states(project)


@linux
def test_sigterm_on_the_ray_executor_requeues_and_leaves_no_ray_process(project):
    pytest.importorskip("ray")
    # SIGTERM to the whole process group, as timeout, Slurm and systemd send it: Ray's own
    # processes get it too, and must not die under the driver before it puts its trials back
    proc, err = _start(project, "--executor", "ray", session=True)
    try:
        # (the study is read once the tuner has created it: not while it creates the tables)
        _wait_for(proc, err, lambda: "study 'toy'" in err.read_text(), 60)
        _wait_for(proc, err, lambda: TrialState.RUNNING in _states(project), 60)
        time.sleep(1.0)
        below = _descendants(proc.pid)  # Ray's processes: started by this driver
        assert below, "Ray started no process"
        os.killpg(proc.pid, signal.SIGTERM)
        lines = _stopped(proc, err, 143, "terminated")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert lines[-1] == ("hydro tune: terminated; the finished trials are saved in study 'toy' of "
                         "sqlite:///toy.db: run the same command again to resume")
    states = _states(project)
    assert TrialState.RUNNING not in states and TrialState.WAITING in states
    assert TrialState.FAIL not in states
    until = time.monotonic() + patience(30)
    while any(_alive(pid, ticks) for pid, ticks, _ in below) and time.monotonic() < until:
        time.sleep(0.2)
    assert not [pid for pid, ticks, _ in below if _alive(pid, ticks)]


def test_a_ray_that_does_not_start_is_one_line_and_exit_3(project):
    pytest.importorskip("ray")
    # Ray's session folder under a regular file: its start-up fails, for real, at once
    (project / "not-a-dir").write_text("")
    proc, err = _start(project, "--executor", "ray",
                       env={"RAY_TMPDIR": str(project / "not-a-dir" / "ray")})
    assert proc.wait(timeout=patience(120)) == 3, err.read_text()
    text = err.read_text()
    assert "Traceback" not in text
    last = text.strip().splitlines()[-1]
    assert last.startswith(
        "hydro tune: error: a new local Ray did not start: NotADirectoryError"
    ), text
    assert "ray start --head" in last
    assert TrialState.RUNNING not in _states(project) and TrialState.FAIL not in _states(project)

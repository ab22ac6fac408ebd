"""Checkpoints that outlive the tuner: keyed by study and trial, a trial re-asked after its
tuner was SIGKILLed resumes from its predecessor's last checkpoint (in process and on a
``LocalExecutor``), a study never reads another study's checkpoint, unusable files are moved
aside, and a dead run's checkpoints are removed once its trials were re-asked and told."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState

import hydro
from hydro.errors import ConfigError, HydroWarning
from hydro.integrations.optuna import is_void, optimize
from hydro.tuning import checkpoint
from hydro.tuning.group import FusedGroup
from hydro.tuning.lockstep import train_group
from tests.tuner_child import SPACE
from tests.tuner_child import make_task as child_task
from tests.tuning.test_continuous_batching import assert_same, make_task, trajectory

optuna.logging.set_verbosity(optuna.logging.WARNING)
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
STEPS, EVERY = 20, 5  # the child's trials: 20 steps, a checkpoint every 5


# --- one trial's slice of a fused group -----------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_trial_moves_to_another_slot_of_another_group_exactly(tmp_path, optimizer):
    """A trial taken out of slot 1 of a group of three at step 5, through a file, into slot 1
    of another group whose members are at step 3, goes on exactly as if never moved: its loss
    and parameters equal the uninterrupted trial's, step by step in float64."""
    task = make_task(steps=12, scheduler="cosine", optimizer=optimizer)
    p = {"lr": 3e-2, "weight_decay": 0.1, "warmup": 2, "grad_clip": 0.5}
    if optimizer == "sgd":
        p["momentum"] = 0.9
    a = FusedGroup(task, [(0, {"lr": 1e-3}, 1), (7, p, 7), (1, {"lr": 1e-1}, 2)], ratio=2)
    trajectory(a, 1, 5)
    torch.save(a.trial_state(1), tmp_path / "t.pt")
    state = torch.load(tmp_path / "t.pt", weights_only=True)  # what a checkpoint holds
    b = FusedGroup(task, [(3, {"lr": 3e-3}, 3), (4, {"lr": 2e-3, "warmup": 4}, 4)], ratio=2)
    others = trajectory(b, 0, 3)
    b.resume(1, state)
    assert (b.members[1].id, b.members[1].step, b.members[1].seed) == (7, 5, 7)
    assert_same(trajectory(b, 1, 7), trajectory(a, 1, 7))
    # the slot's neighbour went on undisturbed: trial 3 alone, 3 + 7 steps
    alone = trajectory(FusedGroup(task, [(3, {"lr": 3e-3}, 3)], ratio=2), 0, 10)
    assert_same(others, alone[:3])


def test_a_trial_state_of_another_model_is_refused(tmp_path):
    small = make_task(steps=4)
    wide = make_task(steps=4)
    wide.model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(),
                                     torch.nn.Linear(64, 3)).double()
    state = FusedGroup(wide, [(0, {"lr": 1e-2}, 0)], ratio=2).trial_state(0)
    group = FusedGroup(small, [(0, {"lr": 1e-2}, 0)], ratio=2)
    with pytest.raises(hydro.errors.FuseError, match="load_trial_state"):
        group.resume(0, state)


# --- a tuner SIGKILLed mid-group, then run again ---------------------------------------------


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in parents.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_at_marker(cmd: list[str], marker: Path) -> None:
    """Run the tuner ``cmd`` until it blocks mid-group (``marker``), then SIGKILL it; its
    workers, if any, are SIGKILLed too should the watchdog not have stopped them."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV)
    family: list[int] = []
    try:
        while not marker.exists():
            assert proc.poll() is None, f"the tuner ended ({proc.returncode}) before its stop"
            time.sleep(0.05)
        family = _descendants(proc.pid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for pid in family:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _child(storage: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tests.tuner_child", storage, "2", "--fuse", "2", "--steps",
            str(STEPS), "--eval-every", "1", "--checkpoint-every", str(EVERY), *extra]


@pytest.mark.parametrize("executor", [None, "local"])
def test_killed_tuner_resumes_each_trial_from_its_last_checkpoint(tmp_path, executor):
    """A tuner SIGKILLed at step 13 of its only group (checkpoints every 5 steps), run again:
    each interrupted trial is put back and taken up again, resuming from its last checkpoint,
    retraining at most 5 steps (today: all 20), ends with the value the uninterrupted trial
    has, and the dead run's checkpoints are gone once the re-asked trials are told."""
    storage = f"sqlite:///{tmp_path / 'hydro.db'}"
    extra = ("--executor", executor) if executor else ()
    marker = tmp_path / "blocked"
    _kill_at_marker(_child(storage, *extra, "--block-at", "14", "--marker", str(marker)),
                    marker)
    study = optuna.load_study(study_name="hydro", storage=storage)
    store = checkpoint.for_study(study, tmp_path / "hydro.db.checkpoints")
    assert store.numbers() == [0, 1]  # the dead run's trials, kept for their re-asks
    reached = {t.number: max(t.intermediate_values) for t in study.trials}
    assert all(EVERY <= s < STEPS for s in reached.values())

    subprocess.run(_child(storage, *extra), cwd=ROOT, env=ENV, check=True, timeout=600)
    study = optuna.load_study(study_name="hydro", storage=storage)
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == len(trials) == 2  # the same two trials, put back and resumed
    assert not [t for t in trials if is_void(t)]
    trained = 0
    for t in complete:
        old = t.number
        resumed = t.user_attrs["hydro_resumed_at"]
        assert t.user_attrs["hydro_seed"] == old and t.user_attrs["hydro_interrupted"] == 1
        assert resumed % EVERY == 0 and 0 < reached[old] - resumed <= EVERY
        # the predecessor's reported values came along, for the pruner
        assert sorted(t.intermediate_values) == list(range(1, STEPS + 1))
        trained += STEPS - resumed
    # steps actually trained by the second run, counted by its groups: the rest was resumed
    assert study.user_attrs["hydro_occupancy"]["live"] == trained < 2 * STEPS
    assert store.numbers() == [] and not store.directory.exists()

    # the uninterrupted trials, in a study of their own: the same values
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    hydro.tune(child_task(STEPS, eval_every=1), SPACE, n_trials=2, ratio=2, fuse=2,
               storage=fresh, seed=0, pruner=optuna.pruners.NopPruner())
    want = {t.number: t.value for t in optuna.load_study(study_name="hydro", storage=fresh).trials}
    for t in complete:
        assert t.value == pytest.approx(want[t.number], rel=1e-6)


# --- two studies, one checkpoint directory ----------------------------------------------------


def test_two_studies_sharing_a_checkpoint_dir_never_read_each_other(tmp_path):
    """Two studies given one executor ``checkpoint_dir`` and one ``checkpoint_dir``: the second
    moves the first's group checkpoint aside instead of resuming it (it crashed with an
    IndexError), and its trials end as they do in a directory of their own."""
    from hydro_fluid import LocalExecutor

    shared = tmp_path / "shared"
    task = child_task(6, eval_every=2, checkpoint_every=2)
    kw = {"n_trials": 2, "ratio": 2, "fuse": 2, "pruner": optuna.pruners.NopPruner(),
          "checkpoint_dir": shared}
    values = {}
    for name, seed in (("a", 0), ("b", 1)):
        ex = LocalExecutor(devices=[], num_workers=1, checkpoint_dir=shared / "groups")
        r = hydro.tune(task, SPACE, storage=f"sqlite:///{tmp_path / name}.db", seed=seed,
                       executor=ex, **kw)
        assert {t.state for t in r.study.trials} == {TrialState.COMPLETE}
        values[name] = [t.value for t in r.study.trials]
    alone = hydro.tune(task, SPACE, storage=f"sqlite:///{tmp_path / 'alone'}.db", seed=1,
                       **kw)
    assert values["b"] == pytest.approx([t.value for t in alone.study.trials], rel=1e-6)
    assert list((shared / "groups" / "group-0").glob("group.pt.set-aside-*"))


# --- unusable checkpoint files -----------------------------------------------------------------


def _dead_trial(storage: str) -> tuple[optuna.Study, dict]:
    """A study whose trial 0 was RUNNING in a tuner that died (a pid that is not alive)."""
    study = optuna.create_study(storage=storage, study_name="hydro")
    t = study.ask(SPACE)
    t.set_user_attr("hydro_owner", {"host": socket.gethostname(), "pid": 2**22 + 11})
    return study, dict(t.params)


def _planted(path: Path) -> None:
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {path.parent / 'pwned'}",))

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps({"step": Payload()}, protocol=2))


@pytest.mark.parametrize("kind", ["truncated", "planted pickle", "another study", "another model"])
def test_an_unusable_checkpoint_is_moved_aside_and_the_trial_starts_afresh(tmp_path, kind):
    storage = f"sqlite:///{tmp_path / 'hydro.db'}"
    study, params = _dead_trial(storage)
    store = checkpoint.for_study(study, tmp_path / "ck")
    path = store.path(0)
    task = child_task(4)
    if kind == "planted pickle":
        _planted(path)
    else:
        model_task = task
        if kind == "another model":
            model_task = child_task(4)
            model_task.model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(),
                                                   torch.nn.Linear(64, 3))
        group = FusedGroup(model_task, [(0, params, 0)], ratio=2)
        group.step()
        owner = store if kind != "another study" else checkpoint.TrialCheckpoints(
            store.directory, "not-this-study")
        owner.save(group.trial_state(0))
        if kind == "truncated":
            path.write_bytes(path.read_bytes()[:200])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimize(study, task, SPACE, n_trials=1, ratio=2, fuse=2, checkpoint_every=2,
                 checkpoint_dir=tmp_path / "ck")
    said = [str(w.message) for w in caught if issubclass(w.category, HydroWarning)]
    # the file is named (the trial is put back and taken up again under its own number)
    named = str(store.path(0))
    assert any(m.startswith(f"checkpoint {named} ") and "moved aside" in m for m in said), said
    assert len(list(store.directory.glob("trial-*.pt.set-aside-*"))) == 1
    assert not (store.directory / "pwned").exists()
    again = study.trials
    assert len(again) == 1 and again[0].state == TrialState.COMPLETE
    assert again[0].user_attrs["hydro_seed"] == 0 and again[0].user_attrs["hydro_interrupted"] == 1
    # it started afresh: the value of the trial trained from step 0
    (fresh,), _ = train_group(task, [params], ratio=2, seeds=[0])
    assert again[0].value == pytest.approx(fresh.value, rel=1e-6)
    assert store.numbers() == []


def test_checkpoint_dir_must_be_a_directory(tmp_path):
    study = optuna.create_study()
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="checkpoint_dir .* is a file: give a directory"):
        optimize(study, child_task(2), SPACE, n_trials=1, checkpoint_dir=tmp_path / "f")
    with pytest.raises(ConfigError, match="checkpoint_dir must be a directory path"):
        optimize(study, child_task(2), SPACE, n_trials=1, checkpoint_dir=3)


def test_default_root_is_beside_the_sqlite_file(tmp_path):
    db = tmp_path / "x.db"
    on_file = optuna.create_study(storage=f"sqlite:///{db}")
    assert checkpoint.default_root(on_file) == db.with_name("x.db.checkpoints")
    assert checkpoint.default_root(optuna.create_study()) is None
    assert checkpoint.default_root(optuna.create_study(storage="sqlite:///:memory:")) is None
    # a study's identity is created once and kept: its directory does not depend on the run
    first = checkpoint.for_study(on_file, tmp_path)
    assert checkpoint.for_study(on_file, tmp_path) == first
    assert first.directory.parent == tmp_path.resolve()
    assert first.directory.name == f"{on_file.study_name}-{first.study}"
    second = optuna.create_study(storage=f"sqlite:///{db}", study_name="second")
    other = checkpoint.for_study(second, tmp_path)
    assert other.study != first.study


def test_cli_and_config_take_a_checkpoint_dir(tmp_path, monkeypatch, capsys):
    """``checkpoint_dir`` in a config (checked: a path) and ``--checkpoint-dir`` on
    ``hydro tune``: the trials' checkpoints go there, not beside the SQLite file."""
    from hydro.cli import main
    from hydro.tuning import config
    from tests.cli.test_commands import CONFIG, TOY

    (tmp_path / "toymod.py").write_text(TOY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "toymod", raising=False)
    (tmp_path / "bad.yaml").write_text(CONFIG + "checkpoint_dir: [1]\n")
    with pytest.raises(ConfigError, match="bad.yaml: checkpoint_dir must be a directory path"):
        config.load("bad.yaml")
    (tmp_path / "tune.yaml").write_text(CONFIG.replace("  steps: 10", "  steps: 10\n"
                                                       "  checkpoint_every: 4")
                                        + "checkpoint_dir: from-config\n")
    assert config.load("tune.yaml").checkpoint_dir == "from-config"
    assert main(["tune", "tune.yaml", "--trials", "2", "--checkpoint-dir", "ck"]) == 0
    study = optuna.load_study(study_name="toy", storage="sqlite:///toy.db")
    assert {t.state for t in study.trials} == {TrialState.COMPLETE}
    assert (tmp_path / "ck").is_dir()  # written at step 4 and 8, removed once told
    assert list((tmp_path / "ck").iterdir()) == []
    assert not (tmp_path / "from-config").exists()
    assert not (tmp_path / "toy.db.checkpoints").exists()

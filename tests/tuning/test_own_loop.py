"""Your own training loop, tuned by Hydro: fused equals alone (refills included), slots stay
full, a killed run resumes, and the errors a user meets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
from optuna.distributions import FloatDistribution

import hydro
from hydro.errors import ConfigError
from hydro.tuning.bookkeeping import trial_seed
from hydro.tuning.loop import Loop, LoopGroup
from tests.tuning import loops

ROOT = Path(__file__).resolve().parents[2]
SPACE = {"lr": FloatDistribution(1e-3, 1e-1, log=True), "beta1": FloatDistribution(0.8, 0.95)}


class PruneSome(optuna.pruners.BasePruner):
    """Prunes trials 1, 4, 7... at their first report: refills at known points."""

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        return trial.number % 3 == 1 and trial.last_step is not None


def _loop(**kw: object) -> Loop:
    x, y = loops.data(dtype=torch.float64)
    base = {"train": loops.train, "model": loops.mlp(dtype=torch.float64), "steps": 6,
            "eval_every": 2, "train_data": (x[:192], y[:192]), "val_data": (x[192:], y[192:]),
            "batch_size": 16, "checkpoint_every": 0}
    return Loop(**{**base, **kw})


def test_fused_loop_equals_each_trial_alone_step_by_step_refills_included():
    loop = _loop()
    study = optuna.create_study(pruner=PruneSome(), sampler=optuna.samplers.RandomSampler(0))
    loops.RECORD = {}
    try:
        result = hydro.tune(loop, SPACE, n_trials=7, fuse=3, ratio=2, study=study,
                            first_group=0)
        fused = loops.RECORD
        trials = result.study.trials
        assert {t.state.name for t in trials} == {"COMPLETE", "PRUNED"}
        assert [t.number for t in trials if t.state.name == "PRUNED"] == [1, 4]
        # one group of 3 slots trained all 7: pruned and completed slots took new trials
        assert {t.user_attrs["group"] for t in trials} == {0}
        assert max(t.number for t in trials if t.user_attrs["slot"] == 1) > 2
        for t in trials:
            last = 6 if t.state.name == "COMPLETE" else 2
            loops.RECORD = {}
            alone = LoopGroup(loop, [(t.number, dict(t.params), trial_seed(t, 0))], ratio=2)
            for _ in range(last):
                alone.step()
            alone.drop([0])
            for step in range(1, last + 1):
                a, b = loops.RECORD[(t.number, step)], fused[(t.number, step)]
                for name, value in a["model"].items():
                    torch.testing.assert_close(
                        b["model"][name],
                        value,
                        rtol=1e-12,
                        atol=1e-14,
                        msg=f"trial {t.number} step {step}: {name}",
                    )
                for sa, sb in zip(a["opt"]["state"], b["opt"]["state"]):
                    for key in sa:
                        torch.testing.assert_close(sb[key], sa[key], rtol=1e-12, atol=1e-14)
                assert a["opt"]["groups"] == b["opt"]["groups"]
            assert t.state.name == "PRUNED" or t.value == pytest.approx(
                t.intermediate_values[6], rel=0
            )  # the last report is the result
    finally:
        loops.RECORD = None


@pytest.mark.parametrize("executor", ["inline", "local"])
def test_sixteen_slots_stay_full_while_trials_remain(executor):
    loop = _loop(train=loops.train, steps=8, eval_every=2)
    result = hydro.tune(loop, SPACE, n_trials=40, fuse=16, ratio=2, first_group=0,
                        storage="sqlite:///:memory:", executor=executor,
                        pruner=optuna.pruners.MedianPruner(n_startup_trials=2))
    states = [t["state"] for t in result.trials]
    assert "FAIL" not in states and len(states) == 40
    assert executor == "local" or states.count("PRUNED") > 0  # workers report side by side
    assert result.occupancy["while_asking"] >= 0.85, result.occupancy


def test_a_dataloader_feeds_each_trial_its_own_loader():
    calls: list[int] = []

    def collate(rows: list) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(len(rows))
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    x, y = loops.data(dtype=torch.float64)
    train = torch.utils.data.TensorDataset(x[:192], y[:192])
    loader = torch.utils.data.DataLoader(train, batch_size=24, shuffle=True, collate_fn=collate)
    loop = Loop(train=loops.train, model=loops.mlp(dtype=torch.float64), steps=4,
                train_data=loader, val_data=(x[192:], y[192:]))
    assert loop.batch_size == 24  # the loader's
    space = {**SPACE, "batch_size": optuna.distributions.CategoricalDistribution([8, 24])}
    result = hydro.tune(loop, space, n_trials=4, fuse=2, ratio=2,
                        storage="sqlite:///:memory:")
    assert len(result.trials) == 4
    sizes = {t["batch_size"] for t in result.trials}
    # the collate function ran at each trial's own batch size (and 2 for capture's example)
    assert set(calls) - {2} == sizes
    task = hydro.Task(model=loops.mlp(), train_data=torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(*loops.data()), batch_size=48), val_data=loops.data(),
        steps=2)
    assert task.batch_size == 48
    assert next(task.train_batches(48, seed=0))[0].shape == (48, 8)


def test_a_training_function_that_breaks_its_contract_is_one_clear_error():
    def no_report(run: hydro.Run) -> None:
        for _ in run:
            pass

    def returns_early(run: hydro.Run) -> None:
        for step in run:
            if step == 1:
                return

    def no_loop(run: hydro.Run) -> None:
        return None

    for fn, words in ((no_report, "did not call run.report"),
                      (returns_early, "returned while trial"),
                      (no_loop, "returned before its first step")):
        with pytest.raises(ConfigError, match=words):
            hydro.tune(fn, SPACE, model=loops.mlp(), steps=4, eval_every=4,
                       example_inputs=(loops.data()[0],),
                       n_trials=2, fuse=2, ratio=2, storage="sqlite:///:memory:")
    with pytest.raises(ConfigError, match="needs the model"):
        hydro.tune(no_report, SPACE, steps=4)
    with pytest.raises(ConfigError, match="give the training steps"):
        hydro.tune(no_report, SPACE, model=loops.mlp())
    with pytest.raises(ConfigError, match="unknown option.*ratoi"):
        hydro.tune(no_report, SPACE, model=loops.mlp(), steps=2, ratoi=2)
    x = loops.data()[0]
    for option, words in (({"verify_top_k": 1}, "verify_top_k trains the full model"),
                          ({"compile": True}, "compile inside it")):
        with pytest.raises(ConfigError, match=words):  # before any trial is asked
            hydro.tune(no_report, SPACE, model=loops.mlp(), steps=2, example_inputs=(x,),
                       storage="sqlite:///:memory:", **option)
    with pytest.raises(ConfigError, match="example inputs for capture"):
        hydro.tune(no_report, SPACE, model=loops.mlp(), steps=2)


def test_a_study_created_under_the_old_ratio_default_resumes_at_its_ratio(tmp_path):
    storage = f"sqlite:///{tmp_path / 'old.db'}"
    x, y = loops.data()
    task = hydro.Task(model=loops.mlp(256), train_data=(x, y), val_data=(x, y), steps=2)
    space = {"lr": FloatDistribution(1e-3, 1e-1, log=True)}
    old = hydro.tune(task, space, n_trials=2, ratio=8, fuse=2, storage=storage)
    assert old.ratio == 8
    again = hydro.tune(task, space, n_trials=4, fuse=2, storage=storage)  # ratio: "auto"
    assert again.ratio == 8
    assert {t.user_attrs["ratio"] for t in again.study.trials} == {8}


def _config(folder: Path, extra: str = "") -> Path:
    path = folder / "tune.yaml"
    path.write_text(
        "trials: 3\nfuse: 3\nratio: 2\nfirst_group: 0\ncheckpoint_every: 2\n"
        "task:\n  model: tests.tuning.loops:mlp\n  data: tests.tuning.loops:config_data\n"
        "  train: tests.tuning.loops:slow_train\n  steps: 12\n  eval_every: 4\n"
        "  batch_size: 16\n"
        "space:\n  lr: {type: float, low: 0.001, high: 0.1, log: true}\n" + extra
    )
    return path


def _hydro(folder: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hydro.cli", "tune", str(_config(folder)), "--storage",
         f"sqlite:///{folder / 'loop.db'}", "--no-progress", *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                       **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("executor", ["inline", "local"])
def test_a_killed_run_resumes_each_trial_from_its_checkpoint(tmp_path, executor):
    marker = tmp_path / "blocked"
    proc = _hydro(tmp_path, "--executor", executor,
                  env={"HYDRO_TEST_BLOCK_AT": "7", "HYDRO_TEST_MARKER": str(marker)})
    deadline = time.monotonic() + 240 * float(os.environ.get("HYDRO_TEST_SLOW", "1"))
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never reached step 7"
        time.sleep(0.2)
    blocked = int(marker.read_text())
    os.kill(blocked, signal.SIGKILL)
    if blocked != proc.pid:
        os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    done = _hydro(tmp_path, "--executor", executor)
    out, err = done.communicate(timeout=600)
    assert done.returncode == 0, err
    study = optuna.load_study(study_name="hydro", storage=f"sqlite:///{tmp_path / 'loop.db'}")
    trials = study.trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3, err
    resumed = [t.user_attrs.get("hydro_resumed_at") for t in trials]
    # killed at step 7 with checkpoints every 2 steps: each trial lost at most 2 (a group that
    # the placement policy moved saved its trials at the move, and counts from there)
    assert all(r is not None and 7 - 2 <= r <= 7 for r in resumed), resumed


def test_both_doors_record_the_same_study(tmp_path):
    """`hydro tune CONFIG` and hydro.tune with the same task and space and no options: one
    set of defaults, so the studies record the same definition, ratio and fusion size."""
    config = tmp_path / "tune.yaml"
    config.write_text(
        "trials: 2\n"
        "task:\n  model: tests.tuning.loops:mlp\n  data: tests.tuning.loops:config_data\n"
        "  steps: 2\n  batch_size: 16\n"
        "space:\n  lr: {type: float, low: 0.001, high: 0.1, log: true}\n"
    )
    from hydro.cli import main
    from hydro.tuning.config import load

    cli = f"sqlite:///{tmp_path / 'cli.db'}"
    assert main(["tune", str(config), "--storage", cli, "--no-progress"]) == 0
    cfg = load(str(config))
    py = f"sqlite:///{tmp_path / 'py.db'}"
    hydro.tune(cfg.task, cfg.space, n_trials=2, storage=py, progress=False)
    a, b = (optuna.load_study(study_name="hydro", storage=s) for s in (cli, py))
    fp_a, fp_b = (s.user_attrs["hydro_fingerprint"]["parts"] for s in (a, b))
    fp_a["data"].pop("source")  # the config names where its data came from
    assert fp_a == fp_b
    assert a.user_attrs["hydro_fuse"]["fuse"] == b.user_attrs["hydro_fuse"]["fuse"] == "auto"
    assert {t.user_attrs["ratio"] for t in a.trials} == {t.user_attrs["ratio"] for t in b.trials}


def test_ctrl_c_stops_a_training_function_cleanly_and_puts_its_trials_back(tmp_path):
    """Ctrl-C lands while the function computes (in its own thread): the run waits for its
    iteration, unwinds it, puts the trials back to WAITING, says so and exits 130."""
    config = _config(tmp_path).read_text().replace("slow_train", "train").replace(
        "steps: 12", "steps: 100000")
    (tmp_path / "tune.yaml").write_text(config)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hydro.cli", "tune", str(tmp_path / "tune.yaml"), "--storage",
         f"sqlite:///{tmp_path / 'loop.db'}", "--no-progress"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    storage = f"sqlite:///{tmp_path / 'loop.db'}"
    deadline = time.monotonic() + 240 * float(os.environ.get("HYDRO_TEST_SLOW", "1"))
    while True:  # until the group trains: its trials RUNNING, a checkpoint written
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the group never started"
        if list(tmp_path.glob("loop.db.checkpoints/*/*")):
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err, err
    study = optuna.load_study(study_name="hydro", storage=storage)
    assert {t.state.name for t in study.trials} == {"WAITING"}

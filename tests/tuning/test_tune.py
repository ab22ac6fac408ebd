"""hydro.tune and the Optuna integration: real Optuna, real SQLite files, a real killed process."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

import hydro
from hydro.integrations.optuna import TransferSampler, optimize
from hydro.tuning.lockstep import train_group

optuna.logging.set_verbosity(optuna.logging.WARNING)
ROOT = Path(__file__).resolve().parents[2]


def make_task(steps: int = 30, **kw) -> hydro.Task:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = (x @ torch.randn(16, 5, generator=g)).argmax(-1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 5))
    kw.setdefault("eval_every", 10)
    kw.setdefault("batch_size", 32)
    kw.setdefault("loss", "cross_entropy")
    return hydro.Task(model=model, train_data=(x[:384], y[:384]), val_data=(x[384:], y[384:]),
                      steps=steps, **kw)


SPACE = {
    "lr": FloatDistribution(1e-4, 1e-1, log=True),
    "weight_decay": FloatDistribution(0.0, 0.2),
    "warmup": IntDistribution(0, 5),
}


def states(study: optuna.Study) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in study.trials:
        out[t.state.name] = out.get(t.state.name, 0) + 1
    return out


def test_tune_sqlite_export_and_resume(tmp_path):
    db = f"sqlite:///{tmp_path / 'hydro.db'}"
    task = make_task()
    result = hydro.tune(task, SPACE, n_trials=6, ratio=2, fuse=3, storage=db, seed=0)
    assert (tmp_path / "hydro.db").exists()
    assert sorted(result.best_params) == ["lr", "warmup", "weight_decay"]
    assert math.isfinite(result.best_value)
    # continuous batching: one group of 3 slots, each freed slot refilled, trains all six
    assert len(result.trials) == 6 and {r["group"] for r in result.trials} == {0}
    assert {t.user_attrs["slot"] for t in result.study.trials} == {0, 1, 2}
    best = result.best_trial
    assert best.user_attrs["ratio"] == 2 and best.user_attrs["fused"] == 3
    assert best.user_attrs["surrogate_widths"] == {"target": [64], "surrogate": [32]}
    data = result.export(tmp_path / "best.yaml")
    on_disk = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert on_disk == data
    assert on_disk["hyperparameters"] == result.best_params
    assert on_disk["provenance"]["ratio"] == 2 and on_disk["provenance"]["study"] == "hydro"
    assert on_disk["provenance"]["hydro_version"] == hydro.__version__
    # the same call again trains nothing; a larger budget trains only the difference
    values = {t.number: t.value for t in result.study.trials}
    again = hydro.tune(task, SPACE, n_trials=6, ratio=2, fuse=3, storage=db, seed=0)
    assert {t.number: t.value for t in again.study.trials} == values
    more = hydro.tune(task, SPACE, n_trials=8, ratio=2, fuse=3, storage=db, seed=0)
    assert len(more.study.trials) == 8
    assert all(more.study.trials[n].value == v for n, v in values.items())


def test_killed_run_resumes_without_retraining(tmp_path):
    """The child stops at a known point (the first two trials told, the two refilling their
    slots asked and RUNNING) and says so in a marker file; the study exists before it starts,
    so nothing races on creating it."""
    storage = f"sqlite:///{tmp_path / 'kill.db'}"
    optuna.create_study(storage=storage, study_name="hydro")
    marker = tmp_path / "stopped"
    child = [sys.executable, "-m", "tests.tuner_child", storage, "8", "--fuse", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*child, "--stop", "put:2", "--marker", str(marker)], cwd=ROOT,
                            env=env)
    try:
        while not marker.exists():
            assert proc.poll() is None, f"the tuning process ended ({proc.returncode}) early"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    study = optuna.load_study(study_name="hydro", storage=storage)
    done = {t.number: (t.params, t.value) for t in study.trials if t.state == TrialState.COMPLETE}
    running = [t for t in study.trials if t.state == TrialState.RUNNING]
    assert sorted(done) == [0, 1] and [t.number for t in running] == [2, 3]
    subprocess.run(child, cwd=ROOT, env=env, check=True, timeout=300)
    study = optuna.load_study(study_name="hydro", storage=storage)
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]
    for number, (_, value) in done.items():  # never trained twice
        assert study.trials[number].state == TrialState.COMPLETE
        assert study.trials[number].value == value
    for t in running:  # put back and taken up again: the same trial, no FAIL row
        again = study.trials[t.number]
        assert again.state == TrialState.COMPLETE and again.params == t.params
        assert again.user_attrs["hydro_interrupted"] == 1
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 8


def test_members_are_pruned_individually_and_dropped():
    task = make_task(steps=40)
    seen: dict[int, list[int]] = {}

    def report(k: int, step: int, value: float) -> bool:
        seen.setdefault(k, []).append(step)
        return k == 1 and step == 10

    params = [{"lr": 1e-2}, {"lr": 1e-2}, {"lr": 3e-3}]
    outcomes, info = train_group(task, params, ratio=2, seeds=[0, 1, 2], report=report)
    assert [o.state for o in outcomes] == ["complete", "pruned", "complete"]
    assert seen[1] == [10] and seen[0] == [10, 20, 30, 40]
    assert outcomes[1].step == 10 and outcomes[1].history == [(10, outcomes[1].value)]
    # the survivors trained on exactly as if the pruned member had never been there
    alone, _ = train_group(task, [params[0], params[2]], ratio=2, seeds=[0, 2])
    assert alone[0].value == pytest.approx(outcomes[0].value, rel=1e-5)
    assert alone[1].value == pytest.approx(outcomes[2].value, rel=1e-5)


def test_median_pruner_prunes_members_of_a_study(tmp_path):
    task = make_task(steps=40)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    study = optuna.create_study(pruner=pruner, sampler=optuna.samplers.RandomSampler(seed=1))
    optimize(study, task, SPACE, n_trials=12, ratio=2, fuse=4)
    assert states(study).get("PRUNED", 0) >= 1
    pruned = [t for t in study.trials if t.state == TrialState.PRUNED]
    assert all(t.intermediate_values for t in pruned)


def test_diverged_member_fails_with_reason_and_others_continue():
    task = make_task(steps=20)
    params = [{"lr": 1e-2}, {"lr": 1e12}, {"lr": 3e-3}]
    outcomes, _ = train_group(task, params, ratio=2, seeds=[0, 1, 2])
    assert outcomes[1].state == "fail" and "non-finite" in outcomes[1].reason
    assert outcomes[0].state == outcomes[2].state == "complete"
    alone, _ = train_group(task, [params[0], params[2]], ratio=2, seeds=[0, 2])
    assert alone[0].value == pytest.approx(outcomes[0].value, rel=1e-5)
    assert alone[1].value == pytest.approx(outcomes[2].value, rel=1e-5)


def test_batch_size_and_architecture_split_groups():
    def factory(width: int = 32) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(),
                                   torch.nn.Linear(width, 5))

    task = make_task()
    task.model = factory
    space = {"lr": FloatDistribution(1e-3, 1e-2, log=True),
             "batch_size": CategoricalDistribution([16, 32]),
             "width": CategoricalDistribution([32, 64])}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    optimize(study, task, space, n_trials=8, ratio=2, fuse=8)
    by_group: dict[int, set] = {}
    for t in study.trials:
        by_group.setdefault(t.user_attrs["group"], set()).add(
            (t.params["batch_size"], t.params["width"])
        )
    assert len(by_group) > 1 and all(len(keys) == 1 for keys in by_group.values())
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in study.trials)


@pytest.mark.parametrize(
    "sampler",
    [
        optuna.samplers.RandomSampler(seed=0),
        optuna.samplers.TPESampler(seed=0, constant_liar=True),
        optuna.samplers.CmaEsSampler(seed=0),
        optuna.samplers.QMCSampler(seed=0),
        optuna.samplers.GPSampler(seed=0),
        optuna.samplers.GridSampler({"lr": [1e-3, 1e-2], "weight_decay": [0.0, 0.1]}),
    ],
    ids=lambda s: type(s).__name__,
)
def test_any_sampler(sampler):
    space = {"lr": FloatDistribution(1e-4, 1e-1, log=True),
             "weight_decay": FloatDistribution(0.0, 0.2)}
    study = optuna.create_study(sampler=sampler)
    optimize(study, make_task(steps=10), space, n_trials=4, ratio=2, fuse=2)
    assert len(study.trials) == 4
    assert all(t.state == TrialState.COMPLETE for t in study.trials)


def test_group_callback_for_your_own_loop():
    def evaluate(trials):
        out = []
        for t in trials:
            x = t.suggest_float("x", -2, 2)
            if x > 1.5:
                out.append(optuna.TrialPruned())
            elif x < -1.5:
                out.append(RuntimeError("exploded"))
            else:
                out.append((x - 0.5) ** 2)
        return out

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    optimize(study, evaluate, n_trials=30, fuse=5)
    s = states(study)
    assert sum(s.values()) == 30 and s.get("RUNNING", 0) == 0
    assert s.get("PRUNED", 0) and s.get("FAIL", 0)
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    assert all(t.user_attrs["fail_reason"] == "RuntimeError: exploded" for t in failed)


def test_a_crashing_group_leaves_no_trial_running():
    def evaluate(trials):
        raise ValueError("user code broke")

    study = optuna.create_study()
    with pytest.raises(ValueError, match="user code broke"):
        optimize(study, evaluate, n_trials=4, fuse=4)
    assert states(study) == {"FAIL": 4}
    assert all("user code broke" in t.user_attrs["fail_reason"] for t in study.trials)


def test_transfer_sampler_replays_the_best_first():
    source = optuna.create_study()
    source.optimize(lambda t: (t.suggest_float("lr", 1e-4, 1e-1, log=True) - 0.01) ** 2,
                    n_trials=15)
    ranked = sorted((t for t in source.trials), key=lambda t: t.value)
    full = optuna.create_study(sampler=TransferSampler(source, top_k=3))
    full.optimize(lambda t: t.suggest_float("lr", 1e-4, 1e-1, log=True), n_trials=5)
    assert [t.params for t in full.trials[:3]] == [t.params for t in ranked[:3]]


def test_verify_top_k_trains_the_full_model():
    task = make_task(steps=20)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    optimize(study, task, SPACE, n_trials=4, ratio=2, fuse=4)
    report = hydro.tuning.verify(task, study, 3)
    assert len(report["configs"]) == 3
    assert report["winner"] in {c["trial"] for c in report["configs"]}
    assert all(math.isfinite(c["full_value"]) for c in report["configs"])
    assert -1.0 <= report["spearman"] <= 1.0


def test_errors_are_clear(tmp_path):
    task = make_task()
    with pytest.raises(hydro.ConfigError, match=r"unknown hyperparameter 'learning_rate'.*Known: "):
        hydro.tune(task, {"learning_rate": FloatDistribution(1e-3, 1e-1)}, n_trials=1,
                   storage=f"sqlite:///{tmp_path / 'a.db'}")
    with pytest.raises(hydro.ConfigError, match="not an Optuna distribution"):
        hydro.tune(task, {"lr": (1e-3, 1e-1)}, n_trials=1)
    with pytest.raises(
        hydro.StorageError, match=r"cannot open Optuna storage 'sqlite:////nonexistent"
    ):
        hydro.tune(task, SPACE, n_trials=1, storage="sqlite:////nonexistent/dir/x.db")
    with pytest.raises(hydro.ConfigError, match="unknown loss 'hinge'"):
        make_task(loss="hinge")
    with pytest.raises(hydro.ConfigError, match="direction"):
        optimize(optuna.create_study(direction="maximize"), task, SPACE, n_trials=1)
    with pytest.raises(hydro.ConfigError, match="warmup 40 must be shorter than steps"):
        train_group(make_task(steps=30), [{"warmup": 40}], ratio=2, seeds=[0])


class PruneOdd(optuna.pruners.BasePruner):
    """Prunes odd-numbered trials at their first report: a pruner whose answer is known."""

    def prune(self, study, trial):
        return trial.number % 2 == 1


def test_groups_train_in_local_worker_processes_and_prune_there():
    from hydro_fluid import LocalExecutor

    study = optuna.create_study(pruner=PruneOdd(), sampler=optuna.samplers.RandomSampler(seed=0))
    executor = LocalExecutor(devices=[], num_workers=2)
    optimize(study, make_task(steps=40), SPACE, n_trials=4, ratio=2, fuse=2, executor=executor)
    # the parent's pruner decides; the worker drops the member and trains the others on
    assert [t.state.name for t in study.trials] == ["COMPLETE", "PRUNED"] * 2
    assert all(max(t.intermediate_values) < 40 for t in study.trials[1::2])
    assert all(max(t.intermediate_values) == 40 for t in study.trials[::2])
    pids = {t.user_attrs["worker_pid"] for t in study.trials}
    assert os.getpid() not in pids and len({t.user_attrs["group"] for t in study.trials}) == 2


def test_output_multiplier_is_a_per_trial_hyperparameter():
    task = make_task(steps=10)
    params = [{"output_mult": 1.0}, {"output_mult": 0.25}, {"output_mult": 4.0}]
    for ratio in (1, 2):
        outcomes, _ = train_group(task, params, ratio=ratio, seeds=[0, 0, 0])
        values = [o.value for o in outcomes]
        assert all(math.isfinite(v) for v in values)
        assert len(set(values)) == 3  # same init and data: only the multiplier differs
    # a multiplier of 1 is the model itself, exactly
    plain, _ = train_group(task, [{}], ratio=1, seeds=[0])
    one, _ = train_group(task, [{"output_mult": 1.0}], ratio=1, seeds=[0])
    assert plain[0].value == one[0].value


def test_groups_train_on_a_local_ray_cluster():
    ray = pytest.importorskip("ray")
    from hydro_fluid import RayExecutor
    from hydro_fluid.executors.ray import _init_ray

    _init_ray(ray, None, {"num_cpus": 2, "num_gpus": 2})  # a new local Ray, on 127.0.0.1
    try:
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        optimize(study, make_task(steps=20), SPACE, n_trials=4, ratio=2, fuse=2,
                 executor=RayExecutor())
        assert states(study) == {"COMPLETE": 4}
        assert os.getpid() not in {t.user_attrs["worker_pid"] for t in study.trials}
    finally:
        ray.shutdown()


def test_first_group_trains_alone_so_the_median_pruner_can_act():
    """``first_group=3``: trials 0-2 form a group of their own and complete before any other
    trial is asked; later groups are full, and a MedianPruner that needs 3 completed trials
    can prune in them. Without it, the first fused group has no trial to compare against."""
    task = make_task(steps=20, eval_every=5)
    space = {"lr": FloatDistribution(1e-4, 1e-1, log=True)}
    pruned, runs = {}, {}
    for first in (0, 3, "auto"):  # "auto", the default: the pruner's n_startup_trials, 3
        study = optuna.create_study(
            sampler=optuna.samplers.RandomSampler(seed=0),
            pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=0),
        )
        kw = {} if first == "auto" else {"first_group": first}
        optimize(study, task, space, 10, ratio=2, fuse=5, **kw)
        trials = sorted(study.trials, key=lambda t: t.number)
        groups = [t.user_attrs["group"] for t in trials]
        if first:
            assert groups[:3] == [0, 0, 0] and 0 not in groups[3:]
            assert all(t.state == TrialState.COMPLETE for t in trials[:3])
            done = max(t.datetime_complete for t in trials[:3])
            assert all(t.datetime_start >= done for t in trials[3:])
        pruned[first] = [t.number for t in trials if t.state == TrialState.PRUNED]
        runs[first] = [(t.state, t.value, t.intermediate_values, t.user_attrs["group"])
                       for t in trials]
    assert not any(n < 5 for n in pruned[0])  # the first fused group of 5: nothing to compare
    assert pruned[3], "with a first group of 3 the pruner acts on later trials"
    assert runs["auto"] == runs[3]  # the default is that first group, trial for trial


def test_auto_first_group_follows_the_pruners_start_up():
    """``first_group="auto"``: a pruner that waits for completed trials gets its start-up as
    a first group when that is below ``fuse``, on the CPU only; other pruners get none."""
    from hydro.tuning.engine import auto_first_group

    P = optuna.pruners
    assert auto_first_group(P.MedianPruner(), 16) == 5
    assert auto_first_group(P.PercentilePruner(25.0, n_startup_trials=3), 16) == 3
    assert auto_first_group(P.PatientPruner(P.MedianPruner(n_startup_trials=2), 1), 16) == 2
    assert auto_first_group(P.MedianPruner(n_startup_trials=0), 16) == 1  # needs one complete
    assert auto_first_group(P.MedianPruner(), 5) == 0  # the first cohort is the first group
    assert auto_first_group(P.MedianPruner(), 16, device="cuda") == 0  # empty slots cost there
    for other in (P.SuccessiveHalvingPruner(), P.HyperbandPruner(), P.NopPruner(),
                  P.ThresholdPruner(upper=1.0), P.PatientPruner(None, 1)):
        assert auto_first_group(other, 16) == 0, other


def test_first_group_is_checked_and_refused_with_an_executor():
    task, study = make_task(steps=4), optuna.create_study()
    with pytest.raises(hydro.errors.ConfigError, match="first_group must be an integer from 0"):
        optimize(study, task, {"lr": FloatDistribution(1e-3, 1e-1)}, 2, fuse=2, first_group=3)
    with pytest.raises(hydro.errors.ConfigError, match="or 'auto', got 'all'"):
        optimize(study, task, {"lr": FloatDistribution(1e-3, 1e-1)}, 2, fuse=2, first_group="all")
    with pytest.raises(hydro.errors.ConfigError, match="with an executor every other slot"):
        optimize(study, task, {"lr": FloatDistribution(1e-3, 1e-1)}, 2, fuse=2, first_group=1,
                 executor=object())

"""What an Optuna user reaches for (issue 20, point 5): ``timeout``, ``callbacks`` and ``catch``
as ``study.optimize`` takes them, a multi-objective study refused in one line, interrupted
trials put back in Optuna's queue (WAITING, never FAIL) and resumed with their own number, the
``hydro tune`` flags, the report's columns and the packaging's ``py.typed``. Real Optuna, real
SQLite files in ``tmp_path``, tiny models."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import FrozenTrial, TrialState

import hydro
from hydro.cli import main
from hydro.errors import ConfigError, UserCodeError
from tests.cli.test_commands import CONFIG, TOY
from tests.tuner_child import SPACE, make_task

optuna.logging.set_verbosity(optuna.logging.WARNING)
ROOT = Path(__file__).resolve().parents[2]
NOP = optuna.pruners.NopPruner


def _states(study: optuna.Study) -> list[str]:
    return [t.state.name for t in study.get_trials(deepcopy=False)]


def test_timeout_stops_asking_the_running_trials_finish_and_a_rerun_goes_on(tmp_path):
    db = f"sqlite:///{tmp_path / 't.db'}"
    seen: list[FrozenTrial] = []

    def slow(study: optuna.Study, trial: FrozenTrial) -> None:
        seen.append(trial)
        if trial.number == 0:  # past the timeout before a freed slot asks the next trial: the
            # run started before trial 0 was asked
            asked = trial.datetime_start.timestamp()
            time.sleep(max(0.0, asked + 2.05 - time.time()))

    task = make_task(2)
    hydro.tune(task, SPACE, n_trials=6, ratio=2, fuse=2, storage=db, seed=0, pruner=NOP(),
               timeout=2, callbacks=[slow])
    study = optuna.load_study(study_name="hydro", storage=db)
    # the two trials asked before the timeout ran to their end; nothing was asked after it
    assert _states(study) == ["COMPLETE", "COMPLETE"]
    assert [t.number for t in seen] == [0, 1]
    assert all(isinstance(t, FrozenTrial) and t.state == TrialState.COMPLETE for t in seen)
    assert [t.value for t in seen] == [t.value for t in study.trials]
    # the same call without the timeout finishes the study: once per trial, in this process
    hydro.tune(task, SPACE, n_trials=6, ratio=2, fuse=2, storage=db, seed=0, pruner=NOP(),
               callbacks=[lambda s, t: seen.append(t)])
    assert _states(study) == ["COMPLETE"] * 6
    assert sorted(t.number for t in seen) == list(range(6))


def test_bad_timeout_catch_and_callbacks_are_one_line_config_errors():
    task = make_task(2)
    study = optuna.create_study()
    for kw, said in [({"timeout": 0}, "timeout must be a number of seconds above 0"),
                     ({"catch": ("ValueError",)}, "catch must hold exception classes"),
                     ({"callbacks": [3]}, "callbacks must be callables")]:
        with pytest.raises(ConfigError, match=said):
            hydro.tune(task, SPACE, n_trials=2, ratio=2, fuse=2, study=study, **kw)
    assert study.trials == []


class RaisingLoss:
    """Cross-entropy that raises ``kind`` on every training batch (the model's check runs a
    batch of 2, which passes)."""

    def __init__(self, kind: type[Exception]) -> None:
        self.kind = kind

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if len(y) > 2:
            raise self.kind("flaky data")
        return torch.nn.functional.cross_entropy(out, y)


def _raising_task(kind: type[Exception]) -> hydro.Task:
    base = make_task(2)
    return hydro.Task(model=base.model, train_data=base.train_data, val_data=base.val_data,
                      steps=2, eval_every=1, batch_size=32, loss=RaisingLoss(kind))


def test_catch_fails_its_exceptions_trials_and_goes_on_where_others_stop_the_run():
    # without catch, every trial failing alike stops the run after 3 groups (hydro's faults)
    study = optuna.create_study()
    with pytest.raises(UserCodeError, match="every trial of this run failed this way"):
        hydro.tune(_raising_task(ValueError), SPACE, n_trials=10, ratio=2, fuse=2, study=study)
    assert _states(study) == ["FAIL"] * 6
    # catch names another type: the same
    study = optuna.create_study()
    with pytest.raises(UserCodeError):
        hydro.tune(_raising_task(ValueError), SPACE, n_trials=10, ratio=2, fuse=2, study=study,
                   catch=(KeyError,))
    assert _states(study) == ["FAIL"] * 6
    # catch=(ValueError,) (a subclass raised): expected failures, the run uses its budget
    failed: list[FrozenTrial] = []
    study = optuna.create_study()
    hydro.tune(_raising_task(UnicodeError), SPACE, n_trials=10, ratio=2, fuse=2, study=study,
               catch=(ValueError,), callbacks=[lambda s, t: failed.append(t)])
    assert _states(study) == ["FAIL"] * 10
    assert sorted(t.number for t in failed) == list(range(10))
    assert all(t.state == TrialState.FAIL and "raised UnicodeError: flaky data"
               in t.user_attrs["fail_reason"] for t in failed)


def test_a_callback_that_raises_stops_the_run_and_the_trial_in_flight_resumes(tmp_path):
    db = f"sqlite:///{tmp_path / 'c.db'}"

    def boom(study: optuna.Study, trial: FrozenTrial) -> None:
        if trial.number == 0:
            raise RuntimeError("callback says stop")

    task = make_task(2)
    kw = {"n_trials": 4, "ratio": 2, "fuse": 2, "storage": db, "seed": 0, "pruner": NOP()}
    with pytest.raises(RuntimeError, match="callback says stop"):
        hydro.tune(task, SPACE, callbacks=[boom], **kw)
    study = optuna.load_study(study_name="hydro", storage=db)
    # trial 0 is told; trial 1, still training, was not at fault: back in the queue
    assert _states(study) == ["COMPLETE", "WAITING"]
    assert study.get_trials(states=(TrialState.FAIL, TrialState.RUNNING)) == []
    hydro.tune(task, SPACE, **kw)
    assert _states(study) == ["COMPLETE"] * 4


def test_a_multi_objective_study_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    task = make_task(2)
    two = optuna.create_study(directions=["minimize", "maximize"])
    with pytest.raises(ConfigError, match=r"has 2 objectives \(minimize, maximize\): Hydro "
                       "tunes one value"):
        hydro.tune(task, SPACE, n_trials=2, ratio=2, fuse=2, study=two)
    db = f"sqlite:///{tmp_path / 'toy.db'}"
    optuna.create_study(study_name="toy", storage=db, directions=["minimize", "minimize"])
    with pytest.raises(ConfigError, match="has 2 objectives"):
        hydro.tune(task, SPACE, n_trials=2, ratio=2, fuse=2, study="toy", storage=db)
    # the CLI: exit 2, one line, no traceback
    (tmp_path / "toymod.py").write_text(TOY)
    (tmp_path / "tune.yaml").write_text(CONFIG)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "toymod", raising=False)
    assert main(["tune", "tune.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("hydro tune: error: study 'toy' has 2 objectives "
                                          "(minimize, minimize)"), err
    assert "Traceback" not in err
    assert optuna.load_study(study_name="toy", storage=db).trials == []


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "toymod.py").write_text(TOY)
    (tmp_path / "tune.yaml").write_text(CONFIG.replace("  eval_every: 5", "  eval_every: 2"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "toymod", raising=False)
    return tmp_path


def _study(name: str = "toy") -> optuna.Study:
    return optuna.load_study(study_name=name, storage="sqlite:///toy.db")


def test_cli_sampler_seed_steps_and_pruner_flags_take_effect(project, capsys):
    common = ["--trials", "2", "--sampler", "random", "--pruner", "none"]
    assert main(["tune", "tune.yaml", "--study", "a", *common, "--seed", "1", "--steps", "4"]) == 0
    assert main(["tune", "tune.yaml", "--study", "b", *common, "--seed", "1", "--steps", "4"]) == 0
    assert main(["tune", "tune.yaml", "--study", "c", *common, "--seed", "2"]) == 0
    a, b, c = _study("a"), _study("b"), _study("c")
    # --sampler random --seed 1 twice: the same draws; --seed 2: others
    assert [t.params for t in a.trials] == [t.params for t in b.trials]
    assert [t.params for t in c.trials] != [t.params for t in a.trials]
    # --steps 4 (the config says 10) with eval_every 2: values at steps 2 and 4, no further
    assert all(sorted(t.intermediate_values) == [2, 4] for t in a.trials)
    assert a.user_attrs["hydro_task"]["steps"] == 4
    assert all(max(t.intermediate_values) == 10 for t in c.trials)  # no flag: the config's
    err = capsys.readouterr().err
    assert "study 'a' in sqlite:///toy.db: new, 2 trials to finish" in err


def test_cli_timeout_and_first_group(project, capsys, monkeypatch):
    # --first-group 1: trial 0 trains alone, to the end, before the group of 2 starts
    assert main(["tune", "tune.yaml", "--first-group", "1", "--trials", "3"]) == 0
    trials = _study().trials
    assert trials[0].datetime_complete <= min(t.datetime_start for t in trials[1:])
    # --timeout: a tiny one asks nothing new, and the header counts what is there
    assert main(["tune", "tune.yaml", "--trials", "6", "--timeout", "0.001"]) == 0
    assert len(_study().trials) == 3
    err = capsys.readouterr().err
    assert "resuming study 'toy' in sqlite:///toy.db: 3 finished (3 complete, 0 pruned), " \
        "3 to go" in err


def test_config_first_group_is_auto_unless_given(project):
    from hydro.tuning import config

    text = (project / "tune.yaml").read_text()
    assert config.load("tune.yaml").first_group == "auto"  # no key: the pruner's start-up
    for value, want in (("auto", "auto"), ("0", 0), ("2", 2)):
        (project / "tune.yaml").write_text(f"{text}\nfirst_group: {value}\n")
        assert config.load("tune.yaml").first_group == want
    for bad in ("some", "-1", "true"):
        (project / "tune.yaml").write_text(f"{text}\nfirst_group: {bad}\n")
        with pytest.raises(ConfigError, match="first_group must be auto or an integer >= 0"):
            config.load("tune.yaml")


@pytest.mark.parametrize(
    "flags, said",
    [
        (
            ["--sampler", "bayes"],
            "--sampler 'bayes' is unknown; use one of cmaes, gp, grid, qmc, random, tpe",
        ),
        (
            ["--pruner", "early"],
            "--pruner 'early' is unknown; use one of asha, hyperband, "
            "median, none, successive-halving, "
            "successive_halving",
        ),
        (
            ["--sampler", "grid"],
            "--sampler 'grid' needs categorical distributions; space.lr is not one",
        ),
        (["--timeout", "-1"], "tune.yaml: timeout must be a number of seconds above 0"),
        (["--first-group", "5"], "first_group (5) must not exceed fuse (2)"),
    ],
)
def test_cli_bad_flags_exit_2_with_one_line(project, capsys, flags, said):
    assert main(["tune", "tune.yaml", *flags]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == f"hydro tune: error: {said}" or said in err.splitlines()[0], err
    assert "Traceback" not in err


def test_an_interrupted_run_leaves_no_fail_row_and_the_next_resumes_the_same_trials(
    project, capsys
):
    def ctrl_c(study: optuna.Study, trial: FrozenTrial) -> None:
        if trial.number == 0:
            raise KeyboardInterrupt

    from hydro.tuning import config
    from hydro.tuning.report import trial_counts

    cfg = config.load("tune.yaml", fuse=3)
    with pytest.raises(KeyboardInterrupt):
        hydro.tune(cfg.task, cfg.space, n_trials=5, ratio=2, fuse=3, study="toy",
                   storage="sqlite:///toy.db", pruner=NOP(), callbacks=[ctrl_c])
    study = _study()
    # trial 0 told; 1 and 2, still training, back in Optuna's queue: no FAIL row
    assert _states(study) == ["COMPLETE", "WAITING", "WAITING"]
    assert study.get_trials(states=(TrialState.FAIL, TrialState.RUNNING)) == []
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert all(t.user_attrs["hydro_interrupted"] == 1 and t.params for t in waiting)
    params = {t.number: t.params for t in waiting}
    counts = trial_counts(study)  # the report's and the export's: interrupted apart
    assert (counts["complete"], counts["failed"], counts["interrupted"]) == (1, 0, 2)
    capsys.readouterr()
    assert main(["tune", "tune.yaml", "--trials", "5", "--fuse", "3", "--pruner", "none"]) == 0
    err = capsys.readouterr().err
    assert "resuming study 'toy' in sqlite:///toy.db: 1 finished (1 complete, 0 pruned), " \
        "2 interrupted (resumed first), 4 to go" in err, err
    study = _study()
    assert _states(study) == ["COMPLETE"] * 5  # the same numbers resumed, no extra row
    assert {n: study.trials[n].params for n in params} == params


def test_the_html_report_has_a_column_per_hyperparameter():
    from hydro.tuning.report import trials_table

    study = optuna.create_study()
    dists = {
        "lr": optuna.distributions.FloatDistribution(1e-5, 1.0, log=True),
        "act": optuna.distributions.CategoricalDistribution(["relu", "gelu"]),
    }
    study.add_trial(optuna.trial.create_trial(params={"lr": 0.0123456, "act": "gelu"},
                                              distributions=dists, value=0.5))
    study.add_trial(optuna.trial.create_trial(params={"lr": 3e-4}, value=0.7,
                                              distributions={"lr": dists["lr"]}))
    table = trials_table(study)  # write_report's page holds this table
    assert "<th>value</th><th>act</th><th>lr</th><th>fail reason</th>" in table
    assert "<td>0.5</td><td>gelu</td><td>0.01235</td>" in table
    assert "<td>0.7</td><td></td><td>0.0003</td>" in table
    assert "{" not in table  # no Python dict in a cell


def test_a_trial_put_back_or_taken_up_elsewhere_is_not_told_by_its_old_owner():
    """A live process taken for dead (no heartbeat seen) ends its trial after another process
    put it back, or took it up: its tell is dropped instead of raising or overwriting."""
    from hydro.tuning.bookkeeping import _me, put_back, tell
    from hydro.tuning.group import Outcome

    study = optuna.create_study()
    done = Outcome("complete", 1.0, 1, "")
    for other in ("waiting", "taken"):
        t = study.ask()
        t.set_user_attr("hydro_owner", _me())
        assert put_back(study, t._trial_id, owner=_me())
        if other == "taken":
            again = study.ask()
            assert again.number == t.number
            again.set_user_attr("hydro_owner", {**_me(), "pid": -1})
        assert not tell(study, t, done, None)
        assert study.trials[t.number].state == (TrialState.WAITING if other == "waiting"
                                                else TrialState.RUNNING)
        if other == "taken":
            study.tell(again, 2.0)
    t = study.ask()
    t.set_user_attr("hydro_owner", _me())
    assert tell(study, t, done, None) and study.trials[t.number].value == 1.0


def test_catch_matches_a_workers_exception_by_its_class_name():
    from hydro.tuning.faults import Faults

    what = "loss 'mymod:loss' raised UnicodeError: bad byte at mymod.py:3"
    assert Faults((UnicodeError, KeyError)).caught(what)
    assert Faults((Exception,)).caught(what)  # every user exception
    assert not Faults((KeyError,)).caught(what)
    assert not Faults((ValueError,)).caught(what)  # a base class: matched in process only
    assert not Faults().caught(what)


def test_py_typed_ships_with_both_packages():
    from setuptools.config.setupcfg import read_configuration

    options = read_configuration(str(ROOT / "setup.cfg"))["options"]
    for package in ("hydro", "hydro_fluid"):
        assert "py.typed" in options["package_data"][package]
        assert (ROOT / package / "py.typed").is_file()
    extras = options["extras_require"]
    assert any(r.startswith("optuna-dashboard") for r in extras["dashboard"])


def test_cli_first_group_takes_auto_or_a_count(capsys):
    from hydro.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["tune", "tune.yaml", "--first-group", "auto"]).first_group == "auto"
    assert parse(["tune", "tune.yaml", "--first-group", "3"]).first_group == 3
    assert parse(["tune", "tune.yaml"]).first_group is None  # the config's (auto by default)
    for bad in ("some", "-1"):
        with pytest.raises(SystemExit) as exc:
            parse(["tune", "tune.yaml", "--first-group", bad])
        assert exc.value.code == 2
        assert f"must be an integer >= 0, got {bad!r}" in capsys.readouterr().err

"""The check on the full model: its fused ratio-1 group trains each configuration as it would
alone, ``verify_steps`` shortens it, and the export follows its winner with both rankings."""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import FloatDistribution, IntDistribution

import hydro
from hydro.errors import ConfigError
from hydro.tuning import config as config_module
from hydro.tuning import lockstep
from hydro.tuning.bookkeeping import trial_seed
from hydro.tuning.options import TuneOptions
from hydro.tuning.outputs import TuneResult, export_data
from hydro.tuning.space import trained_params
from hydro.tuning.verification import CHECK, SURROGATE, check_params, verify
from tests import toy

optuna.logging.set_verbosity(optuna.logging.WARNING)
SPACE = {"lr": FloatDistribution(1e-4, 1e-1, log=True), "warmup": IntDistribution(0, 4)}


def float64_task(steps: int = 12, **kw) -> hydro.Task:
    """:func:`tests.toy.task`'s MLP and data in float64, so "equal" can mean to 1e-12."""
    d = toy.data(256, 192)
    x, y = d["train"]
    vx, vy = d["val"]
    return hydro.Task(model=toy.model(32).double(), train_data=(x.double(), y),
                      val_data=(vx.double(), vy), loss="cross_entropy", batch_size=16,
                      steps=steps, eval_every=kw.pop("eval_every", 4), **kw)


def searched(task: hydro.Task, n: int = 6) -> optuna.Study:
    """A study of ``n`` trials of ``task`` on ratio-2 surrogates, none pruned."""
    result = hydro.tune(task, SPACE, n_trials=n, ratio=2, fuse=n, storage="sqlite:///:memory:",
                        pruner=optuna.pruners.NopPruner(), progress=False,
                        sampler=optuna.samplers.RandomSampler(seed=0))
    return result.study


def by_hand(values: dict[float, float]) -> optuna.Study:
    """A study whose complete trials have the learning rates and surrogate values given (in
    order, trial 0 first): the tests decide what the surrogate ranked first."""
    study = optuna.create_study()
    study.set_user_attr("hydro_task", {"optimizer": "adamw", "scheduler": "cosine", "steps": 30,
                                       "batch_size": 16, "eval_every": 30,
                                       "loss": "cross_entropy", "direction": "minimize"})
    for lr, value in values.items():
        study.add_trial(optuna.trial.create_trial(
            params={"lr": lr}, distributions={"lr": SPACE["lr"]}, value=value,
            user_attrs={"ratio": 2}))
    return study


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch) -> list[tuple[hydro.Task, list[dict], int]]:
    """Every call the check makes to ``train_group``: its task, its members and its ratio."""
    calls: list[tuple[hydro.Task, list[dict], int]] = []
    real = lockstep.train_group

    def spy(task, params, **kw):
        calls.append((task, [dict(p) for p in params], kw["ratio"]))
        return real(task, params, **kw)

    monkeypatch.setattr(lockstep, "train_group", spy)
    return calls


def test_the_fused_check_equals_each_configuration_trained_alone_on_the_full_model(groups):
    task = float64_task()
    study = searched(task)
    v = verify(task, study, 3)
    assert len(groups) == 1 and groups[0][2] == 1 and len(groups[0][1]) == 3  # one fused group
    top = sorted(study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)),
                 key=lambda t: t.value)[:3]
    assert [c["trial"] for c in v["configs"]] == [t.number for t in top]
    for c, t in zip(v["configs"], top):
        (alone,), _ = lockstep.train_group(task, [trained_params(t)], ratio=1,
                                           seeds=[trial_seed(t, 0)])
        assert alone.state == "complete"
        assert c["full_value"] == pytest.approx(alone.value, rel=1e-12, abs=1e-12)
        assert c["surrogate_value"] == t.value
    # the full values are the full model's, not the surrogates'
    assert [c["full_value"] for c in v["configs"]] != [c["surrogate_value"] for c in v["configs"]]


def test_verify_steps_shortens_the_check(groups):
    task = float64_task(steps=12)
    study = searched(task, n=4)
    full = verify(task, study, 2)
    short = verify(task, study, 2, steps=4)
    assert (full["steps"], short["steps"]) == (12, 4)
    (t_full, _, _), (t_short, members, _) = groups
    assert (t_full.steps, t_short.steps, t_short.eval_every) == (12, 4, 4)
    assert task.steps == 12  # the task itself is left as it was
    assert [c["trial"] for c in short["configs"]] == [c["trial"] for c in full["configs"]]
    assert all(a["full_value"] != b["full_value"]
               for a, b in zip(full["configs"], short["configs"]))
    # a searched warm-up shrinks with the schedule, shorter than the check
    for m, c in zip(members, short["configs"]):
        assert m["warmup"] == min(round(c["params"]["warmup"] * 4 / 12), 3)
        assert m["lr"] == c["params"]["lr"]
        assert c["params"] == trained_params(study.trials[c["trial"]])  # recorded as searched


def test_a_shrunk_warmup_stays_shorter_than_the_check():
    assert check_params({"lr": 0.1, "warmup": 40}, 10, 50) == {"lr": 0.1, "warmup": 8}
    assert check_params({"lr": 0.1, "warmup": 49}, 2, 50) == {"lr": 0.1, "warmup": 1}
    assert check_params({"lr": 0.1, "warmup": 40}, 50, 50) == {"lr": 0.1, "warmup": 40}
    assert check_params({"lr": 0.1}, 5, 50) == {"lr": 0.1}


@pytest.mark.parametrize("scheduler", ["cosine", "linear", "step", "none"])
def test_a_one_step_check_trains_under_every_schedule(scheduler):
    """``verify_steps=1`` is allowed, so a schedule of one step must build (its decay spans
    at least one step) and train."""
    task = toy.task(steps=30, eval_every=30, scheduler=scheduler)
    v = verify(task, by_hand({3e-3: 0.10, 5e-2: 0.20}), 2, steps=1)
    assert v["steps"] == 1 and all(c["full_value"] is not None for c in v["configs"])


def test_seed_replicas_are_one_candidate_ranked_by_their_mean(groups):
    """Trials 0 and 3 are one configuration (a replica, as ``replicas`` adds): the check trains
    the top 2 configurations once each, ranked by their mean over seeds, not 0 and its copy."""
    study = by_hand({3e-3: 0.10, 5e-2: 0.12, 1e-4: 0.30})
    study.add_trial(optuna.trial.create_trial(  # trial 3: the first configuration, another seed
        params={"lr": 3e-3}, distributions={"lr": SPACE["lr"]}, value=0.16,
        user_attrs={"ratio": 2, "hydro_replica_of": 0}))
    v = verify(toy.task(steps=30, eval_every=30), study, 2)
    assert len(groups) == 1 and len(groups[0][1]) == 2
    assert [c["trial"] for c in v["configs"]] == [1, 0]  # 0.12 before the mean 0.13
    assert [c["surrogate_value"] for c in v["configs"]] == [0.12, pytest.approx(0.13)]
    assert v["surrogate_best"] == 1
    assert sorted(m["lr"] for m in groups[0][1]) == [3e-3, 5e-2]


def test_the_export_follows_the_full_models_winner_and_keeps_both_rankings(tmp_path):
    task = toy.task(steps=30, eval_every=30)
    # the surrogate ranks a learning rate that barely trains first, a good one last
    study = by_hand({1e-4: 0.10, 3e-3: 0.20, 5e-2: 0.30})
    v = verify(task, study, 3)
    assert v["surrogate_best"] == 0 and v["winner"] == 2 and v["agrees"] is False
    assert [c["surrogate_rank"] for c in v["configs"]] == [1, 2, 3]
    assert [c["full_rank"] for c in v["configs"]] == [3, 2, 1]
    assert v["spearman"] == pytest.approx(-1.0)
    data = export_data(study, v)
    prov = data["provenance"]
    assert data["hyperparameters"] == {"lr": 5e-2}
    assert data["training"]["optimizer_args"]["lr"] == 5e-2
    assert (prov["chosen_by"], prov["trial"], prov["surrogate_value"]) == (CHECK, 2, 0.30)
    assert prov["surrogate_best"] == {"trial": 0, "surrogate_value": 0.10,
                                      "hyperparameters": {"lr": 1e-4}}
    assert data["verification"]["configs"][2]["full_rank"] == 1
    result = TuneResult(study, 2, verification=v)
    assert result.best_params == {"lr": 1e-4}  # Optuna's best trial: the surrogate's
    assert result.chosen_params == {"lr": 5e-2}  # what the export gives
    path = tmp_path / "best.yaml"
    result.export(path)
    recipe = hydro.recipe(str(path), toy.model())  # hydro.recipe reads it as any export
    assert recipe.training["optimizer_args"]["lr"] == 5e-2


def test_a_check_that_agrees_with_the_surrogate_says_so():
    task = toy.task(steps=30, eval_every=30)
    study = by_hand({5e-2: 0.10, 1e-4: 0.20})
    v = verify(task, study, 2)
    assert (v["winner"], v["surrogate_best"], v["agrees"]) == (0, 0, True)
    data = export_data(study, v)
    prov = data["provenance"]
    assert prov["chosen_by"] == CHECK and prov["trial"] == 0
    assert prov["surrogate_best"]["trial"] == prov["trial"]
    assert data["hyperparameters"] == prov["surrogate_best"]["hyperparameters"] == {"lr": 5e-2}
    # without a check the surrogate chose, and nothing else is claimed
    plain = export_data(study)
    assert plain["provenance"]["chosen_by"] == SURROGATE
    assert "surrogate_best" not in plain["provenance"] and "verification" not in plain
    assert TuneResult(study, 2).chosen_params == TuneResult(study, 2).best_params


@pytest.mark.parametrize("bad, words", [
    (0, "verify_steps must be a positive number of steps, got 0"),
    (-3, "verify_steps must be a positive number of steps, got -3"),
    (2.5, "verify_steps must be a positive number of steps, got 2.5"),
])
def test_verify_steps_below_one_is_refused_naming_it(bad, words):
    with pytest.raises(ConfigError, match=words):
        TuneOptions(verify_steps=bad).validate()
    with pytest.raises(ConfigError, match=words):
        verify(toy.task(steps=4), by_hand({1e-2: 0.1}), 1, steps=bad)


def test_verify_steps_beyond_the_tasks_steps_is_refused_before_the_search(tmp_path):
    task = toy.task(steps=10)
    storage = f"sqlite:///{tmp_path / 's.db'}"
    with pytest.raises(ConfigError, match=r"verify_steps 11 is more than the task's steps \(10\)"):
        hydro.tune(task, SPACE, n_trials=2, ratio=2, verify_top_k=2, verify_steps=11,
                   storage=storage, progress=False)
    # refused with the options: no study was created, nothing trained
    assert not (tmp_path / "s.db").exists() or optuna.get_all_study_names(storage) == []
    with pytest.raises(ConfigError, match="verify_top_k must be a positive integer to check"):
        verify(task, by_hand({1e-2: 0.1}), 0)


def test_verify_steps_is_a_config_key_and_a_flag(tmp_path, monkeypatch):
    from hydro.cli import build_parser

    toy.project(tmp_path, monkeypatch, "vmodel", toy.source(),
                toy.config("vmodel", top="verify_top_k: 2\nverify_steps: 0\n", steps=4))
    with pytest.raises(ConfigError, match=r"tune.yaml: verify_steps must be a positive"):
        config_module.load("tune.yaml")
    (tmp_path / "tune.yaml").write_text(toy.config("vmodel", steps=4,
                                                   top="verify_top_k: 2\nverify_steps: 2\n"))
    assert config_module.load("tune.yaml").options().verify_steps == 2
    args = build_parser().parse_args(["tune", "tune.yaml", "--verify-steps", "3"])
    assert args.verify_steps == 3


def test_hydro_tune_checks_and_exports_the_checks_choice(tmp_path, monkeypatch, capsys):
    import yaml

    from hydro.cli import main

    toy.project(tmp_path, monkeypatch, "vmodel", toy.source(), toy.config("vmodel", steps=4))
    assert main(["tune", "tune.yaml", "-o", "best.yaml", "--verify-top-k", "2",
                 "--verify-steps", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "checked the top 2 on the full model (2 steps): winner trial" in out
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    v = best["verification"]
    assert v["steps"] == 2 and len(v["configs"]) == 2
    assert best["provenance"]["chosen_by"] == CHECK
    assert best["provenance"]["trial"] == v["winner"]
    assert best["hyperparameters"] == v["configs"][[c["trial"] for c in v["configs"]]
                                                   .index(v["winner"])]["params"]
    assert main(["export", "-o", "again.yaml"]) == 0  # later, from the study's record
    assert "the full-model check's winner" in capsys.readouterr().out
    again = yaml.safe_load((tmp_path / "again.yaml").read_text())
    assert again["hyperparameters"] == best["hyperparameters"]

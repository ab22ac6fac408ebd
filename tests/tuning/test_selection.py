"""Choosing with the surrogate's seed noise (:mod:`hydro.tuning.selection`): on synthetic noisy
landscapes whose answer is known, the choice is the middle of a flat optimum and the optimum
of a sharp one; in a real search the leaders' seed replicas train to the end, and the export
and the report give the choice and the range within noise."""

from __future__ import annotations

import random
import warnings

import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution

import hydro
from hydro.tuning.report import _figure
from hydro.tuning.selection import REPLICA_OF, SELECTION, Config, seed_noise, select
from tests import toy

SPACE = {"x": FloatDistribution(0.0, 1.0)}


def _landscape(f, noise: float, seed: int, seeds: int = 3, points: int = 21) -> list[Config]:
    rng = random.Random(seed)
    out = []
    for k in range(points):
        x = k / (points - 1)
        out.append(Config({"x": x}, [k * 10 + s for s in range(seeds)],
                          [f(x) + rng.gauss(0, noise) for _ in range(seeds)]))
    return out


def flat(x: float) -> float:  # a flat optimum from 0.3 to 0.7
    return 1.0 + 4 * max(0.0, abs(x - 0.5) - 0.2) ** 2


def test_a_flat_optimum_gives_its_middle_not_the_noisy_minimum():
    picked, noisy = [], []
    for seed in range(20):
        found = _landscape(flat, noise=0.02, seed=seed)
        s = select(found, SPACE)
        picked.append(s.params["x"])
        noisy.append(min(found, key=lambda c: c.values[0]).params["x"])  # one seed's best
        low, high = s.ranges["x"]
        assert low <= 0.4 and high >= 0.6, s.ranges  # the flat region is within noise
    assert all(abs(x - 0.5) <= 0.1 for x in picked), picked
    assert sum(abs(x - 0.5) for x in picked) < 0.5 * sum(abs(x - 0.5) for x in noisy)


def test_a_sharp_optimum_is_chosen_where_it_is_and_its_range_is_narrow():
    for seed in range(5):
        s = select(_landscape(lambda x: 1.0 + 10 * (x - 0.2) ** 2, noise=0.005, seed=seed), SPACE)
        assert s.params["x"] == pytest.approx(0.2, abs=0.051)
        assert s.ranges["x"][1] - s.ranges["x"][0] <= 0.2


def test_maximize_mirrors_and_categoricals_give_their_choices():
    space = {"x": FloatDistribution(0.0, 1.0), "act": CategoricalDistribution(["relu", "gelu"])}
    found = [Config({"x": c.params["x"], "act": "relu" if k % 2 else "gelu"}, c.trials,
                    [-v for v in c.values])
             for k, c in enumerate(_landscape(flat, noise=0.02, seed=3))]
    s = select(found, space, maximize=True)
    assert abs(s.params["x"] - 0.5) <= 0.1 and s.ranges["act"] == ["gelu", "relu"]


def test_without_replicas_there_is_no_noise_to_choose_with():
    assert seed_noise([[1.0], [2.0]]) is None
    assert select([Config({"x": 0.5}, [0], [1.0])], SPACE) is None


class PruneAfterTheSearch(optuna.pruners.BasePruner):
    """Prunes every trial from number 4 on, the replicas of a search of 4 trials."""

    def prune(self, study, trial):
        return trial.number >= 4


def test_a_search_replicates_its_leaders_and_exports_the_choice(tmp_path):
    space = {"lr": FloatDistribution(1e-3, 1e-1, log=True)}
    study = optuna.create_study(pruner=PruneAfterTheSearch(),
                                sampler=optuna.samplers.RandomSampler(seed=0))
    task = toy.task(width=64, steps=6, eval_every=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = hydro.tune(task, space, n_trials=4, ratio=2, fuse=4, replicas=2, leaders=2,
                            study=study, progress=False)
    trials = study.get_trials()
    replicas = [t for t in trials if REPLICA_OF in t.user_attrs]
    assert len(trials) == 8 and len(replicas) == 4
    # the pruner prunes every replica it is asked about: they train to the end anyway
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in replicas)
    leaders = {t.user_attrs[REPLICA_OF] for t in replicas}
    assert len(leaders) == 2
    assert all(t.params == trials[t.user_attrs[REPLICA_OF]].params for t in replicas)
    # other seeds: other values than their leader's
    assert all(t.value != trials[t.user_attrs[REPLICA_OF]].value for t in replicas)
    chosen = study.user_attrs[SELECTION]
    assert chosen["chosen"] in leaders and chosen["noise"] > 0
    assert result.chosen_params == trials[chosen["chosen"]].params
    result.export(str(tmp_path / "best.yaml"))
    data = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert data["hyperparameters"] == result.chosen_params
    assert data["provenance"]["chosen_by"] == "seed noise"
    low, high = data["within_noise"]["lr"]
    assert low <= result.chosen_params["lr"] <= high
    assert any(a.get_gid() == "within" for a in _figure(study).axes[2].patches)
    # a rerun finds every replica made: nothing more is trained
    hydro.tune(task, space, n_trials=4, ratio=2, fuse=4, replicas=2, leaders=2, study=study,
               progress=False)
    assert len(study.get_trials()) == 8


def test_hydro_tune_says_the_noise_aware_choice_and_export_names_it(tmp_path, monkeypatch, capsys):
    from hydro.cli import main

    config = toy.config("toymod", trials=4, ratio=2, fuse=4, steps=6, eval_every=2,
                        top="replicas: 2\nleaders: 2\n")
    toy.project(tmp_path, monkeypatch, "toymod", toy.source(), config)
    assert main(["tune", "tune.yaml", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "chosen with the seeds' noise: trial " in out and "(within noise: [" in out
    assert main(["export", "-o", "best.yaml"]) == 0
    assert "(chosen with the seeds' noise)" in capsys.readouterr().out
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert best["provenance"]["chosen_by"] == "seed noise" and "lr" in best["within_noise"]

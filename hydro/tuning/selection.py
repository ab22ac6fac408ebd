"""Choosing with the surrogate's noise: seed replicas of the leading configurations, and the
middle of the region they cannot tell apart.

A surrogate's value moves between seeds. Where its good region is flat, the search's best trial
is often a point the surrogate cannot tell from its neighbours, and nothing says it is not on
the full model's steep side. So, after the search, the ``leaders`` best configurations train
``replicas`` more times with other seeds (ordinary trials, fused like any other), which
measures the seed-to-seed noise; the configurations whose mean is within that noise of the best
mean form the region the surrogate cannot tell apart, and the choice is the replicated
configuration nearest the middle of that region (each hyperparameter on its search scale: log
for log distributions). The export gives, per hyperparameter, the chosen value and the range of
the region.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

__all__ = ["REPLICA_OF", "SELECTION", "Config", "Selection", "configs", "leaders", "ranked",
           "select", "seed_noise"]

REPLICA_OF = "hydro_replica_of"  # a replica trial's user attribute: the trial it repeats
SELECTION = "hydro_selection"  # the study's user attribute: the last choice (Selection.as_dict)
# A configuration is within noise of the best when its mean is at most Z standard errors of the
# difference of two means worse than the best's.
Z = 2.0


@dataclass
class Config:
    """One configuration and every value it reached (one per seed)."""

    params: dict[str, Any]
    trials: list[int]
    values: list[float]

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)


@dataclass
class Selection:
    """What :func:`select` chose, and why."""

    chosen: int  # the chosen configuration's first trial
    params: dict[str, Any]
    mean: float
    noise: float  # the seed-to-seed standard deviation of one value
    best: int  # the first trial of the configuration with the best mean
    within: list[int] = field(default_factory=list)  # first trials of the region's configurations
    ranges: dict[str, Any] = field(default_factory=dict)  # per hyperparameter: [low, high] or set

    def as_dict(self) -> dict[str, Any]:
        """Plain values, for the study's user attributes and the export."""
        return {"chosen": self.chosen, "params": dict(self.params), "mean": self.mean,
                "noise": self.noise, "best": self.best, "within": list(self.within),
                "ranges": {k: list(v) for k, v in self.ranges.items()}}


def configs(trials: Sequence[FrozenTrial]) -> list[Config]:
    """The complete trials grouped by configuration (a replica joins the trial it repeats),
    in order of their first trial."""
    out: dict[Any, Config] = {}
    for t in sorted(trials, key=lambda t: t.number):
        if t.state != TrialState.COMPLETE or t.value is None or not math.isfinite(t.value):
            continue
        key = _key(t.params)
        if key not in out:
            out[key] = Config(dict(t.params), [], [])
        out[key].trials.append(t.number)
        out[key].values.append(float(t.value))
    return list(out.values())


def ranked(trials: Sequence[FrozenTrial], maximize: bool) -> list[Config]:
    """:func:`configs` of ``trials``, best mean first."""
    return sorted(configs(trials), key=lambda c: c.mean, reverse=maximize)


def leaders(study: optuna.Study, count: int) -> list[FrozenTrial]:
    """The first trials of the ``count`` best configurations by their mean so far."""
    trials = study.get_trials(deepcopy=False)
    found = ranked(trials, study.direction == optuna.study.StudyDirection.MAXIMIZE)
    first = {t.number: t for t in trials}
    return [first[c.trials[0]] for c in found[:count]]


def seed_noise(groups: Sequence[Sequence[float]]) -> float | None:
    """The pooled seed-to-seed standard deviation of the groups of two values or more (each
    group: one configuration's values); ``None`` without any such group.

    >>> round(seed_noise([[1.0, 3.0], [5.0, 5.0, 8.0]]), 4)
    1.633
    """
    squares = dof = 0.0
    for values in groups:
        if len(values) < 2:
            continue
        mean = sum(values) / len(values)
        squares += sum((v - mean) ** 2 for v in values)
        dof += len(values) - 1
    return math.sqrt(squares / dof) if dof else None


def select(found: Sequence[Config], distributions: Mapping[str, BaseDistribution],
           maximize: bool = False, z: float = Z) -> Selection | None:
    """The choice among ``found``: the replicated configuration nearest the middle of the
    region within noise of the best replicated mean (see the module's docstring). ``None``
    where no configuration has two values (no noise measured).

    >>> from optuna.distributions import FloatDistribution
    >>> space = {"x": FloatDistribution(0.0, 10.0)}
    >>> found = [Config({"x": 2.0}, [0, 5], [1.00, 1.10]), Config({"x": 5.0}, [1, 6], [1.02, 1.04]),
    ...          Config({"x": 8.0}, [2, 7], [1.01, 1.13]), Config({"x": 9.5}, [3], [3.0])]
    >>> s = select(found, space)
    >>> s.best, s.within, s.chosen, s.ranges["x"]
    (1, [0, 1, 2], 1, [2.0, 8.0])
    """
    sign = -1.0 if maximize else 1.0
    replicated = [c for c in found if len(c.values) >= 2]
    noise = seed_noise([c.values for c in replicated])
    if noise is None:
        return None
    best = min(replicated, key=lambda c: sign * c.mean)

    def close(c: Config) -> bool:
        margin = z * noise * math.sqrt(1 / len(c.values) + 1 / len(best.values))
        return sign * (c.mean - best.mean) <= margin

    region = [c for c in found if close(c)]
    middle = {name: _mean([_scaled(c.params[name], d) for c in region])
              for name, d in distributions.items()
              if not isinstance(d, CategoricalDistribution)
              and all(name in c.params for c in region)}

    def distance(c: Config) -> float:
        return sum((_scaled(c.params[name], distributions[name]) - m) ** 2
                   for name, m in middle.items())

    chosen = min((c for c in region if len(c.values) >= 2),
                 key=lambda c: (distance(c), sign * c.mean))
    ranges: dict[str, Any] = {}
    for name in sorted({k for c in region for k in c.params}):
        values = [c.params[name] for c in region if name in c.params]
        if isinstance(distributions.get(name), CategoricalDistribution) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
        ):
            ranges[name] = sorted({str(v) for v in values})
        else:
            ranges[name] = [min(values), max(values)]
    return Selection(chosen=chosen.trials[0], params=dict(chosen.params), mean=chosen.mean,
                     noise=noise, best=best.trials[0], within=[c.trials[0] for c in region],
                     ranges=ranges)


def _scaled(value: Any, dist: BaseDistribution) -> float:
    """``value`` on its distribution's search scale, from 0 (low) to 1 (high)."""
    low, high, log = float(dist.low), float(dist.high), bool(getattr(dist, "log", False))
    if log:
        low, high, value = math.log(low), math.log(high), math.log(value)
    return 0.0 if high == low else (float(value) - low) / (high - low)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _key(params: Mapping[str, Any]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in params.items()))

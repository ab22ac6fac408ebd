"""Optuna's face of Hydro: the fused-group driver and transfer sampling.

:func:`optimize` (from :mod:`hydro.tuning.engine`) runs a study's trials in fused groups with any
Optuna sampler, pruner and storage, for a :class:`hydro.Task` or your own training function (a
:class:`hydro.Loop`, docs/how-to/own-loop.md); its options are ``hydro.tune``'s
(:class:`hydro.TuneOptions`). A :data:`GroupCallback` instead trains each asked batch of trials
itself, without Hydro's surrogates. :class:`TransferSampler` starts a study on the full model
from the best configurations of a surrogate study.

Example:
    >>> import optuna, torch, hydro
    >>> from hydro.integrations.optuna import optimize
    >>> x, y = torch.randn(256, 8), torch.randint(0, 3, (256,))
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(),
    ...                             torch.nn.Linear(64, 3))
    >>> task = hydro.Task(model=model, train_data=(x, y), val_data=(x, y), steps=10)
    >>> space = {"lr": optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)}
    >>> study = optuna.create_study()
    >>> optimize(study, task, space, n_trials=4, ratio=2, fuse=4)
    >>> len(study.trials)
    4
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

from hydro.errors import ConfigError
from hydro.tuning.engine import (  # noqa: F401 - re-exported: the engine's names as before
    HEARTBEAT_SECONDS,
    INTERRUPTED,
    STALE_SECONDS,
    GroupCallback,
    is_void,
    optimize,
    reclaim_stale,
)

__all__ = ["GroupCallback", "TransferSampler", "is_void", "optimize"]


class TransferSampler(BaseSampler):
    """Propose a source study's best configurations first, then defer to a base sampler.

    For a study on the full model after a Hydro study on its surrogate: the first ``top_k``
    trials get the surrogate's ``top_k`` best parameters (best first), restricted to parameters
    the new study asks for and within its distributions; later trials (and parameters the source
    never tried) come from ``base_sampler``.

    Args:
        source_study: the finished surrogate study.
        top_k: how many of its best configurations to replay.
        base_sampler: the sampler afterwards (default: TPE).

    Example:
        >>> import optuna
        >>> from hydro.integrations.optuna import TransferSampler
        >>> source = optuna.create_study()
        >>> source.optimize(lambda t: (t.suggest_float("x", -1, 1) - 0.3) ** 2, n_trials=20)
        >>> full = optuna.create_study(sampler=TransferSampler(source, top_k=1))
        >>> full.optimize(lambda t: (t.suggest_float("x", -1, 1) - 0.3) ** 2, n_trials=1)
        >>> full.trials[0].params == source.best_params
        True
    """

    def __init__(
        self, source_study: optuna.Study, top_k: int = 3, base_sampler: BaseSampler | None = None
    ) -> None:
        if top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {top_k}")
        complete = source_study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        reverse = source_study.direction == optuna.study.StudyDirection.MAXIMIZE
        ranked = sorted(complete, key=lambda t: t.value, reverse=reverse)
        self._configs = [dict(t.params) for t in ranked[:top_k]]
        self._base = base_sampler or optuna.samplers.TPESampler()

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        if self._replayed(trial) is not None:
            return {}
        return self._base.infer_relative_search_space(study, trial)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: Mapping[str, BaseDistribution]
    ) -> dict[str, Any]:
        if self._replayed(trial) is not None:
            return {}
        return self._base.sample_relative(study, trial, search_space)

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        config = self._replayed(trial)
        if config is not None and param_name in config:
            value = config[param_name]
            try:
                if param_distribution._contains(param_distribution.to_internal_repr(value)):
                    return value
            except (ValueError, TypeError):
                pass
        return self._base.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._base.before_trial(study, trial)

    def after_trial(self, study, trial, state, values) -> None:
        self._base.after_trial(study, trial, state, values)

    def _replayed(self, trial: FrozenTrial) -> dict[str, Any] | None:
        return self._configs[trial.number] if trial.number < len(self._configs) else None

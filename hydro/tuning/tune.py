"""``hydro.tune``: search on fused surrogates, then hand the answer back to the full model."""

from __future__ import annotations

import datetime
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
import yaml
from optuna.trial import TrialState

import hydro
from hydro.errors import ConfigError, StorageError
from hydro.tuning.group import group_key, train_group
from hydro.tuning.space import Space, check_space
from hydro.tuning.task import Task

DEFAULT_STORAGE = "sqlite:///hydro.db"


@dataclass
class TuneResult:
    """What :func:`tune` found.

    Attributes:
        study: the Optuna study (its storage holds every trial).
        ratio: the surrogate width divisor used.
        verification: with ``verify_top_k``, the full-model check (see :func:`verify`).
    """

    study: optuna.Study
    ratio: int
    verification: dict[str, Any] | None = field(default=None)

    @property
    def best_trial(self) -> optuna.trial.FrozenTrial:
        return self.study.best_trial

    @property
    def best_params(self) -> dict[str, Any]:
        """The best hyperparameters: use them unchanged on the full model."""
        return dict(self.study.best_params)

    @property
    def best_value(self) -> float:
        """The best surrogate value of the metric."""
        return float(self.study.best_value)

    @property
    def trials(self) -> list[dict[str, Any]]:
        """One row per trial: number, state, value, parameters, group and fail reason."""
        return [
            {"number": t.number, "state": t.state.name, "value": t.value, **t.params,
             "group": t.user_attrs.get("group"), "fail_reason": t.user_attrs.get("fail_reason")}
            for t in self.study.get_trials(deepcopy=False)
        ]  # fmt: skip

    def export(self, path: str | os.PathLike) -> dict[str, Any]:
        """Write the best hyperparameters and their provenance to YAML (or JSON by extension)."""
        return export(self.study, path, verification=self.verification)


def export(
    study: optuna.Study, path: str | os.PathLike, verification: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write a study's best hyperparameters for the full model, with provenance.

    The file is YAML unless ``path`` ends in ``.json``. Returns what was written.
    """
    try:
        best = study.best_trial
    except ValueError as exc:
        raise ConfigError(f"study {study.study_name!r} has no completed trial to export") from exc
    data: dict[str, Any] = {
        "hyperparameters": dict(best.params),
        "provenance": {
            "study": study.study_name,
            "trial": best.number,
            "direction": study.direction.name.lower(),
            "surrogate_value": best.value,
            "ratio": best.user_attrs.get("ratio"),
            "surrogate_widths": best.user_attrs.get("surrogate_widths"),
            "trials_finished": sum(1 for t in study.trials if t.state.is_finished()),
            "hydro_version": hydro.__version__,
            "exported": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
    }
    if verification:
        data["verification"] = verification
    path = os.fspath(path)
    with open(path, "w") as f:
        if path.endswith(".json"):
            json.dump(data, f, indent=2)
        else:
            yaml.safe_dump(data, f, sort_keys=False)
    return data


def open_study(
    storage: str | None,
    study_name: str,
    direction: str,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
) -> optuna.Study:
    """Create or load a study, with a clear error for a storage that cannot be opened."""
    url = storage or DEFAULT_STORAGE
    try:
        return optuna.create_study(
            storage=url, study_name=study_name, direction=direction, sampler=sampler,
            pruner=pruner, load_if_exists=True,
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - SQLAlchemy, file system, journal errors...
        raise StorageError(
            f"cannot open Optuna storage {url!r}: {type(exc).__name__}: {exc}. Check the URL "
            "(e.g. sqlite:///path/to/hydro.db, postgresql://user@host/db) and that its "
            "directory or server is reachable."
        ) from exc


def tune(
    task: Task,
    space: Space,
    *,
    n_trials: int,
    ratio: int = 8,
    fuse: int = 16,
    study: optuna.Study | str | None = None,
    storage: str | None = None,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
    executor: Any = None,
    seed: int | None = None,
    verify_top_k: int = 0,
    progress: bool = False,
) -> TuneResult:
    """Tune ``task`` over ``space`` on fused muP surrogates, resumably.

    Args:
        task: what to train (:class:`hydro.Task`).
        space: a dict of Optuna distributions, or a function ``trial -> params`` calling
            ``trial.suggest_*``. Names: see :data:`hydro.tuning.space.HYPERPARAMETERS`, plus the
            model factory's keyword arguments.
        n_trials: configurations to finish.
        ratio: surrogate width divisor (1 tunes the full model itself, fused).
        fuse: trials per fused group.
        study: an Optuna study, or a study name (default ``"hydro"``) to create or resume in
            ``storage``.
        storage: any Optuna storage URL; default ``sqlite:///hydro.db`` (a file in the working
            directory, readable by optuna-dashboard). Rerunning resumes the study there.
        sampler: default TPE with ``constant_liar`` (so a batch asked at once spreads out).
        pruner: default Optuna's ``MedianPruner``.
        executor: where groups train: ``None``/``"inline"`` in this process, one after another;
            ``"local"`` in worker processes on this machine (``hydro_fluid.LocalExecutor``: one
            group per GPU slot, or CPU threads split between workers); ``"ray"`` on a Ray
            cluster (``hydro_fluid.RayExecutor``; ``RAY_ADDRESS`` or a local one); or an
            executor object.
        seed: seeds the sampler, the surrogates' initializations and the data order.
        verify_top_k: afterwards, train the full model (unmodified, standard parametrization)
            with the best ``k`` configurations and report which wins and the rank agreement.
        progress: print progress to stderr.

    Returns:
        A :class:`TuneResult`.

    Example:
        >>> import optuna, torch, hydro
        >>> x, y = torch.randn(512, 8), torch.randint(0, 3, (512,))
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(),
        ...                             torch.nn.Linear(64, 3))
        >>> task = hydro.Task(model=model, train_data=(x, y), val_data=(x, y), steps=20)
        >>> space = {"lr": optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)}
        >>> result = hydro.tune(task, space, n_trials=8, ratio=4, fuse=8,
        ...                     storage="sqlite:///:memory:")
        >>> sorted(result.best_params)
        ['lr']
    """
    from hydro.integrations.optuna import optimize

    executor = make_executor(executor)
    if not isinstance(task, Task):
        raise ConfigError(f"task must be a hydro.Task, got {type(task).__name__}")
    check_space(space, task.model_args())
    base_seed = 0 if seed is None else int(seed)
    if isinstance(study, optuna.Study):
        the_study = study
    else:
        sampler = sampler or optuna.samplers.TPESampler(seed=seed, constant_liar=True)
        the_study = open_study(storage, study or "hydro", task.direction, sampler, pruner)
    optimize(the_study, task, space, n_trials, ratio=ratio, fuse=fuse, seed=base_seed,
             progress=progress, executor=executor)  # fmt: skip
    result = TuneResult(the_study, ratio)
    if verify_top_k:
        result.verification = verify(task, the_study, verify_top_k, seed=base_seed)
        the_study.set_user_attr("hydro_verification", result.verification)  # for report/export
    return result


def make_executor(executor: Any) -> Any:
    """``None``/"inline", "local", "ray" or an executor object -> an executor (or None)."""
    if executor in (None, "inline"):
        return None
    if executor == "local":
        from hydro_fluid import LocalExecutor

        return LocalExecutor()
    if executor == "ray":
        from hydro_fluid import RayExecutor

        return RayExecutor()
    if hasattr(executor, "run"):
        return executor
    raise ConfigError(f"unknown executor {executor!r}: use 'inline', 'local', 'ray' or a "
                      "hydro_fluid executor")  # fmt: skip


def verify(task: Task, study: optuna.Study, top_k: int, *, seed: int = 0) -> dict[str, Any]:
    """Train the full model with a study's ``top_k`` best configurations and compare.

    The full model is the task's model itself (ratio 1: standard parametrization, unmodified),
    trained by the same loop, fused where the configurations allow.

    Returns:
        ``{"configs": [{trial, params, surrogate_value, full_value}...], "winner": trial number,
        "spearman": rank correlation between surrogate and full-model values}``.
    """
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    reverse = task.direction == "maximize"
    top = sorted(complete, key=lambda t: t.value, reverse=reverse)[:top_k]
    if not top:
        raise ConfigError("no completed trial to verify")
    groups: dict[tuple, list] = {}
    for t in top:
        groups.setdefault(group_key(t.params, task), []).append(t)
    full: dict[int, float | None] = {}
    for members in groups.values():
        outcomes, _ = train_group(task, [t.params for t in members], ratio=1,
                                  seeds=[seed + t.number for t in members])  # fmt: skip
        for t, o in zip(members, outcomes):
            full[t.number] = o.value if o.state == "complete" else None
    rows = [{"trial": t.number, "params": dict(t.params), "surrogate_value": t.value,
             "full_value": full[t.number]} for t in top]  # fmt: skip
    finite = [r for r in rows if r["full_value"] is not None and math.isfinite(r["full_value"])]
    pick = max if reverse else min
    winner = pick(finite, key=lambda r: r["full_value"])["trial"] if finite else None
    rho = spearman([r["surrogate_value"] for r in finite], [r["full_value"] for r in finite])
    return {"configs": rows, "winner": winner, "spearman": rho}


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman rank correlation (average ranks for ties, NaN ranked worst, as a diverged run);
    None for fewer than 2 points."""
    if len(a) < 2:
        return None

    def ranks(v: Sequence[float]) -> list[float]:
        v = [math.inf if math.isnan(x) else float(x) for x in v]
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else None

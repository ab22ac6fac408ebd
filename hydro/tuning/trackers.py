"""Experiment trackers: each finished trial logged to MLflow or TensorBoard as it ends.

Both are Optuna-style callbacks ``f(study, frozen_trial)``: pass them to
``hydro.tune(callbacks=[...])``, or name them in a config file's ``trackers`` key
(:func:`from_config`). Hydro calls them in the process that drives the study, once for each
trial it tells (complete, pruned or failed), also when a fused group ends several trials at
once. A trial stopped with its process and put back to resume is logged when it finishes.

What each trial logs: what it sampled and every value it trained with (a fixed value the
space function returned too), each intermediate value it reported (its learning curve, by step),
its state, and the objective ``value`` when it completed.

The packages are the ``trackers`` extra: ``pip install 'hydro-surrogate[trackers]'``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from hydro.errors import ConfigError
from hydro.tuning.space import trained_params

# a trial's end state as MLflow names a run's
_RUN_STATUS = {
    TrialState.COMPLETE: "FINISHED",
    TrialState.PRUNED: "KILLED",
    TrialState.FAIL: "FAILED",
}


def _require(module: str, package: str, who: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"{who} needs the {package} package, which is not installed: "
            "pip install 'hydro-surrogate[trackers]'"
        )


def _params(trial: FrozenTrial) -> dict[str, Any]:
    """What the trial sampled and every value it trained with: a space function may train
    ``lr`` from a sampled ``log_lr``, or fix ``warmup`` beside what it samples."""
    return {**trial.params, **trained_params(trial)}


def _reports(trial: FrozenTrial) -> list[tuple[int, float]]:
    """The trial's intermediate values by step, in step order."""
    return sorted(trial.intermediate_values.items())


class MLflowTracker:
    """Log each finished trial as one MLflow run, in an experiment named after the study.

    Args:
        tracking_uri: where MLflow keeps runs: a tracking URI (``sqlite:///mlflow.db``,
            ``http://host:5000``) or the path of a SQLite file, made ``sqlite:///PATH``
            (MLflow's plain-folder store is no longer written to; a SQLite file needs no
            server, and ``mlflow ui --backend-store-uri sqlite:///PATH`` shows it).
        experiment: the experiment's name (default: the study's name).

    Each run is named ``trial N``, holds the trial's params, the metric ``value`` (complete
    trials), the metric ``reported`` at each step it reported, and the tags ``hydro.study``,
    ``hydro.trial`` and ``hydro.state``; a pruned trial's run ends ``KILLED``, a failed
    one's ``FAILED`` with its ``hydro.fail_reason``.
    """

    def __init__(self, tracking_uri: str | os.PathLike, experiment: str | None = None) -> None:
        _require("mlflow", "mlflow-skinny (or mlflow)", "MLflowTracker")
        uri = os.fspath(tracking_uri)
        self.tracking_uri = uri if "://" in uri else f"sqlite:///{os.path.abspath(uri)}"
        self.experiment = experiment
        self._client: Any = None
        self._experiments: dict[str, str] = {}
        self._lock = threading.Lock()

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if trial.state not in _RUN_STATUS:
            return
        with self._lock:
            self._log(study, trial)

    def _experiment_id(self, name: str) -> str:
        if name not in self._experiments:
            found = self._client.get_experiment_by_name(name)
            self._experiments[name] = (
                found.experiment_id if found is not None else self._client.create_experiment(name)
            )
        return self._experiments[name]

    def _log(self, study: optuna.Study, trial: FrozenTrial) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param

        if self._client is None:
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        tags = {
            "hydro.study": study.study_name,
            "hydro.trial": str(trial.number),
            "hydro.state": trial.state.name,
        }
        if trial.state == TrialState.FAIL:
            tags["hydro.fail_reason"] = str(trial.user_attrs.get("fail_reason", ""))[:5000]
        experiment = self._experiment_id(self.experiment or study.study_name)
        run = self._client.create_run(experiment, run_name=f"trial {trial.number}", tags=tags)
        when = trial.datetime_complete or trial.datetime_start
        stamp = int(when.timestamp() * 1000) if when is not None else 0
        metrics = [Metric("reported", v, stamp, s) for s, v in _reports(trial) if math.isfinite(v)]
        if trial.state == TrialState.COMPLETE and trial.value is not None:
            metrics.append(Metric("value", trial.value, stamp, 0))
        params = [Param(k, str(v)[:6000]) for k, v in sorted(_params(trial).items())]
        for i in range(0, max(len(metrics), 1), 1000):  # MLflow's batch limit
            self._client.log_batch(
                run.info.run_id, metrics=metrics[i : i + 1000], params=params if i == 0 else []
            )
        self._client.set_terminated(run.info.run_id, status=_RUN_STATUS[trial.state])


class TensorBoardTracker:
    """Log each finished trial to TensorBoard, one run folder per trial.

    Args:
        log_dir: the folder ``tensorboard --logdir`` is pointed at; each trial writes
            ``LOG_DIR/STUDY/trial-NNNN``.

    Each trial's run holds the scalar ``reported`` at each step it reported (the learning
    curves, side by side in the Scalars tab), the scalar ``value`` (complete trials) and its
    params with its state in the HParams tab, where trials can be sorted and compared.
    Needs the ``tensorboard`` package (torch's ``SummaryWriter`` writes the files).
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        _require("tensorboard", "tensorboard", "TensorBoardTracker")
        self.log_dir = os.fspath(log_dir)
        self._lock = threading.Lock()

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if not trial.state.is_finished():
            return
        with self._lock:
            self._log(study, trial)

    def _log(self, study: optuna.Study, trial: FrozenTrial) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        folder = os.path.join(self.log_dir, study.study_name, f"trial-{trial.number:04d}")
        writer = SummaryWriter(log_dir=folder)
        try:
            reports = _reports(trial)
            for step, value in reports:
                writer.add_scalar("reported", value, step)
            complete = trial.state == TrialState.COMPLETE and trial.value is not None
            last = reports[-1][0] if reports else 0
            if complete:
                writer.add_scalar("value", trial.value, last)
            values = {k: _hparam(v) for k, v in sorted(_params(trial).items())}
            values["state"] = trial.state.name
            for summary in hparams(values, {"value": trial.value if complete else math.nan}):
                writer.file_writer.add_summary(summary)
        finally:
            writer.close()


def _hparam(value: Any) -> bool | int | float | str:
    """A param as TensorBoard's HParams tab takes one: a number, a string or a boolean."""
    return value if isinstance(value, (bool, int, float, str)) else str(value)


TRACKERS: dict[str, Callable[[str], Callable[[optuna.Study, FrozenTrial], None]]] = {
    "mlflow": MLflowTracker,
    "tensorboard": TensorBoardTracker,
}


def from_config(spec: Any, where: str = "trackers") -> list[Callable[..., None]]:
    """The callbacks a config file's ``trackers`` mapping names: ``{mlflow: PATH_OR_URI,
    tensorboard: DIR}``; an unknown name or a missing package is a :class:`ConfigError`.

    Example:
        >>> from_config(None)
        []
        >>> from_config({"wandb": "runs"})
        Traceback (most recent call last):
        ...
        hydro.errors.ConfigError: trackers: unknown tracker 'wandb'; known: mlflow, tensorboard
    """
    if spec is None:
        return []
    if not isinstance(spec, Mapping):
        raise ConfigError(
            f"{where} must be a mapping of tracker to where it logs, e.g. "
            f"{{mlflow: mlflow.db, tensorboard: runs}}; got {spec!r}"
        )
    out = []
    for name, target in spec.items():
        if name not in TRACKERS:
            raise ConfigError(
                f"{where}: unknown tracker {name!r}; known: {', '.join(sorted(TRACKERS))}"
            )
        if not isinstance(target, str) or not target:
            raise ConfigError(f"{where}.{name} must be a path or URI (a string), got {target!r}")
        try:
            out.append(TRACKERS[name](target))
        except ConfigError as exc:
            raise ConfigError(f"{where}.{name}: {exc}") from exc
    return out

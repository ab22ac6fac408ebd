"""What a tuning run gives back: :class:`TuneResult`, the export of the chosen hyperparameters
for the full model (``best.yaml``; the check of the top configurations on the full model that
may choose them is :mod:`hydro.tuning.verification`), and the study's storage opened with a
clear error."""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass, field
from typing import Any

import optuna
import yaml
from optuna.trial import TrialState

from hydro._version import __version__
from hydro.errors import ConfigError, StorageError, StudyError
from hydro.files import write_text
from hydro.tuning.engine import refuse_directions
from hydro.tuning.fingerprint import recipe_for
from hydro.tuning.options import DEFAULT_STORAGE
from hydro.tuning.report import BELOW_FLOOR, is_interrupted, is_surplus, trial_counts
from hydro.tuning.selection import SELECTION
from hydro.tuning.space import trained_params
from hydro.tuning.task import Task
from hydro.tuning.verification import CHECK, SURROGATE, chosen_trial

__all__ = [
    "TuneResult",
    "best_trial",
    "check_writable",
    "export",
    "export_data",
    "header",
    "open_study",
    "training",
]


@dataclass
class TuneResult:
    """What :func:`tune` found.

    Attributes:
        study: the Optuna study (its storage holds every trial).
        ratio: the surrogate width divisor used.
        verification: with ``verify_top_k``, the full-model check
            (:func:`hydro.tuning.verification.verify`): both rankings and the full model's
            winner, which the export follows (:attr:`chosen_params`).
    """

    study: optuna.Study
    ratio: int
    verification: dict[str, Any] | None = field(default=None)

    @property
    def best_trial(self) -> optuna.trial.FrozenTrial:
        """The best complete trial (:class:`hydro.errors.StudyError` when none completed)."""
        return best_trial(self.study)

    @property
    def best_params(self) -> dict[str, Any]:
        """The surrogate's best hyperparameters (Optuna's best trial), usable unchanged on the
        full model. After a check on the full model (``verify_top_k``) the export follows the
        check's winner instead: :attr:`chosen_params`."""
        return trained_params(self.best_trial)

    @property
    def selection(self) -> dict[str, Any] | None:
        """With ``replicas``: the choice made with the seeds' noise (:mod:`hydro.tuning.selection`:
        ``chosen``, ``params``, ``mean``, ``noise``, ``best``, ``within``, ``ranges``), else
        ``None``."""
        return self.study.user_attrs.get(SELECTION)

    @property
    def chosen_params(self) -> dict[str, Any]:
        """The hyperparameters the export gives: the full-model check's winner when the check
        ran (and a run finished); else, with ``replicas``, the choice made with the seeds'
        noise; else :attr:`best_params`."""
        return chosen_params(self.study, self.verification)

    @property
    def best_value(self) -> float:
        """The best surrogate value of the metric."""
        return float(self.best_trial.value)

    @property
    def trials(self) -> list[dict[str, Any]]:
        """One row per trial: number, state, value, parameters, group and fail reason. A trial
        that stopped with its process is ``WAITING`` until a run takes it up again (an older
        study's FAIL row for it: ``INTERRUPTED``)."""
        return [
            {"number": t.number, "state": "INTERRUPTED" if is_interrupted(t) else t.state.name,
             "value": t.value, **trained_params(t), "group": t.user_attrs.get("group"),
             "fail_reason": t.user_attrs.get("fail_reason")}
            for t in self.study.get_trials(deepcopy=False)
            if not is_surplus(t)
        ]

    @property
    def occupancy(self) -> dict[str, Any] | None:
        """How full the fused groups stayed in the last run (continuous batching): ``fuse``,
        ``overall`` (mean live trials per fused step over ``fuse``) and ``while_asking`` (the
        same over the steps taken while the study still had trials to ask), summed over every
        group (in process or on an executor's workers); ``None`` before any fused step."""
        occ = self.study.user_attrs.get("hydro_occupancy")
        return dict(occ) if occ else None

    @property
    def below_floor(self) -> list[str]:
        """The layers the study's ratio took below their width floor (empty: none): its choice
        may then not be the full model's (:func:`hydro.fx.floor.task_below_floor`)."""
        return list(self.study.user_attrs.get(BELOW_FLOOR) or [])

    def export(self, path: str | os.PathLike) -> dict[str, Any]:
        """Write the best hyperparameters and their provenance to YAML (or JSON by extension)."""
        return export(self.study, path, verification=self.verification)


def selected_trial(study: optuna.Study) -> optuna.trial.FrozenTrial:
    """The trial whose hyperparameters the export gives: the choice made with the seeds' noise
    where the study has one (:data:`hydro.tuning.selection.SELECTION`), else the best."""
    selection = study.user_attrs.get(SELECTION)
    if selection:
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if t.number == selection["chosen"]:
                return t
    return best_trial(study)


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial:
    """A study's best complete trial, or a :class:`StudyError` saying why there is none."""
    try:
        return study.best_trial
    except ValueError as exc:
        counts = trial_counts(study)
        reasons = [t.user_attrs.get("fail_reason") for t in study.get_trials(deepcopy=False)
                   if t.state == TrialState.FAIL
                   and not (is_interrupted(t) or is_surplus(t))]
        first = next((r for r in reasons if r), None)
        raise StudyError(
            f"study {study.study_name!r} has no complete trial ({counts['failed']} failed, "
            f"{counts['pruned']} pruned, {counts['interrupted']} interrupted)"
            + (f"; first failure: {first}" if first else "")
            + ". Fix the cause and run it again (finished trials are kept), or see `hydro report`."
        ) from exc


def check_writable(path: str | os.PathLike, what: str = "output file") -> str:
    """Raise a ConfigError unless ``path`` can be written; checked before any long work."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{what} {path!r} is a directory: name a file, e.g. {path}/best.yaml")
    if not os.path.isdir(folder):
        raise ConfigError(f"cannot write the {what} {path!r}: directory {folder!r} does not "
                          "exist. Create it or name another path.")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write the {what} {path!r}: {exc.strerror or exc}. Name a "
                          "path you can write.") from exc
    if not existed:
        os.remove(path)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write the {what} {path!r}: directory {folder!r} is not "
                          "writable (the file is written beside its name, then renamed over "
                          "it). Name a path in a directory you can write.")
    return path


def task_recipe(task: Any) -> dict[str, Any]:
    """What the study trains with besides the searched hyperparameters (kept with the study)."""
    if not isinstance(task, Task):  # your own training function: its name and length
        from hydro.tuning.fingerprint import callable_name

        return {"loop": callable_name(task.train), "steps": task.steps,
                "batch_size": task.batch_size, "eval_every": task.eval_every,
                "direction": task.direction}
    return {"optimizer": task.optimizer, "scheduler": task.scheduler, "steps": task.steps,
            "batch_size": task.batch_size, "eval_every": task.eval_every,
            "loss": task.loss_name, "direction": task.direction}


def training(params: dict[str, Any], recipe: dict[str, Any]) -> dict[str, Any]:
    """Everything to train the full model: the optimizer's ``torch.optim`` arguments, the
    schedule, warm-up, steps and batch size (searched values, else the study's defaults)."""
    from hydro.tuning.group import DEFAULTS

    if "loop" in recipe:  # your own training function: it reads the hyperparameters itself
        return {
            "loop": recipe["loop"],
            "steps": recipe.get("steps"),
            "batch_size": int(params.get("batch_size", recipe.get("batch_size", 32))),
        }
    kind = recipe.get("optimizer", "adamw")
    base = DEFAULTS[kind]
    args: dict[str, Any] = {
        "lr": float(params.get("lr", base["lr"])),
        "weight_decay": float(params.get("weight_decay", base["weight_decay"])),
    }
    if kind == "sgd":
        args["momentum"] = float(params.get("momentum", 0.0))
    else:
        args["betas"] = [float(params.get("beta1", 0.9)), float(params.get("beta2", 0.999))]
        args["eps"] = float(params.get("eps", 1e-8))
    out = {
        "optimizer": kind,
        "optimizer_args": args,
        "scheduler": recipe.get("scheduler", "cosine"),
        "warmup": int(params.get("warmup", 0)),
        "steps": recipe.get("steps"),
        "batch_size": int(params.get("batch_size", recipe.get("batch_size", 32))),
        "grad_clip": params.get("grad_clip"),
    }
    for key in ("dropout", "init_scale", "output_mult"):
        if key in params:
            out[key] = params[key]
    return out


def header(path: str) -> str:
    """The first line of a YAML export at ``path``: a comment on what to do with it (JSON has
    no comments).

    Example:
        >>> header("out/best.yaml")[:52]
        '# hydro.recipe("best.yaml", model) builds your full '
    """
    name = os.path.basename(path).replace('"', "")
    return (
        f'# hydro.recipe("{name}", model) builds your full model\'s optimizer and LR '
        "schedule from this file (docs/how-to/use-the-export.md)\n"
    )


def export(
    study: optuna.Study, path: str | os.PathLike, verification: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write a study's best hyperparameters for the full model, with provenance.

    The file is YAML unless ``path`` ends in ``.json``. Besides the searched
    ``hyperparameters`` it holds ``training``: the optimizer with its ``torch.optim`` arguments,
    the scheduler, warm-up, steps and batch size, ready to train the full model
    (:func:`hydro.recipe` builds the optimizer and schedule from it). A YAML file starts with a
    comment saying so (:func:`header`). Returns what was written.

    Raises:
        StudyError: the study has no complete trial.
        ConfigError: ``path`` cannot be written.
    """
    path = check_writable(path, "export file")
    data = export_data(study, verification)
    # the whole text first, then one rename: an existing file is never left truncated
    text = (
        json.dumps(data, indent=2)
        if path.endswith(".json")
        else header(path) + _below_floor_comment(data) + yaml.safe_dump(data, sort_keys=False)
    )
    write_text(path, text)
    return data


def _below_floor_comment(data: dict[str, Any]) -> str:
    """A YAML export's second comment line when the study's ratio took layers below their width
    floor: the first thing a reader of the file sees, besides ``provenance.below_floor``."""
    below = data["provenance"].get("below_floor")
    if not below:
        return ""
    return (f"# BELOW THE WIDTH FLOOR: ratio {data['provenance'].get('ratio')} took {len(below)} "
            "layer(s) below their width floor (provenance.below_floor): these values may not "
            "be the full model's best\n")


def export_data(study: optuna.Study, verification: dict[str, Any] | None = None) -> dict[str, Any]:
    """What :func:`export` writes, as a dict: ``hyperparameters``, ``training``, ``provenance``
    (and ``verification`` when given: the full-model check's rankings, whose winner the
    ``hyperparameters`` and ``training`` then follow:
    :func:`apply_choice`).

    Raises:
        StudyError: the study has no complete trial.
    """
    best = selected_trial(study)
    selection = study.user_attrs.get(SELECTION)
    counts = trial_counts(study)
    recipe = recipe_for(study, best.number)  # the one it trained with, if the study changed
    params = trained_params(best)  # what trained, fixed values of a space function included
    data: dict[str, Any] = {
        "hyperparameters": params,
        "training": training(params, recipe),
        "provenance": {
            "study": study.study_name,
            "trial": best.number,
            "direction": study.direction.name.lower(),
            "surrogate_value": best.value,
            "ratio": best.user_attrs.get("ratio"),
            "depth_ratio": best.user_attrs.get("depth_ratio", 1),
            "depth_alpha": best.user_attrs.get("depth_alpha", 1.0),
            "surrogate_widths": best.user_attrs.get("surrogate_widths"),
            "surrogate_blocks": best.user_attrs.get("surrogate_blocks"),
            "fused": best.user_attrs.get("fused"),
            "fuse": fuse_record(study),
            "trials_finished": counts["finished"],
            "trials": {k: counts[k] for k in ("complete", "pruned", "failed", "interrupted")},
            "hydro_version": __version__,
            "exported": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
    }
    if selection:  # chosen with the seeds' noise: the region it could not tell apart, too
        data["provenance"]["chosen_by"] = "seed noise"
        data["provenance"]["surrogate_value"] = selection["mean"]
        data["provenance"]["selection"] = {
            "noise": selection["noise"], "best_mean_trial": selection["best"],
            "within_noise_trials": selection["within"]}
        data["within_noise"] = selection["ranges"]
    below = study.user_attrs.get(BELOW_FLOOR)
    if below:  # the study's ratio took layers below their floor (hydro.fx.floor)
        data["provenance"]["below_floor"] = list(below)
    if params != best.params:  # a space function's fixed or derived values: say what Optuna drew
        data["provenance"]["searched"] = dict(best.params)
    return apply_choice(data, study, verification)  # the check's winner, when it ran


def fuse_record(study: optuna.Study) -> dict[str, Any] | None:
    """How the last run sized its fused groups: ``fuse`` (a number or ``"auto"``) and, for
    ``"auto"``, one entry per key and device (batch size, model arguments, ``n``, bytes per
    trial, fixed bytes, budget, what capped ``n``)."""
    record = study.user_attrs.get("hydro_fuse")
    return dict(record) if record else None


def open_study(
    storage: str | None,
    study_name: str,
    direction: str,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
) -> optuna.Study:
    """Create or load a study, with a clear error for a storage that cannot be opened.

    The storage retries a locked database and turns what still fails into one
    :class:`StorageError` line (:mod:`hydro.tuning.storage`, ``HYDRO_STORAGE_TIMEOUT``).
    """
    from hydro.tuning.storage import cannot_open, open_storage

    url = storage or DEFAULT_STORAGE
    try:
        # a URL gets the guarded storage; a storage object (a journal file...) is used as given
        opened = open_storage(url) if isinstance(url, str) else url
        _refuse_multi_objective(opened, study_name)
        return optuna.create_study(
            storage=opened, study_name=study_name, direction=direction,
            sampler=sampler, pruner=pruner, load_if_exists=True,
        )
    except (StorageError, ConfigError):
        raise  # already one line saying what to do
    except Exception as exc:  # SQLAlchemy, file system, journal errors...
        raise cannot_open(url, exc) from exc


def _refuse_multi_objective(storage: Any, study_name: str) -> None:
    """An existing multi-objective study of that name: one ConfigError line, before Optuna's
    own error about overwriting its directions."""
    try:
        storage = optuna.storages.get_storage(storage)
        directions = storage.get_study_directions(storage.get_study_id_from_name(study_name))
    except KeyError:
        return  # no such study yet: it is created with one direction
    refuse_directions(study_name, directions)


def chosen_params(study: optuna.Study, verification: dict[str, Any] | None) -> dict[str, Any]:
    """The hyperparameters an export of ``study`` gives: the check's winner when it has one,
    else the surrogate's choice (with seed replicas, the one made with their noise; else the
    best trial: :func:`selected_trial`)."""
    chosen = chosen_trial(study, verification) or selected_trial(study)
    return trained_params(chosen)


def apply_choice(
    data: dict[str, Any], study: optuna.Study, verification: dict[str, Any] | None
) -> dict[str, Any]:
    """Make an export's choice: ``data`` (as :func:`export_data` built it
    from the surrogate's best) changed in place to follow the check's winner, if any.

    With a winner, ``hyperparameters``, ``training`` and the provenance's ``trial``,
    ``surrogate_value`` (and ``searched``) become the winner's; ``provenance.chosen_by`` is
    ``"full-model check"`` and ``provenance.surrogate_best`` keeps what the surrogate alone
    chose (its trial, value and hyperparameters), the same trial when the two agree. Without a
    check, or when every checked run diverged, ``chosen_by`` is ``"surrogate"``. The
    ``verification`` section holds both rankings. Returns ``data``.
    """
    prov = data["provenance"]
    if verification:
        data["verification"] = verification
    chosen = chosen_trial(study, verification)
    if chosen is None:
        prov.setdefault("chosen_by", SURROGATE)
        return data
    prov["surrogate_best"] = {"trial": prov["trial"], "surrogate_value": prov["surrogate_value"],
                              "hyperparameters": dict(data["hyperparameters"])}
    prov["chosen_by"] = CHECK
    if chosen.number != prov["trial"]:
        params = trained_params(chosen)
        data["hyperparameters"] = params
        data["training"] = training(params, recipe_for(study, chosen.number))
        prov["trial"] = chosen.number
        prov["surrogate_value"] = chosen.value
        prov.pop("searched", None)
        if params != chosen.params:  # a space function's fixed or derived values
            prov["searched"] = dict(chosen.params)
    return data

"""The one function that runs a tuning run: :func:`run`.

``hydro.tune(...)`` and ``hydro tune CONFIG`` both build a :class:`TuneOptions` and call it,
so the two doors share every default and every step: checks, the target model built once,
the ratio resolved, the study opened and its definition checked, the engine
(:func:`hydro.tuning.engine.drive`), the optional check on the full model
(:mod:`hydro.tuning.verification`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import optuna
from torch import nn

from hydro.errors import ConfigError, HydroError
from hydro.tuning.loop import Loop
from hydro.tuning.options import DEFAULT_STORAGE, TuneOptions
from hydro.tuning.space import Space, check_space
from hydro.tuning.task import Task

__all__ = ["run"]


def run(
    trainer: Task | Loop,
    space: Space,
    options: TuneOptions,
    *,
    say: Callable[[str], Any] | None = None,
    data_source: Mapping[str, Any] | None = None,
    door: str = "python",
) -> Any:
    """Tune ``trainer`` over ``space`` as ``options`` say; returns a
    :class:`hydro.tuning.outputs.TuneResult`.

    Args:
        trainer: a :class:`hydro.Task` (Hydro's recipe) or a :class:`hydro.tuning.loop.Loop`
            (your own training function).
        space: a dict of Optuna distributions, or a function ``trial -> params``.
        options: the run's options (validated here).
        say: where the run's opening line goes (the study, where it stands, the ratio and
            fusion size); ``None``: nowhere.
        data_source: a config's ``{"name": "mod:fn", "args": {...}}`` for its data, kept in
            the study's definition.
        door: ``"python"`` or ``"cli"``: only the wording of the hints in errors.
    """
    from hydro.fx import cache as _cache
    from hydro.fx.floor import task_below_floor, task_ratio
    from hydro.tuning.engine import check_single_objective, drive, make_executor
    from hydro.tuning.fingerprint import check_study, fingerprint
    from hydro.tuning.group import check_device
    from hydro.tuning.outputs import TuneResult, open_study, task_recipe
    from hydro.tuning.progress import wanted
    from hydro.tuning.report import BELOW_FLOOR, below_floor_line
    from hydro.tuning.signals import terminate_as_interrupt
    from hydro.tuning.verification import check_steps, verify

    if not isinstance(trainer, (Task, Loop)):
        raise ConfigError(f"hydro.tune trains a hydro.Task or your own function train(run), got "
                          f"{type(trainer).__name__}")
    options = options.validate()
    options.device = check_device(options.device)
    options.progress = wanted(options.progress)  # None: on a terminal or in a notebook
    is_study = isinstance(options.study, optuna.Study)
    if isinstance(trainer, Loop) and options.compile:
        raise ConfigError(
            "compile applies to Hydro's own training step: with your own "
            "training function, compile inside it (torch.compile(run.model))"
        )
    if isinstance(trainer, Loop) and options.verify_top_k:  # said now, not after the search
        raise ConfigError("verify_top_k trains the full model with Hydro's recipe: with your "
                          "own loop, train the exported configurations yourself")
    if isinstance(trainer, Task) and options.verify_top_k:  # a budget it cannot train: now
        check_steps(options.verify_steps, trainer.steps)
    executor = make_executor(options.executor)
    check_space(space, _names(trainer), steps=trainer.steps if isinstance(trainer, Task) else None)
    try:
        built = preflight(trainer, space)
    except HydroError as exc:
        exc._hydro_task = True  # the CLI names the config file's task section
        raise
    if is_study:
        study = options.study
        check_single_objective(study)
    else:
        sampler = options.sampler or optuna.samplers.TPESampler(seed=options.seed,
                                                                constant_liar=True)
        study = open_study(options.storage, options.study, trainer.direction, sampler,
                           options.pruner)
    auto = options.ratio == "auto"
    recorded = recorded_ratio(study) if auto else None
    if auto and recorded is None and say is not None:  # a capture: seconds to minutes
        say("ratio auto: capturing the model to find the largest ratio within its width floors")
    ratio = recorded if recorded is not None else task_ratio(trainer, options.ratio)
    options = options.replace(ratio=ratio, executor=executor)
    name = study.study_name
    where = f"study {name!r}" + ("" if is_study else f" in {_storage_name(options.storage)}")
    definition = fingerprint(trainer, space, ratio=ratio, depth_ratio=options.depth_ratio,
                             depth_alpha=options.depth_alpha, model=built,
                             data_source=data_source)
    hints = {"new_name": "--study NAME, or study: in the config",
             "force_hint": "--force-resume"} if door == "cli" else {}
    check_study(study, definition, where=where, force=options.force_resume, **hints)
    study.set_user_attr("hydro_task", task_recipe(trainer))  # export's training recipe
    # Said from the capture a group reads from the capture cache next (the same example
    # shapes): free with the cache; without it, one more capture, which is left to the scale
    # warning. A preflight that could not build the model (searched architecture arguments)
    # cannot say, and a ratio "auto" just chose is within every floor.
    check = built is not None and not (auto and recorded is None) \
        and _cache.enabled(_cache.for_task(trainer))
    below = [str(lw) for lw in task_below_floor(trainer, ratio)] if check else []
    study.set_user_attr(BELOW_FLOOR, below)  # the export and the report say it too
    if say is not None:
        say(_opening(study, options, auto, recorded is not None))
        if below:
            say(below_floor_line(ratio, below))
    with terminate_as_interrupt():  # SIGTERM stops the run and verification as Ctrl-C does
        drive(study, trainer, space, options)
        if options.replicas:
            replicate(study, trainer, space, options)
        result = TuneResult(study, ratio)
        if options.verify_top_k:
            result.verification = verify(trainer, study, options.verify_top_k,
                                         steps=options.verify_steps, seed=options.base_seed,
                                         device=options.device)
            study.set_user_attr("hydro_verification", result.verification)
    return result


def replicate(study: optuna.Study, trainer: Task | Loop, space: Space,
              options: TuneOptions) -> None:
    """After the search: ``options.replicas`` more seeds of each of the ``options.leaders``
    best configurations (trials like any other, fused, never pruned), then the choice with
    their noise (:mod:`hydro.tuning.selection`), kept in the study's ``hydro_selection``.
    A rerun adds only the replicas still missing (of the leaders as they stand then)."""
    from hydro.tuning.engine import drive
    from hydro.tuning.report import trial_counts
    from hydro.tuning.selection import REPLICA_OF, SELECTION, configs, leaders, select

    c = trial_counts(study)
    if c["finished"] < options.n_trials or not c["complete"]:
        return  # the search stopped early (a timeout, a deadline) or completed nothing
    trials = study.get_trials(deepcopy=False)
    made: dict[int, int] = {}
    for t in trials:
        of = t.user_attrs.get(REPLICA_OF)
        if of is not None:
            made[of] = made.get(of, 0) + 1
    added = 0
    for lead in leaders(study, options.leaders):
        for _ in range(options.replicas - made.get(lead.number, 0)):
            study.enqueue_trial(dict(lead.params), user_attrs={REPLICA_OF: lead.number})
            added += 1
    if added:
        c = trial_counts(study)
        drive(study, trainer, space, options.replace(
            n_trials=c["finished"] + c["interrupted"] + added, first_group=0, timeout=None,
            deadline=None))
    chosen = select(configs(study.get_trials(deepcopy=False)),
                    study.best_trial.distributions,
                    maximize=study.direction == optuna.study.StudyDirection.MAXIMIZE)
    study.set_user_attr(SELECTION, chosen.as_dict() if chosen is not None else None)


def recorded_ratio(study: optuna.Study) -> int | None:
    """The ratio a study's definition recorded (``None``: a new study, or none recorded), which
    ``ratio="auto"`` keeps so that a study created under another default resumes."""
    from hydro.tuning.fingerprint import FINGERPRINT

    stored = study.user_attrs.get(FINGERPRINT)
    try:
        ratio = stored["parts"]["ratio"]["ratio"]
    except (KeyError, TypeError):
        return None
    return int(ratio) if isinstance(ratio, int) and ratio >= 1 else None


def preflight(trainer: Task | Loop, space: Space) -> nn.Module | None:
    """Build the target model (and, for a :class:`Task`, run it on a training batch) before
    any trial is asked, so a broken factory, model, loss or data set is one clear error instead
    of failed trials.

    Architecture choices take their first value in a dict space; with a function space and a
    factory that needs searched arguments the check waits for the first group (``None``).
    Returns the model it built (the study's fingerprint records its architecture).
    """
    arch: dict[str, Any] = {}
    names = trainer.model_args()
    if isinstance(space, Mapping):
        for name, dist in space.items():
            if name in names:
                arch[name] = (dist.choices[0] if hasattr(dist, "choices")
                              else getattr(dist, "low", None))
    if not isinstance(trainer.model, nn.Module):
        needed = [p.name for p in inspect.signature(trainer.model).parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                  and p.name not in arch]
        if needed:
            return None
    model = trainer.build_model(**arch)
    if isinstance(trainer, Task):
        trainer.validate(model, next(trainer.train_batches(2, seed=0)))
    return model


def _names(trainer: Task | Loop) -> set[str] | None:
    """The names a space may use besides Hydro's (``None``: any, your own loop reads them)."""
    return None if isinstance(trainer, Loop) else trainer.model_args()


def _storage_name(storage: Any) -> str:
    """A storage as a message names it: its URL, or its type."""
    if storage is None:
        return DEFAULT_STORAGE
    return storage if isinstance(storage, str) else type(storage).__name__


def _opening(study: optuna.Study, options: TuneOptions, auto: bool, kept: bool) -> str:
    """The run's first line: the study and where it stands, the ratio, the fusion size."""
    from hydro.tuning.report import trial_counts

    where = f"study '{study.study_name}' in {_storage_name(options.storage)}"
    c = trial_counts(study)
    target = options.n_trials
    if not (c["finished"] or c["interrupted"] or c["running"]):
        line = f"{where}: new, {target} trials to finish"
    else:
        line = (f"resuming {where}: {c['complete'] + c['pruned']} finished ({c['complete']} "
                f"complete, {c['pruned']} pruned)")
        if c["failed"]:
            line += f", {c['failed']} failed"
        if c["interrupted"]:
            line += f", {c['interrupted']} interrupted (resumed first)"
        if c["running"]:
            line += f", {c['running']} running elsewhere"
        line += f", {max(0, target - c['finished'])} to go"
    how = " (the study's)" if kept else " (auto)" if auto else ""
    depth = f", depth ratio {options.depth_ratio}" if options.depth_ratio > 1 else ""
    fuse = (f"{options.fuse} trials per fused group" if options.fuse != "auto" else
            "fuse auto (trials per fused group from the device's memory, per key)")
    return f"{line}; ratio {options.ratio}{how}{depth}, {fuse}"

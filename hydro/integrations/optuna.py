"""Optuna integration: a batched ask/tell driver for fused trial groups, and transfer sampling.

Optuna is the tuning brain: its samplers propose, its pruners prune (per member of a group), its
storages persist. :func:`optimize` asks trials in batches, trains each batch as fused groups,
reports every member's intermediate values and tells each result, so any sampler, pruner and
storage works unchanged. :class:`TransferSampler` starts a study on the full model from the best
configurations of a surrogate study.

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

import functools
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

from hydro.errors import ConfigError
from hydro.tuning.group import GroupInfo, Outcome, group_key, train_group
from hydro.tuning.space import Space, check_names, check_space, sample
from hydro.tuning.task import Task

__all__ = ["GroupCallback", "TransferSampler", "optimize"]

# A user's own group evaluation: given the asked trials (their params are in trial.params), train
# them however you like (report with trial.report, prune with trial.should_prune), and return one
# entry per trial: a float (complete), an optuna.TrialPruned (pruned), or another exception (fail).
GroupCallback = Callable[[list[optuna.Trial]], Sequence[Any]]

_INTERRUPTED = "interrupted: the process running it stopped; re-asked with the same parameters"


def optimize(
    study: optuna.Study,
    task_or_callback: Task | GroupCallback,
    space: Space | None = None,
    n_trials: int = 16,
    *,
    ratio: int = 8,
    fuse: int = 16,
    seed: int = 0,
    device: str = "cpu",
    progress: bool = False,
    timeout: float | None = None,
    executor: Any = None,
) -> None:
    """Run trials of ``study`` in fused groups until it has ``n_trials`` finished trials.

    Trials are asked ``fuse`` at a time (any Optuna sampler); trials that cannot share one fused
    model (different batch size or architecture arguments) are split into separate groups. Each
    member's intermediate values go to ``trial.report`` at every evaluation and a member the
    study's pruner prunes is dropped from its group. Every asked trial is told: COMPLETE,
    PRUNED or FAIL (with the reason in ``user_attrs["fail_reason"]``) — none is left RUNNING, even
    when training raises. A trial left RUNNING by an earlier crash or kill is failed and asked again
    with the same parameters, and finished trials count towards ``n_trials``, so running the same
    call again resumes the study.

    Args:
        study: the study (any sampler, pruner, storage; direction must match the task's).
        task_or_callback: a :class:`hydro.Task`, or a :data:`GroupCallback` for your own loop.
        space: the search space (a dict of distributions or a function of a trial); optional with
            a callback that suggests its own parameters.
        n_trials: finished trials (COMPLETE, PRUNED or FAIL) the study should have.
        ratio: surrogate width divisor.
        fuse: trials per fused group.
        seed: base seed (a trial's initialization and data seed is ``seed + trial.number``).
        device: where groups train.
        progress: print a one-line progress report to stderr after every group.
        timeout: stop asking new groups after this many seconds.
        executor: ``None`` trains groups in this process, one after another; a
            ``hydro_fluid`` executor (``LocalExecutor`` for worker processes on this machine,
            ``RayExecutor`` for a Ray cluster) trains one group per slot at once, streaming
            every member's intermediate values back here for the pruner. With an executor the
            task must be picklable (module-level functions, not lambdas).
    """
    if not isinstance(fuse, int) or fuse < 1:
        raise ConfigError(f"fuse must be a positive integer, got {fuse!r}")
    is_task = isinstance(task_or_callback, Task)
    if executor is not None and not is_task:
        raise ConfigError("an executor runs Hydro's training loop: pass a Task, not a callback")
    # with an executor, ask enough trials to give every slot a group
    batch = fuse * (len(getattr(executor, "slots", None) or [None]) if executor else 1)
    if is_task:
        if space is None:
            raise ConfigError("optimize(study, task, space, ...) needs a search space")
        check_space(space, task_or_callback.model_args())
        want = optuna.study.StudyDirection.MINIMIZE if task_or_callback.direction == "minimize" \
            else optuna.study.StudyDirection.MAXIMIZE  # fmt: skip
        if study.direction != want:
            raise ConfigError(f"the study's direction is {study.direction.name.lower()} but the "
                              f"task's is {task_or_callback.direction}")  # fmt: skip
    _recover_interrupted(study)
    if study.user_attrs.get("hydro_sampler_exhausted"):
        study.set_user_attr("hydro_sampler_exhausted", False)  # a new run may bring a new sampler
    start = time.perf_counter()
    group_id = _next_group_id(study)
    while True:
        remaining = n_trials - _finished(study)
        if remaining <= 0 or (timeout is not None and time.perf_counter() - start > timeout):
            break
        if study.user_attrs.get("hydro_sampler_exhausted"):
            break
        trials = [study.ask() for _ in range(min(batch, remaining))]
        told: set[int] = set()
        try:
            if executor is not None:
                used = _run_on_executor(study, task_or_callback, space, trials, ratio, seed,
                                        fuse, group_id, told, executor)  # fmt: skip
            elif is_task:
                used = _run_task_batch(study, task_or_callback, space, trials, ratio, seed,
                                       device, group_id, told)  # fmt: skip
            else:
                used = _run_callback_batch(study, task_or_callback, space, trials, group_id, told)
        except BaseException as exc:
            # whatever happened, no trial of this batch stays RUNNING
            stopped = isinstance(exc, KeyboardInterrupt)
            for t in trials:
                if t.number not in told:
                    reason = _INTERRUPTED if stopped else f"{type(exc).__name__}: {exc}"[:500]
                    t.set_user_attr("fail_reason", reason)
                    _tell_safely(study, t, state=TrialState.FAIL)
                    if stopped:  # asked again when the study resumes
                        study.enqueue_trial(t.params, skip_if_exists=False)
            raise
        group_id += used
        if progress:
            _progress(study, n_trials, start)


def _plan_groups(trials, task, space, ratio, fuse, group_id):  # noqa: ANN001, ANN202
    """Sample each trial, then split them into fused groups of at most ``fuse`` members that
    agree on :func:`group_key`, recording group id, ratio and size on every trial."""
    params: dict[int, dict] = {}
    by_key: dict[tuple, list[optuna.Trial]] = {}
    for t in trials:
        params[t.number] = sample(t, space)
        check_names(params[t.number], task.model_args())
        by_key.setdefault(group_key(params[t.number], task), []).append(t)
    groups = []
    for same in by_key.values():
        for i in range(0, len(same), fuse):
            members = same[i : i + fuse]
            for t in members:
                t.set_user_attr("group", group_id + len(groups))
                t.set_user_attr("ratio", ratio)
                t.set_user_attr("fused", len(members))
            groups.append(members)
    return groups, params


def _report_and_ask(trial: optuna.Trial, step: int, value: float) -> bool:
    """Give the study a member's intermediate value; True when its pruner prunes it."""
    trial.report(value, step)
    return trial.should_prune()


def _run_task_batch(study, task, space, trials, ratio, seed, device, group_id, told) -> int:  # noqa: ANN001
    groups, params = _plan_groups(trials, task, space, ratio, len(trials), group_id)
    for members in groups:
        outcomes, info = train_group(
            task, [params[t.number] for t in members], ratio=ratio,
            seeds=[seed + t.number for t in members], device=device,
            report=lambda k, step, value, members=members: _report_and_ask(members[k], step, value),
        )  # fmt: skip
        for t, outcome in zip(members, outcomes):
            _tell(study, t, outcome, info)
            told.add(t.number)
    return len(groups)


def _run_on_executor(study, task, space, trials, ratio, seed, fuse, group_id, told, executor):  # noqa: ANN001, ANN202
    from hydro_fluid import TrialGroup

    by_number = {t.number: t for t in trials}
    groups, params = _plan_groups(trials, task, space, ratio, fuse, group_id)
    fluid_groups = [
        TrialGroup(f"group-{group_id + i}", tuple(t.number for t in members),
                   (task.steps,) * len(members))
        for i, members in enumerate(groups)
    ]  # fmt: skip
    fn = functools.partial(_train_in_worker, task, params, ratio, seed)
    on_report = lambda number, step, value: _report_and_ask(by_number[number], step, value)  # noqa: E731
    for result in executor.run(fluid_groups, fn, report=on_report):
        outcomes, info = result.value if result.value is not None else ({}, None)
        for number in result.group.trial_ids:
            outcome = outcomes.get(number)
            if outcome is None:  # the worker never returned: the executor says why
                why = result.trials[number].reason or result.error or "the worker failed"
                outcome = Outcome("fail", None, 0, why)
            _tell(study, by_number[number], outcome, info)
            told.add(number)
    return len(groups)


def _train_in_worker(task, params, ratio, seed, group, ctx):  # noqa: ANN001, ANN202
    """A group's training in a hydro_fluid worker; reports and prunes through ``ctx``."""
    ids = list(group.trial_ids)

    def report(k: int, step: int, value: float) -> bool:
        ctx.report(ids[k], step, value)
        return ctx.is_pruned(ids[k])

    def pruned() -> set[int]:
        return {ids.index(t) for t in ctx.pruned if t in ids}

    outcomes, info = train_group(task, [params[i] for i in ids], ratio=ratio,
                                 seeds=[seed + i for i in ids], report=report,
                                 device=ctx.device, pruned=pruned)  # fmt: skip
    return dict(zip(ids, outcomes)), info


def _tell(
    study: optuna.Study, trial: optuna.Trial, outcome: Outcome, info: GroupInfo | None
) -> None:
    if info is not None:
        trial.set_user_attr("surrogate_widths", info.widths)
        trial.set_user_attr("group_seconds", round(info.seconds, 3))
        trial.set_user_attr("worker_pid", info.pid)
    if outcome.state == "complete" and outcome.value is not None and math.isfinite(outcome.value):
        _tell_safely(study, trial, outcome.value)
    elif outcome.state == "pruned":
        _tell_safely(study, trial, state=TrialState.PRUNED)
    else:
        trial.set_user_attr("fail_reason", outcome.reason or "no finite value")
        _tell_safely(study, trial, state=TrialState.FAIL)


def _run_callback_batch(study, callback, space, trials, group_id, told) -> int:  # noqa: ANN001
    if space is not None:
        for t in trials:
            sample(t, space)
    for t in trials:
        t.set_user_attr("group", group_id)
        t.set_user_attr("fused", len(trials))
    results = list(callback(trials))
    if len(results) != len(trials):
        raise ConfigError(f"the group callback returned {len(results)} results for "
                          f"{len(trials)} trials")  # fmt: skip
    for t, r in zip(trials, results):
        if isinstance(r, optuna.TrialPruned):
            _tell_safely(study, t, state=TrialState.PRUNED)
        elif isinstance(r, BaseException):
            t.set_user_attr("fail_reason", f"{type(r).__name__}: {r}")
            _tell_safely(study, t, state=TrialState.FAIL)
        else:
            _tell_safely(study, t, float(r))
        told.add(t.number)
    return 1


def _tell_safely(study: optuna.Study, trial: Any, *args: Any, **kwargs: Any) -> None:
    """``study.tell``, for a sampler that asks to stop when told (GridSampler, exhausted).

    Such a sampler calls ``study.stop()``, which Optuna allows only inside ``study.optimize``;
    the trial is already told by then, and the driver stops by itself once the sampler's space is
    exhausted, so the request is recorded instead of raised.
    """
    try:
        study.tell(trial, *args, **kwargs)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise
        study.set_user_attr("hydro_sampler_exhausted", True)


def _finished(study: optuna.Study) -> int:
    done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    trials = study.get_trials(deepcopy=False, states=done)
    return sum(1 for t in trials if t.user_attrs.get("fail_reason") != _INTERRUPTED)


def _next_group_id(study: optuna.Study) -> int:
    ids = [t.user_attrs.get("group", -1) for t in study.get_trials(deepcopy=False)]
    return max(ids, default=-1) + 1


def _recover_interrupted(study: optuna.Study) -> None:
    """Fail trials a crash left RUNNING, and ask their parameters again."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        optuna.trial.Trial(study, t._trial_id).set_user_attr("fail_reason", _INTERRUPTED)
        study.tell(t.number, state=TrialState.FAIL)
        if t.params:  # a trial killed before it was sampled has nothing to repeat
            study.enqueue_trial(t.params, skip_if_exists=False)


def _progress(study: optuna.Study, n_trials: int, start: float) -> None:
    from hydro.tuning.report import trial_counts

    count = trial_counts(study)  # an interrupted (re-asked) trial is not a failure
    try:
        best = f"{study.best_value:.4g}"
    except ValueError:
        best = "-"
    done = _finished(study)
    minutes = (time.perf_counter() - start) / 60
    rate = f"{done / minutes:.1f} trials/min" if minutes > 0 else ""
    again = f"  interrupted {count['interrupted']} (asked again)" if count["interrupted"] else ""
    print(
        f"\rtrials {done}/{n_trials}  complete {count['complete']}  pruned "
        f"{count['pruned']}  failed {count['failed']}{again}  best {best}  {rate}",
        end="" if done < n_trials else "\n",
        file=sys.stderr,
        flush=True,
    )


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
    ) -> Any:  # fmt: skip
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

    def after_trial(self, study, trial, state, values) -> None:  # noqa: ANN001
        self._base.after_trial(study, trial, state, values)

    def _replayed(self, trial: FrozenTrial) -> dict[str, Any] | None:
        return self._configs[trial.number] if trial.number < len(self._configs) else None

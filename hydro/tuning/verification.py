"""The check on the target: the study's best configurations train the full model, and the export
follows what the full model says.

After a search, :func:`verify` trains the unmodified model (ratio 1) with the ``top_k``
configurations the surrogates ranked best, fused into one group where they share a
:func:`~hydro.tuning.group.group_key`, for the task's steps or a shorter budget
(``verify_steps``). It returns both rankings and the full model's winner;
:func:`apply_choice` makes an export follow that winner and keep the surrogate's own best
beside it. :func:`check_steps` refuses a budget the task cannot train before any search.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from hydro.errors import ConfigError
from hydro.tuning.bookkeeping import trial_seed
from hydro.tuning.selection import ranked
from hydro.tuning.space import trained_params

__all__ = [
    "CHECK",
    "SURROGATE",
    "check_params",
    "check_steps",
    "check_task",
    "chosen_trial",
    "ranks",
    "spearman",
    "verify",
]

CHECK = "full-model check"  # provenance.chosen_by when the check's winner is exported
SURROGATE = "surrogate"  # ... when the surrogate's best is (no check, or no winner)


def check_steps(verify_steps: Any, steps: int) -> int:
    """The check's training steps: ``verify_steps``, or the task's ``steps`` for ``None``.

    Raises:
        ConfigError: ``verify_steps`` is not an integer from 1 to ``steps``, naming it.

    Example:
        >>> check_steps(None, 200), check_steps(50, 200)
        (200, 50)
        >>> check_steps(0, 200)
        Traceback (most recent call last):
        ...
        hydro.errors.ConfigError: verify_steps must be a positive number of steps, got 0
    """
    if verify_steps is None:
        return int(steps)
    if isinstance(verify_steps, bool) or not isinstance(verify_steps, int) or verify_steps < 1:
        raise ConfigError(f"verify_steps must be a positive number of steps, got "
                          f"{verify_steps!r}")
    if verify_steps > steps:
        raise ConfigError(f"verify_steps {verify_steps} is more than the task's steps ({steps}): "
                          f"the check trains at most as long as the search; give 1 to {steps}, "
                          f"or leave it unset for {steps}")
    return verify_steps


def check_task(task: Any, steps: int) -> Any:
    """``task`` shortened to ``steps`` for the check: its schedule spans ``steps`` and only the
    last step evaluates (the check reads nothing else). The task itself when nothing changes."""
    if steps == task.steps and task.eval_every >= steps:
        return task
    short = copy.copy(task)
    short.steps = steps
    short.eval_every = steps
    return short


def check_params(params: dict[str, Any], steps: int, full_steps: int) -> dict[str, Any]:
    """A configuration as the check trains it in ``steps`` of the search's ``full_steps``: a
    searched warm-up shrinks with the schedule (the same fraction of it, shorter than
    ``steps``); everything else as searched."""
    if steps == full_steps or not params.get("warmup"):
        return dict(params)
    warmup = round(int(params["warmup"]) * steps / full_steps)
    return {**params, "warmup": min(warmup, steps - 1)}


def verify(
    task: Any,
    study: optuna.Study,
    top_k: int,
    *,
    steps: int | None = None,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, Any]:
    """Train the full model with a study's ``top_k`` best configurations and rank them again.

    The full model is the task's model itself (ratio 1: standard parametrization, unmodified),
    trained by the same loop as the surrogates, every configuration from its trial's seed.
    Configurations that share a batch size and architecture train together in one fused group
    (each as it would alone). ``steps`` shortens the budget (``None``: the task's steps); the
    schedule then spans ``steps`` and a searched warm-up shrinks by the same fraction.

    Args:
        task: the study's :class:`hydro.Task`.
        study: the searched study. Its complete trials are ranked as configurations: seed
            replicas (``replicas``) of one configuration are one candidate, by their mean.
        top_k: how many of the best configurations to train, each once.
        steps: the check's training steps, 1 to the task's steps (``None``: all of them).
        seed: the search's base seed (each trial trains from its own seed, as in the search).
        device: where the full model trains.

    Returns:
        ``{"k", "steps", "configs", "surrogate_best", "winner", "agrees", "spearman"}``:
        ``configs`` in the surrogate's order, each ``{"trial", "params", "surrogate_value",
        "full_value", "surrogate_rank", "full_rank"}`` (``trial``: the configuration's first;
        ``surrogate_value``: its mean over its seeds; ranks from 1; a run that diverged has
        ``full_value`` and ``full_rank`` ``None``); ``surrogate_best`` and ``winner``: the trial
        numbers ranked first by each (``winner`` ``None`` when every run diverged); ``agrees``:
        whether they are the same; ``spearman``: the rank correlation of the two values over
        the runs that finished (``None`` below 2).

    Raises:
        ConfigError: ``top_k`` below 1, ``steps`` out of range, or no complete trial.
    """
    from hydro.tuning.group import group_key
    from hydro.tuning.lockstep import train_group

    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"verify_top_k must be a positive integer to check, got {top_k!r}")
    n_steps = check_steps(steps, task.steps)
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    reverse = task.direction == "maximize"
    # configurations, not trials: seed replicas of one configuration are one candidate, ranked
    # by its mean over seeds and trained once, as its first trial
    found = ranked(complete, reverse)[:top_k]
    first = {t.number: t for t in complete}
    top: list[FrozenTrial] = [first[c.trials[0]] for c in found]
    surrogate = {c.trials[0]: c.mean for c in found}
    if not top:
        raise ConfigError("no completed trial to verify: the search finished none")
    short = check_task(task, n_steps)
    trained = {t.number: check_params(trained_params(t), n_steps, task.steps) for t in top}
    groups: dict[tuple, list[FrozenTrial]] = {}
    for t in top:
        groups.setdefault(group_key(trained[t.number], task), []).append(t)
    full: dict[int, float | None] = {}
    for members in groups.values():
        outcomes, _ = train_group(short, [trained[t.number] for t in members], ratio=1,
                                  seeds=[trial_seed(t, seed) for t in members], device=device)
        for t, o in zip(members, outcomes):
            ok = o.state == "complete" and o.value is not None and math.isfinite(o.value)
            full[t.number] = float(o.value) if ok else None
    values = {n: v for n, v in full.items() if v is not None}  # the runs that finished
    finished = [t for t in top if t.number in values]
    order = sorted(finished, key=lambda t: values[t.number], reverse=reverse)
    full_rank = {t.number: i + 1 for i, t in enumerate(order)}
    rows = [{"trial": t.number, "params": trained_params(t),
             "surrogate_value": surrogate[t.number],
             "full_value": full[t.number], "surrogate_rank": i + 1,
             "full_rank": full_rank.get(t.number)} for i, t in enumerate(top)]
    winner = order[0].number if order else None
    rho = spearman([surrogate[t.number] for t in finished], [values[t.number] for t in finished])
    return {"k": top_k, "steps": n_steps, "configs": rows, "surrogate_best": top[0].number,
            "winner": winner, "agrees": winner == top[0].number, "spearman": rho}


def chosen_trial(study: optuna.Study, verification: dict[str, Any] | None) -> FrozenTrial | None:
    """The trial the check chose (its ``winner``), or ``None``: no check, or no winner."""
    winner = (verification or {}).get("winner")
    if winner is None:
        return None
    return next(t for t in study.get_trials(deepcopy=False) if t.number == int(winner))


def ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 0 in ascending order, ties sharing their average rank and NaN ranked last
    (as a run that diverged).

    Example:
        >>> ranks([0.3, 0.1, 0.3, float("nan")])
        [1.5, 0.0, 1.5, 3.0]
    """
    v = [math.inf if math.isnan(x) else float(x) for x in values]
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


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman rank correlation (average ranks for ties, NaN ranked worst, as a diverged run);
    None for fewer than 2 points or a constant side.

    Example:
        >>> round(spearman([1, 2, 3], [10, 30, 20]), 6), spearman([1, 2], [5, 5])
        (0.5, None)
    """
    if len(a) < 2:
        return None
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else None

"""``hydro.tune``: search on fused surrogates, then hand the answer back to the full model.

:func:`tune` builds the run's options and what it trains, and calls
:func:`hydro.tuning.run.run`; the result and the export are :mod:`hydro.tuning.outputs`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn

from hydro.errors import ConfigError
from hydro.tuning.options import TuneOptions
from hydro.tuning.outputs import TuneResult
from hydro.tuning.space import Space
from hydro.tuning.task import Task

__all__ = ["LOOP_ARGS", "tune"]


def tune(
    trainer: Task | Callable[..., Any],
    space: Space,
    *,
    model: nn.Module | Callable[..., nn.Module] | None = None,
    options: TuneOptions | None = None,
    **kwargs: Any,
) -> TuneResult:
    """Tune ``trainer`` over ``space`` on fused muP surrogates, resumably.

    Args:
        trainer: what to train: a :class:`hydro.Task` (Hydro's training recipe), or your own
            training function ``train(run)`` (docs/how-to/own-loop.md): pass the model as ``model=``
            and the loop's settings as keywords (``steps``, ``eval_every``, ``train_data``,
            ``val_data``, ``example_inputs``, ``example_kwargs``, ``batch_size``,
            ``direction``, ``checkpoint_every``; :class:`hydro.tuning.loop.Loop`), or a
            :class:`~hydro.tuning.loop.Loop`.
        space: a dict of Optuna distributions, or a function ``trial -> params`` calling
            ``trial.suggest_*``. With a Task, names: see
            :data:`hydro.tuning.space.HYPERPARAMETERS`, plus the model factory's keyword
            arguments; with your own function, any names (it reads them).
        model: with a training function: the target model or a factory returning one.
        options: a :class:`~hydro.tuning.options.TuneOptions`; keyword arguments override it.
        **kwargs: the run's options (:class:`~hydro.tuning.options.TuneOptions`, one table
            with their defaults in docs/reference/options.md): ``n_trials`` (32), ``ratio``
            ("auto"), ``fuse`` ("auto"), ``study`` ("hydro"), ``storage`` (``sqlite:///hydro.db``),
            ``sampler``, ``pruner``, ``executor``, ``seed``, ``verify_top_k``,
            ``verify_steps``, ``progress``,
            ``device``, ``depth_ratio``, ``depth_alpha``, ``first_group``, ``policy``,
            ``deadline``, ``checkpoint_dir``, ``checkpoint_every``, ``fuse_memory``,
            ``timeout``, ``compile``, ``world_size``, ``force_resume``, ``callbacks``,
            ``catch``. A study keeps what defines it (model, data, loss, metric, recipe,
            space, ratio): a rerun with another definition raises a
            :class:`~hydro.errors.ConfigError` naming what changed; ``ratio="auto"`` keeps the
            ratio a resumed study recorded.

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
    from hydro.tuning.loop import Loop
    from hydro.tuning.run import run

    names = {f.name for f in dataclasses.fields(TuneOptions)}
    loop_args = {k: kwargs.pop(k) for k in list(kwargs) if k in LOOP_ARGS}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ConfigError(f"hydro.tune got unknown option(s) {', '.join(unknown)}; the options "
                          f"are {', '.join(sorted(names))}"
                          + (f" (and, with a training function, {', '.join(sorted(LOOP_ARGS))})"
                             if not isinstance(trainer, Task) else ""))
    if isinstance(trainer, Task):
        if model is not None or loop_args:
            given = ", ".join(sorted(["model"] * (model is not None) + list(loop_args)))
            raise ConfigError(f"{given}: these describe your own training function; a Task "
                              "holds its model and data itself")
    elif isinstance(trainer, Loop):
        if model is not None or loop_args:
            raise ConfigError("a Loop holds its model and settings: pass them to Loop(...)")
    elif callable(trainer):
        if model is None:
            raise ConfigError("hydro.tune(train, space, model=...): your own training function "
                              "needs the model it trains (an nn.Module or a factory)")
        if "steps" not in loop_args:
            raise ConfigError("hydro.tune(train, space, model=..., steps=N): give the training "
                              "steps of each trial (the iterations of "
                              "`for step in run`)")
        trainer = Loop(train=trainer, model=model, **loop_args)
    opts = (options or TuneOptions()).replace(**kwargs)
    return run(trainer, space, opts)


# a training function's settings, given to hydro.tune beside the options (hydro.tuning.loop.Loop)
LOOP_ARGS = frozenset({"steps", "eval_every", "train_data", "val_data", "example_inputs",
                       "example_kwargs", "batch_size", "direction", "dynamic",
                       "cache"})

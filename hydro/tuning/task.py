"""``hydro.Task``: what to train. Hydro owns the loop, so fusion needs no change to user code."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hydro.errors import ConfigError

Data = tuple[Any, torch.Tensor] | Dataset | Callable[[int], Any]


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy that also takes sequence logits ``[B, T, V]`` with targets ``[B, T]``."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cross_entropy": cross_entropy,
    "mse": F.mse_loss,
}
OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULERS = ("none", "cosine", "linear", "step")


@dataclass
class Task:
    """What to train, stated once; Hydro trains its surrogates, fused, with its own loop.

    Args:
        model: the target model (an ``nn.Module`` initialized the way you train it), or a
            factory returning one. A factory's keyword arguments may be searched over
            (architecture choices); trials that differ in them are trained in separate groups.
        train_data: ``(inputs, targets)`` tensors (batches are drawn at random, the same batch
            for every trial of a group), a ``Dataset`` of ``(input, target)`` pairs, or a
            function ``batch_size -> iterable of (inputs, targets)`` (e.g. a ``DataLoader``
            factory).
        val_data: the same kinds; evaluated in full at every ``eval_every`` steps.
        loss: ``"cross_entropy"`` (sequence logits are flattened), ``"mse"``, or a function
            ``(output, target) -> scalar`` for one model.
        metric: what to optimize, a function ``(output, target) -> scalar`` averaged over the
            validation data; ``None`` (default) means the validation loss.
        direction: ``"minimize"`` or ``"maximize"`` the metric.
        optimizer: ``"adamw"`` (default), ``"adam"`` or ``"sgd"``.
        scheduler: ``"none"``, ``"cosine"`` (default), ``"linear"`` decay or ``"step"``; a
            ``warmup`` hyperparameter adds a linear warm-up in front.
        steps: training steps per trial.
        eval_every: steps between evaluations (the intermediate values pruners see).
        batch_size: the default batch size (a ``batch_size`` hyperparameter overrides it).
        example_inputs: inputs shaped like a batch, for tracing; by default the first
            training batch.

    Example:
        >>> import torch, hydro
        >>> x, y = torch.randn(256, 8), torch.randint(0, 3, (256,))
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(),
        ...                             torch.nn.Linear(64, 3))
        >>> task = hydro.Task(model=model, train_data=(x, y), val_data=(x, y),
        ...                   loss="cross_entropy", steps=20, eval_every=10, batch_size=32)
    """

    model: nn.Module | Callable[..., nn.Module]
    train_data: Data
    val_data: Data
    loss: str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = "cross_entropy"
    metric: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    direction: Literal["minimize", "maximize"] = "minimize"
    optimizer: Literal["adamw", "adam", "sgd"] = "adamw"
    scheduler: Literal["none", "cosine", "linear", "step"] = "cosine"
    steps: int = 100
    eval_every: int | None = None
    batch_size: int = 32
    example_inputs: tuple[Any, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.loss, str):
            if self.loss not in LOSSES:
                raise ConfigError(
                    f"unknown loss {self.loss!r}: use one of {sorted(LOSSES)} or a function "
                    "(output, target) -> scalar"
                )
            self.loss = LOSSES[self.loss]
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}: use one of {OPTIMIZERS}")
        if self.scheduler is None:
            self.scheduler = "none"
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"unknown scheduler {self.scheduler!r}: use one of {SCHEDULERS}")
        if self.direction not in ("minimize", "maximize"):
            raise ConfigError(f"direction must be 'minimize' or 'maximize', not {self.direction!r}")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ConfigError(f"steps must be a positive integer, got {self.steps!r}")
        if self.eval_every is None:
            self.eval_every = max(1, self.steps // 4)
        if not isinstance(self.model, nn.Module) and not callable(self.model):
            raise ConfigError("model must be an nn.Module or a function returning one")
        for name, data in (("train_data", self.train_data), ("val_data", self.val_data)):
            _check_data(name, data)

    # --- the model ------------------------------------------------------------------------

    def model_args(self) -> set[str]:
        """Keyword arguments of a model factory (searchable architecture choices)."""
        if isinstance(self.model, nn.Module):
            return set()
        params = inspect.signature(self.model).parameters.values()
        return {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}

    def build_model(self, **arch: Any) -> nn.Module:
        """The target model, for the given architecture choices."""
        if isinstance(self.model, nn.Module):
            return self.model
        model = self.model(**arch)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"the model factory returned {type(model).__name__}, not a module")
        return model

    # --- data -----------------------------------------------------------------------------

    def train_batches(self, batch_size: int, seed: int) -> Iterator[tuple[Any, torch.Tensor]]:
        """An endless stream of training batches (the same stream for the same seed)."""
        data = self.train_data
        if isinstance(data, tuple):
            x, y = data
            g = torch.Generator().manual_seed(seed)
            while True:
                idx = torch.randint(0, len(y), (batch_size,), generator=g)
                yield _index(x, idx), y[idx]
        else:
            while True:
                yielded = False
                for batch in _loader(data, batch_size, shuffle=True, seed=seed):
                    yielded = True
                    yield batch[0], batch[1]
                if not yielded:
                    raise ConfigError("train_data produced no batch")
                seed += 1

    def val_batches(self, batch_size: int) -> Iterator[tuple[Any, torch.Tensor]]:
        """The validation data in order, in batches."""
        data = self.val_data
        if isinstance(data, tuple):
            x, y = data
            for i in range(0, len(y), batch_size):
                yield _index(x, slice(i, i + batch_size)), y[i : i + batch_size]
        else:
            for batch in _loader(data, batch_size, shuffle=False, seed=0):
                yield batch[0], batch[1]

    def inputs_of(self, batch_inputs: Any) -> tuple[Any, ...]:
        return tuple(batch_inputs) if isinstance(batch_inputs, (tuple, list)) else (batch_inputs,)


def _check_data(name: str, data: Any) -> None:
    if isinstance(data, tuple):
        if len(data) != 2 or not isinstance(data[1], torch.Tensor):
            raise ConfigError(f"{name} as a tuple must be (inputs, targets) with tensor targets")
        return
    if isinstance(data, Dataset) or callable(data):
        return
    raise ConfigError(
        f"{name} must be an (inputs, targets) tuple of tensors, a Dataset, or a function "
        f"batch_size -> iterable of batches; got {type(data).__name__}"
    )


def _index(x: Any, idx: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return type(x)(t[idx] for t in x)
    return x[idx]


def _loader(data: Any, batch_size: int, shuffle: bool, seed: int) -> Any:
    if isinstance(data, Dataset):
        g = torch.Generator().manual_seed(seed)
        return DataLoader(data, batch_size=batch_size, shuffle=shuffle, drop_last=shuffle,
                          generator=g)  # fmt: skip
    return data(batch_size)

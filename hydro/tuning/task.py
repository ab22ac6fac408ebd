"""``hydro.Task``: what to train. Hydro owns the loop, so fusion needs no change to user code."""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hydro.errors import ConfigError, DataError, HydroWarning, ModelError, TraceError
from hydro.fx.capture import check_dynamic

Data = tuple[Any, torch.Tensor] | Mapping[str, torch.Tensor] | Dataset | Callable[[int], Any]
# a batch: ``(inputs, targets)`` or a dict of keyword inputs (the targets under ``target_key``)
Batch = tuple[Any, torch.Tensor] | dict[str, Any]


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy that also takes sequence logits ``[B, T, V]`` with targets ``[B, T]``."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cross_entropy": cross_entropy,
    "mse": F.mse_loss,
}
MODEL_LOSS = "model"  # the model computes its own loss: read ``.loss`` or ``["loss"]``
OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULERS = ("none", "cosine", "linear", "step")
IGNORE_INDEX = -100  # F.cross_entropy's default: labels equal to it are skipped
DATA_MODES = ("per_trial", "shared")


@dataclass
class Task:
    """What to train, stated once; Hydro trains its surrogates, fused, with its own loop.

    Args:
        model: the target model (an ``nn.Module`` initialized the way you train it), or a
            factory returning one. A factory's keyword arguments may be searched over
            (architecture choices); trials that differ in them are trained in separate groups.
        train_data: ``(inputs, targets)`` tensors (batches are drawn at random); a dict of
            equal-length tensors, whose batches are dicts passed to the model as keyword
            inputs (``input_ids=``, ``attention_mask=``, ``labels=``, ``pixel_values=`` ...);
            a ``Dataset`` of ``(input, target)`` pairs or of dicts; a ``DataLoader`` (its dataset,
            collate function and worker settings: each trial reads its own shuffled loader of
            the same kind, at the trial's batch size); or a function
            ``batch_size -> iterable of batches``.
        val_data: the same kinds; evaluated in full at every ``eval_every`` steps.
        loss: ``"cross_entropy"`` (sequence logits are flattened), ``"mse"``, a function
            ``(output, target) -> scalar`` for one model, or ``"model"`` for a model that
            computes its own loss (its output's ``.loss`` or ``["loss"]`` is used, as with a
            HuggingFace model given ``labels=``).
        target_key: with dict batches, the key of the targets (default ``"labels"``). With a
            loss function it is taken out of the batch and the rest goes to the model; with
            ``loss="model"`` the whole batch goes to the model. With ``(inputs, targets)``
            batches and ``loss="model"`` the targets go to the model under this keyword.
        metric: what to optimize, a function ``(output, target) -> scalar`` averaged over the
            validation data (a model output that is not a tensor gives its ``logits``);
            ``None`` (default) means the validation loss.
        direction: ``"minimize"`` or ``"maximize"`` the metric.
        optimizer: ``"adamw"`` (default), ``"adam"`` or ``"sgd"``.
        scheduler: ``"none"``, ``"cosine"`` (default), ``"linear"`` decay or ``"step"``; a
            ``warmup`` hyperparameter adds a linear warm-up in front.
        steps: training steps per trial.
        eval_every: steps between evaluations (the intermediate values pruners see).
        eval_samples: validation samples the intermediate evaluations read: a fixed subsample
            of the validation data (the same for every trial, group and resume: drawn from
            seed 0), so the values pruners compare cost less; a trial's last evaluation, its
            reported value, reads all of it. ``None`` (default): all of it every time. Data
            that cannot be indexed (a ``DataLoader``, a function) gives its first batches.
            ``"auto"``: the size is measured: the first evaluation of two trials or more reads
            every block and picks the fewest that rank the trials as the whole split does
            (:mod:`hydro.tuning.eval_sample`); the study records it for every later group,
            process and resume.
        precision: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"``: the forward pass and the
            losses run under ``torch.autocast`` with bfloat16 or float16 (parameters,
            gradients and the optimizer stay float32), in training and evaluation. float16
            scales each trial's loss on its own (:class:`hydro.tuning.loss_scale.LossScales`,
            GradScaler's rule): an overflow skips that trial's step only. float16 is for
            GPUs; on a CPU it runs, slowly.
        batch_size: the default batch size (a ``batch_size`` hyperparameter overrides it);
            default a ``DataLoader``'s own, else 32.
        example_inputs: inputs shaped like a batch, for capture; by default the first
            training batch.
        target_key: with dict batches, the key of the targets (popped before the model call
            unless ``loss="model"``).
        checkpoint_every: fused steps between checkpoints of a group's trials (in process or
            on an executor), so a retried group, or a trial re-asked after its tuner died,
            resumes where it stopped (0: never).
        dynamic: sizes besides the batch left dynamic at capture, for validation batches of
            another sequence length than the training batches: ``"auto"`` or ``{"seq": 1}``
            (``hydro.scale``'s ``dynamic``); ``None`` (default) fixes them to the example's.
        data_mode: ``"per_trial"`` (default): every trial reads its own stream of training
            batches (from its seed), so its result does not depend on its group.
            ``"shared"``: the members of a fused group all train on one stream, the group's
            (from its first trial's seed): each step loads and copies one batch for the group
            instead of one per trial, at the cost of results that depend on the group.
            Validation data is loaded once per group either way.
        cache: read and write the on-disk capture cache (:mod:`hydro.fx.cache`), so that a
            second run, a resume and every executor worker skip ``torch.export`` (``True``,
            default; ``HYDRO_CACHE=0`` turns it off too). ``False``: capture afresh and write
            nothing.

    Raises:
        ConfigError: an unknown loss, optimizer or scheduler, or a count that is not positive.
        DataError: inputs and targets of different lengths, a dict batch without its targets,
            NaN or infinity in the data, float targets for ``"cross_entropy"``.

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
    eval_samples: int | Literal["auto"] | None = None
    batch_size: int | None = None
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    example_inputs: tuple[Any, ...] | None = None
    target_key: str = "labels"
    checkpoint_every: int = 50
    dynamic: Any = None
    data_mode: Literal["per_trial", "shared"] = "per_trial"
    cache: bool = True

    def __post_init__(self) -> None:
        self.loss_name = self.loss if isinstance(self.loss, str) else _name(self.loss)
        if isinstance(self.loss, str) and self.loss != MODEL_LOSS:
            if self.loss not in LOSSES:
                raise ConfigError(
                    f"unknown loss {self.loss!r}: use one of {sorted(LOSSES)}, 'model' (the "
                    "model returns its own loss) or a function (output, target) -> scalar"
                )
            self.loss = LOSSES[self.loss]
        elif not isinstance(self.loss, str) and not callable(self.loss):
            raise ConfigError(f"loss must be a name or a function, got {type(self.loss).__name__}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}: use one of {OPTIMIZERS}")
        if self.scheduler is None:
            self.scheduler = "none"
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"unknown scheduler {self.scheduler!r}: use one of {SCHEDULERS}")
        if self.data_mode not in DATA_MODES:
            raise ConfigError(
                f"data_mode must be 'per_trial' (each trial its own batches, the default) or "
                f"'shared' (one batch per step for the whole fused group), got {self.data_mode!r}"
            )
        check_settings(self)
        if not isinstance(self.target_key, str):
            raise ConfigError(f"target_key must be a string, got {self.target_key!r}")
        for name, data in (("train_data", self.train_data), ("val_data", self.val_data)):
            self._check_data(name, data)

    # --- the model ------------------------------------------------------------------------

    def model_args(self) -> set[str]:
        """Keyword arguments of a model factory (searchable architecture choices)."""
        return factory_args(self.model)

    def build_model(self, **arch: Any) -> nn.Module:
        """The target model, for the given architecture choices.

        Raises:
            ModelError: the factory raised (naming the factory and its arguments) or returned
                something that is not a module.
        """
        if isinstance(self.model, nn.Module):
            return self.model
        try:
            model = self.model(**arch)
        except Exception as exc:  # any error of user code, reported with its call
            raise ModelError(
                f"the model factory {_call(self.model, arch)} raised {type(exc).__name__}: "
                f"{exc}. Check its arguments (model_args and searched architecture choices)."
            ) from exc
        if not isinstance(model, nn.Module):
            raise ModelError(
                f"the model factory {_call(self.model, arch)} returned {type(model).__name__}, "
                "not an nn.Module"
            )
        return model

    def validate(self, model: nn.Module, batch: Batch) -> None:
        """Check the model against a batch before any training: it has parameters, runs, and
        its output suits the loss (one loss for ``loss="model"``; for cross-entropy, labels
        within the number of classes the output has).

        Raises:
            ModelError: no parameters, the forward fails, or no loss in the output.
            DataError: labels outside the classes of the output, or the loss rejects it.
        """
        if not any(True for _ in model.parameters()):
            raise ModelError(
                f"the model ({type(model).__name__}) has no parameters: there is nothing to "
                "train. Pass the model itself, with its layers."
            )
        if any(p.is_meta for p in model.parameters()):
            return  # a target built on the meta device (for its shapes only) cannot run
        args, kwargs, target = self.split(batch)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = model(*args, **kwargs)
        except Exception as exc:  # user code: report it with what it was given
            raise ModelError(
                f"running the model ({type(model).__name__}) on a batch of train_data failed: "
                f"{type(exc).__name__}: {exc}. Inputs were {_describe(args, kwargs)}."
            ) from exc
        finally:
            model.train(was_training)
        if self.loss == MODEL_LOSS:
            loss = _model_loss(out, self.target_key)
            if loss.numel() != 1:
                raise ModelError(
                    f"with loss='model' the model must return one scalar loss, got shape "
                    f"{tuple(loss.shape)}"
                )
            return
        logits = self.logits_of(out)
        if self.loss is LOSSES["cross_entropy"] and logits.dim() >= 1:
            classes = logits.shape[-1]
            for name, data in (("train_data", self.train_data), ("val_data", self.val_data)):
                labels = self._targets(data)
                if labels is None or labels.numel() == 0 or labels.is_floating_point():
                    continue
                valid = labels[labels != IGNORE_INDEX]
                if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= classes):
                    raise DataError(
                        f"{name}: labels range over [{int(valid.min())}, {int(valid.max())}] but "
                        f"the model outputs {classes} classes (the last dimension of its "
                        f"output): cross_entropy needs labels in [0, {classes - 1}] "
                        f"({IGNORE_INDEX} to ignore a position). Fix the labels or the model's "
                        "number of outputs."
                    )
        try:
            value = self.loss(logits, target)
        except Exception as exc:  # user code or a shape mismatch
            raise DataError(
                f"the loss {self.loss_name} fails on the model's output "
                f"{tuple(logits.shape)} and the targets {_shape(target)}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise ConfigError(
                f"the loss {self.loss_name} must return a scalar for one model, got {_shape(value)}"
            )

    # --- data -----------------------------------------------------------------------------

    def train_batches(self, batch_size: int, seed: int) -> Iterator[Batch]:
        """An endless stream of training batches (the same stream for the same seed)."""
        if isinstance(self.train_data, (tuple, Mapping)) and _length(self.train_data) < batch_size \
                and batch_size not in self.__dict__.setdefault("_small", set()):
            self._small.add(batch_size)  # once per task and batch size, not per trial
            _warn_small(_length(self.train_data), batch_size)
        return train_stream(self.train_data, batch_size, seed)

    def val_batches(self, batch_size: int) -> Iterator[Batch]:
        """The validation data in order, in batches."""
        return val_stream(self.val_data, batch_size)

    def val_sample(self, samples: int | None = None) -> Iterator[Batch] | None:
        """The fixed validation subsample of the intermediate evaluations (``eval_samples``, or
        ``samples`` where given: with ``"auto"``, the size the study measured), in blocks of
        :data:`SAMPLE_BLOCK`; ``None`` where every evaluation reads everything."""
        samples = samples if samples is not None else self.eval_samples
        if samples is None or samples == "auto":
            return None
        return val_sample(self.val_data, samples)

    def val_blocks(self) -> Iterator[Batch]:
        """Every block of the validation split in the subsamples' fixed order
        (:func:`sample_order`; data that cannot be indexed: its batches of 64 in order)."""
        if isinstance(self.val_data, (tuple, Mapping)):
            size = _length(self.val_data)
            return (_take(self.val_data, slice(i * SAMPLE_BLOCK, (i + 1) * SAMPLE_BLOCK))
                    for i in sample_order(size))
        return val_stream(self.val_data, SAMPLE_BLOCK)

    def inputs_of(self, batch_inputs: Any) -> tuple[Any, ...]:
        """The positional model inputs of the inputs part of an ``(inputs, targets)`` batch."""
        return tuple(batch_inputs) if isinstance(batch_inputs, (tuple, list)) else (batch_inputs,)

    def split(self, batch: Batch, device: Any = None) -> tuple[tuple, dict[str, Any], Any]:
        """A batch as ``(args, kwargs, target)``: call the model as ``model(*args, **kwargs)``.

        With dict batches the inputs are keywords; the target is popped under ``target_key``
        for a loss function, or left in (and also returned) for ``loss="model"``.
        """
        if isinstance(batch, Mapping):
            kwargs = {k: _to(v, device) for k, v in batch.items()}
            if self.loss == MODEL_LOSS:
                return (), kwargs, kwargs.get(self.target_key)
            if self.target_key not in kwargs:
                raise DataError(
                    f"a batch has no {self.target_key!r} (keys: {sorted(kwargs)}): name the "
                    "targets' key with Task(target_key=...) or use loss='model'"
                )
            target = kwargs.pop(self.target_key)
            return (), kwargs, target
        x, y = batch
        args = tuple(_to(t, device) for t in self.inputs_of(x))
        if self.loss == MODEL_LOSS:
            return args, {self.target_key: _to(y, device)}, _to(y, device)
        return args, {}, _to(y, device)

    def batch_len(self, batch: Batch) -> int:
        """Examples in a batch."""
        return _batch_len(batch)

    # --- losses of a fused model ----------------------------------------------------------

    def logits_of(self, output: Any) -> torch.Tensor:
        """The tensor a loss or metric function reads: the output, or its ``logits``."""
        if isinstance(output, torch.Tensor):
            return output
        logits = _field(output, "logits")
        if isinstance(logits, torch.Tensor):
            return logits
        raise ModelError(
            f"the model returned {type(output).__name__}, not a tensor and without 'logits': "
            "return the predictions as a tensor, or compute the loss in the model and use "
            "loss='model'"
        )

    def trial_losses(self, output: Any, target: Any, shared: bool = True) -> torch.Tensor:
        """Each trial's training loss ``[n]`` from a fused model's output; ``shared=False``:
        ``target`` has a leading ``[n]``, each trial's own batch."""
        from hydro.fusion import trial_loss

        if self.loss == MODEL_LOSS:
            loss = _model_loss(output, self.target_key)
            if loss.dim() != 1:
                raise ModelError(
                    f"a fused model with loss='model' must give one loss per trial, shape [n]; "
                    f"got {tuple(loss.shape)}"
                )
            return loss
        return trial_loss(self.loss, self.logits_of(output), target, shared=shared)

    def trial_metrics(self, output: Any, target: Any) -> torch.Tensor:
        """Each trial's validation metric ``[n]`` for one batch (the loss without a metric)."""
        from hydro.fusion import trial_loss

        if self.metric is None:
            return self.trial_losses(output, target)
        return trial_loss(self.metric, self.logits_of(output), target)

    # --- checks -----------------------------------------------------------------------------

    def _targets(self, data: Any) -> torch.Tensor | None:
        if isinstance(data, tuple):
            return data[1]
        if isinstance(data, Mapping):
            return data.get(self.target_key)
        return None

    def _check_data(self, name: str, data: Any) -> None:
        if isinstance(data, tuple):
            if len(data) != 2 or not isinstance(data[1], torch.Tensor):
                raise DataError(
                    f"{name} as a tuple must be (inputs, targets) with tensor targets; got a "
                    f"tuple of {len(data)}"
                )
            x, y = data
            inputs = x if isinstance(x, (tuple, list)) else (x,)
            for i, t in enumerate(inputs):
                if isinstance(t, torch.Tensor) and len(t) != len(y):
                    which = "inputs" if len(inputs) == 1 else f"inputs[{i}]"
                    raise DataError(
                        f"{name}: {which} have {len(t)} rows but targets {len(y)}: give inputs "
                        "and targets the same length (one target per example)"
                    )
            tensors = {("inputs" if len(inputs) == 1 else f"inputs[{i}]"): t
                       for i, t in enumerate(inputs)}
            tensors["targets"] = y
        elif isinstance(data, Mapping):
            if not data:
                raise DataError(f"{name} is an empty dict: give it tensors, e.g. input_ids=...")
            bad = [k for k, v in data.items() if not isinstance(v, torch.Tensor)]
            if bad:
                raise DataError(
                    f"{name}[{bad[0]!r}] is {type(data[bad[0]]).__name__}: a dict of data must "
                    "hold tensors of equal length"
                )
            lengths = {k: len(v) for k, v in data.items()}
            if len(set(lengths.values())) > 1:
                raise DataError(
                    f"{name}: the tensors have different lengths ({lengths}): give every key "
                    "one row per example"
                )
            if self.loss != MODEL_LOSS and self.target_key not in data:
                raise DataError(
                    f"{name} has no {self.target_key!r} key (keys: {sorted(data)}): name the "
                    "targets' key with Task(target_key=...), or use loss='model' for a model "
                    "that computes its own loss"
                )
            tensors = dict(data)
            y = data.get(self.target_key)
        else:
            check_data(name, data)  # a Dataset, a DataLoader or a factory: read as it trains
            return
        if len(y if isinstance(y, torch.Tensor) else next(iter(tensors.values()))) == 0:
            raise DataError(f"{name} is empty: give it at least one example")
        for key, t in tensors.items():
            _check_finite(name, key, t)
        if (
            self.loss is LOSSES["cross_entropy"]
            and isinstance(y, torch.Tensor)
            and y.is_floating_point()
        ):
            raise DataError(
                f"{name}: the targets are {str(y.dtype).replace('torch.', '')} but loss "
                "'cross_entropy' needs integer class labels: convert them with .long(), use "
                "loss='mse' for regression, or pass torch.nn.functional.cross_entropy for "
                "class probabilities"
            )


def check_settings(obj: Any) -> None:
    """Check, and default, the settings a :class:`Task` and your own training function
    (:class:`hydro.tuning.loop.Loop`) share: ``direction``, ``cache``, ``steps``,
    ``batch_size`` (a ``DataLoader``'s own, else 32), ``eval_every`` (``steps // 4``),
    ``checkpoint_every``, ``dynamic`` and ``model``.

    Raises:
        ConfigError: the first setting that is wrong, naming it.
    """
    if obj.direction not in ("minimize", "maximize"):
        raise ConfigError(f"direction must be 'minimize' or 'maximize', not {obj.direction!r}")
    if not isinstance(obj.cache, bool):
        raise ConfigError(f"cache must be true (the on-disk capture cache, the default) "
                          f"or false (capture afresh, write nothing), got "
                          f"{obj.cache!r}")
    _positive(obj.steps, "steps")
    if obj.batch_size is None:  # a DataLoader's own, else 32
        loader = obj.train_data if isinstance(obj.train_data, DataLoader) else None
        obj.batch_size = int(loader.batch_size or 32) if loader is not None else 32
    _positive(obj.batch_size, "batch_size")
    if obj.eval_every is None:
        obj.eval_every = max(1, obj.steps // 4)
    _positive(obj.eval_every, "eval_every")
    if getattr(obj, "eval_samples", None) not in (None, "auto"):
        if isinstance(obj.eval_samples, str):
            raise ConfigError(f"eval_samples must be a positive integer or 'auto', got "
                              f"{obj.eval_samples!r}")
        _positive(obj.eval_samples, "eval_samples")
    if getattr(obj, "precision", "fp32") not in PRECISIONS:
        names = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
        hint = f" (did you mean {names[obj.precision]!r}?)" if obj.precision in names else ""
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got "
                          f"{obj.precision!r}{hint}")
    ce = obj.checkpoint_every
    if isinstance(ce, bool) or not isinstance(ce, int) or ce < 0:
        raise ConfigError(f"checkpoint_every must be an integer >= 0 (0: never), got {ce!r}")
    try:
        check_dynamic(obj.dynamic)
    except TraceError as exc:
        raise ConfigError(str(exc)) from exc
    if not isinstance(obj.model, nn.Module) and not callable(obj.model):
        raise ConfigError("model must be an nn.Module or a function returning one")


def factory_args(model: Any) -> set[str]:
    """The keyword arguments of a model factory (searchable architecture choices); none for a
    module."""
    if isinstance(model, nn.Module):
        return set()
    params = inspect.signature(model).parameters.values()
    return {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def train_stream(data: Data, batch_size: int, seed: int) -> Iterator[Batch]:
    """An endless stream of training batches of ``data`` (any kind a :class:`Task` takes), the
    same stream for the same seed: tensors are drawn at random, a ``Dataset`` or
    ``DataLoader`` is shuffled epoch after epoch."""
    if isinstance(data, (tuple, Mapping)):
        g = torch.Generator().manual_seed(seed)
        size = _length(data)
        while True:
            idx = torch.randint(0, size, (batch_size,), generator=g)
            yield _take(data, idx)
    while True:
        yielded = False
        for batch in _loader(data, batch_size, shuffle=True, seed=seed):
            yielded = True
            yield _batch(batch)
        if not yielded:
            size = len(data.dataset if isinstance(data, DataLoader) else data) \
                if hasattr(data, "__len__") else None
            if size is not None and size < batch_size:
                raise DataError(
                    f"train_data holds {size} samples, fewer than one batch of "
                    f"{batch_size} (a Dataset's last partial batch is dropped); use a "
                    f"batch_size of at most {size}, or more training data"
                )
            raise DataError("train_data produced no batch")
        seed += 1


def val_stream(data: Data, batch_size: int) -> Iterator[Batch]:
    """The batches of ``data`` in order, once."""
    if isinstance(data, (tuple, Mapping)):
        size = _length(data)
        for i in range(0, size, batch_size):
            yield _take(data, slice(i, i + batch_size))
    else:
        for batch in _loader(data, batch_size, shuffle=False, seed=0):
            yield _batch(batch)


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # -> autocast dtype


def autocast(precision: str, device: Any) -> Any:
    """The autocast context of ``precision`` on ``device`` (a no-op context for fp32)."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


SAMPLE_BLOCK = 64  # samples per block of the validation subsample (its unit, and the batch)


def sample_blocks(size: int, samples: int) -> list[int] | None:
    """Which blocks of :data:`SAMPLE_BLOCK` samples (in order) of a split of ``size`` make up
    its subsample of about ``samples``: drawn once from seed 0, so every trial, group, process
    and resume reads the same; ``None`` where that is the whole split.

    >>> sample_blocks(726, 128)
    [0, 8]
    >>> sample_blocks(100, 128) is None
    True
    """
    k = -(-samples // SAMPLE_BLOCK)
    order = sample_order(size)
    if k >= len(order):
        return None
    return sorted(order[:k])


def sample_order(size: int) -> list[int]:
    """The fixed order (seed 0) in which subsamples take the blocks of a split of ``size``
    samples: a subsample of ``k`` blocks is the first ``k``.

    >>> sorted(sample_order(726)[:2]) == sample_blocks(726, 128)
    True
    """
    blocks = -(-size // SAMPLE_BLOCK)
    return torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).tolist()


def val_sample(data: Data, samples: int) -> Iterator[Batch] | None:
    """The validation subsample (:func:`sample_blocks`), one block a batch; data that cannot be
    indexed (a ``DataLoader``, a function) gives its first batches of 64 holding ``samples``.
    ``None``: the subsample would be the whole split."""
    if isinstance(data, (tuple, Mapping)):
        chosen = sample_blocks(_length(data), samples)
        if chosen is None:
            return None
        return (_take(data, slice(i * SAMPLE_BLOCK, (i + 1) * SAMPLE_BLOCK)) for i in chosen)

    def first() -> Iterator[Batch]:
        seen = 0
        for batch in val_stream(data, SAMPLE_BLOCK):
            if seen >= samples:
                return
            seen += _batch_len(batch)
            yield batch

    return first()


def _batch_len(batch: Batch) -> int:
    if isinstance(batch, Mapping):
        return len(next(iter(batch.values())))
    return len(batch[1])


def check_data(name: str, data: Any) -> None:
    """A one-line :class:`DataError` unless ``data`` is a kind of data Hydro reads: an
    ``(inputs, targets)`` tuple, a dict of tensors, a ``Dataset``, a ``DataLoader`` or a
    function ``batch_size -> iterable of batches``."""
    if isinstance(data, (tuple, Mapping, Dataset, DataLoader)) or callable(data):
        return
    raise DataError(
        f"{name} must be an (inputs, targets) tuple of tensors, a dict of tensors, a Dataset, "
        f"a DataLoader, or a function batch_size -> iterable of batches; got "
        f"{type(data).__name__}"
    )


def _warn_small(size: int, batch_size: int) -> None:
    """Warn that every batch repeats samples of a training set smaller than one batch."""
    warnings.warn(HydroWarning(
        f"train_data holds {size} samples, fewer than a batch of {batch_size}: every batch "
        "draws them with replacement, so each repeats samples; use a batch_size of at most "
        f"{size}, or more training data"), stacklevel=3)


def _positive(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _check_finite(name: str, key: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
        return
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        row = int(bad.reshape(len(t), -1).any(1).nonzero()[0, 0]) if t.dim() else 0
        kind = "NaN" if bool(torch.isnan(t).any()) else "infinity"
        count = int(bad.sum())
        raise DataError(
            f"{name}: {key} contain {kind} (first at index {row}, {count} "
            f"value{'s' if count != 1 else ''} in all): every trial would diverge. Clean or drop "
            "those rows first, e.g. "
            "keep = torch.isfinite(x).flatten(1).all(1)"
        )


def _model_loss(output: Any, target_key: str) -> torch.Tensor:
    loss = _field(output, "loss")
    if not isinstance(loss, torch.Tensor):
        got = type(output).__name__
        raise ModelError(
            f"loss='model' reads the model's loss from output.loss or output['loss'], but the "
            f"model returned {got} without one: pass the targets to the model (the batch's "
            f"{target_key!r}) so it computes its loss, or give Task a loss function"
        )
    return loss


def _field(output: Any, name: str) -> Any:
    if isinstance(output, Mapping):
        return output.get(name)
    return getattr(output, name, None)


def _name(fn: Any) -> str:
    module = getattr(fn, "__module__", None)
    qual = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{module}:{qual}" if module else qual


def _call(factory: Any, arch: dict[str, Any]) -> str:
    """``module:factory(a=1, b=2)``, with a partial's bound arguments shown."""
    args = dict(arch)
    while isinstance(factory, functools.partial):
        args = {**factory.keywords, **args}
        factory = factory.func
    return f"{_name(factory)}({', '.join(f'{k}={v!r}' for k, v in args.items())})"


def _shape(x: Any) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def _describe(args: tuple, kwargs: dict) -> str:
    parts = [_shape(a) for a in args] + [f"{k}={_shape(v)}" for k, v in kwargs.items()]
    return ", ".join(parts) or "nothing"


def _length(data: Any) -> int:
    if isinstance(data, Mapping):
        return len(next(iter(data.values())))
    return len(data[1])


def _take(data: Any, idx: Any) -> Batch:
    if isinstance(data, Mapping):
        return {k: v[idx] for k, v in data.items()}
    x, y = data
    return _index(x, idx), y[idx]


def stack_batches(batches: list[Batch]) -> Batch:
    """Batches of the same structure stacked along a new leading trial dimension ``[n, ...]``
    (for ``fused(..., shared=False)``: every trial its own data)."""
    return torch.utils._pytree.tree_map(lambda *xs: torch.stack(xs), *batches)


def _batch(batch: Any) -> Batch:
    if isinstance(batch, Mapping):
        return dict(batch)
    return batch[0], batch[1]


def _index(x: Any, idx: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return type(x)(t[idx] for t in x)
    return x[idx]


def _to(x: Any, device: Any) -> Any:
    return x.to(device) if device is not None and isinstance(x, torch.Tensor) else x


def _loader(data: Any, batch_size: int, shuffle: bool, seed: int) -> Any:
    """Batches of a Dataset, a DataLoader (a new loader of the same kind: its dataset, collate
    function and worker settings, at ``batch_size``, shuffled from ``seed``) or a factory."""
    if isinstance(data, (Dataset, DataLoader)):
        g = torch.Generator().manual_seed(seed)
        if isinstance(data, DataLoader):
            return DataLoader(data.dataset, batch_size=batch_size, shuffle=shuffle,
                              drop_last=shuffle, generator=g, collate_fn=data.collate_fn,
                              num_workers=data.num_workers, pin_memory=data.pin_memory,
                              worker_init_fn=data.worker_init_fn)
        return DataLoader(data, batch_size=batch_size, shuffle=shuffle, drop_last=shuffle,
                          generator=g)
    return data(batch_size)

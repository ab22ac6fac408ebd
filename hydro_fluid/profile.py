"""Memory-aware fusion size: how many trials of a fused model fit on one device.

Memory grows about linearly with the number of fused trials ``n``: ``m(n) = a + b * n``
(``a``: what does not grow with ``n``, such as the input batch and framework buffers;
``b``: one more trial's weights, gradients, optimizer state and activations). Measuring
``m`` at two fusion sizes gives ``a`` and ``b``, hence the largest ``n`` that fits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .resources import Device

__all__ = ["estimate_memory", "fusion_size"]

GIB = 1024**3

BuildFn = Callable[[int], nn.Module]
BatchFn = Callable[[int], Any]


def estimate_memory(
    build: BuildFn, batch: BatchFn, n: int, *, device: str = "meta", optimizer_slots: int = 2
) -> int:
    """Bytes one training step of the model fused from ``n`` trials needs.

    On ``"meta"`` (the default, nothing is allocated) the estimate is analytic: weights,
    their gradients, ``optimizer_slots`` optimizer states per weight (2 for Adam, 0 for plain
    SGD), the activations that backward keeps (every tensor autograd saves in a forward pass
    on ``meta``, each once, and the outputs), plus the inputs. On ``"cpu"`` the same is counted
    over a real forward pass, for a model whose shapes the meta device cannot propagate (a
    ``view`` of a tensor whose meta strides differ from the CPU's). On a CUDA device it is the
    measured peak of allocated memory over a real forward, backward and Adam step.

    Args:
        build: ``build(n)`` returns the fused model of ``n`` trials (on the CPU).
        batch: ``batch(n)`` returns the model's input for ``n`` trials: a tensor or a tuple.
        n: The fusion size.
        device: ``"meta"``, ``"cpu"`` or a CUDA device such as ``"cuda:0"``.
        optimizer_slots: Optimizer tensors per weight (analytic mode only).

    Example:
        >>> import torch
        >>> from hydro_fluid.profile import estimate_memory
        >>> build = lambda n: torch.nn.Linear(10, 10 * n)
        >>> batch = lambda n: torch.zeros(8, 10)
        >>> estimate_memory(build, batch, 1)  # (110 weights x 4 copies + 80 out + 80 in) x 4 B
        2400
    """
    if n < 1:
        raise ValueError(f"The fusion size n must be >= 1, got {n}.")
    if device in ("meta", "cpu"):
        return _analytic(build, batch, n, optimizer_slots, device)
    if not str(device).startswith("cuda"):
        raise ValueError(
            f"estimate_memory counts on 'meta' or 'cpu' (analytic) or measures on a CUDA "
            f"device, got {device!r}; use 'meta' for CPU training."
        )
    return _measured(build, batch, n, torch.device(device))


def fusion_size(
    build: BuildFn,
    batch: BatchFn,
    device: Device | str = "cpu",
    *,
    memory: float | None = None,
    margin: float = 0.8,
    optimizer_slots: int = 2,
    max_size: int = 4096,
) -> int:
    """The most trials that can be fused into one model on ``device``, with a safety margin.

    On a GPU the memory is measured at fusion sizes 1 and 2 (peak allocated memory); on CPU
    it is estimated analytically on the ``meta`` device. The line through the two points is
    solved for ``margin`` of the device memory. If the result still runs out of memory at
    run time, the executors halve the group and retry, so no trial is lost.

    Args:
        build: ``build(n)`` returns the fused model of ``n`` trials.
        batch: ``batch(n)`` returns the model's input for ``n`` trials.
        device: A :class:`Device`, or ``"cpu"`` / ``"cuda:0"``.
        memory: GiB available; defaults to the memory of a :class:`Device`, and is
            required when ``device`` is a string.
        margin: Fraction of the memory to plan for; the rest absorbs fragmentation and
            estimation error.
        optimizer_slots: Optimizer tensors per weight for the analytic estimate.
        max_size: Upper limit on the answer.

    Example:
        >>> import torch
        >>> from hydro_fluid.profile import fusion_size
        >>> build = lambda n: torch.nn.Sequential(torch.nn.Linear(512, 512 * n), torch.nn.ReLU())
        >>> batch = lambda n: torch.zeros(64, 512)
        >>> fusion_size(build, batch, "cpu", memory=0.05)  # about 4.5 MB per trial
        9
    """
    if not 0 < margin <= 1:
        raise ValueError(f"margin must be in (0, 1], got {margin}.")
    if isinstance(device, Device):
        kind, capacity = device.kind, device.memory
        torch_device = "cuda" if kind == "gpu" else "cpu"
    else:
        torch_device, capacity = str(device), None
        kind = "gpu" if torch_device.startswith("cuda") else "cpu"
    capacity = memory if memory is not None else capacity
    if capacity is None:
        raise ValueError(f"Pass memory=<GiB> for device {device!r}; it has no known capacity.")
    where = torch_device if kind == "gpu" else "meta"
    m1 = estimate_memory(build, batch, 1, device=where, optimizer_slots=optimizer_slots)
    m2 = estimate_memory(build, batch, 2, device=where, optimizer_slots=optimizer_slots)
    per_trial = max(m2 - m1, 1)
    fixed = m1 - per_trial
    budget = margin * capacity * GIB
    if fixed + per_trial > budget:
        raise RuntimeError(
            f"One trial needs about {(fixed + per_trial) / GIB:.2f} GiB but only "
            f"{budget / GIB:.2f} GiB ({margin:.0%} of {capacity} GiB) is available; use a "
            "device with more memory, a smaller batch, or a smaller surrogate model."
        )
    return max(1, min(max_size, math.floor((budget - fixed) / per_trial)))


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _as_args(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _analytic(build: BuildFn, batch: BatchFn, n: int, optimizer_slots: int, where: str) -> int:
    if where == "meta":
        with torch.device("meta"):
            model = build(n)
        model = model.to("meta")
    else:
        model = build(n)
    inputs = [t.to(where) if isinstance(t, torch.Tensor) else t for t in _as_args(batch(n))]
    params = [p for p in model.parameters()]
    weights = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
    # what backward keeps is what autograd saves: count each saved tensor once, and neither the
    # weights (counted above, also when saved as a transposed view) nor the inputs (below)
    known = {id(t) for t in [*params, *_tensors(inputs)]}
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        if id(t) not in known and id(base) not in known:
            saved.setdefault(id(base), base)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = model(*inputs)
    kept = {id(t): t for t in _tensors(output) if id(t) not in known}  # the loss reads them
    kept.update(saved)
    activations = sum(t.numel() * t.element_size() for t in kept.values())
    data = sum(t.numel() * t.element_size() for t in _tensors(inputs))
    return weights * (2 + optimizer_slots) + frozen + activations + data


def _measured(build: BuildFn, batch: BatchFn, n: int, device: torch.device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    model = build(n).to(device)
    inputs = [t.to(device) if isinstance(t, torch.Tensor) else t for t in _as_args(batch(n))]
    optimizer = torch.optim.Adam(model.parameters())
    output = model(*inputs)
    loss = sum(t.float().sum() for t in _tensors(output))
    loss.backward()
    optimizer.step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - start
    del model, optimizer, output, loss, inputs
    torch.cuda.empty_cache()
    return int(peak)

"""``fuse="auto"``: how many trials of one (batch size, architecture) key to fuse on a device.

Memory of a fused training step grows linearly with the trials it fuses: ``fixed + n *
per_trial``. On a GPU both terms are measured (the peak memory of one real fused step at n = 1
and n = 2); on the CPU one surrogate's step is estimated on the ``meta`` device
(:func:`hydro_fluid.profile.estimate_memory`: weights, gradients, optimizer state, what
autograd saves, the batch; counted over one real CPU forward where the meta device cannot
propagate the model's shapes), since nothing there grows with n but the trials. The size is the
most trials whose step fits ``MARGIN`` of the memory budget, capped by the trials the study
still has to ask and by :data:`MAX_FUSE`. If a group still runs out of memory, it is halved
and nothing is lost (the driver in process, the executors in workers).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hydro.errors import ConfigError
from hydro.tuning.task import Task

__all__ = ["FuseSize", "MAX_FUSE", "check_fuse", "check_memory", "fuse_size", "fuse_sizes",
           "memory_budget"]

GIB = 1024**3
# The largest size measured on the CPU examples (benchmarks/fuse_auto.py: within 2x of the best
# there); a larger group also makes the pruner wait longer for its first complete trials.
MAX_FUSE = 64
MARGIN = 0.8  # of the budget, for what an estimate misses: allocator slack, temporaries
# of the memory free at start that a default budget takes: RAM is shared with everything else
FREE_FRACTION = {"cpu": 0.5, "cuda": 0.9}
OPTIMIZER_SLOTS = {"adam": 2, "adamw": 2, "sgd": 1}  # optimizer tensors per weight


@dataclass(frozen=True)
class FuseSize:
    """How many trials of one key fuse on one device, and the memory that decided it.

    Attributes:
        n: trials per fused group.
        per_trial: bytes one more trial adds to a fused step.
        fixed: bytes a fused step needs whatever its size.
        budget: bytes the group may use on ``device``.
        device: where it was sized (``"cpu"``, ``"cuda:0"``).
        capacity: bytes of the device (a GPU's total memory; on the CPU the budget).
        limit: what capped ``n`` besides memory: ``"memory"``, ``"trials"`` (the study's
            remaining trials) or ``"max"`` (:data:`MAX_FUSE`).
    """

    n: int
    per_trial: int
    fixed: int
    budget: int
    device: str
    capacity: int
    limit: str = "memory"

    @property
    def used(self) -> int:
        """Bytes a fused step of ``n`` trials is expected to need."""
        return self.fixed + self.n * self.per_trial

    def describe(self) -> str:
        """One line, e.g. ``fuse auto -> 24 per group on cuda:0 (19.2 GiB of 80 GiB)``."""
        of = (_bytes(self.capacity) if self.device.startswith("cuda")
              else f"{_bytes(self.budget)} budget")
        why = {"memory": "", "trials": ", capped by the trials left", "max": f", capped at "
               f"{MAX_FUSE}"}[self.limit]
        return (
            f"fuse auto -> {self.n} per group on {self.device} ({_bytes(self.used)} of {of}{why})"
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain values, for the study's user attributes and the export."""
        return {"n": self.n, "device": self.device, "per_trial_bytes": self.per_trial,
                "fixed_bytes": self.fixed, "budget_bytes": self.budget,
                "limit": self.limit}


def check_fuse(fuse: Any, where: str = "fuse") -> int | str:
    """``fuse`` if it is a positive integer or ``"auto"``, else a :class:`ConfigError`."""
    if fuse == "auto" or (not isinstance(fuse, bool) and isinstance(fuse, int) and fuse >= 1):
        return fuse
    raise ConfigError(f"{where} must be an integer >= 1 (trials per fused group) or 'auto' "
                      f"(sized to the device's memory), got {fuse!r}")


def check_memory(memory: Any, where: str = "fuse_memory") -> float | None:
    """``memory`` (GiB) if it is ``None`` or a positive number, else a :class:`ConfigError`."""
    if memory is None:
        return None
    if isinstance(memory, bool) or not isinstance(memory, (int, float)) \
            or not 0 < memory < math.inf:
        raise ConfigError(f"{where} must be a positive number of GiB (the memory one fused "
                          f"group may use), got {memory!r}; leave it out for a share of the "
                          "free memory")
    return float(memory)


def memory_budget(device: str, memory: float | None = None, share: int = 1) -> tuple[int, int]:
    """``(budget, capacity)`` in bytes for one group on ``device``.

    ``memory`` (GiB) is the budget if given; else a share of what is free now
    (:data:`FREE_FRACTION`: the GPU's free memory, or the RAM ``MemAvailable`` reports),
    divided by ``share`` groups that use the device at once.
    """
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        kind = "cuda"
    else:
        free, total = _ram(), _ram(total=True)
        kind = "cpu"
    if memory is not None:
        budget = int(memory * GIB)
    else:
        budget = int(FREE_FRACTION[kind] * free / max(1, share))
    return budget, (total if kind == "cuda" else budget)


def fuse_size(
    task: Task,
    params: dict[str, Any],
    *,
    ratio: int,
    device: str = "cpu",
    remaining: int | None = None,
    memory: float | None = None,
    share: int = 1,
    depth: tuple[int, float] = (1, 1.0),
    seed: int = 0,
) -> FuseSize:
    """The fusion size for trials like ``params`` (one :func:`group_key`) on ``device``.

    Args:
        task: what the trials train.
        params: one trial's parameters (batch size and architecture decide).
        ratio: surrogate width divisor.
        device: ``"cpu"`` or ``"cuda:N"``.
        remaining: trials the study still has to ask (the size never exceeds it).
        memory: GiB one group may use; default a share of the free memory
            (:func:`memory_budget`). Required for a GPU this process cannot see (a Ray
            cluster's): the CPU's estimate is then sized against it.
        share: groups that use the device at once (worker slots on it).
        depth: ``(depth_ratio, depth_alpha)`` of the surrogates.
        seed: the seed the probe surrogates are built from.

    Raises:
        ConfigError: not even one trial fits the budget.
    """
    unseen = device.startswith("cuda") and not torch.cuda.is_available()
    if unseen and memory is None:
        raise ConfigError(f"fuse='auto' measures groups for {device} on a GPU of this process, "
                          "which sees none (a Ray cluster's GPUs are elsewhere): give fuse a "
                          "number of trials, or fuse_memory (GiB of a GPU per group) to size "
                          "them from the CPU estimate")
    if unseen:  # a GPU elsewhere: the CPU's estimate against the budget given for it
        budget = capacity = int(memory * GIB)
    else:
        budget, capacity = memory_budget(device, memory, share)
    fixed, per_trial = _measure(task, params, ratio, "cpu" if unseen else device, depth, seed)
    room = MARGIN * budget - fixed
    if room < per_trial:
        raise ConfigError(
            f"fuse='auto': one trial of batch size {params.get('batch_size', task.batch_size)} "
            f"needs about {(fixed + per_trial) / GIB:.3g} GiB on {device} but the budget is "
            f"{budget / GIB:.3g} GiB ({MARGIN:.0%} of it planned for): raise fuse_memory, use "
            "a smaller batch size or a larger ratio"
        )
    n, limit = int(room // per_trial), "memory"
    if n > MAX_FUSE:
        n, limit = MAX_FUSE, "max"
    if remaining is not None and n > max(1, remaining):
        n, limit = max(1, remaining), "trials"
    return FuseSize(n, per_trial, fixed, budget, device, capacity, limit)


def check_budget(task: Task, space: Mapping[str, Any], **kwargs: Any) -> None:
    """Raise :class:`ConfigError` if not even the cheapest trial of ``space`` fits the memory
    budget: the smallest batch size and the smallest value of each architecture choice.
    ``kwargs`` go to :func:`fuse_size` (``ratio``, ``device``, ``memory``, ``depth``,
    ``seed``)."""
    names = {*task.model_args(), "batch_size"}
    params: dict[str, Any] = {}
    for name, dist in space.items():
        if name not in names:
            continue
        if hasattr(dist, "choices"):
            numbers = [c for c in dist.choices if isinstance(c, (int, float))]
            params[name] = min(numbers) if len(numbers) == len(dist.choices) else dist.choices[0]
        elif hasattr(dist, "low"):
            params[name] = dist.low
    try:
        fuse_size(task, params, **kwargs)
    except ConfigError as exc:
        raise ConfigError(
            f"{exc} (even the cheapest trial of the space does not fit; checked "
            "before any trial was asked)"
        ) from exc


def fuse_sizes(
    task: Task, params: dict[str, Any], devices: Sequence[str], **kwargs: Any
) -> dict[str, FuseSize]:
    """:func:`fuse_size` for each distinct device of ``devices`` (one entry per worker slot:
    a device listed k times is shared by k groups, each sized for its share)."""
    return {d: fuse_size(task, params, device=d, share=list(devices).count(d), **kwargs)
            for d in dict.fromkeys(devices)}


def _measure(task, params, ratio, device, depth, seed) -> tuple[int, int]:
    """``(fixed, per_trial)`` bytes of a fused training step of trials like ``params``."""
    from hydro.tuning.group import FusedGroup

    members = [(k, dict(params), seed + k) for k in range(2)]
    if device.startswith("cuda"):
        one, two = (_peak(task, members[:n], ratio, device, depth) for n in (1, 2))
        per_trial = max(two - one, 1)
        return max(one - per_trial, 0), per_trial
    from hydro_fluid.profile import estimate_memory

    # one probe group builds the surrogate (capture, width analysis); its step is estimated on
    # the meta device, where a fused model cannot run (it reads values) but a surrogate can
    group = FusedGroup(task, members[:1], ratio=ratio, device="cpu", depth_ratio=depth[0],
                       depth_alpha=depth[1])
    args, kwargs, _ = task.split(next(group.batches or group.members[0].batches), "cpu")

    def surrogate(n: int) -> torch.nn.Module:
        return _Call(group.builder.make(dict(params), seed), len(args), list(kwargs))

    def inputs(n: int) -> tuple:
        return (*args, *kwargs.values())

    slots = OPTIMIZER_SLOTS.get(task.optimizer, 2)
    try:
        return 0, estimate_memory(surrogate, inputs, 1, device="meta", optimizer_slots=slots)
    except Exception:  # an op the meta device cannot run, or a view its strides
        # refuse (SDPA's output): count the same over one real forward
        return 0, estimate_memory(surrogate, inputs, 1, device="cpu", optimizer_slots=slots)


class _Call(torch.nn.Module):
    """A surrogate called with its batch's keyword inputs passed positionally, so that
    :func:`estimate_memory` moves and counts them with the others."""

    def __init__(self, model: torch.nn.Module, positional: int, names: list[str]) -> None:
        super().__init__()
        self.model, self.positional, self.names = model, positional, names

    def forward(self, *inputs: Any) -> Any:
        k = self.positional
        return self.model(*inputs[:k], **dict(zip(self.names, inputs[k:])))


def _peak(task, members, ratio, device, depth) -> int:
    """Peak bytes allocated on a GPU by building a fused group and taking one step."""
    from hydro.tuning.group import FusedGroup

    dev = torch.device(device)
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    group = FusedGroup(task, members, ratio=ratio, device=device, depth_ratio=depth[0],
                       depth_alpha=depth[1])
    group.step()
    group.step()  # the optimizer's state exists from the first step on: the second is the peak
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - start
    del group
    torch.cuda.empty_cache()
    return int(peak)


def _ram(total: bool = False) -> int:
    """Bytes of RAM available now (or installed), from /proc/meminfo where there is one."""
    field = "MemTotal:" if total else "MemAvailable:"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages = os.sysconf("SC_PHYS_PAGES" if total else "SC_AVPHYS_PAGES")
    return int(pages * os.sysconf("SC_PAGE_SIZE"))


def _bytes(count: float) -> str:
    """``count`` bytes in the largest binary unit below it, to three digits: ``"19.2 GiB"``."""
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{int(count)} B"

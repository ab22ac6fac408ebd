"""The unit of placement: a group of trials fused into one model, plus its cost model."""

from __future__ import annotations

import copy
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

__all__ = ["TrialGroup", "packed_slowdown"]

# Fluid measured a small throughput loss per extra co-located job; 3% is in that range.
INTERFERENCE = 0.03


@dataclass(frozen=True)
class TrialGroup:
    """Trials fused into one model and trained in lockstep, placed as one unit.

    Every member trains for its own budget; members that reach their budget (or are
    pruned) leave the fused model, so a step gets cheaper as the group thins out.

    Args:
        name: Unique name of the group.
        trial_ids: The member trials (any hashable ids, e.g. Optuna trial numbers).
        budgets: Training steps for each member, same order as ``trial_ids``.
        cost_per_step: Seconds one training step costs *per member* when the group runs
            alone on a speed-1.0 device (measured or estimated at this fusion size).
        memory_per_trial: GiB each member needs on a device (weights, gradients, optimizer
            state, activations) at this fusion size.
        utilization: Fraction of a device the group keeps busy when it runs alone. Small
            models leave a device partly idle (< 1.0), which is what packing recovers.
        comm: Data-parallel overhead: the fraction of a step spent on gradient exchange once
            a group spans many devices.
        after: Names of groups that must finish before this one can start (e.g. the
            previous successive-halving rung).
        score: Best objective value of the group so far (lower is better), used by the
            deadline policy to rank groups; ``None`` when unknown.
        startup: Seconds from placing the group to its first step (starting its worker,
            importing, building the fused model): latency, not device work, so other groups
            on the device run at full speed meanwhile. Measured by the executors
            (``executor.measured[name]["startup"]``); 0 when unknown.

    Example:
        >>> from hydro_fluid import TrialGroup
        >>> g = TrialGroup("g0", trial_ids=(0, 1, 2), budgets=(100, 100, 300),
        ...                cost_per_step=0.01, utilization=0.5)
        >>> g.size, g.max_budget, round(g.work, 2)
        (3, 300, 5.0)
        >>> [part.trial_ids for part in g.split()]
        [(0, 1), (2,)]
    """

    name: str
    trial_ids: tuple[Hashable, ...]
    budgets: tuple[int | float, ...]
    cost_per_step: float = 1.0
    memory_per_trial: float = 0.0
    utilization: float = 1.0
    comm: float = 0.05
    after: tuple[str, ...] = ()
    score: float | None = None
    startup: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "trial_ids", tuple(self.trial_ids))
        object.__setattr__(self, "budgets", tuple(self.budgets))
        object.__setattr__(self, "after", tuple(self.after))
        where = f"TrialGroup {self.name!r}"
        if not self.trial_ids:
            raise ValueError(f"{where} has no trials; a group needs at least one trial.")
        if len(self.trial_ids) != len(self.budgets):
            raise ValueError(
                f"{where}: {len(self.trial_ids)} trial_ids but {len(self.budgets)} budgets; "
                "give one budget (steps) per trial."
            )
        if len(set(self.trial_ids)) != len(self.trial_ids):
            raise ValueError(f"{where}: trial_ids must be unique, got {self.trial_ids}.")
        if any(not b >= 0 for b in self.budgets):
            raise ValueError(f"{where}: budgets must be >= 0 steps, got {self.budgets}.")
        if not self.cost_per_step > 0:
            raise ValueError(f"{where}: cost_per_step must be > 0, got {self.cost_per_step}.")
        if not self.memory_per_trial >= 0:
            raise ValueError(f"{where}: memory_per_trial must be >= 0 GiB.")
        if not 0 < self.utilization <= 1:
            raise ValueError(
                f"{where}: utilization must be in (0, 1], got {self.utilization}; it is the "
                "fraction of one device the group keeps busy when it runs alone."
            )
        if not 0 <= self.comm < 1:
            raise ValueError(f"{where}: comm must be in [0, 1), got {self.comm}.")
        if not self.startup >= 0:
            raise ValueError(
                f"{where}: startup must be >= 0 seconds (the measured time to its first step), "
                f"got {self.startup}."
            )

    @property
    def size(self) -> int:
        """Number of member trials (the fusion size)."""
        return len(self.trial_ids)

    @property
    def max_budget(self) -> float:
        """Steps until the last member finishes."""
        return max(self.budgets)

    @property
    def memory(self) -> float:
        """GiB the whole group needs on one device."""
        return self.memory_per_trial * self.size

    @property
    def work(self) -> float:
        """Seconds the group takes alone on one speed-1.0 device (its budget-weighted size)."""
        return self.cost_per_step * sum(self.budgets)

    def speedup(self, workers: int) -> float:
        """Speed-up of data-parallel training on ``workers`` whole devices versus one.

        A step has a compute part (``utilization``) that splits across devices, a part that
        does not (kernel launches, input pipeline: ``1 - utilization``) and a gradient
        exchange that grows towards ``comm``. So small models gain little from more devices
        and large ones gain sublinearly.

        Example:
            >>> from hydro_fluid import TrialGroup
            >>> big = TrialGroup("big", (0,), (10,), utilization=1.0, comm=0.05)
            >>> round(big.speedup(8), 2)
            5.93
            >>> small = TrialGroup("small", (0,), (10,), utilization=0.25)
            >>> round(small.speedup(8), 2)
            1.21
        """
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}.")
        u = self.utilization
        fraction = (1 - u) + u / workers + self.comm * (1 - 1 / workers)
        return 1.0 / fraction

    def seconds(self, workers: int = 1, speed: float = 1.0, slowdown: float = 1.0) -> float:
        """Estimated seconds to finish all members on ``workers`` devices of ``speed``."""
        return self.work * slowdown / (speed * self.speedup(workers))

    def split(self) -> tuple[TrialGroup, TrialGroup]:
        """Halve the fusion size (e.g. after running out of memory), keeping every trial.

        Members are sorted by budget first so that each half has similar budgets.
        """
        if self.size < 2:
            raise ValueError(
                f"TrialGroup {self.name!r} has a single trial and cannot be split further; "
                "the trial needs a device with more memory or a smaller model."
            )
        order = sorted(range(self.size), key=lambda i: self.budgets[i])
        half = math.ceil(self.size / 2)
        parts = (order[:half], order[half:])
        return tuple(  # type: ignore[return-value]
            replace(
                self,
                name=f"{self.name}/{k}",
                trial_ids=tuple(self.trial_ids[i] for i in part),
                budgets=tuple(self.budgets[i] for i in part),
            )
            for k, part in enumerate(parts)
        )

    def remaining(self, budgets: Sequence[float]) -> TrialGroup:
        """The group with each member's budget replaced by its steps still to go.

        Members with nothing left are dropped. Skips validation: it is called on every
        event of a simulation with budgets derived from an already valid group.
        """
        keep = [i for i, steps in enumerate(budgets) if steps > 0]
        clone = copy.copy(self)
        object.__setattr__(clone, "trial_ids", tuple(self.trial_ids[i] for i in keep))
        object.__setattr__(clone, "budgets", tuple(budgets[i] for i in keep))
        return clone

    def without(self, trial_ids: Sequence[Hashable]) -> TrialGroup | None:
        """The group minus ``trial_ids`` (e.g. pruned members); ``None`` if none remain."""
        drop = set(trial_ids)
        keep = [i for i, t in enumerate(self.trial_ids) if t not in drop]
        if not keep:
            return None
        return replace(
            self,
            trial_ids=tuple(self.trial_ids[i] for i in keep),
            budgets=tuple(self.budgets[i] for i in keep),
        )


def packed_slowdown(utilizations: Sequence[float]) -> float:
    """Slowdown of each group sharing one device, given each group's solo utilization.

    Groups that together need at most the whole device run at full speed (packing fills
    the idle part); beyond that the device is saturated and time-slices between them.
    Each co-located group costs a little interference on top.

    Example:
        >>> from hydro_fluid.groups import packed_slowdown
        >>> packed_slowdown([0.25, 0.25])      # fits: only interference
        1.03
        >>> round(packed_slowdown([1.0, 1.0]), 2)  # saturated: twice as slow
        2.06
    """
    if not utilizations:
        return 1.0
    return max(1.0, float(sum(utilizations))) * (1 + INTERFERENCE * (len(utilizations) - 1))

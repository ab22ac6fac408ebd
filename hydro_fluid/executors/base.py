"""What executors share: the worker's view (WorkerContext) and the per-group results.

The executor's side of the contract below is also a type: :class:`~hydro_fluid.Executor` and
:class:`~hydro_fluid.executors.protocol.PlacingExecutor` (:mod:`hydro_fluid.executors.protocol`),
which an object of your own is checked against by :func:`~hydro_fluid.check_executor`.

The contract between an executor and the code it runs (for example the tuner's fused
training loop) is::

    results = executor.run(groups, fn, report=on_report)

``fn(group, ctx)`` runs in a worker process for every :class:`~hydro_fluid.TrialGroup`; it
must be picklable (a module-level function or a ``functools.partial`` of one) and returns
any picklable value. ``ctx`` is a :class:`WorkerContext`. Every value the worker sends with
``ctx.report(trial_id, step, value)`` reaches ``on_report(trial_id, step, value)`` in the
parent as it arrives; if ``on_report`` returns ``True`` the trial is pruned and the worker
sees it in ``ctx.is_pruned(trial_id)``. ``run`` returns one :class:`GroupResult` per group
that ran (a group halved after running out of memory returns its two halves), in which
every trial is ``COMPLETE``, ``PRUNED`` or ``FAIL`` with a reason.

Streaming (what the tuner uses to keep every slot busy)::

    executor.run([], fn, more=next_groups, on_result=finished, request=answer)

``more()`` is called whenever a slot is free and no group waits: it returns new groups to run
(an empty list: none now; ``run`` ends once nothing runs, nothing waits and ``more`` has none).
``on_result(result)`` is called for each group as it ends, before ``run`` returns. A worker's
``ctx.request(payload)`` blocks until ``answer(group_name, payload)`` has run in the parent and
returns its answer: the worker asks the parent for work (new trials for freed slots) while the
parent keeps what it owns (the study, its storage).

Placement (what a policy needs from ``fn``): ``ctx.progress(steps, live)`` after each step
tells the parent how far the group is and how many members it still trains (the parent times
the steps and reads the worker's CPU use from it). ``ctx.should_stop()`` at each step
boundary says that the parent wants the group on other devices: ``fn`` then saves a
checkpoint and raises :class:`Stopped`; the group restarts on its new slots and resumes from
that checkpoint. A stop is neither a retry nor a failure.
"""

from __future__ import annotations

import os
import pickle
import traceback
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..groups import TrialGroup
from .scratch import private_dir

__all__ = [
    "Stopped",
    "WorkerContext",
    "GroupResult",
    "TrialOutcome",
    "ReportFn",
    "WorkerFn",
    "MoreFn",
    "ResultFn",
    "RequestFn",
]

COMPLETE, PRUNED, FAIL = "COMPLETE", "PRUNED", "FAIL"

ReportFn = Callable[[Hashable, int, float], "bool | None"]
MoreFn = Callable[[], Sequence[TrialGroup]]
ResultFn = Callable[["GroupResult"], None]
RequestFn = Callable[[str, Any], Any]
WorkerFn = Callable[[TrialGroup, "WorkerContext"], Any]


class Stopped(Exception):
    """Raised by ``fn`` after ``ctx.should_stop()`` and a checkpoint: move me, I lose nothing."""


@dataclass(frozen=True)
class TrialOutcome:
    """How a trial ended: ``state`` is ``"COMPLETE"``, ``"PRUNED"`` or ``"FAIL"``."""

    state: str
    reason: str | None = None


@dataclass
class GroupResult:
    """The outcome of one group.

    Attributes:
        group: The group as it ran (a half of the submitted group after an out-of-memory).
        value: What ``fn`` returned on rank 0, or ``None`` if the group failed.
        trials: Outcome of every member trial.
        attempts: How many times the group was started (moves not counted).
        error: Why the group failed, if it did.
        moves: How many times the placement policy stopped the group to move or rescale it.
        deterministic: ``fn`` raised an exception marked ``deterministic`` (``error`` is its
            message): it would raise again, so it was not retried.
    """

    group: TrialGroup
    value: Any
    trials: dict[Hashable, TrialOutcome]
    attempts: int
    error: str | None = None
    moves: int = 0
    deterministic: bool = False

    @property
    def ok(self) -> bool:
        """Whether ``fn`` finished (its trials are COMPLETE or PRUNED)."""
        return self.error is None


class WorkerContext:
    """The worker's view of its placement and its line back to the parent.

    Attributes:
        group_name: Name of the group being run.
        device: Torch device string to train on, e.g. ``"cpu"`` or ``"cuda:0"``.
        num_threads: CPU threads this worker may use (already applied with
            ``torch.set_num_threads``).
        rank: Rank of this process in a data-parallel group (0 if not data parallel).
        world_size: Processes training this group together. When it is above 1 the default
            ``torch.distributed`` process group is initialized (gloo on CPU, nccl on GPU), so
            ``DistributedDataParallel(model)`` works as is.
        attempt: 0 on the first run, then 1, 2, ... after the worker died.
        checkpoint_dir: A directory private to this group that survives retries.

    Example:
        A ``fn`` that resumes from its checkpoint and reports every step::

            def train(group, ctx):
                state = ctx.load_checkpoint() or {"step": 0}
                for step in range(state["step"], max(group.budgets)):
                    ...  # one fused training step on ctx.device
                    for trial in group.trial_ids:
                        if not ctx.is_pruned(trial):
                            ctx.report(trial, step, loss_of[trial])
                    ctx.save_checkpoint({"step": step + 1})
                return final_losses
    """

    def __init__(
        self,
        group_name: str,
        device: str,
        num_threads: int,
        rank: int,
        world_size: int,
        attempt: int,
        checkpoint_dir: str | Path,
        channel: Any,
        pruned: Iterable[Hashable] = (),
    ) -> None:
        self.group_name = group_name
        self.device = device
        self.num_threads = num_threads
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        self.checkpoint_dir = Path(checkpoint_dir)
        self._channel = channel
        self._pruned = set(pruned)

    def report(self, trial_id: Hashable, step: int, value: float) -> None:
        """Send an intermediate value of ``trial_id`` to the parent (rank 0 only; others no-op)."""
        if self.rank == 0:
            self._channel.send(("report", trial_id, int(step), float(value)))

    def request(self, payload: Any) -> Any:
        """Send ``payload`` to the parent's ``request`` callback and return its answer.

        Blocks until the answer arrives (rank 0 only; the parent must have been given
        ``request=``). Pruning decisions that arrive meanwhile are kept for :meth:`is_pruned`.
        """
        if self.rank != 0:
            raise RuntimeError("only rank 0 of a group may call ctx.request")
        return self._channel.request(payload)

    def progress(self, steps: int, live: int, score: float | None = None) -> None:
        """Tell the parent that the group has trained ``steps`` steps and trains ``live`` members.

        Call it after every step (rank 0; others no-op): it costs nothing when nothing changed
        for a moment, since it sends at most every 0.2 s and whenever ``live`` changes. The
        parent times the steps for its placement policy; ``score`` (lower is better, e.g. the
        best validation loss so far) ranks the group for the deadline policy.
        """
        send = getattr(self._channel, "progress", None)  # a channel without it has no policy
        if self.rank == 0 and send is not None:
            send(int(steps), int(live), score)

    def should_stop(self, *, agree: bool = True) -> bool:
        """Whether the parent asked this group to stop (to move it to other devices).

        Ask at every step boundary, on every rank (with ``world_size > 1`` the ranks agree
        through one small all-reduce, so all of them stop at the same step; ``agree=False``
        skips it where rank 0 trains alone, the other ranks having left). When it is
        ``True``, save a checkpoint and raise :class:`Stopped`.
        """
        stopping = getattr(self._channel, "stopping", None)  # none: nobody moves this group
        stop = bool(stopping is not None and stopping())
        if self.world_size > 1 and agree:
            import torch.distributed as dist

            flag = torch.tensor([1.0 if stop else 0.0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        return stop

    def is_pruned(self, trial_id: Hashable) -> bool:
        """Whether the parent has pruned ``trial_id`` (so the worker can drop it)."""
        self._pruned |= self._channel.pruned()
        return trial_id in self._pruned

    @property
    def pruned(self) -> frozenset:
        """All trials of this group pruned so far."""
        self._pruned |= self._channel.pruned()
        return frozenset(self._pruned)

    def save_checkpoint(self, state: Any) -> None:
        """Atomically save ``state`` (tensors and plain containers: dicts, lists, tuples,
        numbers, strings; what ``torch.load(weights_only=True)`` reads back); only rank 0
        writes."""
        if self.rank != 0:
            return
        private_dir(self.checkpoint_dir)  # a Ray worker on another node may be the first
        tmp = self.checkpoint_dir / f".checkpoint.{os.getpid()}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.checkpoint_dir / "checkpoint.pt")

    def load_checkpoint(self) -> Any | None:
        """The last saved state of this group, or ``None`` if there is none yet.

        Read with ``torch.load(weights_only=True)``: a file that needs more than tensors and
        plain containers (a planted pickle that would run code) is refused with a
        ``pickle.UnpicklingError`` that says so.
        """
        path = self.checkpoint_dir / "checkpoint.pt"
        if not path.exists():
            return None
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise pickle.UnpicklingError(
                f"refusing to load {path}: it holds more than tensors and plain containers, "
                "so it was not written by save_checkpoint (it could run code). Delete it, and "
                f"check who can write to {self.checkpoint_dir}."
            ) from exc


def call_worker_fn(fn: WorkerFn, group: TrialGroup, ctx: WorkerContext) -> tuple[str, Any]:
    """Run ``fn``; the outcome is ``("done", value)``, ``("stopped", None)``, ``("oom", message)``,
    ``("raised", message)`` (an exception whose class sets ``deterministic = True``: the parent
    does not retry it) or ``("error", line)`` (any other exception, retried), every message one
    line.

    Shared by the executors so that out-of-memory is recognised the same way everywhere.
    """
    try:
        value = fn(group, ctx)
        pickle.dumps(value)  # fail here, with a clear message, rather than in a queue thread
        return "done", value
    except Stopped:
        return "stopped", None
    except (MemoryError, torch.cuda.OutOfMemoryError) as exc:
        return "oom", f"{type(exc).__name__}: {exc}"
    except pickle.PicklingError as exc:
        return "error", f"fn returned a value that cannot be pickled: {exc}"
    except Exception as exc:
        if getattr(exc, "deterministic", False):  # it would raise again on any worker
            return "raised", str(exc)
        return "error", one_line(exc)


def one_line(exc: BaseException) -> str:
    """``exc`` as one line: its type, the first line of its message and where it was raised
    (the innermost frame), for a trial's fail reason (a traceback is not one)."""
    message = (str(exc).strip().splitlines() or [""])[0]
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {message}"[:400] + where


@dataclass
class Ledger:
    """Book-keeping of the parent: pending groups, attempts, pruned trials and results.

    Both executors drive it, so retries, out-of-memory splits and the final trial states
    follow exactly the same rules locally and on Ray.
    """

    max_retries: int
    pending: list[tuple[TrialGroup, int]] = field(default_factory=list)
    pruned: dict[str, set] = field(default_factory=dict)
    results: list[GroupResult] = field(default_factory=list)
    order: dict[str, int] = field(default_factory=dict)
    on_result: Callable[[GroupResult], None] | None = None
    seen: set = field(default_factory=set)  # trial ids of every group submitted so far
    moves: dict[str, int] = field(default_factory=dict)  # group -> times a policy moved it

    def submit(self, groups: Sequence[TrialGroup]) -> None:
        """Queue ``groups`` (at the start of a run, or later ones from ``more``)."""
        groups = list(groups)
        for g in groups:
            if not isinstance(g, TrialGroup):
                raise ValueError(f"Expected TrialGroup objects, got {type(g).__name__}: {g!r}.")
        names = [g.name for g in groups]
        if len(set(names)) != len(names) or set(names) & set(self.order):
            raise ValueError("Group names must be unique within one run.")
        trials = [t for g in groups for t in g.trial_ids]
        if len(set(trials)) != len(trials) or set(trials) & self.seen:
            raise ValueError("A trial appears in two groups; each trial must be in one group.")
        self.seen.update(trials)
        for g in groups:
            self.order[g.name] = len(self.order)
            self.pending.append((g, 0))
            self.pruned[g.name] = set()

    def _result(self, result: GroupResult) -> None:
        self.results.append(result)
        if self.on_result is not None:
            self.on_result(result)

    def prune(self, group: TrialGroup, trial_id: Hashable) -> None:
        self.pruned[group.name].add(trial_id)

    def done(self, group: TrialGroup, attempt: int, value: Any) -> None:
        pruned = self.pruned[group.name]
        trials = {
            t: TrialOutcome(PRUNED) if t in pruned else TrialOutcome(COMPLETE)
            for t in group.trial_ids
        }
        moves = self.moves.get(group.name, 0)
        self._result(GroupResult(group, value, trials, attempt + 1, moves=moves))

    def moved(self, group: TrialGroup, attempt: int) -> None:
        """The group stopped after a checkpoint to change devices: queue it again, same attempt."""
        self.moves[group.name] = self.moves.get(group.name, 0) + 1
        self.pending.append((group, attempt))

    def failed(self, group: TrialGroup, attempt: int, reason: str) -> None:
        """The group's worker died or raised: retry it, or fail its trials for good."""
        if attempt < self.max_retries:
            self.pending.append((group, attempt + 1))
        else:
            self.give_up(group, attempt, f"failed after {attempt + 1} attempt(s): {reason}")

    def raised(self, group: TrialGroup, attempt: int, message: str) -> None:
        """``fn`` raised a deterministic error: its trials fail with ``message``, no retry."""
        self.give_up(group, attempt, message, deterministic=True)

    def out_of_memory(self, group: TrialGroup, attempt: int, message: str) -> None:
        """Halve the fusion size and run both halves afresh; a single trial fails."""
        live = group.without(self.pruned[group.name])
        if live is None:  # everything was pruned already
            self.done(group, attempt, None)
            return
        if live.size < 2:
            self.give_up(group, attempt, f"out of memory even with a single trial: {message}")
            return
        gone = group.without(live.trial_ids)
        if gone is not None:  # pruned members are not re-run; they end here, PRUNED
            self._result(
                GroupResult(
                    gone, None, {t: TrialOutcome(PRUNED) for t in gone.trial_ids}, attempt + 1
                )
            )
        for part in live.split():
            self.order[part.name] = self.order[group.name]
            self.pruned[part.name] = set()
            self.pending.append((part, 0))

    def give_up(self, group: TrialGroup, attempt: int, reason: str,
                deterministic: bool = False) -> None:
        """End the group: its trials FAIL with ``reason`` (pruned ones stay PRUNED)."""
        pruned = self.pruned[group.name]
        trials = {
            t: TrialOutcome(PRUNED) if t in pruned else TrialOutcome(FAIL, reason)
            for t in group.trial_ids
        }
        self._result(GroupResult(group, None, trials, attempt + 1, reason,
                                 deterministic=deterministic))

    def ordered_results(self) -> list[GroupResult]:
        return sorted(self.results, key=lambda r: (self.order[r.group.name], r.group.name))

"""Continuous batching in the tuner's own process: several keys share one device.

:class:`_Stream` asks trials when there is room, keeps up to one live fused group per (batch
size, architecture) key, and steps the groups in rounds (:func:`hydro.tuning.slots.step_slots`),
so a slot one key frees goes to another key's trial. It is also the asking side that
:class:`hydro.tuning.fleet._Fleet` reuses for an executor's groups. Every asked trial is told,
whatever happens.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import optuna
import torch
from optuna.trial import TrialState

from hydro.tuning.bookkeeping import (
    after_tell,
    ask,
    counts,
    fail_unfinished,
    reclaim_stale,
    report_and_ask,
    seed_and_resume,
    seed_sampler,
    tell,
)
from hydro.tuning.eval_sample import STUDY_ATTR
from hydro.tuning.faults import Faults, describe
from hydro.tuning.group import FusedGroup, GroupInfo, Outcome, group_key
from hydro.tuning.loop import make_group
from hydro.tuning.options import TuneOptions
from hydro.tuning.sizing import FuseSize, fuse_sizes
from hydro.tuning.slots import Seat, play_round, resume_slot
from hydro.tuning.space import check_names, sample
from hydro.tuning.task import SAMPLE_BLOCK, Task

__all__ = ["Where"]


@dataclass
class Where:
    """What a run's engine works in besides its options: the study, this process's heartbeat
    on its trials, the progress display, when the run started, the occupancy counters and the
    trial checkpoints."""

    study: optuna.Study
    heart: Any
    bar: Any
    start: float
    occupancy: Any
    checkpoints: Any = None


class _Stream:
    """Continuous batching in this process: one live fused group per key, taking turns.

    Trials are asked one at a time, while the study has trials left and the groups have room:
    together they train at most ``fuse`` trials (:meth:`size` says how many trials of a key
    fill the device; each live trial takes its share). A slot freed in any group takes the
    next asked trial: one of the group's own key (:func:`group_key`: batch size and
    architecture) goes into that slot at once; one of another key waits in ``pending`` and
    joins its key's group at the start of the next round, growing it or starting it. In a
    round every group takes one fused step, so every trial advances at the same rate. Every
    asked trial is told, whatever happens.

    :class:`_Fleet` (executors) reuses the asking side: :meth:`next_members` and
    :meth:`next_trial` give one group at a time, one key per group.
    """

    def __init__(self, task: Any, space: Any, options: TuneOptions, where: Where) -> None:
        o = self.options = options
        self.study, self.task, self.space, self.n_trials = where.study, task, space, o.n_trials
        self.ratio, self.fuse, self.seed, self.device = o.ratio, o.fuse, o.base_seed, o.device
        self.heart, self.bar, self.start, self.timeout = where.heart, where.bar, where.start, \
            o.timeout
        self.hook = self.bar.reported if self.bar is not None else None
        self.pending: dict[tuple, list[tuple[optuna.Trial, dict]]] = {}
        self.running: dict[int, optuna.Trial] = {}  # asked, not yet told
        self.asking = True
        self.occupancy = where.occupancy
        self.depth = (o.depth_ratio, float(o.depth_alpha))
        self.first_group = o.first_group
        # each trial's checkpoints, every `every` steps
        self.checkpoints, self.every = where.checkpoints, o.checkpoint_every
        self.seeds: dict[int, int] = {}  # trial -> its seed (a re-asked trial: its predecessor's)
        self.live: dict[tuple, _InProcess] = {}  # key -> its group training in this process
        self.key_of: dict[int, tuple] = {}  # trial -> its key, for the trials asked here
        self.refills = True  # freed slots take new trials (False: an evaluation phase)
        self.built: dict[tuple, FusedGroup] = {}  # key -> its last group built here
        self.fuse_memory = o.fuse_memory  # GiB per group for fuse="auto"; None: a share of free
        self.key_sizes: dict[tuple, int] = {}  # per key: sized by "auto", or halved after an OOM
        self.key_memory: dict[tuple, float] = {}  # per key, with "auto": GiB one trial adds
        self.faults = Faults(o.catch)  # user code raised: stop once every trial failed alike
        self.callbacks = list(o.callbacks)  # Optuna's (study, frozen_trial), after each trial ends
        self.compile = o.compile  # the tuner's setting; "auto": decided per key by its first group
        self.recorded_blocks: int | None = None  # eval_samples="auto": the study's, once known

    def eval_blocks(self, measured: int | None) -> int | None:
        """The study's ``eval_samples="auto"`` size in blocks (:mod:`hydro.tuning.eval_sample`),
        recording ``measured`` when the study has none: the first recorded holds for every
        group, process and resume."""
        if self.recorded_blocks is None:
            got = self.study.user_attrs.get(STUDY_ATTR)
            if got is None and measured is not None:
                self.study.set_user_attr(STUDY_ATTR, int(measured))
                got = int(measured)
                self.note(f"validation subsample of the intermediate evaluations: {got} "
                          f"blocks of {SAMPLE_BLOCK} samples (measured)")
            self.recorded_blocks = got
        return self.recorded_blocks

    def note(self, line: str) -> None:
        """One line on the progress display, else to the ``hydro`` logger."""
        if self.bar is not None:
            self.bar.note(line)
        else:
            logging.getLogger("hydro").info(line)

    def say_compile(self, line: str) -> None:
        """Say a group's compile decision: on the progress display (else to the ``hydro``
        logger) and in the study's ``hydro_compile`` user attribute (one line per key)."""
        self.note(line)
        lines = list(self.study.user_attrs.get("hydro_compile") or [])
        self.study.set_user_attr("hydro_compile", [*lines, line])

    def run(self) -> None:
        self._guard(self._groups)
        self.faults.check(end=True)

    def phase(self, text: str) -> None:
        """Say what the run does before its first trained step (:meth:`Progress.phase`)."""
        if self.bar is not None:
            self.bar.phase(text)

    def devices(self) -> list[str]:
        """Where this source's groups train, one entry per group that trains at once."""
        return [self.device]

    def fuse_for(self, key: tuple, params: dict | None = None) -> int:
        """Trials per fused group of ``key``: ``fuse``, or with ``fuse="auto"`` the size that
        fits every device (measured when the key first appears, from ``params`` of one of its
        trials); smaller after one of its groups ran out of memory."""
        if key in self.key_sizes:
            return self.key_sizes[key]
        if self.fuse != "auto":
            return self.fuse
        if params is None:
            raise RuntimeError(f"fuse='auto': key {key[0]!r} is sized from a trial's parameters")
        finished, _ = counts(self.study)
        self.phase("capturing the model to measure its memory (fuse auto)")
        sizes = fuse_sizes(self.task, params, self.devices(), ratio=self.ratio,
                           remaining=self.n_trials - finished, memory=self.fuse_memory,
                           depth=self.depth, seed=self.seed)
        self.key_sizes[key] = min(s.n for s in sizes.values())
        self.key_memory[key] = max(s.per_trial for s in sizes.values()) / 2**30  # GiB
        self._announce(params, sizes.values())
        return self.key_sizes[key]

    def _announce(self, params: dict, sizes: Iterable[FuseSize]) -> None:
        """Print each size (with a progress bar) and keep it in the study's ``hydro_fuse``."""
        args = {k: params[k] for k in sorted(self.task.model_args()) if k in params}
        key = {"batch_size": params.get("batch_size", self.task.batch_size), "model_args": args}
        record = dict(self.study.user_attrs.get("hydro_fuse") or {"fuse": "auto", "sizes": []})
        for size in sizes:
            record["sizes"] = [*record["sizes"], {**key, **size.as_dict()}]
            if self.bar is not None:
                self.bar.note(f"{size.describe()}: batch size {key['batch_size']}"
                              + "".join(f", {k} {v}" for k, v in args.items()))
        self.study.set_user_attr("hydro_fuse", record)
        self.occupancy.fuse = max(self.occupancy.fuse, *self.key_sizes.values())

    def out_of_memory(self, key: tuple, live: list[tuple[optuna.Trial, dict]],
                      exc: BaseException) -> None:
        """A group of ``key`` ran out of memory with ``live`` trials: later groups of the key
        fuse half as many, and those trials wait to start afresh in them; a lone trial fails."""
        if len(live) < 2:
            for t, _ in live:
                self.tell(t, Outcome("fail", None, 0, f"out of memory even with a single trial: "
                                     f"{type(exc).__name__}: {exc}"[:500]), None)
            return
        self.key_sizes[key] = (len(live) + 1) // 2  # as the executors split a group
        self.pending[key] = [*live, *self.pending.get(key, [])]

    def _groups(self) -> None:
        complete = len(self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
        if complete < self.first_group:  # a first group alone, to the end, for the pruner
            self._train(limit=self.first_group - complete, refill=False)
        self._train()

    def size(self, key: tuple) -> int:
        """How many trials of ``key`` fill this process's device (:meth:`fuse_for`)."""
        return self.fuse_for(key)

    def _load(self, numbers: Any) -> Fraction:
        """The part of the device the trials ``numbers`` take (1: full)."""
        return sum((Fraction(1, self.size(self.key_of[n])) for n in numbers), Fraction(0))

    def _train(self, limit: int | None = None, refill: bool = True) -> None:
        """Ask trials up to the room there is (at most ``limit``), then rounds until no group is
        left: the waiting trials join their key's group, then each group takes one fused step
        (its evaluations, ended trials told, freed slots refilled). ``refill=False``: no trial is
        asked after the first ones, and the groups drain."""
        self.refills = refill
        self._fill(limit)
        while True:
            self._admit()
            if not self.live:
                return
            # a group's membership changes only at its own turn: these are the trials this
            # round trains
            live, asking = sum(g.group.n for g in self.live.values()), self.asking
            self.phase("first fused step" + (" (torch.compile)" if self.compile is True else ""))
            play_round(self.live, fuse=self.size, checkpoints=self.checkpoints,
                       every=self.every, fault=self._fault)
            if refill:
                self._fill()
            self.occupancy.add(1, live, asking)
            if self.bar is not None:
                self.bar.occupancy = self.occupancy.fraction(asking=False)
                for g in self.live.values():  # trial-steps advance at every fused step here
                    for m in g.group.members:
                        self.bar.stepped(m.id, m.step)
                self.bar.update()

    def _fault(self, key: tuple, exc: BaseException) -> bool:
        """A group's turn raised: out of memory (its trials start afresh in smaller groups) or
        the user's code (its trials fail); ``False`` for anything else, which stops the run."""
        if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):
            self._out_of_memory(key, exc)
            return True
        what = describe(exc, self.task)  # the user's data, loss, metric or training function?
        if what is None:
            return False
        self.user_fault(key, what, exc=exc)
        return True

    def _fill(self, limit: int | None = None) -> None:
        """Ask trials into ``pending`` while the device has room (at most ``limit``)."""
        while (limit is None or limit > 0) and self._load(self.running) < 1:
            if self._ask_keyed() is None:
                return
            limit = None if limit is None else limit - 1

    def _ask_keyed(self) -> tuple[optuna.Trial, dict] | None:
        got = self._ask()
        if got is not None:
            key = group_key(got[1], self.task)
            self.key_of[got[0].number] = key
            self.pending.setdefault(key, []).append(got)
        return got

    def _admit(self) -> None:
        """Waiting trials join their key's live group, or start one, while they fit."""
        used = sum(Fraction(g.group.n, self.size(k)) for k, g in self.live.items())
        for key in list(self.pending):
            share = Fraction(1, self.size(key))
            fits = []
            while self.pending[key] and used + share <= 1:
                fits.append(self.pending[key].pop(0))
                used += share
            if not self.pending[key]:
                del self.pending[key]
            if not fits:
                continue
            try:
                if key in self.live:
                    for t, params in fits:
                        self.live[key].add(t, params)
                else:
                    self.phase(f"capturing the model and fusing a group of {len(fits)} trials")
                    self.live[key] = start_group(self, fits, refill=self.refills)
            except (MemoryError, torch.cuda.OutOfMemoryError) as exc:
                members = self._members(key)
                if not members:  # the group could not even be built: these are its trials
                    self.out_of_memory(key, fits, exc)
                    continue
                self.pending.setdefault(key, [])[:0] = \
                    [f for f in fits if f[0].number not in members]
                self._out_of_memory(key, exc)
            except Exception as exc:  # the user's data or model factory?
                what = describe(exc, self.task)
                if what is None:
                    raise
                self.user_fault(key, what, fits, exc=exc)

    def user_fault(self, key: tuple, what: str, fits: list[tuple[optuna.Trial, dict]] = (),
                   exc: BaseException | None = None) -> None:
        """User code raised (``what``, :func:`describe`; ``exc`` where it raised here) while
        ``key``'s live group trained or took ``fits``: those trials fail with a one-line reason
        naming each, the group is dropped, and the run stops if every trial it ended failed
        this way (:class:`~hydro.tuning.faults.Faults`), unless the run catches its type."""
        caught = self.faults.caught(exc if exc is not None else what)
        g = self.live.pop(key, None)
        trials = {} if g is None else dict(g.trials)
        trials.update((t.number, t) for t, _ in fits)
        gid = g.gid if g is not None else min(trials)
        steps = {} if g is None else {m.id: m.step for m in g.group.members}
        first = ""
        for number, t in sorted(trials.items()):
            if number not in self.running:  # told already
                continue
            reason = f"trial {number} (group {gid}): {what}"
            first = first or reason
            self.tell(t, Outcome("fail", None, steps.get(number, 0), reason), None,
                      fault=not caught)
        if caught:  # an expected failure: the trials end, the run goes on
            return
        self.faults.failed(what, first or f"group {gid}: {what}", key)
        self.faults.check(training=self.key_of.values())

    def _members(self, key: tuple) -> set[int]:
        g = self.live.get(key)
        return set() if g is None else {m.id for m in g.group.members}

    def _out_of_memory(self, key: tuple, exc: BaseException) -> None:
        """``key``'s live group ran out of memory: its trials start afresh in groups of half
        its size (:meth:`out_of_memory`), ahead of those waiting; its memory is freed."""
        g = self.live.pop(key, None)
        live = [] if g is None else [(g.trials[m.id], m.params) for m in g.group.members]
        self.out_of_memory(key, live, exc)
        # the exception (and the frames it kept) is gone: free the group before the next
        del g
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def take(self, key: tuple) -> tuple[optuna.Trial, dict] | None:
        """The next trial for a freed slot of ``key``'s group: one waiting for that key, else
        newly asked while there is room (a trial of another key asked on the way waits for its
        own group, and the slot is dropped: its share of the device went to that trial)."""
        if not self.refills:
            return None
        while not self.pending.get(key) and self._load(self.running) < 1:
            if self._ask_keyed() is None:
                break
        waiting = self.pending.get(key)
        return waiting.pop(0) if waiting else None

    def next_members(
        self, limit: int | None = None, room: float = 1.0
    ) -> tuple[tuple, list[tuple[optuna.Trial, dict]]] | None:
        """The next group's key and up to its key's fusion size (or ``limit``, or the part
        ``room`` of a device) of members that fuse with its first trial; ``None`` once there
        is nothing left to ask."""
        first = self._pop_pending() or self._ask()
        if first is None:
            return None
        key = group_key(first[1], self.task)
        members = [first]
        fuse = self.fuse_for(key, first[1])
        fuse = min(fuse, limit or fuse, max(1, math.floor(room * fuse + 1e-9)))
        while len(members) < fuse:
            nxt = self.next_trial(key)
            if nxt is None:
                break
            members.append(nxt)
        return key, members

    def _guard(self, work: Callable[[], Any]) -> None:
        """Run ``work``; whatever happens, no trial asked here stays RUNNING."""
        try:
            work()
        except BaseException as exc:
            fail_unfinished(self.study, list(self.running.values()), exc)
            raise
        finally:
            self.heart.release(t._trial_id for t in self.running.values())

    def _stopping(self) -> bool:
        if self.timeout is not None and time.perf_counter() - self.start > self.timeout:
            return True
        return bool(self.study.user_attrs.get("hydro_sampler_exhausted"))

    def _ask(self) -> tuple[optuna.Trial, dict] | None:
        """A new trial with its sampled parameters, or None when the study has enough."""
        if not self.asking or self._stopping():
            self.asking = False
            return None
        trials = self.study.get_trials(deepcopy=False)  # one read serves the three below
        if reclaim_stale(self.study, trials):
            trials = self.study.get_trials(deepcopy=False)
        finished, running = counts(self.study, trials)
        got = ask(self.study, 1, self.n_trials, self.seed, self.heart, trials) \
            if finished + running < self.n_trials else []
        if not got:
            self.asking = False
            return None
        t = got[0]
        self.running[t.number] = t
        seed_sampler(self.study.sampler, self.seed, t.number)
        params = sample(t, self.space)
        if isinstance(self.task, Task):  # your own loop reads any name
            check_names(params, self.task.model_args())
        self.seeds[t.number] = seed_and_resume(self.study, t, params, self.seed,
                                                self.checkpoints)
        t.set_user_attr("ratio", self.ratio)
        if self.task.data_mode == "shared":  # its result depends on its group's data stream
            t.set_user_attr("data_mode", "shared")
        _set_depth(t, self.depth)
        t.set_user_attr("fused", self.fuse_for(group_key(params, self.task), params))
        return t, params

    def _pop_pending(self) -> tuple[optuna.Trial, dict] | None:
        for key in sorted(self.pending, key=lambda k: -len(self.pending[k])):
            if self.pending[key]:
                return self.pending[key].pop(0)
        return None

    def next_trial(self, key: tuple) -> tuple[optuna.Trial, dict] | None:
        """The next trial for a slot of a group with ``key``: one waiting, else newly asked
        (trials asked on the way that do not fit wait for a group of their own)."""
        if self.pending.get(key):
            return self.pending[key].pop(0)
        for _ in range(self.fuse_for(key)):
            got = self._ask()
            if got is None:
                return None
            other = group_key(got[1], self.task)
            if other == key:
                return got
            self.pending.setdefault(other, []).append(got)
        return None

    def tell(self, trial: optuna.Trial, outcome: Outcome, info: GroupInfo | None,
             fault: bool = False) -> None:
        """Tell ``trial``'s ``outcome`` (``fault``: it failed because user code raised), then
        call the run's callbacks with the finished trial."""
        told = tell(self.study, trial, outcome, info)
        self.faults.told(fault)
        if self.checkpoints is not None:
            self.checkpoints.remove(trial.number)
        self.running.pop(trial.number, None)
        self.key_of.pop(trial.number, None)
        self.heart.release([trial._trial_id])
        if self.bar is not None:
            self.bar.ended(trial.number)
        if told:
            after_tell(self.study, trial, self.callbacks)


def start_group(
    stream: _Stream, members: list[tuple[optuna.Trial, dict]], refill: bool = True
) -> _InProcess:
    """Build a fused group of ``members`` (one key) to train in this process, in the stream's
    rounds (:meth:`_Stream._train`): its freed slots take new trials until the study has no
    more to ask (``refill=False``: freed slots stay empty, the group drains)."""
    gid = min(t.number for t, _ in members)
    key = group_key(members[0][1], stream.task)
    for slot, (t, _) in enumerate(members):
        t.set_user_attr("group", gid)
        t.set_user_attr("slot", slot)
        t.set_user_attr("fused", stream.fuse_for(key))  # the key's size now (after an OOM)
    like = stream.built.get(key)
    # "auto" is decided by a key's first group; its later groups follow (or decide, if pending)
    group = make_group(stream.task, [(t.number, p, stream.seeds[t.number]) for t, p in members],
                       stream.options, device=stream.device, like=like,
                       compile=like.compile if like is not None else stream.compile,
                       trials_left=stream.n_trials - counts(stream.study)[0],
                       note=stream.say_compile, capacity=stream.fuse_for(key))
    stream.built[key] = group  # a key's next group reuses its capture (seconds per group)
    for slot in range(group.n):  # a trial re-asked after its tuner died goes on from there
        resume_slot(group, slot, stream.checkpoints)
    return _InProcess(stream, gid, group, {t.number: t for t, _ in members}, refill=refill)


class _InProcess(Seat):
    """A group training in the driver's own process, seated in the stream's rounds, and its
    own trial source (:class:`hydro.tuning.slots.TrialSource`)."""

    def __init__(self, stream: _Stream, gid: int, group: FusedGroup,
                 trials: dict[int, optuna.Trial], refill: bool = True) -> None:
        self.stream, self.gid, self.group, self.trials = stream, gid, group, trials
        self.source = self
        self.refills = refill
        self.joined = {n: time.perf_counter() for n in trials}  # for each trial's group_seconds

    @property
    def asking(self) -> bool:
        return self.stream.asking

    def stepped(self, live: int) -> None:
        """Nothing: the stream counts occupancy per round, over all its groups."""

    def eval_blocks(self, measured: int | None) -> int | None:
        return self.stream.eval_blocks(measured)

    def report(self, items: list[tuple[int, int, float]]) -> set[int]:
        hook = self.stream.hook
        return {n for n, step, v in items if report_and_ask(self.trials[n], step, v, hook)}

    def add(self, t: optuna.Trial, params: dict) -> None:
        """Trial ``t`` joins this group in a new slot."""
        slot = self.group.add(t.number, params, self.stream.seeds[t.number])
        resume_slot(self.group, slot, self.stream.checkpoints)
        t.set_user_attr("group", self.gid)
        t.set_user_attr("slot", slot)
        t.set_user_attr("fused", self.stream.fuse_for(self.group.key))
        self.trials[t.number] = t
        self.joined[t.number] = time.perf_counter()

    def refill(self, told: list, slots: list[int], key: tuple) -> list:
        for number, outcome, info in told:
            self.stream.tell(self.trials.pop(number), outcome, info)
        if not self.refills:
            return [None] * len(slots)
        out = []
        for slot in slots:
            nxt = self.stream.take(key)
            if nxt is None:
                out.append(None)
                continue
            t, params = nxt
            t.set_user_attr("group", self.gid)
            t.set_user_attr("slot", slot)
            t.set_user_attr("fused", self.stream.fuse_for(key))
            self.trials[t.number] = t
            out.append((t.number, params, self.stream.seeds[t.number]))
        return out


def _set_depth(trial: optuna.Trial, depth: tuple[int, float]) -> None:
    trial.set_user_attr("depth_ratio", depth[0])
    trial.set_user_attr("depth_alpha", depth[1])

"""The study's bookkeeping: asking and telling the trials of a study that processes share.

Every trial the engine runs carries its owner (host, machine id, pid, process start time) and a
heartbeat (:class:`Heartbeat`); a trial left RUNNING by a dead owner is put back to WAITING
(:func:`reclaim_stale`) and asked again (:func:`ask`) with the same number, parameters and seed
(:func:`seed_and_resume`), taken by one process only. Telling goes through here too
(:func:`tell`, :func:`report_and_ask` for the pruner), so a trial's end is recorded the same way
wherever it trained.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from typing import Any

import numpy
import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.samplers import BaseSampler
from optuna.samplers._lazy_random_state import LazyRandomState
from optuna.storages import InMemoryStorage, RDBStorage
from optuna.storages._heartbeat import is_heartbeat_enabled
from optuna.trial import FrozenTrial, TrialState

from hydro.errors import StorageError
from hydro.tuning.group import GroupInfo, Outcome
from hydro.tuning.selection import REPLICA_OF
from hydro.tuning.storage import put_back_if_same
from hydro_fluid.executors.local import start_ticks

__all__ = ["HEARTBEAT_SECONDS", "INTERRUPTED", "POLL_SECONDS", "STALE_SECONDS", "Heartbeat",
           "after_tell", "ask", "counts", "fail", "fail_unfinished", "finished", "is_void",
           "put_back", "reclaim_stale", "report_and_ask", "seed_and_resume", "seed_sampler",
           "sweep_checkpoints", "tell", "tell_safely", "trial_seed"]

INTERRUPTED = "interrupted: the process running it stopped; re-asked with the same parameters"


def tell(
    study: optuna.Study, trial: optuna.Trial, outcome: Outcome, info: GroupInfo | None
) -> bool:
    """Record ``outcome`` for ``trial``; False when it is no longer this process's: another
    process took it for dead meanwhile (put it back in the queue, or took it up again)."""
    current = study._storage.get_trial(trial._trial_id)
    if current.state != TrialState.RUNNING or current.user_attrs.get(_OWNER, _me()) != _me():
        return False
    try:
        if info is not None:
            trial.set_user_attr("surrogate_widths", info.widths)
            if info.blocks:
                trial.set_user_attr("surrogate_blocks", info.blocks)
            trial.set_user_attr("group_seconds", round(info.seconds, 3))
            trial.set_user_attr("worker_pid", info.pid)
        if outcome.state == "complete" and outcome.value is not None \
                and math.isfinite(outcome.value):
            tell_safely(study, trial, outcome.value)
        elif outcome.state == "pruned":
            tell_safely(study, trial, state=TrialState.PRUNED)
        else:
            trial.set_user_attr("fail_reason", outcome.reason or "no finite value")
            tell_safely(study, trial, state=TrialState.FAIL)
    except UpdateFinishedTrialError:
        return False  # finished by another process meanwhile
    return True


def after_tell(study: optuna.Study, trial: optuna.Trial, callbacks: Any) -> None:
    """Call Optuna-style ``callbacks(study, frozen_trial)`` for a trial just told, as
    ``study.optimize`` does after each trial. An exception in one propagates (as in Optuna);
    the trials still training then are put back to resume, not failed for it."""
    if not callbacks:
        return
    frozen = study._storage.get_trial(trial._trial_id)
    if not frozen.state.is_finished():
        return
    for callback in callbacks:
        try:
            callback(study, frozen)
        except BaseException as exc:
            try:
                exc._hydro_resume_others = True  # type: ignore[attr-defined]  # see fail_unfinished
            except AttributeError:
                pass  # an exception with __slots__: its others fail with its reason
            raise


def tell_safely(study: optuna.Study, trial: Any, *args: Any, **kwargs: Any) -> None:
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


def report_and_ask(trial: optuna.Trial, step: int, value: float, hook=None) -> bool:
    """Give the study a member's intermediate value; True when its pruner prunes it.
    ``hook(number, step, value)`` is then told of the report (the progress bar)."""
    try:
        if step not in trial._cached_frozen_trial.intermediate_values:
            trial.report(value, step)  # a retried group reports its steps again: once is enough
        # a seed replica (hydro.tuning.selection) trains to the end: its value is the point
        pruned = trial._cached_frozen_trial.user_attrs.get(REPLICA_OF) is None \
            and trial.should_prune()
    except UpdateFinishedTrialError:
        return True  # another process failed it as stale: it is no longer ours to train
    if hook is not None:
        hook(trial.number, step, value)
    return pruned


# -- sharing a study between processes -------------------------------------------------------
#
# Every trial this driver runs carries its owner (host, machine id, pid, process start time) and a
# heartbeat time refreshed by a thread. A RUNNING trial is stale when its owner is a dead process
# on this machine (same host and machine id: same pid table), or, on another machine, when its
# heartbeat is older than STALE_SECONDS. Stale trials are
# failed (one process wins that update; the storage refuses the others) and their parameters
# asked again, so live processes never lose trials to each other and dead ones lose none.

HEARTBEAT_SECONDS = 10.0
STALE_SECONDS = 60.0
POLL_SECONDS = 0.5
_OWNER, _BEAT, _RETRY_OF = "hydro_owner", "hydro_heartbeat", "hydro_retry_of"
_TAKEN = "hydro_taken"  # the datetime_start of the take the owner record belongs to
_INTERRUPTIONS = "hydro_interrupted"  # times a trial was put back to WAITING
_SURPLUS = "surplus: other processes sharing the study had already asked n_trials trials"
_ACTIVE: set[int] = set()  # trial ids some optimize() call in this process is running
_ACTIVE_LOCK = threading.Lock()


def is_void(trial: FrozenTrial) -> bool:
    """Whether a finished row does not count as a trial: interrupted (and asked again) or a
    surplus ask of a shared study."""
    return trial.state == TrialState.FAIL and trial.user_attrs.get("fail_reason") in (
        INTERRUPTED, _SURPLUS)


def finished(study: optuna.Study) -> int:
    return counts(study)[0]


def counts(study: optuna.Study, trials: list[FrozenTrial] | None = None) -> tuple[int, int]:
    """(finished trials that count, RUNNING trials), of ``trials`` if given (a snapshot just
    read: each read of an SQLite study costs tens of milliseconds)."""
    finished = running = 0
    for t in study.get_trials(deepcopy=False) if trials is None else trials:
        if t.state == TrialState.RUNNING:
            running += 1
        elif t.state.is_finished() and not is_void(t):
            finished += 1
    return finished, running


def _read_id(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def machine_id() -> str:
    """Which table of process ids this process's pid belongs to, as a string.

    A hostname does not say it: two machines, or two containers, may share one. On Linux it is
    the kernel's boot id (a fresh random id each boot, shared by the containers of one kernel)
    with the pid namespace (containers with their own pid table have their own); elsewhere
    ``/etc/machine-id`` if there is one, else the hostname alone.
    """
    boot = _read_id("/proc/sys/kernel/random/boot_id")
    if boot is not None:
        try:
            return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
        except OSError:
            return boot
    return _read_id("/etc/machine-id") or socket.gethostname()


_MACHINE = machine_id()


def _me() -> dict[str, Any]:
    return {"host": socket.gethostname(), "machine": _MACHINE, "pid": os.getpid(),
            "started": start_ticks(os.getpid())}


def _owner_alive(t: FrozenTrial, now: float) -> bool:
    owner = t.user_attrs.get(_OWNER)
    taken = t.user_attrs.get(_TAKEN)
    if taken is not None and t.datetime_start is not None \
            and taken != t.datetime_start.isoformat():
        # put back and taken up again since this owner was recorded: the record is the last
        # owner's, and the new one records itself right after its ask
        return now - t.datetime_start.timestamp() < STALE_SECONDS
    # this host's pid table decides only for an owner on this machine (a record written before
    # the machine id was kept counts as this host's, as it did then); any other by heartbeat
    if isinstance(owner, dict) and owner.get("host") == socket.gethostname() \
            and owner.get("machine", _MACHINE) == _MACHINE:
        pid = owner.get("pid")
        if pid == os.getpid():
            with _ACTIVE_LOCK:
                return t._trial_id in _ACTIVE
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, TypeError, ValueError):
            pass
        started = owner.get("started")
        return started is None or start_ticks(int(pid)) in (None, started)
    beat = t.user_attrs.get(_BEAT)
    if beat is None:
        beat = t.datetime_start.timestamp() if t.datetime_start else now
    return now - float(beat) < STALE_SECONDS


def reclaim_stale(study: optuna.Study, trials: list[FrozenTrial] | None = None) -> int:
    """Put the RUNNING trials whose owner is gone back to WAITING: the next ask takes them up
    again, same number and parameters. ``trials``: a snapshot of the study just read, else
    this reads one. Returns how many this call put back."""
    now = time.time()
    n = 0
    if trials is None:
        trials = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for t in trials:
        if t.state == TrialState.RUNNING and not _owner_alive(t, now):
            n += put_back(study, t._trial_id, owner=t.user_attrs.get(_OWNER))
    return n


def put_back(study: optuna.Study, trial_id: int, *, owner: Any = None) -> bool:
    """Set a RUNNING trial back to WAITING (Optuna's queue): it was only interrupted, so it
    is no FAIL row; the next ``study.ask()`` of any process takes it up again with its
    number, parameters, seed, reported values and checkpoint. ``owner``: only if the trial
    still has that owner (another process may have put it back and taken it up meanwhile).
    True if this call put it back."""
    storage = study._storage
    try:
        t = storage.get_trial(trial_id)
        if t.state != TrialState.RUNNING or (owner is not None and (
                t.user_attrs.get(_OWNER) != owner or _owner_alive(t, time.time()))):
            return False  # another process's, or being taken by one (not yet recorded)
        storage.set_trial_user_attr(trial_id, _INTERRUPTIONS,
                                    int(t.user_attrs.get(_INTERRUPTIONS, 0)) + 1)
        if not _to_waiting(study, t):
            return False
    except UpdateFinishedTrialError:
        return False
    _rewind_queue(study, t.number)
    return True


def _to_waiting(study: optuna.Study, t: FrozenTrial) -> bool:
    """Set RUNNING trial ``t`` (as just read) back to WAITING, unless it was put back and
    taken up again since (another process's sweep, then another's ask): where the storage can
    check that in the same write (a database, memory). True if this call did it."""
    storage = study._storage
    backend = getattr(storage, "_backend", storage)  # Optuna's cache around a database
    if isinstance(backend, RDBStorage) and t.datetime_start is not None:
        return put_back_if_same(backend, t._trial_id, t.datetime_start)
    if isinstance(storage, InMemoryStorage):
        with storage._lock:
            now = storage.get_trial(t._trial_id)
            if now.state != TrialState.RUNNING or now.datetime_start != t.datetime_start:
                return False
            return storage.set_trial_state_values(t._trial_id, TrialState.WAITING)
    return storage.set_trial_state_values(t._trial_id, TrialState.WAITING)


def _rewind_queue(study: optuna.Study, number: int) -> None:
    """Optuna's in-memory storage looks for WAITING trials from the first one it last saw on
    (in Optuna a trial never goes back to WAITING): let it see trial ``number`` again. The
    other storages read every WAITING trial at each ask."""
    storage = study._storage
    cursor = getattr(storage, "_prev_waiting_trial_number", None)
    if isinstance(storage, InMemoryStorage) and isinstance(cursor, dict) \
            and study._study_id in cursor:
        with storage._lock:
            cursor[study._study_id] = min(cursor[study._study_id], number)


def fail_unfinished(study: optuna.Study, trials: Any, exc: BaseException) -> None:
    """End the RUNNING ``trials`` a run stopped by ``exc`` cannot finish: back to WAITING
    (:func:`put_back`: resumed by the next run) after Ctrl-C, SIGTERM, a storage failure or a
    callback's exception, else FAIL with the error as the reason. One the storage cannot
    update now stays RUNNING, owned by this process: once it has exited, the next run
    reclaims it."""
    again = isinstance(exc, (KeyboardInterrupt, StorageError)) or \
        getattr(exc, "_hydro_resume_others", False)
    # one line, never a traceback
    reason = INTERRUPTED if again else \
        (f"{type(exc).__name__}: {exc}".splitlines() or [""])[0][:500]
    for t in trials:
        try:
            if again:
                put_back(study, t._trial_id)
            else:
                fail(study, t._trial_id, t.number, t.params, reason, requeue=False)
        except StorageError:
            pass  # still failing: the error on its way out says so, and the next run reclaims it


def fail(study, trial_id, number, params, reason, *, requeue) -> bool:
    """Fail a RUNNING trial (True if this call did it: of racing processes one wins), and with
    ``requeue`` enqueue its parameters to be asked again."""
    storage = study._storage
    try:
        storage.set_trial_user_attr(trial_id, "fail_reason", reason)
        if not storage.set_trial_state_values(trial_id, TrialState.FAIL):
            return False
    except UpdateFinishedTrialError:
        return False
    if requeue and params:  # a trial killed before it was sampled has nothing to repeat
        study.enqueue_trial(dict(params), user_attrs={_RETRY_OF: number}, skip_if_exists=False)
    return True


_SEED, _RESUMED_AT = "hydro_seed", "hydro_resumed_at"


def trial_seed(trial: FrozenTrial | optuna.Trial, base: int) -> int:
    """The initialization and data seed a trial trained with: ``base + number``, or, for a
    trial re-asked after its tuner died, its predecessor's (recorded in ``hydro_seed``)."""
    return int(trial.user_attrs.get(_SEED, base + trial.number))


def seed_and_resume(study: optuna.Study, trial: optuna.Trial, params: dict[str, Any],
                     base: int, checkpoints: Any) -> int:
    """Give a newly asked trial its seed (``hydro_seed``) and, if it re-asks a trial whose
    tuner died (``hydro_retry_of``), that trial's seed and last checkpoint: the checkpoint is
    handed to the new number, its reported values are reported again (for the pruner) and
    ``hydro_resumed_at`` records its step. Returns the seed."""
    old = trial.user_attrs.get(_RETRY_OF)
    seed = trial_seed(trial, base)  # a trial put back and taken up again keeps its own
    if old is None:
        trial.set_user_attr(_SEED, seed)
    if old is None and trial.user_attrs.get(_INTERRUPTIONS) and checkpoints is not None:
        state = checkpoints.load(trial.number, seed, params)  # its own file, if it saved one
        if state is not None:
            trial.set_user_attr(_RESUMED_AT, int(state["step"]))
        return seed
    if old is not None:
        storage = study._storage
        before = storage.get_trial(storage.get_trial_id_from_study_id_trial_number(
            study._study_id, int(old)))
        seed = trial_seed(before, base)
    trial.set_user_attr(_SEED, seed)
    if old is None or checkpoints is None:
        return seed
    state = checkpoints.load(int(old), seed, params)
    if state is not None and checkpoints.claim(int(old), trial.number):
        for step, value in state["history"]:
            trial.report(float(value), int(step))
        trial.set_user_attr(_RESUMED_AT, int(state["step"]))
    return seed


def sweep_checkpoints(study: optuna.Study, checkpoints: Any) -> int:
    """Remove the trial checkpoints no trial will resume from: those of finished trials,
    except an interrupted trial's while its re-ask waits (or was just asked by another
    process, which is about to take the file over), and the half-written files of killed
    writers. Returns how many."""
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    waiting = {t.user_attrs.get(_RETRY_OF) for t in trials.values()
               if t.state in (TrialState.WAITING, TrialState.RUNNING)}
    waiting |= {n for n, t in trials.items() if t.state == TrialState.WAITING}  # put back
    removed = checkpoints.sweep_partial()
    for number in checkpoints.numbers():
        t = trials.get(number)
        if t is not None and (t.state == TrialState.RUNNING or number in waiting):
            continue
        checkpoints.remove(number)
        removed += 1
    return removed


def ask(study, k, n_trials, seed, heart, trials=None) -> list[optuna.Trial]:
    """Ask up to ``k`` trials, keeping only those within ``n_trials`` over the whole study.
    ``trials``: a snapshot of the study read just before (it serves the first ask).

    Trial numbers are handed out by the storage, so a trial is within budget when fewer than
    ``n_trials`` counting trials have a lower number, whichever process asked them.

    A trial this process already holds (put back from under it, then asked again), or one
    another process holds once this one recorded itself, is skipped, logged, and another
    asked: a clash never fails a trial nor puts it twice in a batch.
    """
    asked: list[optuna.Trial] = []
    for _ in range(2 * k + 2):  # each clash asks once more; a bounded number of times
        if len(asked) >= k:
            break
        if trials is None:
            trials = study.get_trials(deepcopy=False)
        # multivariate samplers draw when asked: seed by the number the trial will most likely get
        seed_sampler(study.sampler, seed, len(trials))
        trials = None
        t = study.ask()
        with heart.lock:
            held = t._trial_id in heart.owned
        heart.own(t)  # held: its record now names this take
        if held:
            _clash(t, "this process already trains it (a sweep had put it back)")
            continue
        now = study.get_trials(deepcopy=False)
        mine = next((u for u in now if u._trial_id == t._trial_id), None)
        if mine is None or mine.state != TrialState.RUNNING \
                or mine.user_attrs.get(_OWNER) != heart.me:
            heart.release([t._trial_id])
            _clash(t, "another process took it meanwhile")
            continue
        below = sum(1 for u in now if u.number < t.number and not is_void(u))
        if below >= n_trials:
            fail(study, t._trial_id, t.number, {}, _SURPLUS, requeue=False)
            heart.release([t._trial_id])
            break
        asked.append(t)
    return asked


def _clash(trial: optuna.Trial, why: str) -> None:
    """Say that an ask skipped ``trial``: rare, and nothing for the user to do."""
    logging.getLogger("hydro").info(f"trial {trial.number} skipped: {why}")


class Heartbeat:
    """Marks the trials this process runs with their owner and refreshes their heartbeat."""

    def __init__(self, study: optuna.Study) -> None:
        self.study = study
        self.owned: set[int] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.me = _me()

    def __enter__(self) -> Heartbeat:
        self.thread = threading.Thread(target=self._beat, name="hydro-heartbeat", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        self.stop.set()
        self.thread.join()
        if isinstance(exc, StorageError):  # trials asked but not yet in a group's hands too
            with self.lock:
                ids = sorted(self.owned)
            try:
                storage = self.study._storage
                left = [storage.get_trial(i) for i in ids]
                fail_unfinished(self.study, [t for t in left if t.state == TrialState.RUNNING],
                                 exc)
            except StorageError:
                pass  # the next run reclaims them
        self.release(list(self.owned))

    def own(self, trial: optuna.Trial) -> None:
        with _ACTIVE_LOCK:
            _ACTIVE.add(trial._trial_id)
        with self.lock:
            self.owned.add(trial._trial_id)
        storage = self.study._storage
        storage.set_trial_user_attr(trial._trial_id, _OWNER, self.me)
        storage.set_trial_user_attr(trial._trial_id, _BEAT, time.time())
        # last: until it names this take, sweeps take the owner record for the last owner's
        started = trial._cached_frozen_trial.datetime_start
        if started is not None:
            storage.set_trial_user_attr(trial._trial_id, _TAKEN, started.isoformat())

    def release(self, ids: Any) -> None:
        ids = set(ids)
        with self.lock:
            self.owned -= ids
        with _ACTIVE_LOCK:
            _ACTIVE.difference_update(ids)

    def _beat(self) -> None:
        storage = self.study._storage
        native = is_heartbeat_enabled(storage)
        while not self.stop.wait(HEARTBEAT_SECONDS):
            with self.lock:
                ids = list(self.owned)
            for trial_id in ids:
                try:
                    storage.set_trial_user_attr(trial_id, _BEAT, time.time())
                    if native:  # a storage with Optuna's own heartbeat must not fail it either
                        storage.record_heartbeat(trial_id)
                except Exception:  # finished meanwhile, or a transient error
                    pass


def seed_sampler(sampler: Any, seed: int, number: int) -> None:
    """Re-seed the random state of ``sampler`` (and of samplers inside it) from ``seed`` and a
    trial number.

    A seeded sampler built afresh by every run would draw the same start-up configurations each
    time a study resumes; seeding by trial number instead makes a resumed (or shared) study draw
    new ones, while the same sequence of commands still draws the same configurations.
    """
    value = (int(seed) * 1_000_003 + int(number)) % (2**32)
    seen: set[int] = set()

    def visit(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for attr in vars(obj).values():
            if isinstance(attr, LazyRandomState):
                attr.rng.seed(value)
            elif isinstance(attr, numpy.random.RandomState):
                attr.seed(value)
            elif isinstance(attr, BaseSampler):
                visit(attr)

    if isinstance(sampler, BaseSampler):
        visit(sampler)

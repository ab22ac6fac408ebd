"""Your own training loop, tuned by Hydro: :class:`Loop` says what to train, :class:`Run` is
what your function gets, :class:`LoopGroup` is how the engine steps it.

Hydro captures and scales the model and fuses one group of trials, then calls your
``train(run)`` once for that group. The function builds its optimizers (``hydro.optim``, with
the per-trial lists :meth:`Run.hparam` gives), registers them with :meth:`Run.register`, and
loops ``for step in run:`` — one training step of every trial per iteration — reporting one
value per trial with :meth:`Run.report` whenever :attr:`Run.due` says so. Between two
iterations Hydro reports to Optuna, prunes, tells finished trials, and puts a newly asked trial
in each freed slot (a fresh surrogate from its seed, the registered optimizers' and schedulers'
state and hyperparameters for that slot reset), so the group stays full.

Your function runs in a thread of its own that takes turns with the engine (never both at
once): that is how the engine's slot loop, checkpoints and executors serve a function that owns
its loop. Autocast, ``no_grad`` and other thread-local torch state are the function's own.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hydro.errors import ConfigError, DataError
from hydro.fusion.model import FusedModel
from hydro.tuning.group import (
    Member,
    _blocks,
    _Builder,
    _target,
    _widths,
    group_key,
    set_recipe,
)
from hydro.tuning.task import (
    Task,
    check_data,
    check_settings,
    factory_args,
    stack_batches,
    train_stream,
    val_stream,
)

__all__ = ["Loop", "LoopGroup", "Run", "make_group"]


@dataclass
class Loop:
    """A user's training function and what it trains, for :func:`hydro.tune`.

    ``hydro.tune(train, space, model=..., steps=...)`` builds one; pass it directly to set the
    rest.

    Args:
        train: ``train(run)``: trains one fused group (:class:`Run`). It must not reduce across
            trials (sum the per-trial losses, never average them; no norm over all
            parameters), so each trial gets exactly its own gradient.
        model: the target model (an ``nn.Module`` initialized as you train it) or a factory
            returning one (its keyword arguments may be searched).
        steps: training steps per trial (iterations of ``for step in run``).
        eval_every: steps between reports (the values pruners see); default ``steps // 4``.
            The last step is always reported.
        train_data: optional data for :meth:`Run.batch`: ``(inputs, targets)`` tensors, a dict
            of tensors, a ``Dataset`` or a ``DataLoader`` (its dataset, collate function and
            batch size; each trial reads its own shuffled stream).
        val_data: optional data for :meth:`Run.val_batches`, the same kinds.
        example_inputs, example_kwargs: a batch's model inputs, for capture; default: the
            first training batch (``inputs`` of a tuple, every key of a dict).
        batch_size: the default batch size of :meth:`Run.batch` (a searched ``batch_size``
            overrides it; a ``DataLoader``'s own by default).
        direction: ``"minimize"`` or ``"maximize"`` the reported values.
        checkpoint_every: steps between trial checkpoints (0: never).
        dynamic: sizes besides the batch left dynamic at capture (:func:`hydro.scale`).
        cache: use the on-disk capture cache.
    """

    train: Callable[[Run], Any]
    model: nn.Module | Callable[..., nn.Module]
    steps: int
    eval_every: int | None = None
    train_data: Any = None
    val_data: Any = None
    example_inputs: tuple[Any, ...] | None = None
    example_kwargs: dict[str, Any] | None = None
    batch_size: int | None = None
    direction: str = "minimize"
    checkpoint_every: int = 50
    dynamic: Any = None
    cache: bool = True

    data_mode = "per_trial"  # what the engine reads of a Task

    def __post_init__(self) -> None:
        if not callable(self.train):
            raise ConfigError(f"train must be a function train(run), got {self.train!r}")
        check_settings(self)  # as a Task's: steps, eval_every, batch_size, direction...
        for name in ("train_data", "val_data"):
            if getattr(self, name) is not None:
                check_data(name, getattr(self, name))
        if self.example_inputs is None and self.example_kwargs is None and self.train_data is None:
            raise ConfigError("a training function needs example inputs for capture: pass "
                              "example_inputs=(x,) or example_kwargs={...} (a batch's model "
                              "inputs), or train_data")

    # --- what the engine reads of a Task -------------------------------------------------

    @property
    def loss_name(self) -> str:
        return "train"

    def model_args(self) -> set[str]:
        """Keyword arguments of a model factory (searchable architecture choices)."""
        return factory_args(self.model)

    def build_model(self, **arch: Any) -> nn.Module:
        """The target model for the given architecture choices (:meth:`hydro.Task.build_model`:
        a factory's error is a :class:`~hydro.errors.ModelError` naming its call)."""
        return Task.build_model(self, **arch)  # reads only .model

    def example(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of one batch, for capture."""
        if self.example_inputs is not None or self.example_kwargs is not None:
            return tuple(self.example_inputs or ()), dict(self.example_kwargs or {})
        batch = next(train_stream(self.train_data, 2, seed=0))
        if isinstance(batch, Mapping):
            return (), dict(batch)
        x = batch[0]
        return (tuple(x) if isinstance(x, (tuple, list)) else (x,)), {}


class _Stop(BaseException):
    """Raised in the training function's thread when the engine closes the group (a
    ``BaseException``: an ``except Exception`` in user code does not swallow it)."""


class _Turns:
    """Two threads taking turns: the engine resumes the function, which runs until it pauses."""

    def __init__(self, body: Callable[[], Any], name: str) -> None:
        self._to_user = threading.Semaphore(0)
        self._to_engine = threading.Semaphore(0)
        self.error: BaseException | None = None
        self.finished = False
        self.closing = False
        self._body = body
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self._to_user.acquire()
        try:
            if not self.closing:
                self._body()
        except _Stop:
            pass
        except BaseException as exc:  # handed to the engine, raised there
            self.error = exc
        finally:
            self.finished = True
            self._to_engine.release()

    def resume(self) -> None:
        """Let the function run until it pauses or returns; its exception is raised here."""
        if self.finished:
            return
        self._to_user.release()
        try:
            while not self._to_engine.acquire(timeout=1.0):
                if not self.thread.is_alive():
                    break
        except BaseException:  # Ctrl-C, SIGTERM: the function stops at its next pause
            self.stop()
            raise
        if self.error is not None:
            error, self.error = self.error, None
            raise error.with_traceback(error.__traceback__)

    def pause(self) -> None:
        """Called in the function's thread: hand the turn to the engine and wait for it."""
        self._to_engine.release()
        self._to_user.acquire()
        if self.closing:
            raise _Stop

    def close(self) -> None:
        """Stop the function at its next pause (it unwinds with :class:`_Stop`)."""
        self.closing = True
        if not self.finished:
            self._to_user.release()
            self.thread.join(timeout=5.0)

    def stop(self) -> None:
        """The engine was interrupted while the function ran: let it finish its iteration
        (torch must not be computing in a thread while the process tears down), then unwind
        it. A second interrupt while it finishes gives up waiting."""
        self.closing = True
        try:
            while self.thread.is_alive() and not self._to_engine.acquire(timeout=0.5):
                pass
        finally:
            self._to_user.release()
            self.thread.join(timeout=5.0)


class Run:
    """What ``train(run)`` gets: one fused group of trials and the hooks to train it.

    Attributes:
        model: the fused surrogate (:class:`hydro.fusion.FusedModel`), ``n`` trials in one
            model: ``model(x)`` for one batch shared by all, ``model(xs, shared=False)`` for
            ``xs[n, ...]`` (what :meth:`batch` gives); outputs ``[n, ...]``.
        n: slots in the group (fixed while the function runs).
        steps: training steps of every trial.
        eval_every: steps between reports.

    Example (a complete loop)::

        def train(run):
            opt = hydro.optim.AdamW(run.model.parameters(), lr=run.hparam("lr"),
                                    weight_decay=run.hparam("weight_decay", 0.0))
            run.register(opt)
            for step in run:
                x, y = run.batch()
                loss = hydro.trial_loss(F.cross_entropy, run.model(x, shared=False), y,
                                        shared=False)
                opt.zero_grad()
                loss.sum().backward()
                opt.step()
                if run.due:
                    run.report(evaluate(run.model))   # one value per trial, tensor [n]
    """

    def __init__(self, group: LoopGroup) -> None:
        self._group = group
        self.model: FusedModel = group.fused
        self.n: int = group.capacity
        self.steps: int = group.task.steps
        self.eval_every: int = int(group.task.eval_every)
        self._registered: list[tuple[Any, dict[str, Any]]] = []
        self._on_trial: list[Callable[[int], Any]] = []
        self._reported: list[float] | None = None
        self._iterating = False

    # --- the trials in the slots ---------------------------------------------------------

    @property
    def params(self) -> list[dict[str, Any]]:
        """Each slot's trial hyperparameters (an idle slot: the last trial it held)."""
        return [dict(s.params) for s in self._group.slots]

    @property
    def trials(self) -> list[Any]:
        """Each slot's trial number (``None`` for an idle slot)."""
        live = set(self._group.live_slots)
        return [s.id if p in live else None for p, s in enumerate(self._group.slots)]

    @property
    def seeds(self) -> list[int]:
        """Each slot's trial seed (its initialization and data order)."""
        return [s.seed for s in self._group.slots]

    @property
    def step(self) -> list[int]:
        """Each slot's own training step: the steps its trial has trained."""
        return [s.step for s in self._group.slots]

    @property
    def live(self) -> list[bool]:
        """Which slots train a trial now (an idle slot is frozen; its values are ignored)."""
        return [p in self._group.live_slots for p in range(self.n)]

    def hparam(self, name: str, default: Any = None) -> list[Any]:
        """Each slot's value of hyperparameter ``name``, as a list of ``n`` (what
        ``hydro.optim`` takes: ``AdamW(..., lr=run.hparam("lr"))``); ``default`` where a
        trial has none.

        Raises:
            ConfigError: a trial has no ``name`` and no default was given.
        """
        out = []
        for s in self._group.slots:
            if name in s.params:
                out.append(s.params[name])
            elif default is not None:
                out.append(default)
            else:
                raise ConfigError(f"run.hparam({name!r}): trial {s.id} has no {name!r} (its "
                                  f"hyperparameters: {sorted(s.params)}); search it or give "
                                  f"a default: run.hparam({name!r}, default)")
        return out

    def register(self, obj: Any, **hparams: str | Callable[[dict[str, Any]], Any]) -> Any:
        """Let Hydro reset and checkpoint ``obj`` per slot; returns ``obj``.

        ``obj`` is a fused optimizer (``hydro.optim``) or a per-trial scheduler
        (``hydro.optim.lr_scheduler``). When a slot takes a new trial, each registered
        optimizer's state for that slot restarts and its per-trial hyperparameters are set
        from the new trial: by default the trial's value of the same name (``lr``,
        ``weight_decay``, ``momentum``, ``eps``; ``betas`` from ``beta1``/``beta2``), where
        the trial has one; ``register(opt, lr="lr_d")`` reads another name, and
        ``register(opt, lr=lambda p: 2 * p["lr"])`` computes it. Each registered scheduler
        then restarts that slot's schedule. Both are saved with each trial's checkpoint.
        Register optimizers before their schedulers.
        """
        if not (hasattr(obj, "reset_trial") and hasattr(obj, "trial_state")):
            raise ConfigError(f"run.register takes a hydro.optim optimizer or a "
                              f"hydro.optim.lr_scheduler scheduler, got {type(obj).__name__}: "
                              "reset any other per-trial state in run.on_trial(fn)")
        keys = set(getattr(obj, "per_trial_keys", ()))
        unknown = sorted(set(hparams) - keys)
        if unknown:
            raise ConfigError(f"run.register: {type(obj).__name__} has no per-trial "
                              f"hyperparameter {', '.join(unknown)} (it has "
                              f"{', '.join(sorted(keys)) or 'none'})")
        self._registered.append((obj, hparams))
        return obj

    def on_trial(self, fn: Callable[[int], Any]) -> Callable[[int], Any]:
        """Call ``fn(slot)`` whenever ``slot`` takes a new trial (after Hydro reset the model
        and the registered objects): reset per-trial state you keep yourself (an EMA copy, a
        counter) there. Usable as a decorator."""
        self._on_trial.append(fn)
        return fn

    # --- the loop ------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        """One iteration per training step of every trial in the group, until the group has
        no trial left; yields the number of steps the group has taken."""
        if self._iterating:
            raise ConfigError("iterate over run once (for step in run:)")
        self._iterating = True
        group = self._group
        while True:
            group.turns.pause()  # the engine steps, reports, refills, or ends the group
            if not group.live_slots:
                return
            self._reported = None
            yield group.steps
            group.after_step()

    @property
    def due(self) -> bool:
        """Whether this step ends at a report for some trial: call :meth:`report` then."""
        return bool(self._group.due_after_step())

    def report(self, values: Any) -> None:
        """Report one value per slot (``[n]``: a tensor, list or array) for this step: each
        trial's intermediate value for its pruner, and at its last step its result.

        Raises:
            ConfigError: not ``n`` values, or called where no report is due.
        """
        if isinstance(values, torch.Tensor):
            values = values.detach().double().flatten().tolist()
        else:
            values = [float(v) for v in values]
        if len(values) != self.n:
            raise ConfigError(f"run.report takes one value per slot ({self.n}), got "
                              f"{len(values)}")
        if not self.due:
            raise ConfigError(
                "run.report was called where no trial's report is due: report "
                "when run.due is True (every eval_every steps and at the last)"
            )
        self._reported = values

    # --- data ----------------------------------------------------------------------------

    def batch(self, data: Any = None, *, shared: bool = False) -> Any:
        """The next training batch of every slot, each from its trial's own stream (seeded
        by its seed, so its result does not depend on its slot or group), stacked along a new
        leading dimension ``[n, ...]``: call the model with ``shared=False``. Call it more
        than once per step for gradient accumulation. ``shared=True``: one batch for the
        whole group (the group's stream), to call the model on as is.

        ``data``: default the ``train_data`` given to :func:`hydro.tune`; the kinds it
        takes.
        """
        group = self._group
        if shared:
            return group.shared_batch(data)
        return stack_batches([group.next_batch(p, data) for p in range(self.n)])

    def val_batches(self, data: Any = None, batch_size: int | None = None) -> Iterator[Any]:
        """The validation data in order, in batches (shared by every slot): ``val_data`` by
        default."""
        data = self._group.task.val_data if data is None else data
        if data is None:
            raise ConfigError("run.val_batches() needs data: pass val_data to hydro.tune, or "
                              "give run.val_batches(data)")
        return val_stream(data, batch_size or self._group.batch_size)


@dataclass
class _Slot:
    """What a slot of a :class:`LoopGroup` holds: its trial (a :class:`Member`) and its
    data stream's position."""

    member: Member
    drawn: int = 0
    stream: Iterator[Any] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["member"], name)


class LoopGroup:
    """A fused group trained by a user's function: the engine's view (that of
    :class:`hydro.tuning.group.FusedGroup`: ``step``, ``due``, ``evaluate``, ``put``,
    ``drop``, ``add``, ``trial_state``, ``resume``) over ``train(run)``.

    The group has ``capacity`` slots for as long as the function runs (its optimizers hold the
    fused parameters): a slot whose trial ended and that takes no new one is idle, frozen and
    ignored until :meth:`add` gives it a trial. ``members`` are the live slots in order.
    """

    def __init__(self, task: Loop, members: Sequence[tuple[Any, dict[str, Any], int]], *,
                 ratio: int, device: str | torch.device = "cpu", depth_ratio: int = 1,
                 depth_alpha: float = 1.0, like: LoopGroup | None = None,
                 capacity: int | None = None, **_: Any) -> None:
        first, readout, same = set_recipe(self, task, members, ratio, device, depth_ratio,
                                          depth_alpha)
        if like is not None and like.task is task and like.recipe == same:
            self.builder = like.builder
        else:
            target = _target(task, first)
            self.builder = _Builder(task, ratio, task.example(), target, first, readout,
                                    (depth_ratio, depth_alpha))
        self.recipe = same
        self.compile = False
        self.compiled_graphs = None
        self.capacity = max(int(capacity or 0), len(members))
        entries = [*members, *[members[0]] * (self.capacity - len(members))]
        self.slots = [_Slot(Member(i, dict(p), int(sd), None)) for i, p, sd in entries]
        modules = [self.builder.make(s.params, s.seed) for s in self.slots]
        self.widths, self.blocks = _widths(modules[0]), _blocks(modules[0])
        self.fused = FusedModel(modules, own=True).to(device)
        for k, s in enumerate(self.slots):
            self.fused.reseed_trial(k, s.seed)
        self.fused.train()
        self.live_slots = list(range(len(members)))
        self.steps = 0
        self.live_steps = 0
        self.rank, self.world_size = 0, 1
        self._shared_stream: Iterator[Any] | None = None
        self.run = Run(self)
        self.turns = _Turns(lambda: self._call(), name=f"hydro-train-{members[0][0]}")
        for k in range(len(members), self.capacity):
            self._idle(k)
        # the function's set-up, up to its first step (returning without one is its error)
        self.turns.resume()

    def _call(self) -> None:
        self.task.train(self.run)
        if self.live_slots and not self.run._iterating:
            raise ConfigError("train(run) returned before its first step: loop `for step in "
                              "run:` (one iteration per training step) until it ends")
        if self.live_slots:
            first = self.slots[self.live_slots[0]]
            raise ConfigError(f"train(run) returned while trial {first.id} was at step "
                              f"{first.step} of {self.task.steps}: loop `for step in run:` "
                              "to its end (Hydro ends it when no trial is left)")

    # --- the engine's view ---------------------------------------------------------------

    @property
    def members(self) -> list[_Slot]:
        return [self.slots[p] for p in self.live_slots]

    @property
    def n(self) -> int:
        return len(self.live_slots)

    def step(self) -> None:
        """One step of every slot: the function's next iteration."""
        self.turns.resume()  # a function that returned early raised, in _call

    def after_step(self) -> None:
        """Called in the function's thread at the end of an iteration."""
        if self.due_after_step() and self.run._reported is None:
            raise ConfigError(f"train(run) did not call run.report(values) at step "
                              f"{self.steps + 1}, where a report was due (run.due was "
                              "True)")
        for p in self.live_slots:
            self.slots[p].member.step += 1
        self.steps += 1
        self.live_steps += self.n

    def due_after_step(self) -> list[int]:
        every, last = self.task.eval_every, self.task.steps
        ahead = {p: self.slots[p].step + 1 for p in self.live_slots}
        return [p for p, s in ahead.items() if s % every == 0 or s == last]

    def due(self) -> list[int]:
        every, last = self.task.eval_every, self.task.steps
        return [k for k, m in enumerate(self.members) if m.step % every == 0 or m.step == last]

    def evaluate(self, full: Sequence[int] | None = None) -> list[float]:
        """The values your loop reported (``full``: as for a FusedGroup; your loop evaluates
        as it likes)."""
        reported = self.run._reported
        if reported is None:
            return [math.nan] * self.n
        return [reported[p] for p in self.live_slots]

    def diverged(self) -> dict[int, int]:
        flags = self.fused.diverged.tolist()
        return {k: self.slots[p].step for k, p in enumerate(self.live_slots) if flags[p]}

    def put(self, slot: int, id: Any, params: dict[str, Any], seed: int) -> None:
        """Start trial ``id`` in live slot ``slot`` from scratch."""
        self._start(self.live_slots[slot], id, params, seed)

    def add(self, id: Any, params: dict[str, Any], seed: int) -> int:
        """Start trial ``id`` in an idle slot; returns its index among the live slots."""
        idle = [p for p in range(self.capacity) if p not in self.live_slots]
        if not idle:
            raise ConfigError("this group has no idle slot: a training function's group keeps "
                              "its size")
        self._start(idle[0], id, params, seed)
        self.live_slots.append(idle[0])
        return len(self.live_slots) - 1

    def drop(self, slots: Sequence[int]) -> None:
        """The live slots ``slots`` take no new trial: they idle (frozen) until :meth:`add`;
        with none left the function's loop ends."""
        gone = {self.live_slots[k] for k in slots}
        for p in gone:
            self._idle(p)
        self.live_slots = [p for p in self.live_slots if p not in gone]
        if not self.live_slots:
            self.turns.resume()  # `for step in run` ends; the function returns
            self.turns.close()

    def close(self) -> None:
        self.turns.close()

    def _idle(self, p: int) -> None:
        with torch.no_grad():
            self.fused.diverged[p] = True  # the fused optimizers leave a diverged slot alone

    def _start(self, p: int, id: Any, params: dict[str, Any], seed: int) -> None:
        member = Member(id, dict(params), int(seed), None)
        if group_key(member.params, self.task) != self.key:
            raise ConfigError(f"trial {id!r} cannot join this fused group: its batch size or "
                              "architecture differs")
        self.fused.load_trial(p, self.builder.make(member.params, member.seed).to(self.device),
                              seed=member.seed)
        with torch.no_grad():
            self.fused.diverged[p] = False
        self.slots[p] = _Slot(member)
        optimizers = [(o, h) for o, h in self.run._registered if hasattr(o, "per_trial_keys")]
        schedulers = [(o, h) for o, h in self.run._registered if not hasattr(o, "per_trial_keys")]
        for opt, names in optimizers:
            opt.reset_trial(p, **_hyper(opt, member.params, names, p))
        for sched, _ in schedulers:
            sched.reset_trial(p)
        for fn in self.run._on_trial:
            fn(p)

    def trial_state(self, slot: int) -> dict[str, Any]:
        """The trial in live slot ``slot``: its model slice, the registered objects' slices and
        its data position (see :meth:`hydro.tuning.group.FusedGroup.trial_state`)."""
        p = self.live_slots[slot]
        s = self.slots[p]
        return {
            "id": s.id, "params": dict(s.params), "seed": s.seed, "step": s.step,
            "history": [list(h) for h in s.history], "drawn": s.drawn,
            "model": self.fused.trial_state(p),
            "registered": [o.trial_state(p) for o, _ in self.run._registered],
        }

    def resume(self, slot: int, state: dict[str, Any]) -> None:
        """Put the trial of :meth:`trial_state` in live slot ``slot``, at its step."""
        registered = state.get("registered")
        if registered is None or len(registered) != len(self.run._registered):
            raise ConfigError("the checkpoint's registered optimizers and schedulers differ "
                              "from this training function's")
        self.put(slot, state["id"], state["params"], int(state["seed"]))
        p = self.live_slots[slot]
        self.fused.load_trial_state(p, state["model"])
        for (obj, _), saved in zip(self.run._registered, registered):
            obj.load_trial_state(p, saved)
        s = self.slots[p]
        s.member.step = int(state["step"])
        s.member.history[:] = [(int(a), float(v)) for a, v in state["history"]]
        for _ in range(int(state.get("drawn", 0))):
            self.next_batch(p, None)

    def unsplittable(self, world_size: int) -> str | None:
        return None if world_size == 1 else "a training function's group trains on one device"

    def distribute(self, rank: int, world_size: int) -> None:
        if world_size != 1:
            raise ConfigError(f"this group cannot train data parallel: "
                              f"{self.unsplittable(world_size)}")

    # --- data ----------------------------------------------------------------------------

    def next_batch(self, p: int, data: Any) -> Any:
        s = self.slots[p]
        if s.stream is None:
            source = self.task.train_data if data is None else data
            if source is None:
                raise ConfigError("run.batch() needs data: pass train_data to hydro.tune, or "
                                  "give run.batch(data)")
            s.stream = train_stream(source, self.batch_size, s.seed)
        s.drawn += 1
        return next(s.stream)

    def shared_batch(self, data: Any) -> Any:
        if self._shared_stream is None:
            source = self.task.train_data if data is None else data
            if source is None:
                raise DataError("run.batch(shared=True) needs data: pass train_data to "
                                "hydro.tune, or give run.batch(data, shared=True)")
            self._shared_stream = train_stream(source, self.batch_size, self.slots[0].seed)
        return next(self._shared_stream)


def _hyper(opt: Any, params: dict[str, Any], names: dict[str, Any], slot: int) -> dict[str, Any]:
    """A new trial's values of ``opt``'s per-trial hyperparameters (see :meth:`Run.register`)."""
    out: dict[str, Any] = {}
    for key in opt.per_trial_keys:
        source = names.get(key)
        if callable(source):
            out[key] = source(params)
        elif isinstance(source, str):
            if source not in params:
                raise ConfigError(f"run.register: {key}={source!r} but the trial has no "
                                  f"{source!r} (it has {sorted(params)})")
            out[key] = params[source]
        elif key == "betas" and ("beta1" in params or "beta2" in params):
            b1, b2 = opt.param_groups[0]["betas"]  # this slot's values where not searched
            out[key] = (float(params.get("beta1", b1[slot])), float(params.get("beta2", b2[slot])))
        elif key in params:
            out[key] = params[key]
    return out


def make_group(task: Any, members: Sequence[tuple[Any, dict[str, Any], int]], options: Any,
               **kwargs: Any) -> Any:
    """The fused group the engine trains for ``task`` with the run's ``options`` (its ratio and
    depth cut; in this process or an executor's worker): a :class:`LoopGroup` for a
    :class:`Loop`, else a :class:`hydro.tuning.group.FusedGroup`. ``kwargs``: the device, an
    earlier group ``like`` it, the ``capacity`` of a loop's group, and the compile settings."""
    if options.matmul_precision is not None:  # where groups train: this process or a worker
        torch.set_float32_matmul_precision(options.matmul_precision)
    kwargs.update(ratio=options.ratio, depth_ratio=options.depth_ratio,
                  depth_alpha=options.depth_alpha)
    if isinstance(task, Loop):
        return LoopGroup(task, members, **kwargs)
    from hydro.tuning.group import FusedGroup

    kwargs.pop("capacity", None)
    return FusedGroup(task, members, **kwargs)

"""The fused group: trials of one :func:`group_key` trained as one fused model, a slot each.

:class:`FusedGroup` builds each member's surrogate (:func:`build_members`: one capture and width
analysis per group, each member from its own factory arguments and seed) and trains the slots
each at its own step. Every member reports its own validation value at every ``eval_every``
steps; a member that ends is dropped from the fused model (``select``) so it stops costing
compute; a member whose loss or gradients stop being finite is frozen by the fused optimizer.
The optimizer, schedules, step and validation come from :mod:`hydro.tuning.recipe`; training a
fixed group to the end is :func:`hydro.tuning.lockstep.train_group`.
"""

from __future__ import annotations

import os
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hydro.collector import collector_paused
from hydro.errors import ConfigError, HydroWarning
from hydro.fusion import FusedModel
from hydro.fusion import random as _random
from hydro.fx import cache as _capture_cache
from hydro.fx.capture import _copy_graph_module
from hydro.parametrize import READOUT
from hydro.scaling import build
from hydro.tuning import compile_record, compiling, parallel
from hydro.tuning.eval_sample import choose_blocks, prefix_means
from hydro.tuning.loss_scale import LossScales

# DEFAULTS and _schedule are re-exported for the tuner and benchmarks that import them from here
from hydro.tuning.recipe import (  # noqa: F401
    DEFAULTS,
    _hyper,
    _optimizer,
    _schedule,
    _scheduler,
    _train_step,
    block_means,
    evaluate,
)
from hydro.tuning.task import SAMPLE_BLOCK, Task, stack_batches


@dataclass
class Outcome:
    """How one member of a group ended."""

    state: Literal["complete", "pruned", "fail"]
    value: float | None
    step: int
    reason: str = ""
    history: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GroupInfo:
    """Facts about a trained group, recorded with each of its trials."""

    ratio: int
    size: int
    widths: dict[str, list[int]]
    depth_ratio: int = 1
    depth_alpha: float = 1.0
    blocks: dict[str, int] = field(default_factory=dict)  # repeated blocks: target, surrogate
    seconds: float = 0.0
    pid: int = field(default_factory=os.getpid)  # the process that trained the group
    occupancy: float = 1.0  # mean live members per fused step, as a fraction of the slots


def check_device(device: Any) -> str:
    """``device`` as a string torch accepts, or a :class:`ConfigError` saying what to use.

    ``"cuda"`` (or ``"cuda:1"``) needs a CUDA build of torch and a visible GPU; ``"cpu"``
    always works.

    Example:
        >>> check_device("cpu")
        'cpu'
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device {device!r} is not a torch device: use 'cpu', 'cuda' or "
                          "'cuda:N'") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {device!r} was asked but CUDA is not available here "
                "(torch.cuda.is_available() is False: no GPU visible, or a CPU-only build of "
                f"torch {torch.__version__}). Use device 'cpu', or run where a GPU and a CUDA "
                "build of torch are installed."
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r}: this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ConfigError(f"device {device!r}: Hydro trains on 'cpu' or 'cuda[:N]'")
    return str(dev)


def group_key(params: dict[str, Any], task: Task) -> tuple:
    """Trials can share one fused model when their batch size and architecture agree.

    Architecture is what a factory argument *does*, not its name: the model is built on the
    ``meta`` device (no memory) and its parameter and buffer shapes, module types and
    non-float settings make the key. A searched ``dropout`` (a float stored on modules, or a
    literal in forward) changes none of them, so trials differing only in dropout fuse; each
    member is still built from its own arguments (:func:`build_members`).
    """
    args = tuple(sorted((k, params[k]) for k in task.model_args() if k in params))
    return (params.get("batch_size", task.batch_size), structure(task, args))


_STRUCTURES: dict[tuple, Any] = {}
_SITES: dict[tuple, Any] = {}


def structure(task: Task, args: tuple) -> Any:
    """A hashable summary of what the factory builds for ``args`` (shapes, types, settings)."""
    key = (id(task.model), repr(args))
    if key not in _STRUCTURES:
        try:
            with torch.device("meta"), _SkipInit():
                model = task.build_model(**dict(args))
        except Exception:
            return ("args", args)  # the factory does not build on meta: every argument counts
        parts: list[Any] = []
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            parts.append((name, tuple(t.shape), str(t.dtype)))
        for name, m in model.named_modules():
            settings = tuple(sorted(
                (k, v) for k, v in vars(m).items()
                if not k.startswith("_") and isinstance(v, (bool, int, str, type(None)))
            ))
            parts.append((name, type(m).__qualname__, settings))
        _STRUCTURES[key] = tuple(parts)
    return _STRUCTURES[key]


# initializers and random fills: on the meta device they have no values to write
_INIT_NAMES = frozenset({
    "normal_", "uniform_", "trunc_normal_", "zero_", "zeros_", "ones_", "fill_", "constant_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
    "eye_", "dirac_", "sparse_", "random_", "exponential_", "bernoulli_", "cauchy_",
    "log_normal_", "geometric_",
})


class _SkipInit(TorchFunctionMode):
    """Skips initializing meta tensors (a factory's ``reset_parameters``, ``nn.init``): they hold
    no values, and torch runs meta random fills through Python decompositions whose first call
    imports ``torch._dynamo`` (over a second). Shapes, dtypes and modules are unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _INIT_NAMES:
            first = args[0] if args else kwargs.get("tensor")  # nn.init passes it by name
            if isinstance(first, torch.Tensor) and first.is_meta:
                return first
        return func(*args, **kwargs)


@collector_paused()
def build_members(
    task: Task,
    params: Sequence[dict[str, Any]],
    ratio: int,
    seeds: Sequence[int],
    example: tuple[tuple, dict],
    target: nn.Module | None = None,
    *,
    depth_ratio: int = 1,
    depth_alpha: float = 1.0,
) -> list[nn.Module]:
    """One surrogate per member, each from its own factory arguments and seed.

    The group shares one capture and width analysis (its members agree on
    :func:`group_key`). Factory arguments that differ between members without changing the
    architecture (dropout) show up as literals in the captured graphs: the target is captured
    once more with the argument changed, the literals that follow it are located, and each
    member's copy gets its own value there. Where a literal does not equal the argument
    (computed from it), that member is captured on its own. A member's surrogate depends only
    on its own arguments and seed. ``depth_ratio``/``depth_alpha`` cut stacks of repeated
    blocks (:func:`hydro.scale`).
    """
    if target is None:
        target = _target(task, params[0])
    always = any("output_mult" in p for p in params)
    builder = _Builder(task, ratio, example, target, params[0], always, (depth_ratio, depth_alpha))
    return [builder.make(dict(p), int(sd)) for p, sd in zip(params, seeds)]


def _lit(x: Any) -> Any:
    return torch.fx.node.map_arg(x, lambda n: ("node", n.name))


def _literal_sites(task, scaled, args0, name, value, example) -> list | None:
    """Where the captured graphs write factory argument ``name`` as a literal, or ``None``."""
    from hydro.fx.capture import capture

    # training is where a literal like dropout acts; the eval graph keeps the first member's
    other = capture(task.build_model(**{**args0, name: value}), example[0], example[1],
                    modes=("train",), dynamic=task.dynamic,
                    cache=_capture_cache.for_task(task))
    sites = []
    for mode, gm in scaled.captured.graphs.items():
        if mode not in other.graphs:
            continue
        a_nodes, b_nodes = list(gm.graph.nodes), list(other.graphs[mode].graph.nodes)
        if len(a_nodes) != len(b_nodes):
            return None
        for a, b in zip(a_nodes, b_nodes):
            if (
                a.target != b.target
                or len(a.args) != len(b.args)
                or _lit(a.kwargs) != _lit(b.kwargs)
            ):
                return None
            for i, (x, y) in enumerate(zip(a.args, b.args)):
                if _lit(x) == _lit(y):
                    continue
                if isinstance(x, (torch.fx.Node, list, tuple)):
                    return None
                if x != args0[name] or y != value:
                    return None  # computed from the argument: not a plain literal
                new = scaled.node_map[a]
                sites.append((mode, new.name, i))
    return sites


@dataclass
class Member:
    """One trial in a slot of a :class:`FusedGroup`: its own seed, data stream and step count."""

    id: Any  # the caller's name for it (a trial number, an index)
    params: dict[str, Any]
    seed: int
    batches: Iterator[Any] | None  # None with shared data: the group's stream feeds it
    step: int = 0  # steps trained so far
    history: list[tuple[int, float]] = field(default_factory=list)


def set_recipe(group: Any, task: Any, members: Sequence[tuple[Any, dict[str, Any], int]],
               ratio: int, device: Any, depth_ratio: int, depth_alpha: float) -> tuple:
    """What makes a group (of :class:`FusedGroup` or :class:`hydro.tuning.loop.LoopGroup`): its
    task, ratio, device, depth cut, key and batch size set on ``group``; returns the first
    member's parameters, whether a readout multiplier is searched, and the recipe a later group
    of the key must match to reuse this one's capture (``like=``)."""
    group.task, group.ratio, group.device = task, ratio, device
    group.depth_ratio, group.depth_alpha = depth_ratio, depth_alpha
    first = dict(members[0][1])
    group.key = group_key(first, task)
    group.batch_size = int(first.get("batch_size", task.batch_size))
    readout = any("output_mult" in m[1] for m in members)
    return first, readout, (group.key, ratio, depth_ratio, depth_alpha, readout)


class FusedGroup:
    """A fused group whose slots train independent trials, each at its own step.

    Every slot has its own initialization, data order (its trial seed's stream, fed to the
    fused model as per-trial batches), optimizer state and schedule position, so a trial's result
    depends only on its parameters and seed, not on its slot or on the trials beside it. With
    ``task.data_mode == "shared"`` the slots read one stream instead, the group's (from its first
    member's seed, :attr:`data_seed`): one batch loaded and fed to every slot per step. A slot
    freed by pruning, divergence or completion takes a new trial with :meth:`put` (a fresh
    surrogate in that slot, its optimizer state and schedule restarted) or leaves the group with
    :meth:`drop`; :meth:`add` grows the group by a slot for one more trial.

    Args:
        task: what to train.
        members: ``(id, params, seed)`` of the first trials (all with the same :func:`group_key`).
        ratio: surrogate width divisor.
        device: where to train.
        refill: slots will take new trials (:meth:`put`); ``False`` when they never do.
        depth_ratio: keep every ``depth_ratio``-th block of each stack of repeated blocks.
        depth_alpha: the residual-branch exponent of the depth cut (1: CompleteP).
        like: an earlier group of the same task, key, ratio and depth (empty or not): its
            capture and width analysis are reused, so the group is built without capturing
            the model again (anything else: captured afresh).
        compile: train through ``torch.compile`` (:mod:`hydro.tuning.compiling`): ``True`` or
            a mode, ``False`` (default), or ``"auto"``: time the first eager steps and compile
            if it pays back over ``trials_left`` trials' steps; ``note(line)`` hears the
            decision (or why compiling is off).
        trials_left: the trials the study still has to train (for ``"auto"``; default: this
            group's own).
        note: where the compile decision is said (default: nowhere).
    """

    @collector_paused()
    def __init__(
        self,
        task: Task,
        members: Sequence[tuple[Any, dict[str, Any], int]],
        *,
        ratio: int,
        device: str | torch.device = "cpu",
        refill: bool = True,
        depth_ratio: int = 1,
        depth_alpha: float = 1.0,
        like: FusedGroup | None = None,
        compile: bool | str = False,
        trials_left: int | None = None,
        note: Callable[[str], None] | None = None,
    ) -> None:
        first, readout, same = set_recipe(self, task, members, ratio, device, depth_ratio,
                                          depth_alpha)
        if like is not None and like.task is task and like.recipe == same:
            # an earlier group of this key: its capture and width analysis serve this one (a
            # member's surrogate depends only on its own arguments and seed)
            self.builder, target = like.builder, None
        else:
            sample_batch = next(task.train_batches(min(self.batch_size, 2),
                                                   seed=int(members[0][2])))
            target = _target(task, first)
            task.validate(target, sample_batch)  # clear errors before any training
            if task.example_inputs is not None:
                example: tuple[tuple, dict] = (tuple(task.example_inputs), {})
            else:
                args, kwargs, _ = task.split(sample_batch)
                example = (args, kwargs)
            self.builder = _Builder(task, ratio, example, target, first, readout,
                                    (depth_ratio, depth_alpha))
        self.recipe = same
        self.shared = task.data_mode == "shared"
        self.data_seed = int(members[0][2])
        # shared data: one stream for the group, read once per fused step
        self.batches = task.train_batches(self.batch_size, seed=self.data_seed) \
            if self.shared else None
        self.members = [self._member(i, p, sd) for i, p, sd in members]
        modules = [self.builder.make(m.params, m.seed) for m in self.members]
        self.widths = _widths(modules[0])
        self.blocks = _blocks(modules[0])
        cut = self.blocks.get("surrogate", 0) < self.blocks.get("target", 0)
        if target is not None and ratio > 1 and not self.widths["target"] and not cut:
            warnings.warn(HydroWarning(
                f"no width of {type(target).__name__} can shrink (every dimension is tied to the "
                f"inputs or outputs), so the ratio-{ratio} surrogate equals the full model: "
                "Hydro tunes the full model itself, fused. Use a model with hidden layers, or "
                "ratio=1."
            ), stacklevel=3)
        self.compile = compiling.check_compile(compile)
        self._note = note or (lambda line: None)
        self._trials_left = len(members) if trials_left is None else int(trials_left)
        # "auto" checks once it would compile: the check is itself a compile (seconds, cold)
        if self.compile not in (False, "auto") and compiling.unavailable():
            self._note(f"compile: {self.compile} -> off ({compiling.unavailable()})")
            self.compile = False
        self._timings: list[float] | None = [] if self.compile == "auto" else None
        self._compiled: dict[str, Any] | None = None  # timing the first compiled steps
        model_compile = self.compile if self.compile != "auto" else False
        if model_compile:
            compile_record.use_private_inductor_cache()
            if like is None:  # compiles at its first step: timed, kept for "auto" to read
                self._compiled = {"key": None, "mode": model_compile, "eager_s": None,
                                  "times": []}
        # fuse's FusedModel, handed the fresh surrogates rather than copying them
        self.fused = FusedModel(modules, own=True).compile(model_compile).to(device)
        self.compiled_graphs = None  # set when a resize turned compiling off
        if model_compile and like is not None:  # a key's later group: its graphs, compiled
            self.fused.share_compiled(like.compiled_graphs or like.fused)
        for k, m in enumerate(self.members):  # dropout masks follow the trial's seed, not its slot
            self.fused.reseed_trial(k, m.seed)
        self.fused.train()
        self.slot_params = [m.params for m in self.members]  # what slot k's schedule reads
        # a compiled model steps the optimizer's compiled update too; eager: its own default
        self.opt = _optimizer(task, self.fused, self.slot_params,
                              compile=True if model_compile else "auto")
        self.sched = _scheduler(task, self.opt, self.slot_params, always=refill)
        self.clip = [p.get("grad_clip") for p in self.slot_params]
        # float16: a loss scale per trial (an overflow skips its own trial's step only)
        self.scales = LossScales(self.n, self.device) if task.precision == "fp16" else None
        # eval_samples="auto": the blocks the study's subsample holds (None: not yet known),
        # and what this group measured at its last evaluation, for the slot loop to record
        self.eval_blocks: int | None = None
        self.measured: int | None = None
        self._blocks: tuple[torch.Tensor, torch.Tensor] | None = None
        self.steps = 0  # fused steps taken
        self.live_steps = 0  # sum over those steps of the slots that trained
        # what data parallel refuses (a group built like an earlier one: as that one found)
        self.batch_norm = like.batch_norm if target is None else parallel.batch_norm(target)
        self.rank, self.world_size = 0, 1  # data parallel replicas (distribute)

    def _member(self, id: Any, params: dict[str, Any], seed: int) -> Member:
        params = dict(params)
        if group_key(params, self.task) != self.key:
            raise ConfigError(f"trial {id!r} cannot join this fused group: its batch size or "
                              "architecture differs (group_key)")
        batches = None if self.shared else self.task.train_batches(self.batch_size, seed=int(seed))
        return Member(id, params, int(seed), batches)

    @property
    def n(self) -> int:
        """Slots in the group now."""
        return len(self.members)

    @collector_paused()
    def put(self, slot: int, id: Any, params: dict[str, Any], seed: int) -> None:
        """Start trial ``id`` in ``slot`` from scratch: a fresh surrogate from ``seed``, a fresh
        optimizer state and schedule with its own hyperparameters, its own data stream."""
        member = self._member(id, params, seed)
        if "output_mult" in member.params and not self.builder.readout:
            raise ConfigError("output_mult is searched but this group was built without it")
        self.fused.load_trial(slot, self.builder.make(member.params, member.seed).to(self.device),
                              seed=member.seed)
        hyper = _hyper(self.task, member.params)
        self.opt.reset_trial(slot, **hyper)
        if self.scales is not None:
            self.scales.reset(slot)
        self.slot_params[slot] = member.params
        if self.sched is None:
            if "warmup" in member.params:
                raise ConfigError("warmup is searched but this group was built without "
                                  "schedules (refill=False)")
        else:
            self.sched.reset_trial(slot, base_lr=hyper["lr"])  # rebuilt from slot_params
        self.clip[slot] = member.params.get("grad_clip")
        self.members[slot] = member
        # a new member's dropout rate may make the graph draw where it did not
        why = self.unsplittable(self.world_size)
        if why:
            raise ConfigError(f"trial {id!r} cannot join this data parallel group: {why}. "
                              "Train its group with world_size 1")

    def trial_state(self, slot: int) -> dict[str, Any]:
        """The trial in ``slot`` as it stands (copies, tensors and plain containers only): its
        id, parameters, seed, step and history, its slice of the fused model (random stream
        included), of the optimizer and of its schedule. :meth:`resume` puts it in any slot of
        any group of its :func:`group_key`, where it goes on as if never moved."""
        m = self.members[slot]
        return {
            "id": m.id, "params": dict(m.params), "seed": m.seed, "step": m.step,
            "history": [list(h) for h in m.history],
            "model": self.fused.trial_state(slot),
            "optimizer": self.opt.trial_state(slot),
            "scheduler": self.sched.trial_state(slot) if self.sched is not None else None,
            **({"loss_scale": self.scales.trial_state(slot)} if self.scales is not None else {}),
        }

    def resume(self, slot: int, state: dict[str, Any]) -> None:
        """Put the trial of :meth:`trial_state` in ``slot``, at its step: its data stream is
        read up to there, so it draws the batches it would have drawn next (with shared data it
        goes on with this group's stream).

        Raises:
            ConfigError or FuseError: ``state`` does not fit this group (another architecture).
        """
        self.put(slot, state["id"], state["params"], int(state["seed"]))
        self.fused.load_trial_state(slot, state["model"])
        self.opt.load_trial_state(slot, state["optimizer"])
        if self.sched is not None and state["scheduler"] is not None:
            self.sched.load_trial_state(slot, state["scheduler"])
        if self.scales is not None and "loss_scale" in state:
            self.scales.load_trial_state(slot, state["loss_scale"])
        m = self.members[slot]
        self.skip(int(state["step"]), m)
        m.step = int(state["step"])
        m.history[:] = [(int(s), float(v)) for s, v in state["history"]]

    def skip(self, steps: int, member: Member | None = None) -> None:
        """Read ``steps`` batches of ``member``'s stream (per-trial data) or, without one, of the
        group's (shared data), so a resumed stream draws next what it would have; a stream the
        data mode does not have is left alone."""
        stream = self.batches if member is None else member.batches
        if stream is not None:
            for _ in range(steps):
                next(stream)

    def restart_data(self, seed: int, steps: int) -> None:
        """Shared data: the group's stream afresh from ``seed``, read up to ``steps`` batches
        (a group rebuilt from a checkpoint goes on with the stream it had)."""
        if self.shared:
            self.data_seed = int(seed)
            self.batches = self.task.train_batches(self.batch_size, seed=self.data_seed)
            self.skip(steps)

    def add(self, id: Any, params: dict[str, Any], seed: int) -> int:
        """Start trial ``id`` in a new slot at the end (the group grows by one) and return that
        slot. The trial starts from scratch exactly as with :meth:`put`; the other slots go on
        bit for bit."""
        if not self.n:
            raise ConfigError("add: this group has no slot left to copy; build a new FusedGroup")
        self._member(id, params, seed)  # a trial of another key is refused before any change
        grown = [*range(self.n), 0]  # slot 0 copied to the end, then overwritten by put
        self._resized()
        self.fused.select(grown, repeat=True)
        self.opt.select(grown)
        if self.scales is not None:
            self.scales.select(grown)
        self.members.append(self.members[0])
        self.clip.append(None)
        self.slot_params.append(self.slot_params[0])  # in place: the schedules read this list
        self.put(self.n - 1, id, params, seed)
        return self.n - 1

    def drop(self, slots: Sequence[int]) -> None:
        """Remove ``slots`` from the group (they stop costing compute)."""
        keep = [k for k in range(self.n) if k not in set(slots)]
        if keep:
            self._resized()
            self.fused.select(keep)
            self.opt.select(keep)
            if self.scales is not None:
                self.scales.select(keep)
        self.members = [self.members[k] for k in keep]
        self.clip = [self.clip[k] for k in keep]
        self.slot_params[:] = [self.slot_params[k] for k in keep]

    def unsplittable(self, world_size: int) -> str | None:
        """Why this group cannot train as ``world_size`` data parallel replicas exactly as on
        one device (:mod:`hydro.tuning.parallel`), or ``None`` when it can."""
        if world_size == 1:
            return None
        if self.batch_size % world_size:
            return (f"batch size {self.batch_size} does not divide by world_size {world_size}: "
                    "data parallel splits every batch into equal shards")
        if self.batch_norm:
            return (f"{self.batch_norm} normalizes over the batch: on a shard its statistics "
                    "differ from the whole batch's")
        sample = next(self.task.train_batches(world_size, seed=self.members[0].seed))
        if parallel.random_ops(self.fused, stack_batches([sample] * self.n), self.task):
            return ("the model draws random numbers in training (dropout, drop-path, sampling) "
                    "whose per-trial masks follow each row's place in the batch: a shard "
                    "would draw other masks")
        return None

    def distribute(self, rank: int, world_size: int) -> None:
        """Train as replica ``rank`` of ``world_size`` data parallel replicas (an initialized
        ``torch.distributed`` process group): each takes its share of every batch's rows, the
        gradients are averaged, evaluation runs on rank 0 (:mod:`hydro.tuning.parallel`).

        Raises:
            ConfigError: the group cannot be split exactly (:meth:`unsplittable`).
        """
        why = self.unsplittable(world_size)
        if why:
            raise ConfigError(f"this group cannot train data parallel: {why}. Train it with "
                              "world_size 1")
        self.rank, self.world_size = int(rank), int(world_size)

    def step(self) -> torch.Tensor:
        """One training step of every slot, each on the next batch of its own stream (shared
        data: all on the next batch of the group's); returns the slots' losses ``[n]``, on the
        device (reading them waits for the step to finish). A data parallel replica trains on
        its shard and returns the whole batch's losses."""
        timing = self._timings is not None or self._compiled is not None
        start = time.perf_counter() if timing else 0.0
        batches = [next(self.batches)] if self.shared else [next(m.batches) for m in self.members]
        reduce = None
        if self.world_size > 1:
            batches, reduce = self._replica(batches)
        # shared: one batch, copied to the device once, fed to every slot
        batch = batches[0] if self.shared else stack_batches(batches)
        losses = _train_step(self.task, self.fused, self.opt, batch, self.clip, self.device,
                             shared=self.shared, reduce=reduce, scales=self.scales)
        if self.sched is not None:
            self.sched.step()
        for m in self.members:
            m.step += 1
        self.steps += 1
        self.live_steps += self.n
        if self._timings is not None and self.steps > 1:  # the first step builds the graphs
            compiling.time_eager_step(self, start)
        elif self._compiled is not None:
            compiling.time_compiled_step(self, start)
        return losses

    def _resized(self) -> None:
        """A compiled group changes size: it trains eagerly from here, since every new size is
        a new graph to compile (a draining group would compile once per trial that ends). Its
        compiled graphs stay for the key's next group (:meth:`FusedModel.share_compiled`)."""
        if self.fused._compiler is not None:  # self.compile stays: the key's later groups
            self.compiled_graphs = self.fused._compiler
            self.fused.compile(False)
            self.opt.set_compile(False)
        elif self._timings is not None:  # "auto" still measuring: a new size, a new graph
            self._timings = []
        self._compiled = None  # its first compiled steps were of another size

    def _replica(self, batches: list[Any]) -> tuple[list[Any], Callable]:
        """This replica's shards of ``batches``, and the reduction of its losses and gradients
        to the whole batch's (run after the backward pass)."""
        rank, world = self.rank, self.world_size
        shards = [parallel.shard(b, rank, world, self.task.batch_len(b)) for b in batches]

        def reduce(losses: torch.Tensor) -> torch.Tensor:
            return parallel.all_reduce_mean(self.fused, losses, world)

        return shards, reduce

    def diverged(self) -> dict[int, int]:
        """Slots whose loss or gradients stopped being finite (frozen by the optimizer since),
        each with its own step at which that happened; one read of the device (rank 0's, for
        data parallel replicas)."""
        flags, steps = parallel.share(
            torch.stack([self.fused.diverged.long(), self.fused.trial_step]).tolist(),
            self.rank, self.world_size)
        # a frozen trial's random stream stops counting: its step count is where it diverged
        return {k: int(steps[k]) for k in range(self.n) if flags[k]}

    def due(self) -> list[int]:
        """Slots at an evaluation step (every ``eval_every`` of their own steps, and the last)."""
        every, last = self.task.eval_every, self.task.steps
        return [k for k, m in enumerate(self.members) if m.step % every == 0 or m.step == last]

    @property
    def wants_eval_blocks(self) -> bool:
        """``eval_samples="auto"`` and the size of the study's subsample not known here yet."""
        return self.task.eval_samples == "auto" and self.eval_blocks is None

    def evaluate(self, full: Sequence[int] | None = None) -> list[float]:
        """Every slot's validation value (data parallel replicas: rank 0's, on every rank);
        with ``task.eval_samples``, over the fixed subsample except for the slots in ``full``
        (default: all), which read the whole split (see :func:`hydro.tuning.recipe.evaluate`).

        With ``"auto"`` and no size known yet (:attr:`eval_blocks`), the slots not in ``full``
        read every block once: the size they measure is :attr:`measured` (``None``: they could
        not tell it), and their values are over that many blocks.
        """
        self.measured = None
        values = None
        if self.rank == 0:
            if self.wants_eval_blocks and full is not None and len(set(full)) < self.n:
                values = self._measure(full)
            else:
                samples = self.eval_blocks * SAMPLE_BLOCK if self.eval_blocks else None
                values = evaluate(self.task, self.fused, self.batch_size, self.device, full,
                                  samples=samples)
        values, self.measured = parallel.share((values, self.measured), self.rank,
                                               self.world_size)
        return values

    def _measure(self, full: Sequence[int]) -> list[float]:
        """:meth:`evaluate` measuring the subsample's size (rank 0)."""
        means, sizes = self._blocks = block_means(self.task, self.fused, self.device)
        rows = [k for k in range(self.n) if k not in set(full)]
        self.measured = choose_blocks(means[:, rows], sizes)
        return self._values_over(self.measured or len(sizes), full)

    def values_over(self, blocks: int, full: Sequence[int]) -> list[float]:
        """The values of the last measuring evaluation with a subsample of ``blocks`` blocks
        (another tuner of the study recorded its size first); ``full`` slots read the whole
        split as :func:`~hydro.tuning.recipe.evaluate` reads it."""
        values = self._values_over(blocks, full) if self.rank == 0 else None
        return parallel.share(values, self.rank, self.world_size)

    def _values_over(self, blocks: int, full: Sequence[int]) -> list[float]:
        means, sizes = self._blocks
        sub = prefix_means(means, sizes, min(blocks, len(sizes))).tolist()
        whole = evaluate(self.task, self.fused, self.batch_size, self.device) if full else []
        return [whole[k] if k in set(full) else sub[k] for k in range(self.n)]


def _target(task: Task, params: dict[str, Any]) -> nn.Module:
    """The target model for ``params``' architecture, built from a fixed seed: surrogates draw
    from its statistics, so a trial's initialization must not depend on which group built it."""
    args = {k: params[k] for k in task.model_args() if k in params}
    if isinstance(task.model, nn.Module):
        return task.build_model(**args)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return task.build_model(**args)


# float factory arguments (a dropout rate) are captured at two rates of Hydro's, not at the
# first trials': the captures' cache keys are then the same for every study, seed and resume
_CANONICAL = (0.125, 0.0625)


def _canonical(task, target, params0, names):
    """``(target, args0, probe)`` for a group: the target built with its float factory
    arguments at ``_CANONICAL[0]`` (where that leaves its tensors as they are: they only act in
    forward), and the rate each literal site is located with; else the first trial's."""
    args0 = {k: params0[k] for k in names}
    floats = [k for k in names if type(params0[k]) is float]
    if not floats or isinstance(task.model, nn.Module):
        return target, args0, {}
    rates = dict.fromkeys(floats, _CANONICAL[0])
    try:
        canon = _target(task, {**params0, **rates})
    except Exception:  # a factory that refuses the rate: the first trial's
        return target, args0, {}
    a, b = ({**dict(m.named_parameters()), **dict(m.named_buffers())} for m in (target, canon))
    same = a.keys() == b.keys() and all(
        not x.is_meta and x.shape == b[k].shape and x.dtype == b[k].dtype and torch.equal(x, b[k])
        for k, x in a.items()
    )
    if not same:
        return target, args0, {}
    return canon, {**args0, **rates}, dict.fromkeys(floats, _CANONICAL[1])


class _Builder:
    """Surrogates for one group: one capture and width analysis, then each member an
    independent draw from its seed with its own factory arguments (see :func:`build_members`)."""

    def __init__(self, task, ratio, example, target, params0, readout, depth=(1, 1.0)) -> None:
        self.task, self.ratio, self.example, self.readout = task, ratio, example, readout
        self.depth = {"depth_ratio": int(depth[0]), "depth_alpha": float(depth[1])}
        self.names = sorted(k for k in task.model_args() if k in params0)
        target, self.args0, self.probe = _canonical(task, target, params0, self.names)
        self.scaled = build(target, ratio, example_inputs=example[0], example_kwargs=example[1],
                            seed=0, always_readout=readout, dynamic=task.dynamic,
                            cache=_capture_cache.for_task(task), **self.depth)
        self._shared: dict[str, torch.fx.GraphModule] | None = None  # see make
        self.token = uuid.uuid4().hex  # its members' signatures name it (unique, pickled too)

    def make(self, params: dict[str, Any], seed: int) -> nn.Module:
        task, ex_args, ex_kwargs = self.task, *self.example
        args = {k: params[k] for k in self.names}
        differs = [n for n in self.names if args[n] != self.args0[n]]
        sites = {n: self._sites(n, self.probe.get(n, args[n])) for n in differs}
        if any(v is None for v in sites.values()):
            sur = build(_target(task, params), self.ratio, example_inputs=ex_args,
                        example_kwargs=ex_kwargs, seed=int(seed), always_readout=self.readout,
                        dynamic=task.dynamic, cache=_capture_cache.for_task(task),
                        **self.depth).surrogate
        else:

            def edit(mode: str, graph: torch.fx.Graph) -> None:
                # this member's literals, written before the copy's code is generated
                for n in differs:
                    for where, node_name, index in sites[n]:
                        if where == mode:
                            node = next(x for x in graph.nodes if x.name == node_name)
                            node.update_arg(index, args[n])

            # a mode's graph where this member writes no literal of its own is one copy that
            # the members share (a fused model only reads them, for their literals): copied
            # once per builder, not per member; the edited ones are the member's own
            edited = {where for n in differs for where, _, _ in sites[n]}
            if "dropout" in params and "dropout" not in task.model_args():
                edited = set(self.scaled.surrogate.graphs)  # _apply_model_params edits all
            if self._shared is None:
                graphs = self.scaled.surrogate.graphs
                self._shared = {m: _copy_graph_module(gm, m) for m, gm in graphs.items()}
                for gm in self._shared.values():
                    gm._hydro_shared = True  # an editor copies it first (_apply_model_params)
            shared = {m: gm for m, gm in self._shared.items() if m not in edited}
            sur = self.scaled.sample(int(seed), edit=edit if differs else None, graphs=shared)
            # equal literals, equal graphs: the fused model compares this, not generated code
            sur._hydro_signature = (f"hydro.builder {self.token} "
                                    f"{[(n, repr(args[n])) for n in differs]}")
        _apply_model_params(sur, params, task.model_args())
        return sur

    def _sites(self, name: str, value: Any) -> list | None:
        task = self.task
        key = (
            id(task.model),
            structure(task, tuple(self.args0.items())),
            name,
            self.ratio,
            tuple(self.depth.values()),
        )
        if key not in _SITES:  # one extra capture per argument, not per group
            _SITES[key] = _literal_sites(task, self.scaled, self.args0, name, value, self.example)
        return _SITES[key]


def load_model_state(group: FusedGroup, state: dict[str, torch.Tensor]) -> None:
    """Load a checkpoint's fused model into ``group`` (whose members already have their
    checkpointed steps). A checkpoint written before per-trial random streams existed lacks
    their seeds and step counts: each slot then keeps its member's seed and counts the steps
    it trained, so the run goes on (its dropout masks from there are the streams' own)."""
    state = dict(state)
    streams = {
        _random.SEED: group.fused.trial_seed,
        _random.STEP: torch.tensor([m.step for m in group.members], dtype=torch.int64),
    }
    for name, value in streams.items():
        state.setdefault(name, value)
    group.fused.load_state_dict(state)


def _apply_model_params(sur: nn.Module, p: dict[str, Any], model_args: set[str]) -> None:
    """Hyperparameters that act on a built surrogate: the readout multiplier (its buffer),
    dropout (the ``aten.dropout`` literals, unless the factory takes ``dropout`` itself), the
    initialization scale."""
    if "output_mult" in p:
        with torch.no_grad():
            for name, b in sur.named_buffers():
                if name.startswith(READOUT) and name.endswith(".scale"):
                    b.mul_(float(p["output_mult"]))
    if "dropout" in p and "dropout" not in model_args:
        for mode, gm in list(sur.graphs.items()):
            if getattr(gm, "_hydro_shared", False):  # other members read it: edit a copy
                gm = sur.graphs[mode] = _copy_graph_module(gm, mode)
            for node in gm.graph.nodes:
                if node.target is torch.ops.aten.dropout.default:
                    node.update_arg(1, float(p["dropout"]))
            gm.recompile()
        if hasattr(sur, "_hydro_signature"):
            sur._hydro_signature += f" dropout={float(p['dropout'])!r}"
    if "init_scale" in p:
        with torch.no_grad():
            for param in sur.parameters():
                if param.dim() >= 2:
                    param.mul_(float(p["init_scale"]))


def _widths(sur: nn.Module) -> dict[str, list[int]]:
    """The distinct hidden widths of the target and of the surrogate."""
    target, surrogate = set(), set()
    info = sur.hydro
    for name, p in sur.named_parameters():
        old = info.target_shapes.get(name)
        if old is None:
            continue
        for d_old, d_new in zip(old, p.shape):
            if d_old != d_new:
                target.add(int(d_old))
                surrogate.add(int(d_new))
    return {"target": sorted(target), "surrogate": sorted(surrogate)}


def _blocks(sur: nn.Module) -> dict[str, int]:
    """Repeated blocks (summed over stacks) in the target and kept in the surrogate; empty
    where no depth cut was asked (``depth_ratio=1`` looks for no stacks)."""
    stacks = getattr(sur.hydro, "stacks", None) or []
    if not stacks:
        return {}
    return {"target": sum(len(s.blocks) for s in stacks),
            "surrogate": sum(len(s.kept) for s in stacks)}

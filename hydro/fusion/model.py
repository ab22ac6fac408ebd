"""``FusedModel``: n trials of one model trained as one module; ``fuse`` and ``trial_loss``."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from hydro.errors import FuseError
from hydro.fusion import random as _random
from hydro.fusion.compiled import Compiler, CompileSpec, compile_options
from hydro.fusion.loss import trial_loss
from hydro.fusion.rewrite import fuse_graph, mutated_targets
from hydro.fx.capture import Captured, _check_shapes, capture_graph, register_at

MODES = ("train", "eval")
# buffers of the fused model itself, not of any trial's module
OWN = frozenset({"diverged", _random.SEED, _random.STEP, _random.DRAW})


def _signature(model: nn.Module) -> str:
    """What a module's graph may depend on besides its tensors: plain attributes of every
    submodule (dropout ``p``, a multiplier's ``scale``, a config). Equal signatures, one capture."""
    if isinstance(model, Captured):  # the graphs' code holds every literal
        # (or the builder of a fused group's member says which literals it wrote: no code made)
        own = model.__dict__.get("_hydro_signature")
        return own or "captured|" + "|".join(gm.code for gm in model.graphs.values())
    parts = []
    for name, m in model.named_modules():
        attrs = []
        for key, value in sorted(vars(m).items()):
            if key.startswith("_") or key == "training":
                continue
            if isinstance(value, (int, float, bool, str, tuple, type(None))):
                attrs.append((key, value))
            elif hasattr(value, "to_dict"):  # a HuggingFace config
                attrs.append((key, repr(sorted(value.to_dict().items(), key=str))))
        parts.append((name, type(m).__name__, attrs))
    return repr(parts)


def _draws_nothing(node: torch.fx.Node) -> bool:
    """A dropout (or attention) node whose literal rate is 0, or that is not in training: no
    mask drawn (``aten.dropout`` is then aten's identity)."""
    aten = torch.ops.aten
    if node.target is aten.dropout.default:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return train is False or (isinstance(p, (int, float)) and p == 0)
    if node.target is aten.scaled_dot_product_attention.default:
        p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return isinstance(p, (int, float)) and p == 0
    return False


def _example_key(args: tuple, kwargs: Mapping[str, Any]) -> str:
    leaves, spec = tree_flatten((args, dict(kwargs)))
    kinds = [f"t{x.dim()}" if isinstance(x, torch.Tensor) else repr(x) for x in leaves]
    return f"{spec}|{kinds}"


def _flat_inputs(args: tuple, kwargs: Mapping[str, Any]) -> tuple | None:
    """A call's inputs when they are tensors and plain scalars (``None`` otherwise): each
    tensor's shape, each scalar's type and value. Calls with equal results have the same
    :func:`_example_key` and, on one graph, the same :func:`_check_shapes` verdict."""
    out = []
    for name, v in (*((None, a) for a in args), *kwargs.items()):
        if isinstance(v, torch.Tensor):
            out.append((name, v.shape))
        elif v is None or isinstance(v, (bool, int, float, str)):
            out.append((name, type(v), v))
        else:
            return None
    return tuple(out)


def _ranks(flat: tuple) -> tuple:
    """:func:`_flat_inputs` with each shape reduced to its rank: a key with one entry per call
    structure, however many batch sizes and lengths the calls have."""
    return tuple((e[0], len(e[1])) if len(e) == 2 else e for e in flat)


# distinct input shapes remembered as checked, per graph (a run sees a few: its batch sizes)
_CHECKED_SHAPES = 64


class FusedModel(nn.Module):
    """``n`` trials of one model, trained together as one module.

    Every parameter and buffer has a leading trial dimension ``[n, ...]`` and the same name as in
    the original model (the same ``state_dict`` keys). Build it with :func:`fuse`.

    Call it like the model: ``fused(x)`` (or with keyword inputs) feeds one model's inputs to
    every trial; ``fused(xs, shared=False)`` takes inputs with a leading ``n`` (each trial its own
    batch). The output has the model's structure (tuple, dict, ``ModelOutput``) with every
    tensor given a leading ``[n]``: batched outputs ``[n, B, ...]``, and a loss the model
    computes itself (any full reduction of a batched value) ``[n]``, each trial's own.

    Random ops (dropout) draw from each trial's own stream (:mod:`hydro.fusion.random`): the
    ``int64 [n]`` buffers ``trial_seed`` and ``trial_step`` (training forwards run), so a trial's
    masks depend on its seed and step only (:meth:`reseed_trial`); ``trial_draw`` names the
    dropout draw they were made with (a checkpoint of an older one is refused when it matters).

    The model's graph is captured (:func:`hydro.fx.capture.capture`) at the first call, from that
    call's inputs, unless it was captured before (a :class:`~hydro.fx.capture.Captured` model, or
    ``example_inputs=`` given to :func:`fuse`); parameters exist from the start, so an optimizer
    can be built before the first call. ``own=True`` takes the given models over instead of
    copying them (the caller must not use them afterwards: the fused model edits their graphs).

    Example:
        >>> import torch
        >>> from hydro.fusion import fuse
        >>> fused = fuse(torch.nn.Linear(3, 2), n=4)
        >>> fused(torch.randn(5, 3)).shape
        torch.Size([4, 5, 2])
        >>> fused.trial(1).weight.shape
        torch.Size([2, 3])
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        share_frozen: bool = True,
        seed: int = 0,
        *,
        own: bool = False,
    ) -> None:
        super().__init__()
        if not models:
            raise FuseError("fuse() needs at least one model")
        _check_same_architecture(models)
        n = len(models)
        # Distinct sources by signature: trial(k) and captures use these, not n copies.
        sources: list[nn.Module] = []
        index: list[int] = []
        seen: dict[str, int] = {}
        for m in models:
            key = _signature(m)
            if key not in seen:
                seen[key] = len(sources)
                # a caller handing its models over (``own``: a fused group's fresh surrogates)
                # saves a deep copy of each
                sources.append(m if own else _clone(m))
            index.append(seen[key])
        object.__setattr__(self, "_sources", sources)
        object.__setattr__(self, "_member", index)  # trial k -> its source
        object.__setattr__(self, "_captures", {})  # example key -> [per source {mode: gm}]
        object.__setattr__(self, "_graphs", {})  # (key, mode, shared) -> fused GraphModule
        object.__setattr__(self, "_recent", {})  # flat call signature -> its key in _graphs
        object.__setattr__(self, "_compiler", None)  # hydro.fusion.compiled, when compiled

        first = models[0]
        canonical: dict[int, nn.Parameter] = {}
        object.__setattr__(self, "_frozen_shared", set())  # frozen parameters stored once
        for name, p in first.named_parameters(remove_duplicate=False):
            if id(p) not in canonical:
                values = [m.get_parameter(name) for m in models]
                if share_frozen and _frozen_and_equal(values):
                    # trained by no trial and equal in all: one copy, read by every trial
                    stacked = p.detach().clone().unsqueeze(0).expand(n, *p.shape)
                else:
                    stacked = torch.stack([v.detach() for v in values]).clone()
                fused = nn.Parameter(stacked, requires_grad=p.requires_grad)
                if hasattr(p, "infshape"):
                    fused.infshape = p.infshape  # muP metadata for hydro.optim
                canonical[id(p)] = fused
            register_at(self, name, canonical[id(p)], "param")
            if canonical[id(p)].dim() and canonical[id(p)].stride(0) == 0:
                self._frozen_shared.add(name)  # every tied name of a shared parameter
        persistent = set(first.state_dict())
        for name, _ in first.named_buffers(remove_duplicate=False):
            stacked = torch.stack([m.get_buffer(name).detach() for m in models]).clone()
            register_at(self, name, stacked, "buffer", persistent=name in persistent)
        self.register_buffer("diverged", torch.zeros(n, dtype=torch.bool))
        # each trial's random stream (hydro.fusion.random): its seed and its training forwards
        seeds = [_random.as_int64(seed + k) for k in range(n)]
        self.register_buffer(_random.SEED, torch.tensor(seeds, dtype=torch.int64))
        self.register_buffer(_random.STEP, torch.zeros(n, dtype=torch.int64))
        # the dropout draw of each trial's stream: a checkpoint of another one cannot go on
        self.register_buffer(_random.DRAW, torch.full((n,), _random.DRAW_VERSION))
        for p in self.parameters():
            p.hydro_diverged = self.diverged  # lets hydro.optim freeze diverged trials

    @property
    def n(self) -> int:
        """The number of trials."""
        return int(self.diverged.shape[0])

    @property
    def shared_tensors(self) -> set[str]:
        """Tensors the fused graph reads once, for every trial, as trial 0's: buffers equal in
        every trial and never written by the graphs captured so far (a causal mask, rotary
        frequencies), and the parameters of :attr:`frozen_shared`."""
        written = set()
        for graphs in self._captures.values():
            for g in graphs:
                for gm in g.values():
                    written |= mutated_targets(gm)
        buffers = {
            name
            for name, b in self.named_buffers(remove_duplicate=False)
            if name not in written and name not in OWN and bool((b == b[:1]).all())
        }
        return buffers | self._frozen_shared

    @property
    def frozen_shared(self) -> set[str]:
        """Names of the parameters that are frozen (``requires_grad=False``) in every member and
        equal by value in all of them at :func:`fuse` time: stored once (an ``expand``-ed view
        ``[n, ...]`` of one copy). Layers that read only these and the shared inputs (a frozen
        pretrained backbone) run once for the whole group."""
        return set(self._frozen_shared)

    @property
    def fallbacks(self) -> list[str]:
        """Nodes of the fused graphs built so far that have no fused form for per-trial operands
        and run under ``torch.func.vmap`` instead (slower; a warning is logged for each), as
        ``"name (op)"``. Empty when every op took its fused path."""
        return sorted({f for gm in self._graphs.values() for f in gm.hydro_fallbacks})

    def compile(self, mode: CompileSpec = True) -> FusedModel:  # type: ignore[override]
        """Run the fused graphs through ``torch.compile`` (:mod:`hydro.fusion.compiled`):
        ``True`` (inductor, default mode), a mode string, a dict of ``torch.compile`` keyword
        arguments, or ``False`` (eager again). Each graph structure and fusion size compiles
        once; refills (:meth:`load_trial`) reuse it. Returns ``self``.

        Raises:
            FuseError: ``mode`` is none of those forms.
        """
        options = compile_options(mode)
        object.__setattr__(self, "_compiler", None if options is None else Compiler(options))
        return self

    def share_compiled(self, other: FusedModel | Compiler) -> None:
        """Run ``other``'s compiled graphs (same options; counts shared): nothing compiles."""
        theirs = other if isinstance(other, Compiler) else other._compiler
        if self._compiler is not None and self._compiler.same(theirs):
            object.__setattr__(self, "_compiler", theirs)

    @property
    def compile_stats(self) -> dict[str, float]:
        """``{"compiles": graphs compiled, "seconds": their compile time}`` (:meth:`compile`)."""
        return Compiler.summary(self._compiler)

    def _apply(self, fn, recurse=True):  # nn.Module signature
        out = super()._apply(fn, recurse)
        for name in self._frozen_shared:  # a dtype or device move copies n rows: one again
            p = self.get_parameter(name)
            if p.data.stride(0) != 0:
                p.data = p.data[0].clone().unsqueeze(0).expand(p.shape)
        for src in self._sources:  # captures and trial(k) follow dtype and device
            src._apply(fn, recurse)
        self._graphs.clear()
        for p in self.parameters():
            p.hydro_diverged = self.diverged
        return out

    # --- capture and graphs ---------------------------------------------------------------

    def capture(self, example_inputs: tuple = (), example_kwargs: Mapping | None = None) -> None:
        """Capture the model's graphs for calls shaped like ``(example_inputs, example_kwargs)``
        (one model's inputs). :meth:`forward` does this by itself at a first call."""
        self._captured_for(tuple(example_inputs), dict(example_kwargs or {}), MODES)

    def _captured_for(self, args: tuple, kwargs: dict, modes: Sequence[str] = MODES) -> tuple:
        key = _example_key(args, kwargs)
        if key not in self._captures:
            if all(isinstance(s, Captured) for s in self._sources) and self._captures:
                raise FuseError(
                    "this call's inputs are structured differently from the inputs the model "
                    "was captured with (other keyword names, None where a tensor was); call it "
                    "as it was captured, or capture the model again"
                )
            self._captures[key] = [{} for _ in self._sources]
        graphs = self._captures[key]
        # a batch of 1 would be specialized by capture: capture from two copies of the sample
        example = tree_map(_at_least_two, (args, kwargs))
        for src, found in zip(self._sources, graphs):
            for mode in modes:
                if mode in found:
                    continue
                if isinstance(src, Captured):
                    found.update(src.graphs)
                else:  # only the mode in use: a training run never pays for the eval graph
                    found[mode] = _capture_mode(src, example, mode)
        return key, graphs

    def _graph_for(
        self, args: tuple, kwargs: dict, shared: bool, inputs: tuple | None = None
    ) -> torch.fx.GraphModule:
        mode = "train" if self.training else "eval"
        # the common call (flat tensor inputs, seen before) skips the full structure key
        flat = _ranks(inputs) if inputs is not None else None
        cache = self._recent.get((flat, mode, shared)) if flat is not None else None
        if cache is not None and cache in self._graphs:
            return self._graphs[cache]
        one = (args, kwargs) if shared else tree_map(_first_trial, (args, kwargs))
        key, graphs = self._captured_for(*one, modes=(mode,))
        cache = (key, mode, shared)
        if flat is not None:
            self._recent[(flat, mode, shared)] = cache
        if cache not in self._graphs:
            for g in graphs:
                if _drop_dead_nodes(g[mode].graph):
                    g[mode].recompile()
            members = [graphs[i][mode] for i in self._member]
            template = _template(members)
            literals = _literals(template, members)
            mutated = mutated_targets(template)
            tensors = dict(self.named_parameters(remove_duplicate=False))
            tensors.update(self.named_buffers(remove_duplicate=False))
            shared_names = self.shared_tensors - mutated
            gm = fuse_graph(template, self.n, shared, tensors, shared_names, literals)
            gm.hydro_mutated = sorted(mutated)
            gm.hydro_source = members[0]  # its placeholders hold the captured input shapes
            gm.hydro_shared = shared_names
            # a graph built before this one may read, as shared, buffers this one writes per
            # trial (an evaluation graph built before the first training step): rebuild it
            for other in [c for c, g in self._graphs.items() if g.hydro_shared & mutated]:
                del self._graphs[other]
            self._graphs[cache] = gm
        return self._graphs[cache]

    def draws_random(self, *args: Any, shared: bool = True, **kwargs: Any) -> bool:
        """Whether a forward on these inputs, in the current mode, draws random numbers
        (dropout, drop-path, sampling). Builds the graph that call would run (kept for it)
        but runs nothing, so no trial's random stream moves."""
        gm = self._graph_for(args, kwargs, shared, _flat_inputs(args, kwargs))
        return any(n.op == "call_function" and n.target is _random.stream_keys
                   for n in gm.graph.nodes)

    def _checked_graph(self, args: tuple, kwargs: dict, shared: bool) -> torch.fx.GraphModule:
        """The fused graph of this call, its inputs checked (:meth:`forward`'s, and the whole
        compiled training step's: :mod:`hydro.fusion.step`)."""
        if not shared:
            for a in tree_flatten((args, kwargs))[0]:
                if isinstance(a, torch.Tensor) and (a.dim() == 0 or a.shape[0] != self.n):
                    raise FuseError(
                        "shared=False expects inputs with a leading trial dimension of "
                        f"{self.n}, got shape {tuple(a.shape)}"
                    )
        shapes = _flat_inputs(args, kwargs)
        gm = self._graph_for(args, kwargs, shared, shapes)
        # the sizes a surrogate checks (only the batch is dynamic), with the surrogate's error;
        # flat inputs of shapes this graph already passed skip the walk
        checked = gm.__dict__.setdefault("hydro_checked", set())
        if shapes is None or shapes not in checked:
            one = (args, kwargs) if shared else tree_map(_first_trial, (args, kwargs))
            _check_shapes(self._sources[self._member[0]], gm.hydro_source, *one)
            if shapes is not None and len(checked) < _CHECKED_SHAPES:
                checked.add(shapes)
        return gm

    def forward(self, *args: Any, shared: bool = True, **kwargs: Any) -> Any:
        """Run every trial: one model's inputs for all (``shared=True``), or inputs with a
        leading ``n``, each trial its own batch (``shared=False``)."""
        gm = self._checked_graph(args, kwargs, shared)
        mutated = [self.get_buffer(name) for name in gm.hydro_mutated]
        saved = [b.clone() for b in mutated]
        out = gm(*args, **kwargs) if self._compiler is None else self._compiler(gm, args, kwargs)
        with torch.no_grad():
            if self.training:  # the next forward draws the next numbers (a diverged trial: frozen)
                self.trial_step.add_(self.diverged.logical_not())
            if mutated:
                # A trial whose running statistics this forward made non-finite (BatchNorm of an
                # exploding trial) diverged here, before its loss is even seen: flag it now, so
                # the restore below keeps its buffers at their last finite values.
                broken = [
                    ~torch.isfinite(b.data.reshape(self.n, -1)).all(dim=1)
                    for b in mutated
                    if b.is_floating_point() or b.is_complex()
                ]
                if broken:
                    self.diverged.logical_or_(torch.stack(broken).any(dim=0))
            # A diverged trial is frozen: undo what this forward wrote to its buffers, without
            # reading the flags on the host (no synchronization). Through .data: autograd saved
            # some of these buffers and must not see a version bump.
            for b, old in zip(mutated, saved):
                flags = self.diverged.view(-1, *([1] * (b.dim() - 1)))
                b.data.copy_(torch.where(flags, old, b.data))
        return out

    # --- trials in and out ----------------------------------------------------------------

    def trial(self, k: int) -> nn.Module:
        """Trial ``k`` as a standalone module (a copy) with the original ``state_dict`` keys.

        Built from plain modules: a module of the original class; built from a captured model:
        a :class:`~hydro.fx.capture.Captured` of that trial. muP ``infshape`` metadata and
        per-trial attributes (dropout rates) come along.
        """
        k = self._check_index(k)
        module = _clone(self._sources[self._member[k]])
        state = {name: t[k] for name, t in self.state_dict().items() if name not in OWN}
        module.load_state_dict(state)
        with torch.no_grad():  # non-persistent buffers too (rotary frequencies)
            for name, b in module.named_buffers():
                b.copy_(self.get_buffer(name)[k])
        src = dict(self.named_parameters(remove_duplicate=False))
        for name, p in module.named_parameters(remove_duplicate=False):
            if name in src and hasattr(src[name], "infshape"):
                p.infshape = src[name].infshape
        module.train(self.training)
        return module

    def load_trial(self, k: int, module: nn.Module, *, seed: int | None = None) -> None:
        """Overwrite trial ``k`` with ``module`` (same parameter names and shapes): its weights,
        buffers and plain attributes (dropout rates). Slot ``k`` now holds a new trial: its random
        stream restarts, from ``seed`` when given (:meth:`reseed_trial`), else from the slot's
        seed."""
        k = self._check_index(k)
        mine = self.state_dict(keep_vars=True)
        theirs = module.state_dict()
        missing = set(mine) - OWN - set(theirs)
        if missing or set(theirs) - set(mine) - OWN:
            raise FuseError(
                f"load_trial: the module's state_dict keys differ from the fused model's "
                f"(missing {sorted(missing)[:5]}, unexpected {sorted(set(theirs) - set(mine))[:5]})"
            )
        with torch.no_grad():
            for name, value in theirs.items():
                if name in self._frozen_shared:
                    if torch.equal(mine[name][k], value.to(mine[name])):
                        continue
                    self._unshare(name)
                mine[name][k].copy_(value)
        key = _signature(module)
        known = [i for i, s in enumerate(self._sources) if _signature(s) == key]
        if known:
            self._member[k] = known[0]
        else:
            self._sources.append(_clone(module))
            self._member[k] = len(self._sources) - 1
            self._captures.clear()
        self._graphs.clear()
        self.diverged[k] = False
        self.reseed_trial(k, int(self.trial_seed[k]) if seed is None else seed)

    def trial_state(self, k: int) -> dict[str, torch.Tensor]:
        """Trial ``k``'s slice of the ``state_dict`` (copies): its parameters, buffers, diverged
        flag and random stream (seed and step), for :meth:`load_trial_state` into any slot of a
        fused model of the same architecture."""
        k = self._check_index(k)
        return {name: t[k].detach().clone() for name, t in self.state_dict().items()}

    def load_trial_state(self, k: int, state: Mapping[str, torch.Tensor]) -> None:
        """Put what :meth:`trial_state` returned in slot ``k``: the trial goes on from there
        exactly (its random stream included), whichever slot or group it came from.

        Raises:
            FuseError: ``state`` names other tensors, or other shapes, than this model's trials;
                or it was drawn with an older dropout draw and this model draws random numbers
                (its masks could not go on bit-identically).
        """
        k = self._check_index(k)
        mine = self.state_dict(keep_vars=True)
        state = dict(state)
        if _random.DRAW not in state and _random.SEED in state:  # written before the tag
            state[_random.DRAW] = torch.tensor(1)
        if _random.DRAW in state and int(state[_random.DRAW]) != _random.DRAW_VERSION:
            self._refuse_older_draw(int(state[_random.DRAW]), "this trial's state")
            state[_random.DRAW] = torch.tensor(_random.DRAW_VERSION)  # it draws nothing
        if set(state) != set(mine):
            raise FuseError(
                f"load_trial_state: the state's keys differ from the fused model's (missing "
                f"{sorted(set(mine) - set(state))[:5]}, unexpected "
                f"{sorted(set(state) - set(mine))[:5]})"
            )
        for name, value in state.items():
            if tuple(value.shape) != tuple(mine[name].shape[1:]):
                raise FuseError(
                    f"load_trial_state: {name} has shape {tuple(value.shape)}, a trial of this "
                    f"model {tuple(mine[name].shape[1:])}"
                )
        with torch.no_grad():
            for name, value in state.items():
                if name in self._frozen_shared:
                    if torch.equal(mine[name][k], value.to(mine[name])):
                        continue
                    self._unshare(name)
                    mine = self.state_dict(keep_vars=True)
                mine[name][k].copy_(value)

    def reseed_trial(self, k: int, seed: int) -> None:
        """Restart trial ``k``'s random stream from ``seed`` (any integer, taken modulo
        ``2**64``): its dropout masks from then on depend on ``seed`` and on the number of
        training forwards since, nothing else (not its slot, group or neighbours).

        Example:
            >>> import torch
            >>> from hydro.fusion import fuse
            >>> a = fuse([torch.nn.Dropout(0.5)] * 3)
            >>> b = fuse([torch.nn.Dropout(0.5)])
            >>> a.reseed_trial(2, 7); b.reseed_trial(0, 7)
            >>> x = torch.ones(4, 8)
            >>> torch.equal(a(x)[2], b(x)[0])
            True
        """
        k = self._check_index(k)
        with torch.no_grad():
            self.trial_seed[k] = _random.as_int64(seed)
            self.trial_step[k] = 0
            self.trial_draw[k] = _random.DRAW_VERSION

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """:meth:`torch.nn.Module.load_state_dict`, with a check of the random streams' draw: a
        state written with an older dropout draw (or before the draw was recorded) is refused
        when this model draws random numbers (:class:`FuseError`), and taken as this draw's
        when it does not (nothing it trains depends on the draw)."""
        state = dict(state_dict)
        if _random.DRAW not in state and _random.SEED in state and "diverged" in state:
            state[_random.DRAW] = torch.ones_like(state[_random.SEED])  # before the tag
        draw = state.get(_random.DRAW)
        if isinstance(draw, torch.Tensor) and bool((draw != _random.DRAW_VERSION).any()):
            self._refuse_older_draw(int(draw[draw != _random.DRAW_VERSION][0]), "this state")
            state[_random.DRAW] = torch.full_like(draw, _random.DRAW_VERSION)
        return super().load_state_dict(state, strict=strict, assign=assign)

    def _refuse_older_draw(self, version: int, what: str) -> None:
        """A :class:`FuseError` if this model may draw random numbers in training: ``what``
        was drawn with dropout draw ``version``, which this hydro no longer makes."""
        if not self._may_draw():
            return
        raise FuseError(
            f"{what} was trained with hydro's dropout draw version {version}; this hydro draws "
            f"version {_random.DRAW_VERSION} (a cheaper hash), so its dropout masks cannot go on "
            "bit-identically from the checkpoint. Finish the run with the hydro that started "
            "it, or delete the checkpoint to train the trials afresh"
        )

    def _may_draw(self) -> bool:
        """Whether a training forward may draw dropout masks (the draw that changed; sampling
        ops draw as before), from the graphs captured so far (every member's; ``True`` while
        none is)."""
        graphs = [g for found in self._captures.values() for d in found for g in d.values()]
        graphs += [g for src in self._sources if isinstance(src, Captured)
                   for g in src.graphs.values()]
        if not graphs:
            return True
        drops = (
            torch.ops.aten.dropout.default,
            torch.ops.aten.scaled_dot_product_attention.default,
        )
        return any(node.op == "call_function" and node.target in drops and not _draws_nothing(node)
                   for g in graphs for node in g.graph.nodes)

    def _unshare(self, name: str) -> None:
        """One copy per trial again for a frozen shared parameter (a trial loads other values):
        its tied names follow, graphs are rebuilt."""
        p = self.get_parameter(name)
        p.data = p.data.clone()
        tied = {k for k, q in self.named_parameters(remove_duplicate=False) if q is p}
        self._frozen_shared.difference_update(tied)
        self._graphs.clear()

    def select(self, indices: Sequence[int] | torch.Tensor, *, repeat: bool = False) -> FusedModel:
        """Keep only the trials ``indices`` (in that order), in place, and return ``self``.

        Parameters keep their identity (only their data shrinks), so an optimizer over them stays
        valid after ``opt.select(indices)`` with the same indices. Call it between steps, once the
        last step's outputs and losses are gone (``del out, loss``): autograd keeps the old
        parameter shapes for as long as a graph that used them is alive.

        Args:
            indices: the trials to keep, at least one, each once.
            repeat: allow an index more than once (a copy of that trial in a new slot, to be
                overwritten: how :meth:`hydro.tuning.group.FusedGroup.add` grows a group).

        Raises:
            FuseError: no index, or one index twice without ``repeat=True``.
            IndexError: an index out of range.
        """
        index = torch.as_tensor(list(indices) if not torch.is_tensor(indices) else indices)
        index = index.to(torch.long).flatten()
        if not index.numel():
            raise FuseError(
                "select([]) would leave a fused model of 0 trials; keep at least one (to end "
                "them all, drop the fused model)"
            )
        listed = index.tolist()
        for i in listed:
            self._check_index(i)
        twice = sorted({i for i in listed if listed.count(i) > 1})
        if twice and not repeat:
            raise FuseError(
                f"select: trials {twice} are listed more than once, which would copy them into "
                "several slots; list each trial once (to copy a trial into a slot, use "
                "load_trial_state(slot, trial_state(k)))"
            )
        with torch.no_grad():
            for p in self.parameters():
                grad = p.grad
                if p.dim() and p.data.stride(0) == 0:  # frozen and shared: still one copy
                    p.data = p.data[:1].expand(len(index), *p.shape[1:])
                    continue
                p.data = p.data[index.to(p.device)]
                if grad is not None:
                    p.grad = grad[index.to(p.device)]
            for b in self.buffers():
                b.data = b.data[index.to(b.device)]
        self._member[:] = [self._member[i] for i in index.tolist()]
        self._graphs.clear()
        return self

    def _check_index(self, k: int) -> int:
        # no negative indices: trial(-1) is far likelier a bug (an unset slot) than "the last"
        if isinstance(k, bool) or not 0 <= k < self.n:
            raise IndexError(
                f"trial {k!r} out of range: this fused model has trials 0 to {self.n - 1} "
                "(negative indices are not accepted)"
            )
        return int(k)


def _capture_mode(model: nn.Module, example: tuple, mode: str) -> torch.fx.GraphModule:
    """Capture ``model`` in ``mode``. The training graph keeps submodules the user put in
    evaluation mode inside a model in training mode (a frozen backbone's BatchNorm, fine-tuning
    a head) as they were given; the evaluation graph has every module in evaluation mode."""
    was = {m: m.training for m in model.modules()}
    if mode == "eval" or not model.training:
        model.train(mode == "train")
    try:
        return capture_graph(model, example[0], example[1], prefix=f"{mode}_")
    finally:
        for m, flag in was.items():
            m.training = flag


def _at_least_two(x: object) -> object:
    if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == 1:
        return torch.cat([x, x])
    return x


def _first_trial(x: object) -> object:
    return x[0] if isinstance(x, torch.Tensor) else x


def _clone(model: nn.Module) -> nn.Module:
    """A deep copy that keeps mup's ``infshape`` (``deepcopy`` of a Parameter drops it)."""
    copied = copy.deepcopy(model)
    for (_, p), (_, q) in zip(
        model.named_parameters(remove_duplicate=False),
        copied.named_parameters(remove_duplicate=False),
    ):
        if hasattr(p, "infshape"):
            q.infshape = p.infshape
    return copied


_NO_OPS = {torch.ops.aten.contiguous.default, torch.ops.aten.clone.default}


def _skippable(node: torch.fx.Node) -> bool:
    # export records .contiguous() only where the tensor is not contiguous already, which can
    # depend on a rate (attention with dropout returns another layout): such nodes do not count
    # as a difference between graphs
    return node.op == "call_function" and node.target in _NO_OPS and len(node.all_input_nodes) == 1


def _template(members: Sequence[torch.fx.GraphModule]) -> torch.fx.GraphModule:
    """The member graph to rewrite: the one with the most no-op copies (valid for all)."""
    return max(members, key=lambda m: len(m.graph.nodes))


def _literals(
    template: torch.fx.GraphModule, members: Sequence[torch.fx.GraphModule]
) -> dict[str, dict[int, list[float]]]:
    """Arguments whose literal value differs between the members' graphs, one value per trial
    (keyed by the template's node names).

    Raises:
        FuseError: the graphs differ in anything else, naming the first node that differs.
    """
    out: dict[str, dict[int, list[float]]] = {}
    if all(m is template for m in members):
        return out
    ref = [n for n in template.graph.nodes if not _skippable(n)]
    aligned: dict[int, list[torch.fx.Node]] = {}
    maps: dict[int, dict[torch.fx.Node, str]] = {}
    for m in members:
        if id(m) in aligned:
            continue
        nodes = [n for n in m.graph.nodes if not _skippable(n)]
        if len(nodes) != len(ref):
            raise FuseError(
                "the models' graphs differ (one has more operations than the other: "
                f"{len(nodes)} vs {len(ref)}); fuse needs one architecture"
            )
        names: dict[torch.fx.Node, str] = {}
        for a, b in zip(ref, nodes):
            if (a.op, a.target) != (b.op, b.target):
                raise FuseError(
                    f"the models' graphs differ at node '{a.name}' ({a.format_node()} vs "
                    f"{b.format_node()}); fuse needs one architecture"
                )
            names[b] = a.name
        for b in m.graph.nodes:
            if _skippable(b):
                names[b] = names.get(b.all_input_nodes[0], b.name)
        aligned[id(m)], maps[id(m)] = nodes, names
    ref_names = {a: a.name for a in template.graph.nodes}
    for i, a in enumerate(ref):
        width = max(len(aligned[id(m)][i].args) for m in members)
        for pos in range(width):
            value = _positional(a, pos)
            if isinstance(value, torch.fx.Node):
                continue
            column = [_plain(_positional(aligned[id(m)][i], pos), maps[id(m)]) for m in members]
            mine = _plain(value, ref_names)
            if all(v == mine for v in column):
                continue
            if all(isinstance(v, float) for v in column):
                out.setdefault(a.name, {})[pos] = [float(v) for v in column]
            else:
                raise FuseError(
                    f"the models' graphs differ at node '{a.name}' ({a.format_node()}): "
                    f"argument {pos} is {column[0]!r} in one and {column[1:]} in others; only "
                    "float literals (dropout rates, multipliers) may differ between trials"
                )
        for key in a.kwargs:
            column = [_plain(aligned[id(m)][i].kwargs.get(key), maps[id(m)]) for m in members]
            if any(v != column[0] for v in column):
                raise FuseError(
                    f"the models' graphs differ at node '{a.name}' ({a.format_node()}): "
                    f"keyword {key} is {column[0]!r} in one and {column[1:]} in others; fuse "
                    "needs one architecture"
                )
    return out


def _positional(node: torch.fx.Node, pos: int) -> object:
    """Argument ``pos`` of ``node``, the op's default where the graph left it out (export omits
    an argument equal to its default: a dropout rate of 0 in one member, 0.1 in another)."""
    if pos < len(node.args):
        return node.args[pos]
    schema = getattr(node.target, "_schema", None)
    if schema is None or pos >= len(schema.arguments):
        return None
    arg = schema.arguments[pos]
    if arg.name in node.kwargs:
        return node.kwargs[arg.name]
    return arg.default_value if arg.has_default_value() else None


def _plain(value: object, names: Mapping[torch.fx.Node, str]) -> object:
    """An argument with nodes replaced by their template names, comparable across graphs."""
    return torch.fx.node.map_aggregate(
        value, lambda v: ("node", names.get(v, v.name)) if isinstance(v, torch.fx.Node) else v
    )


def _frozen_and_equal(values: Sequence[torch.Tensor]) -> bool:
    """Frozen in every member and equal by value: trained by no trial, the same for all."""
    first = values[0]
    return all(not v.requires_grad for v in values) and all(
        v.shape == first.shape and v.dtype == first.dtype and torch.equal(v, first)
        for v in values[1:]
    )


def _check_same_architecture(models: Sequence[nn.Module]) -> None:
    ref_shapes = {k: v.shape for k, v in models[0].state_dict().items()}
    for i, m in enumerate(models[1:], start=1):
        shapes = {k: v.shape for k, v in m.state_dict().items()}
        if shapes != ref_shapes:
            diff = sorted(
                k for k in shapes.keys() | ref_shapes.keys() if shapes.get(k) != ref_shapes.get(k)
            )
            raise FuseError(
                f"model {i} has different parameter/buffer names or shapes than model 0: "
                f"{diff[:5]}; fuse needs one architecture"
            )


def _reinitialize(model: nn.Module, seed: int) -> nn.Module:
    """A copy of ``model`` with freshly drawn weights at the scale of the original's.

    A plain module: each layer's own ``reset_parameters`` draws new values (under ``seed``),
    rescaled per tensor to the standard deviation of ``model``'s tensor, so a custom init scale
    (GPT-2's 0.02, muP's width-scaled std) carries over. A captured model (no user code to run):
    every tensor is redrawn from the statistics of the given one (mean, std, normal or uniform:
    :func:`hydro.parametrize.init_like`). Constant tensors (norm weights, zero biases),
    frozen parameters (``requires_grad=False``: a pretrained backbone) and a surrogate's tables
    rebuilt by rule (``sur.hydro.structured``) stay.
    """
    from hydro.parametrize import init_like

    fresh = _clone(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if isinstance(model, Captured):
            # a surrogate's tables of a rule (sinusoids, log(arange)) are not draws: they stay
            rules = getattr(getattr(model, "hydro", None), "structured", {})
            for (name, old), (_, new) in zip(model.named_parameters(), fresh.named_parameters()):
                if old.numel() >= 2 and old.requires_grad and name not in rules:
                    draw = torch.empty(new.shape, dtype=torch.float64)
                    init_like(draw, old, 1.0, generator)
                    new.copy_(draw)
            return fresh
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            for m in fresh.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        for (_, old), (_, new) in zip(model.named_parameters(), fresh.named_parameters()):
            if old.numel() < 2 or not old.requires_grad:  # frozen: part of the task, kept
                new.copy_(old)
                continue
            std_old, std_new = old.double().std(), new.double().std()
            if std_old == 0 or std_new == 0:
                new.copy_(old)
            else:
                new.mul_(std_old / std_new)
    return fresh


def fuse(
    models: nn.Module | Sequence[nn.Module],
    n: int | None = None,
    *,
    init: Callable[[nn.Module], nn.Module] | None = None,
    seed: int = 0,
    example_inputs: tuple | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    share_frozen: bool = True,
    compile: CompileSpec = False,
) -> FusedModel:
    """Fuse trials of one model into a :class:`FusedModel`.

    Args:
        models: a list of models with the same parameter names and shapes (plain modules or
            captured ones, e.g. ``hydro.scale`` surrogates; their weights are copied in), or one
            model together with ``n``.
        n: with a single model, the number of trials. Trial 0 keeps the model's weights; the
            others are independent draws (``init``, by default the model's own initialization
            rescaled to the std of each of its tensors, or for a captured model a redraw from
            each tensor's statistics), deterministic given ``seed``.
        init: ``init(model, k)`` returns trial ``k``'s model (a copy with new weights).
        seed: seed of the redrawn initializations, and of the trials' random streams (dropout
            masks): trial ``k``'s stream is seeded ``seed + k`` (change it with
            :meth:`FusedModel.reseed_trial`).
        example_inputs: one model's positional inputs, to capture now rather than at the first
            call.
        example_kwargs: one model's keyword inputs, likewise.
        share_frozen: store parameters that are frozen (``requires_grad=False``) and equal in
            every member once, and run the layers that read only them and shared inputs once
            for the group (:attr:`FusedModel.frozen_shared`). ``False`` keeps one copy per
            trial.
        compile: run the fused forward and backward through ``torch.compile``
            (:meth:`FusedModel.compile`): ``False`` (default, eager), ``True`` (inductor), a
            mode string or a dict of ``torch.compile`` arguments.

    Returns:
        The fused model. Float literals may differ between the given models (dropout rates, a
        multiplier): each trial keeps its own.

    Raises:
        FuseError: the models differ in architecture, an op has no fused form (naming it), or
            ``compile`` is none of its forms.

    Example:
        >>> import torch
        >>> from hydro.fusion import fuse
        >>> models = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
        ...           torch.nn.Linear(8, 1)) for _ in range(3)]
        >>> fused = fuse(models)
        >>> fused(torch.randn(16, 4)).shape
        torch.Size([3, 16, 1])
    """
    if isinstance(models, nn.Module):
        if n is None:
            raise FuseError("fuse(model) needs n=, the number of trials (or pass a list of models)")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise FuseError(f"fuse(model, n=...) needs a whole number of trials >= 1, got {n!r}")
        if init is not None:
            members = [models] + [init(models, k) for k in range(1, n)]
        else:
            members = [models] + [_reinitialize(models, seed * 100003 + k) for k in range(1, n)]
    else:
        members = list(models)
        if not all(isinstance(m, nn.Module) for m in members):
            raise FuseError("fuse() takes an nn.Module or a list of nn.Modules")
        if n is not None and n != len(members):
            raise FuseError(f"fuse got {len(members)} models but n={n}")
    fused = FusedModel(members, share_frozen=share_frozen, seed=seed)
    fused.compile(compile)
    if example_inputs is not None or example_kwargs is not None:
        fused.capture(tuple(example_inputs or ()), example_kwargs)
    return fused


def _drop_dead_nodes(graph: torch.fx.Graph) -> bool:
    """Remove nodes whose values nothing uses (an unused loss, say), keeping side effects;
    whether any was removed.

    Like ``Graph.eliminate_dead_code`` without its lint, which would look for the parameters
    on the graph's own module: a captured graph reads them from the :class:`Captured` it runs
    with.
    """
    dropped = False
    for node in reversed(graph.nodes):
        if node.op not in ("placeholder", "output") and not node.users and not node.is_impure():
            graph.erase_node(node)
            dropped = True
    return dropped


__all__ = ["FusedModel", "fuse", "trial_loss"]

"""The whole fused training step as one compiled graph: forward, losses, backward and update.

``hydro.fuse(compile=True)`` compiles the fused forward and backward, and ``hydro.optim``'s
``compile=True`` the update, as separate graphs (:mod:`hydro.fusion.compiled`): each step then
still pays the autograd engine, AOTAutograd's runtime wrappers around the compiled forward and
backward, the fused model's bookkeeping (diverged trials' buffers restored, the random streams'
step counts) and the optimizer's Python around its two compiled calls. :func:`train_step` traces
all of it into one function of tensors -- the lifted fused graph (:class:`~hydro.fusion.compiled.
Lifted`), the per-trial losses, their gradients (``torch.autograd.grad`` traced by ``make_fx``),
the isolation flags, per-trial gradient clipping and the optimizer's update with every per-trial
hyperparameter -- and hands that graph to the backend directly: one call per step, no dynamo.

Parameters, buffers, optimizer state, the per-trial hyperparameters (learning rates written by
schedulers included), the clipping norms and the flags are *inputs* of the graph, updated in
place: a refill, a scheduler step or a new learning rate runs the same compiled graph. The
graph is keyed like the fused model's (code and inputs' metadata), plus the optimizer's
structure (buckets, muP multipliers, which state exists) and the loss; it lives in the fused
model's :class:`~hydro.fusion.compiled.Compiler` and counts in its ``stats``.

Where it does not apply, :class:`TrainStep` runs the two-graph step (forward, backward,
``opt.step()``) and says why in :attr:`TrainStep.reason`: a model that is not compiled, a CUDA
model (the whole-step graph is measured on CPUs only), an optimizer that is not one of
``hydro.optim``'s over the fused model's parameters, a loss that does not trace, a parameter
the loss does not reach. A trace or compile failure warns once and falls back the same way.
"""

from __future__ import annotations

import operator
import time
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from hydro.errors import FuseError
from hydro.fusion.compiled import Lifted, _meta, quiet_cuda_home

LossFn = Callable[[Any, Any], torch.Tensor]
# input shapes (of the model's inputs and targets) compiled per step graph: a full batch and a
# last short one; others run the two-graph step
MAX_SHAPES = 2


class TrainStep:
    """One training step of every trial of ``fused``: ``step(args, target) -> losses [n]``.

    Runs the forward, ``loss_fn(output, target)`` (each trial's loss, ``[n]``), the backward,
    the isolation of non-finite trials, per-trial gradient clipping (``clip``) and ``opt``'s
    update, as one compiled graph where it applies (:attr:`reason` is ``None``), else as the
    usual two-graph step with the same results. Build it with :func:`train_step`.
    """

    def __init__(
        self,
        fused: Any,
        opt: torch.optim.Optimizer,
        loss_fn: LossFn,
        *,
        clip: float | Sequence[float | None] | None = None,
        loss_key: Hashable | None = None,
    ) -> None:
        self.fused, self.opt, self.loss_fn = fused, opt, loss_fn
        self.loss_key = loss_fn if loss_key is None else loss_key
        self.clip = clip
        self._reason: str | None = None

    @property
    def reason(self) -> str | None:
        """Why the whole-step graph does not apply (``None``: it does, or has not been tried)."""
        return self._reason or self._static_reason()

    def _static_reason(self) -> str | None:
        from hydro.optim.base import FusedOptimizer

        compiler = getattr(self.fused, "_compiler", None)
        if compiler is None:
            return "the fused model is not compiled (hydro.fuse(compile=...))"
        if compiler.failed is not None:
            return f"torch.compile failed ({compiler.failed})"
        if compiler.__dict__.get("_step_failed"):
            return compiler.__dict__["_step_failed"]
        if not isinstance(self.opt, FusedOptimizer) or self.opt.compile is False:
            return "the optimizer is not a hydro.optim optimizer, or was built with compile=False"
        if not self.fused.training:
            return "the fused model is in eval mode"
        p = next(iter(self.fused.parameters()), None)
        if p is not None and p.device.type != "cpu":
            return f"a {p.device.type} model: the whole-step graph is measured on CPUs only"
        return None

    def __call__(
        self, args: tuple, target: Any, kwargs: Mapping[str, Any] | None = None, *,
        shared: bool = True,
    ) -> torch.Tensor:
        """One step on the inputs ``args``/``kwargs`` (one model's, or each trial's with
        ``shared=False``) and ``target``; returns each trial's loss ``[n]`` (detached)."""
        kwargs = dict(kwargs or {})
        if self.reason is None:
            try:
                out = self._whole(args, kwargs, target, shared)
            except _Unsupported as exc:
                self._reason = str(exc)
            else:
                if out is not None:
                    return out
        return self._two_graphs(args, kwargs, target, shared)

    def _two_graphs(self, args: tuple, kwargs: dict, target: Any, shared: bool) -> torch.Tensor:
        """The step as forward, backward and ``opt.step()`` (:meth:`__call__`'s fallback)."""
        import hydro.optim

        fused, opt = self.fused, self.opt
        losses = self.loss_fn(fused(*args, shared=shared, **kwargs), target)
        opt.zero_grad(set_to_none=True)
        losses.sum().backward()
        fused.diverged.logical_or_(~torch.isfinite(losses.detach()))
        norms = self._norms()
        if norms is not None:
            hydro.optim.clip_grad_norm_(fused, norms)
        opt.step()
        return losses.detach()

    def _norms(self) -> list[float] | None:
        clip = self.clip
        if clip is None:
            return None
        if isinstance(clip, (int, float)):
            return [float(clip)] * self.fused.n
        if all(c is None for c in clip):
            return None
        return [float("inf") if c is None else float(c) for c in clip]

    # --- the whole-step graph -------------------------------------------------------------------

    def _whole(self, args: tuple, kwargs: dict, target: Any, shared: bool) -> torch.Tensor | None:
        fused, opt = self.fused, self.opt
        compiler = fused._compiler
        gm = fused._checked_graph(args, kwargs, shared)
        lifted = getattr(gm, "hydro_lifted", None)
        if lifted is None:
            lifted = gm.hydro_lifted = Lifted(gm)
        plan = getattr(gm, "hydro_step_plan", None)
        if plan is None or plan.opt is not opt or not plan.valid():
            plan = gm.hydro_step_plan = _Plan(fused, opt, gm, lifted)
        norms = self._norms()
        tensors, structure = plan.inputs(gm, lifted, args, kwargs, target, norms)
        # this key is the only guard: the graph's code, what the optimizer and loss make of
        # it, and every input's metadata (hydro.fusion.compiled's key discipline)
        metas = tuple(_meta(t) for t in tensors)
        base = (lifted.code, plan.structure, self.loss_key, shared, norms is not None, structure)
        key = (*base, metas)
        steps = compiler.__dict__.setdefault("_steps", {})
        fn = steps.get(key)
        if fn is None:
            # inputs of a third shape (a varying sequence length): the two-graph step, whose
            # forward compiles one graph with dynamic shapes for all, rather than a graph each
            shapes = compiler.__dict__.setdefault("_step_shapes", {}).setdefault(base, set())
            batch = tuple(metas[i] for role in structure[0][1:3] for i in role)
            if batch not in shapes and len(shapes) >= MAX_SHAPES:
                return None
            shapes.add(batch)
        for p in plan.params:
            p.grad = None  # the graph's gradients stay inside it
        if fn is None:
            fn = self._compile(plan, lifted, structure, tensors, norms is not None)
            if fn is None:
                return None
            steps[key] = fn
        with torch.no_grad():
            out = fn(*tensors)
        return out[0] if isinstance(out, (list, tuple)) else out

    def _compile(
        self, plan: _Plan, lifted: Lifted, structure: tuple, tensors: list, clipping: bool
    ) -> Callable | None:
        from torch.fx.experimental.proxy_tensor import make_fx

        compiler = self.fused._compiler
        fn = _traced_step(plan, lifted, structure, self.loss_fn, clipping)
        quiet_cuda_home()
        start = time.perf_counter()
        detached = [t.detach() for t in tensors]
        try:
            try:
                # detached: the trace updates parameters in place, as no autograd leaf may be
                graph = make_fx(fn, tracing_mode="fake")(*detached)
            except _Unsupported:
                raise
            except Exception as exc:  # a loss or model that does not trace
                raise _Unsupported(f"the step does not trace ({_first_line(exc)})") from exc
            compiled = _backend(compiler.options)(graph, detached)
        except _Unsupported:
            raise
        except Exception as exc:  # any compiler failure: fall back, say so
            self._reason = f"the whole-step compile failed ({_first_line(exc)})"
            compiler.__dict__["_step_failed"] = self._reason  # for every step of this compiler
            warnings.warn(
                f"hydro.fusion.step: {self._reason}; this step runs as two compiled graphs "
                "(forward and backward, then the update) from now on (same results, slower)",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        finally:
            compiler.stats["seconds"] += time.perf_counter() - start
        compiler.stats["compiles"] += 1
        return compiled


class _Unsupported(Exception):
    """The whole-step graph does not apply to this step (its message says why)."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


class _Plan:
    """What one fused graph and optimizer make of the step: which lifted inputs are trained
    parameters, the optimizer's buckets, state keys and cohorts; built once per graph."""

    def __init__(self, fused: Any, opt: Any, gm: torch.fx.GraphModule, lifted: Lifted) -> None:
        self.opt = opt
        self.fused = fused
        lifted_tensors = lifted.tensors(gm)
        ids = {id(t): i for i, t in enumerate(lifted_tensors)}
        per_group = [[p for p in g["params"] if p.requires_grad and id(p) in ids]
                     for g in opt.param_groups]
        trainable = {id(p) for p in fused.parameters() if p.requires_grad and id(p) in ids}
        if {id(p) for ps in per_group for p in ps} != trainable:
            raise _Unsupported("the optimizer does not hold exactly the fused model's trained "
                               "parameters")
        self.per_group = per_group
        self.params = [p for ps in per_group for p in ps]
        self.lifted_pos = [ids[id(p)] for p in self.params]
        if not self.params:
            raise _Unsupported("no trained parameter")
        opt._prepare_state(per_group)
        self.keys = tuple(k for k in opt._state_keys()
                          if all(k in opt.state[p] for p in self.params))
        self.buckets = opt._bucket_plan(per_group)  # those of hydro.optim's compiled step
        self.mutated = [fused.get_buffer(name) for name in gm.hydro_mutated]
        # held, not just their ids: a freed tensor's id may come back on another
        self._held = [opt.state[p][k] for p in self.params for k in (opt.cohort_key, *self.keys)]
        self._any = {k: opt._any(k) for k in ("weight_decay", "momentum", "amsgrad")
                     if k in opt.per_trial_keys}
        self._positional = -1  # a count of positional tensor inputs the graph takes as given
        self.structure = (type(opt).__name__, self.buckets, self.keys, tuple(self._any.items()),
                          tuple(len(ps) for ps in per_group))

    def valid(self) -> bool:
        """Whether the optimizer's state and switches are those this plan was built for (a
        ``select``, ``load_state_dict`` or new momentum makes a new plan; a refill does not)."""
        opt = self.opt
        held = iter(self._held)
        try:
            if any(opt.state[p][k] is not next(held)
                   for p in self.params for k in (opt.cohort_key, *self.keys)):
                return False
        except KeyError:
            return False
        if tuple(k for k in opt._state_keys()
                 if all(k in opt.state[p] for p in self.params)) != self.keys:
            return False
        return {k: opt._any(k) for k in self._any} == self._any

    def inputs(
        self, gm: torch.fx.GraphModule, lifted: Lifted, args: tuple, kwargs: dict, target: Any,
        norms: list[float] | None,
    ) -> tuple[list[torch.Tensor], tuple]:
        """The step's tensors, each once, and where each role finds them (``structure``)."""
        opt, fused = self.opt, self.fused
        like = self.params[0]
        if not kwargs and len(args) == self._positional:  # seen: the graph takes them as they are
            flat_in = list(args)
        else:
            flat_in = lifted.flatten(args, kwargs)
            if not all(isinstance(t, torch.Tensor) for t in flat_in):
                raise _Unsupported("the model takes non-tensor inputs")
            if not kwargs and len(flat_in) == len(args) and all(map(operator.is_, flat_in, args)):
                self._positional = len(args)
        flat_target, target_spec = tree_flatten(target)
        if not all(isinstance(t, torch.Tensor) for t in flat_target):
            raise _Unsupported("the target holds non-tensor values")
        hypers = []
        for group in opt.param_groups:
            hyper = [opt._on(group, k, like) for k in opt.per_trial_keys if k != "betas"]
            if "betas" in opt.per_trial_keys:
                hyper += [opt._on(group, 0, like), opt._on(group, 1, like)]
            hypers.append(hyper)
        state = [opt.state[p][k] for p in self.params for k in self.keys]
        cohorts = [opt.state[p][opt.cohort_key] for p in self.params]
        roles: list[list[torch.Tensor]] = [
            lifted.tensors(gm), flat_in, flat_target, state, cohorts,
            [h for hs in hypers for h in hs], [fused.diverged, fused.trial_step], self.mutated,
        ]
        if norms is not None:
            limit = getattr(self, "_limit", None)
            if limit is None or limit[0] != norms:
                self._limit = limit = (norms, torch.tensor(norms, dtype=torch.float64))
            roles.append([limit[1]])
        uniq: list[torch.Tensor] = []
        where: dict[int, int] = {}
        structure = []
        for role in roles:
            index = []
            for t in role:
                i = where.get(id(t))
                if i is None:
                    i = where[id(t)] = len(uniq)
                    uniq.append(t)
                index.append(i)
            structure.append(tuple(index))
        return uniq, (tuple(structure), target_spec)


def _traced_step(
    plan: _Plan, lifted: Lifted, structure: tuple, loss_fn: LossFn, clipping: bool
) -> Callable:
    """The step as a function of its unique tensors, for ``make_fx``: it updates parameters,
    buffers, optimizer state and flags in place and returns the losses."""
    from torch.utils._pytree import tree_unflatten

    from hydro.optim.clip import _clip_grads

    index, target_spec = structure
    opt = plan.opt
    param_index = [index[0][pos] for pos in plan.lifted_pos]  # the trained parameters' slots
    param_slots = set(param_index)
    counts = [len(ps) for ps in plan.per_group]
    per_trial = [k for k in opt.per_trial_keys if k != "betas"]

    def step(*tensors: torch.Tensor) -> tuple[torch.Tensor]:
        pick = [[tensors[i] for i in role] for role in index]
        graph_in, inputs, target, state, cohorts, hyper_flat, own, mutated = pick[:8]
        diverged, trial_step = own
        leaves: dict[int, torch.Tensor] = {}
        args = []
        for i, t in zip(index[0], graph_in):
            if i in param_slots:  # a leaf of the traced backward; the update writes the input
                if i not in leaves:
                    leaves[i] = t.detach().requires_grad_(True)
                args.append(leaves[i])
            else:
                args.append(t)
        saved = [b.clone() for b in mutated]
        with torch.enable_grad():
            out = lifted.module(*args, *inputs)
            output = lifted.unflatten(out)
            losses = loss_fn(output, tree_unflatten(target, target_spec))
            if not isinstance(losses, torch.Tensor) or losses.shape != diverged.shape:
                raise _Unsupported(
                    f"the loss must give one value per trial, [{diverged.shape[0]}]; got "
                    f"{getattr(losses, 'shape', type(losses).__name__)}"
                )
            grads = torch.autograd.grad(
                losses.sum(), [leaves[i] for i in param_index], allow_unused=True
            )
        if any(g is None for g in grads):
            raise _Unsupported("a trained parameter gets no gradient from the loss")
        grads = list(grads)
        losses = losses.detach()
        # the fused model's forward bookkeeping (hydro.fusion.model.FusedModel.forward)
        trial_step.add_(diverged.logical_not())
        broken = [~torch.isfinite(b.reshape(b.shape[0], -1)).all(dim=1)
                  for b in mutated if b.is_floating_point()]
        if broken:
            diverged.logical_or_(torch.stack(broken).any(dim=0))
        for b, old in zip(mutated, saved):
            b.copy_(torch.where(diverged.view(-1, *([1] * (b.dim() - 1))), old, b))
        diverged.logical_or_(~torch.isfinite(losses))
        if clipping:
            _clip_grads(grads, tensors[index[8][0]])
        # the optimizer: hydro.optim's compiled step, its two graphs in one
        params = [tensors[i] for i in param_index]
        hypers = []
        it = iter(hyper_flat)
        for _ in opt.param_groups:
            hyper = {k: next(it) for k in per_trial}
            if "betas" in opt.per_trial_keys:
                hyper["betas"] = (next(it), next(it))
            hypers.append(hyper)
        per_group, firsts, offset = [], [], 0
        for count, buckets in zip(counts, plan.buckets):
            per_group.append(params[offset : offset + count])
            for _, _, members in buckets:
                firsts.append({**dict.fromkeys(plan.keys), opt.cohort_key:
                               cohorts[offset + members[0]]})
            offset += count
        state_lists = {k: state[j :: len(plan.keys)] for j, k in enumerate(plan.keys)}
        opt._tracing, saved_any = True, dict(opt._traced_any)
        opt._traced_any.update(plan._any)
        try:
            active, vectors = opt._traced_coefficients(
                grads, firsts, plan.buckets, hypers, diverged, params[0]
            )
            type(opt)._traced_update(per_group, grads, state_lists, vectors, plan.buckets)
            opt._advance_traced(per_group, cohorts, plan.keys, active, hypers)
        finally:
            opt._tracing = False
            opt._traced_any.clear()
            opt._traced_any.update(saved_any)
        return (losses,)

    return step


def _backend(options: Mapping[str, Any]) -> Callable:
    """The compiler of a whole-step graph: inductor (``compile_fx``, with the fused model's
    mode and options) or the backend given, called directly."""
    options = dict(options)
    backend = options.get("backend")
    if backend is not None:
        return torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
    from torch._inductor.compile_fx import compile_fx

    mode = options.get("mode")
    if mode in ("reduce-overhead", "max-autotune"):  # CUDA graphs: none on a CPU
        mode = "max-autotune-no-cudagraphs" if mode == "max-autotune" else None
    config = torch._TorchCompileInductorWrapper(mode, options.get("options"), None).config

    def inductor(graph: torch.fx.GraphModule, example: list) -> Callable:
        # fake inputs of a mode with a ShapeEnv (static sizes): without one, inductor's FX
        # graph cache and AOTAutograd's cache bypass the graph ("No shape env") and every
        # process compiles it afresh; with one, a warm on-disk cache serves it
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
        fakes = [mode.from_tensor(t, static_shapes=True) for t in example]
        return compile_fx(graph, fakes, config_patches=config)

    return inductor


def train_step(
    fused: Any,
    opt: torch.optim.Optimizer,
    loss_fn: LossFn,
    *,
    clip: float | Sequence[float | None] | None = None,
    loss_key: Hashable | None = None,
) -> TrainStep:
    """The fused training step of ``fused`` and ``opt`` as one compiled graph, where it applies.

    Args:
        fused: a :class:`~hydro.fusion.FusedModel` built with ``compile=`` (its options and
            compile counts serve the step's graph).
        opt: a ``hydro.optim`` optimizer over ``fused``'s parameters, built with
            ``compile=True`` (or a backend).
        loss_fn: ``loss_fn(output, target)``, each trial's loss ``[n]`` (e.g.
            ``lambda out, y: hydro.trial_loss(F.cross_entropy, out, y)``); it is traced into
            the graph, so it must be torch operations without host reads.
        clip: per-trial gradient clipping norms (``hydro.optim.clip_grad_norm_``), one for all
            trials or one per trial (``None``: no clipping for that trial).
        loss_key: what identifies the loss among compiled steps (default: ``loss_fn``
            itself); two steps with equal keys and graphs share the compiled graph.

    Returns:
        A :class:`TrainStep`: ``step(args, target, kwargs=None, shared=True)`` returns each
        trial's loss ``[n]``; :attr:`TrainStep.reason` says why the two-graph step runs instead,
        where it does.

    Raises:
        FuseError: ``fused`` is not a fused model.
    """
    from hydro.fusion.model import FusedModel

    if not isinstance(fused, FusedModel):
        raise FuseError(
            f"train_step needs a fused model (hydro.fuse(...)); got {type(fused).__name__}"
        )
    return TrainStep(fused, opt, loss_fn, clip=clip, loss_key=loss_key)

"""The base of the fused optimizers: one step for ``n`` trials, each with its own hyperparameters.

Every parameter has a leading trial dimension ``[n, ...]``. Each hyperparameter may be a scalar
(the same for every trial) or a length-``n`` sequence/tensor; it is kept as a float64 tensor
``[n]`` in the parameter group (where the schedulers of ``lr_scheduler`` write it).

A step is a fixed sequence of ``torch._foreach_*`` ops over all parameters, with every per-trial
value (learning rate, betas, bias corrections, weight decay, momentum) a tensor ``[n, 1, ...]``
broadcast over the trial dimension: the number of ops does not depend on ``n`` (asserted in
``tests/optim/test_step_ops.py``), there is no Python loop over trials and no host synchronization.
The arithmetic is ``torch.optim``'s single-tensor implementation with trial ``k``'s values
(checked step by step against ``torch.optim`` in ``tests/optim/test_against_torch.py`` and
``tests/fusion``).
Eagerly, the update runs parameter by parameter (a fixed handful of ops each, whatever ``n``)
with its intermediates in two scratch buffers shared by all parameters, so each parameter's
passes hit the cache; ``compile=True`` runs the step through ``torch.compile`` as two graphs, the
isolation flags with every coefficient, then the ``_foreach`` form of the update (one pass over
memory); ``compile="auto"`` (the default) compiles on CUDA only.

Continuous batching: :meth:`FusedOptimizer.reset_trial` gives one slot the state of a new
optimizer with new hyperparameters, for a new trial, leaving the other slots untouched.

muP: a parameter carrying ``infshape`` (every parameter of a Hydro surrogate) gets the learning
rate and weight decay multipliers of :func:`hydro.parametrize.optimizer_multipliers`; a plain
parameter gets none.

Isolation: each step, a trial with a non-finite gradient is marked in the fused model's
``diverged`` flags (a device tensor, updated in place). Diverged trials are frozen: their
gradient is replaced by zeros and their learning rate, moment decay and step increment by
neutral values, so their parameters and optimizer state (step counts included) stop changing,
and no other trial's update depends on them.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

import hydro.host as host
from hydro.errors import ConfigError, FuseError
from hydro.parametrize import optimizer_multipliers

# graphs dynamo may keep of the compiled update's two functions: one per optimizer of another
# structure (parameter shapes, buckets, which state exists) in this process
RECOMPILE_LIMIT = 64

HyperParam = float | bool | Sequence[float] | torch.Tensor
Betas = (
    tuple[HyperParam, HyperParam] | Sequence[tuple[float, float]] | torch.Tensor
)  # see parse_betas

BETAS_FORMS = (
    "(beta1, beta2) with each a scalar or a length-n sequence (e.g. (0.9, [0.99, 0.999])), "
    "or a list of n (beta1, beta2) pairs (e.g. [(0.9, 0.99), (0.8, 0.999)]), or a tensor [n, 2]"
)


def per_trial(value: HyperParam, n: int, name: str) -> torch.Tensor:
    """``value`` as a float64 tensor ``[n]`` (a scalar is repeated for every trial)."""
    try:
        t = torch.as_tensor(value, dtype=torch.float64).detach().clone().cpu()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(
            f"{name} must be a number or a sequence of {n} numbers (one per fused trial); "
            f"got {value!r}"
        ) from exc
    if t.dim() == 0:
        return t.repeat(n)
    if t.shape != (n,):
        raise ConfigError(
            f"{name} has shape {tuple(t.shape)} but there are {n} fused trials: give one number "
            f"for all trials or a sequence of {n} numbers"
        )
    return t


def _is_pair(x: object) -> bool:
    if torch.is_tensor(x):
        return x.dim() == 1 and x.shape[0] == 2
    return (
        isinstance(x, (list, tuple))
        and len(x) == 2
        and not any(isinstance(v, (list, tuple)) or (torch.is_tensor(v) and v.dim() > 0) for v in x)
    )


def parse_betas(betas: object, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-trial ``(beta1, beta2)`` as two float64 tensors ``[n]``.

    Accepted forms: ``(beta1, beta2)`` where each is a scalar or a length-``n`` sequence;
    a *list* of ``n`` ``(beta1, beta2)`` pairs; a tensor ``[n, 2]``. A tuple of two is always
    ``(beta1, beta2)`` (for ``n = 2``, ``([b1_0, b1_1], [b2_0, b2_1])``), a list of pairs is
    always one pair per trial.

    Raises:
        hydro.errors.ConfigError: any other shape, naming the forms above.
    """

    def fail(why: str) -> ConfigError:
        return ConfigError(f"betas: {why}; expected {BETAS_FORMS}")

    if torch.is_tensor(betas):
        if betas.dim() == 2 and betas.shape == (n, 2):
            t = betas.detach().to(torch.float64).cpu()
            return t[:, 0].clone(), t[:, 1].clone()
        if betas.shape == (2,):
            return per_trial(betas[0], n, "beta1"), per_trial(betas[1], n, "beta2")
        raise fail(f"a tensor of shape {tuple(betas.shape)} for {n} fused trials")
    if not isinstance(betas, (list, tuple)):
        raise fail(f"got {betas!r}")
    pairs = isinstance(betas, list) and len(betas) == n and all(_is_pair(b) for b in betas)
    if pairs and not (n == 2 and not all(isinstance(b, (list, tuple)) for b in betas)):
        t = torch.as_tensor([[float(b[0]), float(b[1])] for b in betas], dtype=torch.float64)
        return t[:, 0].clone(), t[:, 1].clone()
    if len(betas) != 2:
        raise fail(f"{len(betas)} entries for {n} fused trials")
    try:
        return per_trial(betas[0], n, "beta1"), per_trial(betas[1], n, "beta2")
    except ConfigError as exc:
        raise fail(str(exc)) from None


# What torch.optim accepts of each hyperparameter (and eps > 0, where torch lets 0 divide by
# zero), per trial: a value outside trains nothing sensible, and NaN would freeze the trial at
# its first step as "diverged" without a word.
_RANGES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "lr": (lambda v: v >= 0, "a learning rate must be >= 0"),
    "weight_decay": (lambda v: v >= 0, "weight decay must be >= 0"),
    "momentum": (lambda v: v >= 0, "momentum must be >= 0"),
    "dampening": (lambda v: v >= 0, "dampening must be >= 0"),
    "eps": (lambda v: v > 0, "eps must be > 0"),
    "beta1": (lambda v: (v >= 0) & (v < 1), "betas must lie in [0, 1)"),
    "beta2": (lambda v: (v >= 0) & (v < 1), "betas must lie in [0, 1)"),
}


def _check_ranges(group: dict) -> None:
    """Raise ``ConfigError`` naming the first hyperparameter of ``group`` that some trial has
    outside its range (or not finite), with those trials and their values."""
    columns = {k: group[k] for k in _RANGES if torch.is_tensor(group.get(k))}
    if "betas" in group:
        columns["beta1"], columns["beta2"] = group["betas"]
    for key, values in columns.items():
        ok, rule = _RANGES[key]
        bad = (~(torch.isfinite(values) & ok(values))).nonzero().flatten().tolist()
        if bad:
            shown = ", ".join(f"trial {k}: {float(values[k])!r}" for k in bad[:5])
            raise ConfigError(
                f"{key} out of range ({shown}): {rule} and finite; give every trial a valid value"
            )


def _trial_sums(grads: list[torch.Tensor]) -> torch.Tensor:
    """``[len(grads), n]``: each gradient summed per trial (finite iff all its entries are,
    barring an overflow of the sum itself, which only an exploding trial reaches)."""
    return torch.stack([g if g.dim() == 1 else g.sum(dim=tuple(range(1, g.dim()))) for g in grads])


class FusedOptimizer(torch.optim.Optimizer):
    """Base of the fused optimizers: per-trial hyperparameters, muP multipliers, isolation.

    Args:
        params: parameters (or parameter groups) with a leading trial dimension ``n``.
        defaults: default hyperparameters, each a scalar or one value per trial.
        compile: run the step through ``torch.compile``: ``True`` (inductor), a
            backend name or a backend callable; ``False``: eager; ``"auto"`` (default): compile
            with inductor on CUDA, eager on a CPU (where the eager step is as fast as torch's
            fused kernel run per trial and a 20-90 s compile pays back only after thousands of
            steps; see docs/explanation/fusion.md). If compiling fails, the step warns once and
            runs eagerly (same results).
    """

    kind = "adam"  # which muP multipliers apply: "adam" or "sgd"
    per_trial_keys: tuple[str, ...] = ()
    cohort_key = "step"  # a state tensor [n] shared by the parameters that step together

    def __init__(
        self, params: Iterable, defaults: dict, compile: bool | str | Callable = "auto"
    ) -> None:
        self.n: int | None = None
        self._device_cache: dict[tuple, tuple[torch.Tensor, int, torch.Tensor]] = {}
        super().__init__(params, defaults)
        self._schedulers: list[weakref.ref] = []
        self._trial_optimizers: list[torch.optim.Optimizer] | None = None
        self.compile = compile
        self._math: Callable | None = None
        # the compiled step (:meth:`_compiled_step`): its structure per parameter list, and the
        # state _on and _any read from while dynamo traces it
        self._plans: dict[tuple, tuple] = {}
        self._tracing = False
        self._traced_any: dict[str, bool] = {}
        self._scratch_buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._scratch_views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def set_compile(self, compile: bool | str | Callable) -> None:
        """Switch how the update runs from the next step on (``compile`` as in the
        constructor); an update compiled before is dropped."""
        self.compile, self._math = compile, None
        self._plans.clear()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its hyperparameters become float64 tensors ``[n]``."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if self.n is None and p.dim() > 0:
                self.n = int(p.shape[0])
            if p.dim() == 0 or p.shape[0] != self.n:
                raise FuseError(
                    "every parameter of a fused optimizer needs the same leading trial "
                    f"dimension {self.n}; got shape {tuple(p.shape)}"
                )
        for key in self.per_trial_keys:
            if key == "betas":
                group[key] = parse_betas(group[key], self.n)
            else:
                group[key] = per_trial(group[key], self.n, key)
        _check_ranges(group)

    # --- the step -------------------------------------------------------------------------------

    def _diverged(self) -> torch.Tensor | None:
        for group in self.param_groups:
            for p in group["params"]:
                flags = getattr(p, "hydro_diverged", None)
                if flags is not None:
                    return flags
        return None

    def _on(self, group: dict, name: str, like: torch.Tensor) -> torch.Tensor:
        """``group[name]`` on ``like``'s device, cached until it is replaced or written to."""
        t = group[name] if isinstance(name, str) else group["betas"][name]
        if self._tracing:  # group: the device tensors the compiled step was given
            return t
        key = (id(group), name, like.device)
        hit = self._device_cache.get(key)
        if hit is not None and hit[0] is t and hit[1] == t._version:
            return hit[2]
        moved = t.to(like.device, non_blocking=True)
        self._device_cache[key] = (t, t._version, moved)
        return moved

    @torch.no_grad()
    def step(self, closure=None):  # torch.optim signature
        """One update of every trial that has not diverged (no host synchronization)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        per_group = [[p for p in g["params"] if p.grad is not None] for g in self.param_groups]
        params = [p for ps in per_group for p in ps]
        if not params:
            return loss
        if self.compile == "auto":
            # CPU: the eager step below is memory-bound and as fast as torch's fused kernel
            # per trial; compiling (20-90 s) pays back only after thousands of steps. CUDA:
            # the eager step launches a few kernels per parameter tensor, the compiled one a
            # handful in all.
            self.compile = "inductor" if params[0].device.type == "cuda" else False
        if self.compile and self._compiled_step(per_group, params):
            return loss
        frozen = ~torch.isfinite(_trial_sums([p.grad for p in params])).all(dim=0)
        flags = self._diverged()
        if flags is not None:
            flags |= frozen.to(flags.device)
            frozen = flags
        active = ~frozen.to(params[0].device)
        self._prepare_state(per_group)
        # One [n] vector per (group, muP multipliers, step cohort); one [n, 1, ...] view of it
        # per parameter: the element-wise update then runs over all parameters at once.
        coeffs: dict[str, list[torch.Tensor]] = {}
        for group, ps in zip(self.param_groups, per_group):
            buckets: dict[tuple, list[int]] = {}
            for i, p in enumerate(ps):
                key = (optimizer_multipliers(p, self.kind), id(self.state[p][self.cohort_key]))
                key += (p.dtype,)
                buckets.setdefault(key, []).append(i)
            per_param: list[dict[str, torch.Tensor] | None] = [None] * len(ps)
            for ((lr_mult, wd_mult), _, dtype), members in buckets.items():
                first = ps[members[0]]
                vectors = self._coefficients(
                    group, self.state[first], lr_mult, wd_mult, active, first
                )
                # converted once per bucket, viewed once per rank (a weight [n, out, in] and its
                # bias [n, out] share one conversion)
                typed = {k: v if v.dtype == torch.bool else v.to(dtype) for k, v in vectors.items()}
                views: dict[int, dict[str, torch.Tensor]] = {}
                for i in members:
                    rank = ps[i].dim()
                    if rank not in views:
                        shape = (-1,) + (1,) * (rank - 1)
                        views[rank] = {k: v.view(shape) for k, v in typed.items()}
                    per_param[i] = views[rank]
            for d in per_param:
                for k, v in d.items():
                    coeffs.setdefault(k, []).append(v)
        self._advance_cohorts(per_group, active)
        state = {
            key: [self.state[p][key] for p in params]
            for key in self._state_keys()
            if all(key in self.state[p] for p in params)
        }
        grads = [p.grad for p in params]
        if host.reads_are_free(params[0].device) and bool(active.all()):
            # On a CPU reading the flags costs nothing (no device to wait for), and with every
            # trial live the masking pass is an identity: skip it. Accelerators keep the mask.
            del coeffs["active"]
        self._run(params, grads, state, coeffs)
        return loss

    def _compiled_step(self, per_group: list[list[torch.Tensor]], params: list) -> bool:
        """The step through ``torch.compile`` as two graphs: the isolation flags and every
        coefficient (what the eager step runs as a few dozen small ops and Python per step),
        then the update; the step counts advance after them. ``False`` after a compiler
        failure (warned once; the eager step runs instead)."""
        self._prepare_state(per_group)
        like = params[0]
        key = tuple((id(p), p.dtype, id(self.state[p][self.cohort_key])) for p in params)
        plan = self._plans.get(key)
        if plan is None:  # once per parameter list: its buckets (see step)
            plan = self._plans[key] = self._bucket_plan(per_group)
        hypers = []
        for group in self.param_groups:
            hyper = {k: self._on(group, k, like) for k in self.per_trial_keys if k != "betas"}
            if "betas" in self.per_trial_keys:
                hyper["betas"] = (self._on(group, 0, like), self._on(group, 1, like))
            hypers.append(hyper)
        for k in ("weight_decay", "momentum", "amsgrad"):
            if k in self.per_trial_keys:
                self._traced_any[k] = self._any(k)
        keys = [k for k in self._state_keys() if all(k in self.state[p] for p in params)]
        # what _coefficients reads of a bucket's state: its cohort, and which keys exist (few
        # tensors for dynamo to guard per call)
        firsts = []
        offset = 0
        for ps, buckets in zip(per_group, plan):
            for _, _, members in buckets:
                cohort = self.state[params[offset + members[0]]][self.cohort_key]
                firsts.append({**dict.fromkeys(keys), self.cohort_key: cohort})
            offset += len(ps)
        state = {k: [self.state[p][k] for p in params] for k in keys}
        flags = self._diverged()
        if self._math is None:
            # two graphs: in one, inductor would recompute each trial's coefficients (powers,
            # square roots in float64) in every vector of the update's loops
            backend = "inductor" if self.compile is True else self.compile
            self._math = (
                torch.compile(self._traced_coefficients, backend=backend, fullgraph=True),
                torch.compile(type(self)._traced_update, backend=backend, fullgraph=True),
            )
        grads = [p.grad for p in params]
        self._tracing = True
        try:
            # dynamo keeps a function's graphs per code object, and these two serve every
            # hydro.optim optimizer of the process: at its default limit (8) the ninth fused
            # model's optimizer would fail to compile and run eagerly
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                active, vectors = self._math[0](grads, firsts, plan, hypers, flags, like)
                self._math[1](per_group, grads, state, vectors, plan)
        except Exception as exc:  # any compiler failure: fall back, say so
            warnings.warn(
                f"hydro.optim.{type(self).__name__}(compile={self.compile!r}): "
                f"torch.compile failed ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                "running the eager step instead (same results, more kernel launches)",
                RuntimeWarning,
                stacklevel=4,
            )
            self._math = None
            self.compile = False
            return False
        finally:
            self._tracing = False
        self._advance_cohorts(per_group, active)
        return True

    def _bucket_plan(self, per_group: list[list[torch.Tensor]]) -> tuple:
        """Per parameter group, its buckets as ``(muP multipliers, dtype, member indices)``:
        parameters sharing multipliers, cohort and dtype, whose coefficients are one vector."""
        plan = []
        for ps in per_group:
            buckets: dict[tuple, list[int]] = {}
            for i, p in enumerate(ps):
                mults = optimizer_multipliers(p, self.kind)
                buckets.setdefault((mults, id(self.state[p][self.cohort_key]), p.dtype),
                                   []).append(i)
            plan.append(tuple((m, d, tuple(i)) for (m, _, d), i in buckets.items()))
        return tuple(plan)

    @classmethod
    def _traced_update(cls, per_group, grads, state, vectors, plan) -> None:
        """The second graph of :meth:`_compiled_step`: each parameter's ``[n, 1, ...]`` views
        of its bucket's coefficient vectors, in parameter order, and the update."""
        params = [p for ps in per_group for p in ps]
        coeffs: dict[str, list[torch.Tensor]] = {k: [] for k in vectors[0]}
        index = iter(vectors)
        for ps, buckets in zip(per_group, plan):
            per_param: list[dict[str, torch.Tensor]] = [{}] * len(ps)
            for _, _, members in buckets:
                typed = next(index)
                for i in members:
                    shape = (-1,) + (1,) * (ps[i].dim() - 1)
                    per_param[i] = {k: v.view(shape) for k, v in typed.items()}
            for d in per_param:
                for k, v in d.items():
                    coeffs[k].append(v)
        cls._elementwise(params, grads, state, coeffs)

    def _traced_coefficients(self, grads, states, plan, hypers, flags, like):
        """The first graph of :meth:`_compiled_step`: the isolation flags and every bucket's
        coefficient vectors ``[n]`` (``step``'s arithmetic; the trials are masked whether or not
        any is frozen, an identity then); returns the active trials and the vectors."""
        frozen = ~torch.isfinite(_trial_sums(grads)).all(dim=0)
        if flags is not None:
            flags |= frozen.to(flags.device)
            frozen = flags
        active = ~frozen.to(like.device)
        out = []
        first = iter(states)  # one per bucket
        for buckets, hyper in zip(plan, hypers):
            for (lr_mult, wd_mult), dtype, _ in buckets:
                vectors = self._coefficients(hyper, next(first), lr_mult, wd_mult, active, like)
                out.append({k: v if v.dtype == torch.bool else v.to(dtype)
                            for k, v in vectors.items()})
        return active, out

    def _run(self, params, grads, state, coeffs) -> None:
        """The eager update, parameter by parameter (:meth:`_update`)."""
        for i, p in enumerate(params):
            self._update(
                p,
                grads[i],
                {key: values[i] for key, values in state.items()},
                {key: values[i] for key, values in coeffs.items()},
                self._scratch(p),
            )

    def _scratch(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two work tensors shaped like ``p``: views of two buffers shared by all parameters.

        The eager update runs parameter by parameter, so its intermediates live in the same
        small memory every time (in cache, never freshly allocated and faulted in) and each
        parameter's passes run while its state is still in cache.
        """
        key = (p.device, p.dtype, tuple(p.shape))
        hit = self._scratch_views.get(key)
        if hit is not None:
            return hit
        pool = (p.device, p.dtype)
        buffers = self._scratch_buffers.get(pool)
        if buffers is None or buffers[0].numel() < p.numel():
            size = max(p.numel(), *(q.numel() for g in self.param_groups for q in g["params"]))
            buffers = tuple(torch.empty(size, dtype=p.dtype, device=p.device) for _ in range(2))
            self._scratch_buffers[pool] = buffers
            self._scratch_views = {k: v for k, v in self._scratch_views.items() if k[:2] != pool}
        views = tuple(b[: p.numel()].view(p.shape) for b in buffers)
        self._scratch_views[key] = views
        return views

    def _update(self, p, g, state, c, scratch) -> None:
        """The eager update of one parameter (``state``, ``c``: its state and coefficients)."""
        raise NotImplementedError

    def _state_keys(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _any(self, key: str) -> bool:
        """Whether any trial of any group has a nonzero ``key`` (host tensors: no device sync);
        every parameter then gets the same state and coefficients, so one update covers all."""
        if self._tracing:  # read before the compiled step: a constant of its graph
            return self._traced_any[key]
        return any(any(g[key].tolist()) for g in self.param_groups)

    def _init_state(self, p: torch.Tensor, state: dict, group: dict) -> None:
        raise NotImplementedError

    def _prepare_state(self, per_group: list[list[torch.Tensor]]) -> None:
        """Create missing state; parameters that start together share one cohort tensor."""
        for group, ps in zip(self.param_groups, per_group):
            fresh: dict[torch.device, torch.Tensor] = {}
            for p in ps:
                state = self.state[p]
                if self.cohort_key not in state:
                    if p.device not in fresh:
                        fresh[p.device] = self._new_cohort(p)
                    state[self.cohort_key] = fresh[p.device]
                self._init_state(p, state, group)
        # A cohort tensor shared with a parameter that has no gradient this step: split it off.
        with_grad = {id(p) for ps in per_group for p in ps}
        owners: dict[int, list[tuple[torch.Tensor, bool]]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                t = self.state[p].get(self.cohort_key) if p in self.state else None
                if t is not None:
                    owners.setdefault(id(t), []).append((p, id(p) in with_grad))
        for members in owners.values():
            if len({has for _, has in members}) == 2:
                split = self.state[members[0][0]][self.cohort_key].clone()
                for p, has in members:
                    if has:
                        self.state[p][self.cohort_key] = split

    def _advance_cohorts(self, per_group: list[list[torch.Tensor]], active: torch.Tensor) -> None:
        raise NotImplementedError

    def _new_cohort(self, p: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _coefficients(self, group, state, lr_mult, wd_mult, active, like):
        raise NotImplementedError

    @staticmethod
    def _elementwise(params, grads, state, coeffs) -> None:
        """The update of every parameter as ``_foreach`` ops, for ``torch.compile`` to fuse."""
        raise NotImplementedError

    # --- checkpoints ----------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()``; a run resumed from it continues bit for bit.

        State tensors are copied (the checkpoint is never written to), moved to their
        parameter's device, and tensors shared in the checkpoint (a step cohort) stay shared.
        """
        super().load_state_dict(state_dict)
        # torch casts every state tensor to its parameter's dtype; step counts (float64) and
        # cohort flags (bool) keep theirs, so re-read them from the checkpoint.
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        memo: dict[int, torch.Tensor] = {}
        for index, p in zip(saved, params):
            for key, value in state_dict["state"].get(index, {}).items():
                if torch.is_tensor(value):
                    if id(value) not in memo:
                        keep = key in ("step", self.cohort_key) or not value.is_floating_point()
                        dtype = value.dtype if keep else p.dtype
                        memo[id(value)] = value.to(p.device, dtype, copy=True)
                    self.state[p][key] = memo[id(value)]
        self._device_cache.clear()

    # --- dropping trials, schedulers ------------------------------------------------------------

    def select(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Keep only the trials ``indices``: pair with ``fused.select(indices)``.

        Slices every per-trial hyperparameter and state tensor, and the per-trial state of the
        learning-rate schedulers attached to this optimizer.
        """
        index = torch.as_tensor(indices, dtype=torch.long)
        for group in self.param_groups:
            for key in self.per_trial_keys:
                if key == "betas":
                    group[key] = tuple(b[index] for b in group[key])
                else:
                    group[key] = group[key][index]
            for k in ("initial_lr", "max_lr", "min_lr"):
                if torch.is_tensor(group.get(k)):
                    group[k] = group[k][index]
        memo: dict[int, torch.Tensor] = {}  # keeps shared (cohort) tensors shared
        for state in self.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    if id(value) not in memo:
                        memo[id(value)] = value[index.to(value.device)]
                    state[key] = memo[id(value)]
        if self._trial_optimizers is not None:
            self._trial_optimizers = [self._trial_optimizers[i] for i in index.tolist()]
        live = []
        for ref in self._schedulers:
            sched = ref()
            if sched is not None:
                sched.select_trials(index)
                live.append(ref)
        self._schedulers = live
        self.n = len(index)
        self._device_cache.clear()

    def reset_trial(self, k: int, **hyperparams: float | bool | tuple[float, float]) -> None:
        """Start slot ``k`` afresh, as a newly constructed optimizer would, for a new trial.

        Slot ``k``'s state (step count, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``,
        ``momentum_buffer``) returns to that of a new optimizer, its diverged flag is cleared,
        and each hyperparameter given (one value: ``lr=3e-4``, ``betas=(0.9, 0.95)``,
        ``weight_decay=0.1``, ...) is set for slot ``k`` in every parameter group; the others
        keep slot ``k``'s current values. Every other slot is left bit for bit as it was. Pair
        with re-initializing slot ``k`` of the fused model's parameters, and with
        :meth:`hydro.optim.lr_scheduler.TrialScheduler.reset_trial` (after this call) when a
        scheduler drives the learning rate: the new trial then trains exactly as it would alone
        from its step 0 (``tests/optim/test_reset_trial.py``).

        Args:
            k: the slot, ``0 <= k < n``.
            **hyperparams: per-trial hyperparameters of this optimizer, one value each.

        Raises:
            hydro.errors.ConfigError: ``k`` out of range, an unknown hyperparameter or a value
                that is not one number (``betas``: one pair).

        Example:
            >>> import torch
            >>> from hydro.fusion import fuse
            >>> import hydro.optim
            >>> fused = fuse(torch.nn.Linear(4, 1), n=2)
            >>> opt = hydro.optim.Adam(fused.parameters(), lr=[1e-3, 1e-2])
            >>> fused(torch.randn(8, 4)).sum().backward()
            >>> opt.step()
            >>> opt.reset_trial(1, lr=3e-3, betas=(0.8, 0.99))
            >>> opt.param_groups[0]["lr"].tolist()
            [0.001, 0.003]
            >>> [float(s["step"][1]) for s in opt.state.values()]
            [0.0, 0.0]
        """
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < (self.n or 0):
            raise ConfigError(f"reset_trial: slot {k!r} is not one of the {self.n} fused trials")
        unknown = sorted(set(hyperparams) - set(self.per_trial_keys))
        if unknown:
            raise ConfigError(
                f"reset_trial: {type(self).__name__} has no per-trial hyperparameter "
                f"{', '.join(unknown)}; it has {', '.join(self.per_trial_keys)}"
            )
        values: dict[str, float | tuple[float, float]] = {}
        for key, value in hyperparams.items():
            try:
                if key == "betas":
                    if not _is_pair(value):
                        raise TypeError
                    values[key] = (float(value[0]), float(value[1]))
                else:
                    values[key] = float(value)
            except (TypeError, ValueError, RuntimeError):
                form = "one (beta1, beta2) pair" if key == "betas" else "one number"
                raise ConfigError(
                    f"reset_trial: {key} sets one trial's value and must be {form}; got {value!r}"
                ) from None
        previous = [dict(group) for group in self.param_groups]
        for group in self.param_groups:
            for key, value in values.items():
                _set_trial_value(group, key, k, value)
        try:
            self._validate()
        except ConfigError:
            for group, before in zip(self.param_groups, previous):
                group.update(before)
            raise
        done: set[int] = set()  # cohort tensors are shared between parameters
        for state in self.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.dim() > 0 and id(value) not in done:
                    done.add(id(value))
                    value[k] = 0
        flags = self._diverged()
        if flags is not None:
            flags[k] = False
        self._device_cache.clear()

    def trial_state(self, k: int) -> dict[str, Any]:
        """Slot ``k``'s slice of the optimizer (copies): its per-trial hyperparameters in every
        parameter group and its state for every parameter, for :meth:`load_trial_state` into
        any slot of an optimizer over a fused model of the same architecture."""
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < (self.n or 0):
            raise ConfigError(f"trial_state: slot {k!r} is not one of the {self.n} fused trials")
        groups = []
        for group in self.param_groups:
            values = {}
            for key in self.per_trial_keys:
                if key == "betas":
                    values[key] = [float(b[k]) for b in group[key]]
                else:
                    values[key] = float(group[key][k])
            groups.append(values)
        params = [p for g in self.param_groups for p in g["params"]]
        state = [
            {key: v[k].clone() for key, v in self.state.get(p, {}).items()
             if torch.is_tensor(v) and v.dim()}
            for p in params
        ]
        return {"groups": groups, "state": state}

    def load_trial_state(self, k: int, trial: dict[str, Any]) -> None:
        """Put what :meth:`trial_state` returned in slot ``k``; the other slots are untouched.

        Raises:
            hydro.errors.ConfigError: ``k`` out of range, or ``trial`` was taken from an
                optimizer over other parameters (count, shapes or kind of state).
        """
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < (self.n or 0):
            raise ConfigError(f"load_trial_state: slot {k!r} is not one of the {self.n} fused "
                              "trials")
        params = [p for g in self.param_groups for p in g["params"]]
        if len(trial["state"]) != len(params) or len(trial["groups"]) != len(self.param_groups):
            raise ConfigError(
                f"load_trial_state: the trial's state covers {len(trial['state'])} parameters "
                f"in {len(trial['groups'])} groups, this optimizer {len(params)} in "
                f"{len(self.param_groups)}: it comes from another model or optimizer"
            )
        # a slot's state exists only once the optimizer has stepped: create it for every slot
        self._prepare_state([list(g["params"]) for g in self.param_groups])
        for p, saved in zip(params, trial["state"]):
            for key, value in saved.items():
                have = self.state[p].get(key)
                if have is None or tuple(have.shape[1:]) != tuple(value.shape):
                    raise ConfigError(
                        f"load_trial_state: state {key!r} of shape {tuple(value.shape)} does not "
                        f"fit this optimizer's parameter of shape {tuple(p.shape)}"
                    )
        done: set[int] = set()  # cohort tensors are shared between parameters
        for p, saved in zip(params, trial["state"]):
            for key, value in saved.items():
                have = self.state[p][key]
                if id(have) not in done:
                    done.add(id(have))
                    have[k] = value.to(have.device, have.dtype)
        for group, values in zip(self.param_groups, trial["groups"]):
            for key, value in values.items():
                _set_trial_value(group, key, k, value)
        self._device_cache.clear()

    def _validate(self) -> None:
        """Reject per-trial hyperparameters that no trial could use."""
        for group in self.param_groups:
            _check_ranges(group)

    def trial_optimizers(self) -> list[torch.optim.Optimizer]:
        """One stand-in ``torch.optim`` optimizer per trial, for per-trial schedulers to drive."""
        if self._trial_optimizers is None:
            self._trial_optimizers = [self._stand_in(k) for k in range(self.n)]
        return self._trial_optimizers

    def _stand_in(self, k: int, base_lr: Sequence[float] | None = None) -> torch.optim.Optimizer:
        groups = []
        for g, group in enumerate(self.param_groups):
            lr = float(group["lr"][k]) if base_lr is None else float(base_lr[g])
            values = {"params": [torch.zeros(1)], "lr": lr}
            if "betas" in group:
                values["betas"] = tuple(float(b[k]) for b in group["betas"])
            if "momentum" in group:
                values["momentum"] = float(group["momentum"][k])
            groups.append(values)
        cls = torch.optim.Adam if "betas" in self.defaults else torch.optim.SGD
        return cls(groups)

    def _attach(self, scheduler: object) -> None:
        self._schedulers.append(weakref.ref(scheduler))


def _set_trial_value(group: dict, key: str, k: int, value: Any) -> None:
    """Set trial ``k``'s ``key`` in a param group: a new column (``betas``: a new pair), so
    a copy of the group taken before still holds the old values."""
    if key == "betas":
        betas = tuple(b.clone() for b in group["betas"])
        betas[0][k], betas[1][k] = value
        group["betas"] = betas
    else:
        column = group[key].clone()
        column[k] = value
        group[key] = column

"""muP relative to the target: infshapes, initialization, multipliers and optimizer scaling.

The surrogate is parametrized with the Maximal Update Parametrization using the *target* model as
the base shape, so every width multiplier is ``surrogate width / target width = 1 / ratio``. At
ratio 1 every multiplier is exactly 1 and the surrogate is the target in standard parametrization.

Rules, per role of a parameter (``m`` is the width multiplier of the parameter's main width
dimension, as returned by ``p.infshape.width_mult()``; for the surrogate ``m = 1/ratio``):

========  ====================================  ===========  =============  ===================
role      example                               init std     Adam(W) lr     SGD lr
========  ====================================  ===========  =============  ===================
input     first Linear/Conv, Embedding          x 1          x 1            x m
hidden    Linear/Conv width -> width            x m^-1/2     x 1/m          x fan_out/fan_in
output    readout Linear width -> classes       x 1          x 1            x m
vector    biases, norm affine, layer scale      x 1          x 1            x m
fixed     no width dimension                    x 1          x 1            x 1
========  ====================================  ===========  =============  ===================

The output layer's input is multiplied by ``output_mult / m`` in the forward pass (the muP readout
multiplier), which is why its stored weights keep the target's scale. A weight shared by an
embedding and the readout (tied) is an output and keeps the target's std too, as ``mup``'s README
recipe leaves it (``mup.init`` after ``set_base_shapes``): ``set_base_shapes(rescale_params=True)``
alone would shrink a ``MuSharedReadout``'s weight by ``sqrt(m)`` as if it were an ``nn.Linear``,
but it is also the embedding, whose muP init does not change with width (that shrink lowered the
best learning rate of a char GPT's ratio-4 surrogate by a doubling: docs/explanation/transfer.md).
Weight decay follows the ``mup`` package: it is divided by the learning-rate multiplier, so that
``lr * weight_decay`` (the per-step decay of AdamW and of SGD's coupled decay) does not change
with width.

These are the rules of ``mup.MuAdam`` / ``mup.MuSGD``; :func:`optimizer_multipliers` returns them
per parameter so that Hydro's fused optimizers and plain ``torch.optim`` users (through
:func:`param_groups`) apply exactly what ``mup`` would.

Depth (``depth_ratio > 1``, see :mod:`hydro.fx.depth`): a stack of ``L`` blocks cut to ``L_s``
multiplies each kept block's residual branches by ``(L / L_s) ** alpha`` (CompleteP, alpha = 1;
Depth-muP, alpha = 1/2), the target being the base depth. With Adam-like optimizers CompleteP
scales the learning rate of every parameter inside the blocks by ``(L_s / L) ** (alpha - 1)``:
1 at alpha = 1, ``sqrt(L / L_s)`` at alpha = 1/2 (hidden weights, their biases and the blocks'
norm gains and biases alike; parameters outside the blocks get none). The weight decay gets no
depth factor: AdamW's decay keeps its width rule only, as in the CompleteP authors' reference
implementation, so at alpha = 1/2 ``lr * weight_decay`` inside the blocks is ``sqrt(L / L_s)``
times the target's. Not implemented: CompleteP's Adam epsilon rule (``eps`` times ``ratio *
(L / L_s) ** alpha`` in the surrogate; see docs/explanation/concepts.md for why it does not
matter at ``eps=1e-8``). The factor rides on the parameter's ``infshape`` (:func:`depth_lr_mult`),
so it
reaches the fused optimizers and ``param_groups`` with the muP ones. ``mup.MuAdam`` does not
know it; with alpha = 1 (the default) there is nothing to know.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import mup
import torch
import torch.fx
from torch import nn

from hydro.fx.rules import weight_norm

OptimizerKind = Literal["adam", "sgd"]


def optimizer_multipliers(param: torch.Tensor, kind: OptimizerKind = "adam") -> tuple[float, float]:
    """The ``(lr, weight_decay)`` multipliers muP gives ``param`` under an optimizer ``kind``.

    Args:
        param: a parameter; if it carries the ``mup`` package's ``infshape`` attribute (every
            parameter of a Hydro surrogate does), the muP rules apply, otherwise ``(1.0, 1.0)``.
        kind: ``"adam"`` for Adam-like optimizers (Adam, AdamW, RMSprop...), ``"sgd"`` for
            SGD-like ones.

    Returns:
        ``(lr_mult, wd_mult)``: multiply the learning rate and the weight decay by these.

    Example:
        >>> import torch, hydro
        >>> sur = hydro.scale(torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(),
        ...                   torch.nn.Linear(64, 64), torch.nn.ReLU(),
        ...                   torch.nn.Linear(64, 2)), ratio=8)
        >>> hydro.parametrize.optimizer_multipliers(sur.get_parameter("2.weight"))
        (8.0, 0.125)
    """
    infshape = getattr(param, "infshape", None)
    if infshape is None:
        return 1.0, 1.0
    lr_m, wd_m = _width_multipliers(param, infshape, kind)
    # CompleteP: the depth factor is on the learning rate only; the weight decay keeps its
    # width rule (lr * weight_decay changes with depth where alpha < 1, as in Dey et al.)
    depth = depth_lr_mult(param) if kind == "adam" else 1.0
    return lr_m * depth, wd_m


def depth_lr_mult(param: torch.Tensor) -> float:
    """The CompleteP depth learning-rate factor of a parameter inside a depth-cut block.

    1 for every parameter of a surrogate built with ``depth_alpha=1`` (the default) or
    ``depth_ratio=1``, and for parameters outside the cut stacks.
    """
    infshape = getattr(param, "infshape", None)
    return float(getattr(infshape, "hydro_depth_lr", 1.0))


def _width_multipliers(param: torch.Tensor, infshape: Any, kind: str) -> tuple[float, float]:
    ninf = infshape.ninf()
    if ninf > 2:
        raise ValueError(
            f"a parameter of shape {tuple(param.shape)} has {ninf} width dimensions; muP defines "
            "learning-rate scaling for at most 2"
        )
    if kind == "adam":
        if ninf == 2:
            m = infshape.width_mult()
            return 1.0 / m, m
        return 1.0, 1.0
    if kind == "sgd":
        if ninf == 1:
            m = infshape.width_mult()
            return m, 1.0 / m
        if ninf == 2:
            r = infshape.fanin_fanout_mult_ratio()
            return 1.0 / r, r
        return 1.0, 1.0
    raise ValueError(f"unknown optimizer kind {kind!r}; use 'adam' (Adam-like) or 'sgd' (SGD-like)")


def param_groups(
    params: Iterable[torch.Tensor] | nn.Module,
    lr: float,
    weight_decay: float = 0.0,
    kind: OptimizerKind = "adam",
) -> list[dict]:
    """Parameter groups with muP learning rates and weight decays, for any ``torch.optim`` class.

    Args:
        params: a module (its parameters are used) or an iterable of parameters.
        lr: the base learning rate (the one that transfers to the target model).
        weight_decay: the base weight decay.
        kind: ``"adam"`` or ``"sgd"``, the family of the optimizer the groups are for.

    Example:
        >>> import torch, hydro
        >>> sur = hydro.scale(torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(),
        ...                   torch.nn.Linear(64, 2)), ratio=8)
        >>> opt = torch.optim.AdamW(hydro.parametrize.param_groups(sur, lr=1e-3, weight_decay=0.1))
    """
    if isinstance(params, nn.Module):
        params = params.parameters()
    groups: dict[tuple[float, float], list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(optimizer_multipliers(p, kind), []).append(p)
    return [
        {"params": ps, "lr": lr * lr_m, "weight_decay": weight_decay * wd_m}
        for (lr_m, wd_m), ps in groups.items()
    ]


def set_depth_lr(sur: nn.Module, plan: Any) -> None:
    """Attach the CompleteP depth learning-rate factor to the parameters of cut stacks' blocks.

    ``plan`` is a :class:`hydro.fx.depth.DepthPlan`. Nothing is attached where the factor is 1.
    """
    for stack in plan.stacks:
        if not stack.cut:
            continue
        factor = (len(stack.blocks) / len(stack.kept)) ** (1.0 - plan.alpha)
        if factor == 1.0:
            continue
        for name, p in sur.named_parameters():
            if any(name.startswith(b + ".") for b in stack.kept) and hasattr(p, "infshape"):
                p.infshape = copy.copy(p.infshape)  # tuple subclass: the copy holds the factor
                p.infshape.hydro_depth_lr = factor


# --- applying muP to a freshly rebuilt surrogate -------------------------------------------------

Role = Literal["input", "hidden", "output", "vector", "fixed"]


@dataclass
class SurrogateInfo:
    """What :func:`hydro.scale` did, attached to the surrogate as ``sur.hydro``.

    Attributes:
        ratio: the width divisor.
        output_mult: the muP output multiplier.
        roles: the muP role of each parameter (``input``, ``hidden``, ``output``, ``vector``,
            ``fixed``), by name.
        target_shapes: each parameter's shape in the target (the muP base shape).
        init_std: ``(target std, surrogate std)`` of each parameter's initialization.
        multipliers: the readout multipliers inserted, by buffer name (``mup_readout.scale``).
        head_decisions: how each attention head split was scaled.
        depth_ratio: every ``depth_ratio``-th block of each stack of repeated blocks is kept.
        depth_alpha: the depth exponent (1: CompleteP, 0.5: Depth-muP).
        stacks: the stacks of repeated blocks found (:class:`hydro.fx.depth.Stack`): which
            blocks are kept, or why a stack was left whole.
        depth_multipliers: the residual-branch multipliers inserted, by buffer name
            (``depth_residual.scale``).
        structured: parameters rebuilt by the rule of their values rather than drawn (a
            sinusoid table, ``log(arange(1, N + 1))``, an identity), with the rule in words.
    """

    ratio: int
    output_mult: float
    roles: dict[str, Role] = field(default_factory=dict)
    target_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    init_std: dict[str, tuple[float, float]] = field(default_factory=dict)
    multipliers: dict[str, float] = field(default_factory=dict)
    head_decisions: list[str] = field(default_factory=list)
    init_mult: dict[str, float] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)
    depth_ratio: int = 1
    depth_alpha: float = 1.0
    stacks: list = field(default_factory=list)
    depth_multipliers: dict[str, float] = field(default_factory=dict)
    structured: dict[str, str] = field(default_factory=dict)


def role_of(width_mask: tuple[bool, ...], uses: list) -> Role:
    """The muP role of a parameter from which dimensions are width and how ops use it."""
    ninf = sum(width_mask)
    if ninf == 0:
        return "fixed"
    if ninf >= 2:
        return "hidden"
    for u in uses:
        if any(width_mask[d] for d in u.fan_in) and not any(width_mask[d] for d in u.fan_out):
            return "output"
    if any(not any(width_mask[d] for d in u.fan_in) for u in uses):
        return "input"
    return "vector"


def _fan_in_ratio(old: tuple[int, ...], new: tuple[int, ...], uses: list, mask) -> float:
    """``target fan-in / surrogate fan-in`` of a parameter (its main width dim if unused)."""
    dims = uses[0].fan_in if uses else (max(i for i, w in enumerate(mask) if w),)
    return math.prod(old[d] for d in dims) / math.prod(new[d] for d in dims)


@dataclass(frozen=True)
class InitStats:
    """What Hydro keeps of a target tensor's initialization: its mean, std and shape family."""

    mean: float
    std: float
    uniform: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> InitStats:
        flat = t.detach().to(torch.float64).flatten()
        mean = flat.mean().item() if flat.numel() else 0.0
        std = flat.std(unbiased=False).item() if flat.numel() > 1 else 0.0
        if std == 0.0 or not math.isfinite(std):
            return cls(mean, 0.0, False)
        # uniform distributions have kurtosis 1.8, normals 3: a cheap, robust way to tell them
        kurtosis = (((flat - mean) / std) ** 4).mean().item()
        return cls(mean, std, flat.numel() >= 16 and kurtosis < 2.2)

    @torch.no_grad()
    def draw(self, new: torch.Tensor, std_mult: float, generator: torch.Generator | None) -> float:
        """Fill ``new`` from these statistics with the std times ``std_mult``; the new std."""
        if self.std == 0.0:
            new.fill_(self.mean)  # constants stay constants: norm ones, zero readouts, layer scales
            return 0.0
        s = self.std * std_mult
        if self.uniform:
            half = math.sqrt(3.0) * s
            new.uniform_(self.mean - half, self.mean + half, generator=generator)
        else:
            new.normal_(self.mean, s, generator=generator)
        return s


@torch.no_grad()
def init_like(
    new: torch.Tensor, old: torch.Tensor, std_mult: float, generator: torch.Generator | None
) -> float:
    """Initialize ``new`` from ``old``'s statistics with its std multiplied by ``std_mult``.

    A constant tensor (ones of a norm, zeros of a zero-init readout, a layer scale) stays that
    constant; a tensor whose values fill a bounded interval (PyTorch's default Kaiming-uniform)
    is redrawn uniformly; anything else is redrawn from a normal. Returns the new std.
    """
    return InitStats.of(old).draw(new, std_mult, generator)


def apply(
    sur: nn.Module,
    target: nn.Module,
    plan: Any,
    node_map: dict[torch.fx.Node, torch.fx.Node],
    new_tensors: dict[int, torch.Tensor],
    *,
    output_mult: float = 1.0,
    seed: int | None = None,
    standard: bool = False,
    always_readout: bool = False,
) -> SurrogateInfo:
    """Parametrize a rebuilt surrogate with muP relative to ``target``.

    Sets each parameter's initialization from the target's statistics by its role, inserts the
    readout multipliers into the graph, and attaches ``mup`` infshapes (base = the target).
    With ``standard=True`` it builds the naive standard-parametrization model instead: every
    weight's std scaled by fan-in (the output layer's too), no multipliers, and infshapes with
    no width dimension (so no learning-rate scaling).
    """
    info = SurrogateInfo(ratio=plan.ratio, output_mult=float(output_mult))
    info.head_decisions = list(plan.head_decisions)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    base: dict[str, tuple[int, ...]] = {}
    delta: dict[str, tuple[int, ...]] = {}
    new_names = {id(p): n for n, p in sur.named_parameters()}
    readouts: list[tuple[Any, float]] = []
    source = _InitSource(target)
    for target_name, old in target.named_parameters():
        new = new_tensors.get(id(old))
        if new is None or id(new) not in new_names:
            continue  # not used by forward: not part of the surrogate
        sur_name = new_names[id(new)]
        mask = plan.width_mask(old)
        uses = plan.uses.get(id(old), [])
        role = role_of(mask, uses)
        old_shape, new_shape = tuple(old.shape), tuple(new.shape)
        by_fan_in = role == "hidden" or (standard and role == "output")
        mult = _fan_in_ratio(old_shape, new_shape, uses, mask) ** 0.5 if by_fan_in else 1.0
        stats = source.values(old)
        if id(old) in plan.structured:  # rebuilt by the rule of its values (scaling.py)
            info.structured[sur_name] = str(plan.structured[id(old)])
            new_std = float(new.detach().to(torch.float64).std()) if new.numel() > 1 else 0.0
        elif stats is None:
            new.detach().zero_()
            new_std = 0.0
        else:
            new_std = init_like(new, stats, mult, generator)
        info.roles[sur_name] = role
        info.init_mult[sur_name] = mult
        info.source[sur_name] = target_name
        info.target_shapes[sur_name] = old_shape
        info.init_std[sur_name] = (new_std / mult if mult else 0.0, new_std)
        base[sur_name] = old_shape
        delta[sur_name] = tuple(2 * d if w else d for d, w in zip(old_shape, mask))
        if role == "output" and not standard:
            for u in uses:
                readout = any(mask[d] for d in u.fan_in) and not any(mask[d] for d in u.fan_out)
                if readout and u.act is not None:
                    fan = math.prod(old_shape[d] for d in u.fan_in) / math.prod(
                        new_shape[d] for d in u.fan_in
                    )
                    u.node.meta["hydro_act"] = u.act
                    readouts.append((u.node, output_mult * fan))
    source.warn_unread(new_names, new_tensors)
    weight_norm.reset_gains(sur, weight_norm.gain_pairs(sur.graphs))
    _insert_readout_multipliers(sur, plan, node_map, readouts, info, always_readout)
    if standard:
        mup.set_base_shapes(sur, None, rescale_params=False, do_assert=False)
    else:
        mup.set_base_shapes(sur, base, delta=delta, rescale_params=False, do_assert=False)
    return info


@torch.no_grad()
def redraw(
    sur: nn.Module,
    target: nn.Module,
    seed: int | None = None,
    cache: dict[str, InitStats | None] | None = None,
) -> None:
    """Draw a surrogate's parameters again, by the same rules, from another seed.

    This is how a group gets independent trials without repeating the width analysis: copy
    one surrogate and redraw each copy. ``cache`` keeps the target's statistics between calls.
    """
    info: SurrogateInfo = sur.hydro
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    cache = {} if cache is None else cache
    source = None
    for name, p in sur.named_parameters():
        if name not in info.source or name in info.structured:
            continue  # (a table of a rule keeps its values: every trial starts from them)
        if name not in cache:
            source = source or _InitSource(target)
            values = source.values(target.get_parameter(info.source[name]))
            cache[name] = None if values is None else InitStats.of(values)
        if cache[name] is None:
            p.zero_()
        else:
            cache[name].draw(p, info.init_mult[name], generator)
    weight_norm.reset_gains(sur, weight_norm.gain_pairs(sur.graphs))


class _InitSource:
    """Where a target parameter's initialization statistics are read from.

    A materialized target is read directly. A target on the ``meta`` device (built there so that
    a large model costs no memory) has no values: each of its layers is materialized alone, on
    the CPU, and initialized by its own ``reset_parameters`` (PyTorch's default for the layer at
    the target's size), then dropped. Raw ``nn.Parameter``s of a meta target have no recoverable
    initialization; they start at zero, with a warning.
    """

    def __init__(self, target: nn.Module) -> None:
        self.owner: dict[int, tuple[nn.Module, str]] = {}
        self.unread: list[int] = []
        for module in target.modules():
            if hasattr(module, "reset_parameters"):
                for name, p in module.named_parameters(recurse=False):
                    self.owner.setdefault(id(p), (module, name))

    def values(self, p: torch.Tensor) -> torch.Tensor | None:
        if not p.is_meta:
            return p
        if id(p) not in self.owner:
            self.unread.append(id(p))
            return None
        module, name = self.owner[id(p)]
        with torch.no_grad():
            layer = copy.deepcopy(module).to_empty(device="cpu")
            layer.reset_parameters()
        return getattr(layer, name)

    def warn_unread(self, names: dict[int, str], new_tensors: dict[int, torch.Tensor]) -> None:
        if not self.unread:
            return
        unread = [names.get(id(new_tensors[i]), "?") for i in self.unread if i in new_tensors]
        warnings.warn(
            f"the target is on the meta device, so the initialization of its raw parameters "
            f"{', '.join(unread)} cannot be read; they start at zero in the surrogate. "
            "Initialize them on the surrogate, or pass a materialized target.",
            stacklevel=4,
        )


READOUT = "mup_readout"


def _insert_readout_multipliers(
    sur, plan, node_map, readouts, info: SurrogateInfo, always: bool = False
) -> None:
    """Multiply each readout's input by a 0-dim buffer (``mup_readout.scale``).

    A buffer rather than a literal: a fused group gives each trial its own value (the
    ``output_mult`` hyperparameter), and ``sur.get_buffer(name).fill_(v)`` changes it.
    Non-persistent, so the surrogate's ``state_dict`` keys stay the target's.
    """
    names: dict[float, str] = {}
    changed = set()
    for node, value in readouts:
        if value == 1.0 and not always:
            continue  # the target's own forward: keep the graph (and its numerics) as they are
        if value not in names:
            module = READOUT if not names else f"{READOUT}_{len(names)}"
            holder = nn.Module()
            dtype = next((p.dtype for p in sur.parameters() if p.is_floating_point()),
                         torch.float32)
            holder.register_buffer("scale", torch.tensor(value, dtype=dtype), persistent=False)
            sur.add_module(module, holder)
            for gm in sur.graphs.values():  # get_attr resolves on the owning graph module too
                gm.add_module(module, holder)
            names[value] = module
            info.multipliers[f"{module}.scale"] = value
        new = node_map[node]
        act_index = node.meta["hydro_act"]
        act = new.args[act_index]
        graph = new.graph
        with graph.inserting_before(new):
            scale = graph.get_attr(f"{names[value]}.scale")
            scaled = graph.call_function(torch.ops.aten.mul.Tensor, (act, scale))
        if "val" in act.meta:  # same shape as its input: later passes read it (fusion's batch)
            scaled.meta["val"] = act.meta["val"]
            scale.meta["val"] = sur.get_buffer(f"{names[value]}.scale")
        new.update_arg(act_index, scaled)
        changed.add(graph)
    for gm in sur.graphs.values():
        gm.recompile()
    for name in dir(sur):
        sub = sur.__dict__.get(name)
        if isinstance(sub, torch.fx.GraphModule) and sub.graph in changed:
            sub.recompile()

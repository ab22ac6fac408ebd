"""The width floor: how narrow each kind of layer may get before hyperparameters stop transferring.

muP makes the best learning rate independent of width only as width grows; a surrogate that is
too narrow leaves that regime and its optimum drifts. ``benchmarks/width_floor.py`` measured, per
layer kind, the narrowest surrogate width at which the learning-rate optimum still transferred
(best rate within one 2x step of the full model's, Spearman >= 0.9 over the grid):
:data:`FLOORS` holds those widths, and docs/explanation/transfer.md ("Width floor") the tables
behind them.

Here a layer's width is the narrowest of its width dimensions in the surrogate (a Linear's
hidden features, a convolution's channels, an embedding's dimension), and an attention op's is
its head dim. A layer narrower than its floor in the target itself has that width as its floor:
it may stay, not shrink. ``ratio="auto"`` (:func:`choose`) picks the largest power of two, up to
:data:`MAX_AUTO_RATIO` (:data:`MAX_AUTO_RATIO_ATTENTION` for a model with attention), that keeps
every layer at or above its floor; an explicit ratio that goes below warns (:func:`warn_below`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from hydro.errors import HydroWarning, ScaleError
from hydro.fx.nodes import module_of
from hydro.fx.rules import weight_norm
from hydro.fx.rules.common import TensorSyms, bound, op_name
from hydro.fx.solve import _solve, analysis
from hydro.fx.widths import HeadPolicy, WidthPlan

# Narrowest surrogate width (features, channels, head dim) at which the learning-rate optimum
# transferred in benchmarks/width_floor.py (3 seeds; the tables are in
# docs/explanation/transfer.md, "Width floor"): an MLP's hidden width 32 transferred and 16 did
# not; BatchNorm conv channels 8 transferred and 4 did not, but a held-out BatchNorm ResNet
# failed at 8 (and 16
# channels) and transferred at 16 (and 32), so the conv floor takes 16; a head dim of 8, the
# narrowest measured, transferred (narrower ones were not measured).
FLOORS: dict[str, int] = {"linear": 32, "conv": 16, "attention": 8}
MAX_AUTO_RATIO = 64
# The largest ratio "auto" takes for a model with an attention layer, floors or not: two GPT
# targets at or above every floor still lost at ratio 8 and transferred at 4
# (docs/explanation/transfer.md, "ratio='auto'"): the charlm GPT (surrogate width 32) chose
# worse hyperparameters end to end,
# +2.6% full-model loss at 32 steps and +6.2% at 200, and a 512-wide one (width 64) ranked
# learning rates at Spearman +0.32, against -0.4%, -0.4% and +0.96 at ratio 4.
MAX_AUTO_RATIO_ATTENTION = 4

_CONV = ("conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d", "conv_transpose2d",
         "conv_transpose3d")
_PRODUCTS = ("matmul", "bmm", "mm", "einsum")


@dataclass
class LayerWidth:
    """One layer's narrowest width in the target and in the surrogate, and its floor."""

    path: str
    kind: str  # "linear", "conv" or "attention"
    target: int
    surrogate: int
    floor: int

    @property
    def below(self) -> bool:
        return self.surrogate < self.floor

    def __str__(self) -> str:
        unit = "head dim" if self.kind == "attention" else "width"
        return (f"'{self.path}' ({self.kind}): {unit} {self.target} -> {self.surrogate}, "
                f"floor {self.floor}")


@dataclass
class AutoChoice:
    """What ``ratio="auto"`` chose and why no larger ratio."""

    ratio: int
    layers: list[LayerWidth] = field(default_factory=list)
    reason: str = ""

    def __str__(self) -> str:
        return f"ratio 'auto' chose {self.ratio}: {self.reason}"


def check_ratio(ratio: Any) -> None:
    """Accept ``"auto"`` or a positive integer; anything else is a :class:`ScaleError`."""
    if ratio == "auto" and isinstance(ratio, str):
        return
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ScaleError(f"ratio must be a positive integer (1, 2, 4, 8...) or 'auto', got "
                         f"{ratio!r}")


def layer_widths(plan: WidthPlan, floors: dict[str, int] | None = None) -> list[LayerWidth]:
    """Every layer whose width shrinks at ``plan.ratio`` or follows the width, with its floor.

    Parameters of two or more dimensions (weights, kernels, embeddings) are the layers; a
    weight any convolution uses is ``conv``, every other is ``linear``. Attention is each
    ``scaled_dot_product_attention`` (its query's last dimension) and each product of two
    activations contracting a width (``q @ k.transpose(-2, -1)`` written out).
    """
    floors = FLOORS if floors is None else floors
    rows: dict[tuple[str, str], LayerWidth] = {}
    params = {id(p) for p in plan.root.parameters()}
    graphs = getattr(plan.root, "graphs", {})
    gains = {g for _, g, _ in weight_norm.gain_pairs(graphs)}  # a scale of its layer, not one
    for key, syms in plan.param_syms.items():
        if key not in params or len(syms) < 2 or key in plan.tables:
            continue  # a table read by index (relative-position bias) is not a layer
        if plan.tensor_names[key][0] in gains:
            continue
        dims = [s for s in syms if plan.is_width(s)]
        if not dims:
            continue
        uses = plan.uses.get(key, [])
        kind = "conv" if any(op_name(u.node) in _CONV for u in uses) else "linear"
        narrow = min(dims, key=plan.new_dim)
        name = plan.tensor_names[key][0]
        path = weight_norm.layer_path(name)
        rows.setdefault((path, kind), _row(path, kind, plan.sizes[narrow], plan.new_dim(narrow),
                                           floors))
    used = {u.node for us in plan.uses.values() for u in us}
    for node in plan.node_syms:
        if node.op != "call_function" or node in used:
            continue
        d = _head_dim(node, plan)
        if d is None or not plan.is_width(d) and not _heads_shrink(node, plan):
            continue
        owner = module_of(node)
        path = owner[0] if owner and owner[0] else node.name
        rows.setdefault((path, "attention"), _row(path, "attention", plan.sizes[d],
                                                  plan.new_dim(d), floors))
    return list(rows.values())


def _row(path: str, kind: str, target: int, surrogate: int, floors: dict[str, int]) -> LayerWidth:
    # a layer already narrower than the floor in the target may stay as it is, not shrink
    return LayerWidth(path, kind, target, surrogate, min(floors[kind], target))


def _head_dim(node: torch.fx.Node, plan: WidthPlan) -> int | None:
    """The symbol of the head dim an attention op contracts, if ``node`` is one."""
    name = op_name(node)
    if name == "scaled_dot_product_attention":
        q = plan.node_syms.get(bound(node).get("query"))
        return q[-1] if isinstance(q, TensorSyms) else None
    if name in ("matmul", "bmm") and len(node.args) == 2:
        a = plan.node_syms.get(node.args[0])
        if isinstance(a, TensorSyms) and len(a) >= 3:  # batched: heads, not a plain layer
            return a[-1]
    return None


def _heads_shrink(node: torch.fx.Node, plan: WidthPlan) -> bool:
    """An attention op whose head count is width (its head dim kept, so still at a floor)."""
    q = plan.node_syms.get(bound(node).get("query")) if op_name(node) == \
        "scaled_dot_product_attention" else None
    return isinstance(q, TensorSyms) and len(q) >= 3 and plan.is_width(q[-3])


def bounding(layers: list[LayerWidth]) -> LayerWidth | None:
    """The layer closest to its floor (the first to cross it as the ratio grows)."""
    return min(layers, key=lambda lw: lw.surrogate / lw.floor, default=None)


def warn_below(plan: WidthPlan, stacklevel: int = 3) -> list[LayerWidth]:
    """Warn (:class:`hydro.errors.HydroWarning`) naming the layers ``plan`` takes below their
    floor; returns them."""
    below = [lw for lw in layer_widths(plan) if lw.below]
    if below:
        shown = "; ".join(str(lw) for lw in below[:4])
        more = f" (and {len(below) - 4} more)" if len(below) > 4 else ""
        warnings.warn(HydroWarning(
            f"ratio {plan.ratio} takes {len(below)} layer(s) below the width at which the best "
            f"learning rate was measured to transfer: {shown}{more}. The surrogate's optimum may "
            "not be the model's; use a smaller ratio, or ratio='auto' to pick the largest safe "
            "one (docs/explanation/transfer.md, 'Width floor')."
        ), stacklevel=stacklevel)
    return below


def choose(
    root: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    example_kwargs: dict[str, Any],
    head_policy: HeadPolicy = "keep_head_dim",
    max_ratio: int = MAX_AUTO_RATIO,
) -> tuple[AutoChoice, WidthPlan]:
    """The largest power-of-two ratio that Hydro can scale ``root`` by with every layer at or
    above its floor, and its width plan. Ratio 1 when even 2 is too much.

    ``root`` is a captured model (:func:`hydro.fx.capture.capture`); the analysis runs once and
    each candidate ratio is only solved.
    """
    a = analysis(root, example_inputs, example_kwargs)
    ratio, reason = max_ratio, f"{max_ratio} is the largest ratio 'auto' tries"
    while ratio > 1:
        try:
            plan = _solve(a, ratio, head_policy)
        except ScaleError as exc:
            reason = f"ratio {ratio} cannot be built ({str(exc).split('. ')[0]})"
            ratio //= 2
            continue
        layers = layer_widths(plan)
        below = [lw for lw in layers if lw.below]
        attention = [lw for lw in layers if lw.kind == "attention"]
        if attention and ratio > MAX_AUTO_RATIO_ATTENTION:
            reason = (
                f"ratio {ratio} is above {MAX_AUTO_RATIO_ATTENTION}, the largest 'auto' "
                f"takes for a model with attention ('{attention[0].path}')"
            )
            ratio //= 2
            continue
        if not below:
            return AutoChoice(ratio, layers, reason), plan
        worst = min(below, key=lambda lw: lw.surrogate / lw.floor)
        reason = f"ratio {ratio} would take {worst} ({len(below)} layer(s) below floor)"
        ratio //= 2
    plan = _solve(a, 1, head_policy)
    return AutoChoice(1, layer_widths(plan), reason), plan


def task_ratio(task: Any, ratio: Any) -> int:
    """The ratio a study of ``task`` (a :class:`hydro.Task`) trains its surrogates at.

    An integer is returned as is; ``"auto"`` is chosen (:func:`choose`) on the model the task
    builds with its default arguments, captured on the same example inputs as a group would be.
    """
    check_ratio(ratio)
    if ratio != "auto":
        return ratio
    model, root, args, kwargs = _captured(task)
    choice, _ = choose(root, args, kwargs)
    warn_if_full(choice, type(model).__name__)
    return choice.ratio


def task_below_floor(task: Any, ratio: int, head_policy: HeadPolicy = "keep_head_dim"
                     ) -> list[LayerWidth]:
    """The layers a study of ``task`` at ``ratio`` takes below their width floor (empty at
    ratio 1 or where every layer stays at or above it), on the model the task builds with its
    default arguments: what the study's export and report say of its choice."""
    check_ratio(ratio)
    if ratio == 1:
        return []
    _, root, args, kwargs = _captured(task)
    plan = _solve(analysis(root, args, kwargs), ratio, head_policy)
    return [lw for lw in layer_widths(plan) if lw.below]


def _captured(task: Any) -> tuple[torch.nn.Module, torch.nn.Module, tuple, dict]:
    """The task's default model, its capture (through the task's capture cache) and the example
    inputs a group captures it on."""
    from hydro.fx import cache as _cache
    from hydro.fx.capture import capture

    model = task.build_model()
    if hasattr(task, "example"):  # your own training loop: its example inputs
        args, kwargs = task.example()
    elif task.example_inputs is not None:
        args, kwargs = tuple(task.example_inputs), {}
    else:
        args, kwargs, _ = task.split(next(task.train_batches(2, seed=0)))
    return model, capture(model, args, kwargs, cache=_cache.for_task(task)), args, kwargs


def warn_if_full(choice: AutoChoice, model_name: str) -> None:
    """Ratio 1 means the surrogate is the model: say so, since no time is saved."""
    if choice.ratio == 1:
        warnings.warn(HydroWarning(
            f"ratio='auto' chose 1 for {model_name}: the surrogate is the model itself, because "
            f"{choice.reason}"), stacklevel=4)


__all__ = ["FLOORS", "MAX_AUTO_RATIO", "MAX_AUTO_RATIO_ATTENTION", "AutoChoice", "LayerWidth",
           "bounding", "check_ratio", "choose", "layer_widths", "task_below_floor", "task_ratio",
           "warn_below"]

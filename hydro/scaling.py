"""``hydro.scale``: a captured model rebuilt with every hidden width divided by ``ratio``.

The pipeline is capture (:mod:`hydro.fx.capture`: run the model on example inputs) → width
analysis (:mod:`hydro.fx.widths`, solved by :mod:`hydro.fx.solve`) → rebuild (this module: a
pure pass over the captured graphs that makes new, smaller parameters and buffers and rewrites
width-valued literals) → muP parametrization (:mod:`hydro.parametrize`) → a check that
re-propagates shapes on fake tensors and compares every node with the analysis.
"""

from __future__ import annotations

import copy
import inspect as pyinspect
import operator
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx
from torch import nn

import hydro.parametrize as parametrize
from hydro.errors import HydroWarning, ScaleError, TraceError
from hydro.fx import cache as _cache
from hydro.fx import depth, floor, indexing, modules, pins
from hydro.fx.capture import Captured, Dynamic, capture, copy_captured
from hydro.fx.depth import DepthPlan
from hydro.fx.rules import rotary
from hydro.fx.rules.common import TensorSyms, bound, is_int, set_arg
from hydro.fx.rules.shape import SIZE_ARG
from hydro.fx.solve import analyze, fake_run
from hydro.fx.widths import HeadPolicy, WidthPlan, describe, op_name, propagate


def scale(
    model: nn.Module,
    ratio: int | Literal["auto"] = 8,
    *,
    example_inputs: tuple[Any, ...] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    head_policy: HeadPolicy = "keep_head_dim",
    output_mult: float = 1.0,
    seed: int | None = None,
    parametrization: Literal["mup", "sp"] = "mup",
    depth_ratio: int = 1,
    depth_alpha: float = 1.0,
    dynamic: Dynamic = None,
) -> Captured:
    """Build a muP surrogate of ``model`` with every hidden width divided by ``ratio``.

    The model is captured by running it once per mode (train, eval) on the example inputs, so
    any Python it contains (shape asserts, dtype checks, optional arguments) runs as usual.

    Args:
        model: the target model (an ``nn.Module`` instance, initialized the way you train it:
            the surrogate's initialization is derived from its per-parameter statistics). It may
            live on the ``meta`` device (a large target then costs no memory).
        ratio: the width divisor; ``ratio=1`` gives the model itself in standard parametrization.
            ``"auto"`` picks the largest power of two (up to 64; up to 4 for a model with
            attention) that keeps every layer at or above its measured width floor
            (:mod:`hydro.fx.floor`; the choice and the layer
            that bounds it are in ``sur.hydro.ratio`` and ``sur.hydro.auto``). An explicit
            ratio that takes a layer below its floor warns (``HydroWarning``) naming it.
        example_inputs: positional inputs of one call, batch in dimension 0 (a batch of 2 is
            plenty). Optional when the model takes one input that feeds a Linear, Conv or
            Embedding layer, from which Hydro makes its own.
        example_kwargs: keyword inputs of that call (``input_ids=``, ``labels=``...).
        head_policy: how attention heads shrink: ``"keep_head_dim"`` (default: fewer heads of
            the same size; when ``ratio`` does not divide the head count, the head count is
            kept and each head shrinks, with the muP ``1/d`` attention scale) or
            ``"keep_head_count"``. :func:`hydro.inspect` says which was chosen.
        output_mult: the muP output multiplier (a tunable hyperparameter; 1 means "as the
            target").
        seed: seed for the surrogate's initialization; ``None`` draws from torch's global RNG.
        parametrization: ``"mup"`` (default); ``"sp"`` builds the *naively* width-scaled model
            instead (standard parametrization at the new width), for comparisons such as coord
            checks.
        depth_ratio: keep every ``depth_ratio``-th block of each stack of repeated residual
            blocks (``nn.ModuleList``/``nn.Sequential`` of identically shaped blocks, confirmed
            in the captured graph), at least one per stack; 1 (default) keeps every block.
            ``sur.hydro.stacks`` and :func:`hydro.inspect` say which blocks are kept and which
            stacks are left whole, and why.
        depth_alpha: the depth parametrization: each kept block's residual branches are
            multiplied by ``(L_target / L_surrogate) ** depth_alpha``; 1 (default) is CompleteP,
            0.5 Depth-muP (which also scales the blocks' Adam learning rates, see
            :mod:`hydro.parametrize`).
        dynamic: dimensions besides the batch that stay dynamic, so that the surrogate trains
            at one size and evaluates at another. ``None`` (default): the batch only.
            ``"auto"``: the sequence length (dimension 1 of integer inputs such as token ids)
            where the model allows it (capture takes ~1.5x as long); ``{"seq": 1}``: dimension
            1 of every input of rank >= 2 (an error where the model fixes it);
            ``{"input_ids": {1: "seq"}}``: per input. See :func:`hydro.fx.capture.capture`.

    Returns:
        A :class:`hydro.fx.capture.Captured` module called exactly like ``model`` (same
        arguments, same output type), with the target's ``state_dict`` keys, parameters that
        carry the ``mup`` package's ``infshape`` (so ``mup.MuAdam(sur.parameters())`` works)
        and a ``hydro`` attribute describing the scaling
        (:class:`hydro.parametrize.SurrogateInfo`).

    Raises:
        TraceError: the model cannot be captured (naming module, file, line and what to do).
        ScaleError: ``depth_ratio`` is not a positive integer, ``depth_alpha`` not in [0, 1].
        ScaleError: a width ``ratio`` does not divide, a head split that cannot shrink, an op
            over parameters with no width rule, a literal Hydro cannot rewrite.

    Example:
        >>> import torch, hydro
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(),
        ...                             torch.nn.Linear(256, 256), torch.nn.ReLU(),
        ...                             torch.nn.Linear(256, 10))
        >>> sur = hydro.scale(model, ratio=8, example_inputs=(torch.randn(2, 16),))
        >>> [tuple(p.shape) for p in sur.parameters()][:3]
        [(32, 16), (32,), (32, 32)]
        >>> sur(torch.randn(4, 16)).shape
        torch.Size([4, 10])
    """
    scaled = build(
        model, ratio, example_inputs=example_inputs, example_kwargs=example_kwargs,
        head_policy=head_policy, output_mult=output_mult, seed=seed,
        parametrization=parametrization, depth_ratio=depth_ratio, depth_alpha=depth_alpha,
        dynamic=dynamic,
    )
    d = scaled.depth
    cut = d is not None and d.depth_ratio > 1 and bool(d.stacks)
    if ratio != "auto" and ratio > 1 and not scaled.plan.width and not cut:
        # (hydro.tune says so in its own words: FusedGroup builds through build(), not here)
        warnings.warn(HydroWarning(
            f"scale(ratio={ratio}): every width of {type(model).__name__} is fixed by its "
            "inputs or outputs (input features, classes, vocabulary), so no width is cut and "
            "the surrogate costs what the model does; scale a model with hidden layers"
        ), stacklevel=2)
    return scaled.surrogate


@dataclass
class Scaled:
    """A surrogate with the analysis behind it (what :func:`hydro.inspect` reports on)."""

    surrogate: Captured
    plan: WidthPlan
    node_map: dict[torch.fx.Node, torch.fx.Node]
    inputs: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: nn.Module
    captured: Captured
    _stats: dict = field(default_factory=dict, repr=False)
    depth: DepthPlan | None = None

    def sample(
        self,
        seed: int | None = None,
        edit: Callable[[str, torch.fx.Graph], None] | None = None,
        graphs: dict[str, torch.fx.GraphModule] | None = None,
    ) -> Captured:
        """Another surrogate with the same graphs, independently initialized from ``seed``.

        Much cheaper than :func:`scale` again: no capture, analysis or shape check. ``edit``
        (``edit(mode, graph)``) changes the copied graphs. ``graphs``: graph modules (copies
        of this surrogate's) that the new one holds for some modes instead of copies, shared
        (:func:`hydro.fx.capture.copy_captured`).
        """
        sur = copy_captured(self.surrogate, edit, graphs=graphs)
        originals = dict(self.surrogate.named_parameters())
        for name, p in sur.named_parameters():
            if hasattr(originals[name], "infshape"):
                p.infshape = originals[name].infshape
        parametrize.redraw(sur, self.target, seed, self._stats)
        return sur


def build(
    model: nn.Module,
    ratio: int | Literal["auto"] = 8,
    *,
    example_inputs: tuple[Any, ...] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    head_policy: HeadPolicy = "keep_head_dim",
    output_mult: float = 1.0,
    seed: int | None = None,
    parametrization: Literal["mup", "sp"] = "mup",
    always_readout: bool = False,
    depth_ratio: int = 1,
    depth_alpha: float = 1.0,
    dynamic: Dynamic = None,
    cache: bool | None = None,
) -> Scaled:
    """:func:`scale`, returning the width plan and node map along with the surrogate.

    ``always_readout`` inserts the readout multiplier even where it is 1 (ratio 1), so that
    its value can be set per trial (the ``output_mult`` hyperparameter). ``cache``: the
    capture cache (:func:`hydro.fx.capture.capture`'s).
    """
    floor.check_ratio(ratio)
    if parametrization not in ("mup", "sp"):
        raise ScaleError(f"parametrization must be 'mup' or 'sp', got {parametrization!r}")
    depth.check_args(depth_ratio, depth_alpha)
    if next(iter(model.parameters()), None) is None:
        raise ScaleError(
            f"{type(model).__name__} has no parameters: there is no width to cut and nothing "
            "to train; scale the model that holds the layers (nn.Linear, nn.Conv2d, ...)"
        )
    kwargs = dict(example_kwargs or {})
    if example_inputs is None and not kwargs:
        inputs = guess_inputs(model)
    else:
        inputs = tuple(example_inputs or ())
    on_meta = any(p.is_meta for p in model.parameters())
    run_inputs, run_kwargs = (_to_meta(inputs), _to_meta(kwargs)) if on_meta else (inputs, kwargs)
    if isinstance(model, Captured):
        cap = model
    else:
        try:
            cap = capture(model, run_inputs, run_kwargs, dynamic=dynamic, cache=cache)
        except TraceError as exc:
            if example_inputs is None and not kwargs:
                raise ScaleError(
                    f"Hydro guessed example inputs for {type(model).__name__} "
                    f"({', '.join(str(tuple(x.shape)) for x in inputs)}) but the model does not "
                    "run on them; pass example_inputs=(x, ...) shaped like a real batch"
                ) from exc
            raise
    # the fake runs of the analysis and of the shape check, replayed from the capture cache
    # where it holds them for these programs, inputs and options (a Captured passed in may
    # have been edited since its capture: never keyed)
    akey = None
    if ratio != "auto" and not isinstance(model, Captured) and _cache.enabled(cache):
        options = {"ratio": ratio, "head_policy": head_policy, "output_mult": output_mult,
                   "parametrization": parametrization, "always_readout": always_readout,
                   "depth_ratio": depth_ratio, "depth_alpha": depth_alpha,
                   "on_meta": on_meta}
        akey = _cache.analysis_key(cap, run_inputs, run_kwargs, options)
    cap, depth_plan = depth.cut(cap, model, depth_ratio, depth_alpha)
    if parametrization == "mup":
        depth.warn_deep_cut(depth_plan, stacklevel=4)
    depth.warn_no_cut(depth_plan, model, stacklevel=4)
    stored = None
    if ratio == "auto":  # the largest ratio that keeps every width above its floor
        auto, plan = floor.choose(cap, run_inputs, run_kwargs, head_policy)
        floor.warn_if_full(auto, type(model).__name__)
    else:
        stored = _cache.load_analysis(akey, cap) if akey else None
        values = stored if stored is not None else fake_run(cap, run_inputs, run_kwargs)
        plan = analyze(cap, run_inputs, run_kwargs, ratio, head_policy=head_policy,
                       values=values)
        auto = None
        if parametrization == "mup":  # a naive (sp) model is not meant to transfer anyway
            floor.warn_below(plan, stacklevel=4)
    pins.warn_pinned(plan, stacklevel=4)
    sur, node_map, new_tensors = _rebuild(cap, plan, model)
    info = parametrize.apply(
        sur, model, plan, node_map, new_tensors, output_mult=output_mult, seed=seed,
        standard=parametrization == "sp", always_readout=always_readout,
    )
    _apply_depth(sur, depth_plan, node_map, info, standard=parametrization == "sp")
    removed = [b for st in depth_plan.stacks if st.cut for b in st.blocks if b not in st.kept]
    modules.adopt(sur, model, removed, plan)  # the user's classes and names, scaled widths
    if stored is None:  # an entry is written only once a surrogate from it passed this check
        _check(sur, plan, node_map, inputs, kwargs)
        if akey:
            _cache.store_analysis(akey, cap, values)
    sur.hydro = info
    device = next((p.device for p in model.parameters() if not p.is_meta), None)
    if device is not None and device.type != "cpu":
        sur.to(device)  # keeps the Parameter objects, and so their infshapes
    sur.hydro.auto = auto
    return Scaled(sur, plan, node_map, inputs, kwargs, model, cap, depth=depth_plan)


def _apply_depth(
    sur: Captured,
    plan: DepthPlan,
    node_map: dict[torch.fx.Node, torch.fx.Node],
    info: parametrize.SurrogateInfo,
    standard: bool = False,
) -> None:
    """Record the depth cut on ``sur.hydro``; parametrize it (unless ``standard``: the naive
    shallow model, blocks dropped and nothing else)."""
    info.depth_ratio, info.depth_alpha = plan.depth_ratio, plan.alpha
    info.stacks = plan.stacks
    if standard:
        return
    info.depth_multipliers = depth.insert_multipliers(sur, plan, node_map)
    parametrize.set_depth_lr(sur, plan)


def _to_meta(x: Any) -> Any:
    return torch.utils._pytree.tree_map(
        lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, x)


_FIRST_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)


def guess_inputs(model: nn.Module) -> tuple[torch.Tensor, ...]:
    """Example inputs for a model with one input that feeds a Linear, Conv or Embedding layer
    (the first such layer it registers says the shape)."""
    params = pyinspect.signature(model.forward).parameters.values()
    required = [p for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    first = next((m for m in model.modules() if isinstance(m, _FIRST_LAYERS)), None)
    if len(required) != 1 or first is None:
        raise ScaleError(
            f"cannot guess the inputs of {type(model).__name__} (forward takes "
            f"{len(required)} required inputs); pass example_inputs=(x, ...) and/or "
            "example_kwargs={...} with tensors shaped like a real batch"
        )
    if isinstance(first, nn.Linear):
        return (torch.zeros(2, first.in_features),)
    if isinstance(first, nn.Embedding):
        return (torch.zeros(2, 8, dtype=torch.long),)
    nd = len(first.kernel_size)
    side = max(16, *(k * 2 for k in first.kernel_size))
    return (torch.zeros(2, first.in_channels, *([side] * nd)),)


# --- rebuilding: new tensors, copied graphs, rewritten literals -----------------------------------


def _rebuild(
    cap: Captured, plan: WidthPlan, model: nn.Module
) -> tuple[Captured, dict[torch.fx.Node, torch.fx.Node], dict[int, torch.Tensor]]:
    """The surrogate, the map from target nodes to its nodes, and from each target tensor's id
    to its surrogate tensor (tied tensors stay tied)."""
    new_tensors: dict[int, torch.Tensor] = {}
    holder = nn.Module()
    persistent = set(cap.state_dict())
    for name, t in cap.named_parameters(remove_duplicate=False):
        _put(holder, name, _new_tensor(t, plan, new_tensors), "param")
    for name, t in cap.named_buffers(remove_duplicate=False):
        _put(holder, name, _new_tensor(t, plan, new_tensors), "buffer", name in persistent)
    node_map: dict[torch.fx.Node, torch.fx.Node] = {}
    subs: dict[str, torch.fx.GraphModule] = {}
    graphs = {}
    for mode, gm in cap.graphs.items():
        graph = _copy(gm.graph, node_map)
        for node in gm.graph.nodes:
            if node.op == "get_attr" and isinstance(getattr(cap, node.target, None),
                                                    torch.fx.GraphModule):
                sub = getattr(cap, node.target)
                sub_graph = _copy(sub.graph, node_map)
                subs[node.target] = torch.fx.GraphModule(sub, sub_graph, type(sub).__name__)
        new_gm = torch.fx.GraphModule(nn.Module(), torch.fx.Graph(), type(gm).__name__)
        new_gm.graph = graph
        new_gm._in_spec, new_gm._out_spec = gm._in_spec, gm._out_spec
        graphs[mode] = new_gm
    plan.int_rewrites = {}
    for old, new in node_map.items():
        if old.op == "call_function":
            _rewrite_literals(old, new, plan)
    for old, k in plan.int_rewrites.items():
        node_map[old].update_arg(1, k)
    for old, (i, value) in plan.literal_rewrites.items():  # muP attention scales (widths.py)
        node_map[old].update_arg(i, value)
    for sub in subs.values():
        sub.recompile()
    for name, sub in subs.items():
        for gm in graphs.values():
            if any(n.op == "get_attr" and n.target == name for n in gm.graph.nodes):
                gm.add_submodule(name, sub)
    for gm in graphs.values():
        gm.recompile()
    non_persistent = {
        n for n, _ in cap.named_buffers(remove_duplicate=False) if n not in persistent
    }
    sur = Captured(graphs, f"{cap.captured_name}Surrogate", state=holder,
                   non_persistent=non_persistent)
    sur.train(model.training)
    return sur, node_map, new_tensors


def _copy(graph: torch.fx.Graph, node_map: dict) -> torch.fx.Graph:
    new = torch.fx.Graph()
    new._codegen = copy.deepcopy(graph._codegen)  # the pytree calling convention
    local: dict[torch.fx.Node, torch.fx.Node] = {}
    out = new.graph_copy(graph, local)
    new.output(out)
    for old, node in local.items():
        node.meta = dict(old.meta)
    node_map.update(local)
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    node_map[out_node] = next(n for n in reversed(new.nodes) if n.op == "output")
    return new


def _put(root: nn.Module, path: str, value: torch.Tensor, kind: str, persistent=True) -> None:
    *parents, leaf = path.split(".")
    mod = root
    for part in parents:
        if part not in mod._modules:
            mod.add_module(part, nn.Module())
        mod = mod._modules[part]
    if kind == "param":
        mod.register_parameter(leaf, value)
    else:
        mod.register_buffer(leaf, value, persistent=persistent)


def _new_tensor(t: torch.Tensor, plan: WidthPlan, cache: dict[int, torch.Tensor]) -> torch.Tensor:
    """The surrogate's version of a target parameter or buffer."""
    if id(t) in cache:
        return cache[id(t)]
    old_shape, new_shape = plan.param_shape(t) if id(t) in plan.param_syms else (t.shape,) * 2
    device = "cpu" if t.is_meta else t.device
    if id(t) in plan.structured:  # values of a rule (a sinusoid, a sequence): rebuilt, not cut
        new = plan.structured[id(t)].build(tuple(new_shape), t.dtype).to(device)
        if isinstance(t, nn.Parameter):
            new = nn.Parameter(new, requires_grad=t.requires_grad)
    elif isinstance(t, nn.Parameter):
        new = nn.Parameter(torch.empty(new_shape, dtype=t.dtype, device=device),
                           requires_grad=t.requires_grad)
    elif tuple(old_shape) == tuple(new_shape):
        new = t.detach().clone()
    elif id(t) in plan.rotary:  # frequencies of the surrogate's own head dim, same base
        table = plan.rotary[id(t)]
        new = rotary.table(table.new_head_dim, table.base, t.dtype).to(device)
    else:
        # a width-shaped buffer (running statistics): its leading entries along shrunk dims
        new = t.detach()[tuple(slice(0, n) for n in new_shape)].clone()
    cache[id(t)] = new
    return new


def _rewrite_literals(old: torch.fx.Node, new: torch.fx.Node, plan: WidthPlan) -> None:
    """Rewrite width-valued literals of one node (sizes of views, splits, norms, aranges...)."""
    for key, value in new.kwargs.items():
        if isinstance(value, torch.device) and value.type == "meta":
            new.update_kwarg(key, torch.device("cpu"))  # captured on a meta target
    name = op_name(old)
    syms = plan.node_syms.get(old)
    b, nb = bound(old), bound(new)  # old nodes key the plan; the copy's args are written back
    if name in SIZE_ARG and isinstance(syms, TensorSyms):
        key = SIZE_ARG[name]
        sizes = nb.get(key)
        want = plan.new_shape(syms)
        if isinstance(sizes, (list, tuple)) and len(sizes) == len(want):
            fixed = [w if is_int(s) and s != -1 else s for s, w in zip(sizes, want)]
            if fixed != list(sizes):
                set_arg(new, key, fixed)
            for s, w in zip(b.get(key), want):
                if isinstance(s, torch.fx.Node):
                    _rewrite_int(s, w, plan)
    elif name == "unflatten" and isinstance(syms, TensorSyms):
        dim = b["dim"] % len(plan.node_syms[b["self"]])
        sizes = list(nb["sizes"])
        want = plan.new_shape(syms)[dim : dim + len(sizes)]
        set_arg(new, "sizes", [w if is_int(s) and s != -1 else s for s, w in zip(sizes, want)])
    elif name in ("split", "split_with_sizes") and isinstance(syms, (tuple, list)):
        x = plan.node_syms[b["self"]]
        dim = b.get("dim", 0) % len(x)
        parts = [plan.new_shape(s)[dim] for s in syms]
        if name == "split" and is_int(b["split_size"]):
            set_arg(new, "split_size", parts[0])
        elif name == "split_with_sizes":
            set_arg(new, "split_sizes", parts)
    elif name in ("slice", "narrow") and isinstance(syms, TensorSyms):
        _rewrite_slice(old, new, plan, b, name)
    elif name in ("layer_norm", "rms_norm"):
        x = plan.new_shape(plan.node_syms[b["input"]])
        k = len(b["normalized_shape"])
        set_arg(new, "normalized_shape", list(x[len(x) - k :]))
    elif name == "group_norm":
        x = plan.node_syms[b["input"]]
        c_old, c_new = plan.sizes[x[1]], plan.new_dim(x[1])
        groups = b["num_groups"]
        if c_new != c_old and c_new % groups:
            per = c_old // groups
            if c_new % per:
                raise ScaleError(
                    f"{describe(old)}: GroupNorm({groups}, {c_old}) cannot shrink to {c_new} "
                    f"channels: neither {groups} groups nor {per} channels per group divides "
                    "it; choose a ratio that keeps one of them whole"
                )
            set_arg(new, "num_groups", c_new // per)
    elif name == "arange" and isinstance(syms, TensorSyms):
        length = plan.new_dim(syms[0])
        if length != plan.sizes[syms[0]] and is_int(b.get("end")):
            start, step = b.get("start", 0) or 0, b.get("step", 1) or 1
            if is_int(start) and is_int(step):
                set_arg(new, "end", start + length * step)
    elif name in ("conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d",
                  "conv_transpose2d", "conv_transpose3d"):
        x = plan.node_syms[b["input"]]
        if b.get("groups", 1) > 1 and b["groups"] == plan.sizes[x[1]]:  # depthwise
            set_arg(new, "groups", plan.new_dim(x[1]))
        elif b.get("groups", 1) > 1:
            w = plan.node_syms[b["weight"]]
            per = plan.new_dim(w[0] if "transpose" in name else w[1])
            set_arg(new, "groups", plan.new_dim(x[1]) // per)
    elif name == "scaled_dot_product_attention":
        q = plan.node_syms[b["query"]]
        d_old, d_new = plan.sizes[q[-1]], plan.new_dim(q[-1])
        if d_old != d_new:
            base = b.get("scale") or d_old**-0.5
            if isinstance(base, torch.fx.Node):
                raise ScaleError(f"{describe(old)}: a computed attention scale cannot be "
                                 "corrected for a smaller head dim; use a ratio that divides "
                                 "the head count")
            new.update_kwarg("scale", base * d_old / d_new)  # muP 1/d, relative to the target


def _rewrite_int(node: torch.fx.Node, want: int, plan: WidthPlan) -> None:
    """Make a size computed as ``batch * k`` (a literal ``k``) evaluate to ``want``; in a chain
    ``batch * k1 * k2`` (MobileViT's unfold: ``B * C * patches``) the outermost literal whose
    scaled value is whole, else an inner one no other size reads (the channels' ``C`` where the
    patch count cannot shrink)."""
    chain = []  # (mul node, its literal), outermost first
    x = node
    while isinstance(x, torch.fx.Node) and x.target is operator.mul and len(x.args) == 2:
        if not is_int(x.args[1]):
            break
        chain.append((x, x.args[1]))
        x = x.args[0]
    got = plan.values.get(node)
    xv = plan.values.get(x) if isinstance(x, torch.fx.Node) else None
    if not chain or not is_int(xv) or not is_int(got) or got == want or not xv or want % xv:
        return
    old_total, new_total = got // xv, want // xv
    # the outermost literal where it scales to a whole number (it is this size's alone); an
    # inner one only where no other size reads its product
    fits = [(k, m) for i, (m, k) in enumerate(chain)
            if (k * new_total) % old_total == 0 and (i == 0 or len(m.users) == 1)]
    if fits:
        k, m = fits[0]
        plan.int_rewrites[m] = k * new_total // old_total


def _rewrite_slice(old, new, plan: WidthPlan, b: dict, name: str) -> None:
    x = plan.node_syms[b["self"]]
    dim = b.get("dim", 0) % len(x)
    whole, new_whole = plan.sizes[x[dim]], plan.new_dim(x[dim])
    if whole == new_whole:
        return
    part_new = plan.new_dim(plan.node_syms[old][dim])

    def scaled(v: Any) -> Any:
        if not is_int(v) or v >= whole:
            return v
        v = v + whole if v < 0 else v
        if (v * new_whole) % whole:
            raise ScaleError(f"{describe(old)}: a slice at {v} of {whole} does not scale to a "
                             f"whole index at width {new_whole}")
        return v * new_whole // whole

    if name == "narrow":
        set_arg(new, "start", scaled(b["start"]))
        set_arg(new, "length", part_new)
        return
    start = scaled(b.get("start") or 0)
    set_arg(new, "start", start)
    end = b.get("end")
    if is_int(end) and end < whole:
        set_arg(new, "end", scaled(end))


# --- the final check -----------------------------------------------------------------------------


def _check(
    sur: Captured,
    plan: WidthPlan,
    node_map: dict[torch.fx.Node, torch.fx.Node],
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Re-propagate shapes through the surrogate's graphs and compare each node with the plan."""
    values: dict[torch.fx.Node, Any] = {}
    for gm in sur.graphs.values():
        try:
            values.update(propagate(sur, gm, inputs, kwargs))
        except Exception as exc:
            failing = getattr(exc, "hydro_node", None)
            where = describe(failing) if failing is not None else "the surrogate"
            raise ScaleError(
                f"the scaled model fails at {where} at ratio {plan.ratio}: "
                f"{str(exc).strip().splitlines()[0]}. A width-valued number is probably "
                "computed in a way Hydro cannot rewrite; read it from a tensor size "
                "(x.size(-1)) or a module attribute instead of hard-coding it."
            ) from exc
    by_new = {new: old for old, new in node_map.items()}
    broken = indexing.out_of_range(sur, values, by_new.get, indexing.sym_size(plan))
    if broken is not None:
        raise ScaleError(f"{describe(broken[0])} {broken[1]} at ratio {plan.ratio}. Report this "
                         "model: width analysis should have kept that table whole")
    for new, value in values.items():
        old = by_new.get(new)
        syms = plan.node_syms.get(old) if old is not None else None
        if not isinstance(syms, TensorSyms) or not isinstance(value, torch.Tensor):
            continue
        got, want = tuple(value.shape), plan.new_shape(syms)
        if got != want:
            raise ScaleError(
                f"{describe(old)} produces shape {got} at ratio {plan.ratio}, but width analysis "
                f"expects {want}: a width-valued number there is computed in a way Hydro cannot "
                "rewrite. Read it from a tensor size (x.size(-1)) instead of hard-coding it."
            )


__all__ = ["Scaled", "build", "guess_inputs", "scale"]

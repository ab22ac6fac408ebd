"""``hydro.scale``: rebuild a traced model with every hidden width divided by ``ratio``.

The pipeline is trace (:mod:`hydro.fx.trace`) → width analysis (:mod:`hydro.fx.widths`) → rebuild
(this module: new layers, new raw parameters, width-valued literals rewritten) → muP
parametrization (:mod:`hydro.parametrize`) → a check that re-propagates shapes on fake tensors and
compares every node with the analysis.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx
from torch import nn

from hydro import parametrize
from hydro.errors import ScaleError
from hydro.fx.paths import get_path, has_path
from hydro.fx.shapes import propagate
from hydro.fx.trace import trace
from hydro.fx.widths import (
    _CONV_TRANSPOSES,
    _CONVS,
    HeadPolicy,
    WidthPlan,
    _size_args,
    _TensorSyms,
    analyze,
    describe,
    node_arg,
    op_name,
)


def scale(
    model: nn.Module,
    ratio: int = 8,
    *,
    example_inputs: tuple[Any, ...] | None = None,
    head_policy: HeadPolicy = "keep_head_dim",
    output_mult: float = 1.0,
    leaf_modules: Iterable[type[nn.Module]] = (),
    seed: int | None = None,
    parametrization: Literal["mup", "sp"] = "mup",
) -> torch.fx.GraphModule:
    """Build a muP surrogate of ``model`` with every hidden width divided by ``ratio``.

    Args:
        model: the target model (an ``nn.Module`` instance, initialized the way you train it:
            the surrogate's initialization is derived from its per-parameter statistics).
        ratio: the width divisor; ``ratio=1`` gives the model itself in standard parametrization.
        example_inputs: a tuple of inputs shaped like real ones (a batch of 2 is plenty); only
            shapes and dtypes are used. Optional when every input feeds a Linear, Conv or
            Embedding layer directly, from which Hydro makes its own.
        head_policy: how attention heads shrink: ``"keep_head_dim"`` (default: fewer heads of
            the same size, the attention scale is unchanged) or ``"keep_head_count"`` (same
            heads, each smaller, with the muP ``1/d`` attention scale). Either falls back to the
            other when its count does not divide.
        output_mult: the muP output multiplier (a tunable hyperparameter; 1 means "as the
            target").
        leaf_modules: extra module types to keep opaque while tracing (they must not hold
            width-carrying parameters).
        seed: seed for the surrogate's initialization; ``None`` draws from torch's global RNG.
        parametrization: ``"mup"`` (default); ``"sp"`` builds the *naively* width-scaled model
            instead (standard parametrization at the new width: every fan-in-scaled init, no
            multipliers, no learning-rate scaling), for comparisons such as coord checks.

    Returns:
        A ``torch.fx.GraphModule`` with the target's ``state_dict`` keys, whose parameters carry
        the ``mup`` package's ``infshape`` (so ``mup.MuAdam(sur.parameters())`` works) and whose
        ``hydro`` attribute describes the scaling (:class:`hydro.parametrize.SurrogateInfo`).

    Raises:
        TraceError: the model cannot be traced (naming module, source line and what to do).
        ScaleError: a width ``ratio`` does not divide, a head split that cannot shrink, a module
            with parameters and no width rule, a literal Hydro cannot rewrite.

    Example:
        >>> import torch, hydro
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(),
        ...                             torch.nn.Linear(256, 256), torch.nn.ReLU(),
        ...                             torch.nn.Linear(256, 10))
        >>> sur = hydro.scale(model, ratio=8)
        >>> [tuple(p.shape) for p in sur.parameters()][:3]
        [(32, 16), (32,), (32, 32)]
        >>> sur(torch.randn(4, 16)).shape
        torch.Size([4, 10])
    """
    return build(
        model, ratio, example_inputs=example_inputs, head_policy=head_policy,
        output_mult=output_mult, leaf_modules=leaf_modules, seed=seed,
        parametrization=parametrization,
    ).surrogate  # fmt: skip


@dataclass
class Scaled:
    """A surrogate with the analysis behind it (what :func:`hydro.inspect` reports on)."""

    surrogate: torch.fx.GraphModule
    plan: WidthPlan
    node_map: dict[torch.fx.Node, torch.fx.Node]
    inputs: tuple[Any, ...]
    target: nn.Module | None = None
    _stats: dict = field(default_factory=dict, repr=False)

    def sample(self, seed: int | None = None) -> torch.fx.GraphModule:
        """Another surrogate with the same structure, independently initialized from ``seed``.

        Much cheaper than :func:`scale` again: no tracing, analysis or shape check.
        """
        sur = _clone(self.surrogate)
        sur.hydro = self.surrogate.hydro
        originals = dict(self.surrogate.named_parameters())
        for name, p in sur.named_parameters():
            if hasattr(originals[name], "infshape"):
                p.infshape = originals[name].infshape
        parametrize.redraw(sur, self.target, seed, self._stats)
        return sur


def _clone(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A deep copy that keeps the class name and the tensors forward never reads.

    (``copy.deepcopy`` of a GraphModule renames its class and drops unreferenced tensors.)
    """
    memo: dict[int, Any] = {}
    root = nn.Module()
    for name, child in gm.named_children():
        root.add_module(name, copy.deepcopy(child, memo))
    for name, p in gm.named_parameters(recurse=False):
        root.register_parameter(name, copy.deepcopy(p, memo))
    for name, b in gm.named_buffers(recurse=False):
        root.register_buffer(name, copy.deepcopy(b, memo))
    clone = torch.fx.GraphModule(root, copy.deepcopy(gm.graph), type(gm).__name__)
    for name, _ in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers()]:
        if not has_path(clone, name):
            _set_path(clone, name, get_path(root, name))
    # the same registration order as the original: module lists compare equal
    clone._modules = {k: clone._modules[k] for k in gm._modules if k in clone._modules}
    return clone


def build(
    model: nn.Module,
    ratio: int = 8,
    *,
    example_inputs: tuple[Any, ...] | None = None,
    head_policy: HeadPolicy = "keep_head_dim",
    output_mult: float = 1.0,
    leaf_modules: Iterable[type[nn.Module]] = (),
    seed: int | None = None,
    parametrization: Literal["mup", "sp"] = "mup",
    always_readout: bool = False,
) -> Scaled:
    """:func:`scale`, returning the width plan and node map along with the surrogate.

    ``always_readout`` inserts the readout multiplier even where it is 1 (ratio 1), so that
    its ``scale`` can be set per trial (the ``output_mult`` hyperparameter).
    """
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ScaleError(f"ratio must be a positive integer (1, 2, 4, 8...), got {ratio!r}")
    if parametrization not in ("mup", "sp"):
        raise ScaleError(f"parametrization must be 'mup' or 'sp', got {parametrization!r}")
    gm = trace(model, leaf_modules=leaf_modules)
    inputs = tuple(example_inputs) if example_inputs is not None else guess_inputs(gm)
    plan = analyze(gm, inputs, ratio, head_policy=head_policy)
    sur, node_map, new_tensors = _rebuild(gm, plan, model)
    info = parametrize.apply(
        sur, gm, plan, node_map, new_tensors, output_mult=output_mult, seed=seed,
        standard=parametrization == "sp", always_readout=always_readout,
    )  # fmt: skip
    _check(sur, plan, node_map, inputs)
    sur.hydro = info
    device = next((p.device for p in model.parameters() if not p.is_meta), None)
    if device is not None and device.type != "cpu":
        sur.to(device)  # keeps the Parameter objects, and so their infshapes
    return Scaled(sur, plan, node_map, inputs, model)


def guess_inputs(gm: torch.fx.GraphModule) -> tuple[torch.Tensor, ...]:
    """Example inputs for a model whose inputs feed a Linear, Conv or Embedding directly."""
    inputs = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        # the first layer reading this input says its shape (size() calls and the like aside)
        layers = [u for u in node.users if u.op == "call_module"]
        first = layers[0] if layers else next(iter(node.users), None)
        m = gm.get_submodule(first.target) if layers else None
        if isinstance(m, nn.Linear):
            inputs.append(torch.zeros(2, m.in_features))
        elif isinstance(m, _CONVS + _CONV_TRANSPOSES):
            nd = len(m.kernel_size)
            side = max(16, *(k * 2 for k in m.kernel_size))
            inputs.append(torch.zeros(2, m.in_channels, *([side] * nd)))
        elif isinstance(m, nn.Embedding):
            inputs.append(torch.zeros(2, 8, dtype=torch.long))
        else:
            raise ScaleError(
                f"cannot guess the shape of input '{node.name}' (its first use is "
                f"{describe(first) if first is not None else 'nothing'}); pass "
                "example_inputs=(x, ...) with tensors shaped like a real batch"
            )
    return tuple(inputs)


# --- rebuilding the graph and its modules --------------------------------------------------------


def _rebuild(
    gm: torch.fx.GraphModule, plan: WidthPlan, model: nn.Module
) -> tuple[torch.fx.GraphModule, dict[torch.fx.Node, torch.fx.Node], dict[int, torch.Tensor]]:
    """The surrogate graph module, the map from target nodes to its nodes, and from each target
    tensor's id to its surrogate tensor."""
    graph = torch.fx.Graph()
    node_map: dict[torch.fx.Node, torch.fx.Node] = {}
    out = graph.graph_copy(gm.graph, node_map)
    graph.output(out)
    for old, new in node_map.items():
        if old.op in ("call_function", "call_method"):
            _rewrite_literals(old, new, plan, node_map)
            _attention_scale(old, new, plan)
    root = nn.Module()
    new_tensors: dict[int, torch.Tensor] = {}
    for old in gm.graph.nodes:
        if old.op == "call_module":
            m = gm.get_submodule(old.target)
            _set_path(root, old.target, _rebuild_module(m, old, plan, new_tensors))
        elif old.op == "get_attr":
            t = get_path(gm, old.target)
            if isinstance(t, torch.Tensor):
                _set_path(root, old.target, _new_tensor(t, plan, new_tensors))
    # tensors forward never reads (an unused mask buffer...) keep their place in the state_dict
    everything = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    for pname, t in everything:
        if not has_path(root, pname):
            _set_path(root, pname, _new_tensor(t, plan, new_tensors) if id(t) in plan.param_syms
                      else t.detach().clone())  # fmt: skip
    sur = torch.fx.GraphModule(root, graph, f"{type(model).__name__}Surrogate")
    # GraphModule copies only what the graph references; put the unused tensors back too
    for pname, _ in everything:
        if not has_path(sur, pname):
            _set_path(sur, pname, get_path(root, pname))
    return sur, node_map, new_tensors


def _new_tensor(t: torch.Tensor, plan: WidthPlan, cache: dict[int, torch.Tensor]) -> torch.Tensor:
    """The surrogate's version of a target parameter or buffer (tied tensors stay tied)."""
    if id(t) in cache:
        return cache[id(t)]
    old_shape, new_shape = plan.param_shape(t)
    if isinstance(t, nn.Parameter):
        new = nn.Parameter(torch.empty(new_shape, dtype=t.dtype), requires_grad=t.requires_grad)
    elif old_shape == new_shape:
        new = t.detach().clone()
    else:
        # a width-shaped raw buffer: keep its leading entries along each shrunk dimension
        new = t.detach()[tuple(slice(0, n) for n in new_shape)].clone()
    cache[id(t)] = new
    return new


def _rebuild_module(
    m: nn.Module, node: torch.fx.Node, plan: WidthPlan, cache: dict[int, torch.Tensor]
) -> nn.Module:
    """A fresh module of the same type and options at the surrogate's sizes."""
    params = dict(m.named_parameters(recurse=True))
    if not params:
        return copy.deepcopy(m)
    x_shape = plan.new_shape(plan.node_syms[node.args[0]]) if node.args else None
    kw = {"dtype": next(iter(params.values())).dtype}
    if isinstance(m, nn.Linear):
        out_f, in_f = plan.param_shape(m.weight)[1]
        new = nn.Linear(in_f, out_f, bias=m.bias is not None, **kw)
    elif isinstance(m, _CONVS + _CONV_TRANSPOSES):
        w = plan.param_shape(m.weight)[1]
        transposed = isinstance(m, _CONV_TRANSPOSES)
        in_c = x_shape[1]
        depthwise = m.groups > 1 and m.groups == m.in_channels
        groups = in_c if depthwise else m.groups
        out_c = w[1] * groups if transposed else w[0]
        extra = {"output_padding": m.output_padding} if transposed else {}
        new = type(m)(
            in_c, out_c, m.kernel_size, stride=m.stride, padding=m.padding,
            dilation=m.dilation, groups=groups, bias=m.bias is not None,
            padding_mode=m.padding_mode, **extra, **kw,
        )  # fmt: skip
    elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        new = type(m)(
            x_shape[1], eps=m.eps, momentum=m.momentum, affine=m.affine,
            track_running_stats=m.track_running_stats, **kw,
        )  # fmt: skip
    elif isinstance(m, nn.LayerNorm):
        k = len(m.normalized_shape)
        new = nn.LayerNorm(
            x_shape[len(x_shape) - k :], eps=m.eps, elementwise_affine=m.elementwise_affine,
            bias=m.bias is not None, **kw,
        )  # fmt: skip
    elif hasattr(nn, "RMSNorm") and isinstance(m, nn.RMSNorm):
        k = len(m.normalized_shape)
        new = nn.RMSNorm(x_shape[len(x_shape) - k :], eps=m.eps,
                         elementwise_affine=m.elementwise_affine, **kw)  # fmt: skip
    elif isinstance(m, nn.GroupNorm):
        new = nn.GroupNorm(_group_count(m, x_shape[1], node), x_shape[1], eps=m.eps,
                           affine=m.affine, **kw)  # fmt: skip
    elif isinstance(m, nn.Embedding):
        num, dim = plan.param_shape(m.weight)[1]
        new = nn.Embedding(
            num, dim, padding_idx=m.padding_idx, max_norm=m.max_norm, norm_type=m.norm_type,
            scale_grad_by_freq=m.scale_grad_by_freq, sparse=m.sparse, **kw,
        )  # fmt: skip
    elif isinstance(m, nn.MultiheadAttention):
        e_new = plan.param_shape(m.out_proj.weight)[1][0]
        head_dim = m.embed_dim // m.num_heads
        if e_new % head_dim:
            ok = [r for r in range(1, m.num_heads + 1) if m.num_heads % r == 0]
            raise ScaleError(
                f"module '{node.target}' (MultiheadAttention, {m.num_heads} heads of {head_dim}) "
                f"cannot shrink to width {e_new} with whole heads of the same size; use a ratio "
                f"that divides the head count: {', '.join(map(str, ok))}"
            )
        new = nn.MultiheadAttention(
            e_new, e_new // head_dim, dropout=m.dropout, bias=m.in_proj_bias is not None,
            add_bias_kv=m.bias_k is not None, add_zero_attn=m.add_zero_attn,
            batch_first=m.batch_first, **kw,
        )  # fmt: skip
    else:  # the analysis rejects modules with parameters and no rule; keep this honest
        raise ScaleError(f"module '{node.target}' ({type(m).__name__}) has no rebuild rule")
    new.train(m.training)
    # tied parameters: the first module to rebuild a shared tensor owns it, the others share it
    for pname, p in m.named_parameters(recurse=True):
        if id(p) in cache:
            _set_path(new, pname, cache[id(p)])
        else:
            cache[id(p)] = new.get_parameter(pname)
    for bname, b in m.named_buffers(recurse=True):
        cache.setdefault(id(b), new.get_buffer(bname))
    return new


def _group_count(m: nn.GroupNorm, channels: int, node: torch.fx.Node) -> int:
    # Keep the number of groups if it divides; otherwise keep the channels per group.
    if channels % m.num_groups == 0:
        return m.num_groups
    per_group = m.num_channels // m.num_groups
    if channels % per_group == 0:
        return channels // per_group
    raise ScaleError(
        f"module '{node.target}' (GroupNorm({m.num_groups}, {m.num_channels})) cannot shrink to "
        f"{channels} channels: neither {m.num_groups} groups nor {per_group} channels per group "
        "divides it; choose a ratio that keeps one of them whole"
    )


# --- literals and attention ----------------------------------------------------------------------


def _rewrite_literals(
    old: torch.fx.Node,
    new: torch.fx.Node,
    plan: WidthPlan,
    node_map: dict[torch.fx.Node, torch.fx.Node],
) -> None:
    """Rewrite width-valued int literals (``view(B, T, 12, 64)``, ``split(768)``...)."""
    syms = plan.node_syms.get(old)
    name = op_name(old)
    if name in ("view", "reshape", "expand", "new_zeros", "new_ones", "new_empty", "new_full",
                "zeros", "ones", "empty", "full", "rand", "randn"):  # fmt: skip
        if not isinstance(syms, _TensorSyms):
            return
        start = 1 if old.op == "call_method" or name in ("reshape",) else 0
        if name == "reshape" and old.op == "call_function":
            start = 1
        sizes = _size_args(new, start)  # the copy's args: they refer to the copy's nodes
        expected = plan.new_shape(syms)
        if sizes is None or len(sizes) != len(expected):
            return
        fixed = [e if _is_literal(a) and a not in (-1, e) else a for a, e in zip(sizes, expected)]
        if fixed != list(sizes):
            _set_size_args(new, start, fixed)
        # sizes computed from a literal (``C // self.n_head``): rewrite that literal
        for a, e in zip(_size_args(old, start), expected):
            if isinstance(a, torch.fx.Node):
                _solve_int_literal(a, e, plan, node_map)
    elif name == "split":
        size = node_arg(old, 1, "split_size_or_sections")
        dim = node_arg(old, 2, "dim", 0)
        parts = [plan.new_shape(s) for s in syms] if isinstance(syms, (tuple, list)) else None
        if not parts:
            return
        if _is_literal(size):
            new_size = parts[0][dim]
            if new_size != size:
                new.update_arg(1, new_size) if len(old.args) > 1 else new.update_kwarg(
                    "split_size_or_sections", new_size)  # fmt: skip
        elif isinstance(size, (list, tuple)) and all(_is_literal(s) for s in size):
            new.update_arg(1, [p[dim] for p in parts])
    elif name == "layer_norm":
        shape = node_arg(old, 1, "normalized_shape")
        if isinstance(shape, (list, tuple)) and all(_is_literal(s) for s in shape):
            expected = plan.new_shape(syms)[len(plan.new_shape(syms)) - len(shape) :]
            if tuple(expected) != tuple(shape):
                new.update_arg(1, tuple(expected))
    elif name == "arange":
        if isinstance(syms, _TensorSyms):
            length = plan.new_shape(syms)[0]
            if len(old.args) == 1 and _is_literal(old.args[0]) and old.args[0] != length:
                new.update_arg(0, length)


_INT_OPS = {
    operator.floordiv: operator.floordiv,
    operator.mul: operator.mul,
    operator.add: operator.add,
    operator.sub: operator.sub,
}


def _int_value(a: Any, plan: WidthPlan) -> int | None:
    """The value an int argument will have in the surrogate, where it can be told."""
    if _is_literal(a):
        return a
    if not isinstance(a, torch.fx.Node):
        return None
    syms = plan.node_syms.get(a)
    if syms is not None and getattr(syms, "sym", None) is not None:
        return plan.new_dim(syms.sym)
    if a.op == "call_function" and a.target in _INT_OPS and len(a.args) == 2:
        x, y = (_int_value(v, plan) for v in a.args)
        if x is not None and y is not None and not (a.target is operator.floordiv and y == 0):
            return _INT_OPS[a.target](x, y)
    return None


def _solve_int_literal(
    a: torch.fx.Node, want: int, plan: WidthPlan, node_map: dict[torch.fx.Node, torch.fx.Node]
) -> None:
    """Make ``a`` (``size // literal`` or ``size * literal``) evaluate to ``want``."""
    got = _int_value(a, plan)
    if got is None or got == want or a.op != "call_function" or len(a.args) != 2:
        return
    x, lit = a.args
    if not _is_literal(lit):
        return
    xv = _int_value(x, plan)
    if xv is None:
        return
    if a.target is operator.floordiv and want and xv % want == 0:
        node_map[a].update_arg(1, xv // want)
    elif a.target is operator.mul and xv and want % xv == 0:
        node_map[a].update_arg(1, want // xv)


def _is_literal(a: Any) -> bool:
    return isinstance(a, int) and not isinstance(a, bool)


def _set_size_args(node: torch.fx.Node, start: int, sizes: list[Any]) -> None:
    if "size" in node.kwargs:
        node.update_kwarg("size", tuple(sizes))
    elif len(node.args) == start + 1 and isinstance(node.args[start], (tuple, list)):
        node.update_arg(start, tuple(sizes))
    else:
        rest = node.args[start + len(sizes) :]
        node.args = tuple(node.args[:start]) + tuple(sizes) + tuple(rest)


def _attention_scale(old: torch.fx.Node, new: torch.fx.Node, plan: WidthPlan) -> None:
    """muP's 1/d attention scale, relative to the target, when the head dim shrinks."""
    if op_name(old) != "scaled_dot_product_attention":
        return
    q = plan.node_syms[node_arg(old, 0, "query")]
    d_old, d_new = plan.sizes[q[-1]], plan.new_dim(q[-1])
    if d_old == d_new:
        return
    base = node_arg(old, 6, "scale") or d_old**-0.5
    if isinstance(base, torch.fx.Node):
        raise ScaleError(f"{describe(old)}: a computed attention scale cannot be corrected for "
                         "a smaller head dim; use head_policy='keep_head_dim'")  # fmt: skip
    new.update_kwarg("scale", base * d_old / d_new)


# --- the final check -----------------------------------------------------------------------------


def _check(
    sur: torch.fx.GraphModule,
    plan: WidthPlan,
    node_map: dict[torch.fx.Node, torch.fx.Node],
    inputs: tuple[Any, ...],
) -> None:
    """Re-propagate shapes through the surrogate and compare each node with the analysis."""
    try:
        values = propagate(sur, inputs)
    except Exception as exc:
        failing = _first_failing(sur, inputs)
        where = describe(failing) if failing is not None else "the surrogate"
        raise ScaleError(
            f"the scaled model fails at {where} at ratio {plan.ratio}: "
            f"{str(exc).splitlines()[0]}. A width-valued "
            "number is probably computed in a way Hydro cannot rewrite; read it from a tensor "
            "size (x.size(-1)) or a module attribute instead of hard-coding it."
        ) from exc
    for old, new in node_map.items():
        syms = plan.node_syms.get(old)
        if not isinstance(syms, _TensorSyms) or new not in values:
            continue
        got = tuple(values[new].shape)
        want = plan.new_shape(syms)
        if got != want:
            raise ScaleError(
                f"{describe(old)} produces shape {got} at ratio {plan.ratio}, but width analysis "
                f"expects {want}: a width-valued number there is computed in a way Hydro cannot "
                "rewrite. Read it from a tensor size (x.size(-1)) instead of hard-coding it."
            )


def _first_failing(gm: torch.fx.GraphModule, inputs: tuple[Any, ...]) -> torch.fx.Node | None:
    from torch._subclasses import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    failing: list[torch.fx.Node] = []

    class _Find(torch.fx.Interpreter):
        def run_node(self, n):  # noqa: ANN001
            try:
                with mode:
                    return super().run_node(n)
            except Exception:
                failing.append(n)
                raise

    try:
        _Find(gm).run(*(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs))
    except Exception:
        pass
    return failing[0] if failing else None


# --- small helpers -------------------------------------------------------------------------------


def _set_path(root: nn.Module, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    obj = root
    for part in parents:
        if not hasattr(obj, part):
            obj.add_module(part, nn.Module())
        obj = getattr(obj, part)
    if isinstance(value, nn.Module):
        obj.add_module(last, value)
    elif isinstance(value, nn.Parameter):
        obj.register_parameter(last, value)
    elif isinstance(obj, nn.Module) and isinstance(value, torch.Tensor):
        obj.register_buffer(last, value)
    else:
        setattr(obj, last, value)


__all__ = ["Scaled", "build", "guess_inputs", "scale"]

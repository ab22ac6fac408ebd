"""``hydro.inspect``: the per-layer scaling plan of a model, in the terminal and as data."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn

from hydro.errors import ConfigError, ScaleError
from hydro.fx.floor import LayerWidth, bounding, layer_widths
from hydro.fx.nodes import module_of
from hydro.fx.rules.common import bound
from hydro.fx.widths import HeadPolicy, op_name, propagate
from hydro.scaling import build, guess_inputs

_FACTORY_FORMS = ("a model, (model, (x, ...)), (model, {'input_ids': x, ...}) or "
                  "(model, (x, ...), {'input_ids': x, ...})")


def factory_inputs(made: Any, spec: str) -> tuple[nn.Module, tuple[Any, ...] | None,
                                                   dict[str, Any] | None]:
    """``(model, args, kwargs)`` from what a ``hydro inspect`` model factory returned.

    A factory returns the model alone (Hydro guesses one input, where the model takes a single
    tensor that feeds a Linear, Conv or Embedding layer), ``(model, args)``, ``(model, kwargs)``
    with a dict of keyword inputs, or ``(model, args, kwargs)``. Anything else, or a model whose
    inputs cannot be guessed, is a :class:`hydro.errors.ConfigError` naming ``spec`` and these
    forms.
    """
    parts = made if isinstance(made, tuple) else (made,)
    ok = 1 <= len(parts) <= 3 and isinstance(parts[0], nn.Module)
    args: Any = None
    kwargs: Any = None
    if ok and len(parts) == 2:
        if isinstance(parts[1], Mapping):
            kwargs = parts[1]
        else:
            args = parts[1]
    elif ok and len(parts) == 3:
        args, kwargs = parts[1], parts[2]
    ok = ok and (args is None or isinstance(args, (tuple, list)))
    named = isinstance(kwargs, Mapping) and all(isinstance(k, str) for k in kwargs)
    ok = ok and (kwargs is None or named)
    if not ok:
        shown = ", ".join(type(p).__name__ for p in parts)
        raise ConfigError(f"{spec} returned ({shown}); a model factory for `hydro inspect` "
                          f"returns {_FACTORY_FORMS}")
    model = parts[0]
    if args is None and kwargs is None:
        try:
            guess_inputs(model)
        except ScaleError as exc:
            raise ConfigError(
                f"{spec} returned {type(model).__name__} alone and Hydro cannot guess its inputs "
                "(it guesses one tensor for a forward taking a single required input); make "
                f"the factory return the model with one example batch: "
                f"{_FACTORY_FORMS.split(', ', 1)[1]}"
            ) from exc
    return model, None if args is None else tuple(args), None if kwargs is None else dict(kwargs)


@dataclass
class LayerPlan:
    """One row of :class:`InspectReport`: a layer (or a raw parameter, or an attention op)."""

    path: str
    kind: str
    role: str
    target_shape: tuple[int, ...]
    surrogate_shape: tuple[int, ...]
    target_params: int
    surrogate_params: int
    target_flops: int
    surrogate_flops: int
    floor: int | None = None  # the width floor of its kind, where a width of it shrinks


@dataclass
class InspectReport:
    """What :func:`inspect` returns: rows per layer, totals, and a printable table."""

    ratio: int
    rows: list[LayerPlan] = field(default_factory=list)
    head_decisions: list[str] = field(default_factory=list)
    multipliers: dict[str, float] = field(default_factory=dict)
    kept: list[tuple[str, int, int]] = field(default_factory=list)
    pinned: list[tuple[str, int, str]] = field(default_factory=list)  # widths kept, and why
    depth_ratio: int = 1
    stacks: list[Any] = field(default_factory=list)
    depth_multipliers: dict[str, float] = field(default_factory=dict)
    floors: list[LayerWidth] = field(default_factory=list)
    auto: str | None = None  # why ratio="auto" chose ``ratio``
    rotary: list[str] = field(default_factory=list)  # rotary and other tables rebuilt by rule

    @property
    def totals(self) -> dict[str, int]:
        keys = ("target_params", "surrogate_params", "target_flops", "surrogate_flops")
        return {k: sum(getattr(r, k) for r in self.rows) for k in keys}

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for JSON/YAML)."""
        return {
            "ratio": self.ratio,
            "rows": [vars(r) | {"target_shape": list(r.target_shape),
                                "surrogate_shape": list(r.surrogate_shape)} for r in self.rows],
            "totals": self.totals,
            "head_decisions": self.head_decisions,
            "multipliers": self.multipliers,
            "kept": [list(k) for k in self.kept],
            "pinned": [list(p) for p in self.pinned],
            "depth_ratio": self.depth_ratio,
            "stacks": [{"path": st.path, "blocks": list(st.blocks), "kept": list(st.kept),
                        "head": list(st.head), "left_whole": st.reason,
                        "multiplier": st.multiplier, "siblings": list(st.siblings)}
                       for st in self.stacks],
            "depth_multipliers": self.depth_multipliers,
            "floors": [vars(lw) | {"below": lw.below} for lw in self.floors],
            "auto": self.auto,
            "rotary": self.rotary,
        }

    def __str__(self) -> str:
        header = ("module", "kind", "role", "target", "surrogate", "params", "sur params",
                  "FLOPs", "sur FLOPs", "floor")
        body = [
            (r.path, r.kind, r.role, _shape(r.target_shape), _shape(r.surrogate_shape),
             _num(r.target_params), _num(r.surrogate_params), _num(r.target_flops),
             _num(r.surrogate_flops), _floor(r, self.floors))
            for r in self.rows
        ]
        t = self.totals
        body.append(("total", "", "", "", "", _num(t["target_params"]),
                     _num(t["surrogate_params"]), _num(t["target_flops"]),
                     _num(t["surrogate_flops"]), ""))
        widths = [max(len(str(row[i])) for row in [header, *body]) for i in range(len(header))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in [header, *body]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.insert(-1, lines[1])
        p = t["target_params"] / max(1, t["surrogate_params"])
        f = t["target_flops"] / max(1, t["surrogate_flops"])
        lines.append(f"ratio {self.ratio}: {p:.1f}x fewer parameters, {f:.1f}x fewer FLOPs "
                     "per forward pass (matmul-like ops)")
        lines += [self.auto] if self.auto else []
        below = [lw for lw in self.floors if lw.below]
        closest = bounding(self.floors)
        if below:
            lines.append(f"below the width floor ({len(below)} layers; the learning rate may not "
                         f"transfer): " + "; ".join(map(str, below[:4])))
        elif closest is not None:
            lines.append(f"width floor: closest to it (bounds the ratio) {closest}")
        lines += [f"attention: {d}" for d in self.head_decisions]
        lines += self.rotary
        lines += [f"muP multiplier {k} = {v:g}" for k, v in self.multipliers.items()]
        lines += [_stack_line(st) for st in self.stacks]
        lines += [f"depth multiplier {k} = {v:g}" for k, v in self.depth_multipliers.items()]
        lines += [
            f"fixed: '{name}' dimension {dim} ({size}) is indexed or sliced by a fixed size "
            "(vocabulary, positions), not a width"
            for name, dim, size in self.kept
        ]
        lines += [f"kept whole: {what} ({size}), a hidden width: {why}"
                  for what, size, why in self.pinned]
        return "\n".join(lines)


def inspect(
    model: nn.Module,
    ratio: int | str = 8,
    *,
    example_inputs: tuple[Any, ...] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    head_policy: HeadPolicy = "keep_head_dim",
    depth_ratio: int = 1,
    depth_alpha: float = 1.0,
) -> InspectReport:
    """Describe how :func:`hydro.scale` shrinks ``model``: per layer and in total.

    Args:
        model: the target model.
        ratio: the width divisor, or ``"auto"`` (as for :func:`hydro.scale`).
        example_inputs: positional inputs shaped like a real batch (FLOPs are counted for it).
        example_kwargs: keyword inputs of that call.
        head_policy: as for :func:`hydro.scale`.
        depth_ratio: as for :func:`hydro.scale`; the report then names each stack of repeated
            blocks with the blocks it keeps, or why it is left whole. Removed blocks keep their
            rows, with no surrogate parameters or FLOPs.
        depth_alpha: as for :func:`hydro.scale`.

    Returns:
        An :class:`InspectReport`; ``print(report)`` shows the table (with how attention heads
        were scaled and which parameter dimensions stay fixed because they index positions),
        ``report.to_dict()`` the data.

    Example:
        >>> import torch, hydro
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(),
        ...                             torch.nn.Linear(256, 10))
        >>> report = hydro.inspect(model, ratio=8, example_inputs=(torch.randn(2, 16),))
        >>> [(r.path, r.role) for r in report.rows]
        [('0', 'input'), ('2', 'output')]
    """
    scaled = build(model, ratio, example_inputs=example_inputs, example_kwargs=example_kwargs,
                   head_policy=head_policy, depth_ratio=depth_ratio,
                   depth_alpha=depth_alpha)
    sur, plan = scaled.surrogate, scaled.plan
    mode = "train" if "train" in sur.graphs else next(iter(sur.graphs))
    sur_values = propagate(sur, sur.graphs[mode], scaled.inputs, scaled.kwargs)
    report = InspectReport(plan.ratio, head_decisions=list(sur.hydro.head_decisions),
                           multipliers=dict(sur.hydro.multipliers),
                           kept=list(plan.kept), pinned=list(plan.pinned),
                           depth_ratio=depth_ratio,
                           stacks=list(sur.hydro.stacks),
                           depth_multipliers=dict(sur.hydro.depth_multipliers))
    roles = sur.hydro.roles
    target_graph = scaled.captured.graphs[mode].graph
    flops: dict[int, tuple[int, int]] = {}  # per parameter id: (target, surrogate) FLOPs
    counted_nodes: set[torch.fx.Node] = set()
    for key, uses in plan.uses.items():
        for u in uses:
            if u.node.graph is target_graph:
                t, s_ = _flops(u.node, plan.values), _flops(scaled.node_map[u.node], sur_values)
                old = flops.get(key, (0, 0))
                flops[key] = (old[0] + t, old[1] + s_)
                counted_nodes.add(u.node)
    _removed_flops(model, report.stacks, flops)
    sur_params = dict(sur.named_parameters())
    kinds = {}  # module path -> type, from where the graphs were recorded
    for node in target_graph.nodes:
        owner = module_of(node)
        if owner is not None:
            kinds.setdefault(owner[0], owner[1])
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, p in model.named_parameters():  # tied weights: counted once, where first seen
        groups.setdefault(name.rpartition(".")[0], []).append((name, p))
    for path, params in groups.items():
        main_name, main = next(((n, p) for n, p in params if n.endswith("weight")), params[0])
        kind = kinds.get(path) or "Parameter"
        if len(params) == 1 and not main_name.endswith(("weight", "bias")):
            path, kind = main_name, "Parameter"
        f_t = sum(flops.get(id(p), (0, 0))[0] for _, p in params)
        f_s = sum(flops.get(id(p), (0, 0))[1] for _, p in params)
        report.rows.append(LayerPlan(
            path, kind, roles.get(main_name, "-"), tuple(main.shape),
            tuple(sur_params[main_name].shape) if main_name in sur_params else (),
            sum(p.numel() for _, p in params),
            sum(sur_params[n].numel() for n, _ in params if n in sur_params), f_t, f_s,
        ))
    for node in target_graph.nodes:  # attention and products of activations
        if node.op != "call_function" or node in counted_nodes:
            continue
        f_t = _flops(node, plan.values)
        if f_t:
            owner = module_of(node)
            out_t = plan.values.get(node)
            out_s = sur_values.get(scaled.node_map[node])
            report.rows.append(LayerPlan(
                f"{owner[0]}:{node.name}" if owner and owner[0] else node.name, op_name(node), "-",
                tuple(getattr(out_t, "shape", ())), tuple(getattr(out_s, "shape", ())), 0, 0,
                f_t, _flops(scaled.node_map[node], sur_values),
            ))
    report.floors = layer_widths(plan)
    report.auto = str(sur.hydro.auto) if sur.hydro.auto else None
    report.rotary = [str(table) for table in plan.rotary.values()]
    report.rotary += [str(table) for table in plan.structured.values()]
    by_path = {lw.path: lw.floor for lw in report.floors}
    for row in report.rows:
        row.floor = by_path.get(row.path.split(":")[0] if row.kind == "scaled_dot_product_attention"
                                else row.path)
    return report


def _stack_line(st: Any) -> str:
    if st.reason is not None:
        return f"depth: stack '{st.path}' ({len(st.blocks)} blocks) left whole: {st.reason}"
    if not st.cut:
        return f"depth: stack '{st.path}' ({len(st.blocks)} blocks) kept whole"
    after = f" after {', '.join(st.head)} (another shape, kept as is)" if st.head else ""
    if st.siblings:
        after += f" (one loop body with {', '.join(repr(s) for s in st.siblings)})"
    return (f"depth: stack '{st.path}' keeps {len(st.kept)} of {len(st.blocks)} blocks "
            f"({', '.join(st.kept)}){after}, residual branches x {st.multiplier:g}")


def _removed_flops(model: nn.Module, stacks: list, flops: dict[int, tuple[int, int]]) -> None:
    """Target FLOPs of the parameters of removed blocks: those of the same parameter of the
    stack's first block (identical blocks on the same stream); none in the surrogate."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for st in stacks:
        if not st.cut:
            continue
        first = st.blocks[0]
        for block in st.blocks:
            if block in st.kept:
                continue
            for name, p in params.items():
                if name.startswith(block + "."):
                    twin = params.get(first + name[len(block) :])
                    if twin is not None and id(twin) in flops and id(p) not in flops:
                        flops[id(p)] = (flops[id(twin)][0], 0)


def _floor(row: LayerPlan, floors: list[LayerWidth]) -> str:
    if row.floor is None:
        return ""
    path = row.path.split(":")[0]
    below = any(lw.below and lw.path == path for lw in floors)
    return f"{row.floor}{' (below)' if below else ''}"


def _flops(node: torch.fx.Node, values: dict) -> int:
    """Forward multiply-add FLOPs (x2) of a matmul-like op, for the example batch."""
    name = op_name(node)
    out = values.get(node)
    if not isinstance(out, torch.Tensor):
        return 0
    b = bound(node)

    def val(key: str) -> Any:
        return values.get(b.get(key)) if isinstance(b.get(key), torch.fx.Node) else None

    if name == "linear":
        return 2 * out.numel() * val("input").shape[-1]
    if name == "addmm":
        return 2 * out.numel() * val("mat1").shape[-1]
    if name in ("mm", "bmm", "matmul"):
        a = values.get(node.args[0])
        return 2 * out.numel() * a.shape[-1] if isinstance(a, torch.Tensor) else 0
    if name.startswith("conv"):
        w, x = val("weight"), val("input")
        k = math.prod(w.shape[2:])
        if "transpose" in name:
            return 2 * x.numel() * w.shape[1] * k
        return 2 * out.numel() * w.shape[1] * k
    if name == "scaled_dot_product_attention":
        q, k = val("query"), val("key")
        return 2 * 2 * q.numel() * k.shape[-2]
    return 0


def _num(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _shape(s: tuple[int, ...]) -> str:
    return "x".join(map(str, s)) if s else "-"

"""``hydro.inspect``: the per-layer scaling plan of a model, in the terminal and as data."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn

from hydro.fx.shapes import propagate
from hydro.fx.widths import HeadPolicy, node_arg, op_name
from hydro.scaling import build


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


@dataclass
class InspectReport:
    """What :func:`inspect` returns: rows per layer, totals, and a printable table."""

    ratio: int
    rows: list[LayerPlan] = field(default_factory=list)
    head_decisions: list[str] = field(default_factory=list)
    multipliers: dict[str, float] = field(default_factory=dict)

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
        }  # fmt: skip

    def __str__(self) -> str:
        header = ("module", "kind", "role", "target", "surrogate", "params", "sur params",
                  "FLOPs", "sur FLOPs")  # fmt: skip
        body = [
            (r.path, r.kind, r.role, _shape(r.target_shape), _shape(r.surrogate_shape),
             _num(r.target_params), _num(r.surrogate_params), _num(r.target_flops),
             _num(r.surrogate_flops))
            for r in self.rows
        ]  # fmt: skip
        t = self.totals
        body.append(("total", "", "", "", "", _num(t["target_params"]),
                     _num(t["surrogate_params"]), _num(t["target_flops"]),
                     _num(t["surrogate_flops"])))  # fmt: skip
        widths = [max(len(str(row[i])) for row in [header, *body]) for i in range(len(header))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in [header, *body]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.insert(-1, lines[1])
        p = t["target_params"] / max(1, t["surrogate_params"])
        f = t["target_flops"] / max(1, t["surrogate_flops"])
        lines.append(f"ratio {self.ratio}: {p:.1f}x fewer parameters, {f:.1f}x fewer FLOPs "
                     "per forward pass (matmul-like ops)")  # fmt: skip
        lines += [f"attention: {d}" for d in self.head_decisions]
        lines += [f"muP multiplier {k} = {v:g}" for k, v in self.multipliers.items()]
        return "\n".join(lines)


def inspect(
    model: nn.Module,
    ratio: int = 8,
    *,
    example_inputs: tuple[Any, ...] | None = None,
    head_policy: HeadPolicy = "keep_head_dim",
    leaf_modules: Iterable[type[nn.Module]] = (),
) -> InspectReport:
    """Describe how :func:`hydro.scale` shrinks ``model``: per layer and in total.

    Args:
        model: the target model.
        ratio: the width divisor.
        example_inputs: inputs shaped like a real batch (FLOPs are counted for this batch).
        head_policy: as for :func:`hydro.scale`.
        leaf_modules: as for :func:`hydro.scale`.

    Returns:
        An :class:`InspectReport`; ``print(report)`` shows the table, ``report.to_dict()`` the
        data.

    Example:
        >>> import torch, hydro
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(),
        ...                             torch.nn.Linear(256, 10))
        >>> report = hydro.inspect(model, ratio=8)
        >>> [(r.path, r.role) for r in report.rows]
        [('0', 'input'), ('2', 'output')]
    """
    scaled = build(model, ratio, example_inputs=example_inputs, head_policy=head_policy,
                   leaf_modules=leaf_modules)  # fmt: skip
    sur, plan = scaled.surrogate, scaled.plan
    sur_values = propagate(sur, scaled.inputs)
    report = InspectReport(ratio, head_decisions=list(sur.hydro.head_decisions),
                           multipliers=dict(sur.hydro.multipliers))  # fmt: skip
    roles = sur.hydro.roles
    canonical = {id(p): n for n, p in sur.named_parameters()}  # tied weights: one name
    counted: set[int] = set()
    gm = plan.gm
    for old in gm.graph.nodes:
        if old not in scaled.node_map:
            continue  # the output node
        new = scaled.node_map[old]
        t_val, s_val = plan.values.get(old), sur_values.get(new)
        if old.op == "call_module":
            m_t, m_s = gm.get_submodule(old.target), sur.get_submodule(old.target)
            if not any(True for _ in m_t.parameters()):
                continue
            # a tied weight (a readout sharing the embedding) is counted once, where first seen
            n_t = sum(p.numel() for p in m_t.parameters() if id(p) not in counted)
            n_s = sum(p.numel() for p in m_s.parameters() if id(p) not in counted)
            counted.update(id(p) for p in (*m_t.parameters(), *m_s.parameters()))
            first = next(n for n, _ in m_t.named_parameters())
            report.rows.append(LayerPlan(
                old.target, type(m_t).__name__,
                roles.get(canonical.get(id(m_s.get_parameter(first)), ""), "?"),
                tuple(m_t.get_parameter(first).shape), tuple(m_s.get_parameter(first).shape),
                n_t, n_s,
                _module_flops(m_t, plan.values.get(old.args[0]), t_val),
                _module_flops(m_s, sur_values.get(new.args[0]) if new.args else None, s_val),
            ))  # fmt: skip
        elif old.op == "get_attr" and old.target in roles:
            p_t, p_s = gm.get_parameter(old.target), sur.get_parameter(old.target)
            report.rows.append(LayerPlan(old.target, "Parameter", roles[old.target],
                                         tuple(p_t.shape), tuple(p_s.shape), p_t.numel(),
                                         p_s.numel(), 0, 0))  # fmt: skip
        elif old.op in ("call_function", "call_method"):
            f_t = _function_flops(old, plan.values)
            if f_t:
                report.rows.append(LayerPlan(
                    old.name, op_name(old), "-", tuple(getattr(t_val, "shape", ())),
                    tuple(getattr(s_val, "shape", ())), 0, 0, f_t,
                    _function_flops(new, sur_values),
                ))  # fmt: skip
    return report


def _module_flops(m: nn.Module, x: Any, out: Any) -> int:
    """Forward multiply-add FLOPs (x2) of a layer, for one batch."""
    if isinstance(out, tuple):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        return 0
    if isinstance(m, nn.Linear):
        return 2 * out.numel() * m.in_features
    if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return 2 * out.numel() * (m.in_channels // m.groups) * math.prod(m.kernel_size)
    if isinstance(m, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return 2 * x.numel() * (m.out_channels // m.groups) * math.prod(m.kernel_size)
    if isinstance(m, nn.MultiheadAttention):
        e, tokens = m.embed_dim, out.numel() // m.embed_dim
        seq = out.shape[1] if m.batch_first else out.shape[0]
        return 2 * tokens * e * 4 * e + 2 * 2 * tokens * seq * e
    return 0


def _function_flops(node: torch.fx.Node, values: dict) -> int:
    name = op_name(node)
    out = values.get(node)
    if not isinstance(out, torch.Tensor):
        return 0
    if name in ("matmul", "bmm", "mm", "linear"):
        a = values.get(node.args[0])
        return 2 * out.numel() * a.shape[-1] if isinstance(a, torch.Tensor) else 0
    if name == "scaled_dot_product_attention":
        q, k = values.get(node_arg(node, 0, "query")), values.get(node_arg(node, 1, "key"))
        return 2 * 2 * q.numel() * k.shape[-2]
    return 0


def _num(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _shape(s: tuple[int, ...]) -> str:
    return "x".join(map(str, s)) if s else "-"

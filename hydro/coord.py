"""``hydro.coord_check``: the measurement that shows muP holds for a surrogate.

Train the surrogate at several ratios for a few steps and record, per layer, the average size of
an activation coordinate (mean absolute value). Under muP these sizes do not depend on the width,
so the curves over width are flat; in a naively width-scaled model they drift with width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_unflatten

import hydro.parametrize as parametrize
from hydro.fx.capture import capture
from hydro.fx.paths import get_path
from hydro.fx.widths import flat_inputs, op_name
from hydro.scaling import scale

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass
class CoordCheckResult:
    """Activation sizes: ``sizes[ratio][layer][step]`` (mean absolute value of a coordinate).

    Attributes:
        widths: the main hidden width of the surrogate at each ratio (target width / ratio).
        roles: each layer's muP role (hidden layers are the ones the check is about).
        ops: the op that applies each layer's weight (``linear``, ``embedding``, ``layer_norm``).
    """

    ratios: list[int]
    steps: int
    parametrization: str
    sizes: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    widths: dict[int, int] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    ops: dict[str, str] = field(default_factory=dict)

    def spread(self, layer: str, step: int) -> float:
        """Largest over smallest activation size across ratios for one layer and step."""
        values = [self.sizes[r][layer][step] for r in self.ratios]
        return max(values) / max(min(values), 1e-30)

    def hidden_layers(self) -> list[str]:
        """Layers whose output is a hidden (width-sized) activation."""
        return [name for name, role in self.roles.items() if role in ("hidden", "input", "vector")]

    def worst(self, step: int | None = None) -> tuple[str, float]:
        """The hidden layer with the largest spread at ``step`` (default: the last) and that
        spread; every recorded layer when none is hidden."""
        step = self.steps - 1 if step is None else step
        layers = [n for n in self.hidden_layers() if n in self.sizes[self.ratios[0]]]
        layers = layers or list(self.sizes[self.ratios[0]])
        name = max(layers, key=lambda n: self.spread(n, step))
        return name, self.spread(name, step)

    def verdict(self, threshold: float = 2.0) -> tuple[bool, str]:
        """``(passed, line)``: muP holds when the worst hidden layer's spread at the last step
        (largest over smallest activation size across widths) is below ``threshold``."""
        layer, spread = self.worst()
        widths = sorted(self.widths[r] for r in self.ratios)
        passed = spread < threshold
        why = "activation sizes do not grow or shrink with width"
        if not passed:
            why = "activation sizes change with width: tuned values will not transfer"
        return passed, (
            f"verdict: {'PASS' if passed else 'FAIL'} ({self.parametrization}): worst hidden "
            f"layer {layer!r} has spread {spread:.2f} at step {self.steps - 1} over widths "
            f"{widths[0]}-{widths[-1]}, {'below' if passed else 'not below'} the threshold "
            f"{threshold:g}; {why}"
        )

    def __str__(self) -> str:
        layers = list(self.sizes[self.ratios[0]])
        head = ["layer", "step"] + [f"r={r} (w={self.widths[r]})" for r in self.ratios] + ["spread"]
        rows = []
        for layer in layers:
            for t in range(self.steps):
                rows.append([layer, str(t)]
                            + [f"{self.sizes[r][layer][t]:.3g}" for r in self.ratios]
                            + [f"{self.spread(layer, t):.2f}"])
        cols = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
        fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, cols))
        return "\n".join([fmt(head), fmt(["-" * w for w in cols]), *map(fmt, rows)])

    def kind(self, layer: str) -> str:
        """The layer's kind, one panel of :meth:`plot`: embedding, norm, conv, or a linear map by
        its muP role (input, hidden, output)."""
        op = self.ops.get(layer, "")
        if op == "embedding":
            return "embedding"
        if op.endswith("norm"):
            return "norm"
        family = "conv" if op.startswith("conv") else "linear"
        role = self.roles.get(layer, "?")
        return "output (logits)" if role == "output" else f"{family} ({role})"

    def plot(self, path: str | None = None, threshold: float = 2.0, per_panel: int = 6) -> Figure:
        """Activation size against width at the last step, one panel per layer kind (at most
        ``per_panel`` lines each: the layers with the largest spread, named), then the spread
        per step of the worst layers against the ``threshold`` of :meth:`verdict`."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import (
            FixedLocator,
            FormatStrFormatter,
            LogLocator,
            NullFormatter,
            NullLocator,
        )

        last = self.steps - 1
        layers = list(self.sizes[self.ratios[0]])
        widths = [self.widths[r] for r in self.ratios]
        kinds: dict[str, list[str]] = {}
        for layer in layers:
            kinds.setdefault(self.kind(layer), []).append(layer)
        panels = len(kinds) + 1
        cols = min(panels, 4)
        rows = -(-panels // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows + 0.6),
                                 squeeze=False)
        axes = [ax for row in axes for ax in row]
        colors = plt.get_cmap("tab10")
        judged = set(self.hidden_layers())
        for ax, (kind, members) in zip(axes, kinds.items()):
            worst = sorted(members, key=lambda n: -self.spread(n, last))[:per_panel]
            for i, layer in enumerate(worst):
                ax.plot(widths, [self.sizes[r][layer][last] for r in self.ratios], marker="o",
                        color=colors(i), ls="-" if layer in judged else ":",
                        label=f"{layer} ({self.spread(layer, last):.2f})")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            # at least a factor 4 top to bottom: a flat line looks flat, not steep noise
            values = [self.sizes[r][n][last] for r in self.ratios for n in worst]
            lo, hi = max(min(values), 1e-30), max(max(values), 1e-30)
            if hi / lo < 4:
                mid = (lo * hi) ** 0.5
                ax.set_ylim(mid / 2, mid * 2)
            ax.xaxis.set_major_locator(FixedLocator(widths))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticklabels([str(w) for w in widths])
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            more = f", worst {len(worst)} of {len(members)}" if len(members) > len(worst) else ""
            ax.set_title(f"{kind}{more}", fontsize=10)
            ax.set_xlabel("hidden width")
            ax.set_ylabel(f"mean |activation| at step {last}")
            ax.legend(fontsize=7, loc="best", title="layer (spread)", title_fontsize=7)
            ax.grid(alpha=0.3)
        ax = axes[len(kinds)]
        order = sorted(judged or layers, key=lambda n: -self.spread(n, last))[:per_panel]
        for i, layer in enumerate(order):
            ax.plot(range(self.steps), [self.spread(layer, t) for t in range(self.steps)],
                    marker="o", color=colors(i), label=layer)
        ax.axhline(threshold, color="k", ls="--", lw=1, label=f"threshold {threshold:g}")
        ax.set(title="spread (max/min across widths),\nworst judged layers", xlabel="step",
               ylabel="spread")
        ax.set_xticks(range(self.steps))
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
        for extra in axes[panels:]:
            extra.axis("off")
        passed, _ = self.verdict(threshold)
        layer, spread = self.worst()
        fig.suptitle(
            f"coord check ({self.parametrization}): {'PASS' if passed else 'FAIL'}, worst hidden "
            f"spread {spread:.2f} ({layer}) vs threshold {threshold:g}; dotted: not judged",
            color="green" if passed else "red",
        )
        fig.tight_layout(rect=(0, 0, 1, 0.95))
        if path:
            from hydro.files import replacing

            with replacing(path) as tmp:
                fig.savefig(tmp, dpi=120)
        return fig


def coord_check(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    target: torch.Tensor,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    ratios: Sequence[int] = (1, 2, 4, 8),
    steps: int = 4,
    lr: float = 1e-2,
    optimizer: Literal["adam", "sgd"] = "adam",
    parametrization: Literal["mup", "sp"] = "mup",
    seed: int = 0,
) -> CoordCheckResult:
    """Record per-layer activation sizes while training surrogates at several ratios.

    Each surrogate is trained on the same batch for ``steps`` steps with muP-scaled Adam (or SGD)
    at the base learning rate ``lr``; the size of every parameterized layer's output is recorded
    before each step. With ``parametrization="sp"`` the naive width-scaled models are trained
    with the unscaled learning rate instead, which is what the check is meant to tell apart.

    Example:
        >>> import torch, torch.nn.functional as F, hydro
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 128), torch.nn.ReLU(),
        ...                             torch.nn.Linear(128, 128), torch.nn.ReLU(),
        ...                             torch.nn.Linear(128, 3))
        >>> x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
        >>> result = hydro.coord_check(model, (x,), y, F.cross_entropy, ratios=(1, 4), steps=2)
        >>> result.spread("2", 1) < 2.0
        True
    """
    result = CoordCheckResult(list(ratios), steps, parametrization)
    model = capture(model, example_inputs)  # once: every ratio scales the same graphs
    for ratio in ratios:
        sur = scale(model, ratio, example_inputs=example_inputs, seed=seed,
                    parametrization=parametrization)
        gm = sur.graphs["train"]
        layers = _layers(sur, gm)
        roles = sur.hydro.roles
        for node, (name, weight) in layers.items():
            result.roles.setdefault(name, roles.get(weight, "?"))
            result.ops.setdefault(name, op_name(node))
        hidden = [
            s for n, s in sur.hydro.target_shapes.items()
            if roles.get(n) == "hidden" and len(s) >= 2
        ]
        result.widths[ratio] = (max(s[0] for s in hidden) if hidden else 1) // ratio
        record: dict[str, list[float]] = {name: [] for name, _ in dict.fromkeys(layers.values())}
        kind = "sgd" if optimizer == "sgd" else "adam"
        groups = parametrize.param_groups(sur, lr=lr, kind=kind)
        opt = torch.optim.SGD(groups) if kind == "sgd" else torch.optim.Adam(groups)
        torch.manual_seed(seed)
        sur.train()
        for _ in range(steps):
            opt.zero_grad()
            out = _Recording(sur, gm, layers, record).call(example_inputs)
            loss(out, target).backward()
            opt.step()
        result.sizes[ratio] = record
    return result


_LAYER_OPS = {"linear", "addmm", "mm", "matmul", "conv1d", "conv2d", "conv3d", "convolution",
              "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "embedding",
              "layer_norm", "batch_norm", "group_norm", "rms_norm"}


def _layers(sur: nn.Module, gm: torch.fx.GraphModule) -> dict[torch.fx.Node, tuple[str, str]]:
    """The ops that apply a layer's weight: node -> (layer name, weight name); first use only."""
    params = {id(p): n for n, p in sur.named_parameters()}
    layers: dict[torch.fx.Node, tuple[str, str]] = {}
    seen: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or op_name(node) not in _LAYER_OPS:
            continue
        for arg in node.all_input_nodes:
            if arg.op != "get_attr":
                continue
            weight = params.get(id(get_path(sur, arg.target)))
            if weight is not None and weight.rpartition(".")[0] not in seen:
                seen.add(weight.rpartition(".")[0])
                layers[node] = (weight.rpartition(".")[0], weight)
                break
    return layers


class _Recording(torch.fx.Interpreter):
    """Runs a surrogate's graph (with autograd), recording each layer's mean |activation|."""

    def __init__(self, root, gm, layers, record) -> None:
        super().__init__(root, graph=gm.graph)
        self.gm, self.layers, self.record = gm, layers, record

    def call(self, inputs: tuple[Any, ...]) -> Any:
        flat = self.run(*flat_inputs(self.gm, inputs, {}))
        flat = list(flat) if isinstance(flat, (list, tuple)) else [flat]
        return tree_unflatten(flat, self.gm._out_spec)

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n in self.layers:
            self.record[self.layers[n][0]].append(out.detach().abs().mean().item())
        return out

"""Hydro's surrogate against the ``mup`` package's parametrization of the same narrow model.

Two GPTs: ``examples/charlm`` (4 layers, width 256, 4 heads of 64, tied embedding and readout,
GPT-2 init N(0, 0.02), attention through ``scaled_dot_product_attention``) and a pre-LN GPT
written here (2 layers, width 256, 8 heads of 32, an untied readout with a bias, PyTorch's
default initialization, attention written out as ``softmax(q @ k^T * s)``). At each ratio both
sides build a model of width ``256 / ratio``:

* **hydro**: ``hydro.scale(model, ratio)``, read from ``sur.hydro`` and
  :func:`hydro.parametrize.optimizer_multipliers` (what the fused optimizers and
  :func:`hydro.parametrize.param_groups` apply);
* **mup**: the model class built at the narrow width with the same head count, the readout
  replaced by ``mup.MuSharedReadout`` / ``mup.MuReadout``, the attention scale ``s = sqrt(d_base) /
  d`` (muP's ``1/d``, equal to the model's own ``1/sqrt(d)`` at the base), ``mup.set_base_shapes``
  with the full model as base, then the package's README recipe: every weight re-drawn with
  ``mup.init`` at the model's own init std (the charlm GPT), or PyTorch's default init as
  ``set_base_shapes(rescale_params=True)`` corrects it (the GPT written here); learning rates and
  weight decays from ``mup.MuAdam``'s parameter groups.

Every number on the mup side comes from the package's own code: its ``constant_std_init_`` rule
(called with a recording sampler), the factor ``set_base_shapes`` multiplied a tensor by, the
groups ``MuAdam`` made, ``MuReadout``'s ``output_mult / width_mult()``. Attention scales and head
layouts are recorded from one forward pass of each model under a dispatch mode.

The table has one row per parameter: the init std multiplier relative to the target's own init
(and the std it gives), Adam's learning-rate and weight-decay multipliers, the role; then one row
per readout (its input multiplier) and per attention (heads x head dim, scale), and whether the
embedding and readout are one tensor. ``!`` marks every row where the two sides differ by more
than 1%.

``--train`` measures what each difference does to the best learning rate: the full model and
surrogates built each way train the same batches (Adam, constant learning rate, no weight decay,
no dropout) over a learning-rate grid, and the best of each is printed.

    python benchmarks/mup_compare.py --out benchmarks/results/mup_compare.txt
    python benchmarks/mup_compare.py --train --model charlm --ratios 4 8 --seeds 0 1 \
        --json benchmarks/results/mup_compare_lr_charlm.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mup
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's hydro and examples

import hydro  # noqa: E402
from examples.charlm.data import VOCAB_SIZE  # noqa: E402
from examples.charlm.model import GPT as CharGPT  # noqa: E402
from hydro.parametrize import InitStats, optimizer_multipliers  # noqa: E402

WIDTH, BLOCK = 256, 64
TOL = 0.01


# --- the second GPT: written here, apart from the project's example ----------------------------


class SmallAttention(nn.Module):
    """Causal self-attention written out (not SDPA), with its scale a Python float."""

    def __init__(self, width: int, heads: int, scale: float | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.scale = scale  # None: the usual 1/sqrt(head dim)
        self.register_buffer("mask", torch.tril(torch.ones(BLOCK, BLOCK, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        d = c // self.heads
        q, k, v = (z.view(b, t, self.heads, d).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(d)
        att = (q @ k.transpose(-2, -1)) * scale
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, t, c))


class SmallBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = SmallAttention(width, heads)
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class SmallGPT(nn.Module):
    """Pre-LN GPT, PyTorch's default init, an untied readout with a bias."""

    def __init__(self, width: int = WIDTH, layers: int = 2, heads: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB_SIZE, width)
        self.pos = nn.Embedding(BLOCK, width)
        self.blocks = nn.ModuleList(SmallBlock(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB_SIZE)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# --- the two models, their target init and their mup version ------------------------------------


@dataclass
class Spec:
    """One GPT: how to build it at a width, its own init std per parameter, its mup version."""

    name: str
    build: Callable[[int], nn.Module]
    nominal_std: Callable[[str, tuple[int, ...], int], float]  # name, shape, model width
    to_mup: Callable[[nn.Module, int], None]  # readout and attention scale, in place
    reinit: Callable[[nn.Module], dict[str, float]]  # mup's re-draw; the rule's std per name


def _char_std(name: str, shape: tuple[int, ...], width: int) -> float:
    """The charlm GPT's own init: N(0, 0.02), residual projections / sqrt(2 * 4 layers)."""
    if name.endswith("c_proj.weight"):
        return 0.02 / math.sqrt(8)
    if name.endswith(".bias") or "ln_" in name:
        return 0.0  # zeros, and LayerNorm's ones
    return 0.02


def _char_mup_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``CausalSelfAttention.forward`` with muP's ``1/d`` scale (``self.mup_scale``)."""
    b, t, c = x.size()
    q, k, v = self.c_attn(x).chunk(3, dim=2)
    q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.mup_scale)
    return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


def _char_to_mup(model: nn.Module, base_width: int) -> None:
    model.lm_head = mup.MuSharedReadout(model.wte.weight, bias=False)
    for block in model.h:
        d, d_base = model.wte.weight.shape[1] // block.attn.n_head, base_width // block.attn.n_head
        block.attn.mup_scale = math.sqrt(d_base) / d
        block.attn.forward = types.MethodType(_char_mup_forward, block.attn)


def _mup_rule_std(p: torch.Tensor, std: float) -> float:
    """The std ``mup.init.normal_(p, std=std)`` draws from, by the package's own rule."""
    scales: list[float] = []
    mup.init.constant_std_init_(p, lambda t, scale=1: scales.append(scale))
    return std * scales[0]


def _char_reinit(model: nn.Module) -> dict[str, float]:
    """The README recipe: after ``set_base_shapes``, every weight re-drawn with ``mup.init``."""
    rule = {}
    for name, p in model.named_parameters():
        std = _char_std(name, tuple(p.shape), p.infshape[-1].dim)
        if p.dim() >= 2:
            rule[name] = _mup_rule_std(p, std)
            mup.init.normal_(p, std=std)
    return rule


def _small_std(name: str, shape: tuple[int, ...], width: int) -> float:
    """PyTorch's defaults: Linear weight and bias U(+-1/sqrt(fan_in)), Embedding N(0, 1)."""
    if name.startswith(("tok", "pos")):
        return 1.0
    if ".ln" in name or name.startswith("ln."):
        return 0.0
    fan_in = 4 * width if name.endswith("proj.weight") or name.endswith("proj.bias") else width
    return 1.0 / math.sqrt(3 * fan_in)


def _small_to_mup(model: nn.Module, base_width: int) -> None:
    width = model.tok.weight.shape[1]
    head = mup.MuReadout(width, VOCAB_SIZE)
    model.head = head
    for block in model.blocks:
        d, d_base = width // block.attn.heads, base_width // block.attn.heads
        block.attn.scale = math.sqrt(d_base) / d


def _small_reinit(model: nn.Module) -> dict[str, float]:
    """PyTorch's default init is fan-in already: ``set_base_shapes`` rescales the rest."""
    return {}


SPECS = {
    "charlm": Spec("charlm", lambda w: CharGPT(4, 4, w, BLOCK, 0.0), _char_std, _char_to_mup,
                   _char_reinit),
    "small": Spec("small", lambda w: SmallGPT(w), _small_std, _small_to_mup, _small_reinit),
}


# --- reading each side ------------------------------------------------------------------------


class AttentionRecorder(TorchDispatchMode):
    """Record ``(heads, head dim, scale)`` of every attention a forward pass computes.

    SDPA calls are read from their arguments; written-out attention from a ``bmm`` whose
    output is ``[B*H, T, T]`` followed by a multiplication or division by a number.
    """

    def __init__(self, batch: int, seq: int) -> None:
        super().__init__()
        self.batch, self.seq = batch, seq
        self.found: list[tuple[int, int, float]] = []
        self._pending: tuple[int, int] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__
        if "scaled_dot_product" in name:
            q = args[0]
            scale = kwargs.get("scale")
            d = q.shape[-1]
            self.found.append((q.shape[-3], d, d**-0.5 if scale is None else float(scale)))
        elif name.startswith("bmm") and tuple(out.shape[-2:]) == (self.seq, self.seq):
            self._pending = (args[0].shape[0] // self.batch, args[0].shape[-1])
        elif self._pending and name.split(".")[0] in ("mul", "div") and len(args) == 2:
            number = next((a for a in args if isinstance(a, (int, float))), None)
            if number is None:
                number = next((a.item() for a in args
                               if isinstance(a, torch.Tensor) and a.dim() == 0), None)
            if number is not None:
                heads, d = self._pending
                self.found.append((heads, d, number if name.startswith("mul") else 1 / number))
                self._pending = None
        return out


def example() -> tuple[torch.Tensor]:
    """Token ids ``[2, BLOCK]``: the models train on whole blocks."""
    return (torch.randint(0, VOCAB_SIZE, (2, BLOCK), generator=torch.Generator().manual_seed(0)),)


def attentions(model: nn.Module) -> list[tuple[int, int, float]]:
    (x,) = example()
    rec = AttentionRecorder(2, BLOCK)
    with torch.no_grad(), rec:
        model(x)
    return rec.found


@dataclass
class Side:
    """What one side sets, per parameter name and per model."""

    roles: dict[str, str] = field(default_factory=dict)
    init_mult: dict[str, float] = field(default_factory=dict)  # relative to the target's std
    init_std: dict[str, float] = field(default_factory=dict)
    lr: dict[str, float] = field(default_factory=dict)
    wd: dict[str, float] = field(default_factory=dict)
    readout: dict[str, float] = field(default_factory=dict)  # readout weight -> input multiplier
    attention: list[tuple[int, int, float]] = field(default_factory=list)
    tied: bool = False
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


def hydro_side(spec: Spec, target: nn.Module, ratio: int,
               head_policy: str = "keep_head_dim") -> tuple[Side, nn.Module]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the width floor's warning: this compares rules
        sur = hydro.scale(target, ratio=ratio, seed=0, example_inputs=example(),
                          head_policy=head_policy)
    info = sur.hydro
    side = Side()
    for name, p in sur.named_parameters():
        side.roles[name] = info.roles[name]
        side.init_mult[name] = info.init_mult[name]
        side.init_std[name] = spec.nominal_std(name, info.target_shapes[name], WIDTH) * (
            info.init_mult[name])
        side.lr[name], side.wd[name] = optimizer_multipliers(p, "adam")
        side.shapes[name] = tuple(p.shape)
    for name, role in info.roles.items():
        if role == "output":
            side.readout[name] = next(iter(info.multipliers.values()), 1.0)
    side.attention = attentions(sur)
    params = dict(sur.named_parameters(remove_duplicate=False))
    side.tied = "lm_head.weight" in params and params["lm_head.weight"] is params.get("wte.weight")
    return side, sur


def mup_model(spec: Spec, ratio: int, rescale: bool = True,
              reinit: bool = True) -> tuple[nn.Module, dict[str, float]]:
    """The narrow model parametrized by the mup package; the std of each re-drawn tensor."""
    narrow = spec.build(WIDTH // ratio)
    spec.to_mup(narrow, WIDTH)
    with torch.device("meta"):
        base = spec.build(WIDTH)
    spec.to_mup(base, WIDTH)
    mup.set_base_shapes(narrow, base, rescale_params=rescale)
    rule = spec.reinit(narrow) if reinit else {}
    return narrow, rule


def mup_side(spec: Spec, ratio: int) -> tuple[Side, nn.Module]:
    torch.manual_seed(0)
    narrow = spec.build(WIDTH // ratio)
    spec.to_mup(narrow, WIDTH)
    before = {n: p.detach().clone() for n, p in narrow.named_parameters()}
    with torch.device("meta"):
        base = spec.build(WIDTH)
    spec.to_mup(base, WIDTH)
    mup.set_base_shapes(narrow, base)  # rescale_params=True: the package's default
    rescaled = {}
    for n, p in narrow.named_parameters():  # the factor set_base_shapes multiplied by
        nz = before[n].abs() > 0
        rescaled[n] = (p.detach()[nz] / before[n][nz]).mean().item() if nz.any() else 1.0
    rule = spec.reinit(narrow)
    side = Side()
    readouts = {id(m.weight): m for m in narrow.modules() if isinstance(m, mup.MuReadout)}
    opt = mup.MuAdam(narrow.parameters(), lr=1.0, weight_decay=1.0)
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    for name, p in narrow.named_parameters():
        ninf = p.infshape.ninf()
        side.roles[name] = ("readout" if id(p) in readouts else
                            "hidden" if ninf == 2 else "vector-like" if ninf == 1 else "fixed")
        target_std = spec.nominal_std(name, tuple(base.get_parameter(name).shape), WIDTH)
        own = spec.nominal_std(name, tuple(p.shape), WIDTH // ratio)  # its own init code
        std = rule.get(name, own * rescaled[name])
        side.init_std[name] = std
        side.init_mult[name] = std / target_std if target_std else 1.0
        side.lr[name] = group_of[id(p)]["lr"]
        side.wd[name] = group_of[id(p)]["weight_decay"]
        side.shapes[name] = tuple(p.shape)
        if id(p) in readouts:
            m = readouts[id(p)]
            side.readout[name] = m.output_mult / m.width_mult()
    side.attention = attentions(narrow)
    side.tied = getattr(narrow, "lm_head", None) is not None and (
        narrow.lm_head.weight is narrow.wte.weight)
    return side, narrow


# --- the table ----------------------------------------------------------------------------------


def _ratio(a: float, b: float) -> float:
    if a == b:
        return 1.0
    return a / b if b else math.inf


def _flag(r: float) -> str:
    return "!" if not math.isfinite(r) or abs(r - 1) > TOL else " "


def table(spec: Spec, ratio: int,
          head_policy: str = "keep_head_dim") -> tuple[list[str], list[str]]:
    """The comparison's lines, and the rows flagged (``name: what``)."""
    torch.manual_seed(0)
    target = spec.build(WIDTH)
    h, _ = hydro_side(spec, target, ratio, head_policy)
    m, _ = mup_side(spec, ratio)
    lines = [f"\n{spec.name}, ratio {ratio} (width {WIDTH} -> {WIDTH // ratio}); "
             "init: std multiplier relative to the target's own init (std it gives); "
             "hydro / mup (ratio)"]
    lines.append(f"  {'parameter':26} {'shape':11} {'role hydro/mup':20} {'init std mult':27} "
                 f"{'Adam lr mult':23} {'weight decay mult':23}")
    flagged = []
    for name in h.roles:
        if name not in m.roles:
            lines.append(f"! {name}: not a parameter of the mup model")
            flagged.append(f"{name}: missing on the mup side")
            continue
        cells = []
        for what, a, b in (("init", h.init_mult[name], m.init_mult[name]),
                           ("lr", h.lr[name], m.lr[name]), ("wd", h.wd[name], m.wd[name])):
            r = _ratio(a, b)
            cells.append((what, a, b, r))
        role_h, role_m = h.roles[name], m.roles[name]
        role_differs = (role_h == "output") != (role_m == "readout") or (
            (role_h == "hidden") != (role_m == "hidden"))
        bad = [c for c in cells if _flag(c[3]) == "!"] or role_differs
        mark = "!" if bad else " "
        init = (f"{cells[0][1]:.3f}/{cells[0][2]:.3f} ({cells[0][3]:.3f})"
                f" [{h.init_std[name]:.4f}/{m.init_std[name]:.4f}]")
        lines.append(
            f"{mark} {name:26} {'x'.join(map(str, h.shapes[name])):11} "
            f"{role_h + '/' + role_m:20} {init:27} "
            + " ".join(f"{a:g}/{b:g} ({r:.3f}){_flag(r)}".ljust(23) for _, a, b, r in cells[1:]))
        for what, a, b, r in cells:
            if _flag(r) == "!":
                flagged.append(f"{spec.name} ratio {ratio} {name}: {what} hydro {a:g}, mup {b:g}")
        if role_differs:
            flagged.append(f"{spec.name} ratio {ratio} {name}: role hydro {role_h}, mup {role_m}")
    for name in sorted(set(h.readout) | set(m.readout)):
        a, b = h.readout.get(name, 1.0), m.readout.get(name, 1.0)
        r = _ratio(a, b)
        lines.append(f"{_flag(r)} readout input multiplier ({name}): {a:g} / {b:g} ({r:.3f})")
        if _flag(r) == "!":
            flagged.append(f"{spec.name} ratio {ratio} readout {name}: hydro {a:g}, mup {b:g}")
    base_scale = attentions(target)[0][2]  # the target's own 1/sqrt(head dim)
    for i, (ha, ma) in enumerate(zip(h.attention, m.attention)):
        r = _ratio(ha[2], ma[2])
        layout = ha[:2] != ma[:2]
        mark = "!" if layout or _flag(r) == "!" else " "
        lines.append(f"{mark} attention {i}: heads x head dim {ha[0]}x{ha[1]} / {ma[0]}x{ma[1]}; "
                     f"scale {ha[2]:.4g} / {ma[2]:.4g} ({r:.3f}); x the target's "
                     f"{ha[2] / base_scale:.3g} / {ma[2] / base_scale:.3g}")
        if mark == "!":
            flagged.append(f"{spec.name} ratio {ratio} attention {i}: {ha[0]}x{ha[1]} scale "
                           f"{ha[2]:.4g} (hydro) against {ma[0]}x{ma[1]} scale {ma[2]:.4g} (mup)")
    lines.append(f"{'!' if h.tied != m.tied else ' '} embedding and readout one tensor: "
                 f"{h.tied} / {m.tied}")
    # Hydro draws from the target's measured std: how far that is from the nominal one
    dev, worst = max((abs(InitStats.of(p).std / s - 1), n) for n, p in target.named_parameters()
                     if (s := spec.nominal_std(n, tuple(p.shape), WIDTH)))
    lines.append(f"  (Hydro draws from the target's measured std: at most {100 * dev:.2f}% from "
                 f"the nominal one, on {worst}, {target.get_parameter(worst).numel()} values)")
    return lines, flagged


def compare(ratios: list[int]) -> str:
    out = io.StringIO()
    print(__doc__.split("\n\n")[0], file=out)
    print(f"torch {torch.__version__}, mup {getattr(mup, '__version__', '1.0.0')}; "
          f"'!' marks a difference over {100 * TOL:g}%", file=out)
    flagged: list[str] = []
    for spec in SPECS.values():
        for ratio in ratios:
            lines, f = table(spec, ratio)
            print("\n".join(lines), file=out)
            flagged += f
    print(f"\n{len(flagged)} rows differ:", file=out)
    for f in flagged:
        print(f"  {f}", file=out)
    print("\nthe same comparison with hydro.scale(..., head_policy='keep_head_count'), the head "
          "layout the mup model has:", file=out)
    for spec in SPECS.values():
        for ratio in ratios:
            _, f = table(spec, ratio, "keep_head_count")
            print(f"  {spec.name}, ratio {ratio}: {len(f)} rows differ", file=out)
    # a package convention the README recipe hides: set_base_shapes rescales a shared readout,
    # which is the embedding, when nothing re-draws it afterwards (mup's Transformer example)
    for ratio in ratios:
        narrow, _ = mup_model(SPECS["charlm"], ratio, rescale=False, reinit=True)
        w = narrow.wte.weight.detach().clone()
        narrow.lm_head._rescale_parameters()
        f = (narrow.wte.weight.detach() / w).mean().item()
        print(f"mup's set_base_shapes(rescale_params=True) without a re-draw, ratio {ratio}: the "
              f"tied embedding's std x {f:.4f} (sqrt(width_mult)); Hydro x 1", file=out)
    return out.getvalue()


# --- the learning-rate grid ------------------------------------------------------------------


VARIANTS = ("full", "hydro", "hydro_heads", "mup", "mup_shrunk_tie")


def build_variant(spec: Spec, variant: str, ratio: int, seed: int) -> tuple[nn.Module, list]:
    """A model and its Adam parameter groups (learning-rate multipliers at lr 1)."""
    torch.manual_seed(seed)
    target = spec.build(WIDTH)
    if variant == "full":
        return target, [{"params": list(target.parameters()), "lr": 1.0}]
    if variant.startswith("hydro"):
        policy = "keep_head_count" if variant == "hydro_heads" else "keep_head_dim"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sur = hydro.scale(target, ratio=ratio, seed=seed, head_policy=policy,
                              example_inputs=example())
        return sur, hydro.parametrize.param_groups(sur, lr=1.0)
    torch.manual_seed(seed)
    narrow, _ = mup_model(spec, ratio, rescale=True, reinit=True)
    if variant == "mup_shrunk_tie":  # mup's example order: the shared readout rescaled last
        with torch.no_grad():
            narrow.wte.weight.mul_(math.sqrt(narrow.wte.weight.infshape.width_mult()))
    opt = mup.MuAdam(narrow.parameters(), lr=1.0)
    return narrow, [{"params": g["params"], "lr": g["lr"]} for g in opt.param_groups]


def train(spec: Spec, variant: str, ratio: int, lr: float, seed: int, steps: int,
          batch: int, data: dict) -> float:
    """Final validation loss after ``steps`` Adam steps at a constant ``lr``."""
    sys.path.insert(0, str(HERE))
    import end_to_end as e2e

    model, groups = build_variant(spec, variant, ratio, seed)
    opt = torch.optim.Adam([{**g, "lr": g["lr"] * lr} for g in groups], lr=lr)
    x, y = data["train"]
    g = torch.Generator().manual_seed(seed)  # the same batches for every variant and lr
    for _ in range(steps):
        idx = torch.randint(0, len(y), (batch,), generator=g)
        logits = model(x[idx])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y[idx].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if not math.isfinite(loss.item()):
            return math.inf
    return e2e.evaluate(model, data["val"])


def run_grid(args: argparse.Namespace) -> None:
    from examples.charlm.data import load

    torch.set_num_threads(1)
    spec = SPECS[args.model]
    path = Path(args.json)
    saved = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    saved["config"] = {"model": args.model, "steps": args.steps, "batch": args.batch,
                       "block": BLOCK, "chars": args.chars, "optimizer": "Adam, constant lr"}
    data = load(block_size=BLOCK, max_chars=args.chars)
    lrs = [2.0**e for e in range(args.lr_lo, args.lr_hi + 1)]
    for seed in args.seeds:
        for variant in args.variants:
            for ratio in ([1] if variant == "full" else args.ratios):
                if variant == "mup_shrunk_tie" and spec.name != "charlm":
                    continue
                for lr in lrs:
                    k = f"{variant}|{ratio}|{math.log2(lr):g}|{seed}"
                    if k in saved["runs"]:
                        continue
                    t0 = time.process_time()
                    saved["runs"][k] = train(spec, variant, ratio, lr, seed, args.steps,
                                             args.batch, data)
                    path.write_text(json.dumps(saved, indent=1))
                    print(f"{k}: {saved['runs'][k]:.4f} ({time.process_time() - t0:.1f} cpu s)",
                          flush=True)
    report(saved)


def report(saved: dict) -> None:
    """Mean loss per learning rate and the best one, per variant and ratio."""
    by: dict[tuple[str, int], dict[float, list[float]]] = {}
    for k, v in saved["runs"].items():
        variant, ratio, e, _ = k.split("|")
        by.setdefault((variant, int(ratio)), {}).setdefault(float(e), []).append(v)
    exps = sorted({e for d in by.values() for e in d})
    print(f"\nmean final validation loss; config {saved['config']}; * = best of each row")
    print(f"  {'variant':16} {'ratio':>5} {'seeds':>5}" + "".join(f"{'2^' + format(e, 'g'):>9}"
                                                          for e in exps) + "    best")
    for (variant, ratio), d in sorted(by.items(), key=lambda x: (x[0][1], x[0][0])):
        means = {e: sum(v) / len(v) for e, v in d.items()}
        best = min(means, key=means.get)
        n = min(len(v) for v in d.values())
        cells = "".join(f"{means[e]:8.4f}{'*' if e == best else ' '}" if e in means else " " * 9
                        for e in exps)
        per_seed = []
        for s in sorted({k.split("|")[3] for k in saved["runs"]}):
            vals = {float(k.split("|")[2]): v for k, v in saved["runs"].items()
                    if k.startswith(f"{variant}|{ratio}|") and k.endswith(f"|{s}")}
            if vals:
                per_seed.append(f"2^{min(vals, key=vals.get):g}")
        print(f"  {variant:16} {ratio:5d} {n:5d}{cells}    2^{best:g} (per seed "
              f"{', '.join(per_seed)})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ratios", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--out", help="also write the comparison table to this file")
    p.add_argument("--train", action="store_true", help="run the learning-rate grid")
    p.add_argument("--model", choices=tuple(SPECS), default="charlm")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--chars", type=int, default=200_000)
    p.add_argument("--lr-lo", type=int, default=-13)
    p.add_argument("--lr-hi", type=int, default=-8)
    p.add_argument("--json", default=str(HERE / "results" / "mup_compare_lr.json"))
    p.add_argument("--report", nargs="+",
                   help="print saved grids' table only (several files: their runs together)")
    args = p.parse_args()
    if args.report:
        saved = [json.loads(Path(f).read_text()) for f in args.report]
        return report({"config": saved[0]["config"],
                       "runs": {k: v for s in saved for k, v in s["runs"].items()}})
    if args.train:
        return run_grid(args)
    text = compare(args.ratios)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()

"""The cost of per-trial random streams: fused dropout against torch's own, side by side.

Two tables, each timed in interleaved rounds (medians; the load average is printed, since only
ratios within one run count on a shared machine):

Times are this process's CPU time (``time.process_time``, one thread: what other processes'
load inflates least).

1. **Per element**: one dropout site, forward + backward (and forward alone), on ``n`` trials'
   activations ``[n, *shape]``: torch's ``F.dropout`` over the folded batch (its generator, one
   rate), against Hydro's per-trial streams with each trial's own rate (``[n]``, as a study
   samples them): the draw this tree makes (``streams``, :mod:`hydro.fusion.random`, draw
   version 2) and the one before it (``streams v1``: a 24-bit ``int64`` hash per element).
2. **Share of the group step**: the charlm GPT of ``examples/charlm/tune.yaml`` (4 layers,
   width 256, 4 heads, block 64; dropout after the embeddings, the attention and the MLP: 9
   sites) at ratio 4, ``n`` fused trials with rates spread over the search space's range, one
   step = forward, per-trial loss, backward, ``hydro.optim.AdamW``: with no dropout (rate 0,
   nothing drawn: the floor), with torch's generator (the path before per-trial streams: a
   trial's masks depended on its slot), with the streams of version 1, and with this tree's;
   then one rate (0.1) for all trials: torch's own ``aten.dropout`` over the folded batch
   against this tree's streams. A row's share is ``(step - no dropout) / step``.

    python benchmarks/dropout.py --threads 1 --n 16 --repeats 7
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusion import timed
from trial_step_ratio import VOCAB, loss_fn

import hydro
import hydro.optim
from examples.charlm.model import gpt
from hydro.fusion import ops, rewrite
from hydro.fusion import random as rng


def dropout_v1(t: torch.Tensor, p: float | torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The dropout draw of version 1 (before this tree's): the 24-bit uniforms of
    :func:`hydro.fusion.random.uniform_bits` (two ``lowbias32`` rounds in ``int64`` per element)."""
    bits = rng._hash(keys, t.shape[1:])
    if not isinstance(p, torch.Tensor):
        q = 1.0 - float(p)
        keep = bits >= math.ceil(float(p) * 2**24) * 256
        return t * keep.to(t.dtype) * (1.0 / q if q > 0 else 0.0)
    p = p.to(torch.float64).view(-1, *[1] * (t.dim() - 1))
    q = (1.0 - p).to(t.dtype)
    scale = torch.where(q > 0, 1.0 / q.clamp_min(torch.finfo(t.dtype).tiny), 0.0)
    return t * ((bits >= torch.ceil(p * 2**24) * 256) * scale)


@contextlib.contextmanager
def draw(fn: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Fused dropout through ``fn`` instead of this tree's draw (looked up at every call)."""
    saved = rng.dropout
    rng.dropout = fn
    try:
        yield
    finally:
        rng.dropout = saved


def _torch_rng_dropout(x, p, train, n, spec):
    """The per-trial-rate dropout before streams: torch's generator over the whole group."""
    if not train:
        return x
    t = ops.to_trials(x, n, spec)
    keep = (1.0 - p).to(x.dtype).view(n, *([1] * (t.dim() - 1)))
    mask = torch.rand_like(t) < keep
    scale_ = torch.where(keep > 0, 1.0 / keep.clamp_min(1e-12), torch.zeros_like(keep))
    return ops.settle(t * mask * scale_, spec)


def _torch_rng_handler(rw, node, found, kinds) -> bool:
    p = rw.literal(node, 1)
    if p is None or "T" in kinds:
        return False  # one rate: aten.dropout over the folded batch, as before
    s = rw.spec.get(node.args[0])
    s = ("F", s[1], s[2]) if s[0] == "SB" else s
    rw.env[node] = rw.fn(_torch_rng_dropout, rw.folded(node.args[0]), p, node.args[2], rw.n, s)
    rw.spec[node] = s
    return True


@contextlib.contextmanager
def torch_rng() -> Iterator[None]:
    """Build fused graphs the way they were built before per-trial streams."""
    key = torch.ops.aten.dropout.default
    saved = rewrite._HANDLERS[key]
    rewrite._HANDLERS[key] = _torch_rng_handler
    try:
        yield
    finally:
        rewrite._HANDLERS[key] = saved


def rates(n: int, low: float = 0.0, high: float = 0.2) -> list[float]:
    """``n`` rates spread over the search space's range (charlm's ``dropout``: 0 to 0.2)."""
    return [low + (high - low) * (k + 0.5) / n for k in range(n)]


def site_steps(
    n: int, shape: tuple[int, ...], device: torch.device | str = "cpu"
) -> dict[str, Callable[[], None]]:
    """One dropout site's forward + backward and forward alone, per method, on ``device``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, *shape, generator=g).to(device).requires_grad_()
    grad = torch.randn(n, *shape, generator=g).to(device)
    p = torch.tensor(rates(n), dtype=torch.float64, device=device)
    steps = torch.zeros(n, dtype=torch.int64)
    keys = rng.stream_keys(torch.arange(n), steps, 1)[0].to(device)
    folded = (n * shape[0], *shape[1:])
    methods = {
        "torch": lambda v: F.dropout(v.view(folded), 0.1),
        "streams v1": lambda v: dropout_v1(v, p, keys),
        "streams": lambda v: rng.dropout(v, p, keys),
    }
    steps = {}
    for name, fn in methods.items():

        def both(fn: Callable = fn) -> None:
            y = fn(x)
            y.backward(grad.view_as(y))
            x.grad = None

        def forward(fn: Callable = fn) -> None:
            with torch.no_grad():
                fn(x)

        steps[f"{name} fwd+bwd"], steps[f"{name} fwd"] = both, forward
    return steps


def group_steps(n: int, batch: int, ratio: int) -> dict[str, Callable[[], None]]:
    """The charlm ratio-``ratio`` group's training step, per way of drawing its masks."""
    from hydro.tuning.group import _apply_model_params

    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (batch, 64))
    y = torch.randint(0, VOCAB, (batch, 64))
    full = gpt(n_layer=4, n_head=4, n_embd=256, block_size=64, dropout=0.1)

    def build(ps: list[float], graph: Callable = contextlib.nullcontext,
              call: Callable | None = None) -> Callable[[], None]:
        """The fused step of rates ``ps``, its graph built under ``graph()``, each call of it
        under ``call()`` when given."""
        members = []
        for p in ps:
            m = hydro.scale(full, ratio=ratio, example_inputs=(x[:2],))
            _apply_model_params(m, {"dropout": p}, set())  # the rate as the tuner sets it
            members.append(m)
        fused = hydro.fuse(members, seed=1)
        opt = hydro.optim.AdamW(fused.parameters(), lr=[1e-3] * n)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            hydro.trial_loss(loss_fn, fused(x), y).sum().backward()
            opt.step()

        def wrapped() -> None:
            with call():
                step()

        with graph():
            step()  # the graph is built here
        return step if call is None else wrapped

    return {
        "no dropout": build([0.0] * n),
        "torch RNG": build(rates(n), graph=torch_rng),
        "streams v1": build(rates(n), call=lambda: draw(dropout_v1)),
        "streams": build(rates(n)),
        # one rate for all: torch's own aten.dropout over the folded batch, against the streams
        "torch F.dropout, 0.1 for all": build([0.1] * n, graph=torch_rng),
        "streams, 0.1 for all": build([0.1] * n),
    }


def site_table(n: int, shapes: list[tuple[int, ...]], repeats: int, min_time: float) -> list:
    """Rows ``(shape, method, ns per element fwd+bwd, fwd, ratios to torch)``."""
    rows = []
    for shape in shapes:
        t: dict[str, float] = {}
        timed(site_steps(n, shape), repeats, min_time, cpu=t)
        per = n * math.prod(shape)
        for m in ("torch", "streams v1", "streams"):
            both, fwd = t[f"{m} fwd+bwd"], t[f"{m} fwd"]
            rows.append((shape, m, 1e9 * both / per, 1e9 * fwd / per,
                         both / t["torch fwd+bwd"], fwd / t["torch fwd"]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16, help="trials fused")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds per repeat")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ratio", type=int, default=4)
    parser.add_argument("--skip-group", action="store_true", help="the per-element table only")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}; {args.threads} thread(s); load average before "
          f"{os.getloadavg()[0]:.2f}; medians of {args.repeats} interleaved rounds\n")
    width = 256 // args.ratio
    shapes = [(args.batch, 64, width), (args.batch, 64, 4 * width)]
    print(f"Per element, one site, {args.n} trials, rates spread over 0-0.2 (torch: 0.1):\n")
    print("| per-trial shape | method | fwd+bwd ns/el | fwd ns/el | fwd+bwd / torch "
          "| fwd / torch |")
    print("|---|---|---|---|---|---|")
    for shape, m, both, fwd, rb, rf in site_table(args.n, shapes, args.repeats, args.min_time):
        print(f"| {list(shape)} | {m} | {both:.2f} | {fwd:.2f} | {rb:.2f}x | {rf:.2f}x |")
    if args.skip_group:
        return
    t: dict[str, float] = {}
    timed(group_steps(args.n, args.batch, args.ratio), args.repeats, args.min_time, cpu=t)
    floor = t["no dropout"]
    print(f"\ncharlm GPT ratio {args.ratio}, {args.n} fused, batch {args.batch} x 64, 9 "
          f"dropout sites; load average after {os.getloadavg()[0]:.2f}:\n")
    print("| method | step ms | dropout ms | share of the step |")
    print("|---|---|---|---|")
    for name, v in t.items():
        share = (v - floor) / v
        print(f"| {name} | {1e3 * v:.1f} | {1e3 * (v - floor):.1f} | {share:.1%} |")


if __name__ == "__main__":
    main()

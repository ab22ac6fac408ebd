"""The cost of per-trial random streams: a fused training step with dropout, side by side.

On the GPT surrogate of ``benchmarks/fusion.py`` (the charlm GPT, 2 layers, n_embd 256 / 4,
dropout after the embeddings, the attention projection and the MLP), ``n`` fused trials, one
step = forward, per-trial loss, backward, ``hydro.optim.AdamW``. Timed in interleaved rounds
(medians):

- ``no dropout``: rate 0 (nothing drawn), the floor;
- ``torch RNG``: the path before per-trial streams (one ``aten.dropout`` over the folded batch
  for one rate, ``rand_like`` for per-trial rates): torch's generator, so a trial's masks
  depended on its slot and group;
- ``streams``: this tree (:mod:`hydro.fusion.random`), each trial's masks from its own seed
  and step.

    python benchmarks/dropout.py --threads 1 --ns 16 --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusion import LRS, gpt_loss, timed  # noqa: E402

import hydro.optim  # noqa: E402
from examples.charlm.model import GPT  # noqa: E402
from hydro import scale  # noqa: E402
from hydro.fusion import fuse, ops, rewrite, trial_loss  # noqa: E402


def _torch_rng_dropout(x, p, train, n, spec):  # noqa: ANN001, ANN202
    """The per-trial-rate dropout before streams: torch's generator over the whole group."""
    if not train:
        return x
    t = ops.to_trials(x, n, spec)
    keep = (1.0 - p).to(x.dtype).view(n, *([1] * (t.dim() - 1)))
    mask = torch.rand_like(t) < keep
    scale_ = torch.where(keep > 0, 1.0 / keep.clamp_min(1e-12), torch.zeros_like(keep))
    return ops.settle(t * mask * scale_, spec)


def _torch_rng_handler(rw, node, found, kinds) -> bool:  # noqa: ANN001
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


def surrogate(dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)
    idx = torch.randint(0, 96, (8, 32))
    target = GPT(n_layer=2, n_head=8, n_embd=256, block_size=32, dropout=dropout)
    return scale(target, ratio=4, example_inputs=(idx,))


def fused_step(rates: list[float], old: bool) -> Callable[[], None]:
    """One fused step of ``len(rates)`` GPT surrogates, trial ``k`` at dropout ``rates[k]``."""
    from hydro.tuning.group import _apply_model_params

    members = []
    for p in rates:
        sur = surrogate(0.0)
        _apply_model_params(sur, {"dropout": p}, set())  # the rate as the tuner sets it
        members.append(sur)
    fused = fuse(members, seed=1)
    opt = hydro.optim.AdamW(fused.parameters(), lr=LRS(len(rates)), weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    idx, y = torch.randint(0, 96, (8, 32), generator=g), torch.randint(0, 96, (8, 32), generator=g)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        trial_loss(gpt_loss, fused(idx), y).sum().backward()
        opt.step()

    with torch_rng() if old else contextlib.nullcontext():
        step()  # the graph is built here, under the chosen dropout handler
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", nargs="*", type=int, default=[16])
    parser.add_argument("--threads", nargs="*", type=int, default=[1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds per repeat")
    parser.add_argument("--rate", type=float, default=0.1)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}; GPT surrogate (charlm GPT, n_embd 256 / 4), dropout "
          f"{args.rate}; ms per fused step, medians of {args.repeats} interleaved "
          "rounds\n")  # fmt: skip
    header = ("| rates | n | threads | no dropout | torch RNG | streams | streams / torch RNG "
              "| streams / no dropout |")  # fmt: skip
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for threads in args.threads:
        torch.set_num_threads(threads)
        for n in args.ns:
            for kind in ("one rate", "per trial"):
                if kind == "one rate":
                    rates = [args.rate] * n
                else:  # spread around the rate, as a study samples them
                    rates = [args.rate * (0.5 + k / max(n - 1, 1)) for k in range(n)]
                steps = {
                    "no dropout": fused_step([0.0] * n, old=False),
                    "torch RNG": fused_step(rates, old=True),
                    "streams": fused_step(rates, old=False),
                }
                t = timed(steps, args.repeats, args.min_time)
                ms = {k: 1e3 * v for k, v in t.items()}
                print(f"| {kind} | {n} | {threads} | {ms['no dropout']:.2f} | "
                      f"{ms['torch RNG']:.2f} | {ms['streams']:.2f} | "
                      f"{t['streams'] / t['torch RNG']:.2f}x | "
                      f"{t['streams'] / t['no dropout']:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()

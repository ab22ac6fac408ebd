"""Learning-rate transfer on the word-language-model LSTM (issue 32, point 1): the best Adam
learning rate of the ratio-8 surrogates (one fused group, one trial per rate) against the full
model's (each rate trained alone), and the Spearman correlation of their final losses over
the grid. Character-level text from the standard library (``pydoc_data.topics``), nothing
downloaded.

    python benchmarks/recurrent_transfer.py                  # 5 rates, 300 steps
    python benchmarks/recurrent_transfer.py --steps 100 --kind GRU

Measured (one seed, 300 steps, one thread on the shared 2-core box), validation loss:

    lr        LSTM full  surrogate    GRU full  surrogate
    3e-4      3.000      2.932        2.469     2.507
    1e-3      2.309      2.229        1.917     2.040
    3e-3      1.985      2.141        1.589     1.825
    1e-2      1.635      1.947        1.597     3.055
    3e-2      1.636      2.216        2.942     2.950

    LSTM: best lr 1e-2 for both, Spearman 0.90 (full models 65 s, fused surrogates 7 s)
    GRU:  best lr 3e-3 for both, Spearman 0.40 (the surrogate diverges one step earlier on
          the grid, at 1e-2; full models 63 s, fused surrogates 11 s)
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydro
import hydro.optim
from benchmarks.recurrent import RNNModel


def _text() -> torch.Tensor:
    from pydoc_data.topics import topics

    text = "".join(topics.values())
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), len(chars)


def _batch(data: torch.Tensor, step: int, bptt: int, batch: int, offset: int = 0) -> tuple:
    g = torch.Generator().manual_seed(offset + step)
    starts = torch.randint(0, len(data) - bptt - 1, (batch,), generator=g)
    rows = torch.stack([data[s : s + bptt + 1] for s in starts.tolist()], 1)  # [T + 1, B]
    return rows[:-1], rows[1:]


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _spearman(a: list[float], b: list[float]) -> float:
    ra = torch.tensor(a).argsort().argsort().double()
    rb = torch.tensor(b).argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ratio", type=int, default=8)
    parser.add_argument("--kind", default="LSTM")
    parser.add_argument("--lrs", default="3e-4,1e-3,3e-3,1e-2,3e-2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data, vocab = _text()
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    lrs = [float(x) for x in args.lrs.split(",")]
    bptt, batch = 35, 20

    def evaluate(model: torch.nn.Module, fused: bool = False) -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            total = 0
            for k in range(4):
                x, y = _batch(val, k, bptt, batch, offset=10_000)
                out = model(x)
                total = total + (hydro.trial_loss(_loss, out, y) if fused else _loss(out, y))
        model.train()
        return total / 4

    start = time.perf_counter()
    full = []
    for lr in lrs:
        torch.manual_seed(0)
        model = RNNModel(args.kind, vocab, 200, 200, 2, False)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        for step in range(args.steps):
            x, y = _batch(train, step, bptt, batch)
            opt.zero_grad()
            _loss(model(x), y).backward()
            opt.step()
        full.append(float(evaluate(model)))
    full_s = time.perf_counter() - start

    start = time.perf_counter()
    torch.manual_seed(0)
    target = RNNModel(args.kind, vocab, 200, 200, 2, False)
    x0, _ = _batch(train, 0, bptt, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sur = hydro.scale(target, args.ratio, example_inputs=(x0,), seed=0)
    fused = hydro.fuse(sur, n=len(lrs), seed=0)
    opt = hydro.optim.Adam(fused.parameters(), lr=lrs)
    for step in range(args.steps):
        x, y = _batch(train, step, bptt, batch)
        opt.zero_grad()
        hydro.trial_loss(_loss, fused(x), y).sum().backward()
        opt.step()
    small = [float(v) for v in evaluate(fused, fused=True)]
    small_s = time.perf_counter() - start

    hidden = sur.get_parameter("rnn.weight_hh_l0").shape[1]
    print(f"{args.kind}, 2 layers, hidden 200 (surrogate {hidden}), {args.steps} Adam steps of "
          f"[{bptt} x {batch}] characters, validation loss per learning rate")
    print(f"{'lr':>8} {'full':>8} {'surrogate':>10}")
    for lr, f, s in zip(lrs, full, small):
        print(f"{lr:>8g} {f:>8.3f} {s:>10.3f}")
    best_f, best_s = lrs[full.index(min(full))], lrs[small.index(min(small))]
    print(f"best lr: full {best_f:g}, surrogate {best_s:g}; Spearman over the grid "
          f"{_spearman(full, small):.2f}; time: full models {full_s:.0f} s, fused surrogates "
          f"{small_s:.0f} s")


if __name__ == "__main__":
    main()

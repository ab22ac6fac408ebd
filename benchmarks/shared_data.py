"""``data_mode: shared`` vs per-trial streams on a loading-bound pipeline (issue 21 point 4).

The training data is a ``Dataset`` of compressed grayscale images: each sample is decoded on
the CPU (zlib, then a PNG-style "up" filter undone row by row in Python) and augmented (a
random crop of the padded image, a random horizontal flip, noise), as a real image pipeline
does per sample. A fused group of ``n`` MLP surrogates trains on it both ways, built once,
timed in interleaved rounds (medians):

- ``per_trial`` (the default): each member reads its own stream: ``n`` batches loaded per step;
- ``shared``: one stream for the group: one batch loaded per step, fed to every member.

``--in-memory`` decodes the images once into tensors instead (no augmentation): a batch is an
index into them, the case where loading costs little.

Throughput is trial-steps per second (``n`` trial-steps per fused step), per second of this
process's CPU time (one thread: the wall time on an idle core; a machine shared with other jobs
stretches the wall time of both ways alike), and per wall-clock second.

    python benchmarks/shared_data.py --threads 1 --n 16 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydro
from hydro.tuning.group import FusedGroup

SIDE, PAD, CLASSES = 28, 2, 10


def encode(image: np.ndarray) -> bytes:
    """A PNG-like encoding: each row minus the row above (mod 256), then zlib."""
    up = image.astype(np.int16)
    up[1:] -= image[:-1].astype(np.int16)
    return zlib.compress((up % 256).astype(np.uint8).tobytes(), 6)


class Images(Dataset):
    """Compressed images, decoded and augmented per sample on every read."""

    def __init__(self, size: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.labels = rng.integers(0, CLASSES, size)
        base = rng.integers(0, 256, (CLASSES, SIDE, SIDE))
        self.records = []
        for y in self.labels:  # a class pattern plus noise, as bytes
            img = np.clip(base[y] + rng.normal(0, 40, (SIDE, SIDE)), 0, 255).astype(np.uint8)
            self.records.append(encode(img))
        self.rng = np.random.default_rng(seed + 1)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        rows = np.frombuffer(zlib.decompress(self.records[i]), np.uint8).reshape(SIDE, SIDE)
        img = rows.copy()
        for r in range(1, SIDE):  # undo the "up" filter, row by row
            img[r] += img[r - 1]
        x = img.astype(np.float32) / 255.0
        x = np.pad(x, PAD, mode="reflect")
        top, left = self.rng.integers(0, 2 * PAD + 1, 2)
        x = x[top : top + SIDE, left : left + SIDE]
        if self.rng.random() < 0.5:
            x = x[:, ::-1]
        x = (x - 0.5) / 0.25 + self.rng.normal(0, 0.05, x.shape).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(x).reshape(-1)), int(self.labels[i])


def make_task(data_mode: str, batch_size: int, width: int, in_memory: bool = False) -> hydro.Task:
    train, val = Images(4096, seed=0), Images(256, seed=1)
    if in_memory:
        train = tuple(torch.utils.data.default_collate([train[i] for i in range(len(train))]))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(SIDE * SIDE, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, CLASSES))
    return hydro.Task(model=model, train_data=train, val_data=val, batch_size=batch_size,
                      steps=10_000, data_mode=data_mode)


def timed(group: FusedGroup, steps: int) -> tuple[float, float]:
    """CPU and wall seconds for ``steps`` fused steps (losses read each step, as the tuner
    does)."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        group.step().tolist()
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", nargs="*", type=int, default=[16])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--ratio", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="fused steps per timed round")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--in-memory", action="store_true", help="tensors: no per-batch loading")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s); MLP {SIDE * SIDE}-{args.width}-"
          f"{args.width}-{CLASSES} at ratio {args.ratio}, batch {args.batch_size}; "
          f"trial-steps/s, medians of {args.repeats} interleaved rounds of {args.steps} fused "
          "steps\n")
    sample = Images(512)
    start = time.process_time()
    for i in range(512):
        sample[i]
    load_ms = (time.process_time() - start) / 512 * args.batch_size * 1e3
    print(f"loading one batch (decode + augment): {load_ms:.2f} ms of CPU\n")
    print("| n | per_trial | shared | shared / per_trial | wall: per_trial | shared | ratio |")
    print("|---|---|---|---|---|---|---|")
    for n in args.n:
        members = [(k, {"lr": 1e-3 * (k + 1)}, k) for k in range(n)]
        groups = {mode: FusedGroup(make_task(mode, args.batch_size, args.width, args.in_memory),
                                   members,
                                   ratio=args.ratio, refill=False)
                  for mode in ("per_trial", "shared")}
        cpu: dict[str, list[float]] = {mode: [] for mode in groups}
        wall: dict[str, list[float]] = {mode: [] for mode in groups}
        for group in groups.values():
            timed(group, 3)  # warm-up: first batches, allocations
        for _ in range(args.repeats):
            for mode, group in groups.items():
                c, w = timed(group, args.steps)
                cpu[mode].append(n * args.steps / c)
                wall[mode].append(n * args.steps / w)
        per, shared = (statistics.median(cpu[m]) for m in ("per_trial", "shared"))
        wper, wshared = (statistics.median(wall[m]) for m in ("per_trial", "shared"))
        print(f"| {n} | {per:.0f} | {shared:.0f} | {shared / per:.1f}x | {wper:.0f} | "
              f"{wshared:.0f} | {wshared / wper:.1f}x |")


if __name__ == "__main__":
    main()

"""Training functions written as a user writes them, for the own-loop tests (module level, so
an executor's workers import them)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import hydro

# (trial, step) -> the trial's model and optimizer slices after that step, when recording
RECORD: dict[tuple[int, int], dict[str, Any]] | None = None


def data(rows: int = 256, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 8, generator=g, dtype=dtype)
    y = (x @ torch.randn(8, 3, generator=g, dtype=dtype)).argmax(-1)
    return x, y


def mlp(width: int = 32, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 3)).to(dtype)


def evaluate(run: hydro.Run) -> torch.Tensor:
    """Each trial's loss on the validation data, ``[n]``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in run.val_batches():
            total = total + hydro.trial_loss(F.cross_entropy, run.model(x), y) * len(y)
            count += len(y)
    return total / count


def train(run: hydro.Run) -> None:
    """Adam with a cosine schedule, per-trial batches, gradient accumulation over two
    micro-batches and clipping per trial: what a user's loop does."""
    opt = run.register(hydro.optim.Adam(run.model.parameters(), lr=run.hparam("lr"),
                                        betas=(run.hparam("beta1", 0.9), 0.999)))
    sched = run.register(hydro.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=run.steps))
    for _ in run:
        opt.zero_grad()
        for _ in range(2):
            x, y = run.batch()
            loss = hydro.trial_loss(F.cross_entropy, run.model(x, shared=False), y, shared=False)
            (loss.sum() / 2).backward()
        hydro.optim.clip_grad_norm_(run.model, [1.0] * run.n)
        opt.step()
        sched.step()
        if RECORD is not None:
            for p, number in enumerate(run.trials):
                if number is not None:
                    RECORD[(number, run.step[p] + 1)] = {
                        "model": run.model.trial_state(p),
                        "opt": opt.trial_state(p),
                    }
        if run.due:
            run.report(evaluate(run))


def slow_train(run: hydro.Run) -> None:
    """:func:`train`, and at step ``HYDRO_TEST_BLOCK_AT`` of any trial write the marker file
    ``HYDRO_TEST_MARKER`` and wait to be killed."""
    at = int(os.environ.get("HYDRO_TEST_BLOCK_AT", "0"))
    marker = os.environ.get("HYDRO_TEST_MARKER", "")
    opt = run.register(hydro.optim.SGD(run.model.parameters(), lr=run.hparam("lr"),
                                       momentum=0.9))
    for _ in run:
        x, y = run.batch()
        loss = hydro.trial_loss(F.cross_entropy, run.model(x, shared=False), y, shared=False)
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
        if at and max(run.step) + 1 >= at and marker and not Path(marker).exists():
            Path(marker).write_text(str(os.getpid()))
            while True:  # the test SIGKILLs this process here
                time.sleep(0.1)
        if run.due:
            run.report(evaluate(run))


def config_data() -> dict[str, Any]:
    """A config's ``task.data``: the split of :func:`data`."""
    x, y = data()
    return {"train": (x[:192], y[:192]), "val": (x[192:], y[192:])}


def precision_train(run: hydro.Run, path: str) -> None:
    """:func:`train`, after writing the process's float32 matmul precision to ``path``."""
    Path(path).write_text(torch.get_float32_matmul_precision())
    train(run)

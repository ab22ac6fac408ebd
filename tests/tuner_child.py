"""A real ``hydro.tune`` process for the fault tests, that can stop at a known point.

``python -m tests.tuner_child STORAGE N_TRIALS [--stop ask:K|train:K] [--marker FILE] ...``

With ``--stop ask:K`` the process writes ``--marker`` and blocks forever just before its K-th
``study.ask()``; with ``train:K`` just before building its K-th group in process (the group's
trials are asked, sampled and RUNNING). The test then SIGKILLs it at a state it knows, with no
timing guess.
With ``--kill-worker-at STEP`` (local executor) the first worker to reach that training step
SIGKILLs itself (once: a marker file remembers it), so its group is retried. With
``--block-at STEP`` whichever process trains (this one, or a worker) writes ``--marker`` and
blocks at that training call, for the test to SIGKILL the tuner mid-group.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import torch

ROOT = Path(__file__).resolve().parents[1]


def make_task(steps: int, kill_at: int = 0, kill_marker: str = "", *, block_at: int = 0,
              eval_every: int = 0, checkpoint_every: int = 50) -> Any:
    import hydro

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(-1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    loss = "cross_entropy"
    if kill_at:
        loss = KillingLoss(kill_at, kill_marker)
    if block_at:
        loss = BlockingLoss(block_at, kill_marker)
    return hydro.Task(model=model, train_data=(x[:192], y[:192]), val_data=(x[192:], y[192:]),
                      steps=steps, eval_every=eval_every or steps, batch_size=32, loss=loss,
                      checkpoint_every=checkpoint_every)


class BlockingLoss:
    """Cross-entropy that writes ``marker`` and blocks at its ``step``-th training call."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker, self.calls = step, marker, 0

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls == self.step:
                _block(self.marker)
        return torch.nn.functional.cross_entropy(out, y)


class KillingLoss:
    """Cross-entropy that SIGKILLs its own (worker) process at a training step, once."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker, self.calls = step, marker, 0

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls == self.step and not os.path.exists(self.marker):
                Path(self.marker).write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
        return torch.nn.functional.cross_entropy(out, y)


SPACE = {
    "lr": optuna.distributions.FloatDistribution(1e-3, 1e-1, log=True),
    "weight_decay": optuna.distributions.FloatDistribution(0.0, 0.1),
}


def _block(marker: str) -> None:
    Path(marker).write_text(str(os.getpid()))
    while True:
        time.sleep(60)


def main(argv: list[str] | None = None) -> None:
    import hydro
    import hydro.tuning.stream as driver  # start_group: where the in-process stream builds groups

    p = argparse.ArgumentParser()
    p.add_argument("storage")
    p.add_argument("n_trials", type=int)
    p.add_argument("--fuse", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--executor", default=None)
    p.add_argument("--stop", default="")
    p.add_argument("--marker", default="")
    p.add_argument("--kill-worker-at", type=int, default=0)
    p.add_argument("--block-at", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--checkpoint-dir", default=None)
    a = p.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if a.stop:
        where, k = a.stop.split(":")
        calls = {"n": 0}
        if where == "ask":
            ask = optuna.Study.ask

            def stopping_ask(self, *args, **kw):
                calls["n"] += 1
                if calls["n"] == int(k):
                    _block(a.marker)
                return ask(self, *args, **kw)

            optuna.Study.ask = stopping_ask
        elif where == "put":  # a freed slot taking its next trial (continuous batching)
            from hydro.tuning.group import FusedGroup

            put = FusedGroup.put

            def stopping_put(self, *args, **kw):
                calls["n"] += 1
                if calls["n"] == int(k):
                    _block(a.marker)
                return put(self, *args, **kw)

            FusedGroup.put = stopping_put
        else:
            train = driver.start_group

            def stopping_train(*args, **kw):
                calls["n"] += 1
                if calls["n"] == int(k):
                    _block(a.marker)
                return train(*args, **kw)

            driver.start_group = stopping_train
    executor = None
    if a.executor == "local":
        from hydro_fluid import LocalExecutor

        executor = LocalExecutor(devices=[], num_workers=1, max_retries=2)
    task = make_task(a.steps, a.kill_worker_at, a.marker, block_at=a.block_at,
                     eval_every=a.eval_every, checkpoint_every=a.checkpoint_every)
    storage = a.storage
    if storage.startswith("journal:"):  # a journal file, as several processes share it
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        storage = JournalStorage(JournalFileBackend(storage[len("journal:") :]))
    # the run a test kills trains with a blocking or killing loss, its rerun with plain
    # cross-entropy: the same study, whose recorded loss differs by name only
    hydro.tune(task, SPACE, n_trials=a.n_trials, ratio=2, fuse=a.fuse, storage=storage,
               seed=a.seed, pruner=optuna.pruners.NopPruner(), executor=executor,
               checkpoint_dir=a.checkpoint_dir, force_resume=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()

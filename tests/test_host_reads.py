"""A fused training step reads nothing back on the host (on an accelerator every such read waits
for the device); the tuner's loop reads its flags once per evaluation.

Counted on this CPU with the accelerator's path switched on (``hydro.host.FREE`` emptied): the
ops that read a value on the host (``item``, ``bool``, ``nonzero``, boolean masks) through a
dispatch mode, ``tolist``/``numpy`` (which do not dispatch) by wrapping them."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hydro
import hydro.host
from examples.charlm.model import GPT
from examples.models import ResNet
from hydro.tuning.group import FusedGroup
from hydro.tuning.lockstep import train_group
from hydro.tuning.slots import train_slots

_READS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.is_nonzero.default,
}


class HostReads(TorchDispatchMode):
    """Counts reads of tensor values on the host while active."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self.active = False
        super().__exit__(*exc)

    def keep_on_host(self, opt: torch.optim.Optimizer) -> None:
        """``opt``'s per-trial hyperparameters live on the host by design: not counted."""
        self.optimizers.append(opt)

    def on_host(self, t: torch.Tensor) -> bool:
        for opt in self.optimizers:
            for group in opt.param_groups:
                for v in group.values():
                    if any(x is t for x in (v if isinstance(v, tuple) else (v,))):
                        return True
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        bool_index = func is torch.ops.aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        )
        if func in _READS or bool_index:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def reads(monkeypatch):
    """The accelerator's path on this CPU, and a counter of host reads (``.reads``)."""
    monkeypatch.setattr(hydro.host, "FREE", set())
    counter = HostReads()
    for name in ("tolist", "numpy"):
        original = getattr(torch.Tensor, name)

        def wrapped(self, *a, _original=original, _name=name, **kw):
            if counter.active and not counter.on_host(self):
                counter.reads.append(_name)
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return counter


def _mlp_task(**kw) -> hydro.Task:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(-1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 3))
    kw = {"steps": 12, "eval_every": 4, "batch_size": 16, **kw}
    return hydro.Task(model=model, train_data=(x[:192], y[:192]), val_data=(x[192:], y[192:]),
                      **kw)


def _cnn_task() -> hydro.Task:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 16, 16, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)
    return hydro.Task(model=ResNet(width=16), train_data=(x[:48], y[:48]),
                      val_data=(x[48:], y[48:]), steps=12, eval_every=4, batch_size=8)


def _gpt_task() -> hydro.Task:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 96, (64, 33), generator=g)
    model = GPT(n_layer=2, n_head=4, n_embd=64, block_size=32, dropout=0.1)
    return hydro.Task(model=model, train_data=(idx[:48, :-1], idx[:48, 1:]),
                      val_data=(idx[48:, :-1], idx[48:, 1:]), steps=12, eval_every=4,
                      batch_size=4, scheduler="cosine")


SPACE = {"lr": 1e-3, "weight_decay": 0.1, "warmup": 2, "grad_clip": 1.0, "beta2": 0.99}


@pytest.mark.parametrize("make", [_mlp_task, _cnn_task, _gpt_task], ids=["mlp", "cnn", "gpt"])
def test_a_tuner_step_reads_nothing_on_the_host(make, reads) -> None:
    task = make()
    extra = {"dropout": 0.1} if make is _gpt_task else {}
    members = [(k, {**SPACE, "lr": 1e-3 * (k + 1), **extra}, k) for k in range(4)]
    group = FusedGroup(task, members, ratio=2)
    group.step()  # captures and builds the graphs outside the count
    reads.keep_on_host(group.opt)
    with reads:
        for _ in range(3):
            losses = group.step()  # forward, losses, backward, clipping, AdamW, schedules
    assert reads.reads == []
    assert torch.isfinite(losses).all() and losses.shape == (4,)


class _Source:
    """A trial source that prunes nothing, has nothing more to ask, and notes how many host
    reads each fused step of the loop made (see :func:`hydro.tuning.slots.train_slots`)."""

    asking = False

    def __init__(self, counter: HostReads) -> None:
        self.counter, self.per_step, self.told, self.seen = counter, [], {}, 0

    def stepped(self, live: int) -> None:
        self.per_step.append(len(self.counter.reads) - self.seen)
        self.seen = len(self.counter.reads)

    def report(self, items: list) -> set:
        return set()

    def refill(self, told: list, slots: list, key: tuple) -> list:
        self.told.update({number: outcome for number, outcome, _ in told})
        return [None] * len(slots)


def test_the_loop_reads_flags_once_per_evaluation_and_names_the_diverged_step(reads) -> None:
    task = _mlp_task(steps=12, eval_every=4)
    # trial 1 diverges within a few steps: its learning rate is absurd
    members = [(0, {"lr": 1e-3}, 0), (1, {"lr": 1e9}, 1), (2, {"lr": 3e-3}, 2)]
    group = FusedGroup(task, members, ratio=2)
    source = _Source(reads)
    reads.keep_on_host(group.opt)
    with reads:
        train_slots(group, source, fuse=3, joined={})
    # the reads of step s land in the count taken at step s + 1 (stepped comes first)
    counts = source.per_step[1:] + [len(reads.reads) - source.seen]
    quiet = [c for s, c in enumerate(counts, 1) if s % 4]
    assert quiet == [0] * len(quiet), counts
    failed = source.told.pop(1)
    assert failed.state == "fail" and failed.step < 4
    assert failed.reason == f"diverged at step {failed.step}: non-finite loss or gradient"
    assert {k: o.state for k, o in source.told.items()} == {0: "complete", 2: "complete"}


def test_divergence_is_found_at_the_same_step_when_reads_are_free(monkeypatch) -> None:
    task = _mlp_task(steps=12, eval_every=4)
    params = [{"lr": 1e-3}, {"lr": 1e9}, {"lr": 3e-3}]
    outcomes = {}
    for free in ({"cpu"}, set()):
        monkeypatch.setattr(hydro.host, "FREE", free)
        ended, _ = train_group(task, params, ratio=2, seeds=[0, 1, 2])
        outcomes[bool(free)] = [(o.state, o.step, o.reason, o.value) for o in ended]
    assert outcomes[True] == outcomes[False]
    assert outcomes[True][1][0] == "fail" and outcomes[True][1][1] < 4
    assert all(math.isfinite(o[3]) for o in (outcomes[True][0], outcomes[True][2]))


def test_refilled_slots_keep_every_evaluation_shared_by_all_slots() -> None:
    """A diverged slot takes its next trial at an evaluation step, so the group's slots stay in
    phase: each evaluation of the fused model is due for every slot it evaluates."""
    task = _mlp_task(steps=12, eval_every=4)
    waiting = [(3, {"lr": 1e9}, 3), (4, {"lr": 2e-3}, 4), (5, {"lr": 1e-3}, 5)]

    class Refill(_Source):
        def refill(self, told: list, slots: list, key: tuple) -> list:
            super().refill(told, slots, key)
            return [waiting.pop(0) if waiting else None for _ in slots]

    group = FusedGroup(task, [(0, {"lr": 1e-3}, 0), (1, {"lr": 1e9}, 1), (2, {"lr": 3e-3}, 2)],
                       ratio=2)
    evaluated = []
    plain = group.evaluate

    def evaluate(full=None) -> list[float]:
        evaluated.append((len(group.due()), group.n))
        return plain(full)

    group.evaluate = evaluate
    source = Refill(HostReads())
    train_slots(group, source, fuse=3, joined={})
    assert not waiting and sorted(source.told) == [0, 1, 2, 3, 4, 5]
    assert [source.told[k].state for k in (1, 3)] == ["fail", "fail"]
    assert evaluated and all(due == n for due, n in evaluated), evaluated

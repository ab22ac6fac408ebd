"""The compiled fused step (``hydro.fuse(compile=...)``, :mod:`hydro.fusion.compiled`).

Compiled fused training equals eager fused training step by step in float64 (loss, gradients,
parameters, optimizer state, buffers), per-trial dropout included; a diverging trial is frozen
and isolated as eagerly; a refill reuses the compiled graph (no compilation), a new fusion size
compiles once per mode; a failing compiler falls back to eager with a warning; bad ``compile=``
values are refused. The inductor compiles of these tiny graphs take seconds (less with a warm
on-disk inductor cache).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import hydro
import hydro.optim
from hydro.errors import FuseError
from hydro.fusion import FusedModel
from tests.fusion.compile_cases import (
    TOL,
    assert_same,
    gpt,
    gpt_batch,
    gpt_losses,
    mlp,
    mlp_batch,
    mlp_losses,
    snapshot,
)

STEPS = 3


CASES = {"mlp": (mlp, mlp_batch, mlp_losses), "gpt": (gpt, gpt_batch, gpt_losses)}


# The tests of the mechanism (graph counts, refills, input forms) compile through AOTAutograd
# without inductor: the same lifting, functionalization and backward, seconds instead of a
# minute per graph on a cold cache. Inductor's own exactness is proven on the MLP and the GPT.
AOT = {"backend": "aot_eager"}


def build(case: str, compile: object, lrs: list[float], rates=(0.1, 0.2, 0.3)):
    make = CASES[case][0]
    fused = hydro.fuse([make(p) for p in rates], compile=compile).double().train()
    backend = compile.get("backend", True) if isinstance(compile, dict) else bool(compile)
    opt = hydro.optim.AdamW(fused.parameters(), lr=lrs, weight_decay=0.01, compile=backend)
    return fused, opt


def train(case: str, fused: FusedModel, opt: torch.optim.Optimizer, steps: int) -> list:
    """Every step's losses, gradients, parameters, optimizer state and buffers (copies)."""
    _, batch, losses_of = CASES[case]
    records = []
    for s in range(steps):
        x, y = batch(s)
        losses = losses_of(fused(x), y)
        opt.zero_grad(set_to_none=True)
        losses.sum().backward()
        fused.diverged.logical_or_(~torch.isfinite(losses.detach()))
        grads = {k: p.grad.clone() for k, p in fused.named_parameters()}
        opt.step()
        records.append({**snapshot(fused, opt, losses), "grad": grads})
    return records


@pytest.fixture(scope="module")
def mlp_pair() -> tuple:
    """Eager and compiled runs of the fused MLP (BatchNorm, per-trial dropout): 3 AdamW steps."""
    lrs = [1e-2, 2e-2, 3e-2]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the tests: dynamo guards on the thread count
    try:
        eager = build("mlp", False, lrs)
        compiled = build("mlp", True, lrs)
        return train("mlp", *eager, STEPS), train("mlp", *compiled, STEPS), compiled
    finally:
        torch.set_num_threads(threads)


def test_compiled_mlp_equals_eager(mlp_pair: tuple) -> None:
    eager, compiled, (fused, _) = mlp_pair
    assert_same(eager, compiled)
    # dropout drew per-trial masks: the trials' losses differ, each trial's stream moved
    assert fused.trial_step.tolist() == [STEPS] * 3
    # one training graph (forward and backward), compiled once
    assert fused.compile_stats["compiles"] == 1
    assert fused.compile_stats["seconds"] > 0


def test_compiled_gpt_equals_eager() -> None:
    lrs = [3e-3, 1e-2, 2e-2]
    eager = train("gpt", *build("gpt", False, lrs), STEPS)
    fused, opt = build("gpt", True, lrs)
    compiled = train("gpt", fused, opt, STEPS)
    assert_same(eager, compiled)
    assert fused.compile_stats["compiles"] == 1


def test_divergence_is_isolated() -> None:
    """A trial given a huge learning rate goes non-finite and is frozen; the others are exactly
    the eager run's (whose own diverged trial is frozen the same way)."""
    lrs = [1e-2, 1e9, 3e-2]
    runs = []
    for compile in (False, True):
        fused, opt = build("mlp", compile, lrs)
        with torch.no_grad():  # and a huge readout: its squared error overflows at once
            fused.get_parameter("4.weight")[1].mul_(1e160)
        runs.append((train("mlp", fused, opt, 4), fused))
    (eager, fe), (compiled, fc) = runs
    assert fc.diverged.tolist() == fe.diverged.tolist() == [False, True, False]
    assert_same(eager, compiled, trials=[0, 2])
    # the diverged trial is frozen from its first step: parameters and state never change
    for record in compiled[1:]:
        for kind in ("param", "state"):
            for name, value in record[kind].items():
                assert torch.equal(value[1], compiled[0][kind][name][1]), (kind, name)


def test_refill_does_not_recompile() -> None:
    fused, opt = build("mlp", AOT, [1e-2, 2e-2, 3e-2])
    train("mlp", fused, opt, 1)
    x, y = mlp_batch(0)
    before = fused.compile_stats["compiles"]
    for k, rate in enumerate((0.05, 0.25, 0.15)):  # refills: new weights and dropout rates
        fused.load_trial(k % 3, mlp(rate).double(), seed=10 + k)
        opt.reset_trial(k % 3, lr=1e-3)
        losses = mlp_losses(fused(x), y)
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
    del losses  # select resizes parameters in place: no autograd graph may hold them
    assert fused.compile_stats["compiles"] == before
    fused.eval()
    with torch.no_grad():
        fused(x)
        fused(x)
    assert fused.compile_stats["compiles"] == before + 1  # the evaluation graph, once
    fused.train()
    fused.select([0, 2])  # a new fusion size: one compile per mode
    opt.select([0, 2])
    mlp_losses(fused(x), y).sum().backward()
    fused.eval()
    with torch.no_grad():
        fused(x)
    assert fused.compile_stats["compiles"] == before + 3
    fused.train()


def test_refill_result_equals_eager() -> None:
    """After refills, the compiled model still computes what the eager one does."""
    models = []
    for compile in (False, True):
        fused, opt = build("mlp", compile, [1e-2, 2e-2, 3e-2])
        train("mlp", fused, opt, 1)
        fused.load_trial(1, mlp(0.4).double(), seed=7)
        opt.reset_trial(1, lr=5e-3)
        models.append(train("mlp", fused, opt, 2))
    assert_same(*models)


def test_failing_compiler_falls_back_to_eager() -> None:
    def broken(gm: torch.fx.GraphModule, example: list) -> object:
        raise RuntimeError("no kernels today")

    eager = train("mlp", *build("mlp", False, [1e-2] * 3), 2)
    fused, opt = build("mlp", {"backend": broken}, [1e-2] * 3)
    opt.compile = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = train("mlp", fused, opt, 2)
    messages = [str(w.message) for w in caught if "torch.compile failed" in str(w.message)]
    assert len(messages) == 1 and "no kernels today" in messages[0]
    assert "no kernels today" in fused.compile_stats["failed"]
    assert_same(eager, compiled)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("auto", "tuner setting"),
        ("fast", "not a torch.compile mode"),
        (3, "is not accepted"),
        ({"bogus": 1}, "unknown torch.compile argument"),
        ({"mode": "quick"}, "not a torch.compile mode"),
        ({"backend": "eager", "mode": "default"}, "not both"),
    ],
)
def test_bad_compile_values_are_refused(value: object, says: str) -> None:
    with pytest.raises(FuseError, match=says):
        hydro.fuse(nn.Linear(2, 2), n=2, compile=value)


def test_reduce_overhead_on_cpu_maps_to_default() -> None:
    """CUDA graphs need CUDA (untested here: no GPU): on a CPU the mode says so and compiles
    in the default mode, with eager's results."""
    fused = hydro.fuse(nn.Linear(3, 2).double(), n=2, compile="reduce-overhead")
    eager = hydro.fuse(nn.Linear(3, 2).double(), n=2)
    eager.load_state_dict(fused.state_dict())
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="CUDA graphs need a CUDA device"):
        out = fused(x)
    torch.testing.assert_close(out, eager(x), **TOL)


def test_equal_dropout_rates_compile_as_one_graph() -> None:
    """A rate equal in every trial is a constant of the graph: its scale (read on the host) must
    not split the compiled graph (one compile, not one per dropout site)."""
    lrs = [1e-2, 2e-2]
    eager = train("gpt", *build("gpt", False, lrs, rates=(0.1, 0.1)), 2)
    fused, opt = build("gpt", AOT, lrs, rates=(0.1, 0.1))
    assert_same(eager, train("gpt", fused, opt, 2))
    assert fused.compile_stats["compiles"] == 1


def test_per_trial_inputs_compiled_equal_eager() -> None:
    """``shared=False`` (each trial its own batch) runs compiled too, with eager's outputs and
    gradients."""
    runs = []
    for compile in (False, AOT):
        fused = hydro.fuse([mlp(p) for p in (0.1, 0.2)], compile=compile).double().train()
        xs = torch.randn(2, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        out = fused(xs, shared=False)
        out.square().sum().backward()
        runs.append((out.detach(), {k: p.grad for k, p in fused.named_parameters()}))
    torch.testing.assert_close(runs[0][0], runs[1][0], **TOL)
    for name, grad in runs[0][1].items():
        torch.testing.assert_close(grad, runs[1][1][name], **TOL)


class Keyed(nn.Module):
    """Inputs by keyword, as a HuggingFace model takes them."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
        out = self.proj(x)
        return {"out": out * mask.unsqueeze(-1) if mask is not None else out}


def test_keyword_inputs_and_dict_outputs_compiled() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 4, dtype=torch.float64)
    mask = (torch.arange(5) % 2).double()
    outs = []
    for compile in (False, True):
        torch.manual_seed(0)
        fused = hydro.fuse(Keyed().double(), n=2, compile=compile)
        outs.append(fused(x=x, mask=mask)["out"])
    torch.testing.assert_close(outs[0], outs[1], **TOL)
    assert outs[1].shape == (2, 5, 3)
    assert fused.compile_stats["compiles"] == 1 and "failed" not in fused.compile_stats


def test_relu_saves_its_activation_not_a_bool_mask() -> None:
    """With inductor's decompositions, ReLU's backward reads ``out <= 0``: the compiled forward
    must not save that bool mask (inductor's CPU kernels store it ~15x slower than eager) but
    recompute it from the activation the next layer's gradient saves anyway."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 3))
    compiled = hydro.fuse(model, n=2, compile={"backend": "aot_eager_decomp_partition"})
    eager = hydro.fuse(model, n=2)
    x = torch.randn(8, 6)
    saved: list[torch.dtype] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compiled(x)
    assert saved and torch.bool not in saved, saved
    out.square().sum().backward()
    eager(x).square().sum().backward()
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_new_batch_size_compiles_one_graph_for_all_sizes() -> None:
    """On a CPU the first input shape compiles a static graph, called without dynamo; a second
    one compiles one graph with dynamic shapes (through dynamo) that serves it and every later
    size. A graph with random streams goes through dynamo from the start (inductor's on-disk
    cache refuses it called directly)."""

    def plain() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))

    fused = hydro.fuse([plain(), plain()], compile=AOT).double()
    eager = hydro.fuse([plain(), plain()]).double()
    g = torch.Generator().manual_seed(5)
    counts, through_dynamo = [], []
    for batch in (8, 5, 3, 8):
        x = torch.randn(batch, 6, dtype=torch.float64, generator=g)
        out = fused(x)
        torch.testing.assert_close(out, expected := eager(x), **TOL)
        out.sum().backward()
        expected.sum().backward()
        counts.append(fused.compile_stats["compiles"])
        through_dynamo.append(len(fused._compiler._dynamic))
    assert counts == [1, 2, 2, 2]
    assert through_dynamo == [0, 1, 1, 1]
    for (name, p), q in zip(fused.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
    dropout = hydro.fuse([mlp(p) for p in (0.1, 0.2)], compile=AOT).double()
    dropout(torch.randn(8, 6, dtype=torch.float64))
    assert len(dropout._compiler._dynamic) == 1

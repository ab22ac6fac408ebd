"""The whole fused training step as one graph (:mod:`hydro.fusion.step`).

Trained side by side in float64 with the eager fused step (forward, backward, ``opt.step()``):
losses, parameters, optimizer state (``exp_avg``, ``exp_avg_sq``, step counts, momentum) and
buffers (running statistics, random-stream steps, diverged flags) agree to 1e-12 step by step;
a diverging trial leaves the others bit-identical to a run without it; refills, new learning
rates and a scheduler reuse the compiled graph; where the graph does not apply, the step runs
the two-graph path and says why. The mechanism compiles through AOTAutograd without inductor
(``aot_eager``: seconds); inductor's own exactness, and its compile caches, are the last tests'.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import hydro
import hydro.optim
from hydro.errors import FuseError
from hydro.fusion.step import train_step
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

AOT = {"backend": "aot_eager"}


def small(p: float) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(6, 3)


CASES = {"mlp": (mlp, mlp_batch, mlp_losses), "gpt": (gpt, gpt_batch, gpt_losses),
         "small": (small, mlp_batch, mlp_losses)}


def build(case: str, compile: object, optimizer: str = "adamw", rates=(0.1, 0.2, 0.3), **hyper):
    fused = hydro.fuse([CASES[case][0](p) for p in rates], compile=compile).double().train()
    backend = compile.get("backend", True) if isinstance(compile, dict) else bool(compile)
    n = len(rates)
    if optimizer == "sgd":
        hyper = {"lr": [1e-2 * (k + 1) for k in range(n)], **hyper}
        opt = hydro.optim.SGD(fused.parameters(), compile=backend, **hyper)
    else:
        hyper = {"lr": [1e-2 * (k + 1) for k in range(n)], "weight_decay": 0.01, **hyper}
        cls = hydro.optim.AdamW if optimizer == "adamw" else hydro.optim.Adam
        opt = cls(fused.parameters(), compile=backend, **hyper)
    return fused, opt


def train(case: str, fused, opt, steps: int, clip=None, first: int = 0) -> list:
    """Every step's losses, parameters, optimizer state and buffers, through :func:`train_step`
    (the two-graph path where the model is not compiled)."""
    _, batch, losses_of = CASES[case]
    step = train_step(fused, opt, losses_of, clip=clip)
    records = []
    for s in range(first, first + steps):
        x, y = batch(s)
        records.append(snapshot(fused, opt, step((x,), y)))
    return records


def whole(case: str, fused, opt) -> None:
    """Assert that the model's steps ran as one graph (compiled once)."""
    assert train_step(fused, opt, CASES[case][2]).reason is None
    assert fused.compile_stats["compiles"] == 1, fused.compile_stats
    assert fused._compiler._cache == fused._compiler._dynamic == {}  # no forward graph ran


def test_mlp_step_equals_eager() -> None:
    """BatchNorm's running statistics and per-trial dropout rates (random streams) included;
    Adam with L2 weight decay (AdamW's decoupled decay: the other tests)."""
    eager = train("mlp", *build("mlp", False, "adam"), 4)
    fused, opt = build("mlp", AOT, "adam")
    assert_same(eager, train("mlp", fused, opt, 4))
    whole("mlp", fused, opt)
    assert fused.trial_step.tolist() == [4, 4, 4]


def test_gpt_step_equals_eager() -> None:
    """Embeddings, attention, per-trial dropout; AdamW."""
    eager = train("gpt", *build("gpt", False), 3)
    fused, opt = build("gpt", AOT)
    assert_same(eager, train("gpt", fused, opt, 3))
    whole("gpt", fused, opt)


def test_sgd_momentum_nesterov_and_clipping_equal_eager() -> None:
    """Per-trial momentum (one trial without), Nesterov, weight decay and per-trial clipping
    norms (one trial unclipped) in the graph."""
    hyper = {"momentum": [0.9, 0.0, 0.8], "nesterov": [True, False, False],
             "weight_decay": [0.0, 1e-2, 1e-3]}
    clip = [0.05, None, 0.1]
    eager = train("mlp", *build("mlp", False, "sgd", **hyper), 4, clip=clip)
    fused, opt = build("mlp", AOT, "sgd", **hyper)
    assert_same(eager, train("mlp", fused, opt, 4, clip=clip))
    whole("mlp", fused, opt)


def test_diverging_trial_leaves_the_others_bit_identical() -> None:
    """A trial blown up by a huge readout goes non-finite at its first step and is frozen;
    the other trials are bit for bit those of a run without it, the frozen one never moves."""
    runs = []
    for blow in (False, True):
        fused, opt = build("mlp", AOT)
        if blow:
            with torch.no_grad():
                fused.get_parameter("4.weight")[1].mul_(1e160)
        runs.append((train("mlp", fused, opt, 4), fused))
    (clean, _), (blown, fused) = runs
    assert fused.diverged.tolist() == [False, True, False]
    assert fused.trial_step.tolist() == [4, 1, 4]  # its first forward ran before its loss
    assert_same(clean, blown, trials=[0, 2], exact=True)
    for record in blown[1:]:
        for kind in ("param", "state", "buffer"):
            for name, value in record[kind].items():
                if value.dim():
                    assert torch.equal(value[1], blown[0][kind][name][1]), (kind, name)


def test_refills_and_learning_rates_do_not_recompile() -> None:
    """Refills (new weights, dropout rates, optimizer slots), a scheduler's learning rates and a
    new clipping norm run the compiled graph; the results are still the eager step's. A new
    fusion size compiles once more."""
    runs = []
    for compile in (False, AOT):
        fused, opt = build("mlp", compile)
        train("mlp", fused, opt, 1)
        for k, rate in enumerate((0.05, 0.25)):
            fused.load_trial(k, mlp(rate).double(), seed=10 + k)
            opt.reset_trial(k, lr=1e-3 * (k + 2))
        sched = hydro.optim.lr_scheduler.TrialScheduler(
            opt, lambda o, k: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5 + 0.1 * k)
        )
        records = []
        for s in range(1, 4):
            records += train("mlp", fused, opt, 1, clip=[1.0, 0.5 * s, None], first=s)
            sched.step()
        runs.append((records, fused, opt))
    (eager, *_), (compiled, fused, opt) = runs
    assert_same(eager, compiled)
    assert fused.compile_stats["compiles"] == 2  # without clipping, then with (a switch)
    fused.select([0, 2])
    opt.select([0, 2])
    train("mlp", fused, opt, 1)
    assert fused.compile_stats["compiles"] == 3


def host_read_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    scale = float(out.detach().abs().max())  # a host read: does not trace
    return mlp_losses(out / scale, y)


def test_falls_back_to_the_two_graph_step_and_says_why() -> None:
    fused, opt = build("small", False)
    assert "not compiled" in train_step(fused, opt, mlp_losses).reason
    fused, opt = build("small", AOT)
    fused.eval()
    assert "eval mode" in train_step(fused, opt, mlp_losses).reason
    fused.train()
    opt.set_compile(False)
    assert "compile=False" in train_step(fused, opt, mlp_losses).reason
    # a loss with a host read: the step says so and trains as the eager two-graph step does
    eager_fused, eager_opt = build("small", False, "adam")
    fused, opt = build("small", AOT, "adam")
    steps = [train_step(f, o, host_read_loss) for f, o in ((eager_fused, eager_opt), (fused, opt))]
    for s in range(2):
        x, y = mlp_batch(s)
        a, b = (step((x,), y) for step in steps)
        torch.testing.assert_close(a, b, **TOL)
    assert "does not trace" in steps[1].reason
    for p, q in zip(eager_fused.parameters(), fused.parameters()):
        torch.testing.assert_close(p, q, **TOL)
    with pytest.raises(FuseError, match="needs a fused model"):
        train_step(mlp(0.1), opt, mlp_losses)


def test_failing_compiler_warns_and_falls_back() -> None:
    def broken(gm: torch.fx.GraphModule, example: list) -> object:
        raise RuntimeError("no kernels today")

    eager = train("mlp", *build("mlp", False), 2)
    fused, opt = build("mlp", {"backend": broken})
    opt.set_compile(False)
    opt.compile = "aot_eager"  # the optimizer's own graphs compile; the model's fail
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = train("mlp", fused, opt, 2)
    said = [str(w.message) for w in caught if "whole-step compile failed" in str(w.message)]
    assert len(said) == 1 and "no kernels today" in said[0]
    assert_same(eager, compiled)


def test_inductor_step_equals_eager_and_hits_the_compile_caches() -> None:
    """Inductor's kernels for the whole step (forward, loss, backward, isolation, AdamW) in
    float64, on one linear layer: the cheapest compile (~15 s cold on 2 loaded cores). A second
    fused model of the same step compiles through inductor's FX graph cache and AOTAutograd's
    cache, as a new process with a warm on-disk cache does (they bypassed a direct
    ``compile_fx`` call on real inputs: "No shape env")."""
    from torch._dynamo.utils import counters

    eager = train("small", *build("small", False), 3)
    fused, opt = build("small", True)
    assert_same(eager, train("small", fused, opt, 3))
    whole("small", fused, opt)
    before = dict(counters["inductor"]), dict(counters["aot_autograd"])
    again, opt = build("small", True)
    assert_same(eager, train("small", again, opt, 3))
    whole("small", again, opt)
    hits = (counters["inductor"]["fxgraph_cache_hit"] - before[0].get("fxgraph_cache_hit", 0),
            counters["aot_autograd"]["autograd_cache_hit"]
            - before[1].get("autograd_cache_hit", 0))
    assert hits == (1, 1), (hits, dict(counters["inductor"]), dict(counters["aot_autograd"]))


def test_a_third_input_shape_runs_the_two_graph_step() -> None:
    """Two batch sizes (a full and a last short batch) compile a step graph each; a third runs
    the two-graph step (one dynamic-shape forward for every size) with the same results."""
    runs = []
    for compile in (False, AOT):
        fused, opt = build("small", compile)
        step = train_step(fused, opt, mlp_losses)
        g = torch.Generator().manual_seed(1)
        for size in (8, 5, 3, 8):
            x = torch.randn(size, 6, generator=g, dtype=torch.float64)
            step((x,), torch.randn(size, 3, generator=g, dtype=torch.float64))
        runs.append(snapshot(fused, opt, torch.zeros(3)))
    assert_same(runs[:1], runs[1:])
    compiler = fused._compiler
    assert len(compiler._steps) == 2 and len(compiler._cache) == 1  # the forward, for size 3
    assert step.reason is None  # the next step of a compiled size runs its graph again

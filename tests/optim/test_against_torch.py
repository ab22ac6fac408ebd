"""hydro.optim against torch.optim, without hydro.fuse: trial k of stacked parameters equals a
separate model trained by torch.optim (or mup's MuAdam/MuSGD) with trial k's hyperparameters.

Gradients come from the separate models themselves (stacked into the fused parameters' .grad), so
these tests prove the optimizer, schedulers and clipping alone; tests/fusion proves them through
a fused model.
"""

from __future__ import annotations

import copy
import io
import warnings

import mup
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hydro.optim
from hydro.errors import ConfigError
from hydro.optim import lr_scheduler as S

N = 4
STEPS = 6
RTOL = 1e-9


class Net(nn.Module):
    """Linear, conv and a raw vector parameter: ranks 1 to 4."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, width, 3, padding=1)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, 3)
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)).mean(dim=(2, 3)) * self.gain
        return self.fc2(torch.tanh(self.fc1(h)))


def make_models(n: int, mup_base: bool = False) -> list[nn.Module]:
    models = []
    for k in range(n):
        torch.manual_seed(k)
        m = Net().double()
        if mup_base:
            mup.set_base_shapes(m, Net(width=32), rescale_params=False, do_assert=False)
        models.append(m)
    return models


def stacked(models: list[nn.Module]) -> dict[str, nn.Parameter]:
    """Fused parameters ``[n, *p.shape]`` built by stacking, carrying mup's infshape."""
    out = {}
    for name, p in models[0].named_parameters():
        t = nn.Parameter(torch.stack([m.get_parameter(name).detach().clone() for m in models]))
        if hasattr(p, "infshape"):
            t.infshape = p.infshape
        out[name] = t
    return out


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(5, 2, 4, 4, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (5,), generator=g
    )


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    actual, expected = actual.detach().to(expected.dtype), expected.detach()
    assert actual.shape == expected.shape, what
    if not expected.is_floating_point():
        assert torch.equal(actual, expected), what
        return
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    err = float((actual - expected).abs().max()) if expected.numel() else 0.0
    assert err <= RTOL * scale + 1e-15, f"{what}: error {err:.3g} at scale {scale:.3g}"


def run(
    torch_opt,  # (model, k) -> torch optimizer
    fused_opt,  # params -> hydro optimizer
    *,
    torch_sched=None,
    fused_sched=None,
    clip: list[float] | None = None,
    mup_base: bool = False,
    steps: int = STEPS,
) -> None:
    models = make_models(N, mup_base)
    params = stacked(models)
    opts = [torch_opt(m, k) for k, m in enumerate(models)]
    fopt = fused_opt(list(params.values()))
    scheds = [torch_sched(o, k) for k, o in enumerate(opts)] if torch_sched else []
    fsched = fused_sched(fopt) if fused_sched else None
    for step in range(steps):
        x, y = batch(step)
        for m, o in zip(models, opts):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
        for name, p in params.items():  # unclipped: the fused side clips its own
            p.grad = torch.stack([m.get_parameter(name).grad.clone() for m in models])
        if clip is not None:
            for k, m in enumerate(models):
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip[k])
        for o in opts:
            o.step()
        fopt.step()
        for s in scheds:
            s.step()
        if fsched is not None:
            fsched.step()
            for g, group in enumerate(fopt.param_groups):
                lrs = [o.param_groups[g]["lr"] for o in opts]
                assert group["lr"].tolist() == lrs, f"step {step}: lr"
        for k, m in enumerate(models):
            for name, p in m.named_parameters():
                fp = params[name]
                close(fp[k], p, f"step {step}: trial {k} {name}")
                for key, value in opts[k].state[p].items():
                    if value is None:
                        continue
                    close(fopt.state[fp][key][k], value, f"step {step}: trial {k} {key} {name}")


ADAM = dict(
    lr=[1e-3, 3e-3, 1e-2, 2e-3],
    betas=[(0.9, 0.999), (0.8, 0.99), (0.95, 0.9), (0.5, 0.98)],
    eps=[1e-8, 1e-6, 1e-3, 1e-7],
    weight_decay=[0.0, 0.1, 0.01, 0.5],
    amsgrad=[False, True, False, True],
)
SGD = dict(
    lr=[0.1, 0.05, 0.01, 0.2],
    momentum=[0.0, 0.9, 0.5, 0.8],
    dampening=[0.0, 0.0, 0.1, 0.0],
    weight_decay=[0.0, 1e-3, 1e-2, 0.1],
    nesterov=[False, True, False, True],
)


def trial(hp: dict, k: int) -> dict:
    return {key: value[k] for key, value in hp.items()}


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_every_hyperparameter_per_trial(name: str) -> None:
    torch_cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    cls = {"adam": hydro.optim.Adam, "adamw": hydro.optim.AdamW}[name]
    run(lambda m, k: torch_cls(m.parameters(), **trial(ADAM, k)), lambda ps: cls(ps, **ADAM))


def test_sgd_every_hyperparameter_per_trial() -> None:
    run(
        lambda m, k: torch.optim.SGD(m.parameters(), **trial(SGD, k)),
        lambda ps: hydro.optim.SGD(ps, **SGD),
    )


def test_per_trial_clipping() -> None:
    run(
        lambda m, k: torch.optim.AdamW(m.parameters(), **trial(ADAM, k)),
        lambda ps: _clipping(hydro.optim.AdamW(ps, **ADAM), [0.05, 1e6, 0.5, 0.01]),
        clip=[0.05, 1e6, 0.5, 0.01],
    )


def _clipping(opt: hydro.optim.FusedOptimizer, limits: list[float]):
    """``opt`` whose step first clips per trial, as a training loop would."""
    step = opt.step

    def clipped_step(closure=None):
        params = [p for g in opt.param_groups for p in g["params"]]
        norms = hydro.optim.clip_grad_norm_(params, limits)
        assert norms.shape == (N,)
        return step(closure)

    opt.step = clipped_step
    return opt


def test_clip_grad_norm_matches_torch_per_trial() -> None:
    models = make_models(N)
    x, y = batch(0)
    for m in models:
        F.cross_entropy(m(x), y).backward()
    params = stacked(models)
    for name, p in params.items():
        p.grad = torch.stack([m.get_parameter(name).grad.clone() for m in models])
    for norm_type in (2.0, 1.0, float("inf")):
        grads = {name: p.grad.clone() for name, p in params.items()}
        limits = [0.01, 0.1, 1e6, 0.3]
        got = hydro.optim.clip_grad_norm_(list(params.values()), limits, norm_type=norm_type)
        for k, m in enumerate(models):
            ref_model = copy.deepcopy(m)
            for name, p in ref_model.named_parameters():
                p.grad = grads[name][k].clone()
            want = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), limits[k], norm_type)
            close(got[k], want, f"norm {norm_type} trial {k}")
            for name, p in ref_model.named_parameters():
                close(params[name].grad[k], p.grad, f"clipped {name} trial {k}")
        for name, p in params.items():
            p.grad = grads[name]


SCHEDULES = {
    "step": (
        lambda o, k: torch.optim.lr_scheduler.StepLR(o, [1, 2, 3, 1][k], [0.5, 0.1, 0.9, 0.7][k]),
        lambda o: S.StepLR(o, step_size=[1, 2, 3, 1], gamma=[0.5, 0.1, 0.9, 0.7]),
    ),
    "multistep": (
        lambda o, k: torch.optim.lr_scheduler.MultiStepLR(o, [[1, 3], [2], [1, 2], [4]][k], 0.3),
        lambda o: S.MultiStepLR(o, [[1, 3], [2], [1, 2], [4]], gamma=0.3),
    ),
    "exponential": (
        lambda o, k: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9 - 0.1 * k),
        lambda o: S.ExponentialLR(o, gamma=[0.9, 0.8, 0.7, 0.6]),
    ),
    "cosine": (
        lambda o, k: torch.optim.lr_scheduler.CosineAnnealingLR(
            o, 3 + k, [0.0, 1e-4, 2e-4, 3e-4][k]
        ),
        lambda o: S.CosineAnnealingLR(o, [3, 4, 5, 6], [0.0, 1e-4, 2e-4, 3e-4]),
    ),
    "linear": (
        lambda o, k: torch.optim.lr_scheduler.LinearLR(
            o, [0.1, 0.2, 0.3, 0.4][k], 1.0, total_iters=2 + k
        ),
        lambda o: S.LinearLR(o, [0.1, 0.2, 0.3, 0.4], 1.0, total_iters=[2, 3, 4, 5]),
    ),
    "warmup_then_cosine": (
        lambda o, k: torch.optim.lr_scheduler.SequentialLR(
            o,
            [
                torch.optim.lr_scheduler.LinearLR(o, [0.1, 0.2, 0.3, 0.4][k], total_iters=2),
                torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4),
            ],
            milestones=[[2], [3], [2], [1]][k],
        ),
        lambda o: S.SequentialLR(
            o,
            [
                S.LinearLR(o, start_factor=[0.1, 0.2, 0.3, 0.4], total_iters=2),
                S.CosineAnnealingLR(o, T_max=4),
            ],
            milestones=[[2], [3], [2], [1]],
        ),
    ),
    "onecycle": (
        lambda o, k: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.01 * (k + 1), total_steps=8),
        lambda o: S.OneCycleLR(o, max_lr=[0.01, 0.02, 0.03, 0.04], total_steps=8),
    ),
}


@pytest.mark.parametrize("sched", list(SCHEDULES))
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_schedulers(sched: str, name: str) -> None:
    torch_sched, fused_sched = SCHEDULES[sched]
    hp, torch_cls, cls = {
        "adamw": (ADAM, torch.optim.AdamW, hydro.optim.AdamW),
        "sgd": (SGD, torch.optim.SGD, hydro.optim.SGD),
    }[name]
    run(
        lambda m, k: torch_cls(m.parameters(), **trial(hp, k)),
        lambda ps: cls(ps, **hp),
        torch_sched=torch_sched,
        fused_sched=fused_sched,
    )


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_mup_multipliers_match_mup_optimizers(name: str) -> None:
    mu_cls = {"adam": mup.MuAdam, "adamw": mup.MuAdamW, "sgd": mup.MuSGD}[name]
    hp = SGD if name == "sgd" else ADAM
    cls = {"adam": hydro.optim.Adam, "adamw": hydro.optim.AdamW, "sgd": hydro.optim.SGD}[name]
    run(
        lambda m, k: mu_cls(m.parameters(), **trial(hp, k)),
        lambda ps: cls(ps, **hp),
        mup_base=True,
    )


def test_param_groups_keep_their_own_per_trial_values() -> None:
    def torch_opt(m: nn.Module, k: int) -> torch.optim.Optimizer:
        ps = list(m.parameters())  # the same order as the stacked parameters
        return torch.optim.Adam(
            [{"params": ps[:2], "lr": [0.01, 0.02, 0.03, 0.04][k]}, {"params": ps[2:]}],
            lr=1e-3 * (k + 1),
            betas=[(0.9, 0.999), (0.8, 0.99), (0.95, 0.9), (0.5, 0.98)][k],
        )

    def fused_opt(ps: list[torch.Tensor]) -> hydro.optim.Adam:
        return hydro.optim.Adam(
            [{"params": ps[:2], "lr": [0.01, 0.02, 0.03, 0.04]}, {"params": ps[2:]}],
            lr=[1e-3, 2e-3, 3e-3, 4e-3],
            betas=ADAM["betas"],
        )

    run(torch_opt, fused_opt)


# --- betas forms and errors ------------------------------------------------------------------


def test_betas_forms_agree() -> None:
    p = [nn.Parameter(torch.zeros(3, 2))]
    pairs = hydro.optim.Adam(p, betas=[(0.9, 0.99), (0.8, 0.999), (0.7, 0.9)])
    columns = hydro.optim.Adam(p, betas=([0.9, 0.8, 0.7], [0.99, 0.999, 0.9]))
    tensor = hydro.optim.Adam(
        p, betas=torch.tensor([[0.9, 0.99], [0.8, 0.999], [0.7, 0.9]], dtype=torch.float64)
    )
    for opt in (pairs, columns, tensor):
        b1, b2 = opt.param_groups[0]["betas"]
        assert b1.tolist() == [0.9, 0.8, 0.7] and b2.tolist() == [0.99, 0.999, 0.9]
    mixed = hydro.optim.AdamW(p, betas=(0.9, [0.99, 0.999, 0.9]))
    assert mixed.param_groups[0]["betas"][0].tolist() == [0.9] * 3
    plain = hydro.optim.Adam(p, betas=[0.8, 0.9])  # a list of two numbers: (beta1, beta2)
    assert plain.param_groups[0]["betas"][1].tolist() == [0.9] * 3
    # n = 2: a list of pairs is per trial, a tuple of two is (beta1s, beta2s)
    two = [nn.Parameter(torch.zeros(2, 2))]
    b1, b2 = hydro.optim.Adam(two, betas=[(0.9, 0.99), (0.8, 0.999)]).param_groups[0]["betas"]
    assert b1.tolist() == [0.9, 0.8] and b2.tolist() == [0.99, 0.999]
    b1, b2 = hydro.optim.Adam(two, betas=([0.9, 0.8], [0.99, 0.999])).param_groups[0]["betas"]
    assert b1.tolist() == [0.9, 0.8] and b2.tolist() == [0.99, 0.999]


@pytest.mark.parametrize(
    "betas",
    [
        [(0.9, 0.99), (0.8, 0.999)],  # 2 pairs for 3 trials
        (0.9, [0.99, 0.999]),  # 2 beta2 values for 3 trials
        (0.9, 0.99, 0.999),
        [(0.9, 0.99, 0.5)] * 3,
        torch.zeros(3, 3),
        "0.9",
    ],
)
def test_betas_bad_shapes_name_the_forms(betas: object) -> None:
    with pytest.raises(ConfigError, match=r"betas.*list of n \(beta1, beta2\) pairs"):
        hydro.optim.Adam([nn.Parameter(torch.zeros(3, 2))], betas=betas)


def test_per_trial_length_error_names_the_argument() -> None:
    with pytest.raises(ConfigError, match="lr has shape \\(2,\\) but there are 3 fused trials"):
        hydro.optim.SGD([nn.Parameter(torch.zeros(3, 2))], lr=[0.1, 0.2])
    with pytest.raises(ConfigError, match="nesterov"):
        hydro.optim.SGD([nn.Parameter(torch.zeros(2, 2))], lr=0.1, momentum=[0.9, 0.0],
                        nesterov=True)


# --- isolation, checkpoints, select ----------------------------------------------------------


def _train(opt_factory, steps: int, nan_at: int | None = None, trial: int = 1):
    models = make_models(N)
    params = stacked(models)
    flags = torch.zeros(N, dtype=torch.bool)
    for p in params.values():
        p.hydro_diverged = flags
    opt = opt_factory(list(params.values()))
    history = []
    for step in range(steps):
        x, y = batch(step)
        for m in models:
            m.zero_grad()
            F.cross_entropy(m(x), y).backward()
        for name, p in params.items():
            p.grad = torch.stack([m.get_parameter(name).grad for m in models])
            if step == nan_at and name == "fc1.weight":
                p.grad[trial, 0, 0] = float("nan")
        opt.step()
        history.append(copy.deepcopy(({k: v.detach() for k, v in params.items()}, opt.state)))
    return params, opt, flags, history


@pytest.mark.parametrize(
    "factory",
    [
        lambda ps: hydro.optim.AdamW(ps, **ADAM),
        lambda ps: hydro.optim.Adam(ps, **ADAM),
        lambda ps: hydro.optim.SGD(ps, **SGD),
    ],
    ids=["adamw", "adam", "sgd"],
)
def test_diverged_trial_frozen_others_bit_identical(factory) -> None:
    _, _, clean_flags, clean = _train(factory, 5)
    _, _, flags, broken = _train(factory, 5, nan_at=2)
    assert clean_flags.tolist() == [False] * N
    assert flags.tolist() == [False, True, False, False]
    for (pa, sa), (pb, sb) in zip(clean, broken):
        for name in pa:
            for k in (0, 2, 3):
                assert torch.equal(pa[name][k], pb[name][k]), name
        for (_, a), (_, b) in zip(sa.items(), sb.items()):
            for key in a:
                for k in (0, 2, 3):
                    assert torch.equal(a[key][k], b[key][k]), key
    # trial 1 stops changing from the step its gradient went non-finite: params and state
    for later in broken[2:]:
        for name in later[0]:
            assert torch.equal(later[0][name][1], broken[1][0][name][1]), name
        for (_, a), (_, b) in zip(later[1].items(), broken[1][1].items()):
            for key in a:
                assert torch.equal(a[key][1], b[key][1]), key


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_state_dict_round_trip_is_bit_identical(name: str) -> None:
    hp, cls = (ADAM, hydro.optim.AdamW) if name == "adamw" else (SGD, hydro.optim.SGD)
    models = make_models(N)

    def steps(params: dict, opt, sched, first: int, last: int) -> None:
        for step in range(first, last):
            x, y = batch(step)
            for m in models:
                m.zero_grad()
                F.cross_entropy(m(x), y).backward()
            for pname, p in params.items():
                p.grad = torch.stack([m.get_parameter(pname).grad for m in models]) * (1 + step)
            opt.step()
            sched.step()

    def sched_of(opt):
        return S.SequentialLR(
            opt,
            [S.LinearLR(opt, [0.1, 0.2, 0.3, 0.4], total_iters=2), S.CosineAnnealingLR(opt, 5)],
            milestones=[[2], [3], [1], [2]],
        )

    straight = stacked(models)
    opt = cls(list(straight.values()), **hp)
    sched = sched_of(opt)
    steps(straight, opt, sched, 0, 6)

    resumed = stacked(models)
    opt_a = cls(list(resumed.values()), **hp)
    sched_a = sched_of(opt_a)
    steps(resumed, opt_a, sched_a, 0, 3)
    buffer = io.BytesIO()
    torch.save(
        {"opt": opt_a.state_dict(), "sched": sched_a.state_dict(), "params": resumed}, buffer
    )
    buffer.seek(0)
    ckpt = torch.load(buffer, weights_only=True)
    restored = {k: nn.Parameter(v.detach().clone()) for k, v in ckpt["params"].items()}
    opt_b = cls(list(restored.values()), lr=0.5)  # hyperparameters come from the checkpoint
    sched_b = sched_of(opt_b)
    opt_b.load_state_dict(ckpt["opt"])
    sched_b.load_state_dict(ckpt["sched"])
    steps(restored, opt_b, sched_b, 3, 6)
    for pname in straight:
        assert torch.equal(straight[pname], restored[pname]), pname
        for key, value in opt.state[straight[pname]].items():
            assert torch.equal(value, opt_b.state[restored[pname]][key]), key
    assert torch.equal(opt.param_groups[0]["lr"], opt_b.param_groups[0]["lr"])


def test_select_keeps_trials_in_step() -> None:
    keep = [3, 1]
    models = make_models(N)
    params = stacked(models)
    opt = hydro.optim.AdamW(list(params.values()), **ADAM)
    sched = S.StepLR(opt, step_size=[1, 2, 3, 1], gamma=0.5)
    opts = [torch.optim.AdamW(m.parameters(), **trial(ADAM, k)) for k, m in enumerate(models)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, [1, 2, 3, 1][k], 0.5) for k, o in enumerate(opts)]
    for step in range(STEPS):
        if step == 2:
            for p in params.values():
                p.data = p.data[keep]
            opt.select(keep)
            models, opts, scheds = ([xs[k] for k in keep] for xs in (models, opts, scheds))
        x, y = batch(step)
        for m, o in zip(models, opts):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
        for name, p in params.items():
            p.grad = torch.stack([m.get_parameter(name).grad for m in models])
        for o in opts:
            o.step()
        opt.step()
        for s in scheds:
            s.step()
        sched.step()
        assert opt.param_groups[0]["lr"].tolist() == [o.param_groups[0]["lr"] for o in opts]
        for j, (m, o) in enumerate(zip(models, opts)):
            for name, p in m.named_parameters():
                close(params[name][j], p, f"step {step} trial {j} {name}")
                for key, value in o.state[p].items():
                    close(opt.state[params[name]][key][j], value, f"step {step} {key} {name}")


# --- torch.compile ---------------------------------------------------------------------------


def _failing_backend(gm, example_inputs):
    raise RuntimeError("this backend cannot compile anything")


def test_compile_failure_falls_back_with_warning() -> None:
    eager = _train(lambda ps: hydro.optim.AdamW(ps, **ADAM), 3)[3]
    with pytest.warns(RuntimeWarning, match="torch.compile failed.*running the eager step"):
        params, opt, _, compiled = _train(
            lambda ps: hydro.optim.AdamW(ps, **ADAM, compile=_failing_backend), 3
        )
    assert opt.compile is False
    for (pa, _), (pb, _) in zip(eager, compiled):
        for name in pa:
            assert torch.equal(pa[name], pb[name]), name


@pytest.mark.parametrize(
    "factory",
    [
        lambda c: hydro.optim.SGD(c[0], **SGD, compile=c[1]),
        lambda c: hydro.optim.AdamW(c[0], **ADAM, compile=c[1]),
        lambda c: hydro.optim.Adam(c[0], **ADAM, compile=c[1]),
    ],
    ids=["sgd", "adamw", "adam"],
)
def test_compiled_step_matches_eager(factory) -> None:
    # aot_eager traces the step exactly as inductor would see it, without a C++ build
    eager = _train(lambda ps: factory((ps, False)), 4)[3]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback
        compiled = _train(lambda ps: factory((ps, "aot_eager")), 4)[3]
    for (pa, sa), (pb, sb) in zip(eager, compiled):
        for name in pa:
            close(pb[name], pa[name], name)
        for (_, a), (_, b) in zip(sa.items(), sb.items()):
            for key in a:
                close(b[key], a[key], key)


def test_inductor_step_matches_torch() -> None:
    # two parameters keep the C++ compile short; the arithmetic is the same for any number
    g = torch.Generator().manual_seed(0)
    trials = [[torch.randn(3, 2, generator=g, dtype=torch.float64, requires_grad=True),
               torch.randn(2, generator=g, dtype=torch.float64, requires_grad=True)]
              for _ in range(N)]
    fused = [nn.Parameter(torch.stack([t[i].detach() for t in trials])) for i in range(2)]
    opts = [torch.optim.Adam(ts, **trial(ADAM, k)) for k, ts in enumerate(trials)]
    fopt = hydro.optim.Adam(fused, **ADAM, compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback
        for step in range(5):
            grads = [torch.randn(N, *f.shape[1:], generator=g, dtype=torch.float64) for f in fused]
            for k, ts in enumerate(trials):
                for t, grad in zip(ts, grads):
                    t.grad = grad[k].clone()
                opts[k].step()
            for f, grad in zip(fused, grads):
                f.grad = grad
            fopt.step()
            for k, ts in enumerate(trials):
                for i, t in enumerate(ts):
                    close(fused[i][k], t, f"step {step} trial {k} param {i}")
                    for key, value in opts[k].state[t].items():
                        close(fopt.state[fused[i]][key][k], value, f"step {step} {key}")


def test_many_compiled_optimizers_in_one_process_stay_compiled() -> None:
    # dynamo counts graphs per function, and every optimizer's compiled update runs the same two
    # functions: at dynamo's default limit (8) the ninth structure fell back to eager, warning
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback
        for n in range(2, 13):  # 11 structures: trial counts the guards see as shapes
            p = nn.Parameter(torch.randn(n, 3, generator=g, dtype=torch.float64))
            opt = hydro.optim.AdamW([p], lr=[1e-3] * n, compile="aot_eager")
            p.grad = torch.randn(n, 3, generator=g, dtype=torch.float64)
            opt.step()
            assert opt.compile == "aot_eager", n

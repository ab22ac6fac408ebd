"""reset_trial: a slot refilled with a new trial mid-run trains exactly as that trial alone.

Slot 1 of a fused optimizer + scheduler is reset at step 5 with new hyperparameters and a new
schedule, then trained 5 more steps; every step it must equal a separate torch.optim (+ torch
scheduler) run of the new trial from scratch, and the other slots their uninterrupted separate
runs (params, optimizer state and learning rates, float64, 1e-9 relative).
"""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler as TS

import hydro.optim
from hydro.errors import ConfigError
from hydro.optim import lr_scheduler as S
from tests.optim.test_against_torch import ADAM, N, Net, batch, close, make_models, stacked, trial

RESET_AT, AFTER = 5, 5
SLOT = 1

SGD_NO_MOMENTUM = dict(lr=[0.1, 0.05, 0.01, 0.2], weight_decay=[0.0, 1e-3, 1e-2, 0.1])
ADAM_NO_AMSGRAD = {**ADAM, "amsgrad": [False] * N}

# name: (torch optimizer, fused optimizer, old hp, new trial's hp,
#        torch schedule (opt, args), fused schedule (opt), old per-trial args, new args)
CASES: dict[str, tuple] = {
    "adamw_warmup_cosine": (
        torch.optim.AdamW,
        hydro.optim.AdamW,
        ADAM,
        dict(lr=5e-3, betas=(0.7, 0.95), eps=1e-5, weight_decay=0.2, amsgrad=True),
        lambda o, a: TS.SequentialLR(
            o,
            [TS.LinearLR(o, a["start"], total_iters=a["warm"]), TS.CosineAnnealingLR(o, a["T"])],
            milestones=[a["warm"]],
        ),
        lambda o: S.SequentialLR(
            o,
            [
                S.LinearLR(o, start_factor=[0.1, 0.2, 0.3, 0.4], total_iters=[2, 3, 2, 1]),
                S.CosineAnnealingLR(o, T_max=[6, 7, 8, 9]),
            ],
            milestones=[[2], [3], [2], [1]],
        ),
        [
            dict(start=s, warm=w, T=t)
            for s, w, t in zip([0.1, 0.2, 0.3, 0.4], [2, 3, 2, 1], [6, 7, 8, 9])
        ],
        (
            dict(start=0.25, warm=2, T=4),
            dict(
                milestones=[2],
                schedulers=[dict(start_factor=0.25, total_iters=2), dict(T_max=4)],
            ),
        ),
    ),
    "adam_amsgrad_appears_onecycle": (
        torch.optim.Adam,
        hydro.optim.Adam,
        ADAM_NO_AMSGRAD,
        dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, amsgrad=True),
        lambda o, a: TS.OneCycleLR(o, max_lr=a["max_lr"], total_steps=a["total"]),
        lambda o: S.OneCycleLR(o, max_lr=[0.01, 0.02, 0.03, 0.04], total_steps=12),
        [dict(max_lr=m, total=12) for m in [0.01, 0.02, 0.03, 0.04]],
        (dict(max_lr=0.05, total=7), dict(max_lr=0.05, total_steps=7)),
    ),
    "sgd_momentum_appears_step": (
        torch.optim.SGD,
        hydro.optim.SGD,
        SGD_NO_MOMENTUM,
        dict(lr=0.3, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True),
        lambda o, a: TS.StepLR(o, a["size"], a["gamma"]),
        lambda o: S.StepLR(o, step_size=[1, 2, 3, 1], gamma=[0.5, 0.1, 0.9, 0.7]),
        [dict(size=s, gamma=g) for s, g in zip([1, 2, 3, 1], [0.5, 0.1, 0.9, 0.7])],
        (dict(size=2, gamma=0.3), dict(step_size=2, gamma=0.3)),
    ),
}


class Ref:
    """One trial trained alone by torch.optim and a torch scheduler."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, make_sched: Callable) -> None:
        self.model, self.opt = model, opt
        self.sched = make_sched(opt)


def _new_model() -> nn.Module:
    torch.manual_seed(99)
    return Net().double()


def _step(params: dict, refs: list[Ref], fopt, fsched, step: int, nan_slot: int | None = None):
    x, y = batch(step)
    for r in refs:
        r.opt.zero_grad()
        F.cross_entropy(r.model(x), y).backward()
    for name, p in params.items():
        p.grad = torch.stack([r.model.get_parameter(name).grad.clone() for r in refs])
        if nan_slot is not None and name == "fc1.weight":
            p.grad[nan_slot, 0, 0] = float("nan")
    for k, r in enumerate(refs):
        if k != nan_slot:
            r.opt.step()
    fopt.step()
    for k, r in enumerate(refs):
        if k != nan_slot:
            r.sched.step()
    fsched.step()


def _compare(params: dict, refs: list[Ref], fopt, step: int, skip: int | None = None) -> None:
    for k, r in enumerate(refs):
        if k == skip:
            continue
        for g, group in enumerate(fopt.param_groups):
            close(group["lr"][k], torch.tensor(r.opt.param_groups[g]["lr"]), f"{step}: lr {k}")
        for name, p in r.model.named_parameters():
            fp = params[name]
            close(fp[k], p, f"step {step}: trial {k} {name}")
            for key, value in r.opt.state[p].items():
                if value is not None:
                    close(fopt.state[fp][key][k], value, f"step {step}: trial {k} {key} {name}")


def _run(case: str, nan_before_reset: bool = False):
    torch_cls, fused_cls, hp, new_hp, torch_sched, fused_sched, args, (new_args, reset_args) = (
        CASES[case]
    )
    models = make_models(N)
    params = stacked(models)
    flags = torch.zeros(N, dtype=torch.bool)
    for p in params.values():
        p.hydro_diverged = flags
    refs = [
        Ref(m, torch_cls(m.parameters(), **trial(hp, k)), lambda o, k=k: torch_sched(o, args[k]))
        for k, m in enumerate(models)
    ]
    fopt = fused_cls(list(params.values()), **hp)
    fsched = fused_sched(fopt)
    for step in range(RESET_AT):
        nan = SLOT if nan_before_reset and step == RESET_AT - 2 else None
        _step(params, refs, fopt, fsched, step, nan_slot=nan)
        _compare(params, refs, fopt, step, skip=SLOT if nan_before_reset else None)
    assert flags[SLOT].item() is nan_before_reset
    # slot SLOT gets a new trial: new weights, hyperparameters and schedule
    new = _new_model()
    with torch.no_grad():
        for name, p in params.items():
            p[SLOT] = new.get_parameter(name)
    before = {name: p.detach().clone() for name, p in params.items()}
    state_before = {
        name: {key: v.clone() for key, v in fopt.state[p].items()} for name, p in params.items()
    }
    fopt.reset_trial(SLOT, **new_hp)
    fsched.reset_trial(SLOT, base_lr=new_hp["lr"], **reset_args)
    assert not flags[SLOT].item()
    for name, p in params.items():  # the other slots are untouched, bit for bit
        others = [k for k in range(N) if k != SLOT]
        assert torch.equal(p[others], before[name][others]), name
        for key, v in fopt.state[p].items():
            assert torch.equal(v[others], state_before[name][key][others]), (name, key)
            assert not v[SLOT].any(), (name, key)
    refs[SLOT] = Ref(new, torch_cls(new.parameters(), **new_hp), lambda o: torch_sched(o, new_args))
    _compare(params, refs, fopt, RESET_AT)  # the reset trial's step-0 learning rate too
    return params, refs, fopt, fsched, flags


@pytest.mark.parametrize("case", list(CASES))
def test_reset_slot_equals_new_trial_alone(case: str) -> None:
    params, refs, fopt, fsched, _ = _run(case)
    for step in range(RESET_AT, RESET_AT + AFTER):
        _step(params, refs, fopt, fsched, step)
        _compare(params, refs, fopt, step)


def test_reset_clears_divergence_and_the_new_trial_trains() -> None:
    params, refs, fopt, fsched, flags = _run("adamw_warmup_cosine", nan_before_reset=True)
    for step in range(RESET_AT, RESET_AT + AFTER):
        _step(params, refs, fopt, fsched, step)
        _compare(params, refs, fopt, step)
    assert not flags.any()


@pytest.mark.parametrize("case", ["adamw_warmup_cosine", "sgd_momentum_appears_step"])
def test_state_dict_round_trip_after_reset(case: str) -> None:
    fused_cls, hp, fused_sched = CASES[case][1], CASES[case][2], CASES[case][5]
    params, refs, fopt, fsched, _ = _run(case)
    _step(params, refs, fopt, fsched, RESET_AT)
    buffer = io.BytesIO()
    torch.save({"opt": fopt.state_dict(), "sched": fsched.state_dict(), "params": params}, buffer)
    buffer.seek(0)
    ckpt = torch.load(buffer, weights_only=True)
    restored = {k: nn.Parameter(v.detach().clone()) for k, v in ckpt["params"].items()}
    opt_b = fused_cls(list(restored.values()), **hp)  # built as at the start, before the reset
    sched_b = fused_sched(opt_b)
    opt_b.load_state_dict(ckpt["opt"])
    sched_b.load_state_dict(ckpt["sched"])
    assert sched_b.trial_args == fsched.trial_args
    for step in range(RESET_AT + 1, RESET_AT + AFTER):
        x, y = batch(step)
        for r in refs:
            r.model.zero_grad()
            F.cross_entropy(r.model(x), y).backward()
        for ps, opt, sched in ((params, fopt, fsched), (restored, opt_b, sched_b)):
            for name, p in ps.items():
                p.grad = torch.stack([r.model.get_parameter(name).grad for r in refs])
            opt.step()
            sched.step()
    for name, p in params.items():
        assert torch.equal(p, restored[name]), name
        for key, value in fopt.state[p].items():
            assert torch.equal(value, opt_b.state[restored[name]][key]), (name, key)
    assert torch.equal(fopt.param_groups[0]["lr"], opt_b.param_groups[0]["lr"])


def test_reset_after_select_uses_the_slot_index() -> None:
    models = make_models(N)
    params = stacked(models)
    opt = hydro.optim.Adam(list(params.values()), lr=[1.0, 2.0, 3.0, 4.0])
    sched = S.StepLR(opt, step_size=[1, 2, 3, 4], gamma=0.5)
    opt.select([2, 3])
    sched.reset_trial(1, base_lr=8.0, gamma=0.25)
    assert sched.trial_args == [dict(step_size=3, gamma=0.5), dict(step_size=4, gamma=0.25)]
    sched.step()
    sched.step()
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"].tolist() == [1.5, 2.0]


def test_reset_errors_are_clear_and_change_nothing() -> None:
    params = stacked(make_models(N))
    opt = hydro.optim.SGD(list(params.values()), **SGD_NO_MOMENTUM)
    sched = S.StepLR(opt, step_size=2)
    lr = opt.param_groups[0]["lr"].clone()
    with pytest.raises(ConfigError, match="slot 4 is not one of the 4"):
        opt.reset_trial(N)
    with pytest.raises(ConfigError, match="no per-trial hyperparameter betas.*it has lr"):
        opt.reset_trial(0, betas=(0.9, 0.99))
    with pytest.raises(ConfigError, match="lr sets one trial's value and must be one number"):
        opt.reset_trial(0, lr=[0.1, 0.2])
    with pytest.raises(ConfigError, match="nesterov: trials \\[2\\]"):
        opt.reset_trial(2, nesterov=True)
    assert not opt.param_groups[0]["nesterov"].any()
    assert torch.equal(opt.param_groups[0]["lr"], lr)
    adam = hydro.optim.Adam(list(params.values()))
    with pytest.raises(ConfigError, match="betas sets one trial's value and must be one"):
        adam.reset_trial(0, betas=0.9)
    with pytest.raises(ConfigError, match="StepLR has no argument T_max"):
        sched.reset_trial(0, T_max=3)
    with pytest.raises(ConfigError, match="base_lr has 2 values for 1 parameter groups"):
        sched.reset_trial(0, base_lr=[0.1, 0.2])
    with pytest.raises(ConfigError, match="slot -1"):
        sched.reset_trial(-1)
    seq = S.SequentialLR(opt, [S.LinearLR(opt), S.StepLR(opt, 2)], milestones=[3])
    with pytest.raises(ConfigError, match="schedulers has 1 entries for 2 child"):
        seq.reset_trial(0, schedulers=[{}])
    with pytest.raises(ConfigError, match="LinearLR has no argument gamma"):
        seq.reset_trial(0, schedulers=[{"gamma": 0.1}, {}])

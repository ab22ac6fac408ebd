"""Which trials share a fused model (issue 9 point 1), and how a group's members are built.

Architecture is decided by what the model factory builds (parameter shapes, module types,
settings), not by its signature: the README's main job searches ``dropout``, which ``gpt()``
takes, and its 32 trials must still form 2 groups of 16.
"""

from __future__ import annotations

import functools

import optuna
import torch

from examples.charlm.model import gpt
from hydro.tuning.config import load
from hydro.tuning.group import _apply_model_params, build_members, group_key
from hydro.tuning.task import Task

optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_readme_job_puts_every_trial_in_one_architecture():
    cfg = load("examples/charlm/tune.yaml")
    assert "dropout" in cfg.space and "dropout" in cfg.task.model_args()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    keys = []
    for _ in range(cfg.trials):
        trial = study.ask(cfg.space)
        keys.append(group_key(trial.params, cfg.task))
        study.tell(trial, 0.0)
    assert len({t.params["dropout"] for t in study.trials}) == cfg.trials
    assert len(set(keys)) == 1  # so fuse=16 makes 2 full groups of 16
    assert cfg.trials // cfg.fuse == 2
    # a factory argument that changes the shapes does split
    assert group_key({"n_layer": 2}, cfg.task) != group_key({"n_layer": 3}, cfg.task)
    assert group_key({"n_embd": 64}, cfg.task) != keys[0]


def _task() -> Task:
    factory = functools.partial(gpt, n_layer=1, n_head=2, n_embd=32, block_size=16)
    x = torch.randint(0, 60, (32, 16))
    return Task(model=factory, train_data=(x, x), val_data=(x[:8], x[:8]), steps=2)


def _dropouts(sur) -> list[float]:
    nodes = sur.graphs["train"].graph.nodes
    return [n.args[1] for n in nodes if n.target is torch.ops.aten.dropout.default]


def test_members_are_built_from_their_own_factory_arguments():
    task = _task()
    params = [{"dropout": 0.1, "lr": 1e-3}, {"dropout": 0.05}, {"dropout": 0.1}, {"dropout": 0.0}]
    assert len({group_key(p, task) for p in params}) == 1
    example = ((torch.randint(0, 60, (2, 16)),), {})
    members = build_members(task, params, 2, [0, 1, 2, 3], example)
    for sur, p in zip(members, params):
        assert _dropouts(sur) and set(_dropouts(sur)) == {p["dropout"]}
        assert sur.get_parameter("wte.weight").shape[1] == 16
    # independent initializations, one structure
    assert not torch.equal(members[0].get_parameter("wte.weight"),
                           members[1].get_parameter("wte.weight"))
    torch.manual_seed(0)
    a = members[3](*example[0])
    # with dropout 0 the member is deterministic in training mode
    assert torch.equal(a, members[3](*example[0]))


def test_model_params_act_on_the_built_surrogate():
    task = _task()
    example = ((torch.randint(0, 60, (2, 16)),), {})
    (sur,) = build_members(task, [{"output_mult": 1.0}], 2, [0], example)
    base = sur.get_buffer("mup_readout.scale").item()
    _apply_model_params(sur, {"output_mult": 0.5, "dropout": 0.3}, task.model_args())
    assert sur.get_buffer("mup_readout.scale").item() == base * 0.5
    assert set(_dropouts(sur)) == {0.0}  # dropout is the factory's: not rewritten here
    _apply_model_params(sur, {"dropout": 0.3}, set())  # a model without a dropout argument
    assert set(_dropouts(sur)) == {0.3}


def test_meta_builds_skip_initialization_and_torch_dynamo():
    from torch import nn

    from hydro.tuning.group import _SkipInit

    with torch.device("meta"), _SkipInit():
        layer = nn.Linear(4, 3)
        nn.init.trunc_normal_(layer.weight)  # by keyword inside: tensor=
    assert layer.weight.is_meta and layer.weight.shape == (3, 4)
    with _SkipInit():  # real tensors are initialized as ever
        w = torch.zeros(3, 4)
        nn.init.normal_(w)
    assert w.abs().sum() > 0
    # the README job's group key imports no torch._dynamo (its first meta random fill did:
    # 1.5 s of the start-up), in a fresh process
    code = ("import sys, torch; from hydro.tuning.config import load; "
            "from hydro.tuning.group import group_key; "
            "task = load('examples/charlm/tune.yaml').task; group_key({'dropout': 0.1}, task); "
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'")
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", code], check=True)

"""A fused group's members share the graphs they write no literal of their own in (a fused model
only reads its members' graphs) and generate a graph's code only when it runs: an edit of one
member's graph never reaches another's, and a member computes what a member built alone
computes, bit for bit."""

from __future__ import annotations

import functools

import pytest
import torch

from examples.charlm.model import gpt
from hydro.fx.capture import copy_captured
from hydro.tuning.group import _apply_model_params, build_members
from hydro.tuning.task import Task

pytestmark = pytest.mark.usefixtures("one_thread")

EXAMPLE = ((torch.randint(0, 60, (2, 16), generator=torch.Generator().manual_seed(0)),), {})


def _task(**kw) -> Task:
    factory = functools.partial(gpt, n_layer=1, n_head=2, n_embd=32, block_size=16, **kw)
    x = torch.randint(0, 60, (32, 16))
    return Task(model=factory, train_data=(x, x), val_data=(x[:8], x[:8]), steps=2)


def _dropouts(gm: torch.fx.GraphModule) -> list[float]:
    return [n.args[1] for n in gm.graph.nodes if n.target is torch.ops.aten.dropout.default]


def _run(sur: torch.nn.Module, train: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    sur.train(train)
    sur.zero_grad()
    torch.manual_seed(5)  # the same dropout masks
    out = sur(*EXAMPLE[0])
    out.float().square().sum().backward()
    return out.detach(), [p.grad.clone() for p in sur.parameters()]


def test_members_share_unedited_graphs_and_keep_their_own_literals():
    task = _task()
    params = [{"dropout": 0.1}, {"dropout": 0.05}, {"dropout": 0.1}]
    members = build_members(task, params, 2, [0, 1, 2], EXAMPLE)
    # dropout is written in the training graph only: the evaluation graph is one for all
    assert all(m.graphs["eval"] is members[0].graphs["eval"] for m in members)
    assert len({id(m.graphs["train"]) for m in members}) == 3
    assert [set(_dropouts(m.graphs["train"])) for m in members] == [{0.1}, {0.05}, {0.1}]

    # an edit of one member's own graph stays its own
    for node in members[1].graphs["train"].graph.nodes:
        if node.target is torch.ops.aten.dropout.default:
            node.update_arg(1, 0.3)
    members[1].graphs["train"].recompile()
    assert [set(_dropouts(m.graphs["train"])) for m in members] == [{0.1}, {0.3}, {0.1}]
    # an edit of every graph (a dropout the factory does not take) copies a shared one first
    shared = members[0].graphs["eval"]
    before = _dropouts(shared)
    _apply_model_params(members[2], {"dropout": 0.2}, set())
    assert members[2].graphs["eval"] is not shared and set(
        _dropouts(members[2].graphs["eval"])
    ) == {0.2}
    assert _dropouts(shared) == before and members[0].graphs["eval"] is shared
    assert set(_dropouts(members[2].graphs["train"])) == {0.2}
    assert set(_dropouts(members[0].graphs["train"])) == {0.1}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_a_member_computes_what_one_built_alone_does(train):
    task = _task()
    params = [{"dropout": 0.1}, {"dropout": 0.05}, {"dropout": 0.2}]
    members = build_members(task, params, 2, [0, 1, 2], EXAMPLE)
    for k in (1, 2):
        (alone,) = build_members(task, [params[k]], 2, [k], EXAMPLE)
        for (name, p), q in zip(members[k].state_dict().items(), alone.state_dict().values()):
            assert torch.equal(p, q), name
        out_a, grads_a = _run(members[k].double(), train)
        out_b, grads_b = _run(alone.double(), train)
        assert out_a.dtype == torch.float64 and torch.equal(out_a, out_b)
        assert all(torch.equal(g, h) for g, h in zip(grads_a, grads_b, strict=True))


def test_members_without_literals_of_their_own_share_every_graph():
    task = _task()
    members = build_members(task, [{"lr": 1e-3}, {"lr": 1e-2}], 2, [0, 1], EXAMPLE)
    for mode in ("train", "eval"):
        assert members[0].graphs[mode] is members[1].graphs[mode]
    assert not torch.equal(members[0].get_parameter("wte.weight"),
                           members[1].get_parameter("wte.weight"))
    a, b = _run(members[0], True)[0], _run(members[1], True)[0]
    assert not torch.equal(a, b)  # each runs the shared code on its own tensors


def test_a_copy_generates_its_code_when_it_first_runs():
    (sur,) = build_members(_task(), [{"dropout": 0.1}], 2, [0], EXAMPLE)
    copy = copy_captured(sur)
    gm = copy.graphs["train"]
    assert gm._needs_recompile()  # no code made by the copy
    out = _run(copy, True)[0]
    assert not gm._needs_recompile()
    assert torch.equal(out, _run(sur, True)[0])
    assert copy.graphs["eval"].code == sur.graphs["eval"].code


def test_the_collector_runs_again_after_a_build_even_a_failing_one():
    import gc

    from hydro.collector import collector_paused

    seen = []

    @collector_paused()  # as hydro.tuning.group builds its members
    def build(fail: bool) -> None:
        seen.append(gc.isenabled())
        if fail:
            raise ValueError("a factory that fails")

    assert gc.isenabled()
    build(False)
    with pytest.raises(ValueError, match="factory that fails"):
        build(True)
    assert seen == [False, False] and gc.isenabled()
    gc.disable()  # paused by the caller: left as it was
    try:
        build(False)
        assert not gc.isenabled()
    finally:
        gc.enable()

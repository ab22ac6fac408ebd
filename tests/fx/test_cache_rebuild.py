"""A graph read back from the capture cache (hydro.fx.serial, without torch's deserializer) is the
graph a fresh capture makes: the same nodes and the metadata Hydro's passes read, and in float64
bit-identical outputs, gradients and fused training steps (the README's char-level GPT, with
dropout and a sequence length left dynamic, a CNN with batch norm, autocast and no-grad
regions)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hydro.optim
from hydro.fusion import fuse
from hydro.fusion.facts import batch_facts
from hydro.fx import cache
from hydro.fx.capture import Captured, _captured_shapes, capture
from tests.cache_model import forward_backward
from tests.zoo import ResNet


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HYDRO_CACHE", raising=False)


def _gpt() -> tuple[nn.Module, tuple, dict]:
    from examples.charlm.model import gpt

    torch.manual_seed(0)
    model = gpt(n_layer=2, n_head=2, n_embd=16, block_size=16, dropout=0.1).double()
    return model, (torch.randint(0, 60, (3, 16)),), {"dynamic": "auto"}


def _cnn() -> tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    return ResNet(width=4).double(), (torch.randn(3, 3, 8, 8, dtype=torch.float64),), {}


class Regions(nn.Module):
    """``with`` regions: export keeps them as higher-order ops over subgraphs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # fusion: no parameters inside
            y = (h * h).relu()
        with torch.no_grad():
            z = y * 2
        return self.fc2(z + y)


def _regions() -> tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    return Regions().double(), (torch.randn(3, 4, dtype=torch.float64),), {}


def _stack(node: torch.fx.Node) -> dict:
    # a fresh capture names the module classes, a loaded one their qualified names
    stack = node.meta.get("nn_module_stack") or {}
    return {k: (p, t if isinstance(t, str) else f"{t.__module__}.{t.__qualname__}")
            for k, (p, t) in stack.items()}


def _val(v: object) -> object:
    if isinstance(v, torch.Tensor):
        return ("T", str(tuple(v.shape)), str(v.stride()), str(v.storage_offset()), v.dtype,
                v.device, v.requires_grad, isinstance(v, torch.Tensor))
    if isinstance(v, (list, tuple)):
        return [type(v).__name__, *map(_val, v)]
    return (type(v).__name__, str(v))


def _same_graphs(loaded: Captured, fresh: Captured) -> None:
    for mode in ("train", "eval"):
        a, b = loaded.graphs[mode], fresh.graphs[mode]
        assert a.code == b.code, mode
        assert _subgraphs(a) == _subgraphs(b)
        assert a._in_spec == b._in_spec and a._out_spec == b._out_spec
        for x, y in zip(a.graph.nodes, b.graph.nodes, strict=True):
            assert (x.op, x.name, x.target, str(x.args), str(x.kwargs)) == (
                y.op, y.name, y.target, str(y.args), str(y.kwargs))
            assert _val(x.meta.get("val")) == _val(y.meta.get("val")), x.name
            assert _stack(x) == _stack(y) and x.meta.get("stack_trace") == y.meta.get(
                "stack_trace"
            ), x.name
        assert _captured_shapes(a) == _captured_shapes(b)  # ranges of the dynamic sizes
        fa, fb = batch_facts(a), batch_facts(b)
        assert [str(fa[n]) for n in a.graph.nodes] == [str(fb[n]) for n in b.graph.nodes]


def _subgraphs(gm: torch.fx.GraphModule) -> dict[str, str]:
    return {k: v.code for k, v in gm.named_children() if isinstance(v, torch.fx.GraphModule)}


def _fused_step(cap: Captured, x: tuple) -> list[torch.Tensor]:
    fused = fuse([cap, cap], seed=3).train()
    opt = hydro.optim.AdamW(fused.parameters(), lr=[1e-2, 3e-2], weight_decay=[0.0, 0.1])
    for _ in range(2):
        opt.zero_grad()
        (fused(*x) ** 2).sum().backward()
        opt.step()
    return [p.detach().clone() for p in fused.parameters()]


@pytest.mark.parametrize("make", [_gpt, _cnn, _regions], ids=["charlm_gpt", "cnn", "regions"])
def test_a_loaded_graph_is_the_fresh_capture(folder, make, one_thread):
    model, x, kw = make()
    capture(model, x, **kw)  # writes both modes
    hits = cache.stats["hits"]
    loaded = capture(model, x, **kw)
    assert cache.stats["hits"] == hits + 2
    model2, _, _ = make()  # the same weights, captured without the cache
    fresh = capture(model2, x, cache=False, **kw)
    _same_graphs(loaded, fresh)
    for train in (True, False):
        out_l, grads_l = forward_backward(loaded, x, train)
        out_f, grads_f = forward_backward(fresh, x, train)
        assert torch.equal(out_l, out_f)
        assert all(torch.equal(g, h) for g, h in zip(grads_l, grads_f, strict=True))
    steps_l, steps_f = _fused_step(loaded, x), _fused_step(fresh, x)
    assert all(torch.equal(p, q) for p, q in zip(steps_l, steps_f, strict=True))


@pytest.mark.filterwarnings("ignore:ratio 2 takes")
def test_another_study_with_other_dropouts_hits_the_cache(folder, monkeypatch, one_thread):
    import functools

    from examples.charlm.model import gpt
    from hydro.scaling import build
    from hydro.tuning import group
    from hydro.tuning.task import Task

    factory = functools.partial(gpt, n_layer=1, n_head=2, n_embd=32, block_size=16)
    x = torch.randint(0, 60, (32, 16))
    task = Task(model=factory, train_data=(x, x), val_data=(x[:8], x[:8]), steps=2)
    example = ((torch.randint(0, 60, (2, 16)),), {})
    exports = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(1) or real(*a, **k))
    group.build_members(task, [{"dropout": 0.1}, {"dropout": 0.05}], 2, [0, 1], example)
    assert len(exports) == 3  # train and eval, and train at the second rate
    group._SITES.clear()  # what a new process (a resume, another seed) starts from
    hits = cache.stats["hits"]
    params = [{"dropout": 0.17}, {"dropout": 0.0}, {"dropout": 0.125}]
    members = group.build_members(task, params, 2, [7, 8, 9], example)
    assert len(exports) == 3 and cache.stats["hits"] == hits + 3
    for sur, p in zip(members, params):
        nodes = sur.graphs["train"].graph.nodes
        rates = {n.args[1] for n in nodes if n.target is torch.ops.aten.dropout.default}
        assert rates == {p["dropout"]}
    # a member drawn from the canonical capture is the member captured at its own rate
    sur, p, seed = members[0], params[0], 7
    own = build(group._target(task, p), 2, example_inputs=example[0], seed=seed, cache=False)
    own = own.surrogate
    pairs = zip(sur.state_dict().values(), own.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    sur.train(), own.train()
    torch.manual_seed(3)
    out = sur(*example[0])
    torch.manual_seed(3)
    assert torch.equal(out, own(*example[0]))  # the same dropout masks at the same rate


@torch.library.custom_op("hydrotest::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class CustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _twice(self.fc(x))


def test_a_graph_with_an_op_outside_aten_is_not_cached(folder, recwarn):
    # an entry names its ops, looked up in aten and prims only: another namespace (a custom
    # op, whose code could be anything) is captured every time, without a warning
    x = torch.randn(3, 4)
    writes = cache.stats["writes"]
    for _ in range(2):
        cap = capture(CustomOp(), (x,), modes=("eval",))
        assert torch.equal(cap.eval()(x), cap.fc(x) * 2)
    assert cache.stats["writes"] == writes
    assert not [w for w in recwarn if "capture cache" in str(w.message)]

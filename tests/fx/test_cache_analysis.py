"""The width analysis cached with the program (hydro.fx.cache's analysis entries): a second
``hydro.scale`` of the same model replays the stored fake-run values instead of running the
target's and the surrogate's graphs on fake tensors, and builds the very surrogate a fresh
analysis builds (names, shapes, initialization, float64 forward and backward bit for bit);
other options miss; a bad entry is analyzed again, with one warning, and rewritten."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from torch import nn

import hydro.fx.solve
import hydro.scaling
from hydro.errors import HydroWarning
from hydro.fx import cache
from hydro.fx.capture import capture
from hydro.scaling import build
from tests.cache_model import forward_backward
from tests.zoo import ResNet

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def fake_runs(tmp_path, monkeypatch):
    """The cache in ``tmp_path``, and a list that grows by one per fake run of a graph (the
    target's, in the analysis, or the surrogate's, in the shape check)."""
    monkeypatch.setenv("HYDRO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HYDRO_CACHE", raising=False)
    calls = []
    real = hydro.fx.solve.propagate

    def counted(root, gm, args, kwargs):
        calls.append(type(root).__name__)
        return real(root, gm, args, kwargs)

    monkeypatch.setattr(hydro.fx.solve, "propagate", counted)
    monkeypatch.setattr(hydro.scaling, "propagate", counted)
    return calls


def _gpt() -> tuple[nn.Module, tuple, dict]:
    from examples.charlm.model import gpt

    torch.manual_seed(0)
    model = gpt(n_layer=2, n_head=4, n_embd=32, block_size=16, dropout=0.1).double()
    return model, (torch.randint(0, 60, (3, 16)),), {"dynamic": "auto", "ratio": 4}


def _cnn() -> tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    return ResNet(width=8).double(), (x,), {"ratio": 2}


def _build(make, cache_on: bool | None = None, **extra):
    model, x, kw = make()
    kw = {**kw, **extra}
    ratio = kw.pop("ratio")
    return build(model, ratio, example_inputs=x, seed=3, cache=cache_on, **kw), x


def _described(v: object) -> object:
    if isinstance(v, torch.Tensor):
        assert all(type(d) is int for d in (*v.shape, *v.stride())), "a symbolic size"
        return (type(v).__name__, tuple(v.shape), v.stride(), v.dtype, v.device, v.requires_grad)
    if isinstance(v, (list, tuple)):
        return [type(v).__name__, *map(_described, v)]
    return (type(v).__name__, repr(v) if not isinstance(v, torch.nn.Module) else "module")


def _entries() -> list[str]:
    return sorted(f for f in os.listdir(cache.directory()) if f.endswith(cache.ANALYSIS_SUFFIX))


@pytest.mark.parametrize("make", [_gpt, _cnn], ids=["charlm_gpt", "cnn"])
def test_a_cached_analysis_builds_the_fresh_surrogate(fake_runs, make):
    fresh, x = _build(make, cache_on=False)
    assert len(fake_runs) == 4 and not os.path.exists(cache.directory())
    hits = cache.stats["analysis_hits"]
    _build(make)  # a miss: analyzed, checked, stored
    assert len(fake_runs) == 8 and len(_entries()) == 1
    cached, _ = _build(make)
    assert len(fake_runs) == 8, "a hit runs no graph on fake tensors"
    assert cache.stats["analysis_hits"] == hits + 1

    a, b = cached.surrogate, fresh.surrogate
    assert [(n, p.shape, p.dtype) for n, p in a.named_parameters()] == [
        (n, p.shape, p.dtype) for n, p in b.named_parameters()
    ]
    assert [n for n, _ in a.named_buffers()] == [n for n, _ in b.named_buffers()]
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name  # the same initialization from the same seed
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert getattr(p, "infshape", None) == getattr(q, "infshape", None), name
    for mode in ("train", "eval"):
        assert a.graphs[mode].code == b.graphs[mode].code
    assert cached.plan.new_size == fresh.plan.new_size

    def shapes(plan) -> dict:  # every node's value as the fake run gives it, get_attr included
        return {n.name: _described(v) for n, v in plan.values.items()}

    assert shapes(cached.plan) == shapes(fresh.plan)
    assert cached.plan.head_decisions == fresh.plan.head_decisions
    assert {n.name: str(s) for n, s in cached.plan.node_syms.items()} == {
        n.name: str(s) for n, s in fresh.plan.node_syms.items()
    }
    for train in (True, False):
        out_a, grads_a = forward_backward(a, x, train)
        out_b, grads_b = forward_backward(b, x, train)
        assert out_a.dtype == torch.float64 and torch.equal(out_a, out_b)
        assert all(torch.equal(g, h) for g, h in zip(grads_a, grads_b, strict=True))


def test_other_options_or_programs_miss(fake_runs):
    model, x, _ = _cnn()
    cap = capture(model, x)
    opts = {"ratio": 2, "head_policy": "keep_head_dim", "parametrization": "mup"}
    k = cache.analysis_key(cap, x, {}, opts)
    assert k is not None and k == cache.analysis_key(cap, x, {}, dict(opts))
    others = [
        cache.analysis_key(cap, x, {}, {**opts, "ratio": 4}),
        cache.analysis_key(cap, x, {}, {**opts, "parametrization": "sp"}),
        cache.analysis_key(cap, (torch.randn(3, 3, 16, 16, dtype=torch.float64),), {}, opts),
        cache.analysis_key(capture(ResNet(width=16).double(), x), x, {}, opts),
    ]
    assert len({k, *others}) == 5
    # a program that did not come from the cache (cache off) has no key: nothing is stored
    assert cache.analysis_key(capture(model, x, cache=False), x, {}, opts) is None
    runs = len(fake_runs)
    build(model, 2, example_inputs=x, cache=False)
    build(model, 2, example_inputs=x, cache=False)
    assert len(fake_runs) == runs + 8 and not _entries()
    build(model, 2, example_inputs=x)
    build(model, 4, example_inputs=x)  # another ratio: another entry
    assert len(_entries()) == 2 and len(fake_runs) == runs + 16


def _damage(path: str, damage: str) -> None:
    if damage == "garbage":
        open(path, "wb").write(b"not a cache entry")
        return
    text = open(path, "rb").read()
    if damage == "truncated":
        open(path, "wb").write(text[: len(text) // 2])
        return
    data = json.loads(text.partition(b"\n")[2])  # after the line of its HMAC
    values = data["values"]["train"]
    if damage == "other_key":
        data["key"] = "0" * 40
    elif damage == "other_torch":
        data["torch"] = "1.0.0"
    elif damage == "missing_node":
        del values[next(iter(values))]
    elif damage == "extra_node":
        values["not_a_node"] = 1
    elif damage == "bad_value":  # an unknown dtype where a tensor's is
        node = next(n for n, v in values.items() if isinstance(v, dict) and "T" in v)
        values[node]["T"][3] = "__import__"
    else:  # a value of a kind a fake run never gives
        values[next(iter(values))] = {"code": "os.system('x')"}
    # signed again with this user's secret: what the checks behind the HMAC catch
    text = json.dumps(data).encode()
    k = os.path.basename(path)[: -len(cache.ANALYSIS_SUFFIX)]
    open(path, "wb").write(cache._mac(cache._secret(), k, text).encode() + b"\n" + text)


@pytest.mark.parametrize(
    "damage",
    ["garbage", "truncated", "other_key", "other_torch", "missing_node", "extra_node",
     "bad_value", "bad_kind"],
)
def test_a_bad_analysis_entry_is_rebuilt_with_one_warning(fake_runs, damage):
    fresh, x = _build(_cnn, cache_on=False)
    _build(_cnn)
    (entry,) = _entries()
    path = os.path.join(cache.directory(), entry)
    _damage(path, damage)
    runs = len(fake_runs)
    with pytest.warns(HydroWarning, match="capture cache entry .* running the width analysis"):
        again, _ = _build(_cnn)
    assert len(fake_runs) == runs + 4  # analyzed and checked again
    for p, q in zip(again.surrogate.state_dict().values(), fresh.surrogate.state_dict().values()):
        assert torch.equal(p, q)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="capture cache")
        _build(_cnn)  # rewritten: a hit now
    assert len(fake_runs) == runs + 4


def test_a_failing_shape_check_stores_nothing(fake_runs, monkeypatch):
    def broken(*args, **kwargs):
        raise hydro.scaling.ScaleError("the shape check failed")

    monkeypatch.setattr(hydro.scaling, "_check", broken)
    with pytest.raises(hydro.scaling.ScaleError, match="shape check failed"):
        _build(_cnn)
    assert not os.path.exists(cache.directory()) or not _entries()

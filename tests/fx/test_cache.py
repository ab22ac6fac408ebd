"""The capture cache (hydro.fx.cache): a second capture of the same model skips torch.export and
gives the same graphs; anything that changes the program misses; a bad entry is rebuilt."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import types
import warnings
import zipfile

import numpy as np
import pytest
import torch
from torch import nn

import hydro
from hydro.errors import HydroWarning
from hydro.fx import cache
from hydro.fx.capture import capture
from tests.cache_model import Net
from tests.toy import config as toy_config
from tests.toy import project as toy_project
from tests.toy import source as toy_source


@pytest.fixture
def exports(tmp_path, monkeypatch):
    """The cache in ``tmp_path``, and a list that grows by one per ``torch.export.export``."""
    monkeypatch.setenv("HYDRO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HYDRO_CACHE", raising=False)
    calls = []
    real = torch.export.export

    def counted(*args, **kwargs):
        calls.append(type(args[0]).__name__)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    return calls


def _entries() -> list[str]:
    folder = cache.directory()
    return sorted(f for f in os.listdir(folder) if f.endswith(cache.SUFFIX))


def _net(seed: int = 0, **kw) -> Net:
    torch.manual_seed(seed)
    return Net(**kw).double()


def _run(model: nn.Module, x: torch.Tensor, train: bool) -> tuple[torch.Tensor, dict]:
    model.train(train)
    model.zero_grad()
    torch.manual_seed(5)  # the same dropout mask for both
    out = model(x)
    (out**2).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_second_capture_loads_and_equals_a_fresh_one(exports):
    x = torch.randn(4, 6, dtype=torch.float64)
    capture(_net(), (x,))
    assert len(exports) == 2 and len(_entries()) == 2  # train and eval
    mtimes = [os.stat(os.path.join(cache.directory(), f)).st_mtime_ns for f in _entries()]
    assert stat.S_IMODE(os.stat(cache.directory()).st_mode) == 0o700
    hits = cache.stats["hits"]

    model = _net(seed=1)  # other weights, same code and shapes: the same program
    cached = capture(model, (x,))
    assert len(exports) == 2 and cache.stats["hits"] == hits + 2
    assert [os.stat(os.path.join(cache.directory(), f)).st_mtime_ns for f in _entries()] == mtimes
    assert cached.fc1.weight is model.fc1.weight  # the live model's tensors, not stored ones
    fresh = capture(_net(seed=1), (x,), cache=False)
    assert len(exports) == 4
    for mode in ("train", "eval"):
        assert cached.graphs[mode].code == fresh.graphs[mode].code
    for train in (True, False):
        out_c, grad_c = _run(cached, x, train)
        out_f, grad_f = _run(fresh, x, train)
        assert torch.equal(out_c, out_f)
        assert grad_c.keys() == grad_f.keys()
        assert all(torch.equal(grad_c[n], grad_f[n]) for n in grad_c)


def test_surrogate_from_cached_capture_equals_fresh(exports):
    x = torch.randn(4, 6, dtype=torch.float64)
    fresh = hydro.scale(_net(width=64), ratio=2, example_inputs=(x,), seed=3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYDRO_CACHE", "0")
        reference = hydro.scale(_net(width=64), ratio=2, example_inputs=(x,), seed=3)
    n = len(exports)
    cached = hydro.scale(_net(width=64), ratio=2, example_inputs=(x,), seed=3)
    assert len(exports) == n  # both modes loaded
    for other in (fresh, reference):
        assert {k: v.shape for k, v in cached.state_dict().items()} == {
            k: v.shape for k, v in other.state_dict().items()
        }
        assert all(torch.equal(v, other.state_dict()[k]) for k, v in cached.state_dict().items())
        for train in (True, False):
            out_c, grad_c = _run(cached, x, train)
            out_o, grad_o = _run(other, x, train)
            assert torch.equal(out_c, out_o)
            assert all(torch.equal(grad_c[k], grad_o[k]) for k in grad_c)


def test_misses_on_shapes_configuration_and_versions(exports, monkeypatch):
    x = torch.randn(4, 6)
    capture(Net(), (x,), modes=("eval",))
    capture(Net(), (x,), modes=("eval",))
    assert len(exports) == 1
    capture(Net(), (torch.randn(4, 6, dtype=torch.float64),), modes=("eval",))  # dtype
    capture(Net(width=8), (x,), modes=("eval",))  # a constructor argument: a width
    capture(Net(p=0.5), (x,), modes=("train",))
    capture(Net(p=0.4), (x,), modes=("train",))  # a literal of the graph
    assert len(exports) == 5
    monkeypatch.setattr(torch, "__version__", "0.0.1-other")
    capture(Net(), (x,), modes=("eval",))
    assert len(exports) == 6
    assert len(_entries()) == 6


def _module(name: str, source: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = f"/nonexistent/{name}.py"
    sys.modules[name] = mod
    exec(compile(source, mod.__file__, "exec"), mod.__dict__)
    return mod


BLOCK = """
import torch
from torch import nn

def act(x):
    return torch.relu(x) {op}

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return act(self.fc(x))
"""
NET = """
from torch import nn
from hydro_cache_probe_block import Block

class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return self.block(x) * 2
"""


def test_misses_when_a_submodule_class_in_another_file_changes(exports, monkeypatch):
    for name in ("hydro_cache_probe_block", "hydro_cache_probe_net"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    x = torch.randn(3, 4)
    _module("hydro_cache_probe_block", BLOCK.format(op="+ 1"))
    net = _module("hydro_cache_probe_net", NET)
    model = net.Outer()
    capture(model, (x,), modes=("eval",))
    capture(net.Outer(), (x,), modes=("eval",))
    assert len(exports) == 1
    # the user edits the helper the block calls (in the block's file), and imports again
    _module("hydro_cache_probe_block", BLOCK.format(op="+ 2"))
    net = _module("hydro_cache_probe_net", NET)
    edited = net.Outer()
    edited.load_state_dict(model.state_dict())
    cap = capture(edited, (x,), modes=("eval",))
    assert len(exports) == 2
    assert torch.allclose(cap.eval()(x), edited(x))


def _rewrite(path: str, name: str, data: bytes) -> None:
    """Replace the entry's member ``name``, the entry signed again with this user's secret: what
    the checks behind its HMAC catch (tests/fx/test_cache_trust.py: an entry changed unsigned)."""
    with zipfile.ZipFile(path) as z:
        items = {i: z.read(i) for i in z.namelist()}
    items[name] = data
    k = os.path.basename(path)[: -len(cache.SUFFIX)]
    parts = [items[i] for i in ("meta.json", "graph.json", "constants.pt")]
    items["mac"] = cache._mac(cache._secret(), k, *parts).encode()
    with zipfile.ZipFile(path, "w") as z:
        for i, d in items.items():
            z.writestr(i, d)


class _Planted:
    """A pickle payload that would call a function when loaded by a plain unpickler."""

    def __reduce__(self):
        return (os.makedirs, (PLANTED,))


PLANTED = os.path.join(os.path.dirname(__file__), "__planted_by_a_cache_entry__")


def _plant(path: str, damage: str) -> None:
    """Rewrite the entry's graph so that, were its text run as code or its names looked up
    anywhere, it would create PLANTED."""
    import json

    with zipfile.ZipFile(path) as z:
        graph = json.loads(z.read("graph.json"))
    evil = f"__import__('os').makedirs({PLANTED!r})"
    call = next(n for n in graph["nodes"] if n[0] == "call_function")
    if damage == "planted_function":  # a call of a function outside the table
        call[2] = ["fn", "os.makedirs"]
    elif damage == "planted_op":  # an op of a namespace other than aten's
        call[2] = ["op", "hydro_planted", "makedirs", "default"]
    elif damage == "planted_trace":  # a stack trace reaches the code, in a comment
        call[5]["stack_trace"] = f'File "m.py", line 1, in f\r{evil}\rx\n  y'
    elif damage == "planted_name":  # a node's name is the code's variable
        call[1] = f"x = {evil}; y"
    else:  # a get_attr path is code too
        graph["attrs"].append(f"x; {evil}")
    _rewrite(path, "graph.json", json.dumps(graph).encode())


@pytest.mark.parametrize(
    "damage",
    ["garbage", "truncated", "other_torch", "other_model", "planted_constant",
     "planted_function", "planted_op", "planted_trace", "planted_name", "planted_attr"],
)
def test_a_bad_entry_is_rebuilt_with_one_warning(exports, damage):
    x = torch.randn(4, 6, dtype=torch.float64)
    capture(_net(), (x,), modes=("eval",))
    (entry,) = _entries()
    path = os.path.join(cache.directory(), entry)
    good = open(path, "rb").read()
    if damage == "garbage":
        open(path, "wb").write(b"not a cache entry")
    elif damage == "truncated":
        open(path, "wb").write(good[: len(good) // 2])
    elif damage == "other_torch":  # the key matches, what wrote it does not
        with zipfile.ZipFile(path) as z:
            meta = z.read("meta.json").replace(torch.__version__.encode(), b"1.0.0")
        _rewrite(path, "meta.json", meta)
    elif damage == "planted_constant":  # a pickle that calls a function: refused, never run
        import pickle

        _rewrite(path, "constants.pt", pickle.dumps(_Planted(), protocol=2))
    elif damage.startswith("planted"):
        _plant(path, damage)
    else:  # an entry of a wider model under this key: its tensors do not fit
        capture(_net(width=24), (x,), modes=("eval",))
        other = next(f for f in _entries() if f != entry)
        os.replace(os.path.join(cache.directory(), other), path)
    before = len(exports)
    with pytest.warns(HydroWarning, match="capture cache entry .* capturing the model again"):
        cap = capture(_net(), (x,), modes=("eval",))
    assert len(exports) == before + 1
    assert not os.path.exists(PLANTED)
    assert torch.equal(cap.eval()(x), _net().eval()(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capture(_net(), (x,), modes=("eval",))  # rewritten: a hit now
    assert len(exports) == before + 1


def test_disabled_cache_writes_nothing(exports, monkeypatch):
    x = torch.randn(4, 6)
    capture(Net(), (x,), modes=("eval",), cache=False)
    monkeypatch.setenv("HYDRO_CACHE", "0")
    capture(Net(), (x,), modes=("eval",))
    assert len(exports) == 2
    assert not os.path.exists(cache.directory())


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * float(np.random.rand() > 2)  # a host draw, frozen by capture


def test_models_capture_cannot_trust_are_not_cached(exports):
    x = torch.randn(3, 4)
    for _ in range(2):  # the NumPy draw is seen (and warned about) every time
        with pytest.warns(HydroWarning, match="NumPy's random generator"):
            capture(Noisy(), (x,), modes=("eval",))
    hooked = Net()
    seen = []
    hooked.fc1.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    capture(hooked, (torch.randn(4, 6),), modes=("eval",))
    capture(hooked, (torch.randn(4, 6),), modes=("eval",))
    assert len(exports) == 4
    assert not os.path.exists(cache.directory()) or not _entries()


def test_writers_of_one_key_at_once_leave_one_whole_entry(exports):
    import threading

    from hydro.fx.capture import _strip_guards

    model, x = Net().eval(), torch.randn(4, 6)
    gm = torch.export.export(model, (x,), strict=False).module()
    _strip_guards(gm)
    key = cache.key(model, (x,), {}, None)
    assert cache.store(key, gm, model)
    errors, loaded = [], []

    def write() -> None:
        try:
            for _ in range(4):
                assert cache.store(key, gm, model)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(3)]
    for t in threads:
        t.start()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a reader never meets a half-written entry
        while any(t.is_alive() for t in threads):
            loaded.append(cache.load(key, model))
    for t in threads:
        t.join()
    assert not errors and all(e is not None for e in loaded)
    # no temporary files left (beside the entry: the secret its HMAC is made with)
    assert sorted(os.listdir(cache.directory())) == [cache.KEY_FILE, key + cache.SUFFIX]


def test_the_key_is_the_same_in_another_process():
    # strings hash differently in every process (Net's set of names is ordered {silu, relu,
    # gelu} under seed 1 and {relu, silu, gelu} under 2): a key that followed it would never hit
    code = (
        "import torch; from hydro.fx import cache; from tests.cache_model import Net; "
        "print(cache.key(Net().eval(), (torch.zeros(4, 6),), {}, None))"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    keys = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=root)
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root,
                             capture_output=True, text=True, check=True, timeout=300)
        keys.append(out.stdout.strip().splitlines()[-1])
    keys.append(cache.key(Net().eval(), (torch.zeros(4, 6),), {}, None))
    assert keys[0] != "None" and len(set(keys)) == 1, keys


# --- Task(cache=), the config's task.cache and `hydro tune --no-cache` --------------------------


@pytest.fixture
def toy(tmp_path, monkeypatch, exports):
    """A toy ``hydro tune`` project in ``tmp_path``; ``toy(study, cache_line)`` writes its
    config and returns the path."""
    toy_project(tmp_path, monkeypatch, "toymod", toy_source())

    def write(study: str, cache_line: str = "") -> str:
        path = tmp_path / f"{study}.yaml"
        # quoted: YAML reads a bare `off` as False, which a study name must not be
        path.write_text(toy_config("toymod", study=repr(study), task=cache_line, steps=2))
        return str(path)

    return write


def test_task_cache_is_parsed_and_a_bad_value_refused(toy):
    from hydro.errors import ConfigError
    from hydro.tuning import config

    assert config.load(toy("a")).task.cache is True  # the default
    assert config.load(toy("b", "  cache: false\n")).task.cache is False
    assert config.load(toy("c", "  cache: true\n"), cache=False).task.cache is False  # --no-cache
    with pytest.raises(ConfigError, match=r"task: cache must be true .* or false .*'sometimes'"):
        config.load(toy("d", "  cache: sometimes\n"))
    with pytest.raises(ConfigError, match="cache must be true"):
        data = (torch.randn(4, 2), torch.randn(4, 2))
        hydro.Task(model=nn.Linear(2, 2), train_data=data, val_data=data, loss="mse", cache=1)


def test_tune_without_cache_writes_nothing_and_with_it_writes_then_hits(toy, exports):
    from hydro.cli import main

    stats0 = dict(cache.stats)
    assert main(["tune", toy("off", "  cache: false\n"), "--no-progress"]) == 0
    assert main(["tune", toy("flag"), "--no-cache", "--no-progress"]) == 0
    assert not os.path.exists(cache.directory())  # nothing written, not even the folder
    assert cache.stats == stats0 and len(exports) == 4  # train and eval, twice, exported
    assert main(["tune", toy("first"), "--no-progress"]) == 0  # the default: written
    written = _entries()
    assert len(written) == 2 and cache.stats["writes"] == stats0["writes"] + 2
    assert main(["tune", toy("second"), "--no-progress"]) == 0  # a second run: loaded
    assert _entries() == written and len(exports) == 6
    # the run's floor check (hydro.fx.floor.task_below_floor) captures first, its group reads
    # that entry: 2 hits in the first run, 4 in the second, no export more
    assert cache.stats["hits"] == stats0["hits"] + 6

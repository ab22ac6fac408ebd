"""A capture cache entry is trained only if this user's Hydro wrote it as it is (issue 36, point 3).

With ``HYDRO_CACHE_DIR`` a directory others could write, every ``relu`` of a cached graph
replaced by ``neg`` was loaded and trained, silently. Now the directory must be this user's
alone (as a checkpoint directory), and every entry carries an HMAC, keyed by this user's secret,
of its key and its bytes: a changed entry is captured again, never used.
"""

from __future__ import annotations

import os
import warnings
import zipfile

import pytest
import torch

from hydro.errors import HydroWarning
from hydro.fx import cache
from hydro.fx.capture import capture
from hydro.scaling import build
from tests.cache_model import Net

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def exports(tmp_path, monkeypatch):
    """The cache in ``tmp_path``, and a list that grows by one per ``torch.export.export``."""
    monkeypatch.setenv("HYDRO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HYDRO_CACHE", raising=False)
    cache._warned.clear()
    calls = []
    real = torch.export.export

    def counted(*args, **kwargs):
        calls.append(type(args[0]).__name__)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    return calls


def _net() -> Net:
    torch.manual_seed(0)
    return Net().double().eval()


def _entry() -> str:
    (name,) = [f for f in os.listdir(cache.directory()) if f.endswith(cache.SUFFIX)]
    return os.path.join(cache.directory(), name)


def _relu_to_neg(path: str) -> None:
    """Every relu of the entry's graph made a neg, the rest of the entry as it was: a graph
    that loads and runs, and trains something else."""
    with zipfile.ZipFile(path) as z:
        items = {n: z.read(n) for n in z.namelist()}
    text = items["graph.json"].decode()
    assert '"relu"' in text
    items["graph.json"] = text.replace('"relu"', '"neg"').encode()
    with zipfile.ZipFile(path, "w") as z:
        for name, data in items.items():
            z.writestr(name, data)


def test_an_entry_whose_relus_became_negs_is_captured_again(exports):
    x = torch.randn(4, 6, dtype=torch.float64)
    capture(_net(), (x,), modes=("eval",))
    _relu_to_neg(_entry())
    with pytest.warns(HydroWarning, match="capture cache entry .* capturing the model again"):
        cap = capture(_net(), (x,), modes=("eval",))
    assert len(exports) == 2  # captured again
    assert torch.equal(cap.eval()(x), _net()(x))
    with zipfile.ZipFile(_entry()) as z:  # and rewritten as Hydro made it
        assert '"neg"' not in z.read("graph.json").decode()


def test_an_entry_made_with_another_secret_is_captured_again(exports):
    """Whoever plants an entry cannot make its HMAC without this user's secret (mode 0600):
    an entry from another cache (its own secret) under this key is rebuilt."""
    x = torch.randn(4, 6, dtype=torch.float64)
    capture(_net(), (x,), modes=("eval",))
    path = _entry()
    key = os.path.join(cache.directory(), cache.KEY_FILE)
    assert oct(os.stat(key).st_mode & 0o777) == "0o600"
    os.remove(key)  # a fresh secret: the entry's HMAC was made with another
    cache._secret(create=True)
    _relu_to_neg(path)
    with pytest.warns(HydroWarning, match="not written by this user's Hydro"):
        capture(_net(), (x,), modes=("eval",))
    assert len(exports) == 2


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_cache_directory_others_can_write_is_neither_read_nor_written(exports, mode):
    x = torch.randn(4, 6, dtype=torch.float64)
    capture(_net(), (x,), modes=("eval",))
    path = _entry()
    before = os.stat(path).st_mtime_ns
    os.chmod(cache.directory(), mode)
    with pytest.warns(HydroWarning) as seen:
        cap = capture(_net(), (x,), modes=("eval",))
    lines = [str(w.message) for w in seen]
    assert len(lines) == 1, lines  # one line, naming the directory and what to do
    folder = cache.directory()
    assert f"capture cache directory {folder} is writable by others (mode {mode:o})" in lines[0]
    assert f"`chmod 700 {folder}`" in lines[0] and "HYDRO_CACHE_DIR" in lines[0]
    assert len(exports) == 2  # the entry was not read...
    assert os.stat(path).st_mtime_ns == before  # ...nor written
    assert torch.equal(cap.eval()(x), _net()(x))
    os.chmod(folder, 0o700)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capture(_net(), (x,), modes=("eval",))  # this user's alone again: a hit
    assert len(exports) == 2


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                    reason="only root can give a directory away")
def test_a_cache_directory_of_another_user_is_not_used(exports):
    x = torch.randn(4, 6, dtype=torch.float64)
    capture(_net(), (x,), modes=("eval",))
    os.chown(cache.directory(), 65534, 65534)
    with pytest.warns(HydroWarning, match=r"belongs to another user \(uid 65534\)"):
        capture(_net(), (x,), modes=("eval",))
    assert len(exports) == 2


def test_a_secret_others_could_read_is_replaced_and_its_entries_rebuilt(exports):
    x = torch.randn(4, 6, dtype=torch.float64)
    capture(_net(), (x,), modes=("eval",))
    key = os.path.join(cache.directory(), cache.KEY_FILE)
    os.chmod(key, 0o644)
    with pytest.warns(HydroWarning, match="capture cache entry"):
        capture(_net(), (x,), modes=("eval",))
    assert len(exports) == 2
    assert os.stat(key).st_mode & 0o777 == 0o600  # a new secret, this user's alone
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capture(_net(), (x,), modes=("eval",))
    assert len(exports) == 2


def test_a_changed_width_analysis_is_analyzed_again(exports):
    """The width analysis entries (``.hydro-wa``) are bound the same way: one whose values
    were changed (a width of 16 made 24) is not replayed."""
    x = torch.randn(4, 6, dtype=torch.float64)
    build(_net(), 2, example_inputs=(x,), seed=3)
    (name,) = [f for f in os.listdir(cache.directory()) if f.endswith(cache.ANALYSIS_SUFFIX)]
    path = os.path.join(cache.directory(), name)
    data = open(path, "rb").read()
    start = data.index(b"{")  # the entry's JSON (after the line of its HMAC)
    changed = data[:start] + data[start:].replace(b"16", b"24")
    assert changed != data
    with open(path, "wb") as f:
        f.write(changed)
    rebuilt = cache.stats["rebuilt"]
    with pytest.warns(HydroWarning, match="running the width analysis again"):
        build(_net(), 2, example_inputs=(x,), seed=3)
    assert cache.stats["rebuilt"] == rebuilt + 1

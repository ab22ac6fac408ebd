"""What compiling a fused group cost and bought, kept per graph on disk (issue 34, point 3):
a record is found for the same graph, fusion size, device and mode only; a corrupt or foreign
one is ignored (it can only sway a decision); ``compile="auto"`` decides from it and says so;
inductor's own caches go to Hydro's checked cache folder."""

from __future__ import annotations

import json
import os
import stat

import pytest

from hydro.tuning import compile_record, compiling
from hydro.tuning.group import FusedGroup
from tests import toy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HYDRO_CACHE", raising=False)
    return tmp_path / "cache"


def test_a_record_is_kept_for_its_key_only(folder):
    k = compile_record.key(["def forward(x): ..."], 16, "cpu", True)
    assert k == compile_record.key(["def forward(x): ..."], 16, "cpu", True)
    others = {compile_record.key(["def forward(y): ..."], 16, "cpu", True),
              compile_record.key(["def forward(x): ..."], 8, "cpu", True),
              compile_record.key(["def forward(x): ..."], 16, "cuda:0", True),
              compile_record.key(["def forward(x): ..."], 16, "cpu", "max-autotune")}
    assert k not in others and len(others) == 4
    assert compile_record.load(k) is None  # miss
    assert compile_record.store(k, 11.5, 1.42)
    assert compile_record.load(k) == {"compile_s": 11.5, "speedup": 1.42}  # hit
    assert all(compile_record.load(o) is None for o in others)
    path = folder / (k + compile_record.SUFFIX)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    # another key's record under this name (copied, stale): ignored
    other = next(iter(others))
    os.replace(path, folder / (other + compile_record.SUFFIX))
    assert compile_record.load(other) is None
    bad = [{"version": 1, "key": k, "compile_s": "soon"},
           {"version": 1, "key": k, "compile_s": -3, "speedup": 1},
           {"version": 0, "key": k, "compile_s": 3, "speedup": 1}]
    for text in ["{", *map(json.dumps, bad)]:
        path.write_text(text)
        assert compile_record.load(k) is None  # corrupt, impossible or of an older format


def test_nothing_is_kept_with_the_cache_off(folder, monkeypatch):
    monkeypatch.setenv("HYDRO_CACHE", "0")
    k = compile_record.key(["g"], 2, "cpu", True)
    assert not compile_record.store(k, 1.0, 2.0) and compile_record.load(k) is None


def test_auto_decides_from_the_record_and_says_so(folder):
    task = toy.task(steps=40, eval_every=10)
    lines: list[str] = []
    members = [(k, {"lr": 0.01}, k) for k in range(2)]
    group = FusedGroup(task, members, ratio=2, compile="auto", note=lines.append)
    group.step()  # the first step builds the graphs (and is not timed)
    graphs = group.fused._graphs.values()
    k = compile_record.key((gm.code for gm in graphs), group.n, group.device, True)
    compile_record.store(k, 1e6, 1.5)  # compiling this graph took for ever here
    for _ in range(compiling.MEASURED_STEPS):
        group.step()
    assert group.compile is False and len(lines) == 1
    assert lines[0].startswith("compile: auto -> off (") and "compile est. 1000000 s" in lines[0]
    assert lines[0].endswith("; measured here before (x1.50)")
    # a record of compile=True (its speed-up not measured): the default assumed, and said so
    again = FusedGroup(task, members, ratio=2, compile="auto", note=lines.append)
    compile_record.store(k, 1e6, None)
    for _ in range(1 + compiling.MEASURED_STEPS):
        again.step()
    assert lines[1].endswith(f"; compile measured here before, speed-up assumed "
                             f"(x{compiling.SPEEDUP:.2f})")


def test_inductor_caches_go_to_the_checked_folder(folder, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    compile_record.use_private_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")
    assert stat.S_IMODE((folder / "inductor").stat().st_mode) == 0o700
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")  # the user's choice stays
    compile_record.use_private_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"

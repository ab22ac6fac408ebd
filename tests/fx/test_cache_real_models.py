"""The capture cache reads back every program it writes: each model of ``tests/real_models.py``
captured in one process is loaded, not exported again, in a second process (the same key, the
same ops; HF BERT's mask code records ``aten.__and__.Tensor``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hydro.fx import serial
from hydro.fx.capture import capture
from tests import real_models

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = """
import json, sys, warnings
import torch
torch.set_num_threads(1)
from hydro.fx import cache
from hydro.fx.capture import capture
from tests import real_models
exports = []
real = torch.export.export
def counted(*a, **k):
    exports.append(1)
    return real(*a, **k)
torch.export.export = counted
out = {}
for name in sys.argv[1:]:
    model, make = real_models.build(name)
    args, kwargs = make(2, torch.Generator().manual_seed(0))
    before = dict(cache.stats), len(exports)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        capture(model, args, kwargs)
    out[name] = {k: cache.stats[k] - before[0][k] for k in ("hits", "writes", "rebuilt")}
    out[name]["exports"] = len(exports) - before[1]
    out[name]["warnings"] = [str(w.message) for w in seen if "cache" in str(w.message)]
print("RESULT " + json.dumps(out))
"""


def _names() -> list[str]:
    names = list(real_models.MODELS)
    if real_models.timm_available():
        names += list(real_models.TIMM_MODELS)
    try:
        import transformers  # noqa: F401
    except ImportError:
        names = [n for n in names if not n.startswith("hf_")]
    return names


def _run(folder: str, names: list[str]) -> dict:
    env = dict(os.environ, HYDRO_CACHE_DIR=folder, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("HYDRO_CACHE", None)
    done = subprocess.run([sys.executable, "-c", _SCRIPT, *names], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_every_real_model_is_written_then_loaded_in_another_process(tmp_path):
    names = _names()
    folder = str(tmp_path / "cache")
    first = _run(folder, names)
    for name in names:  # train and eval programs, each written whole
        assert first[name]["writes"] == 2 and first[name]["exports"] == 2, (name, first[name])
    second = _run(folder, names)
    for name in names:
        got = second[name]
        assert (got["hits"], got["exports"], got["rebuilt"]) == (2, 0, 0), (name, got)
        assert got["warnings"] == [], (name, got)


def test_a_dunder_op_round_trips_and_other_dunders_are_refused():
    class Masked(torch.nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return x * (mask & (x > 0)).to(x.dtype)

    x, mask = torch.randn(3, 4), torch.rand(3, 4) > 0.5
    gm = capture(Masked(), (x, mask), cache=False).graphs["train"]
    text = json.dumps(serial.encode(gm), separators=(",", ":"))
    op = '["op","aten","__and__","Tensor"]'
    assert op in text
    back = serial.decode(json.loads(text), {})
    assert torch.equal(back(x, mask), gm(x, mask))
    bad_ops = ['["op","aten","__class__","Tensor"]', '["op","aten","__and__","__doc__"]',
               '["op","aten","__and__","missing"]', '["op","aten","__init__","Tensor"]']
    for bad in bad_ops:
        with pytest.raises(serial.Invalid):
            serial.decode(json.loads(text.replace(op, bad)), {})

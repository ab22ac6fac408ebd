"""The benchmarks a lent GPU runs first work before one is lent: ``benchmarks/gpu_suite.py`` on
the CPU at toy sizes (every section but the compiled rows, which a cold inductor takes minutes
over; the data parallel check with gloo in place of NCCL), and ``benchmarks/dropout.py``'s
per-element table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str, timeout: float) -> str:
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_gpu_suite_runs_on_the_cpu_and_writes_its_json_and_table(tmp_path: Path) -> None:
    _run("benchmarks/gpu_suite.py", "--device", "cpu", "--small", "--no-compile",
         "--dp-on-cpu", "--out", str(tmp_path), timeout=240)
    result = json.loads((tmp_path / "gpu_suite.json").read_text())
    table = (tmp_path / "gpu_suite.md").read_text()
    assert result["device"] == "cpu" and result["small"]
    drops = result["dropout"]
    assert drops["same_as_cpu"]
    assert [r["method"] for r in drops["rows"]] == ["torch", "streams v1", "streams"]
    eager = {r["method"]: r for r in result["fusion"] if r.get("mode") == "eager"}
    assert set(eager) == {"sequential", "vmap", "fused"}
    assert all(r["trial_steps_per_s"] > 0 for r in eager.values())
    assert result["fusion"][-1]["skipped"] == "--no-compile"
    auto = result["fuse_auto"]
    assert auto["n"] >= 1 and auto["predicted_bytes"] > 0, auto
    dp = result["data_parallel"]
    assert dp["backend"] == "gloo" and dp["equal"], dp
    methods = [r["method"] for r in result["end_to_end"]]
    assert methods == ["plain", "hydro"], result["end_to_end"]
    precision = {r["precision"]: r for r in result["precision"]}
    assert set(precision) == {"fp32", "bf16", "fp16"}, result["precision"]
    assert precision["fp32"]["first_loss_diff"] == 0 < precision["fp16"]["first_loss_diff"] < 0.05
    assert all(s <= 2.0**16 for s in precision["fp16"]["scales"])
    for title in ("## Dropout", "## Fusion", "## fuse='auto'", "## Data parallel",
                  "## End to end", "## Precision"):
        assert title in table
    assert "| MLP w64 | 4 | fused | eager |" in table


def test_gpu_suite_skips_data_parallel_with_fewer_than_two_gpus(tmp_path: Path) -> None:
    skip = "dropout,fusion,fuse_auto,end_to_end,precision"
    _run("benchmarks/gpu_suite.py", "--device", "cpu", "--small", "--no-compile", "--skip", skip,
         "--out", str(tmp_path), timeout=60)
    result = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert "needs 2" in result["data_parallel"]["skipped"]
    assert "needs 2" in (tmp_path / "gpu_suite.md").read_text()


def test_dropout_benchmark_prints_its_per_element_table() -> None:
    out = _run("benchmarks/dropout.py", "--n", "2", "--repeats", "1", "--min-time", "0.01",
               "--skip-group", timeout=120)
    rows = [line for line in out.splitlines() if line.startswith("| [")]
    assert [r.split("|")[2].strip() for r in rows[:3]] == ["torch", "streams v1", "streams"]

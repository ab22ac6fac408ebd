"""The shipped example configs tune at a ratio Hydro itself recommends: at each one's ratio no
layer falls below its width floor (Hydro's own check, which warns), and it is the ratio that
``ratio: auto`` picks, as their comments say. Cheap: the models are scaled, never trained."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import yaml

import hydro
from hydro.errors import HydroWarning
from hydro.fx.floor import layer_widths
from hydro.scaling import build
from hydro.tuning.trust import resolve_callable

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "examples").glob("*/tune.yaml"))


def _example(path: Path) -> tuple[dict, torch.nn.Module, tuple]:
    """The config, its full model and two of its training inputs."""
    cfg = yaml.safe_load(path.read_text())
    task = cfg["task"]

    def load(spec: str):
        return resolve_callable(spec, "callable", (str(ROOT),), trust=("examples",))

    torch.manual_seed(0)
    model = load(task["model"])(**task.get("model_args", {}))
    data = load(task["data"])(**task.get("data_args", {}))["train"]
    x = data["input_ids"] if isinstance(data, dict) else data[0]
    return cfg, model, (x[:2],)


def test_every_example_has_a_config():
    assert {p.parent.name for p in CONFIGS} >= {"charlm", "cnn", "hf_gpt2", "own_loop"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.parent.name)
def test_the_example_ratio_keeps_every_layer_above_its_floor(path):
    cfg, model, inputs = _example(path)
    ratio = cfg["ratio"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", HydroWarning)  # Hydro's floor check warns below a floor
        scaled = build(model, ratio, example_inputs=inputs)
    assert scaled.plan.ratio == ratio
    below = [str(lw) for lw in layer_widths(scaled.plan) if lw.below]
    assert not below, f"{path}: ratio {ratio} takes layers below their floor: {below}"
    if ratio != "auto":  # what `ratio: auto` picks: the config says it is the same
        assert "auto" in path.read_text().split(f"ratio: {ratio}", 1)[1].splitlines()[0]
        assert hydro.scale(model, "auto", example_inputs=inputs).hydro.ratio == ratio

"""The width floor: ``ratio="auto"`` picks the largest ratio that keeps every layer above the
floor of its kind, an explicit ratio below it warns naming the layer, bad ratios are refused."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import optuna
import pytest
import torch
from optuna.distributions import FloatDistribution
from torch import nn

import hydro
from examples.charlm.model import gpt
from examples.cnn.model import cnn
from hydro.cli import main
from hydro.errors import ConfigError, HydroWarning, ScaleError
from hydro.fx.floor import FLOORS, MAX_AUTO_RATIO, MAX_AUTO_RATIO_ATTENTION, layer_widths
from hydro.scaling import build
from hydro.tuning import config as config_module
from tests.cli.test_commands import CONFIG, TOY
from tests.real_models import build as real_model

ROOT = Path(__file__).resolve().parents[2]

IMAGES = (torch.zeros(2, 3, 16, 16),)


def mlp(width: int = 1024) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


def largest(width: int, floor: int) -> int:
    """The largest power of two up to MAX_AUTO_RATIO with ``width / ratio >= floor``."""
    r = 1
    while r < MAX_AUTO_RATIO and width // (2 * r) >= floor and width % (2 * r) == 0:
        r *= 2
    return r


def test_the_floors_are_measured_widths():
    # benchmarks/width_floor.py measured these; a floor of 0 or 1 would make 'auto' pick 64
    assert set(FLOORS) == {"linear", "conv", "attention"}
    assert all(isinstance(v, int) and v >= 2 for v in FLOORS.values())


def test_auto_on_an_mlp_keeps_the_hidden_width_at_the_linear_floor():
    width = 8 * FLOORS["linear"]  # ratio 8 reaches the floor exactly, 16 would cross it
    sur = hydro.scale(mlp(width), "auto", example_inputs=(torch.randn(2, 32),))
    assert sur.hydro.ratio == 8 == largest(width, FLOORS["linear"])
    assert sur.get_parameter("2.weight").shape == (width // 8, width // 8)
    assert str(sur.hydro.auto) == (
        f"ratio 'auto' chose 8: ratio 16 would take '0' (linear): width {width} -> "
        f"{width // 16}, floor {FLOORS['linear']} (3 layer(s) below floor)"
    )
    widths = layer_widths(build(mlp(width), 8, example_inputs=(torch.randn(2, 32),)).plan)
    assert [(lw.path, lw.surrogate) for lw in widths] == [(p, FLOORS["linear"]) for p in "024"]
    # a wide model stops at the largest ratio auto tries
    wide = nn.Sequential(nn.Linear(32, 64 * FLOORS["linear"]), nn.ReLU(),
                         nn.Linear(64 * FLOORS["linear"], 10))
    wide = hydro.scale(wide, "auto", example_inputs=(torch.randn(2, 32),))
    assert wide.hydro.ratio == MAX_AUTO_RATIO == 64
    assert wide.hydro.auto.reason == "64 is the largest ratio 'auto' tries"


def test_auto_on_nanogpt_respects_the_linear_and_head_dim_floors():
    model, batch = real_model("nanogpt")
    args, kwargs = batch(2, torch.Generator().manual_seed(0))
    scaled = build(model, "auto", example_inputs=args, example_kwargs=kwargs)
    ratio = scaled.surrogate.hydro.ratio
    widths = layer_widths(scaled.plan)
    heads = [lw for lw in widths if lw.kind == "attention"]
    assert [lw.path for lw in heads] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert all(not lw.below for lw in widths)

    # n_embd 64, 4 heads of 16: ratios 2 and 4 drop heads (head dim 16 kept); 8 and more keep
    # 4 heads and cut the head dim to 64 / ratio / 4
    def fits(r: int) -> bool:
        head_dim = 16 if r <= 4 else 64 // r // 4
        # a width already below its floor in the target may stay, not shrink
        return 64 // r >= min(FLOORS["linear"], 64) and head_dim >= min(FLOORS["attention"], 16)

    want = max(r for r in (1, 2, 4, 8, 16) if fits(r))
    assert ratio == want
    if want < 16:  # the next ratio up is refused by a floor, named in the reason
        assert f"ratio {2 * want} would take" in scaled.surrogate.hydro.auto.reason


def test_auto_stops_at_the_attention_cap_on_a_gpt_whose_floors_allow_more():
    # the README's GPT (width 256, 4 heads of 64): ratio 8 keeps width 32 and head dim 8, both
    # at their floors, yet transferred worse end to end than ratio 4 (docs/explanation/transfer.md)
    model = gpt(n_layer=1, n_head=4, n_embd=256, block_size=16)
    tokens = (torch.zeros(2, 16, dtype=torch.long),)
    eight = layer_widths(build(model, 8, example_inputs=tokens).plan)
    assert not any(lw.below for lw in eight)  # the floors alone would take ratio 8
    sur = hydro.scale(model, "auto", example_inputs=tokens)
    assert sur.hydro.ratio == MAX_AUTO_RATIO_ATTENTION == 4
    assert sur.hydro.auto.reason == (
        "ratio 8 is above 4, the largest 'auto' takes for a model with attention ('h.0.attn')"
    )
    # an explicit ratio is built as asked, and within the floors it does not warn
    with warnings.catch_warnings():
        warnings.simplefilter("error", HydroWarning)
        assert hydro.scale(model, 8, example_inputs=tokens).hydro.ratio == 8
    # a model without attention is not capped: the MLP above goes to 8
    assert hydro.scale(mlp(8 * FLOORS["linear"]), "auto",
                       example_inputs=(torch.randn(2, 32),)).hydro.ratio == 8


def test_auto_on_a_batchnorm_cnn_is_bounded_by_the_conv_floor_and_inspect_shows_it():
    report = hydro.inspect(cnn(width=64), "auto", example_inputs=IMAGES)
    want = min(largest(64, FLOORS["conv"]), largest(128, FLOORS["linear"]))
    assert report.ratio == want
    rows = {r.path: r for r in report.rows}
    assert rows["stem.0"].surrogate_shape[0] == 64 // want
    assert rows["layer1.conv1"].floor == FLOORS["conv"] and rows["head"].floor == FLOORS["linear"]
    assert rows["layer1.bn1"].floor is None  # a norm has no width of its own
    text = str(report)
    assert "floor" in text.splitlines()[0]
    assert f"ratio 'auto' chose {want}: ratio {2 * want} would take 'stem.0' (conv)" in text
    assert "width floor: closest to it (bounds the ratio) 'stem.0' (conv)" in text
    data = report.to_dict()
    assert data["ratio"] == want and data["auto"].startswith(f"ratio 'auto' chose {want}")
    kinds = {f["path"]: f["kind"] for f in data["floors"]}
    assert kinds["layer3.conv2"] == "conv" and kinds["head"] == "linear"
    assert not any(f["below"] for f in data["floors"])


def test_an_explicit_ratio_below_the_floor_warns_naming_the_layer():
    ratio = 2 * largest(64, FLOORS["conv"])
    with pytest.warns(HydroWarning) as record:
        report = hydro.inspect(cnn(width=64), ratio, example_inputs=IMAGES)
    message = str(record[0].message)
    narrow = 64 // ratio
    assert f"'layer1.conv1' (conv): width 64 -> {narrow}, floor {FLOORS['conv']}" in message
    assert "ratio='auto'" in message and f"ratio {ratio} takes" in message
    assert report.auto is None and "(below)" in str(report)
    assert "below the width floor" in str(report)
    assert {f["path"] for f in report.to_dict()["floors"] if f["below"]} >= {"stem.0"}
    with pytest.warns(HydroWarning) as record:
        hydro.scale(mlp(4 * FLOORS["linear"]), 8, example_inputs=(torch.randn(2, 32),))
    assert record[0].filename == __file__  # points at the caller's line


def test_a_ratio_within_the_floors_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", HydroWarning)
        hydro.scale(mlp(8 * FLOORS["linear"]), 8, example_inputs=(torch.randn(2, 32),))
        # a naive (sp) model is for comparisons, not transfer: no floor warning
        hydro.scale(mlp(8 * FLOORS["linear"]), 16, example_inputs=(torch.randn(2, 32),),
                    parametrization="sp")


def test_auto_picks_ratio_1_and_says_so_when_nothing_can_shrink():
    narrow = mlp(FLOORS["linear"])
    with pytest.warns(HydroWarning, match=r"chose 1 for Sequential: the surrogate is the model"):
        sur = hydro.scale(narrow, "auto", example_inputs=(torch.randn(2, 32),))
    assert sur.hydro.ratio == 1


@pytest.mark.parametrize("ratio", [0, -8, 2.5, True, "fast", "AUTO", None])
def test_bad_ratios_are_refused(ratio):
    with pytest.raises(ScaleError, match=r"ratio must be a positive integer .* or 'auto'"):
        hydro.scale(mlp(64), ratio, example_inputs=(torch.randn(2, 32),))
    with pytest.raises(ScaleError, match=r"or 'auto', got"):
        hydro.inspect(mlp(64), ratio, example_inputs=(torch.randn(2, 32),))


def test_attention_written_out_is_found_by_its_head_dim():
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.proj = nn.Linear(64, 192), nn.Linear(64, 64)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, 2, c // 2).permute(2, 0, 3, 1, 4)
            att = (q @ k.transpose(-2, -1)) * (c // 2) ** -0.5
            return self.proj((att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c))

    with pytest.warns(HydroWarning, match="'proj' \\(linear\\): width 64 -> 16, floor 32"):
        plan = build(Attention(), 4, example_inputs=(torch.randn(2, 5, 64),),
                     head_policy="keep_head_count").plan
    heads = [lw for lw in layer_widths(plan) if lw.kind == "attention"]
    # q @ k^T contracts the head dim (32 -> 8); att @ v contracts positions, not a width
    assert [(lw.path, lw.target, lw.surrogate) for lw in heads] == [("matmul", 32, 8)]


def test_tune_with_auto_reports_the_ratio_it_chose(tmp_path):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
    task = hydro.Task(model=mlp(256), train_data=(x, y), val_data=(x, y), steps=2)
    space = {"lr": FloatDistribution(1e-3, 1e-1, log=True)}
    result = hydro.tune(task, space, n_trials=2, ratio="auto", fuse=2,
                        storage=f"sqlite:///{tmp_path}/s.db")
    want = largest(256, FLOORS["linear"])
    assert result.ratio == want
    assert {t.user_attrs["ratio"] for t in result.study.trials} == {want}
    with pytest.raises(ScaleError, match="or 'auto', got 'fast'"):
        hydro.tune(task, space, n_trials=1, ratio="fast", storage="sqlite:///:memory:")


def test_cli_inspect_defaults_to_auto(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "plan.json"
    assert main(["inspect", "examples.models:mlp", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ratio"] == largest(1024, FLOORS["linear"])  # 4 layers of width 1024
    assert data["auto"].startswith(f"ratio 'auto' chose {data['ratio']}")
    assert f"ratio 'auto' chose {data['ratio']}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["inspect", "examples.models:mlp", "--ratio", "fast"])
    assert exc.value.code == 2 and "must be 'auto' or an integer, got 'fast'" in (
        capsys.readouterr().err
    )


def test_cli_tune_defaults_to_auto_and_configs_check_the_ratio(tmp_path, capsys, monkeypatch):
    (tmp_path / "toymod.py").write_text(TOY)
    config = "\n".join(line for line in CONFIG.splitlines() if not line.startswith("ratio"))
    (tmp_path / "tune.yaml").write_text(config.replace("trials: 4", "trials: 2"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "toymod", raising=False)
    assert main(["tune", "tune.yaml"]) == 0
    want = largest(64, FLOORS["linear"])  # toymod's model: one hidden layer of 64
    assert f"ratio {want} (auto)" in capsys.readouterr().err
    study = optuna.load_study(study_name="toy", storage="sqlite:///toy.db")
    assert {t.user_attrs["ratio"] for t in study.trials} == {want}
    (tmp_path / "bad.yaml").write_text(config.replace("fuse: 2", "fuse: 2\nratio: fast"))
    with pytest.raises(ConfigError, match=r"bad.yaml: ratio must be 'auto' or an integer >= 1"):
        config_module.load("bad.yaml")

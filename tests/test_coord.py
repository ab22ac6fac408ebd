"""`hydro coord-check` tells muP from naive narrowing on the examples whose transfer is measured
(docs/explanation/transfer.md), and its plot stays readable on a model with many layers."""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch import nn

from hydro.cli import main
from hydro.coord import CoordCheckResult

ROOT = pathlib.Path(__file__).resolve().parents[1]


def charlm_small() -> nn.Module:
    """The README's character GPT at its width (256), two blocks: what `coord-check` judges."""
    from examples.charlm.model import gpt

    return gpt(n_layer=2, n_head=4, n_embd=256, block_size=16)


def cnn_small() -> nn.Module:
    from examples.cnn.model import cnn

    return cnn(width=64)


def _verdict(capsys: pytest.CaptureFixture) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("model", "args", "status"),
    [
        # widths 256 and 32 (charlm), 64 and 8 channels (cnn): muP holds, naive narrowing not
        ("charlm_small", [], 0),
        ("charlm_small", ["--lr", "3e-3", "--parametrization", "sp"], 1),
        ("cnn_small", [], 0),
        ("cnn_small", ["--parametrization", "sp"], 1),
    ],
)
def test_coord_check_passes_muP_examples_and_fails_naive_narrowing(
    model: str, args: list[str], status: int, tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.chdir(ROOT)
    png = tmp_path / "coord.png"
    argv = ["coord-check", f"tests.test_coord:{model}", "--ratios", "1,8", "-o", str(png), *args]
    assert main(argv) == status
    verdict = _verdict(capsys)
    assert verdict.startswith(f"verdict: {'PASS' if status == 0 else 'FAIL'}"), verdict
    assert png.stat().st_size > 10_000


def _many_layers() -> CoordCheckResult:
    """A 25-layer result shaped like the char GPT's: embeddings, norms, attention and MLP
    linears over 4 blocks, the readout; sizes growing with width for the MLP projections."""
    ratios, steps = [1, 2, 4, 8], 3
    res = CoordCheckResult(ratios, steps, "mup", widths={r: 1024 // r for r in ratios})
    layers = {"wte": ("embedding", "input"), "wpe": ("embedding", "input")}
    norm, linear = ("layer_norm", "vector"), ("linear", "hidden")
    for b in range(4):
        for part, kind in (("ln_1", norm), ("attn.c_attn", linear), ("attn.c_proj", linear),
                           ("ln_2", norm), ("mlp.c_fc", linear)):
            layers[f"h.{b}.{part}"] = kind
    layers |= {"h.3.mlp.c_proj": ("linear", "hidden"), "ln_f": ("layer_norm", "vector"),
               "lm_head": ("linear", "output")}
    for i, (name, (op, role)) in enumerate(layers.items()):
        res.ops[name], res.roles[name] = op, role
        grow = 2.0 if name.endswith("c_proj") else 1.0 + i / 100
        for r in ratios:
            res.sizes.setdefault(r, {})[name] = [0.1 * grow ** (3 - r.bit_length()) + t / 10
                                                 for t in range(steps)]
    return res


def test_plot_has_one_panel_per_layer_kind_and_few_named_lines(tmp_path) -> None:
    import matplotlib.pyplot as plt

    res = _many_layers()
    assert len(res.sizes[1]) >= 25
    fig = res.plot(threshold=2.0)
    try:
        titles = [ax.get_title() for ax in fig.axes if ax.get_visible() and ax.lines]
        assert titles[:4] == ["embedding", "norm, worst 6 of 9", "linear (hidden), worst 6 of 13",
                              "output (logits)"]
        assert titles[4].startswith("spread")
        for ax in fig.axes:
            if not ax.lines:
                continue
            labels = [t.get_text() for t in ax.get_legend().get_texts()]
            assert len(labels) <= 7 and len(set(labels)) == len(labels), labels
            colours = [tuple(line.get_color()) for line in ax.lines if line.get_label() in labels]
            assert len(set(colours)) == len(colours)  # no colour recycled within a panel
        hidden = next(ax for ax in fig.axes if ax.get_title().startswith("linear (hidden)"))
        named = [t.get_text() for t in hidden.get_legend().get_texts()]
        # the worst layers are the ones named, worst first, with their spread
        assert named[0].startswith("h.0.attn.c_proj (") and all("c_proj" in n for n in named[:5])
        assert "FAIL" in fig._suptitle.get_text()
    finally:
        plt.close(fig)
    png = tmp_path / "c.png"
    plt.close(res.plot(str(png)))
    assert png.stat().st_size > 10_000


def test_logits_get_cross_entropy_and_a_single_output_mse() -> None:
    from hydro.cli import _synthetic_task

    target, loss = _synthetic_task(torch.zeros(4, 16, 65))
    assert target.dtype == torch.long and target.shape == (4, 16) and int(target.max()) < 65
    assert loss(torch.zeros(4, 16, 65), target).item() == pytest.approx(
        torch.log(torch.tensor(65.0))
    )
    logits = torch.zeros(4, 16, 65)
    target, loss = _synthetic_task((logits, "extra"))  # a tuple: its first tensor
    assert target.shape == (4, 16) and loss((logits, "extra"), target).item() > 4
    nested = {"logits": {"logits": logits}}  # a ModelOutput comes back from a graph nested
    target, loss = _synthetic_task(nested)
    assert target.shape == (4, 16) and loss(nested, target).item() > 4
    target, loss = _synthetic_task(torch.zeros(8, 1))
    assert target.dtype == torch.float32 and loss(torch.zeros(8, 1), target) > 0

"""The examples: data, models, scaling with Hydro, a few training steps, and their tune.yaml files.

Models are kept small (one or two blocks) except where a test is about the shipped size, so the
whole file runs in seconds on a CPU.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

import hydro
from examples.charlm import data as chardata
from examples.charlm.model import gpt
from examples.cnn import data as cnndata
from examples.cnn.model import cnn, error_rate

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models


def _train_losses(model, groups, x, y, steps: int) -> tuple[float, float]:
    """Loss on a fixed batch before and after ``steps`` AdamW steps on it."""
    opt = torch.optim.AdamW(groups)
    model.train()
    with torch.no_grad():
        before = F.cross_entropy(model(x).flatten(0, -2), y.flatten()).item()
    for _ in range(steps):
        loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = F.cross_entropy(model(x).flatten(0, -2), y.flatten()).item()
    return before, after


# --- char LM data --------------------------------------------------------------------------------


def test_charlm_vocab_is_sorted_and_round_trips():
    assert chardata.VOCAB == sorted(set(chardata.TEXT))
    assert chardata.VOCAB_SIZE == len(chardata.VOCAB) > 60  # letters, digits, punctuation
    text = chardata.TEXT[1000:1500]
    ids = chardata.encode(text)
    assert all(0 <= i < chardata.VOCAB_SIZE for i in ids)
    assert chardata.decode(ids) == text
    assert chardata.decode(torch.tensor(ids)) == text


def test_charlm_load_shapes_shift_and_split():
    d = chardata.load(block_size=32, val_fraction=0.1, max_chars=20_000)
    (x, y), (xv, yv) = d["train"], d["val"]
    assert x.dtype == y.dtype == torch.long
    assert x.shape == y.shape and x.shape[1] == 32
    assert xv.shape == yv.shape and xv.shape[1] == 32
    assert x.shape[0] == (18_000 - 1) // 32 and xv.shape[0] == (2_000 - 1) // 32
    # y is x shifted by one, also across window boundaries (non-overlapping windows).
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x[1:, 0], y[:-1, -1])
    assert chardata.decode(x[0]) == chardata.TEXT[:32]
    # Validation is the tail of the text.
    assert chardata.decode(xv[0]) == chardata.TEXT[18_000:18_032]


def test_charlm_load_is_deterministic_and_full_size():
    a, b = chardata.load(), chardata.load()
    for split in ("train", "val"):
        assert torch.equal(a[split][0], b[split][0]) and torch.equal(a[split][1], b[split][1])
    n = len(chardata.TEXT)
    assert n > 300_000
    assert a["train"][0].numel() + a["val"][0].numel() > 0.99 * n
    with pytest.raises(ValueError):
        chardata.load(val_fraction=0.0)


# --- char LM model -------------------------------------------------------------------------------


def test_gpt_structure_and_init():
    torch.manual_seed(0)
    m = gpt(n_layer=2, n_head=4, n_embd=64, block_size=16, dropout=0.1)
    assert m.lm_head.weight is m.wte.weight  # tied
    assert m.wte.weight.shape == (chardata.VOCAB_SIZE, 64)
    drops = [mod for mod in m.modules() if isinstance(mod, torch.nn.Dropout)]
    assert len(drops) == 1 + 2 * 2 and all(d.p == 0.1 for d in drops)
    # GPT-2 init: 0.02 everywhere, residual projections 0.02 / sqrt(2 * n_layer).
    assert abs(m.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.002
    assert abs(m.h[0].mlp.c_proj.weight.std().item() - 0.01) < 0.001
    out = m(torch.zeros(3, 16, dtype=torch.long))
    assert out.shape == (3, 16, chardata.VOCAB_SIZE)
    with pytest.raises(ValueError):
        gpt(n_head=3, n_embd=64)


def test_gpt_is_causal():
    torch.manual_seed(0)
    m = gpt(n_layer=1, n_head=2, n_embd=32, block_size=16).eval()
    x = torch.randint(chardata.VOCAB_SIZE, (1, 16))
    x2 = x.clone()
    x2[0, 10:] = (x2[0, 10:] + 1) % chardata.VOCAB_SIZE
    assert torch.allclose(m(x)[0, :10], m(x2)[0, :10])
    assert not torch.allclose(m(x)[0, 10:], m(x2)[0, 10:])


def test_gpt_scales_at_ratio_8():
    """The shipped target size (tune.yaml's) scales: every hidden width / 8, vocab kept."""
    x = chardata.load(max_chars=5_000)["train"][0]
    torch.manual_seed(0)
    model = gpt(n_layer=4, n_head=4, n_embd=256)
    sur = hydro.scale(model, 8, example_inputs=(x[:2],))
    assert sur.get_parameter("wte.weight").shape == (chardata.VOCAB_SIZE, 32)
    assert sur.get_parameter("wpe.weight").shape == (64, 32)
    assert sur.get_parameter("h.0.attn.c_attn.weight").shape == (96, 32)
    assert sur.get_parameter("h.3.mlp.c_fc.weight").shape == (128, 32)
    assert sur.state_dict().keys() == model.state_dict().keys()
    assert sur.hydro.roles["h.0.mlp.c_fc.weight"] == "hidden"
    n_sur = sum(p.numel() for p in sur.parameters())
    n_target = sum(p.numel() for p in model.parameters())
    assert n_target / n_sur > 40
    out = sur(x[:5])
    assert out.shape == (5, 64, chardata.VOCAB_SIZE) and torch.isfinite(out).all()


def test_gpt_ratio_1_is_the_model():
    x = chardata.load(block_size=16, max_chars=5_000)["train"][0]
    torch.manual_seed(0)
    model = gpt(n_layer=2, n_head=4, n_embd=64, block_size=16).eval()
    sur = hydro.scale(model, 1, example_inputs=(x[:2],))
    sur.load_state_dict(model.state_dict())
    sur.eval()
    assert torch.equal(sur(x[:4]), model(x[:4]))


def test_gpt_surrogate_learns():
    d = chardata.load(block_size=32, max_chars=20_000)
    x, y = d["train"][0][:8], d["train"][1][:8]
    torch.manual_seed(0)
    sur = hydro.scale(gpt(n_layer=1, n_head=4, n_embd=64, block_size=32), 8, example_inputs=(x,))
    groups = hydro.parametrize.param_groups(sur, lr=1e-2, weight_decay=0.0)
    assert len(groups) > 1  # muP: hidden matrices get their own learning rate
    before, after = _train_losses(sur, groups, x, y, steps=20)
    assert before > 4.0  # about log(VOCAB_SIZE) at init
    assert after < 0.8 * before


# --- CNN data ------------------------------------------------------------------------------------


def test_cnn_data_shapes_and_labels():
    d = cnndata.load(n_train=300, n_val=100, size=16)
    (x, y), xv = d["train"], d["val"][0]
    assert x.shape == (300, 3, 16, 16) and xv.shape == (100, 3, 16, 16)
    assert x.dtype == torch.float32 and y.dtype == torch.long
    assert y.min() >= 0 and y.max() < cnndata.NUM_CLASSES
    assert torch.equal(y.bincount(minlength=10), torch.full((10,), 30))  # balanced
    assert abs(x.mean().item()) < 0.3 and 0.7 < x.std().item() < 1.5
    assert not torch.equal(x[:100], xv)  # validation is drawn separately
    assert cnndata.load(n_train=10, n_val=10, size=24)["train"][0].shape == (10, 3, 24, 24)


def test_cnn_data_is_deterministic():
    a = cnndata.load(n_train=64, n_val=32, seed=3)
    b = cnndata.load(n_train=64, n_val=32, seed=3)
    c = cnndata.load(n_train=64, n_val=32, seed=4)
    assert torch.equal(a["train"][0], b["train"][0]) and torch.equal(a["val"][1], b["val"][1])
    assert not torch.equal(a["train"][0], c["train"][0])


def test_cnn_data_needs_learning():
    """Raw pixels do not give the class away: a nearest-class-mean classifier is near chance."""
    d = cnndata.load(n_train=1000, n_val=500)
    (x, y), (xv, yv) = d["train"], d["val"]
    centroids = torch.stack([x[y == k].mean(0) for k in range(10)]).flatten(1)
    acc = (torch.cdist(xv.flatten(1), centroids).argmin(1) == yv).float().mean().item()
    assert acc < 0.25


# --- CNN model -----------------------------------------------------------------------------------


def test_cnn_scales_at_ratio_8():
    x = cnndata.load(n_train=8, n_val=8)["train"][0]
    torch.manual_seed(0)
    model = cnn(width=64)
    sur = hydro.scale(model, 8, example_inputs=(x[:2],))
    assert sur.get_parameter("stem.0.weight").shape == (8, 3, 3, 3)
    assert sur.get_parameter("layer2.conv1.weight").shape == (16, 8, 3, 3)
    assert sur.get_parameter("head.weight").shape == (cnndata.NUM_CLASSES, 16)
    assert sur.state_dict().keys() == model.state_dict().keys()
    assert sur(x).shape == (8, cnndata.NUM_CLASSES)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_cnn_ratio_1_is_the_model(mode):
    x = cnndata.load(n_train=8, n_val=8)["train"][0]
    torch.manual_seed(0)
    model = cnn(width=16, dropout=0.0)
    sur = hydro.scale(model, 1, example_inputs=(x[:2],))
    sur.load_state_dict(model.state_dict())
    model.train(mode == "train")
    sur.train(mode == "train")
    assert torch.equal(sur(x), model(x))


def test_cnn_surrogate_learns():
    (x, y) = cnndata.load(n_train=64, n_val=8)["train"]
    torch.manual_seed(0)
    sur = hydro.scale(cnn(width=32), 8, example_inputs=(x[:2],))
    before, after = _train_losses(sur, hydro.parametrize.param_groups(sur, lr=1e-2), x, y, 20)
    assert after < 0.7 * before
    assert 0.0 <= error_rate(sur(x), y).item() <= 1.0


def test_error_rate():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0], [0.0, 5.0]])
    assert error_rate(logits, torch.tensor([0, 1, 1, 0])).item() == 0.5


# --- tune.yaml -----------------------------------------------------------------------------------

TOP_KEYS = {"study", "storage", "trials", "ratio", "fuse", "seed", "sampler", "sampler_args"}
TOP_KEYS |= {"pruner", "pruner_args", "task", "space"}
TASK_KEYS = {"model", "model_args", "data", "data_args", "loss", "metric", "direction"}
TASK_KEYS |= {"optimizer", "scheduler", "steps", "eval_every", "batch_size"}
KNOWN_HPARAMS = {"lr", "momentum", "beta1", "beta2", "eps", "weight_decay", "warmup", "dropout"}
KNOWN_HPARAMS |= {"batch_size", "grad_clip", "output_mult", "init_scale"}


def _resolve(ref: str):
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("name", ["charlm", "cnn"])
def test_tune_yaml_follows_the_schema(name):
    cfg = yaml.safe_load((ROOT / "examples" / name / "tune.yaml").read_text())
    assert set(cfg) <= TOP_KEYS, set(cfg) - TOP_KEYS
    assert {"trials", "ratio", "fuse", "task", "space"} <= set(cfg)
    assert cfg["sampler"] in {"tpe", "random", "cmaes", "gp", "qmc", "grid"}
    assert cfg["pruner"] in {"median", "successive_halving", "hyperband", "none"}
    assert cfg["fuse"] == 16 and cfg["trials"] >= cfg["fuse"]
    # the ratio 'auto' picks (tests/tuning/test_example_ratios.py checks Hydro's floor)
    assert cfg["ratio"] == {"charlm": 4, "cnn": 4}[name]

    task = cfg["task"]
    assert set(task) <= TASK_KEYS, set(task) - TASK_KEYS
    assert task["loss"] == "cross_entropy" and task["direction"] == "minimize"
    assert task["optimizer"] in {"adamw", "adam", "sgd"}
    assert task["scheduler"] in {"none", "cosine", "linear", "step"}
    assert 0 < task["eval_every"] <= task["steps"] <= 1000
    if task.get("metric"):
        assert callable(_resolve(task["metric"]))

    # The callables exist and fit together: data batches go through the model.
    factory = _resolve(task["model"])
    data = _resolve(task["data"])(**task["data_args"])
    (x, y), xv = data["train"], data["val"][0]
    assert len(x) >= task["batch_size"] and len(xv) > 0
    model = factory(**task["model_args"])
    out = model(x[:2])
    assert F.cross_entropy(out.flatten(0, -2), y[:2].flatten()).isfinite()
    if name == "charlm":  # the yaml's comment: "ratio: auto picks the same"
        assert hydro.scale(model, "auto", example_inputs=(x[:2],)).hydro.ratio == cfg["ratio"]

    model_kwargs = set(inspect.signature(factory).parameters)
    for hp, dist in cfg["space"].items():
        assert hp in KNOWN_HPARAMS | model_kwargs, hp
        assert dist["type"] in {"float", "int", "categorical"}
        if dist["type"] == "categorical":
            assert len(dist["choices"]) > 1
        else:
            assert dist["low"] < dist["high"]
            assert not dist.get("log") or dist["low"] > 0
        if hp == "dropout":
            assert "dropout" in model_kwargs  # the tuner passes it to the factory


def test_hf_gpt2_example_tunes_fused_with_its_own_loss(tmp_path):
    """examples/hf_gpt2 as its config states it (smaller: steps, text, trials), end to end."""
    from hydro.integrations.optuna import optimize
    from hydro.tuning.config import load
    from hydro.tuning.outputs import open_study

    spec = yaml.safe_load((ROOT / "examples" / "hf_gpt2" / "tune.yaml").read_text())
    spec["task"].update(steps=4, eval_every=2, batch_size=4)
    spec["task"]["model_args"].update(n_layer=1)
    spec["task"]["data_args"].update(max_chars=4_000)
    spec["space"]["warmup"].update(low=0, high=2)
    spec.update(storage=f"sqlite:///{tmp_path / 'hf.db'}", trials=4, fuse=4)
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(spec))
    cfg = load(str(path))
    study = open_study(cfg.storage, cfg.study, cfg.task.direction, cfg.sampler, cfg.pruner)
    optimize(study, cfg.task, cfg.space, cfg.trials, ratio=cfg.ratio, fuse=cfg.fuse, seed=0)
    trials = study.get_trials()
    assert len(trials) == 4 and all(t.state.name in ("COMPLETE", "PRUNED") for t in trials)
    assert {t.user_attrs["fused"] for t in trials} == {4}  # one fused group, its loss per trial

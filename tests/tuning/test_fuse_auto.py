"""``fuse="auto"``: the fusion size per (batch size, architecture) key from the device's memory,
printed, kept in the study and the export; an out-of-memory group halves and loses no trial."""

from __future__ import annotations

import math

import optuna
import pytest
import torch
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState

import hydro
from hydro.errors import ConfigError
from hydro.integrations.optuna import optimize
from hydro.tuning import sizing
from hydro.tuning.group import FusedGroup
from hydro.tuning.outputs import export
from hydro.tuning.sizing import GIB, MARGIN, MAX_FUSE, fuse_size, fuse_sizes, memory_budget
from tests import toy

optuna.logging.set_verbosity(optuna.logging.WARNING)
LR = {"lr": FloatDistribution(1e-3, 1e-1, log=True)}


def make_task(cls: type = hydro.Task, **kw) -> hydro.Task:
    """A small MLP whose width a space may search (``width``), on generated data."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(-1)

    def model(width: int = 64) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                                   torch.nn.Linear(width, 3))

    kw = {"steps": 6, "eval_every": 3, "batch_size": 16, **kw}
    return cls(model=model, train_data=(x[:192], y[:192]), val_data=(x[192:], y[192:]), **kw)


def study() -> optuna.Study:
    return optuna.create_study(pruner=optuna.pruners.NopPruner(),
                               sampler=optuna.samplers.RandomSampler(seed=0))


def per_trial(task: hydro.Task, params: dict | None = None) -> int:
    return fuse_size(task, params or {"lr": 1e-2}, ratio=2, memory=1.0).per_trial


def test_per_trial_bytes_are_weights_gradients_optimizer_state_and_activations():
    task = make_task()
    group = FusedGroup(task, [(0, {"lr": 1e-2}, 0)], ratio=2)
    weights = sum(p.numel() * p.element_size() for p in group.fused.parameters())
    batch = 16 * 8 * 4  # one trial's inputs, float32
    adamw = per_trial(task)
    # AdamW: the weights, their gradients and two moments; then activations of a 32-wide
    # surrogate on a batch of 16 (a few 16 x 32 float32 tensors, well under 16 KiB)
    assert 4 * weights + batch < adamw < 4 * weights + batch + 16 * 1024
    # SGD keeps one momentum buffer per weight, not two: exactly one copy of the weights less
    assert adamw - per_trial(make_task(optimizer="sgd")) == weights
    # a batch twice as large adds at least its inputs and never touches the weights' share
    assert per_trial(make_task(batch_size=32)) - adamw >= batch


def test_a_model_the_meta_device_cannot_run_is_counted_on_the_cpu():
    """A GPT whose attention output is viewed after SDPA: the meta device's strides refuse the
    view, so its step is counted over one real CPU forward instead."""
    from hydro_fluid.profile import estimate_memory
    from tests import zoo

    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 65, (64, 16), generator=g) for _ in range(2))
    task = hydro.Task(model=zoo.gpt(n_embd=64, n_head=4).model, train_data=(x, y),
                      val_data=(x, y), loss=zoo.gpt_loss, steps=4, batch_size=8)
    group = FusedGroup(task, [(0, {}, 0)], ratio=2)
    args, _, _ = task.split(next(group.members[0].batches), "cpu")
    build = lambda n: group.builder.make({}, 0)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        estimate_memory(build, lambda n: args, 1, device="meta")
    size = fuse_size(task, {}, ratio=2, memory=1.0)
    assert size.per_trial == estimate_memory(build, lambda n: args, 1, device="cpu")
    weights = sum(p.numel() * p.element_size() for p in group.fused.parameters())
    assert size.per_trial > 4 * weights and size.n == MAX_FUSE


def test_keyword_inputs_are_counted_like_positional_ones():
    """A model called with keyword inputs (dict batches, as HuggingFace models are) is sized
    exactly as the same model and data given positionally."""
    from tests.tuning.test_task import keyword_data, model

    d = keyword_data()
    as_tuple = ((d["input_ids"], d["attention_mask"]), d["labels"])
    sizes = [fuse_size(hydro.Task(model=model(), train_data=data, val_data=data, batch_size=16),
                       {"lr": 1e-2}, ratio=2, memory=1.0).per_trial
             for data in (d, as_tuple)]
    assert sizes[0] == sizes[1] > 16 * 6 * 8 * 2  # more than the inputs alone


def test_the_budget_decides_n():
    task = make_task()
    b = per_trial(task)
    for want in (1, 3, 10):
        memory = (want + 0.5) * b / MARGIN / GIB  # room for want and a half trials
        size = fuse_size(task, {"lr": 1e-2}, ratio=2, memory=memory)
        assert (size.n, size.limit, size.per_trial, size.fixed) == (want, "memory", b, 0)
        assert size.budget == int(memory * GIB) and size.used <= MARGIN * size.budget
    with pytest.raises(ConfigError, match="needs about .* raise fuse_memory"):
        fuse_size(task, {"lr": 1e-2}, ratio=2, memory=0.5 * b / GIB)


def test_n_is_capped_by_the_trials_left_and_by_max_fuse():
    task = make_task()
    size = fuse_size(task, {"lr": 1e-2}, ratio=2, memory=1.0, remaining=5)
    assert (size.n, size.limit) == (5, "trials")
    assert "capped by the trials left" in size.describe()
    size = fuse_size(task, {"lr": 1e-2}, ratio=2, memory=1.0)
    assert (size.n, size.limit) == (MAX_FUSE, "max")


def test_each_device_gets_its_own_size_for_its_share():
    task = make_task()
    ram = sizing._ram()
    budget, capacity = memory_budget("cpu")
    assert budget == capacity == pytest.approx(sizing.FREE_FRACTION["cpu"] * ram, rel=0.2)
    assert memory_budget("cpu", share=4)[0] == pytest.approx(budget / 4, rel=0.2)
    assert memory_budget("cpu", memory=2.0, share=4)[0] == 2 * GIB  # a budget is per group
    b = per_trial(task)
    sizes = fuse_sizes(task, {"lr": 1e-2}, ["cpu", "cpu"], ratio=2, memory=4.5 * b / MARGIN / GIB)
    assert list(sizes) == ["cpu"] and sizes["cpu"].n == 4
    if torch.cuda.is_available():  # a GPU next to the CPU: each is measured on its own
        both = fuse_sizes(task, {"lr": 1e-2}, ["cuda:0", "cpu"], ratio=2)
        assert set(both) == {"cuda:0", "cpu"} and both["cuda:0"].per_trial != b


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU this process cannot see")
def test_a_gpu_this_process_cannot_see_is_sized_from_fuse_memory():
    """A Ray cluster's GPUs: without fuse_memory a clear error; with it, the CPU's estimate."""
    task = make_task()
    with pytest.raises(ConfigError, match="give fuse a number of trials, or fuse_memory"):
        fuse_size(task, {"lr": 1e-2}, ratio=2, device="cuda")
    b = per_trial(task)
    size = fuse_size(task, {"lr": 1e-2}, ratio=2, device="cuda", memory=5.5 * b / MARGIN / GIB)
    assert (size.n, size.per_trial, size.device) == (5, b, "cuda")
    assert size.capacity == size.budget and " of " in size.describe()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_bytes_are_measured_at_one_and_two_trials():
    task = make_task()
    size = fuse_size(task, {"lr": 1e-2}, ratio=2, device="cuda:0", memory=1.0)
    group = FusedGroup(task, [(0, {"lr": 1e-2}, 0)], ratio=2, device="cuda:0")
    weights = sum(p.numel() * p.element_size() for p in group.fused.parameters())
    assert size.per_trial >= 4 * weights and size.n >= 1
    assert "of" in size.describe() and "cuda:0" in size.describe()


def test_auto_in_a_study_prints_stores_and_exports(tmp_path, capsys):
    task = make_task()
    b = per_trial(task, {"lr": 1e-2, "width": 64})
    small = per_trial(task, {"lr": 1e-2, "width": 128})  # a wider key: fewer fit the same budget
    assert small > b
    memory = 4.5 * b / MARGIN / GIB
    space = {**LR, "width": CategoricalDistribution([64, 128])}
    s = study()
    optimize(s, task, space, 10, ratio=2, fuse="auto", fuse_memory=memory, progress=True)
    err = capsys.readouterr().err
    trials = s.get_trials()
    assert len(trials) == 10 and all(t.state == TrialState.COMPLETE for t in trials)
    record = s.user_attrs["hydro_fuse"]
    assert record["fuse"] == "auto"
    sizes = {e["model_args"]["width"]: e for e in record["sizes"]}
    assert sizes[64]["n"] == 4 and sizes[128]["n"] == int(MARGIN * memory * GIB // small)
    for width, e in sizes.items():
        assert (e["batch_size"], e["device"], e["fixed_bytes"]) == (16, "cpu", 0)
        assert f"fuse auto -> {e['n']} per group on cpu (" in err
        assert f"GiB budget): batch size 16, width {width}" in err or "KiB budget" in err
    for t in trials:  # each trial trained in a group of its key's size
        n = sizes[t.params["width"]]["n"]
        assert t.user_attrs["fused"] == n and t.user_attrs["slot"] < n
    path = tmp_path / "best.yaml"
    export(s, path)
    prov = yaml.safe_load(path.read_text())["provenance"]
    assert prov["fuse"]["fuse"] == "auto" and len(prov["fuse"]["sizes"]) == 2
    assert prov["fused"] == sizes[s.best_trial.params["width"]]["n"]


def test_hydro_tune_auto_never_exceeds_the_trials_asked(tmp_path):
    result = hydro.tune(make_task(), LR, n_trials=3, ratio=2, fuse="auto", fuse_memory=1.0,
                        storage=f"sqlite:///{tmp_path / 'auto.db'}")
    (size,) = result.study.user_attrs["hydro_fuse"]["sizes"]
    assert (size["n"], size["limit"], size["budget_bytes"]) == (3, "trials", GIB)
    assert {t.user_attrs["fused"] for t in result.study.trials} == {3}
    prov = result.export(tmp_path / "best.json")["provenance"]
    assert prov["fuse"]["sizes"] == [size] and prov["fused"] == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"fuse": "big"}, "fuse must be an integer >= 1 .* or 'auto'"),
        ({"fuse": 0}, "fuse must be an integer >= 1"),
        ({"fuse": -4}, "fuse must be an integer >= 1"),
        ({"fuse": True}, "fuse must be an integer >= 1"),
        ({"fuse": "auto", "fuse_memory": -1}, "fuse_memory must be a positive number of GiB"),
        ({"fuse": "auto", "fuse_memory": "1G"}, "fuse_memory must be a positive number"),
        ({"fuse": "auto", "first_group": MAX_FUSE + 1}, "first_group must be an integer from 0"),
    ],
)
def test_bad_values_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        hydro.tune(make_task(), LR, n_trials=2, storage="sqlite:///:memory:", **kwargs)
    with pytest.raises(ConfigError, match=message):
        optimize(study(), make_task(), LR, 2, **kwargs)


def test_auto_with_a_group_callback_is_refused():
    with pytest.raises(ConfigError, match="with a group callback, give fuse a number"):
        optimize(study(), lambda trials: [0.0] * len(trials), LR, 2, fuse="auto")


CONFIG = """
trials: 2
ratio: 2
trust: [torch.nn]
task:
  model: torch.nn:Identity
  data: {data}
  loss: mse
space:
  lr: {{type: float, low: 1.0e-4, high: 1.0e-1, log: true}}
"""


@pytest.mark.parametrize(
    "extra, fuse, memory",
    [("", "auto", None), ("fuse: auto\nfuse_memory: 0.5\n", "auto", 0.5), ("fuse: 8\n", 8, None)],
)
def test_config_fuse_defaults_to_auto(tmp_path, extra, fuse, memory):
    from hydro.tuning.config import load

    path = tmp_path / "tune.yaml"
    path.write_text(extra + CONFIG.format(data="tests.tuning.test_fuse_auto:config_data"))
    cfg = load(str(path))
    assert (cfg.fuse, cfg.fuse_memory) == (fuse, memory)


@pytest.mark.parametrize(
    "extra, message",
    [
        ("fuse: big\n", "tune.yaml: fuse must be an integer >= 1 .* or 'auto'"),
        ("fuse: 0\n", "tune.yaml: fuse must be an integer >= 1"),
        ("fuse_memory: -2\n", "tune.yaml: fuse_memory must be a positive number of GiB"),
        ("fuse_memory: lots\n", "tune.yaml: fuse_memory must be a positive number"),
    ],
)
def test_config_bad_fuse_names_the_file_and_key(tmp_path, extra, message):
    from hydro.tuning.config import load

    path = tmp_path / "tune.yaml"
    path.write_text(extra + CONFIG.format(data="tests.tuning.test_fuse_auto:config_data"))
    with pytest.raises(ConfigError, match=message):
        load(str(path))


def config_data() -> dict:
    x = torch.zeros(8, 3)
    return {"train": (x, x), "val": (x, x)}


class OutOfMemoryAbove(hydro.Task):
    """A real task whose fused training step raises ``MemoryError`` above ``limit`` trials, as
    a step too large for the device would."""

    limit = 2

    def trial_losses(self, output, target, shared=True):
        n = self.logits_of(output).shape[0]
        if not shared and n > self.limit:
            raise MemoryError(f"a fused step of {n} trials does not fit (limit {self.limit})")
        return super().trial_losses(output, target, shared=shared)


@pytest.mark.parametrize("fuse", [4, "auto"])
def test_an_out_of_memory_group_halves_and_loses_no_trial(fuse):
    task = make_task(OutOfMemoryAbove)
    s = study()
    optimize(s, task, LR, 5, ratio=2, fuse=fuse, seed=0)
    trials = s.get_trials()
    assert len(trials) == 5 and all(t.state == TrialState.COMPLETE for t in trials)
    assert all(math.isfinite(t.value) for t in trials)
    # 4 -> 2 (auto: 5 -> 3 -> 2): every trial ended in a group small enough, and later groups of the
    # key started at the size that fitted
    assert {t.user_attrs["fused"] for t in trials} == {2}
    assert all(t.user_attrs["slot"] < 2 for t in trials)
    # each trial trained from its own start in the smaller group: the same result as alone
    alone = study()
    optimize(alone, make_task(), LR, 5, ratio=2, fuse=1, seed=0)
    assert [t.value for t in trials] == pytest.approx([t.value for t in alone.get_trials()])


def test_out_of_memory_with_a_single_trial_fails_it_with_the_reason():
    task = make_task(OutOfMemoryAbove)
    task.limit = 0
    s = study()
    optimize(s, task, LR, 3, ratio=2, fuse=2, seed=0)
    trials = s.get_trials()
    assert len(trials) == 3 and all(t.state == TrialState.FAIL for t in trials)
    assert all("out of memory even with a single trial: MemoryError" in t.user_attrs["fail_reason"]
               for t in trials)


def test_on_local_workers_each_worker_is_sized_for_its_share():
    """Two CPU workers share the RAM: the default budget of a group is half of one alone, and
    the groups the workers train have the key's size."""
    from hydro_fluid import LocalExecutor
    from tests.tuning.test_continuous_batching import make_task as picklable_task

    task = picklable_task(steps=4)
    s = study()
    optimize(s, task, LR, 4, ratio=2, fuse="auto", executor=LocalExecutor(devices=[],
             num_workers=2), seed=0)
    trials = s.get_trials()
    assert len(trials) == 4 and all(t.state == TrialState.COMPLETE for t in trials)
    (size,) = s.user_attrs["hydro_fuse"]["sizes"]
    assert (size["device"], size["n"], size["limit"]) == ("cpu", 4, "trials")
    alone = memory_budget("cpu")[0]
    assert size["budget_bytes"] == pytest.approx(alone / 2, rel=0.2)
    assert {t.user_attrs["fused"] for t in trials} == {4}


def test_hydro_tune_without_fuse_prints_auto_and_exports_it(tmp_path, monkeypatch, capsys):
    from hydro.cli import main

    toy.project(tmp_path, monkeypatch, "toyfuse", toy.source(), (
        "storage: sqlite:///toy.db\ntrials: 3\nratio: 2\n"
        "task: {model: 'toyfuse:model', data: 'toyfuse:data', steps: 4, eval_every: 2}\n"
        "space: {lr: {type: float, low: 1.0e-3, high: 1.0e-1, log: true}}\n"
    ))
    assert main(["tune", "tune.yaml", "-o", "best.yaml"]) == 0
    err = capsys.readouterr().err
    assert "fuse auto (trials per fused group from the device's memory, per key)" in err
    assert "fuse auto -> 3 per group on cpu (" in err and "capped by the trials left" in err
    prov = yaml.safe_load((tmp_path / "best.yaml").read_text())["provenance"]
    assert prov["fused"] == 3 and prov["fuse"]["sizes"][0]["n"] == 3
    assert main(["export", "-o", "again.json"]) == 0
    assert '"fuse": "auto"' in (tmp_path / "again.json").read_text()

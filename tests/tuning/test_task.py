"""``hydro.Task`` with dict batches (keyword inputs) and with a model that computes its loss."""

from __future__ import annotations

import optuna
import pytest
import torch
import torch.nn.functional as F
from optuna.distributions import FloatDistribution
from torch import nn
from torch.utils.data import Dataset

import hydro
from hydro.errors import ConfigError, DataError, ModelError

SPACE = {"lr": FloatDistribution(1e-3, 1e-1, log=True)}


class Keywords(nn.Module):
    """Takes keyword inputs like a HuggingFace model; with ``labels`` it returns its loss."""

    def __init__(self, vocab: int = 11, width: int = 32, classes: int = 3, own_loss: bool = False):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.fc = nn.Linear(width, width)
        self.out = nn.Linear(width, classes)
        self.own_loss = own_loss

    def forward(self, input_ids, attention_mask, labels=None):
        h = torch.relu(self.fc(self.emb(input_ids))) * attention_mask.unsqueeze(-1)
        logits = self.out(h.mean(1))
        if not self.own_loss:
            return logits
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def keyword_data(n: int = 96):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 11, (n, 6), generator=g)
    mask = (torch.rand(n, 6, generator=g) > 0.2).float()
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": torch.randint(0, 3, (n,), generator=g),
    }


def model(own_loss: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return Keywords(own_loss=own_loss)


def test_dict_batches_train_exactly_like_the_same_data_as_a_tuple():
    d = keyword_data()
    as_tuple = ((d["input_ids"], d["attention_mask"]), d["labels"])
    results = []
    for data in (d, as_tuple):
        task = hydro.Task(model=model(), train_data=data, val_data=data, steps=6, eval_every=3,
                          batch_size=16)
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        hydro.tune(task, SPACE, n_trials=3, ratio=2, fuse=3, study=study, seed=1)
        results.append([(t.state, t.value, t.intermediate_values) for t in study.trials])
    assert all(state.name == "COMPLETE" for state, _, _ in results[0])
    assert results[0] == results[1]  # the same batches, the same training, bit for bit


def test_batches_are_dicts_and_split_by_target_key():
    d = keyword_data()
    task = hydro.Task(model=model(), train_data=d, val_data=d, batch_size=8)
    batch = next(task.train_batches(8, seed=0))
    assert set(batch) == {"input_ids", "attention_mask", "labels"} and len(batch["labels"]) == 8
    args, kwargs, target = task.split(batch)
    assert args == () and set(kwargs) == {"input_ids", "attention_mask"}
    assert torch.equal(target, batch["labels"])
    assert [task.batch_len(b) for b in task.val_batches(40)] == [40, 40, 16]


def test_with_loss_model_the_whole_batch_goes_to_the_model():
    d = keyword_data()
    task = hydro.Task(model=model(own_loss=True), train_data=d, val_data=d, loss="model")
    args, kwargs, target = task.split(next(task.train_batches(4, seed=0)))
    assert set(kwargs) == {"input_ids", "attention_mask", "labels"}
    task.validate(task.model, next(task.train_batches(4, seed=0)))
    # the fused contract: the output's loss is one value per trial
    per_trial = torch.tensor([0.5, 0.7])
    assert task.trial_losses({"loss": per_trial}, target) is per_trial

    class Output:  # a ModelOutput-like object
        loss = per_trial

    assert task.trial_losses(Output(), target) is per_trial
    with pytest.raises(ModelError, match=r"one loss per trial, shape \[n\]"):
        task.trial_losses({"loss": torch.tensor(0.5)}, target)
    with pytest.raises(ModelError, match="returned dict without one"):
        task.trial_losses({"logits": torch.zeros(2, 4, 3)}, target)


def test_loss_model_with_a_tuple_batch_passes_targets_under_target_key():
    d = keyword_data()
    data = ((d["input_ids"], d["attention_mask"]), d["labels"])
    task = hydro.Task(model=model(own_loss=True), train_data=data, val_data=data, loss="model")
    args, kwargs, _ = task.split(next(task.train_batches(4, seed=0)))
    assert len(args) == 2 and set(kwargs) == {"labels"}
    task.validate(task.model, next(task.train_batches(4, seed=0)))


def test_a_model_that_returns_no_loss():
    d = keyword_data()
    no_labels = {k: v for k, v in d.items() if k != "labels"}
    task = hydro.Task(model=model(own_loss=True), train_data=no_labels, val_data=no_labels,
                      loss="model")
    with pytest.raises(ModelError, match=r"reads the model's loss from output.loss or "
                       r"output\['loss'\], but the model returned dict without one"):
        task.validate(task.model, next(task.train_batches(4, seed=0)))


def test_loss_model_tunes_end_to_end():
    d = keyword_data()
    task = hydro.Task(model=model(own_loss=True), train_data=d, val_data=d, loss="model",
                      steps=4, eval_every=2, batch_size=16)
    result = hydro.tune(task, SPACE, n_trials=2, ratio=2, fuse=2, storage="sqlite:///:memory:")
    assert all(t["state"] == "COMPLETE" for t in result.trials)
    assert {t.user_attrs["fused"] for t in result.study.trials} == {2}  # one fused group


@pytest.mark.parametrize(
    "data, message",
    [
        ({"input_ids": torch.zeros(8, 6, dtype=torch.long)}, "has no 'labels' key"),
        ({"input_ids": torch.zeros(8, 6), "labels": torch.zeros(5, dtype=torch.long)},
         "different lengths"),
        ({"input_ids": [1, 2], "labels": torch.zeros(2, dtype=torch.long)}, "is list"),
        ({}, "empty dict"),
    ],
)
def test_bad_dict_data(data, message):
    with pytest.raises(DataError, match=message):
        hydro.Task(model=model(), train_data=data, val_data=keyword_data())


def test_keys_the_model_does_not_take():
    d = {**keyword_data(), "token_type_ids": torch.zeros(96, 6, dtype=torch.long)}
    task = hydro.Task(model=model(), train_data=d, val_data=d)
    with pytest.raises(ModelError, match=r"token_type_ids"):
        task.validate(task.model, next(task.train_batches(2, seed=0)))


class Dicts(Dataset):
    def __init__(self):
        self.d = keyword_data(32)

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.d.items()}


def test_a_dataset_of_dicts():
    task = hydro.Task(model=model(), train_data=Dicts(), val_data=Dicts(), steps=4, batch_size=8)
    batch = next(task.train_batches(8, seed=0))
    assert isinstance(batch, dict) and batch["input_ids"].shape == (8, 6)
    result = hydro.tune(task, SPACE, n_trials=2, ratio=2, fuse=2, storage="sqlite:///:memory:")
    assert [t["state"] for t in result.trials] == ["COMPLETE", "COMPLETE"]


def test_checkpoint_every_is_a_task_setting_and_a_config_key():
    from hydro.tuning.config import TASK_KEYS

    d = keyword_data()
    assert hydro.Task(model=model(), train_data=d, val_data=d).checkpoint_every == 50
    assert "checkpoint_every" in TASK_KEYS
    with pytest.raises(ConfigError, match=r"checkpoint_every must be an integer >= 0"):
        hydro.Task(model=model(), train_data=d, val_data=d, checkpoint_every=-1)

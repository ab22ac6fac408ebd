"""The toy the tests tune: a one-hidden-layer MLP classifying generated data.

In process: :func:`data`, :func:`model` and :func:`task`. For ``hydro tune``: :func:`source` (a
model module's text, with ``data`` and ``model`` as :func:`data` and :func:`model` make them),
:func:`config` (a config naming it) and :func:`project` (both written into a scratch folder
that the test runs in).

The same arguments give the same numbers everywhere (the data from its own generator, seed 0;
the model's weights from ``torch.manual_seed(0)``), so a test that moved here trains what it
trained before.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import hydro


def data(n: int = 96, n_train: int = 64, features: int = 8,
         classes: int = 3) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``n`` rows of standard normal inputs labelled by a random linear map's argmax; the first
    ``n_train`` train, the rest validate."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    y = (x @ torch.randn(features, classes, generator=g)).argmax(-1)
    return {"train": (x[:n_train], y[:n_train]), "val": (x[n_train:], y[n_train:])}


def model(width: int = 32, features: int = 8, classes: int = 3) -> torch.nn.Module:
    """``Linear(features, width) -> ReLU -> Linear(width, classes)``, seeded 0."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(features, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, classes))


def task(n: int = 256, n_train: int = 192, width: int = 32, **kw: Any) -> hydro.Task:
    """A :class:`hydro.Task` of :func:`model` on :func:`data`; ``kw`` go to the Task (loss
    ``cross_entropy`` and batches of 16 unless given)."""
    d = data(n, n_train)
    kw = {"loss": "cross_entropy", "batch_size": 16, **kw}
    return hydro.Task(model=model(width), train_data=d["train"], val_data=d["val"], **kw)


def source(n: int = 96, n_train: int = 64, width: int = 64, features: int = 8, classes: int = 3,
           seeded: bool = True, extra: str = "") -> str:
    """A model module's text: ``data(n=...)`` and ``model(width=...)`` as :func:`data` and
    :func:`model` (``seeded=False``: the model's weights from the global generator as it is),
    then ``extra`` (more callables for the config to name)."""
    seed = "    torch.manual_seed(0)\n" if seeded else ""
    return (
        "import torch\n\n"
        f"def data(n={n}):\n"
        "    g = torch.Generator().manual_seed(0)\n"
        f"    x = torch.randn(n, {features}, generator=g)\n"
        f"    y = (x @ torch.randn({features}, {classes}, generator=g)).argmax(-1)\n"
        f"    return {{'train': (x[:{n_train}], y[:{n_train}]), 'val': (x[{n_train}:], "
        f"y[{n_train}:])}}\n\n"
        f"def model(width={width}):\n{seed}"
        f"    return torch.nn.Sequential(torch.nn.Linear({features}, width), torch.nn.ReLU(),\n"
        f"                               torch.nn.Linear(width, {classes}))\n" + extra
    )


def config(module: str, *, study: str = "toy", storage: str = "sqlite:///toy.db",
           trials: int = 2, ratio: int = 2, fuse: int = 2, top: str = "", task: str = "",
           steps: int = 4, eval_every: int = 2, batch_size: int | None = 16,
           lr_low: str = "1.0e-3", space: str = "") -> str:
    """A ``hydro tune`` config of ``module:model`` on ``module:data``, one key a line (tests
    edit it with ``str.replace``); ``top`` and ``task`` are more lines of those sections
    (``task`` goes right after ``task.data``). The space searches ``lr`` from ``lr_low`` to
    0.1 (log), then ``space``'s lines."""
    batch = f"  batch_size: {batch_size}\n" if batch_size is not None else ""
    space = f"  lr: {{type: float, low: {lr_low}, high: 1.0e-1, log: true}}\n{space}"
    return (f"study: {study}\nstorage: {storage}\ntrials: {trials}\nratio: {ratio}\n"
            f"fuse: {fuse}\n{top}task:\n  model: {module}:model\n  data: {module}:data\n{task}"
            f"  steps: {steps}\n  eval_every: {eval_every}\n{batch}space:\n{space}")


def project(folder: Path, monkeypatch: pytest.MonkeyPatch, module: str, text: str,
            tune_yaml: str | None = None) -> Path:
    """Write ``module``.py (``text``) and, if given, tune.yaml into ``folder`` and run the test
    there, importing the test's own copy of ``module``."""
    (folder / f"{module}.py").write_text(text)
    if tune_yaml is not None:
        (folder / "tune.yaml").write_text(tune_yaml)
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, module, raising=False)
    return folder

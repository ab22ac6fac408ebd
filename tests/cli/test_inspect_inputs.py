"""`hydro inspect` takes keyword inputs from a model factory: ``(model, {kwargs})`` and
``(model, args, kwargs)``; a factory whose model's inputs cannot be guessed is told how."""

from __future__ import annotations

import textwrap

import pytest

from hydro.cli import main

SOURCE = textwrap.dedent('''
    import torch
    from torch import nn


    class KeywordNet(nn.Module):
        """Called as HF models are: keyword inputs, none required positionally."""

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 64)
            self.fc = nn.Linear(64, 64)
            self.out = nn.Linear(64, 3)

        def forward(self, input_ids=None, scale=None):
            h = self.fc(self.emb(input_ids)).relu()
            if scale is not None:
                h = h * scale
            return self.out(h).mean(1)


    def ids():
        return torch.randint(0, 50, (2, 5))


    def kwargs_only():
        return KeywordNet(), {"input_ids": ids()}


    def args_and_kwargs():
        return KeywordNet(), (ids(),), {"scale": torch.full((2, 5, 1), 0.5)}


    def alone():
        return KeywordNet()


    def wrong():
        return KeywordNet(), "input_ids"
''')


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "kwfactories.py").write_text(SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("factory", ["kwargs_only", "args_and_kwargs"])
def test_keyword_inputs_from_the_factory(factories, factory, capsys):
    assert main(["inspect", f"kwfactories:{factory}", "--ratio", "8"]) == 0
    text = capsys.readouterr().out
    assert "fc" in text and "hidden" in text


@pytest.mark.parametrize(
    "factory, message",
    [
        ("alone", "cannot guess its inputs"),
        ("wrong", "returned (KeywordNet, str)"),
    ],
)
def test_a_factory_without_usable_inputs_is_told_the_forms(factories, factory, message, capsys):
    assert main(["inspect", f"kwfactories:{factory}", "--ratio", "8"]) == 2
    err = capsys.readouterr().err
    assert message in err and "(model, {'input_ids': x, ...})" in err
    assert "example_kwargs=" not in err and "Traceback" not in err

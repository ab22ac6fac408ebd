"""Shape propagation: the value (or fake value) of every node of a graph, without real compute."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._subclasses import FakeTensorMode


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, mode: FakeTensorMode) -> None:
        super().__init__(gm)
        self.mode = mode
        self.values: dict[torch.fx.Node, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        with self.mode:
            result = super().run_node(n)
        self.values[n] = result
        return result


def propagate(gm: torch.fx.GraphModule, inputs: tuple[Any, ...]) -> dict[torch.fx.Node, Any]:
    """Run ``gm`` on fake copies of ``inputs`` and return every node's (fake) value.

    Fake tensors carry shapes and dtypes but no data, so this costs no memory for a large model;
    sizes read from them (``x.size(1)``) are plain ints.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_inputs = tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs)
    recorder = _Recorder(gm, mode)
    recorder.run(*fake_inputs)
    return recorder.values

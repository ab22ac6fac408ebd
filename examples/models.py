"""Small target models for trying Hydro on a CPU: ``hydro inspect examples.models:resnet``.

(The character-level GPT lives in :mod:`examples.charlm.model`.)

Each factory returns a freshly initialized model (or a ``(model, example_inputs)`` pair), sized
like a real model you would tune but still quick to build on a laptop.
"""

from __future__ import annotations

import torch
from torch import nn


def mlp() -> nn.Module:
    """A 4-layer MLP of width 1024 on 32 features, 10 classes."""
    return nn.Sequential(
        nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10),
    )


class ResNet(nn.Module):
    """A small CIFAR-style ResNet on 32x32 images."""

    def __init__(self, width: int = 64, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.body = nn.Sequential(
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width), nn.ReLU(),
        )
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        x = self.body(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


def resnet():
    """The ResNet target with an example batch of two 32x32 images."""
    return ResNet(), (torch.zeros(2, 3, 32, 32),)

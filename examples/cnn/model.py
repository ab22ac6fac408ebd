"""A small ResNet-style CNN: a stem, residual blocks, one strided downsampling, a linear head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from examples.cnn.data import NUM_CLASSES


class ResidualBlock(nn.Module):
    """Two 3x3 conv-BN layers and a shortcut; a 1x1 strided conv shortcut when the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CNN(nn.Module):
    """stem (width) -> block -> strided block (2 x width) -> block -> average pool -> linear."""

    def __init__(self, width: int, dropout: float, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.layer1 = ResidualBlock(width, width)
        self.layer2 = ResidualBlock(width, 2 * width, stride=2)  # halves the resolution
        self.layer3 = ResidualBlock(2 * width, 2 * width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits ``[B, num_classes]`` for images ``[B, 3, H, W]``."""
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.head(self.dropout(torch.flatten(self.pool(x), 1)))


def cnn(width: int = 64, dropout: float = 0.0) -> nn.Module:
    """A freshly initialized CNN (PyTorch's default init) for the synthetic shapes task.

    Args:
        width: channels of the first stage (the second has ``2 * width``); Hydro divides it.
        dropout: dropout probability before the classifier (tunable per trial).
    """
    return CNN(width, dropout)


class DeepCNN(nn.Module):
    """stem (width) -> ``blocks`` blocks -> strided block (2 x width) -> ``blocks`` blocks -> pool
    -> linear.

    Each stage is an ``nn.Sequential`` of identically shaped residual blocks (the downsampling
    block sits between them, not inside a stage), so ``hydro.scale(..., depth_ratio=k)`` can keep
    every ``k``-th block of each stage.
    """

    def __init__(self, width: int, blocks: int, dropout: float, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.stage1 = nn.Sequential(*(ResidualBlock(width, width) for _ in range(blocks)))
        self.down = ResidualBlock(width, 2 * width, stride=2)
        self.stage2 = nn.Sequential(*(ResidualBlock(2 * width, 2 * width) for _ in range(blocks)))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits ``[B, num_classes]`` for images ``[B, 3, H, W]``."""
        x = self.stage2(self.down(self.stage1(self.stem(x))))
        return self.head(self.dropout(torch.flatten(self.pool(x), 1)))


def deep_cnn(width: int = 64, blocks: int = 4, dropout: float = 0.0) -> nn.Module:
    """A deeper CNN for depth scaling: two stages of ``blocks`` residual blocks each.

    Args:
        width: channels of the first stage (the second has ``2 * width``); Hydro divides it.
        blocks: residual blocks per stage (``2 * blocks + 1`` in all, with the strided one).
        dropout: dropout probability before the classifier.
    """
    return DeepCNN(width, blocks, dropout)


def error_rate(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Fraction of misclassified images: the tuning metric of ``tune.yaml`` (lower is better)."""
    return (output.argmax(dim=-1) != target).float().mean()

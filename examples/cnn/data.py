"""A synthetic 10-class image task: which shape or texture is drawn, wherever and however coloured.

Each image is a random background colour with one object of a random size at a random position,
in a random colour that contrasts with the background, plus Gaussian pixel noise. The class is
the object's kind only, so a model has to learn shape (colour, position and size are nuisances):

    0 filled square   1 hollow square   2 disk          3 ring           4 plus
    5 diagonal cross  6 horizontal bar  7 vertical bar  8 diagonal stripes  9 checkerboard

Everything is drawn from one seeded ``torch.Generator``: the same arguments give the same tensors.
"""

from __future__ import annotations

import torch

CLASSES: list[str] = [
    "filled square",
    "hollow square",
    "disk",
    "ring",
    "plus",
    "diagonal cross",
    "horizontal bar",
    "vertical bar",
    "diagonal stripes",
    "checkerboard",
]
NUM_CLASSES: int = len(CLASSES)


def _masks(size: int, cy: torch.Tensor, cx: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Every class's shape for every sample: bool ``[NUM_CLASSES, N, size, size]``."""
    grid = torch.arange(size, dtype=torch.float32)
    yy, xx = grid.view(1, size, 1), grid.view(1, 1, size)
    dy, dx = yy - cy.view(-1, 1, 1), xx - cx.view(-1, 1, 1)
    r = r.view(-1, 1, 1)
    box = torch.maximum(dy.abs(), dx.abs())  # Chebyshev distance: squares
    dist2 = dy**2 + dx**2  # Euclidean: disks
    inside = box <= r
    thin = 0.75  # half-width of a stroke, in pixels
    return torch.stack(
        [
            inside,
            inside & (box > r - 1.5),
            dist2 <= r**2,
            (dist2 <= r**2) & (dist2 > (r - 1.5) ** 2),
            inside & ((dy.abs() < thin) | (dx.abs() < thin)),
            inside & (((dy - dx).abs() < thin) | ((dy + dx).abs() < thin)),
            inside & (dy.abs() < 1.5),
            inside & (dx.abs() < 1.5),
            inside & (torch.remainder(yy + xx, 4) < 2),
            inside & (torch.remainder(yy.div(2).floor() + xx.div(2).floor(), 2) == 0),
        ]
    )


def _draw(n: int, size: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.arange(n) % NUM_CLASSES  # balanced classes, shuffled below
    labels = labels[torch.randperm(n, generator=g)]
    # Radius 3 is the smallest at which a ring, a cross and a checkerboard are still distinct.
    r = torch.randint(3, max(4, size // 2 - 1), (n,), generator=g).float()
    # Centres anywhere the object fits, at sub-pixel positions.
    cy = r + torch.rand(n, generator=g) * (size - 1 - 2 * r)
    cx = r + torch.rand(n, generator=g) * (size - 1 - 2 * r)
    mask = _masks(size, cy, cx, r)[labels, torch.arange(n)].unsqueeze(1).float()  # [N, 1, S, S]

    background = torch.rand(n, 3, 1, 1, generator=g)
    # Shift each channel by 0.35-0.65 (mod 1) so the object always contrasts with its background.
    foreground = torch.remainder(background + 0.35 + 0.3 * torch.rand(n, 3, 1, 1, generator=g), 1)
    images = background + mask * (foreground - background)
    images = images + 0.15 * torch.randn(n, 3, size, size, generator=g)
    return (images - 0.5) / 0.3, labels  # roughly zero mean, unit variance


def load(n_train: int = 2048, n_val: int = 512, size: int = 16, seed: int = 0) -> dict:
    """Generate the data set.

    Args:
        n_train: training images.
        n_val: validation images (drawn after, and independently of, the training images).
        size: image height and width in pixels (at least 8).
        seed: seed of the generator; the same arguments always give the same tensors.

    Returns:
        ``{"train": (x, y), "val": (x, y)}``: ``x`` float32 ``[N, 3, size, size]``, ``y`` int64
        labels in ``[0, NUM_CLASSES)``.
    """
    if size < 8:
        raise ValueError(f"size must be at least 8 pixels, got {size}")
    g = torch.Generator().manual_seed(seed)
    return {"train": _draw(n_train, size, g), "val": _draw(n_val, size, g)}

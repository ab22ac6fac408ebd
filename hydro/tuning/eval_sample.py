"""How much of the validation split intermediate evaluations read, sized from measured noise.

``Task(eval_samples="auto")``: the values pruners compare are read on a fixed subsample of the
validation split, the first ``k`` blocks of 64 samples in a fixed seeded order
(:func:`hydro.tuning.task.sample_order`), the same for every trial. A subsample moves every
trial's value by an offset common to all (the subsample is easier or harder than the split)
plus a part of its own; only the own part can change which trials a pruner keeps. So ``k`` is
chosen from one evaluation that reads every block: the smallest ``k`` from which on the own
part stays within :data:`NOISE` of the spread between the trials' whole-split values. The
study records it (:data:`STUDY_ATTR`); every later group, process and resume reads the same.
"""

from __future__ import annotations

import torch

__all__ = ["MIN_BLOCKS", "NOISE", "STUDY_ATTR", "choose_blocks", "prefix_means"]

# The own part of a subsample's error, as a fraction of the trials' spread, that "auto" accepts.
# On the charlm example (docs/evidence/2026-12-tuning.md) 2 blocks of 12 left 0.15-0.43 of the
# spread and swapped trials; 8 blocks left 0.01-0.07 and kept the ranking.
NOISE = 0.1
MIN_BLOCKS = 2  # a subsample of one block: its error would be one block's luck
STUDY_ATTR = "hydro_eval_blocks"


def prefix_means(block_means: torch.Tensor, sizes: torch.Tensor, k: int) -> torch.Tensor:
    """Each trial's mean over the first ``k`` blocks: ``block_means`` ``[blocks, trials]``
    (each block's mean), ``sizes`` ``[blocks]`` (its samples).

    >>> prefix_means(torch.tensor([[1.0], [3.0], [5.0]]), torch.tensor([2, 2, 1]), 2).tolist()
    [2.0]
    """
    w = sizes[:k].to(block_means.dtype)
    return (block_means[:k] * w[:, None]).sum(0) / w.sum()


def choose_blocks(
    block_means: torch.Tensor, sizes: torch.Tensor, noise: float = NOISE
) -> int | None:
    """The blocks intermediate evaluations read: the smallest ``k >= MIN_BLOCKS`` such that for
    every ``k' >= k`` the subsample's error, less its part common to all trials, has a root mean
    square within ``noise`` of the standard deviation of the trials' whole-split means (``k``
    = every block where no subsample is that steady). ``None``: the trials cannot tell it (fewer
    than two, all equal, or a value that is not finite).

    >>> steady = torch.tensor([[1.0, 2.0, 3.0], [1.5, 2.5, 3.5], [0.5, 1.5, 2.5], [1.0, 2.0, 3.0]])
    >>> choose_blocks(steady, torch.full((4,), 64))  # a common offset only: two blocks do
    2
    >>> swapped = torch.tensor([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    >>> choose_blocks(swapped, torch.full((4,), 64))  # the first blocks rank the trials wrong
    4
    """
    blocks, trials = block_means.shape
    block_means = block_means.double()
    if trials < 2 or blocks == 0 or not bool(torch.isfinite(block_means).all()):
        return None
    whole = prefix_means(block_means, sizes, blocks)
    spread = float(whole.std())
    if not spread > 0:
        return None
    chosen = blocks
    for k in range(blocks - 1, MIN_BLOCKS - 1, -1):  # from the top: every larger k must pass
        error = prefix_means(block_means, sizes, k) - whole
        own = error - error.mean()
        if float(own.pow(2).mean().sqrt()) > noise * spread:
            break
        chosen = k
    return chosen

"""Character-level data from the English text that ships with Python (``pydoc_data.topics``).

The text is the help topics of the standard library's ``pydoc`` (about 465k characters on
Python 3.11): no download, and deterministic for a given Python version. The topics are joined
in sorted-key order; the validation split is the tail of the text.
"""

from __future__ import annotations

from pydoc_data.topics import topics

import torch

# The whole corpus, in a fixed order so that the vocabulary and the splits never change.
TEXT: str = "".join(topics[key] for key in sorted(topics))
VOCAB: list[str] = sorted(set(TEXT))
VOCAB_SIZE: int = len(VOCAB)

_STOI = {ch: i for i, ch in enumerate(VOCAB)}


def encode(text: str) -> list[int]:
    """Map a string to token ids (raises ``KeyError`` on a character outside ``VOCAB``)."""
    return [_STOI[ch] for ch in text]


def decode(ids: list[int] | torch.Tensor) -> str:
    """Map token ids back to a string."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    return "".join(VOCAB[i] for i in ids)


def _windows(ids: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Non-overlapping windows; y is x shifted by one character, so we need block_size + 1 ids
    # per window, and the last id of one window's y is the first of the next window's x.
    n = (len(ids) - 1) // block_size
    x = ids[: n * block_size].view(n, block_size)
    y = ids[1 : n * block_size + 1].view(n, block_size)
    return x.clone(), y.clone()


def load(block_size: int = 64, val_fraction: float = 0.1, max_chars: int | None = None) -> dict:
    """The corpus as next-character prediction windows.

    Args:
        block_size: characters per sequence.
        val_fraction: share of the text (its tail) held out for validation.
        max_chars: use only the first ``max_chars`` characters of the text (for quick runs).

    Returns:
        ``{"train": (x, y), "val": (x, y)}`` with ``x, y`` LongTensors ``[N, block_size]``, ``y``
        being ``x`` shifted by one character.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    text = TEXT if max_chars is None else TEXT[:max_chars]
    ids = torch.tensor(encode(text), dtype=torch.long)
    split = int(len(ids) * (1.0 - val_fraction))
    train, val = ids[:split], ids[split:]
    if len(val) <= block_size:
        raise ValueError(
            f"validation split has {len(val)} characters, fewer than block_size + 1 = "
            f"{block_size + 1}: raise max_chars or val_fraction"
        )
    return {"train": _windows(train, block_size), "val": _windows(val, block_size)}

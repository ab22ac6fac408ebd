"""The character data of ``examples.charlm`` as keyword batches for a HuggingFace model."""

from __future__ import annotations

from examples.charlm.data import load as load_windows


def load(block_size: int = 64, max_chars: int | None = None) -> dict:
    """``{"train": {...}, "val": {...}}``, each a dict of ``input_ids`` and ``labels`` ``[N, T]``.

    ``labels`` equal ``input_ids``: a HuggingFace causal LM shifts them itself.
    """
    data = load_windows(block_size=block_size, max_chars=max_chars)
    return {split: {"input_ids": x, "labels": x} for split, (x, _) in data.items()}

"""The example's data: the character windows of ``examples.hf_gpt2``, and the model inputs
Hydro captures the model with (the loop calls it with ``input_ids`` alone)."""

from __future__ import annotations

from examples.hf_gpt2.data import load as load_batches


def load(block_size: int = 64, max_chars: int | None = None) -> dict:
    """``{"train", "val"}`` (dicts of ``input_ids`` and ``labels``) and ``example_kwargs``."""
    data = load_batches(block_size=block_size, max_chars=max_chars)
    data["example_kwargs"] = {"input_ids": data["train"]["input_ids"][:2]}
    return data

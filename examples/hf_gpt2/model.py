"""A HuggingFace GPT-2 built from its config, as a user would tune it (random init, no download).

The model is ``transformers.GPT2LMHeadModel`` unmodified: Hydro captures it by running it on a
batch, so its decorated ``forward``, mask helpers and ``ModelOutput`` pass as they are. Called
with ``labels=`` it computes its own loss, which is what ``loss: model`` in ``tune.yaml`` trains.
"""

from __future__ import annotations

from torch import nn

from examples.charlm.data import VOCAB_SIZE


def gpt2(
    n_layer: int = 4, n_head: int = 8, n_embd: int = 256, block_size: int = 64, dropout: float = 0.0
) -> nn.Module:
    """``GPT2LMHeadModel`` over the characters of ``examples.charlm.data``.

    Args:
        n_layer: transformer blocks.
        n_head: attention heads.
        n_embd: model width.
        block_size: longest sequence (``n_positions``).
        dropout: residual, embedding and attention dropout.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=block_size,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return GPT2LMHeadModel(config)

"""Your own training loop, tuned by Hydro: a HuggingFace GPT-2 with label smoothing, gradient
accumulation and bf16 autocast (``hydro tune examples/own_loop/tune.yaml``)."""

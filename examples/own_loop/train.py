"""A training loop as an ML engineer writes it, handed to Hydro as it is.

Label smoothing, gradient accumulation over micro-batches, bf16 autocast on the CPU (or a GPU),
AdamW with a linear warm-up and a cosine decay, clipping per trial. Hydro calls ``train(run)``
once per fused group: ``run.model`` is the fused 1/4-width surrogate of the GPT-2 in
``tune.yaml``, ``run.hparam(name)`` each trial's value, ``for step in run`` one step of every
trial, and ``run.report`` one validation loss per trial whenever ``run.due``.

The one rule: nothing reduces across trials. Each trial's loss is its own mean (``[n]``), and
the backward pass runs on their sum, so every trial gets exactly its own gradient.
"""

from __future__ import annotations

import torch

import hydro

LABEL_SMOOTHING = 0.1
MICRO_BATCHES = 2  # gradient accumulation: each step sees MICRO_BATCHES batches per trial


def trial_losses(logits: torch.Tensor, labels: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Each trial's next-token cross-entropy with label smoothing: logits ``[n, B, T, V]``,
    labels ``[n, B, T]`` (or ``[B, T]`` shared by all) -> ``[n]``."""
    logp = logits[..., :-1, :].float().log_softmax(-1)
    target = labels[..., 1:].expand(logp.shape[:-1])
    nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return ((1 - smoothing) * nll - smoothing * logp.mean(-1)).flatten(1).mean(1)


@torch.no_grad()
def validate(run: hydro.Run) -> torch.Tensor:
    """Each trial's validation loss (no smoothing, full precision), ``[n]``."""
    run.model.eval()
    total, count = 0.0, 0
    for batch in run.val_batches():
        out = run.model(input_ids=batch["input_ids"])
        total = total + trial_losses(out.logits, batch["labels"], 0.0) * len(batch["input_ids"])
        count += len(batch["input_ids"])
    run.model.train()
    return total / count


def train(run: hydro.Run) -> None:
    """Train one fused group of trials (see the module's docstring)."""
    opt = run.register(hydro.optim.AdamW(run.model.parameters(), lr=run.hparam("lr"),
                                         weight_decay=run.hparam("weight_decay", 0.0),
                                         betas=(0.9, 0.95)))
    warmup = max(1, run.steps // 10)
    schedules = hydro.optim.lr_scheduler
    ramp = schedules.LinearLR(opt, start_factor=0.1, total_iters=warmup)
    decay = schedules.CosineAnnealingLR(opt, T_max=run.steps - warmup)
    ramp_and_decay = run.register(schedules.SequentialLR(opt, [ramp, decay], milestones=[warmup]))
    device = next(run.model.parameters()).device.type
    autocast = torch.autocast(device, dtype=torch.bfloat16)
    for _ in run:
        opt.zero_grad(set_to_none=True)
        for _ in range(MICRO_BATCHES):
            batch = run.batch()  # each trial its own batch: [n, B, T]
            with autocast:
                out = run.model(input_ids=batch["input_ids"], shared=False)
            loss = trial_losses(out.logits, batch["labels"], LABEL_SMOOTHING)
            (loss.sum() / MICRO_BATCHES).backward()
        hydro.optim.clip_grad_norm_(run.model, [1.0] * run.n)
        opt.step()
        ramp_and_decay.step()
        if run.due:
            run.report(validate(run))

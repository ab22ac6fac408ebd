"""Fused optimizers, per-trial learning-rate schedulers and per-trial gradient clipping."""

from hydro.optim import lr_scheduler
from hydro.optim.clip import clip_grad_norm_
from hydro.optim.optimizers import SGD, Adam, AdamW, FusedOptimizer

__all__ = ["SGD", "Adam", "AdamW", "FusedOptimizer", "clip_grad_norm_", "lr_scheduler"]

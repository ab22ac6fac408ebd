"""Hydro: cheap hyperparameter tuning for PyTorch models."""

__version__ = "0.1.0"

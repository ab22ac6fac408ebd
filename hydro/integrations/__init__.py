"""Integrations with other libraries (Optuna)."""

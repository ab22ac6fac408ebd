"""Fusion tests run single-threaded (``one_thread`` in tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test here on one torch thread."""

"""Checkpoints of a fused group, so that a retried group resumes bit-identically.

A checkpoint holds only tensors and plain containers of numbers and strings, and is read back
with ``torch.load(weights_only=True)``: a file planted in the checkpoint directory cannot run
code, it is refused with :class:`CheckpointError`. Files are written atomically (a temporary
file, then ``os.replace``) in a directory created only the user can enter (mode ``0o700``).
"""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path
from typing import Any

import torch

from hydro.errors import HydroError

__all__ = ["CheckpointError", "save", "load", "rng_state", "set_rng_state"]

FILE = "group.pt"


class CheckpointError(HydroError, RuntimeError):
    """A checkpoint could not be read: unreadable, or not a checkpoint Hydro wrote."""


def private_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (and parents) if needed, readable and writable by the user only."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def save(directory: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``directory/group.pt`` atomically; returns the file."""
    d = private_dir(directory)
    tmp = d / f".{FILE}.{os.getpid()}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, d / FILE)
    return d / FILE


def load(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The state last saved in ``directory``, or ``None`` if there is none.

    Raises:
        CheckpointError: the file holds anything but tensors and plain containers (a planted
            pickle is refused before it can run), or cannot be read.
    """
    path = Path(directory) / FILE
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as exc:
        raise CheckpointError(
            f"refusing to load checkpoint {path}: it is not a checkpoint Hydro wrote (only "
            f"tensors and plain containers are accepted): {str(exc).splitlines()[0]}. Delete "
            "the file to start the group afresh, and check who can write to its directory."
        ) from exc


def rng_state() -> dict[str, Any]:
    """The random states a training step draws from: torch (CPU and CUDA), Python, numpy."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "python": [version, list(internal), gauss]}  # fmt: skip
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

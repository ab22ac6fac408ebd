"""Fusion: train n trials of one model as one model (``hydro.fuse``).

Public entry points: :func:`fuse`, :func:`trial_loss` and :class:`FusedModel`. The package is named
``fusion`` because ``hydro.fuse`` is the function.
"""

from hydro.errors import FuseError
from hydro.fusion.model import FusedModel, fuse, trial_loss

__all__ = ["FuseError", "FusedModel", "fuse", "trial_loss"]

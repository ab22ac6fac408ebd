"""The version of Hydro: a leaf, read by setup.cfg and by modules that record it."""

__version__ = "0.1.0"

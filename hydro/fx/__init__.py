"""Graph passes: capture by example, and width analysis over the captured ATen graphs."""

from hydro.fx.capture import Captured, capture

__all__ = ["Captured", "capture"]

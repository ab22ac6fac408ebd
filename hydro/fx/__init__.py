"""Graph passes: capture by example, and width analysis over the captured ATen graphs."""

from hydro.fx.capture import Captured, capture
from hydro.fx.trace import HydroTracer, trace  # still imported by hydro.fusion

__all__ = ["Captured", "HydroTracer", "capture", "trace"]

"""Graph passes over torch.fx: tracing and width analysis."""

from hydro.fx.trace import HydroTracer, trace

__all__ = ["HydroTracer", "trace"]

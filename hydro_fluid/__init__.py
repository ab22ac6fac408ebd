"""hydro_fluid: resource-aware placement and execution of fused trial groups."""

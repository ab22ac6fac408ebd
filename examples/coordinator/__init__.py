"""The Coordinator for real: a 2-stage pipeline-parallel job with a guest trial group.

``pipeline.run_pipeline`` trains the host's MLP in two processes and a fused group of small
MLPs (:func:`hydro.fuse`) in its bubbles; docs/how-to/pipeline-bubbles.md explains the run and
``benchmarks/coordinator.py`` measures it. The planning side (bubbles, interleaving, the
simulation) is the library's: :mod:`hydro_fluid.coordinator`.
"""

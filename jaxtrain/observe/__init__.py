"""Seeing a run: goodput (where the wall time went), stragglers (which process is slow), a
profiler window, and Weights & Biases. Metrics themselves are jaxtrain/metrics.py's."""

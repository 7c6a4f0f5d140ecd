"""jaxtrain: the trainer (config, data, optimizer, train step, loop, CLI).

Submodules are imported on demand so that `jaxtrain.config` can be read before
JAX picks a backend.
"""

__version__ = "0.1.0"

"""Flax NNX language models. Parameters carry logical axis names; `sharding`
maps them to a mesh. Never imports `jaxtrain`'s trainer.

The names below are looked up on first use (module `__getattr__`), so that
`jaxtrain.models.config` (a plain dataclass, read by the CLI before any backend
starts) does not import JAX and Flax.
"""

import importlib

_PUBLIC = {
    "ModelConfig": "config",
    "MoEConfig": "config",
    "MLAConfig": "config",
    "MTPConfig": "config",
    "LinearAttentionConfig": "config",
    "Transformer": "transformer",
    "attend": "attention",
    "abstract_model": "params",
    "logical_axes": "params",
    "merge": "params",
    "generate": "generation",
    "from_hf": "hf",
    "to_hf": "hf",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(f"jaxtrain.models.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module 'jaxtrain.models' has no attribute {name!r}")

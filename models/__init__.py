"""Flax NNX language models. Parameters carry logical axis names; `sharding`
maps them to a mesh. Never imports `jaxtrain`."""

from jaxtrain.models.attention import attend, resolve_impl
from jaxtrain.models.config import ModelConfig, MoEConfig
from jaxtrain.models.generation import generate
from jaxtrain.models.hf import from_hf, to_hf
from jaxtrain.models.params import abstract_model, logical_axes, merge
from jaxtrain.models.transformer import Transformer

__all__ = [
    "ModelConfig",
    "MoEConfig",
    "Transformer",
    "attend",
    "resolve_impl",
    "abstract_model",
    "logical_axes",
    "merge",
    "generate",
    "from_hf",
    "to_hf",
]

"""Flax NNX language models. Parameters carry logical axis names; `sharding`
maps them to a mesh. Never imports `jaxtrain`."""
from models.attention import attend, resolve_impl
from models.config import ModelConfig, MoEConfig
from models.params import abstract_model, logical_axes, merge
from models.transformer import Transformer

__all__ = ["ModelConfig", "MoEConfig", "Transformer", "attend", "resolve_impl", "abstract_model",
           "logical_axes", "merge"]

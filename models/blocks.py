"""Decoder blocks: a block's attention (GQA, or latent attention with `model.mla`), the dense
block and one repeat of `model.attention_pattern`. Apart from models/layers.py, whose norms,
RoPE and projections latent attention (models/mla.py) is built on, so that neither of those
two imports the other."""

from __future__ import annotations

from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.layers import (
    MLP,
    REGION_INPUT_AXES,
    RESIDUAL_AXES,
    Attention,
    RMSNorm,
    norm_after,
    norm_before,
)
from jaxtrain.models.linear_attention import GatedDeltaNet
from jaxtrain.models.mla import LatentAttention
from jaxtrain.sharding import constrain


def attention_layer(cfg: ModelConfig, *, rngs: nnx.Rngs, kind: str | None = None):
    """A block's token mixer: models/layers.py Attention (GQA), or with `model.mla` latent
    attention; a `linear_attention` layer of `model.layer_types` gated DeltaNet
    (models/linear_attention.py), a `full_attention` one the attention of a layer without a kind."""
    if kind == "linear_attention":
        return GatedDeltaNet(cfg, rngs=rngs)
    if kind == "full_attention":
        kind = None
    if cfg.mla is not None:
        return LatentAttention(cfg, rngs=rngs, kind=kind)
    return Attention(cfg, rngs=rngs, kind=kind)


class Block(nnx.Module):
    """Decoder block: x + attn(norm(x)), then + mlp(norm(x)) (pre-norms); with
    `model.norm_placement: post`, x + norm(attn(x)), then + norm(mlp(x)); with `both`,
    x + post_norm(attn(norm(x))), then the same around the MLP (Gemma). `kind`: the layer's
    kind in `model.attention_pattern` or `model.layer_types` (None without one)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, kind: str | None = None):
        self.attn_norm = RMSNorm(cfg, rngs=rngs)
        self.attn = attention_layer(cfg, rngs=rngs, kind=kind)
        self.mlp_norm = RMSNorm(cfg, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)
        if cfg.norm_placement == "both":
            self.attn_post_norm = RMSNorm(cfg, rngs=rngs)
            self.mlp_post_norm = RMSNorm(cfg, rngs=rngs)

    def __call__(self, x, positions, segment_ids, fp8=None):
        cfg = self.attn.cfg
        x = checkpoint_name(x, "layer_input")
        h = constrain(norm_before(self.attn_norm, x, cfg), REGION_INPUT_AXES)
        h = self.attn(h, positions, segment_ids, None if fp8 is None else fp8["attn"])
        x = constrain(x + norm_after(self.attn_norm, h, cfg, post_norm(self, "attn")), RESIDUAL_AXES)
        h = constrain(norm_before(self.mlp_norm, x, cfg), REGION_INPUT_AXES)
        h = self.mlp(h, None if fp8 is None else fp8["mlp"])
        return constrain(x + norm_after(self.mlp_norm, h, cfg, post_norm(self, "mlp")), RESIDUAL_AXES)


def post_norm(block, sublayer: str) -> RMSNorm | None:
    """The block's norm after `sublayer` ("attn" or "mlp") with norm_placement both, else None."""
    return getattr(block, f"{sublayer}_post_norm", None)


class PatternGroup(nnx.Module):
    """One repeat of `model.attention_pattern` (or of `model.layer_types`): a Block per kind
    (`layer_0`, ...), so that the layer scan runs over groups and each layer keeps its static
    window and RoPE base (or its token mixer).
    `block`: the class of its blocks (models/transformer.py MoEPatternGroup: MoE blocks)."""

    block = Block

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.n_layers = cfg.layers_per_group
        for i, kind in enumerate(cfg.scan_pattern):
            setattr(self, f"layer_{i}", self.block(cfg, rngs=rngs, kind=kind))

    def blocks(self) -> list[Block]:
        return [getattr(self, f"layer_{i}") for i in range(self.n_layers)]

    def __call__(self, x, positions, segment_ids, fp8=None):
        for i, block in enumerate(self.blocks()):
            x = block(x, positions, segment_ids, None if fp8 is None else fp8[f"layer_{i}"])
        return x

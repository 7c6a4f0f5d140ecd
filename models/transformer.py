"""Decoder-only transformer with layers stacked on a leading `layers` axis and
run with `jax.lax.scan` (one compiled layer body: compile time on CPU is paid
in every test), each layer wrapped in `jax.checkpoint` per `cfg.remat`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import Block, RMSNorm, param
from sharding import constrain

# What the backward pass may keep from the forward pass, per `cfg.remat`.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        cfg.validate()
        self.cfg = cfg
        self.embedding = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                               std=cfg.init_std, dtype=cfg.param_dtype)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                                 std=cfg.init_std, dtype=cfg.param_dtype)

    def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """tokens int [batch, seq] -> logits [batch, seq, vocab] (compute dtype).

        `positions` (RoPE) default to 0..seq-1; `segment_ids` (packed documents,
        attention stays within a segment) default to one segment per row.
        """
        cfg = self.cfg
        if tokens.ndim != 2:
            raise ValueError(f"tokens: expected [batch, seq], got shape {tokens.shape}")
        b, s = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if segment_ids is None:
            segment_ids = jnp.ones((b, s), jnp.int32)
        dt = jnp.dtype(cfg.compute_dtype)
        x = jnp.take(self.embedding[...], tokens, axis=0).astype(dt)
        x = constrain(x, ("batch", "seq", "act_embed"))

        graphdef, layer_state = nnx.split(self.blocks)

        def layer(x, state):
            return nnx.merge(graphdef, state)(x, positions, segment_ids), None

        if cfg.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
        x, _ = jax.lax.scan(layer, x, layer_state,
                            unroll=1 if cfg.scan_layers else cfg.n_layers)
        x = self.final_norm(x)
        head = self.embedding[...].T if cfg.tie_embeddings else self.lm_head[...]
        logits = x @ head.astype(dt)
        return constrain(logits, ("batch", "seq", "act_vocab"))

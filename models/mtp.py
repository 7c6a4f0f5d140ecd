"""DeepSeek-V3's multi-token prediction (MTP; DeepSeek-V3 technical report, section 2.2).

`model.mtp.depth` modules run in sequence after the main model. Module k (1-based) predicts
token t + k + 1 at position t, from two inputs at that position: the previous module's hidden
state h^{k-1}_t (h^0: the main model's last residual stream, before its final norm) and the
embedding of token t + k (the main model's table):

    h'_t  = eh_proj [enorm(Emb(token t + k)) ; hnorm(h^{k-1}_t)]     (2 d_model -> d_model)
    h^k_t = block(h')                 (one decoder block of the model's kind: MoE on MoE models)
    logits = head(head_norm(h^k_t))   (the main model's output head, the module's own norm)

The embedding comes first in the concatenation, as DeepSeek's checkpoints store `eh_proj`
(and as vLLM and SGLang read them); the report's equation writes it second. The block attends
causally over the positions as the main layers do, so module k's prediction at t sees tokens
up to t + k and no further.

The modules are stacked on a leading `mtp_depth` axis and run as one scanned body (unrolled
with `model.scan_layers: false`), each under the main layers' remat policy. Positions whose
target lies past the row's end or in another document have no target (`lookahead_mask`).
The loss is the trainer's (jaxtrain/trainer/mtp.py); generation never calls this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models import layer_scan
from jaxtrain.models.blocks import Block
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.layers import RESIDUAL_AXES, RMSNorm, matmul_weight, param
from jaxtrain.models.moe import MoEBlock
from jaxtrain.sharding import constrain

# eh_proj [2 d_model, d_model]: the concatenated input's dim has a name of its own (replicated
# by every rule table), its output dim is the residual stream's `embed` (fsdp-sharded as
# every weight's d_model)
EH_PROJ_AXES = ("mtp_concat", "embed")


class MTPLayer(nnx.Module):
    """One prediction depth: `enorm`, `hnorm`, `eh_proj`, `block`, `head_norm` (DeepSeek's
    `shared_head.norm`); returns (h^k, head_norm(h^k), the block's MoE stats or None)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.enorm = RMSNorm(cfg, rngs=rngs)
        self.hnorm = RMSNorm(cfg, rngs=rngs)
        self.eh_proj = param(rngs, (2 * d, d), EH_PROJ_AXES, std=cfg.init_std, dtype=cfg.param_dtype)
        # the kind the layer after the last would have in attention_pattern, MoE or dense alike
        # (the MoE block once took none: with a pattern, the window of every local layer)
        pattern = cfg.attention_pattern
        kind = pattern[cfg.n_layers % len(pattern)] if pattern else None
        block = MoEBlock if cfg.moe is not None else Block
        self.block = block(cfg, rngs=rngs, kind=kind)
        self.head_norm = RMSNorm(cfg, rngs=rngs)
        self.cfg = cfg

    def __call__(self, h, emb, positions, segment_ids):
        x = jnp.concatenate([self.enorm(emb), self.hnorm(h)], axis=-1)
        x = jnp.einsum("bsc,cd->bsd", x, matmul_weight(self.eh_proj[...], EH_PROJ_AXES, self.cfg))
        out = self.block(constrain(x, RESIDUAL_AXES), positions, segment_ids)
        h, stats = out if isinstance(out, tuple) else (out, None)
        return h, self.head_norm(h), stats


def run(layers: nnx.Module, h0, emb, positions, segment_ids, *, cfg: ModelConfig, policy):
    """The stacked modules `layers` (an MTPLayer per depth) in sequence.

    h0 [batch, seq, d_model]: the main model's last residual (before its final norm); emb
    [depth, batch, seq, d_model]: module k's token embeddings (`lookahead_tokens`, embedded);
    `policy`: the main layers' remat policy (None: no checkpoint), the loop scanned or
    unrolled as theirs (`cfg.scan_layers`). Returns (head-normed hidden
    states [depth, batch, seq, d_model], the blocks' MoE stats stacked on depth, or None)."""
    graphdef, state = nnx.split(layers)
    depth = jax.tree.leaves(state)[0].shape[0]

    def module(state, h, emb, positions, segment_ids):
        h, normed, stats = nnx.merge(graphdef, state)(h, emb, positions, segment_ids)
        return h, (normed, stats)

    if policy is not None:  # as the main layers (models/transformer.py `hidden`)
        module = jax.checkpoint(module, policy=policy, prevent_cse=cfg.unrolled_layers)
    _, (normed, stats) = layer_scan.scan(
        lambda h, xs, consts: module(xs[0], h, xs[1], *consts),
        h0,
        (state, emb),
        (positions, segment_ids),
        unroll=depth if cfg.unrolled_layers else 1,
        compact_grads=cfg.compact_weight_grads,
    )
    return normed, stats


def lookahead_tokens(inputs: jax.Array, targets: jax.Array, depth: int) -> jax.Array:
    """[depth, batch, seq] int: at [k - 1, :, t] token t + k of the row (inputs then the last
    target, so token seq is known), 0 past it (those positions have no target)."""
    tokens = jnp.concatenate([inputs, targets[:, -1:]], axis=1)  # tokens 0 .. seq
    return jnp.stack([_shifted(tokens, k)[:, : inputs.shape[1]] for k in range(1, depth + 1)])


def lookahead_targets(targets: jax.Array, depth: int) -> jax.Array:
    """[depth, batch, seq] int: module k's target at t, token t + k + 1 (= targets[t + k]),
    0 past the row's end."""
    return jnp.stack([_shifted(targets, k) for k in range(1, depth + 1)])


def lookahead_mask(loss_mask: jax.Array, segment_ids: jax.Array, depth: int) -> jax.Array:
    """[depth, batch, seq] float32: 1 where module k's target at t counts: the main loss counts
    target t + k (loss_mask[t + k]: a real token of that document) and position t is in the
    same document as t + k (segments are contiguous, so every token between is too); 0 past
    the row's end."""
    mask = loss_mask.astype(jnp.float32)
    out = []
    for k in range(1, depth + 1):
        same_doc = _shifted(segment_ids, k, fill=-1) == segment_ids
        out.append(_shifted(mask, k) * same_doc)
    return jnp.stack(out)


def _shifted(a: jax.Array, k: int, fill=0) -> jax.Array:
    """a [batch, n] shifted left by k along its second axis: [t] = a[t + k], `fill` past the end."""
    pad = jnp.full((a.shape[0], min(k, a.shape[1])), fill, a.dtype)
    return jnp.concatenate([a[:, k:], pad], axis=1)

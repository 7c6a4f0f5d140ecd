"""Multi-head latent attention (MLA: DeepSeek-V2 and V3, Kimi K2, Moonlight), `model.mla`.

Parameters of one layer (H = n_heads, D = d_model; names as Hugging Face's DeepseekV3Attention):

    wq      [D, H, nope + rope]          ("embed", "heads", "head_dim")    q_lora_rank null
    wq_a    [D, q_lora]                  ("embed", "q_lora")               q_lora_rank set: the
    q_norm  [q_lora]                     ("norm",)                          query's latent,
    wq_b    [q_lora, H, nope + rope]     ("q_lora", "heads", "head_dim")   its norm, its up-projection
    wkv_a   [D, kv_lora + rope]          ("embed", "kv_lora")              the latent and the shared RoPE key
    kv_norm [kv_lora]                    ("norm",)
    wkv_b   [kv_lora, H, nope + v]       ("kv_lora", "heads", "head_dim")  per head: no-RoPE key, value
    wo      [H, v, D]                    ("heads", "head_dim", "embed")
    bo      [D]                          ("bias",)                         model.attention_out_bias
    sinks   [H]                          ("sink_heads",)                   model.attention_sinks

Heads shard over `tensor` like every attention's; the latents (`q_lora`, `kv_lora`) are
never split over `tensor` (each head's up-projection reads all of it), and over `fsdp` only
where `embed` does not already take it (sharding/rules.py).

A head's key is its no-RoPE part (from the key/value latent's up-projection) followed by the
one RoPE part every head shares (straight from the down-projection, rotated once); its query
the same split of its own projection. The latents' RMSNorms use epsilon 1e-6 whatever
`model.norm_eps` says, as DeepSeek's reference code and transformers do. The softmax scale
is (nope + rope) ** -0.5, times YaRN's get_mscale(factor, mscale_all_dim) ** 2 when
`model.rope_mscale_all_dim` is set (transformers' `yarn_apply_mscale`); `model.attention_scale`
overrides it.

`model.attention_sinks` and `model.attention_out_bias` are layers.Attention's (GPT-OSS): one
learned logit per head in every softmax's denominator, carrying no value, and a bias on the
output projection. No published MLA checkpoint has either (models/hf/deepseek.py does not export them);
they exist so that a config asking for them gets them, in training and in the latent-cache
decode alike (models/generation.py), never a model silently without them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.models import logit_stats
from jaxtrain.models.attention import attend
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.layers import (
    RMSNorm,
    matmul_weight,
    param,
    rope,
    rope_attention_factor,
    rope_frequencies,
    weight_matmul,
    yarn_mscale,
)
from jaxtrain.sharding import constrain

LATENT_NORM_EPS = 1e-6  # DeepSeek's RMSNorm default, which its latent norms keep


def softmax_scale(cfg: ModelConfig) -> float:
    """The query scale of latent attention (module docstring)."""
    if cfg.attention_scale is not None:
        return cfg.attention_scale
    scale = cfg.mla.qk_head_dim**-0.5
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_scaling_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


def _latent_norm(cfg: ModelConfig, rngs: nnx.Rngs, width: int) -> RMSNorm:
    norm = RMSNorm(cfg, rngs=rngs, shape=(width,))
    norm.eps = LATENT_NORM_EPS
    return norm


class LatentAttention(nnx.Module):
    """MLA self-attention: the same interface as layers.Attention (`project` gives full q, k
    and v per head, `output` projects the heads' values back)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, kind: str | None = None):
        self.kind = kind
        m = cfg.mla
        d, h = cfg.d_model, cfg.n_heads
        p = lambda shape, axes, std: param(rngs, shape, axes, std=std, dtype=cfg.param_dtype)
        if m.q_lora_rank is None:
            self.wq = p((d, h, m.qk_head_dim), ("embed", "heads", "head_dim"), cfg.init_std)
        else:
            self.wq_a = p((d, m.q_lora_rank), ("embed", "q_lora"), cfg.init_std)
            self.q_norm = _latent_norm(cfg, rngs, m.q_lora_rank)
            self.wq_b = p((m.q_lora_rank, h, m.qk_head_dim), ("q_lora", "heads", "head_dim"), cfg.init_std)
        self.wkv_a = p((d, m.kv_lora_rank + m.qk_rope_head_dim), ("embed", "kv_lora"), cfg.init_std)
        self.kv_norm = _latent_norm(cfg, rngs, m.kv_lora_rank)
        kv_width = m.qk_nope_head_dim + m.v_head_dim
        self.wkv_b = p((m.kv_lora_rank, h, kv_width), ("kv_lora", "heads", "head_dim"), cfg.init_std)
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.wo = p((h, m.v_head_dim, d), ("heads", "head_dim", "embed"), out_std)
        if cfg.attention_out_bias:  # as layers.Attention's: d_model whole
            self.bo = p((d,), ("bias",), 0)
        if cfg.attention_sinks:  # one logit per query head, split with the heads
            self.sinks = p((h,), ("sink_heads",), 0)
        self.cfg = cfg

    def __call__(self, x, positions, segment_ids, fp8=None):
        q, k, v = self.project(x, positions)
        if logit_stats.enabled():  # QK-clip (optimizer.qk_clip): each head's largest logit
            stats = logit_stats.max_logits(
                q, k, scale=softmax_scale(self.cfg), segment_ids=segment_ids, window=self.window
            )
            logit_stats.record(self, stats)
        return self.output(self.attention(q, k, v, segment_ids))

    def attention(self, q, k, v, segment_ids):
        """Causal attention of expanded q, k, v [b, s, H, *] with this layer's scale -> [b, s, H, v]."""
        cfg = self.cfg
        # only when set, so that the attention paths without sinks see the call they know
        sinks = {"sinks": self.sinks[...]} if cfg.attention_sinks else {}
        return attend(
            q,
            k,
            v,
            segment_ids=segment_ids,
            causal=True,
            impl=cfg.attention_impl,
            gpu_kernel=cfg.flash_kernel_on_gpu,
            sliding_window=self.window,
            context_impl=cfg.context_impl,
            cpu_tuned=cfg.cpu_tuning is True,
            softmax_scale=softmax_scale(cfg),
            softcap=cfg.attention_softcap,
            **sinks,
        )

    @property
    def window(self) -> int | None:
        return None if self.kind == "global" else self.cfg.sliding_window

    def _matmul(self, eqn: str, x: jax.Array, name: str, axes) -> jax.Array:
        """x through weight `name` (layers.weight_matmul: the compute dtype, CPU tuning)."""
        w = matmul_weight(getattr(self, name)[...], axes, self.cfg)
        return weight_matmul(eqn, x, w, self.cfg, None)

    def _rope(self, t: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg
        inv_freq = rope_frequencies(cfg, self.kind, dim=cfg.mla.qk_rope_head_dim)
        factor = rope_attention_factor(cfg, self.kind)
        return rope(t, positions, inv_freq, factor=factor, interleave=cfg.rope_interleave)

    def query(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [b, s, d] -> (no-RoPE part [b, s, H, nope], RoPE part rotated [b, s, H, rope])."""
        m = self.cfg.mla
        if m.q_lora_rank is None:
            q = self._matmul("bsd,dhk->bshk", x, "wq", ("embed", "heads", "head_dim"))
        else:
            latent = self.q_norm(self._matmul("bsd,dr->bsr", x, "wq_a", ("embed", "q_lora")))
            q = self._matmul("bsr,rhk->bshk", latent, "wq_b", ("q_lora", "heads", "head_dim"))
        q = constrain(q, ("batch", "seq", "act_heads", None))
        q_nope, q_rope = jnp.split(q, [m.qk_nope_head_dim], axis=-1)
        return q_nope, self._rope(q_rope, positions)

    def latent(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [b, s, d] -> (the normed key/value latent [b, s, kv_lora], the shared RoPE key
        rotated [b, s, rope]): all a latent KV cache keeps of a token."""
        m = self.cfg.mla
        ckv = self._matmul("bsd,dr->bsr", x, "wkv_a", ("embed", "kv_lora"))
        latent, k_rope = jnp.split(ckv, [m.kv_lora_rank], axis=-1)
        return self.kv_norm(latent), self._rope(k_rope[:, :, None, :], positions)[:, :, 0, :]

    def expand(self, latent: jax.Array, k_rope: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(latent [b, t, kv_lora], shared RoPE key [b, t, rope]) -> keys [b, t, H, nope + rope]
        and values [b, t, H, v]: the up-projection split per head, the RoPE key joined to every head."""
        m = self.cfg.mla
        kv = self._matmul("btr,rhk->bthk", latent, "wkv_b", ("kv_lora", "heads", "head_dim"))
        kv = constrain(kv, ("batch", "seq", "act_kv_heads", None))
        k_nope, v = jnp.split(kv, [m.qk_nope_head_dim], axis=-1)
        shared = jnp.broadcast_to(k_rope[:, :, None, :], (*k_nope.shape[:-1], m.qk_rope_head_dim))
        return jnp.concatenate([k_nope, shared.astype(k_nope.dtype)], axis=-1), v

    def project(self, x, positions, fp8=None):
        """x [b, s, d] -> q and k [b, s, H, nope + rope], v [b, s, H, v_head_dim], RoPE
        applied. `fp8` must be None (model.fp8 is refused with model.mla)."""
        q_nope, q_rope = self.query(x, positions)
        q = constrain(jnp.concatenate([q_nope, q_rope], axis=-1), ("batch", "seq", "act_heads", None))
        k, v = self.expand(*self.latent(x, positions))
        k = constrain(k, ("batch", "seq", "act_kv_heads", None))
        v = constrain(v, ("batch", "seq", "act_kv_heads", None))
        # Activation checkpoint names as layers.Attention's (model.remat policies)
        return tuple(checkpoint_name(t, "qkv_proj") for t in (q, k, v))

    def output(self, out, fp8=None):
        """Attention output [b, s, H, v_head_dim] -> [b, s, d]."""
        out = constrain(out, ("batch", "seq", "act_heads", None))  # named `context` by attend()
        y = self._matmul("bshk,hkd->bsd", out, "wo", ("heads", "head_dim", "embed"))
        if self.cfg.attention_out_bias:
            y = y + self.bo[...].astype(y.dtype)
        return checkpoint_name(y, "out_proj")

    # --- the latent KV cache (models/generation.py): attention with the up-projections absorbed

    def _up_projection(self, part: str) -> jax.Array:
        """wkv_b's key ("key": [kv_lora, H, nope]) or value ("value": [kv_lora, H, v]) half."""
        w = matmul_weight(self.wkv_b[...], ("kv_lora", "heads", "head_dim"), self.cfg)
        nope = self.cfg.mla.qk_nope_head_dim
        return w[..., :nope] if part == "key" else w[..., nope:]

    def absorbed_query(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [b, s, d] -> the query against cached [latent, RoPE key] rows [b, s, H, kv_lora + rope]:
        each head's no-RoPE query through its key up-projection (q_nope . (W_uk c) = (W_uk^T
        q_nope) . c), then its rotated RoPE part."""
        q_nope, q_rope = self.query(x, positions)
        q_latent = jnp.einsum("bshn,rhn->bshr", q_nope, self._up_projection("key"))
        return jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)

    def absorbed_output(self, context: jax.Array) -> jax.Array:
        """Attention-weighted latents [b, s, H, kv_lora] -> [b, s, d]: each head's value
        up-projection, then the output projection."""
        values = jnp.einsum("bshr,rhv->bshv", context, self._up_projection("value"))
        return self.output(values)

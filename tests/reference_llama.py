"""An independent, deliberately naive Llama forward pass in plain jnp.

Written from the Llama paper / HF `modeling_llama` semantics, not from
`models/`: K/V heads are repeated (jnp.repeat) for GQA, RoPE uses explicit
cos/sin tables, attention is a per-head softmax over an explicit mask, and
layers run in a Python loop. Used only as a test oracle.
"""

import jax
import jax.numpy as jnp
import numpy as np


def rms_norm(x, scale, eps):
    return x / jnp.sqrt(jnp.mean(x**2, axis=-1, keepdims=True) + eps) * scale


def rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x, positions, theta):
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
    freqs = positions[..., None] * inv_freq  # [b, s, d/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [b, s, d]
    cos, sin = jnp.cos(emb)[:, :, None], jnp.sin(emb)[:, :, None]
    return x * cos + rotate_half(x) * sin


def forward(params, tokens, cfg, positions=None, segment_ids=None):
    b, s = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    if segment_ids is None:
        segment_ids = jnp.ones((b, s), jnp.int32)
    hd = cfg.resolved_head_dim
    groups = cfg.n_heads // cfg.n_kv_heads
    causal = np.tril(np.ones((s, s), bool))
    mask = causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])  # [b, q, k]
    x = params["embedding"][tokens]
    blocks = params["blocks"]
    for layer in range(cfg.n_layers):
        p = jax.tree.map(lambda a: a[layer], blocks)
        h = rms_norm(x, p["attn_norm"]["scale"], cfg.norm_eps)
        q = jnp.einsum("bsd,dhk->bshk", h, p["attn"]["wq"])
        k = jnp.einsum("bsd,dhk->bshk", h, p["attn"]["wk"])
        v = jnp.einsum("bsd,dhk->bshk", h, p["attn"]["wv"])
        q, k = apply_rope(q, positions, cfg.rope_theta), apply_rope(k, positions, cfg.rope_theta)
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / np.sqrt(hd)
        scores = jnp.where(mask[:, None], scores, -1e30)
        attn = jnp.einsum("bhqt,bthk->bqhk", jax.nn.softmax(scores, axis=-1), v)
        x = x + jnp.einsum("bqhk,hkd->bqd", attn, p["attn"]["wo"])
        h = rms_norm(x, p["mlp_norm"]["scale"], cfg.norm_eps)
        gate = h @ p["mlp"]["w_gate"]
        x = x + (gate * jax.nn.sigmoid(gate) * (h @ p["mlp"]["w_up"])) @ p["mlp"]["w_down"]
    x = rms_norm(x, params["final_norm"]["scale"], cfg.norm_eps)
    head = params["embedding"].T if cfg.tie_embeddings else params["lm_head"]
    return x @ head

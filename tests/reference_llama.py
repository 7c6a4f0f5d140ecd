"""An independent, deliberately naive Llama forward pass in plain jnp.

Written from the Llama paper / HF `modeling_llama` semantics, not from
`models/`: K/V heads are repeated (jnp.repeat) for GQA, RoPE uses explicit
cos/sin tables, attention is a per-head softmax over an explicit mask, and
layers run in a Python loop. The features a layer can add (sinks, query/key
norms, sliding windows and layer patterns) and the final logit softcap are
written the same way (`block`). Used only as a test oracle.
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


def latent_qkv(a, h, positions, cfg):
    """DeepSeek-V2/V3's latent attention (`model.mla`), as its paper writes it: queries through
    the normed query latent; keys as the up-projected no-RoPE part joined to the one RoPE key all
    heads share; values up-projected from the normed KV latent (the latents' norms at eps 1e-6).
    -> q, k [b, s, heads, nope + rope], v [b, s, heads, v_head_dim]."""
    m = cfg.mla
    n = m.qk_nope_head_dim
    q = jnp.einsum("bsr,rhk->bshk", rms_norm(h @ a["wq_a"], a["q_norm"]["scale"], 1e-6), a["wq_b"])
    q = jnp.concatenate([q[..., :n], apply_rope(q[..., n:], positions, cfg.rope_theta)], axis=-1)
    ckv = h @ a["wkv_a"]
    latent = rms_norm(ckv[..., : m.kv_lora_rank], a["kv_norm"]["scale"], 1e-6)
    k_rope = apply_rope(ckv[:, :, None, m.kv_lora_rank :], positions, cfg.rope_theta)
    kv = jnp.einsum("bsr,rhk->bshk", latent, a["wkv_b"])
    k_nope, v = kv[..., :n], kv[..., n:]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:-1], m.qk_rope_head_dim))], -1)
    return q, k, v


def block(p, x, positions, mask, cfg, kind=None, maxima=None, attention_only=False):
    """One pre-norm Llama block (models/blocks.py Block's parameters) and the features a layer
    can add, each written from its paper / HF model: attention sinks (GPT-OSS: one logit per
    head joins the softmax, its share dropped), a per-head RMSNorm of queries and keys before
    RoPE (Qwen3, `model.qk_norm=head`), and a sliding window (Mistral / Gemma: key j visible from
    query i when i - j < window) on `local` layers, or on every layer without a pattern.
    `maxima`: a list that gets each head's largest visible q.k logit (QK-clip's statistic; a
    sink is no q.k logit); `attention_only`: the residual after the attention (an MoE layer's
    logits, whose experts the reference does not model)."""
    groups, hd = cfg.n_heads // cfg.n_kv_heads, cfg.resolved_head_dim
    s = x.shape[1]
    window = None if kind == "global" else cfg.sliding_window
    if window is not None:
        i = np.arange(s)
        mask = mask & ((i[:, None] - i[None, :]) < window)[None]
    a = p["attn"]
    h = rms_norm(x, p["attn_norm"]["scale"], cfg.norm_eps)
    if "wkv_a" in a:
        q, k, v = latent_qkv(a, h, positions, cfg)
        hd = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim
    else:
        q, k, v = (jnp.einsum("bsd,dhk->bshk", h, a[w]) for w in ("wq", "wk", "wv"))
        if "q_norm" in a:
            q = rms_norm(q, a["q_norm"]["scale"], cfg.norm_eps)
            k = rms_norm(k, a["k_norm"]["scale"], cfg.norm_eps)
        q, k = apply_rope(q, positions, cfg.rope_theta), apply_rope(k, positions, cfg.rope_theta)
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / np.sqrt(hd)
    if maxima is not None:
        maxima.append(jnp.max(jnp.where(mask[:, None], scores, -jnp.inf), axis=(0, 2, 3)))
    scores = jnp.where(mask[:, None], scores, -1e30)
    if "sinks" in a:
        sink = jnp.broadcast_to(a["sinks"][None, :, None, None], (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    attn = jnp.einsum("bhqt,bthk->bqhk", probs, v)
    x = x + jnp.einsum("bqhk,hkd->bqd", attn, a["wo"])
    if attention_only:
        return x
    h = rms_norm(x, p["mlp_norm"]["scale"], cfg.norm_eps)
    gate = h @ p["mlp"]["w_gate"]
    return x + (gate * jax.nn.sigmoid(gate) * (h @ p["mlp"]["w_up"])) @ p["mlp"]["w_down"]


def layers(params, cfg, key="blocks"):
    """[(kind, the layer's parameters)] in model order; with `model.attention_pattern` the
    blocks are stacked per kind (`layer_0`, `layer_1`, ...) over the pattern's repeats. `key`:
    the stack (`moe_blocks` in an MoE model)."""
    pattern = cfg.attention_pattern
    if not pattern:
        return [(None, jax.tree.map(lambda a, i=i: a[i], params[key])) for i in range(cfg.n_layers)]
    return [
        (kind, jax.tree.map(lambda a, g=g: a[g], params[key][f"layer_{i}"]))
        for g in range(cfg.n_layers // len(pattern))
        for i, kind in enumerate(pattern)
    ]


def causal_mask(segment_ids):
    """[b, q, k]: k at or before q, in q's document (jnp: the ids may be traced)."""
    s = segment_ids.shape[1]
    segment_ids = jnp.asarray(segment_ids)
    return np.tril(np.ones((s, s), bool))[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])


def forward(params, tokens, cfg, positions=None, segment_ids=None, hidden=False):
    """Logits (c tanh(z / c) with `model.final_softcap` c); `hidden`: the last block's output
    before the final norm instead."""
    b, s = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    if segment_ids is None:
        segment_ids = jnp.ones((b, s), jnp.int32)
    mask = causal_mask(segment_ids)
    x = params["embedding"][tokens]
    for kind, p in layers(params, cfg):
        x = block(p, x, positions, mask, cfg, kind)
    if hidden:
        return x
    x = rms_norm(x, params["final_norm"]["scale"], cfg.norm_eps)
    head = params["embedding"].T if cfg.tie_embeddings else params["lm_head"]
    logits = x @ head
    if cfg.final_softcap:
        logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
    return logits

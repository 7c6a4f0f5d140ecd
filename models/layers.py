"""Transformer building blocks (Flax NNX). Every parameter names its dims with
logical axes (stored as `out_sharding` metadata, resolved by `sharding.rules`);
activations are hinted with `sharding.constrain` at layer boundaries. No mesh
axis name appears here. The names also give a parameter its role: "norm" (norm
scales) and "bias" (biases) are never sharded and never weight-decayed
(`jaxtrain.trainer.optimizer.decays`)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.models import cpu_tuning, logit_stats, lora
from jaxtrain.models import fp8 as fp8_ops
from jaxtrain.models.attention import attend
from jaxtrain.models.config import ModelConfig
from jaxtrain.sharding import constrain

# The residual stream between blocks and sublayers (and the norms on it). Its sequence dim
# has its own logical name so that Megatron sequence parallelism (the `fsdp_tensor_sp` rule
# preset) can split it over `tensor` while q/k/v and the MLP keep `seq` whole there.
RESIDUAL_AXES = ("batch", "residual_seq", "act_embed")
# The input of a tensor-parallel region (attention, MLP): seq whole over `tensor` again, so
# sequence parallelism all-gathers the normed activations here (Megatron's `g`) rather than
# letting XLA gather the weights and reshuffle heads.
REGION_INPUT_AXES = ("batch", "seq", "act_embed")


def param(rngs: nnx.Rngs, shape, logical_axes, *, std: float | None, dtype, fill: float = 1.0) -> nnx.Param:
    """A parameter with logical axis names; std None means `fill` everywhere (norm scales: 1,
    or 0 with a norm scale offset of 1), 0 zeros (biases)."""
    if std is None:
        value = jnp.full(shape, fill, dtype)
    elif std == 0:
        value = jnp.zeros(shape, dtype)
    else:
        value = std * jax.random.normal(rngs.params(), shape, dtype)
    # eager_sharding=False: we resolve names ourselves with sharding.rules, so the
    # same names work with or without a mesh and with any rule table.
    return nnx.Param(value, out_sharding=tuple(logical_axes), eager_sharding=False)


class RMSNorm(nnx.Module):
    """RMSNorm over the trailing dims its scale has: [d_model] (the residual stream), or for
    QK-norm [head_dim] (each head) or [heads, head_dim] (a whole projection). It multiplies
    by (model.norm_scale_offset + scale): Gemma stores its scales around 0 with offset 1."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, shape=None, logical_axes=("norm",)):
        shape = (cfg.d_model,) if shape is None else tuple(shape)
        self.offset = cfg.norm_scale_offset
        fill = 1.0 - self.offset
        self.scale = param(rngs, shape, logical_axes, std=None, dtype=cfg.param_dtype, fill=fill)
        self.eps = cfg.norm_eps

    def __call__(self, x):
        scale = self.scale[...]
        dims = tuple(range(-scale.ndim, 0))
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=dims, keepdims=True) + self.eps)
        return (x32 * (self.offset + scale.astype(jnp.float32))).astype(x.dtype)


def norm_before(norm: RMSNorm, x, cfg: ModelConfig):
    """A sublayer's input: norm(x) with pre-norms (and both), x itself with post-norms."""
    return x if cfg.norm_placement == "post" else norm(x)


def norm_after(norm: RMSNorm, h, cfg: ModelConfig, post: RMSNorm | None = None):
    """What a sublayer adds to the residual stream: h with pre-norms, norm(h) with post-norms,
    post(h) with both (a norm of its own after the sublayer: Gemma)."""
    if cfg.norm_placement == "both":
        return post(h)
    return norm(h) if cfg.norm_placement == "post" else h


def matmul_weight(w: jax.Array, logical_axes, cfg: ModelConfig) -> jax.Array:
    """A weight as its matmul uses it: cast to the compute dtype (with `model.cpu_tuning` in
    bfloat16, also constrained to its fsdp-gathered layout: models/cpu_tuning.py)."""
    w = w.astype(jnp.dtype(cfg.compute_dtype))
    return cpu_tuning.gathered_weight(w, logical_axes) if cfg.gathers_weights_once else w


def weight_matmul(eqn: str, x: jax.Array, w: jax.Array, cfg: ModelConfig, fp8_site: dict | None) -> jax.Array:
    """`jnp.einsum(eqn, x, w)` for a weight `w`: through fp8 when the layer has fp8 state
    (`fp8_site`, models/fp8.py), with XLA:CPU's transpose-free gradient under
    `model.cpu_tuning` (models/cpu_tuning.py)."""
    if fp8_site is not None:
        return fp8_ops.einsum(eqn, x, w, fp8_site)
    return cpu_tuning.einsum(eqn, x, w) if cfg.cpu_tuning is True else jnp.einsum(eqn, x, w)


def own_local_rope(cfg: ModelConfig, kind: str | None) -> bool:
    """Whether a layer of this kind has its own unscaled RoPE of base `local_rope_theta`:
    Gemma 3's local layers (transformers: `rope_parameters` per layer type). Without
    `local_rope_theta`, local layers share the global RoPE and its scaling, as transformers'
    one rotary embedding gives them (GPT-OSS's YaRN, Gemma 2)."""
    return kind == "local" and cfg.local_rope_theta is not None


def rope_frequencies(cfg: ModelConfig, kind: str | None = None, dim: int | None = None) -> jax.Array:
    """Inverse frequencies [dim / 2] (dim: the rotated width, head_dim by default; latent
    attention: its RoPE part), with the configured long-context scaling.

    `llama3`: Llama 3.1's rule (wavelengths longer than original_max_position /
    low_freq_factor are slowed by `factor`, shorter than .../high_freq_factor kept,
    smooth in between); `linear`: all divided by `factor`; `yarn`: `yarn_frequencies`.
    Every layer shares this RoPE (GPT-OSS's sliding layers have its YaRN too), except a local
    layer of an attention pattern (`kind`) when `local_rope_theta` is set: its own base and no
    scaling (Gemma 3; `own_local_rope`).
    """
    d = cfg.resolved_head_dim if dim is None else dim
    theta = cfg.local_rope_theta if own_local_rope(cfg, kind) else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if own_local_rope(cfg, kind):
        return inv_freq
    factor = cfg.rope_scaling_factor
    if cfg.rope_scaling == "linear":
        return inv_freq / factor
    if cfg.rope_scaling == "yarn":
        return yarn_frequencies(cfg, inv_freq, d)
    if cfg.rope_scaling == "llama3":
        old = cfg.rope_original_max_position
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        wavelen = 2 * jnp.pi / inv_freq
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return jnp.where(
            wavelen > old / low, inv_freq / factor, jnp.where(wavelen < old / high, inv_freq, smoothed)
        )
    return inv_freq


def yarn_frequencies(cfg: ModelConfig, inv_freq: jax.Array, dim: int) -> jax.Array:
    """YaRN's frequencies (transformers' `_compute_yarn_parameters`): those that turn fewer than
    `rope_beta_slow` times over the original context are divided by the factor, those that turn
    more than `rope_beta_fast` times are kept, a linear ramp over the dimensions in between
    (its ends rounded outwards with `rope_truncate`)."""

    def correction_dim(rotations: float) -> float:  # the dimension turning `rotations` times
        turns = cfg.rope_original_max_position / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(cfg.rope_theta))

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return inv_freq / cfg.rope_scaling_factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg: ModelConfig, kind: str | None = None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (model.rope_attention_factor,
    else from the mscales: see the config), 1 otherwise and on layers with their own local RoPE
    (`own_local_rope`: Gemma 3's; GPT-OSS's sliding layers have YaRN's factor too)."""
    if cfg.rope_scaling != "yarn" or own_local_rope(cfg, kind):
        return 1.0
    if cfg.rope_attention_factor is not None:
        return cfg.rope_attention_factor
    factor = cfg.rope_scaling_factor
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return yarn_mscale(factor, cfg.rope_mscale) / yarn_mscale(factor, cfg.rope_mscale_all_dim)
    return yarn_mscale(factor)


def rope(
    x: jax.Array, positions: jax.Array, inv_freq: jax.Array, *, factor: float = 1.0, interleave: bool = False
) -> jax.Array:
    """Rotary embedding, Llama "rotate half" convention. x: [b, s, h, d], positions [b, s].
    `factor`: cos and sin scaled by it (YaRN); `interleave`: the rotated pairs are adjacent
    values (DeepSeek), and come out as the halves (as transformers computes it; q and k alike,
    so their products are the same)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [b, s, d/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    x32 = x.astype(jnp.float32)
    x1, x2 = (x32[..., 0::2], x32[..., 1::2]) if interleave else jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def partial_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, *, rotary_dim: int, **kwargs):
    """`rope` on the first `rotary_dim` values of each head, the rest passed through
    (`model.partial_rotary_factor`; transformers' q_rot / q_pass)."""
    if rotary_dim == x.shape[-1]:
        return rope(x, positions, inv_freq, **kwargs)
    rotated = rope(x[..., :rotary_dim], positions, inv_freq, **kwargs)
    return jnp.concatenate([rotated, x[..., rotary_dim:]], axis=-1)


class Attention(nnx.Module):
    """GQA self-attention with RoPE. `kind` (model.attention_pattern): local layers attend
    within `sliding_window` with their own RoPE base, global ones to every earlier key; None
    (no pattern): `sliding_window` as configured."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, kind: str | None = None):
        self.kind = kind
        d, hd = cfg.d_model, cfg.resolved_head_dim
        p = lambda shape, axes, std: param(rngs, shape, axes, std=std, dtype=cfg.param_dtype)
        self.wq = p((d, cfg.n_heads, hd), ("embed", "heads", "head_dim"), cfg.init_std)
        self.wk = p((d, cfg.n_kv_heads, hd), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        self.wv = p((d, cfg.n_kv_heads, hd), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        self.wo = p(
            (cfg.n_heads, hd, d), ("heads", "head_dim", "embed"), cfg.init_std / (2 * cfg.n_layers) ** 0.5
        )
        q, kv = [(cfg.n_heads, "heads"), (hd, "head_dim")], [(cfg.n_kv_heads, "kv_heads"), (hd, "head_dim")]
        # with the output gate, wq's adapter is PEFT's on the whole HF q_proj: per head the
        # query's hd rows, then the gate's (models/lora.py)
        q_rows = [(cfg.n_heads, "heads"), (2 * hd if cfg.attention_output_gate else hd, "head_dim")]
        lora.adapter(self, "wq", cfg, rngs, inputs=[(d, "embed")], outputs=q_rows)
        lora.adapter(self, "wk", cfg, rngs, inputs=[(d, "embed")], outputs=kv)
        lora.adapter(self, "wv", cfg, rngs, inputs=[(d, "embed")], outputs=kv)
        lora.adapter(self, "wo", cfg, rngs, inputs=q, outputs=[(d, "embed")])
        if cfg.attention_output_gate:  # the second half of each head's HF q_proj rows
            self.wq_gate = p((d, cfg.n_heads, hd), ("embed", "heads", "head_dim"), cfg.init_std)
        if cfg.qkv_bias:  # split with their heads; "bias": never weight-decayed
            self.bq = p((cfg.n_heads, hd), ("heads", "bias"), 0)
            self.bk = p((cfg.n_kv_heads, hd), ("kv_heads", "bias"), 0)
            self.bv = p((cfg.n_kv_heads, hd), ("kv_heads", "bias"), 0)
        if cfg.attention_out_bias:  # d_model whole, as the residual stream it adds to
            self.bo = p((d,), ("bias",), 0)
        if cfg.attention_sinks:  # one logit per query head, split with the heads
            self.sinks = p((cfg.n_heads,), ("sink_heads",), 0)
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(cfg, rngs=rngs, shape=(hd,))
            self.k_norm = RMSNorm(cfg, rngs=rngs, shape=(hd,))
        elif cfg.qk_norm == "projection":
            norm = lambda heads, axis: RMSNorm(cfg, rngs=rngs, shape=(heads, hd), logical_axes=(axis, "norm"))
            self.q_norm, self.k_norm = norm(cfg.n_heads, "heads"), norm(cfg.n_kv_heads, "kv_heads")
        self.cfg = cfg

    def __call__(self, x, positions, segment_ids, fp8=None):
        cfg = self.cfg
        q_update = lora.update(self, "wq", x)  # once: one dropout mask for the query and the gate
        q, k, v = self.project(x, positions, fp8, q_update=q_update)
        if logit_stats.enabled():  # QK-clip (optimizer.qk_clip): each head's largest logit
            scale = cfg.attention_scale if cfg.attention_scale is not None else cfg.resolved_head_dim**-0.5
            stats = logit_stats.max_logits(q, k, scale=scale, segment_ids=segment_ids, window=self.window)
            logit_stats.record(self, stats)
        # only when set, so that the attention paths without sinks see the call they know
        sinks = {"sinks": self.sinks[...]} if cfg.attention_sinks else {}
        out = attend(
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
            softmax_scale=cfg.attention_scale,
            softcap=cfg.attention_softcap,
            **sinks,
        )
        return self.output(out, fp8, gate=self.output_gate(x, q_update=q_update))

    @property
    def window(self) -> int | None:
        """The keys a query sees at most (None: all earlier ones)."""
        return None if self.kind == "global" else self.cfg.sliding_window

    def project(self, x, positions, fp8=None, q_update=None):
        """x [b, s, d] -> q [b, s, heads, hd], k and v [b, s, kv_heads, hd], RoPE applied
        (shared with the KV-cache decode in models/generation.py). `fp8`: this layer's
        fp8 state (models/fp8.py); None: matmuls in the compute dtype. `q_update`: wq's
        adapter output (`lora.update`) when the caller shares it with `output_gate`; None:
        computed here."""
        cfg = self.cfg
        proj = lambda w, axes, name: weight_matmul(
            "bsd,dhk->bshk", x, matmul_weight(w[...], axes, cfg), cfg, None if fp8 is None else fp8[name]
        )
        q = _plus(proj(self.wq, ("embed", "heads", "head_dim"), "wq"), self._query_share(x, q_update, part=0))
        k = lora.add(self, "wk", x, proj(self.wk, ("embed", "kv_heads", "head_dim"), "wk"))
        v = lora.add(self, "wv", x, proj(self.wv, ("embed", "kv_heads", "head_dim"), "wv"))
        if cfg.qkv_bias:
            dtype = jnp.dtype(cfg.compute_dtype)
            q, k, v = (t + b[...].astype(dtype) for t, b in ((q, self.bq), (k, self.bk), (v, self.bv)))
        if cfg.qk_norm != "none":  # before RoPE, as Qwen3 and OLMo 2 do
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_frequencies(self.cfg, self.kind, dim=cfg.rotary_dim)
        rotate = functools.partial(
            partial_rope,
            rotary_dim=cfg.rotary_dim,
            factor=rope_attention_factor(cfg, self.kind),
            interleave=cfg.rope_interleave,
        )
        q = constrain(rotate(q, positions, inv_freq), ("batch", "seq", "act_heads", None))
        k = constrain(rotate(k, positions, inv_freq), ("batch", "seq", "act_kv_heads", None))
        v = constrain(v, ("batch", "seq", "act_kv_heads", None))
        # Activation checkpoint names (model.remat policies); no effect outside jax.checkpoint.
        return tuple(checkpoint_name(t, "qkv_proj") for t in (q, k, v))

    def output_gate(self, x, fp8=None, q_update=None):
        """`model.attention_output_gate`: the gate logits [b, s, heads, hd] of x [b, s, d]
        (None without the gate); `q_update` as `project`'s."""
        if not self.cfg.attention_output_gate:
            return None
        w = matmul_weight(self.wq_gate[...], ("embed", "heads", "head_dim"), self.cfg)
        gate = weight_matmul("bsd,dhk->bshk", x, w, self.cfg, None)
        gate = _plus(gate, self._query_share(x, q_update, part=1))
        return checkpoint_name(constrain(gate, ("batch", "seq", "act_heads", None)), "qkv_proj")

    def _query_share(self, x, q_update, part: int):
        """The share of wq's adapter output for the query (`part` 0) or the gate (1); without
        the output gate the query takes it all. None: no adapter (or adapters off)."""
        u = lora.update(self, "wq", x) if q_update is None else q_update
        if u is None or not self.cfg.attention_output_gate:
            return u if part == 0 else None
        return lora.halves(u, part)

    def output(self, out, fp8=None, gate=None):
        """Attention output [b, s, heads, hd] -> [b, s, d]; `gate` (`output_gate`): the output
        is multiplied by its sigmoid first (in the output's dtype, as transformers)."""
        out = constrain(out, ("batch", "seq", "act_heads", None))  # named `context` by attend()
        if gate is not None:
            out = out * jax.nn.sigmoid(gate.astype(out.dtype))
        wo = matmul_weight(self.wo[...], ("heads", "head_dim", "embed"), self.cfg)
        y = weight_matmul("bshk,hkd->bsd", out, wo, self.cfg, None if fp8 is None else fp8["wo"])
        y = lora.add(self, "wo", out, y)
        if self.cfg.attention_out_bias:
            y = y + self.bo[...].astype(y.dtype)
        return checkpoint_name(y, "out_proj")


def _plus(y: jax.Array, u: jax.Array | None) -> jax.Array:
    """y + an adapter's update in y's dtype (None: y)."""
    return y if u is None else y + u.astype(y.dtype)


class MLP(nnx.Module):
    """Gated feed-forward: SwiGLU, or GeGLU with `model.mlp_activation: gelu_tanh`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.mlp_dim
        p = lambda shape, axes, std: param(rngs, shape, axes, std=std, dtype=cfg.param_dtype)
        self.w_gate = p((d, f), ("embed", "mlp"), cfg.init_std)
        self.w_up = p((d, f), ("embed", "mlp"), cfg.init_std)
        self.w_down = p((f, d), ("mlp", "embed"), cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        for name, (fan_in, fan_out) in {
            "w_gate": ((d, "embed"), (f, "mlp")),
            "w_up": ((d, "embed"), (f, "mlp")),
            "w_down": ((f, "mlp"), (d, "embed")),
        }.items():
            lora.adapter(self, name, cfg, rngs, inputs=[fan_in], outputs=[fan_out])
        self.cfg = cfg

    def __call__(self, x, fp8=None):
        return swiglu(x, self.w_gate[...], self.w_up[...], self.w_down[...], self.cfg, fp8, adapters=self)


def swiglu(x, w_gate, w_up, w_down, cfg: ModelConfig, fp8=None, adapters=None):
    """act(x @ w_gate) * (x @ w_up) @ w_down in the compute dtype (fp8: its sites, or None);
    act is silu (SwiGLU) or the tanh approximation of GELU (GeGLU, `model.mlp_activation`).
    `adapters`: the module whose LoRA adapters (models/lora.py) add to the three matmuls."""
    mm = lambda a, w, axes, name: lora.add(
        adapters,
        name,
        a,
        weight_matmul(
            "...d,df->...f", a, matmul_weight(w, axes, cfg), cfg, None if fp8 is None else fp8[name]
        ),
    )
    gate = checkpoint_name(mm(x, w_gate, ("embed", "mlp"), "w_gate"), "mlp_in")
    up = checkpoint_name(mm(x, w_up, ("embed", "mlp"), "w_up"), "mlp_in")
    act = jax.nn.silu if cfg.mlp_activation == "silu" else lambda g: jax.nn.gelu(g, approximate=True)
    h = constrain(act(gate) * up, ("batch", "seq", "act_mlp"))
    return checkpoint_name(mm(h, w_down, ("mlp", "embed"), "w_down"), "mlp_out")

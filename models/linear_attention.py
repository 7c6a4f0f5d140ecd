"""Gated DeltaNet layers (Qwen3.5 / Qwen3.6, Qwen3-Next), the `linear_attention` layers of
`model.layer_types`, on the gated delta rule of models/gated_deltanet.py.

Parameters of one layer (D = d_model; hk, hv key and value heads, dk, dv their widths,
r = hv // hk, K the conv kernel; `model.linear_attention`). Every head dim is the key-head
group: key head j with its r value heads (value head h reads key head h // r), so that heads
split over `tensor` as whole groups and the rule runs on each shard without a collective:

    in_proj_qkv  [D, hk, 2 dk + r dv]  ("embed", "kv_heads", "head_dim")  per group: q, k, its r v heads
    in_proj_z    [D, hk, r dv]         ("embed", "kv_heads", "head_dim")  the norm's gate
    in_proj_b    [D, hk, r]            ("embed", "kv_heads", None)        beta = sigmoid(b)
    in_proj_a    [D, hk, r]            ("embed", "kv_heads", None)        the decay's input
    conv_weight  [hk, 2 dk + r dv, K]  ("kv_heads", "head_dim", None)     depthwise, over q | k | v
    A_log        [hk, r]               ("kv_heads", "bias")               never weight-decayed
    dt_bias      [hk, r]               ("kv_heads", "bias")
    norm         [dv]                  ("norm",)                          plain w (init 1), shared by heads
    out_proj     [hk, r dv, D]         ("kv_heads", "head_dim", "embed")

Hugging Face's Qwen3.5 layout (`in_proj_qkv` rows: every q head, every k head, every v head)
is these rows regrouped (`from_qwen3_5`); Qwen3-Next's through
`gated_deltanet.qwen3_next_projections_as_qwen3_5` first.

LoRA (models/lora.py): `model.lora.targets` names the five projections by these (HF / PEFT)
names; each adapter keeps its weight's layout (in_proj_qkv's b [r, hk, width] is PEFT's
lora_B rows regrouped per key head, as the weight's are: jaxtrain/interchange/peft.py).

The forward is transformers': projections, the causal conv with SiLU, L2-normalised q and k,
g = -exp(A_log) softplus(a + dt_bias), the delta rule in float32 by 64-token chunks
(`chunked_gated_delta_rule`; with `model.linear_attention.impl` pallas the Pallas kernels of
pallas_kernels/gated_delta.py, per shard of batch and key-head groups), the gated RMSNorm with
epsilon `model.norm_eps`, out_proj. Packed documents (`segment_ids`) reset the rule's state
and the conv window at each boundary, so a packed row equals its documents run alone.
Activation checkpoints: the projections are `qkv_proj`, the rule's output `context`, the
output `out_proj` (model.remat).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.models import gated_deltanet as gdn
from jaxtrain.models import lora
from jaxtrain.models.attention import kernel_shards
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.layers import matmul_weight, param, weight_matmul
from jaxtrain.pallas_kernels.gated_delta import sharded_gated_delta_rule
from jaxtrain.pallas_kernels.remat_names import ATTENTION_RESIDUALS
from jaxtrain.sharding import constrain

_GROUP_AXES = ("embed", "kv_heads", "head_dim")
_GATE_AXES = ("embed", "kv_heads", None)
_ACT_AXES = ("batch", "seq", "act_kv_heads", None)
# the decode state (models/generation.py), stacked over layers: heads split as the layer's
CONV_STATE_AXES = ("layers", "batch", None, "act_kv_heads", None)
STATE_AXES = ("layers", "batch", "act_kv_heads", None, None)


class GatedDeltaNet(nnx.Module):
    """One gated DeltaNet layer: x [b, s, D] -> [b, s, D] (the interface of layers.Attention's
    __call__; generation runs `prefill` and `decode` instead of `project` / `output`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        la = cfg.linear_attention
        d, hk, r, dv, kernel = (
            cfg.d_model,
            la.num_key_heads,
            la.values_per_key,
            la.value_head_dim,
            la.conv_kernel,
        )
        width = la.group_width
        p = lambda shape, axes, std: param(rngs, shape, axes, std=std, dtype=cfg.param_dtype)  # noqa: E731
        self.in_proj_qkv = p((d, hk, width), _GROUP_AXES, cfg.init_std)
        self.in_proj_z = p((d, hk, r * dv), _GROUP_AXES, cfg.init_std)
        self.in_proj_b = p((d, hk, r), _GATE_AXES, cfg.init_std)
        self.in_proj_a = p((d, hk, r), _GATE_AXES, cfg.init_std)
        # torch's Conv1d init (uniform over +-1/sqrt(K)) has this std
        self.conv_weight = p((hk, width, kernel), ("kv_heads", "head_dim", None), (3 * kernel) ** -0.5)
        # as transformers: A = uniform(0, 16) (log taken), dt_bias ones
        a = jax.random.uniform(rngs.params(), (hk, r), jnp.float32, 1e-3, 16.0)
        self.A_log = nnx.Param(
            jnp.log(a).astype(cfg.param_dtype), out_sharding=("kv_heads", "bias"), eager_sharding=False
        )
        self.dt_bias = param(rngs, (hk, r), ("kv_heads", "bias"), std=None, dtype=cfg.param_dtype)
        self.norm = param(rngs, (dv,), ("norm",), std=None, dtype=cfg.param_dtype)
        self.out_proj = p(
            (hk, r * dv, d), ("kv_heads", "head_dim", "embed"), cfg.init_std / (2 * cfg.n_layers) ** 0.5
        )
        embed, heads = [(d, "embed")], (hk, "kv_heads")
        for name, out in {
            "in_proj_qkv": [heads, (width, "head_dim")],
            "in_proj_z": [heads, (r * dv, "head_dim")],
            "in_proj_b": [heads, (r, None)],
            "in_proj_a": [heads, (r, None)],
        }.items():
            lora.adapter(self, name, cfg, rngs, inputs=embed, outputs=out)
        lora.adapter(self, "out_proj", cfg, rngs, inputs=[heads, (r * dv, "head_dim")], outputs=embed)
        self.cfg = cfg

    def __call__(self, x, positions, segment_ids, fp8=None):
        """x [b, s, D] (positions unused: no RoPE); `segment_ids` [b, s] or None (one document
        per row). `fp8` must be None (model.fp8 is refused with these layers)."""
        out, _, _ = self._mix(*self._inputs(x), segment_ids=segment_ids)
        return out

    def prefill(self, x, lengths):
        """Right-padded prompts x [b, s, D], row i's first lengths[i] tokens real -> (out
        [b, s, D], the decode state after each row's last real token: (conv_state
        [b, kernel - 1, hk, width] in x's dtype, state [b, hv, dk, dv] float32)). Padding
        tokens neither decay nor write the state (g = beta = 0)."""
        qkv, z, beta_in, a = self._inputs(x)
        b, s = x.shape[:2]
        valid = jnp.arange(s)[None] < lengths[:, None]
        out, _, state = self._mix(qkv, z, beta_in, a, valid=valid)
        # the conv window: the last kernel - 1 real inputs of each row (zeros before its start)
        taps = (
            lengths[:, None]
            - (self.cfg.linear_attention.conv_kernel - 1)
            + jnp.arange(self.cfg.linear_attention.conv_kernel - 1)
        )
        window = jnp.take_along_axis(qkv, jnp.clip(taps, 0, s - 1)[:, :, None, None], axis=1)
        conv_state = jnp.where((taps >= 0)[:, :, None, None], window, 0).astype(qkv.dtype)
        return out, (constrain(conv_state, CONV_STATE_AXES[1:]), constrain(state, STATE_AXES[1:]))

    def decode(self, x, conv_state, state):
        """One token per row x [b, 1, D] after `prefill`'s (or the last decode's) state ->
        (out [b, 1, D], the next (conv_state, state)): the rule's recurrence for one token."""
        b = x.shape[0]
        flat = conv_state.reshape(b, conv_state.shape[1], -1)
        out, conv_state, state = self._mix(*self._inputs(x), conv_state=flat, state=state, recurrent=True)
        conv_state = conv_state.reshape(b, -1, self.cfg.linear_attention.num_key_heads, self._width)
        return out, (constrain(conv_state, CONV_STATE_AXES[1:]), constrain(state, STATE_AXES[1:]))

    @property
    def _width(self) -> int:
        return self.cfg.linear_attention.group_width

    def _inputs(self, x):
        """x [b, s, D] -> the projections: qkv [b, s, hk, width] (before the conv), z
        [b, s, hv, dv], beta's and the decay's inputs [b, s, hv]."""
        cfg, la = self.cfg, self.cfg.linear_attention
        b, s, _ = x.shape
        hv, dv = la.num_value_heads, la.value_head_dim

        def project(name, axes):
            w = getattr(self, name)[...]
            y = weight_matmul("bsd,dhc->bshc", x, matmul_weight(w, axes, cfg), cfg, None)
            return checkpoint_name(constrain(lora.add(self, name, x, y), _ACT_AXES), "qkv_proj")

        qkv = project("in_proj_qkv", _GROUP_AXES)
        z = project("in_proj_z", _GROUP_AXES).reshape(b, s, hv, dv)
        beta_in = project("in_proj_b", _GATE_AXES).reshape(b, s, hv)
        a = project("in_proj_a", _GATE_AXES).reshape(b, s, hv)
        return qkv, z, beta_in, a

    def _mix(
        self,
        qkv,
        z,
        beta_in,
        a,
        *,
        segment_ids=None,
        conv_state=None,
        state=None,
        valid=None,
        recurrent=False,
    ):
        """The conv, the gated delta rule (by chunks, or token by token when `recurrent`) from
        `state`, the gated norm and out_proj -> (out [b, s, D], the conv state [b, kernel - 1,
        channels], the rule's final state). `valid` [b, s]: False tokens leave the state as it is."""
        cfg, la = self.cfg, self.cfg.linear_attention
        b, s = qkv.shape[:2]
        hk, hv, r = la.num_key_heads, la.num_value_heads, la.values_per_key
        dk, dv = la.key_head_dim, la.value_head_dim
        conv_w = self.conv_weight[...].astype(qkv.dtype)
        mixed, conv_state = gdn.causal_conv1d(
            qkv.reshape(b, s, -1),
            conv_w.reshape(-1, conv_w.shape[-1]),
            segment_ids=segment_ids,
            conv_state=conv_state,
        )
        mixed = mixed.reshape(b, s, hk, -1)
        q, k = mixed[..., :dk], mixed[..., dk : 2 * dk]
        v = mixed[..., 2 * dk :].reshape(b, s, hv, dv)  # value head j * r + i of key head j
        g, beta = gdn.decay_and_beta(a, beta_in, self.A_log[...].reshape(hv), self.dt_bias[...].reshape(hv))
        if valid is not None:
            g, beta = jnp.where(valid[..., None], g, 0), jnp.where(valid[..., None], beta, 0)
        if recurrent:
            rule = gdn.recurrent_gated_delta_rule
        elif la.impl == "pallas":  # the Pallas kernels per shard, heads split as _ACT_AXES's
            mesh, batch_axes, head_axes = kernel_shards(q, heads=_ACT_AXES[2])
            rule = functools.partial(
                sharded_gated_delta_rule, mesh=mesh, batch_axes=batch_axes, head_axes=head_axes
            )
        else:  # xla, and auto (resolved by planning/resolve.py; a model built directly runs xla)
            rule = gdn.chunked_gated_delta_rule
        core, state = rule(q, k, v, g, beta, initial_state=state, segment_ids=segment_ids)
        core = checkpoint_name(core, ATTENTION_RESIDUALS)
        out = gdn.gated_rms_norm(core, z, self.norm[...].astype(core.dtype), eps=cfg.norm_eps)
        out = constrain(out.reshape(b, s, hk, r * dv), _ACT_AXES)
        wo = matmul_weight(self.out_proj[...], ("kv_heads", "head_dim", "embed"), cfg)
        y = lora.add(self, "out_proj", out, weight_matmul("bshc,hcd->bsd", out, wo, cfg, None))
        out = checkpoint_name(y, "out_proj")
        return out, conv_state, state


def state_shapes(cfg: ModelConfig, layers: int, batch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The decode state generation keeps for `layers` such layers: the conv window
    [layers, batch, kernel - 1, hk, width] (compute dtype) and the rule's state
    [layers, batch, hv, dk, dv] (float32). Neither grows with the sequence."""
    la = cfg.linear_attention
    conv = (layers, batch, la.conv_kernel - 1, la.num_key_heads, la.group_width)
    return conv, (layers, batch, la.num_value_heads, la.key_head_dim, la.value_head_dim)


# our parameter -> its tensor in a Hugging Face Qwen3.5 `linear_attn` module
QWEN3_5_NAMES = {
    "in_proj_qkv": "in_proj_qkv.weight",
    "in_proj_z": "in_proj_z.weight",
    "in_proj_b": "in_proj_b.weight",
    "in_proj_a": "in_proj_a.weight",
    "conv_weight": "conv1d.weight",
    "A_log": "A_log",
    "dt_bias": "dt_bias",
    "norm": "norm.weight",
    "out_proj": "out_proj.weight",
}


# Qwen3-Next's fused tensors (rows per key-head group: q, k, v, z; and b, a) -> ours, in order
QWEN3_NEXT_FUSED = {
    "in_proj_qkvz.weight": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba.weight": ("in_proj_b", "in_proj_a"),
}


def qwen3_next_fused(hf_name: str) -> str | None:
    """The QWEN3_NEXT_FUSED key a full HF tensor name ends with (`...linear_attn.in_proj_ba.weight`
    -> `in_proj_ba.weight`), or None."""
    return next((t for t in QWEN3_NEXT_FUSED if hf_name.endswith("." + t)), None)


def qwen3_next_rows(theirs: str, cfg: ModelConfig) -> int:
    """Rows of a Qwen3-Next fused tensor (QWEN3_NEXT_FUSED's keys)."""
    la = cfg.linear_attention
    if theirs == "in_proj_qkvz.weight":
        return la.num_key_heads * (la.group_width + la.values_per_key * la.value_head_dim)
    return 2 * la.num_value_heads


def qwen3_next_split(theirs: str, w: np.ndarray, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """A Qwen3-Next fused tensor [rows, D] -> our parameters by name: each key head's rows
    are its group's (q | k | v, then z; b, then a), so a split per group is our layout."""
    la, d = cfg.linear_attention, w.shape[-1]
    first, second = QWEN3_NEXT_FUSED[theirs]
    groups = w.reshape(la.num_key_heads, -1, d)
    cut = la.group_width if theirs == "in_proj_qkvz.weight" else la.values_per_key
    return {first: np.moveaxis(groups[:, :cut], -1, 0), second: np.moveaxis(groups[:, cut:], -1, 0)}


def qwen3_next_join(theirs: str, parts: dict[str, np.ndarray]) -> np.ndarray:
    """`qwen3_next_split`'s inverse: our two parameters [D, hk, ...] -> the fused [rows, D]."""
    first, second = (np.moveaxis(parts[n], 0, -1) for n in QWEN3_NEXT_FUSED[theirs])
    joined = np.concatenate([first, second], axis=1)
    return joined.reshape(-1, joined.shape[-1])


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape in one layer (module docstring)."""
    la, d = cfg.linear_attention, cfg.d_model
    hk, r, dv = la.num_key_heads, la.values_per_key, la.value_head_dim
    return {
        "in_proj_qkv": (d, hk, la.group_width),
        "in_proj_z": (d, hk, r * dv),
        "in_proj_b": (d, hk, r),
        "in_proj_a": (d, hk, r),
        "conv_weight": (hk, la.group_width, la.conv_kernel),
        "A_log": (hk, r),
        "dt_bias": (hk, r),
        "norm": (dv,),
        "out_proj": (hk, r * dv, d),
    }


def _grouped(rows: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """[2 hk dk + hv dv, ...] (every q head, every k head, every v head) -> [hk, width, ...]."""
    la = cfg.linear_attention
    hk, dk = la.num_key_heads, la.key_head_dim
    q, k, v = np.split(rows, [hk * dk, 2 * hk * dk])
    per = lambda t: t.reshape(hk, -1, *rows.shape[1:])  # noqa: E731
    return np.concatenate([per(q), per(k), per(v)], axis=1)


def _ungrouped(groups: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """`_grouped`'s inverse: [hk, width, ...] -> [2 hk dk + hv dv, ...]."""
    dk = cfg.linear_attention.key_head_dim
    q, k, v = np.split(groups, [dk, 2 * dk], axis=1)
    flat = lambda t: t.reshape(-1, *groups.shape[2:])  # noqa: E731
    return np.concatenate([flat(q), flat(k), flat(v)])


def qwen3_5_tensor_to_ours(name: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Our parameter `name` (a key of QWEN3_5_NAMES) from its Hugging Face tensor (torch's
    [out, in] for the projections, conv1d [channels, 1, K]): the same values regrouped per
    key head (module docstring)."""
    shape = param_shapes(cfg)[name]
    if name == "in_proj_qkv":
        return np.moveaxis(_grouped(w, cfg), -1, 0)
    if name == "conv_weight":
        return _grouped(w[:, 0], cfg)
    if name in ("in_proj_z", "in_proj_b", "in_proj_a"):
        return w.T.reshape(shape)
    if name == "out_proj":
        return w.T.reshape(shape)
    return w.reshape(shape)  # A_log, dt_bias [hv] -> [hk, r]; norm [dv]


def qwen3_5_tensor_to_hf(name: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """`qwen3_5_tensor_to_ours`' inverse."""
    if name == "in_proj_qkv":
        return _ungrouped(np.moveaxis(w, 0, -1), cfg)
    if name == "conv_weight":
        return _ungrouped(w, cfg)[:, None, :]
    if name in ("in_proj_z", "in_proj_b", "in_proj_a"):
        return w.reshape(w.shape[0], -1).T
    if name == "out_proj":
        return w.reshape(-1, w.shape[-1]).T
    return w.reshape(-1)


def from_qwen3_5(weights: dict, cfg: ModelConfig) -> dict:
    """A Hugging Face Qwen3.5 gated-DeltaNet layer's tensors (`in_proj_qkv.weight`,
    `in_proj_z.weight`, `in_proj_b.weight`, `in_proj_a.weight`, `conv1d.weight`, `A_log`,
    `dt_bias`, `norm.weight`, `out_proj.weight`; torch's [out, in]) -> this module's parameters
    by name (numpy, float32): the same values regrouped per key head (module docstring)."""
    la = cfg.linear_attention
    w = {k: np.asarray(v, np.float32) for k, v in weights.items()}
    expected = {
        "in_proj_qkv.weight": (la.num_key_heads * la.group_width, cfg.d_model),
        "out_proj.weight": (cfg.d_model, la.num_value_heads * la.value_head_dim),
    }
    for key, shape in expected.items():
        if w[key].shape != shape:
            raise ValueError(f"{key} {w[key].shape}: expected {shape} for model.linear_attention {la}")
    return {ours: qwen3_5_tensor_to_ours(ours, w[theirs], cfg) for ours, theirs in QWEN3_5_NAMES.items()}

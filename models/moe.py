"""Mixture-of-experts feed-forward (GShard / Switch / Mixtral / DeepSeek-MoE).

Parameters of one MoE layer (stacked on a leading `layers` axis in the model;
E experts, D = d_model, F = expert_mlp_dim), the layout HF conversion relies on:

    w_router    [D, E]     ("embed", None)            router logits = x @ w_router
    router_bias [E]        ("bias",)                   only with moe.score_bias (not trained by gradients)
    b_router    [E]        ("bias",)                   only with moe.router_logit_bias (trained): logits + it
    b_gate, b_up [E, F]    ("expert", "bias")          only with moe.expert_bias: added after x @ w_gate[e],
    b_down      [E, D]     ("expert", "bias")            x @ w_up[e] and h @ w_down[e] (GPT-OSS)
    w_gate      [E, D, F]  ("expert", "embed", "mlp")  expert e: silu(x @ w_gate[e]) * (x @ w_up[e])
                                                        @ w_down[e]
    w_up        [E, D, F]  ("expert", "embed", "mlp")
    w_down      [E, F, D]  ("expert", "mlp", "embed")
    shared_gate [D, S*F], shared_up [D, S*F], shared_down [S*F, D]   only with S = num_shared_experts > 0
                (S always-on experts fused into one SwiGLU of width S*F; output added to the routed one)

Routing (per token, router in f32): scores = softmax(logits) or sigmoid(logits)
(logits + b_router with moe.router_logit_bias); the top_k experts are chosen by
scores (+ router_bias, selection only), with num_groups > 1 among the top_k_groups
groups whose two best such scores sum highest (DeepSeek-V3); their weights are the
chosen (unbiased) scores, renormalised to sum to 1 if normalize_top_k (softmax: the
softmax of the chosen logits, GPT-OSS's router), times routed_scaling_factor.

Experts: silu(gate) * up (SwiGLU), or with moe.expert_activation clamped_swiglu
GPT-OSS's (up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit.
A token's output is sum_k weight_k * expert_k(x), the down bias inside expert_k.

Losses (global over the batch, whatever the mesh):
  load-balancing (Switch): E * sum_e f_e * P_e, f_e = share of the T*k assignments
      routed to e, P_e = mean router probability of e (sigmoid scores normalised
      per token); exactly 1.0 when balanced;
  z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2.

Dispatch:
  capacity  GShard: groups are sequences (mesh-independent), each expert takes
            C = ceil(k * seq * capacity_factor / E) assignments per sequence, first
            choices of all tokens before second choices, in token order; the rest
            are dropped (their output is 0, the residual passes them on);
            dispatch/combine are one-hot einsums.
  dropless  assignments sorted by expert, one grouped matmul per weight:
            `jax.lax.ragged_dot`, or on TPU JAX's Pallas megablox kernels (gmm
            forward, gmm + tgmm backward, with their cost estimates), as MaxText,
            or on GPU our Pallas Triton kernel or JAX's Mosaic GPU (Hopper) ones
            (moe.grouped_matmul, resolved by jaxtrain: auto picks megablox on TPU,
            the measured GPU choice on GPU, ragged_dot on CPU). The rows are sorted
            and un-sorted by permutation gathers whose backward passes are gathers too
            (sort_rows, unsort_rows), not autodiff's scatter-adds.

Expert parallelism: with a mesh set (`jax.set_mesh` + `sharding.axis_rules`) the
layer runs in `jax.shard_map`: tokens stay sharded on their batch axes, experts
are sharded on the mesh axes the rules give logical "expert" (and "mlp" over
tensor: Megatron-style, psum after w_down). They enter the shard_map as stored,
d_model split over fsdp, and are all-gathered inside it, so that their gradients
leave as a reduce-scatter (the gather's transpose). Tokens travel to their experts'
devices with `all_to_all`; dropless uses a padded all_to_all (every source sends a
[A, D] buffer to every expert shard, A = its local assignments: no drops,
ep x the memory) or `ragged_all_to_all` (exchange=ragged; TPU/GPU only,
unimplemented on XLA:CPU). exchange=auto (resolved by jaxtrain): ragged on TPU/GPU,
padded on CPU.
Each shard receives into a buffer of R rows (`receive_rows`): ep x A by default,
which cannot overflow, and over which the grouped matmul is sized (XLA costs
ragged_dot over the whole buffer); with moe.receive_factor f, R = ceil(f x A).
A shard then keeps a prefix of what it is sent (sources in mesh order, each
source's rows by local expert) and drops the rest, as MaxText's
ragged_buffer_factor; both exchanges keep the same rows.
With moe.dispatch_per_shard (`dispatch_per_shard`: auto where it sends fewer rows) a token
goes instead once to each expert shard holding one of its experts, with their ids and
weights; the shard combines their weighted outputs into one row back (DeepSeek-V3's
node-limited dispatch: with its groups on shards, at most top_k_groups rows a token), and
receives into ep x T rows, T = a source's tokens, which cannot overflow
(`_per_shard_exchange`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxtrain import sharding
from jaxtrain.models import fp8 as fp8_ops
from jaxtrain.models import lora
from jaxtrain.models.blocks import attention_layer
from jaxtrain.models.config import ModelConfig, MoEConfig
from jaxtrain.models.layers import (
    REGION_INPUT_AXES,
    RESIDUAL_AXES,
    RMSNorm,
    norm_after,
    norm_before,
    param,
    swiglu,
)
from jaxtrain.pallas_kernels.grouped_matmul import megablox_grouped_matmul
from jaxtrain.pallas_kernels.grouped_matmul_gpu import triton_grouped_matmul
from jaxtrain.pallas_kernels.grouped_matmul_mgpu import mosaic_grouped_matmul

F32 = jnp.float32


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        m = cfg.moe
        d, f, e = cfg.d_model, m.mlp_dim(cfg), m.num_experts
        p = lambda shape, axes, std: param(rngs, shape, axes, std=std, dtype=cfg.param_dtype)
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.w_router = p((d, e), ("embed", None), cfg.init_std)
        if m.score_bias:
            self.router_bias = nnx.Param(
                jnp.zeros((e,), cfg.param_dtype), out_sharding=("bias",), eager_sharding=False
            )
        if m.router_logit_bias:
            self.b_router = p((e,), ("bias",), 0)
        if m.expert_bias:
            self.b_gate = p((e, f), ("expert", "bias"), 0)
            self.b_up = p((e, f), ("expert", "bias"), 0)
            self.b_down = p((e, d), ("expert", "bias"), 0)
        self.w_gate = p((e, d, f), ("expert", "embed", "mlp"), cfg.init_std)
        self.w_up = p((e, d, f), ("expert", "embed", "mlp"), cfg.init_std)
        self.w_down = p((e, f, d), ("expert", "mlp", "embed"), out_std)
        for name, (fan_in, fan_out) in {
            "w_gate": ((d, "embed"), (f, "mlp")),
            "w_up": ((d, "embed"), (f, "mlp")),
            "w_down": ((f, "mlp"), (d, "embed")),
        }.items():  # one adapter per expert, folded into its weight (models/lora.py)
            lora.adapter(self, name, cfg, rngs, inputs=[fan_in], outputs=[fan_out], lead=[(e, "expert")])
        if m.num_shared_experts:
            fs = m.shared_mlp_dim(cfg)
            self.shared_gate = p((d, fs), ("embed", "mlp"), cfg.init_std)
            self.shared_up = p((d, fs), ("embed", "mlp"), cfg.init_std)
            self.shared_down = p((fs, d), ("mlp", "embed"), out_std)
        if m.shared_expert_gate:  # a logit per token for the shared experts' sigmoid scale
            self.shared_expert_gate = p((d,), ("embed",), cfg.init_std)
        self.moe = m
        self.cfg = cfg
        self.dtype = jnp.dtype(cfg.compute_dtype)

    def __call__(self, x: jax.Array, fp8=None) -> tuple[jax.Array, dict]:
        """x [b, s, d] -> (y [b, s, d], per-layer stats: see `moe_layer`). `fp8`: this
        layer's fp8 state ({"experts": ..., "shared": ...}; models/fp8.py) or None."""
        dt = self.dtype
        bias = self.router_bias[...] if self.moe.score_bias else None
        extras = {}
        if self.moe.router_logit_bias:
            extras["logit_bias"] = self.b_router[...]
        if self.moe.expert_bias:
            extras["expert_biases"] = tuple(b[...].astype(dt) for b in (self.b_gate, self.b_up, self.b_down))
        y, stats = moe_layer(
            x,
            self.w_router[...],
            bias,
            lora.effective_weight(self, "w_gate", self.w_gate[...]).astype(dt),
            lora.effective_weight(self, "w_up", self.w_up[...]).astype(dt),
            lora.effective_weight(self, "w_down", self.w_down[...]).astype(dt),
            self.moe,
            fp8=None if fp8 is None else fp8["experts"],
            **extras,
        )
        if self.moe.num_shared_experts:
            shared = None if fp8 is None else fp8["shared"]
            y_shared = swiglu(
                x, self.shared_gate[...], self.shared_up[...], self.shared_down[...], self.cfg, shared
            )
            if self.moe.shared_expert_gate:
                logit = jnp.einsum("bsd,d->bs", x, self.shared_expert_gate[...].astype(x.dtype))
                y_shared = jax.nn.sigmoid(logit)[..., None].astype(y_shared.dtype) * y_shared
            y = y + y_shared
        return y, stats


class MoEBlock(nnx.Module):
    """A decoder block (as blocks.Block) whose feed-forward is MoE; returns (x, stats).
    `kind`: the layer's kind in `model.attention_pattern` (None without one)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, kind: str | None = None):
        self.attn_norm = RMSNorm(cfg, rngs=rngs)
        self.attn = attention_layer(cfg, rngs=rngs, kind=kind)
        self.mlp_norm = RMSNorm(cfg, rngs=rngs)
        self.mlp = MoE(cfg, rngs=rngs)

    def __call__(self, x, positions, segment_ids, fp8=None):
        cfg = self.attn.cfg
        x = checkpoint_name(x, "layer_input")
        h = sharding.constrain(norm_before(self.attn_norm, x, cfg), REGION_INPUT_AXES)
        h = self.attn(h, positions, segment_ids, None if fp8 is None else fp8["attn"])
        x = sharding.constrain(x + norm_after(self.attn_norm, h, cfg), RESIDUAL_AXES)
        y, stats = self.mlp(norm_before(self.mlp_norm, x, cfg), None if fp8 is None else fp8["mlp"])
        return sharding.constrain(x + norm_after(self.mlp_norm, y, cfg), RESIDUAL_AXES), stats


# --- the layer as a function -----------------------------------------------------


def capacity(seq_len: int, m: MoEConfig) -> int:
    """Slots per expert per sequence (capacity dispatch)."""
    return max(1, math.ceil(m.top_k * seq_len * m.capacity_factor / m.num_experts))


def route(x, w_router, bias, m: MoEConfig, logit_bias=None):
    """-> (logits f32 [..., E], scores [..., E], top-k expert ids [..., k], their weights f32 [..., k]).
    `bias`: the selection-only score bias (moe.score_bias); `logit_bias`: the trained bias on
    the logits (moe.router_logit_bias), or None."""
    logits = jnp.einsum("...d,de->...e", x.astype(F32), w_router.astype(F32))
    if logit_bias is not None:
        logits = logits + logit_bias.astype(F32)
    scores = jax.nn.softmax(logits, axis=-1) if m.scoring == "softmax" else jax.nn.sigmoid(logits)
    select = scores if bias is None else scores + jax.lax.stop_gradient(bias.astype(F32))
    if m.num_groups > 1:
        select = _group_limited(select, m)
    _, idx = jax.lax.top_k(select, m.top_k)
    # the routing decisions ("routing": these ids, dropless's sort orders) are kept by every
    # remat policy but full, a few bytes per token: redone, the backward would repeat the top-k
    # and the sorts, slow on GPUs
    idx = checkpoint_name(idx, "routing")
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if m.normalize_top_k:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if m.routed_scaling_factor != 1.0:
        weights = weights * m.routed_scaling_factor
    return logits, scores, idx, weights


def _group_limited(select, m: MoEConfig):
    """Selection scores [..., E] with the experts outside each token's top_k_groups groups at
    -inf; a group's score is the sum of its two best selection scores (DeepSeek-V3)."""
    groups = select.reshape(*select.shape[:-1], m.num_groups, m.num_experts // m.num_groups)
    group_scores = jnp.sum(jax.lax.top_k(groups, 2)[0], axis=-1)  # [..., G]
    _, best = jax.lax.top_k(group_scores, m.top_k_groups)
    chosen = jnp.any(best[..., None] == jnp.arange(m.num_groups), axis=-2)  # [..., G]
    return jnp.where(chosen[..., None], groups, -jnp.inf).reshape(select.shape)


def _fp8_site(fp8, name):
    """(meta of expert matmul `name`, the mesh axes to reduce its amax over), or (None, ())."""
    return (None, ()) if fp8 is None else (fp8[0][name], fp8[1])


def expert_activation(gate, up, m: MoEConfig):
    """The experts' gated activation (moe.expert_activation): silu(gate) * up, or GPT-OSS's
    clamped SwiGLU (up + 1) * gate * sigmoid(alpha * gate), the gate clamped above at
    `swiglu_limit` and up to [-limit, limit] (HF's GptOssExperts._apply_gate)."""
    if m.expert_activation == "clamped_swiglu":
        limit = m.swiglu_limit
        gate = jnp.minimum(gate, jnp.asarray(limit, gate.dtype))
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * gate * jax.nn.sigmoid(gate * jnp.asarray(m.swiglu_alpha, gate.dtype))
    return jax.nn.silu(gate) * up


def _swiglu(x, w_gate, w_up, w_down, eq_in: str, eq_out: str, fp8=None, m=None, in_biases=None):
    """Capacity dispatch's experts on slots [E, ..., D] -> [E, ..., D] (the down projection
    without its bias, which the caller adds once the tensor shards are summed). `in_biases`:
    (b_gate, b_up) [E, F] or None."""
    mm = lambda eq, a, w, name: fp8_ops.expert_matmul(
        lambda a, w: jnp.einsum(eq, a, w), a, w, *_fp8_site(fp8, name)
    )
    gate = mm(eq_in, x, w_gate, "w_gate")
    up = mm(eq_in, x, w_up, "w_up")
    if in_biases is not None:  # broadcast each expert's bias over its slots
        lead = (slice(None),) + (None,) * (gate.ndim - 2)
        gate, up = gate + in_biases[0][lead], up + in_biases[1][lead]
    gate, up = checkpoint_name(gate, "mlp_in"), checkpoint_name(up, "mlp_in")
    act = jax.nn.silu(gate) * up if m is None else expert_activation(gate, up, m)
    return mm(eq_out, act, w_down, "w_down")


def grouped_matmul(a, w, group_sizes, impl: str, *, full: bool = False):
    """a [m, k] rows sorted by group, w [groups, k, n], group_sizes [groups] int32 -> [m, n]:
    row i through its group's w; rows past sum(group_sizes) are zero, and so are their
    gradients. impl: "ragged_dot" (XLA's) | "megablox" (JAX's Pallas TPU kernels,
    pallas_kernels/grouped_matmul.py) | "triton" (our Pallas Triton kernel,
    grouped_matmul_gpu.py) | "mosaic" (JAX's Mosaic GPU kernels, grouped_matmul_mgpu.py).
    `full`: the caller knows every row is in a group (no padding to mask)."""
    if impl in _GROUPED_KERNELS:
        return _GROUPED_KERNELS[impl](a, w, group_sizes, full=full)
    return jax.lax.ragged_dot(a, w, group_sizes)


_GROUPED_KERNELS = {
    "megablox": megablox_grouped_matmul,
    "triton": triton_grouped_matmul,
    "mosaic": mosaic_grouped_matmul,
}


def grouped_matmul_impl(m: MoEConfig, fp8=None) -> str:
    """The grouped matmul a layer runs: model.moe.grouped_matmul as resolved (jaxtrain
    resolves `auto` per platform in planning/resolve.py; a model built with `auto` runs
    ragged_dot); fp8 experts always ragged_dot (quantize-dequantize around it)."""
    return m.grouped_matmul if fp8 is None and m.grouped_matmul in _GROUPED_KERNELS else "ragged_dot"


def _ragged_swiglu(
    x, w_gate, w_up, w_down, group_sizes, fp8=None, impl="ragged_dot", full=False, m=None, in_biases=None
):
    """fp8: (this layer's expert sites, the shard_map's mesh axes) or None; impl and full:
    grouped_matmul's; m: the MoE config (its expert activation; None: silu); in_biases: the
    gate and up biases of each row's expert, (b_gate, b_up) [rows, F], or None. The down
    projection's bias is the caller's (after any sum over tensor shards)."""
    rd = lambda a, w, name: fp8_ops.expert_matmul(
        lambda a, w: grouped_matmul(a, w, group_sizes, impl, full=full), a, w, *_fp8_site(fp8, name)
    )
    if fp8 is None:
        # gate and up as one grouped matmul over [w_gate | w_up]: one kernel instead of two in
        # the forward, in dA (which then sums both products in the kernel's f32 accumulator) and
        # in dW; the concatenation fuses with the weights' cast to bf16, the slices with SwiGLU
        f = w_gate.shape[-1]
        gate_up = grouped_matmul(x, jnp.concatenate([w_gate, w_up], axis=-1), group_sizes, impl, full=full)
        gate, up = gate_up[:, :f], gate_up[:, f:]
    else:  # each weight has its own fp8 scale
        gate, up = rd(x, w_gate, "w_gate"), rd(x, w_up, "w_up")
    if in_biases is not None:
        gate, up = gate + in_biases[0], up + in_biases[1]
    gate, up = checkpoint_name(gate, "mlp_in"), checkpoint_name(up, "mlp_in")
    act = jax.nn.silu(gate) * up if m is None else expert_activation(gate, up, m)
    return rd(act, w_down, "w_down")


def _row_biases(expert_biases, row_expert):
    """Each row's expert's (gate, up) and down biases from expert_biases (b_gate, b_up
    [E, F], b_down [E, D]) and row_expert int [rows] (ids past E: padding rows, clamped; their
    outputs are never read): ((gate, up) [rows, F], down [rows, D]), or (None, None)."""
    if expert_biases is None:
        return None, None
    b_gate, b_up, b_down = (_take_rows(b, row_expert, unique=False) for b in expert_biases)
    return (b_gate, b_up), b_down


def _capacity_positions(idx, m: MoEConfig, cap: int):
    """Slot of each assignment in its expert's queue [b, s, k] and whether it fits.
    Priority: all first choices (in token order), then all second choices, ..."""
    b, s, k = idx.shape
    onehot = jax.nn.one_hot(idx, m.num_experts, dtype=jnp.int32)  # [b, s, k, E]
    flat = onehot.transpose(0, 2, 1, 3).reshape(b, k * s, m.num_experts)  # k-major order
    pos = jnp.sum((jnp.cumsum(flat, axis=1) - 1) * flat, axis=-1)  # [b, k*s]
    pos = pos.reshape(b, k, s).transpose(0, 2, 1)
    return pos, pos < cap


# --- expert-sorted rows with gather-only backward passes ------------------------------
# Autodiff transposes a row gather into a scatter-add, which GPUs run with atomics (on an
# H100 the two here were ~10% of a dropless MoE step). The gathers below follow a
# permutation, so each backward is a gather too, by the inverse permutation.


def _take_rows(a, idx, *, unique: bool):
    """a[idx] along axis 0 for indices known to be in bounds: a clamping gather, without the
    negative-index wrap of `a[idx]` (a comparison with a constant, which the custom VJP rules
    below would have to mark varying over the manual axes of a pipeline stage by hand)."""
    return jnp.take(a, idx, axis=0, mode="clip", unique_indices=unique)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def sort_rows(x, order, inverse, k: int):
    """Token rows x [T, d] -> their assignments' rows x[order // k] [T*k, d] in `order`:
    each token row k times (assignment t*k + i is token t's i-th choice), the assignments
    permuted by `order` (int [T*k], a permutation; `inverse` = argsort(order) its inverse).

    Backward without a scatter-add: assignment j's gradient row sits at inverse[j] of the
    sorted rows, so dx = dxs[inverse] summed over each token's k rows (in float32, then
    cast to x.dtype)."""
    return _take_rows(x, order // k, unique=k == 1)


def _sort_rows_fwd(x, order, inverse, k):
    return _take_rows(x, order // k, unique=k == 1), inverse


def _sort_rows_bwd(k, inverse, g):
    g = _take_rows(g, inverse, unique=True)  # [T*k, d] in assignment order
    if k > 1:
        g = jnp.sum(g.reshape(-1, k, g.shape[-1]).astype(F32), axis=1).astype(g.dtype)
    return g, None, None


sort_rows.defvjp(_sort_rows_fwd, _sort_rows_bwd)


@jax.custom_vjp
def unsort_rows(rows, order, inverse):
    """Expert-sorted rows [A, d] -> rows[inverse] [A, d], back in assignment order
    (`order` int [A] the permutation sort_rows applied, `inverse` = argsort(order)).

    Backward without a scatter-add: the inverse permutation's gather, d_rows = d_out[order]."""
    return _take_rows(rows, inverse, unique=True)


def _unsort_rows_fwd(rows, order, inverse):
    return _take_rows(rows, inverse, unique=True), order


def _unsort_rows_bwd(order, g):
    return _take_rows(g, order, unique=True), None, None


unsort_rows.defvjp(_unsort_rows_fwd, _unsort_rows_bwd)


def _local_moe(
    x,
    w_router,
    bias,
    w_gate,
    w_up,
    w_down,
    *,
    m: MoEConfig,
    batch_axes,
    expert_axes,
    tensor_axes,
    exchange: str,
    grouped: str,
    fp8=None,
    logit_bias=None,
    expert_biases=None,
):
    """The layer on this device's tokens x [b, s, d] (all of them without a mesh).
    exchange, grouped: exchange_impl's and grouped_matmul_impl's answers.
    fp8: (the expert sites' fp8 state, the mesh axes of the shard_map) or None.
    logit_bias [E], expert_biases (b_gate, b_up [E local, F local], b_down [E local, D]): as
    moe_layer's."""
    b, s, d = x.shape
    E, k = m.num_experts, m.top_k
    ep = 1 if not expert_axes else jax.lax.axis_size(expert_axes)
    psum = lambda v, axes: jax.lax.psum(v, axes) if axes else v
    logits, scores, idx, weights = route(x, w_router, bias, m, logit_bias)

    # Global statistics: sums over this shard, then over the batch axes.
    counts = jnp.sum(jax.nn.one_hot(idx, E, dtype=F32), axis=(0, 1, 2))  # [E] assignments
    probs = scores if m.scoring == "softmax" else scores / jnp.sum(scores, -1, keepdims=True)
    sums = dict(
        counts=counts,
        probs=jnp.sum(probs, axis=(0, 1)),
        z=jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2),
        tokens=jnp.asarray(b * s, F32),
    )

    if m.dispatch == "capacity":
        cap = capacity(s, m)
        pos, keep = _capacity_positions(idx, m, cap)
        slot = jax.nn.one_hot(jnp.where(keep, pos, cap), cap, dtype=F32)  # dropped: all-zero row
        expert = jax.nn.one_hot(idx, E, dtype=F32)
        dispatch = jnp.einsum("bske,bskc->bsec", expert, slot)
        combine = jnp.einsum("bske,bskc,bsk->bsec", expert, slot, weights)
        xin = jnp.einsum("bsec,bsd->ebcd", dispatch.astype(x.dtype), x)  # [E, b, cap, d]
        if ep > 1:  # send expert e's slots to the device holding e; receive all sources' slots
            xin = jax.lax.all_to_all(xin, expert_axes, 0, 1, tiled=True)  # [E/ep, ep*b, cap, d]
        in_biases = None if expert_biases is None else expert_biases[:2]
        out = _swiglu(xin, w_gate, w_up, w_down, "ebcd,edf->ebcf", "ebcf,efd->ebcd", fp8, m, in_biases)
        out = psum(out, tensor_axes)
        if expert_biases is not None:  # empty slots get it too; their combine weight is 0
            out = out + expert_biases[2][:, None, None, :]
        if ep > 1:
            out = jax.lax.all_to_all(out, expert_axes, 1, 0, tiled=True)  # [E, b, cap, d]
        out = checkpoint_name(out, "mlp_out")  # the combine weights' gradient needs it
        y = jnp.einsum("bsec,ebcd->bsd", combine.astype(x.dtype), out)
        sums["dropped"] = jnp.sum(1.0 - keep.astype(F32))
    elif ep > 1 and dispatch_per_shard(m, ep):
        y = _per_shard_exchange(
            x.reshape(b * s, d),
            idx.reshape(b * s, k),
            weights.reshape(b * s, k),
            w_gate,
            w_up,
            w_down,
            ep=ep,
            expert_axes=expert_axes,
            tensor_axes=tensor_axes,
            exchange=exchange,
            fp8=fp8,
            impl=grouped,
            m=m,
            expert_biases=expert_biases,
        ).reshape(b, s, d)
        sums["dropped"] = jnp.zeros((), F32)  # every shard receives every row it is sent
    else:
        a = b * s * k
        flat_e = idx.reshape(a)
        order = checkpoint_name(jnp.argsort(flat_e, stable=True), "routing")  # assignments by expert
        inverse = checkpoint_name(jnp.argsort(order), "routing")  # where each one sits in that order
        xs = sort_rows(x.reshape(b * s, d), order, inverse, k)
        group_sizes = counts.astype(jnp.int32)
        if ep == 1:
            in_biases, down_bias = _row_biases(expert_biases, flat_e[order])
            out = _ragged_swiglu(
                xs, w_gate, w_up, w_down, group_sizes, fp8, grouped, full=True, m=m, in_biases=in_biases
            )
            out = psum(out, tensor_axes)
            if down_bias is not None:
                out = out + down_bias
            dropped = jnp.zeros((), jnp.int32)
        else:
            out, dropped = _dropless_exchange(
                xs,
                flat_e[order],
                group_sizes,
                w_gate,
                w_up,
                w_down,
                ep=ep,
                expert_axes=expert_axes,
                tensor_axes=tensor_axes,
                exchange=exchange,
                rows=receive_rows(a, ep, m),
                fp8=fp8,
                impl=grouped,
                m=m,
                expert_biases=expert_biases,
            )
        # The expert outputs, in token order: the router weights' gradient needs them, so a
        # policy that keeps "mlp_out" spares the backward the w_down matmul (and this gather).
        out = checkpoint_name(unsort_rows(out, order, inverse).reshape(b, s, k, d), "mlp_out")
        y = jnp.einsum("bskd,bsk->bsd", out, weights.astype(x.dtype))
        sums["dropped"] = dropped.astype(F32)

    sums = {key: psum(v, batch_axes) for key, v in sums.items()}
    n = sums["tokens"]
    load = sums["counts"] / (n * k)  # [E], sums to 1
    stats = {
        "aux_loss": E * jnp.sum(load * sums["probs"] / n),
        "z_loss": sums["z"] / n,
        "dropped_fraction": sums["dropped"] / (n * k),
        "max_load": jnp.max(load) * E,  # max / mean load
        "expert_load": load,
    }
    return y, stats


def receive_rows(a: int, ep: int, m: MoEConfig) -> int:
    """Rows of a shard's dropless receive buffer, for A = `a` assignments per source:
    ep x A (every source may send all its rows to one shard) or ceil(receive_factor x A)."""
    if not m.receive_factor:
        return ep * a
    return max(1, min(ep * a, math.ceil(m.receive_factor * a)))


def _local_experts(buf, local_e, sizes, k, w_gate, w_up, w_down, tensor_axes, fp8, impl, m, expert_biases):
    """A shard's received rows buf [R, d], each k times, through its local experts: local_e
    int [R*k] the local expert of row r's i-th copy at r*k + i (e_local: none; its output is
    never used), sizes int [e_local] their counts -> the outputs [R*k, d] in that order, the
    tensor shards summed and the down bias added (one grouped matmul over the copies sorted
    by local expert)."""
    order = checkpoint_name(jnp.argsort(local_e, stable=True), "routing")
    inverse = checkpoint_name(jnp.argsort(order), "routing")
    in_biases, down_bias = _row_biases(expert_biases, local_e[order])
    out = _ragged_swiglu(
        sort_rows(buf, order, inverse, k), w_gate, w_up, w_down, sizes, fp8, impl, m=m, in_biases=in_biases
    )
    if tensor_axes:
        out = jax.lax.psum(out, tensor_axes)
    if down_bias is not None:
        out = out + down_bias
    return unsort_rows(out, order, inverse)


def _dropless_exchange(
    xs,
    sorted_e,
    group_sizes,
    w_gate,
    w_up,
    w_down,
    *,
    ep,
    expert_axes,
    tensor_axes,
    exchange,
    rows,
    fp8=None,
    impl="ragged_dot",
    m=None,
    expert_biases=None,
):
    """Expert-parallel dropless: xs [A, d] sorted by expert -> (expert outputs [A, d] in the
    same order, zero for rows the receiver had no room for; how many such rows, int32).

    Each shard receives into `rows` rows: from every source, in mesh order, the rows
    for its experts (sorted by local expert), as long as there is room. The receiver
    sorts the buffer by local expert and runs one ragged_dot over it. exchange=ragged
    moves only the kept rows; padded sends every shard an [A, d] buffer and compacts."""
    a, d = xs.shape
    e_local = w_gate.shape[0]
    a2a = lambda v: jax.lax.all_to_all(v, expert_axes, 0, 0, tiled=True)
    dest = sorted_e // e_local  # [A] expert shard
    send_counts = group_sizes.reshape(ep, e_local)  # rows per (shard, local expert)
    per_dest = jnp.sum(send_counts, axis=1)
    dest_start = jnp.cumsum(per_dest) - per_dest
    pos = jnp.arange(a) - dest_start[dest]
    recv_counts = a2a(send_counts)  # [ep src, e_local]
    # What fits: a prefix of the (source, local expert) order, `rows` in all.
    kept = jnp.diff(jnp.minimum(jnp.cumsum(recv_counts.reshape(-1)), rows), prepend=0)
    kept = kept.reshape(ep, e_local)
    recv_sizes = jnp.sum(kept, axis=1)  # [ep src] rows kept per source
    recv_start = jnp.cumsum(recv_sizes) - recv_sizes  # where they start in the buffer
    sent = a2a(recv_sizes.reshape(ep, 1)).reshape(ep)  # [ep dest] my rows each one kept
    # Buffer row r: source src[r], its row i[r]; rows past the kept total are padding.
    r = jnp.arange(rows)
    src = jnp.minimum(jnp.sum(r[:, None] >= (recv_start + recv_sizes)[None, :], axis=1), ep - 1)
    i = r - recv_start[src]
    valid = r < jnp.sum(recv_sizes)
    if exchange == "ragged":
        out_offsets = a2a(recv_start.reshape(ep, 1)).reshape(ep)  # where my rows land on each
        buf = jax.lax.ragged_all_to_all(
            xs,
            jnp.zeros((rows, d), xs.dtype),
            dest_start.astype(jnp.int32),
            sent.astype(jnp.int32),
            out_offsets.astype(jnp.int32),
            recv_sizes.astype(jnp.int32),
            axis_name=expert_axes,
        )
    else:
        recv = a2a(jnp.zeros((ep, a, d), xs.dtype).at[dest, pos].set(xs))  # [ep src, A, d]
        buf = jnp.where(valid[:, None], recv[src, jnp.minimum(i, a - 1)], 0)
    # Local expert of every buffer row (e_local: padding), then one grouped matmul.
    ends = jnp.cumsum(kept, axis=1)[src]  # [rows, e_local]
    local_e = jnp.where(valid, jnp.sum(i[:, None] >= ends, axis=1), e_local)
    sizes = jnp.sum(kept, axis=0).astype(jnp.int32)
    out = _local_experts(
        buf, local_e, sizes, 1, w_gate, w_up, w_down, tensor_axes, fp8, impl, m, expert_biases
    )  # [rows, d] buffer order
    dropped = jnp.sum(per_dest - sent)
    if exchange == "ragged":
        # Each source's rows go back to where it keeps them: its dest_start[this shard].
        back_offsets = a2a(dest_start.reshape(ep, 1)).reshape(ep)
        return jax.lax.ragged_all_to_all(
            out,
            jnp.zeros((a, d), out.dtype),
            recv_start.astype(jnp.int32),
            recv_sizes.astype(jnp.int32),
            back_offsets.astype(jnp.int32),
            sent.astype(jnp.int32),
            axis_name=expert_axes,
        ), dropped
    back = jnp.zeros((ep, a, d), out.dtype).at[src, jnp.where(valid, i, a)].set(out, mode="drop")
    return a2a(back)[dest, pos], dropped  # unsent rows stay zero


def shards_per_token(m: MoEConfig, ep: int) -> int:
    """The most expert shards one token's top_k experts can lie on, over `ep` shards that hold
    E/ep consecutive experts each: top_k and ep bound it, and so does group-limited routing
    whose groups lie whole on shards (num_groups a multiple of ep: at most top_k_groups
    shards, DeepSeek-V3's node limit) or span ep/num_groups shards each."""
    bound = min(m.top_k, ep)
    if m.num_groups > 1 and m.num_groups % ep == 0:
        bound = min(bound, m.top_k_groups)
    elif m.num_groups > 1 and ep % m.num_groups == 0:
        bound = min(bound, m.top_k_groups * (ep // m.num_groups))
    return bound


def dispatch_per_shard(m: MoEConfig, ep: int) -> bool:
    """Whether a dropless layer over `ep` expert shards sends each token once per shard it
    needs (`_per_shard_exchange`) rather than once per chosen expert: model.moe.dispatch_per_shard,
    whose `auto` (resolved by jaxtrain and logged, or here for a model built with it) is on
    where that sends fewer rows, shards_per_token < top_k, with the worst-case receive buffer
    (receive_factor 0). Off without expert parallelism and for capacity dispatch."""
    if ep <= 1 or m.dispatch != "dropless":
        return False
    if m.dispatch_per_shard == "auto":
        return not m.receive_factor and shards_per_token(m, ep) < m.top_k
    return m.dispatch_per_shard is True


def _per_shard_exchange(
    x,
    idx,
    weights,
    w_gate,
    w_up,
    w_down,
    *,
    ep,
    expert_axes,
    tensor_axes,
    exchange,
    fp8=None,
    impl="ragged_dot",
    m=None,
    expert_biases=None,
):
    """Expert-parallel dropless, each token sent once per expert shard it needs (DeepSeek-V3's
    node-limited dispatch): tokens x [T, d], their experts idx and weights [T, k] -> the
    weighted sum of their experts' outputs [T, d].

    A token has one row for each of its (at most n = shards_per_token) destination shards,
    carrying the local ids and routing weights of its experts there (k_local = min(k, E/ep)
    slots; unused: id E/ep, weight 0). A source sends a shard at most T rows, so each shard
    receives into ep x T rows, a block of T per source in mesh order whose first rows are the
    ones sent: nothing is dropped. The shard expands its rows to their experts (one grouped
    matmul, as `_dropless_exchange`), sums each row's weighted expert outputs and sends that
    one row back; the source sums its token's rows. Token rows move T x n instead of T x k
    (ragged); the padded exchange's buffers are [ep, T, d] instead of [ep, T x k, d]."""
    t, d = x.shape
    k = idx.shape[1]
    e_local = w_gate.shape[0]
    n, k_local = shards_per_token(m, ep), min(k, e_local)
    a2a = lambda v: jax.lax.all_to_all(v, expert_axes, 0, 0, tiled=True)
    shard = idx // e_local  # [T, k]
    need = jnp.any(shard[:, :, None] == jnp.arange(ep), axis=1)  # [T, ep]
    dests = jnp.sort(jnp.where(need, jnp.arange(ep), ep), axis=1)[:, :n]  # [T, n]; ep: none
    mine = shard[:, None, :] == dests[:, :, None]  # [T, n, k]: choice on that destination
    slots = jnp.argsort((~mine).astype(jnp.int32), axis=-1, stable=True)[..., :k_local]
    ids = jnp.take_along_axis(jnp.where(mine, (idx % e_local)[:, None, :], e_local), slots, axis=-1)
    w = jnp.take_along_axis(jnp.where(mine, weights[:, None, :], 0), slots, axis=-1)
    # The rows by destination, each destination's in token order; rows for no shard last
    row_dest = dests.reshape(t * n)
    order = checkpoint_name(jnp.argsort(row_dest, stable=True), "routing")
    inverse = checkpoint_name(jnp.argsort(order), "routing")
    xs = sort_rows(x, order, inverse, n)  # [T*n, d]
    ids = _take_rows(ids.reshape(t * n, k_local), order, unique=True)
    w = _take_rows(w.reshape(t * n, k_local), order, unique=True)
    dest = row_dest[order]
    per_dest = jnp.sum(need, axis=0)  # [ep] rows for each shard
    dest_start = jnp.cumsum(per_dest) - per_dest
    pos = jnp.arange(t * n) - dest_start[jnp.minimum(dest, ep - 1)]  # row within its destination's
    recv_sizes = a2a(per_dest.reshape(ep, 1)).reshape(ep)  # [ep src] rows each source sent here
    per_dest, dest_start, recv_sizes = (v.astype(jnp.int32) for v in (per_dest, dest_start, recv_sizes))
    if exchange == "ragged":
        landing = jnp.full((ep,), jax.lax.axis_index(expert_axes) * t)  # my block on every shard

        def send(v):
            out = jnp.zeros((ep * t, *v.shape[1:]), v.dtype)
            return jax.lax.ragged_all_to_all(
                v, out, dest_start, per_dest, landing, recv_sizes, axis_name=expert_axes
            )
    else:

        def send(v):  # rows for no shard (dest = ep) fall off the buffer
            buf = jnp.zeros((ep, t, *v.shape[1:]), v.dtype).at[dest, pos].set(v, mode="drop")
            return a2a(buf).reshape(ep * t, *v.shape[1:])

    buf, buf_ids, buf_w = send(xs), send(ids), send(w)
    r = jnp.arange(ep * t)
    valid = r % t < recv_sizes[r // t]
    local_e = jnp.where(valid[:, None], buf_ids, e_local).reshape(-1)  # [ep*T*k_local]; e_local: none
    sizes = jnp.sum(local_e[:, None] == jnp.arange(e_local), axis=0).astype(jnp.int32)
    out = _local_experts(
        buf, local_e, sizes, k_local, w_gate, w_up, w_down, tensor_axes, fp8, impl, m, expert_biases
    )
    # Each row's expert outputs, weighted and summed: one row back per row received. The
    # routing weights' gradient needs these outputs, but they fill the worst-case buffer (ep x
    # k_local rows a token, against top_k for the other paths' "mlp_out"), so no remat policy
    # keeps them: policies that keep mlp_out redo this layer's w_down in the backward here.
    out = out.reshape(ep * t, k_local, d)
    back = jnp.einsum("rcd,rc->rd", out, buf_w.astype(out.dtype))
    if exchange == "ragged":
        blocks = jnp.arange(ep, dtype=jnp.int32) * t  # where each source's rows sit here
        back_offsets = a2a(dest_start.reshape(ep, 1)).reshape(ep)  # where each source keeps mine
        rows = jax.lax.ragged_all_to_all(
            back, jnp.zeros((t * n, d), back.dtype), blocks, recv_sizes, back_offsets, per_dest,
            axis_name=expert_axes,
        )  # fmt: skip
    else:
        back = a2a(back.reshape(ep, t, d))  # [ep dest, T, d]
        rows = jnp.where((dest < ep)[:, None], back[jnp.minimum(dest, ep - 1), jnp.minimum(pos, t - 1)], 0)
    rows = unsort_rows(rows, order, inverse).reshape(t, n, d)  # each token's rows, rows for no shard 0
    return jnp.sum(rows.astype(F32), axis=1).astype(x.dtype)


def exchange_impl(m: MoEConfig) -> str:
    """The dropless expert-parallel exchange a layer runs: model.moe.exchange as resolved
    (jaxtrain resolves `auto` per platform; a model built with `auto` runs padded, which
    every backend implements)."""
    return "ragged" if m.exchange == "ragged" else "padded"


def moe_layer(
    x, w_router, bias, w_gate, w_up, w_down, m: MoEConfig, fp8=None, *, logit_bias=None, expert_biases=None
):
    """Routed experts on x [b, s, d] -> (y [b, s, d], stats dict of f32 scalars + expert_load [E]).

    Without a mesh (or rules) in context: plain single-device code. With one: a
    shard_map over the whole mesh, experts sharded as the rules say (see module doc).
    `fp8`: the expert matmuls' fp8 state (models/fp8.py; replicated into the shard_map,
    amax reduced over the whole mesh) or None. `logit_bias` [E]: the router's trained bias
    (moe.router_logit_bias); `expert_biases`: (b_gate, b_up [E, F], b_down [E, D]) in the
    compute dtype (moe.expert_bias); None without them.
    """
    if x.ndim != 3:
        raise ValueError(f"moe_layer: x must be [batch, seq, d_model], got shape {x.shape}")
    exchange, grouped = exchange_impl(m), grouped_matmul_impl(m, fp8)
    rules, mesh = sharding.current_rules(), jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty or mesh.size == 1:
        return _local_moe(
            x,
            w_router,
            bias,
            w_gate,
            w_up,
            w_down,
            m=m,
            batch_axes=(),
            expert_axes=(),
            tensor_axes=(),
            exchange=exchange,
            grouped=grouped,
            fp8=None if fp8 is None else (fp8, ()),
            logit_bias=logit_bias,
            expert_biases=expert_biases,
        )
    x_spec = sharding.logical_to_spec(("batch", None, None), rules, mesh, x.shape)
    in_spec = sharding.logical_to_spec(("expert", "embed", "mlp"), rules, mesh, w_gate.shape)
    in_spec = P(*in_spec, *[None] * (3 - len(in_spec)))
    batch_axes = sharding.axes_tuple(x_spec[0] if len(x_spec) else None)
    expert_axes, tensor_axes = sharding.axes_tuple(in_spec[0]), sharding.axes_tuple(in_spec[2])
    # The experts enter as stored, d_model split over the fsdp axes, and are gathered inside:
    # the gather's transpose is a reduce-scatter of their gradients. Passed in whole (gathered
    # at the boundary), their gradients left as a replicated all-reduce of every expert's
    # weights (5.6 GiB a layer for Mixtral) that XLA did not turn into a reduce-scatter.
    embed_axes = sharding.axes_tuple(in_spec[1])
    if set(embed_axes) & set(expert_axes + tensor_axes):
        embed_axes = ()  # rules that reuse an axis: gather at the boundary instead
    in_spec = P(in_spec[0], embed_axes or None, in_spec[2])
    out_spec = P(in_spec[0], in_spec[2], embed_axes or None)
    if not set(expert_axes) <= set(batch_axes):
        raise ValueError(
            f"moe_layer: expert mesh axes {expert_axes} must also shard the batch "
            f"(batch axes here: {batch_axes}); check the sharding rules"
        )
    if set(tensor_axes) & set(batch_axes):
        raise ValueError(f"moe_layer: mlp mesh axes {tensor_axes} also shard the batch")
    mesh_axes = tuple(mesh.axis_names)

    def fn(x, w_router, bias, w_gate, w_up, w_down, meta, logit_bias, expert_biases):
        if embed_axes:
            gather = lambda w, axis: jax.lax.all_gather(w, embed_axes, axis=axis, tiled=True)
            w_gate, w_up, w_down = gather(w_gate, 1), gather(w_up, 1), gather(w_down, 2)
        return _local_moe(
            *(x, w_router, bias, w_gate, w_up, w_down),
            m=m,
            batch_axes=batch_axes,
            expert_axes=expert_axes,
            tensor_axes=tensor_axes,
            exchange=exchange,
            grouped=grouped,
            fp8=None if meta is None else (meta, mesh_axes),
            logit_bias=logit_bias,
            expert_biases=expert_biases,
        )

    # The inputs a layer may not have, by name (absent ones are not passed): the selection and
    # logit biases and fp8 state replicated, the expert biases split with their experts (and
    # the gate/up ones over the mlp's tensor axes, as w_gate and w_up)
    optional = dict(bias=bias, meta=fp8, logit_bias=logit_bias, expert_biases=expert_biases)
    optional = {key: v for key, v in optional.items() if v is not None}
    gate_bias_spec = P(in_spec[0], in_spec[2])
    optional_spec = dict(
        bias=P(), meta=P(), logit_bias=P(), expert_biases=(gate_bias_spec, gate_bias_spec, P(in_spec[0]))
    )
    optional_spec = {key: optional_spec[key] for key in optional}

    def body(x, r, g, u, dn, optional):
        extra = [optional.get(key) for key in ("meta", "logit_bias", "expert_biases")]
        return fn(x, r, optional.get("bias"), g, u, dn, *extra)

    stats_spec = {k: P() for k in ("aux_loss", "z_loss", "dropped_fraction", "max_load", "expert_load")}
    # Pallas calls (megablox, triton, mosaic) do not declare how their outputs vary over the
    # mesh, which the shard_map's varying-axes check requires; MaxText runs its MoE unchecked
    # too. The expert-parallel tests check the gradients both ways.
    pallas = m.dispatch == "dropless" and grouped in _GROUPED_KERNELS
    return jax.shard_map(
        body,
        in_specs=(x_spec, P(), in_spec, in_spec, out_spec, optional_spec),
        out_specs=(x_spec, stats_spec),
        check_vma=not pallas,
    )(x, w_router, w_gate, w_up, w_down, optional)


# --- helpers for the trainer --------------------------------------------------------

STAT_KEYS = ("aux_loss", "z_loss", "dropped_fraction", "max_load")


def update_router_bias(params: dict, expert_load: jax.Array, rate: float) -> dict:
    """Aux-loss-free balancing (DeepSeek-V3): after each step, every `router_bias`
    [layers, E] moves by `rate` towards balance: + for under-loaded experts, - for
    over-loaded ones (sign of mean load - load). `expert_load` [layers, E]."""

    def update(path, v):
        if getattr(path[-1], "key", None) != "router_bias":
            return v
        step = rate * jnp.sign(jnp.mean(expert_load, axis=-1, keepdims=True) - expert_load)
        return v + step.astype(v.dtype)

    return jax.tree_util.tree_map_with_path(update, params)

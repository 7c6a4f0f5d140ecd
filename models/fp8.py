"""FP8 matmuls with delayed per-tensor scaling (`model.fp8: true`).

Every fp8 matmul ("site") quantizes its input and its weight to float8_e4m3fn and
the gradient of its output to float8_e5m2, each with one scale per tensor. The
scales are *delayed* (Transformer Engine's recipe): this step's scale comes from
the largest |value| (amax) seen over the last `model.fp8_amax_history` steps,
scale = amax / fp8_max, and this step's amax enters the history. Master weights
stay float32; only the matmul operands are fp8.

State: per site the three scales [1] and the three amax histories [H] (`site_meta`),
stacked like the parameters on a leading `layers` axis (`model_meta`). It lives in
the train state (`TrainState.fp8`, checkpointed), not in the module: the model takes
it as an argument (`Transformer.__call__(..., fp8=meta)`) and without it (generation,
tools) every matmul runs in the compute dtype. It is never trained: its "gradient" is
its next value (Flax's OVERWRITE_WITH_GRADIENT convention: the custom VJPs return the
new scale and history as the cotangent), so the train step takes jax.grad with
respect to it and stores the result.

Which matmuls: the attention projections (wq, wk, wv, wo), the dense SwiGLU MLP,
the MoE shared experts (dense, through Flax's `fp8_ops.fp8_scaled_dot_general`: a real
fp8 x fp8 dot_general, which XLA:GPU turns into cuBLASLt fp8 GEMMs) and the routed
experts (`expert_matmul`: quantize-dequantize around the grouped `ragged_dot` /
capacity einsums, own custom VJPs: inside the MoE layer's shard_map each device holds
a shard of the tokens or experts, so the per-tensor amax is a `pmax` over the mesh,
which Flax's ops do not do; and XLA has no fp8 grouped matmul). Attention scores
(QK^T, PV), the router and the LM head stay in the compute dtype, as in Transformer
Engine's default recipe.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32 = jnp.float32
SITE_KEYS = (
    "input_scale",
    "kernel_scale",
    "grad_scale",
    "input_amax_history",
    "kernel_amax_history",
    "grad_amax_history",
)
ATTENTION_SITES = ("wq", "wk", "wv", "wo")
MLP_SITES = ("w_gate", "w_up", "w_down")


def site_meta(history: int) -> dict:
    """A fresh site: scales 1, empty amax histories (the first step quantizes with scale 1)."""
    one, empty = jnp.ones((1,), F32), jnp.zeros((history,), F32)
    return {k: (one if k.endswith("scale") else empty) for k in SITE_KEYS}


def block_meta(cfg, *, moe: bool) -> dict:
    """The sites of one decoder block (blocks.Block, or moe.MoEBlock when `moe`)."""
    site = lambda: site_meta(cfg.fp8_amax_history)
    mlp = {k: site() for k in MLP_SITES}
    if moe:
        mlp = {"experts": {k: site() for k in MLP_SITES}}
        if cfg.moe.num_shared_experts:
            mlp["shared"] = {k: site() for k in MLP_SITES}
    return {"attn": {k: site() for k in ATTENTION_SITES}, "mlp": mlp}


def model_meta(cfg) -> dict:
    """The whole model's fp8 state, stacked as Transformer's layer stacks: `blocks`
    (dense layers; with an attention pattern, groups of `layer_i` blocks) and `moe_blocks`
    (MoE groups: `dense_i` blocks, then `moe`)."""
    stack = lambda tree, n: jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), tree)
    n_dense = cfg.n_layers if cfg.moe is None else cfg.moe.first_dense_layers
    meta = {}
    if n_dense and cfg.attention_pattern:  # PatternGroup: a block per kind of the pattern
        p = cfg.layers_per_group
        meta["blocks"] = stack({f"layer_{i}": block_meta(cfg, moe=False) for i in range(p)}, n_dense // p)
    elif n_dense:
        meta["blocks"] = stack(block_meta(cfg, moe=False), n_dense)
    if cfg.moe is not None and cfg.attention_pattern:  # MoEPatternGroup: an MoE block per kind
        p = cfg.layers_per_group
        group = {f"layer_{i}": block_meta(cfg, moe=True) for i in range(p)}
        meta["moe_blocks"] = stack(group, cfg.moe.num_moe_layers(cfg) // p)
    elif cfg.moe is not None:
        group = block_meta(cfg, moe=True)
        if cfg.moe.every > 1:
            group = {f"dense_{i}": block_meta(cfg, moe=False) for i in range(cfg.moe.every - 1)}
            group["moe"] = block_meta(cfg, moe=True)
        meta["moe_blocks"] = stack(group, cfg.moe.num_moe_layers(cfg))
    return meta


def combine(a: dict, b: dict) -> dict:
    """Two next-state "gradients" of the same state (e.g. two microbatches): the scales
    are equal (both from the old history); the histories differ in the newest amax, of
    which the batch's is the larger."""
    return jax.tree.map(jnp.maximum, a, b)


# --- dense matmuls: Flax's fp8 dot_general ----------------------------------------------


def einsum(eqn: str, x: jax.Array, w: jax.Array, meta: dict) -> jax.Array:
    """`jnp.einsum(eqn, x, w)` in x's dtype through e4m3 operands and an e5m2 output
    gradient (fp8_ops.fp8_scaled_dot_general, delayed per-tensor scales from `meta`)."""
    dot = functools.partial(
        fp8_ops.fp8_scaled_dot_general,
        lhs_scale=meta["input_scale"],
        rhs_scale=meta["kernel_scale"],
        grad_scale=meta["grad_scale"],
        lhs_amax_history=meta["input_amax_history"],
        rhs_amax_history=meta["kernel_amax_history"],
        grad_amax_history=meta["grad_amax_history"],
        quantize_compute_type=x.dtype,
    )
    return jnp.einsum(eqn, x, w, preferred_element_type=x.dtype, _dot_general=dot)


# --- expert matmuls: quantize-dequantize with a mesh-wide amax -----------------------------


def _amax(x, axes):
    """max |x| over the whole tensor: inside a shard_map, a max over every one of its mesh
    `axes` (the result is then the same on every device). Explicit, whether the shard_map
    tracks how values vary (check_vma) or not: the axes x does not vary along are cast to
    varying first, as pmax then requires; a max over an axis where x is the same everywhere
    changes nothing. (Taking only the axes the type says x varies along silently reduced over
    none when check_vma was off.)"""
    amax = jnp.max(jnp.abs(x)).astype(F32)
    if not axes:
        return amax
    invariant = tuple(a for a in axes if a not in jax.typeof(amax).manual_axis_type.varying)
    if invariant:
        amax = jax.lax.pcast(amax, invariant, to="varying")
    return jax.lax.pmax(amax, tuple(axes))


def _delayed(x, q_dtype, scale, history, axes):
    """(this step's scale from the history, the history with this step's amax)."""
    fp8_max = fp8_ops.get_fp8_max(q_dtype, F32)
    new_scale = fp8_ops.compute_scale(jnp.max(history, axis=0), scale, fp8_max)
    new_history = jnp.roll(history, shift=-1, axis=0).at[0].set(_amax(x, axes))
    return new_scale, new_history


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _qdq_forward(q_dtype, axes, x, scale, history):
    new_scale, _ = _delayed(x, q_dtype, scale, history, axes)
    return fp8_ops.qdq(x, q_dtype, new_scale, x.dtype)


def _qdq_forward_fwd(q_dtype, axes, x, scale, history):
    new_scale, new_history = _delayed(x, q_dtype, scale, history, axes)
    return fp8_ops.qdq(x, q_dtype, new_scale, x.dtype), (new_scale, new_history)


def _qdq_forward_bwd(q_dtype, axes, res, g):
    new_scale, new_history = res
    return g, new_scale, new_history  # the state's cotangent is its next value


_qdq_forward.defvjp(_qdq_forward_fwd, _qdq_forward_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _qdq_backward(q_dtype, axes, y, scale, history):
    return y


def _qdq_backward_fwd(q_dtype, axes, y, scale, history):
    return y, (scale, history)


def _qdq_backward_bwd(q_dtype, axes, res, g):
    scale, history = res
    new_scale, new_history = _delayed(g, q_dtype, scale, history, axes)
    return fp8_ops.qdq(g, q_dtype, new_scale, g.dtype), new_scale, new_history


_qdq_backward.defvjp(_qdq_backward_fwd, _qdq_backward_bwd)


def expert_matmul(matmul, x: jax.Array, w: jax.Array, meta: dict | None, axes=()) -> jax.Array:
    """`matmul(x, w)` (ragged_dot / einsum) with x and w through e4m3 and the output
    gradient through e5m2, per-tensor delayed scales; `axes`: the mesh axes of the
    enclosing shard_map, over which the amax is a max (one scale for the whole tensor)."""
    if meta is None:
        return matmul(x, w)
    axes = tuple(axes)
    xq = _qdq_forward(E4M3, axes, x, meta["input_scale"], meta["input_amax_history"])
    wq = _qdq_forward(E4M3, axes, w, meta["kernel_scale"], meta["kernel_amax_history"])
    return _qdq_backward(E5M2, axes, matmul(xq, wq), meta["grad_scale"], meta["grad_amax_history"])


def count_fp8_matmuls(hlo_text: str) -> int:
    """Matmuls with fp8 operands in an optimized HLO module (`compiled.as_text()`): cuBLASLt
    fp8 custom calls, plus dot / convolution instructions, fused or not, one of whose
    operands is an f8 value (XLA:GPU's Triton GEMM fusions, XLA:TPU's MXU convolutions)."""
    count = len(re.findall(r'custom_call_target="__cublas\$lt\$matmul\$f8"', hlo_text))
    fp8_values = set()
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = f8e\w+\[", line)
        if m:
            fp8_values.add(m.group(1))
        m = re.search(r"= \S+ (?:dot|convolution)\(%([\w.\-]+), %([\w.\-]+)\)", line)
        if m and (m.group(1) in fp8_values or m.group(2) in fp8_values):
            count += 1
    return count

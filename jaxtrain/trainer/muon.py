"""Muon (Jordan et al. 2024; `optimizer.name: muon`) as `torch.optim.Muon` computes it, for
the hidden weight matrices, each taken as the one matrix Hugging Face stores.

Which parameters, and as which matrix. A parameter is a hidden matrix when its logical axes,
after the stacking axes (`layers`; MoE's `expert`; the prediction modules' `mtp_depth`: each
layer's, each expert's and each module's own matrix), are `embed` and only hidden axes
(heads, kv_heads, head_dim, mlp, latent attention's latents q_lora, kv_lora, and eh_proj's
mtp_concat), `embed` first (an input projection: q/k/v, gate, up,
MLA's down-projections wq_a and wkv_a, the shared RoPE key's columns included as HF's
`kv_a_proj_with_mqa` holds them) or last (an output projection: o, down, and a prediction
module's eh_proj [2 d_model, d_model], HF's [d_model, 2 d_model]); or, without
`embed`, a latent first and heads after it (MLA's up-projections wq_b, wkv_b: HF's
`q_b_proj` [H * (nope + rope), q_lora], `kv_b_proj` [H * (nope + v), kv_lora]). Our layouts
are [in..., out...]; the matrix is [prod(in), prod(out)], the transpose of HF's [out, in]
(q_proj: [d_model, heads * head_dim] here, [heads * head_dim, d_model] there), never one head
at a time. Embeddings, the LM head (vocab axes), norm scales, biases, routers (an unnamed
expert axis) and LoRA adapters (`lora_rank`) are not hidden matrices: AdamW takes them
(jaxtrain/trainer/optimizer.py).

The update of one matrix W with gradient g (torch/optim/_muon.py):

    buf = momentum * buf + (1 - momentum) * g
    u   = (1 - momentum) * g + momentum * buf          (nesterov; else u = buf)
    O   = NewtonSchulz(u)                               (ns_steps quintic iterations)
    W   = W * (1 - lr * weight_decay) - adjusted_lr * O

NewtonSchulz works on the wide orientation (a tall matrix is transposed, as torch does; the
iteration commutes with transposition, so [in, out] and HF's [out, in] give the same O),
first divided by its Frobenius norm (floored at eps). adjusted_lr is computed on HF's
[out, in]: `match_rms_adamw` 0.2 sqrt(max(out, in)) lr, `original` sqrt(max(1, out / in)) lr.

Sharding. The iteration is written on the whole (reshaped) matrix, batched over the
stacking axes, inside the jitted step: GSPMD inserts the collectives a sharded matrix needs
(an FSDP-sharded `embed`, tensor-sharded heads), so the result is that of the unsharded
matrix on every mesh. The momentum lives in the parameter's own layout and sharding.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxtrain.config import MuonConfig
from jaxtrain.trainer import state_store

#: Leading axes that stack independent matrices (the layer scan's, MoE's experts, the
#: multi-token prediction modules': models/mtp.py).
STACK_AXES = frozenset({"layers", "expert", "mtp_depth"})
#: The axes a hidden matrix has besides `embed` (`mtp_concat`: the input of a prediction
#: module's eh_proj, HF's [d_model, 2 d_model]).
HIDDEN_AXES = frozenset({"heads", "kv_heads", "head_dim", "mlp", "q_lora", "kv_lora", "mtp_concat"})
#: Latent attention's latents: the input of its up-projections (models/mla.py).
LATENT_AXES = frozenset({"q_lora", "kv_lora"})


@dataclasses.dataclass(frozen=True)
class MatrixView:
    """How a parameter [*stack, *in, *out] is seen as a stack of [in, out] matrices."""

    n_stack: int  # leading stacking dims
    n_in: int  # then this many input dims; the rest are output dims

    def matrices(self, x: jax.Array) -> jax.Array:
        """x as [*stack, prod(in), prod(out)]."""
        stack = x.shape[: self.n_stack]
        n_in = math.prod(x.shape[self.n_stack : self.n_stack + self.n_in])
        return x.reshape(*stack, n_in, -1)

    def from_matrices(self, m: jax.Array, shape: Sequence[int]) -> jax.Array:
        """`matrices`' inverse: [*stack, in, out] back to the parameter's `shape`."""
        return m.reshape(shape)

    def hf_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        """(out, in): the matrix as Hugging Face stores it."""
        n_in = math.prod(shape[self.n_stack : self.n_stack + self.n_in])
        return math.prod(shape[self.n_stack + self.n_in :]), n_in


def matrix_view(logical_axes: Sequence[str | None]) -> MatrixView | None:
    """The hidden matrix a parameter with these logical axes is (see the module docstring),
    or None: not one (AdamW's)."""
    axes = tuple(logical_axes)
    n_stack = 0
    while n_stack < len(axes) and axes[n_stack] in STACK_AXES:
        n_stack += 1
    core = axes[n_stack:]
    if len(core) >= 2 and core[0] in LATENT_AXES and set(core[1:]) <= HIDDEN_AXES - LATENT_AXES:
        return MatrixView(n_stack, 1)  # an MLA up-projection: [latent, heads, width]
    if len(core) < 2 or core.count("embed") != 1 or not set(core) - {"embed"} <= HIDDEN_AXES:
        return None
    if core[0] == "embed":
        return MatrixView(n_stack, 1)
    if core[-1] == "embed":
        return MatrixView(n_stack, len(core) - 1)
    return None


def is_muon_param(logical_axes: Sequence[str | None]) -> bool:
    return matrix_view(logical_axes) is not None


def newton_schulz(g: jax.Array, coefficients: Sequence[float], steps: int, eps: float, dtype) -> jax.Array:
    """The orthogonalised update of matrices g [..., m, n] (batched over the leading dims), in
    `dtype`: torch's `_zeropower_via_newtonschulz`, per matrix."""
    a, b, c = coefficients
    x = g.astype(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = jnp.swapaxes(x, -1, -2)
    norm = jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=(-2, -1), keepdims=True))
    x = x / jnp.maximum(norm, eps).astype(dtype)
    for _ in range(steps):
        gram = x @ jnp.swapaxes(x, -1, -2)
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return jnp.swapaxes(x, -1, -2) if tall else x


def lr_ratio(adjust_lr: str, out_dim: int, in_dim: int) -> float:
    """adjusted_lr / lr for a matrix of HF shape [out, in] (torch's `_adjust_lr`)."""
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(out_dim, in_dim))
    if adjust_lr == "original":
        return math.sqrt(max(1.0, out_dim / in_dim))
    raise ValueError(f"optimizer.muon.adjust_lr={adjust_lr!r}: expected match_rms_adamw or original")


class MuonState(NamedTuple):
    count: jax.Array  # steps taken (the schedule's argument)
    momentum: optax.Updates  # the momentum buffers, param-shaped
    # with state_dtype bfloat16, their int8 error terms (trainer/state_store.py); else None
    momentum_err: optax.Updates = None


def muon(
    cfg: MuonConfig,
    learning_rate: optax.Schedule,
    weight_decay: float,
    views,
    state_dtype=None,
) -> optax.GradientTransformation:
    """Muon over params whose `views` (a tree of `MatrixView`, the params' structure; under
    `optax.partition` the same masking as the updates) say which matrix each is.
    `learning_rate`: the (unadjusted) lr schedule; `state_dtype`: the momentum's dtype
    (None: each parameter's); the update is computed in float32 whatever it is."""
    ns_dtype = jnp.dtype(cfg.ns_dtype)
    m = cfg.momentum
    compensated = state_store.compensated(state_dtype)  # bfloat16 with an int8 error term

    def init(params):
        if compensated:
            return MuonState(jnp.zeros([], jnp.int32), *state_store.zeros_like_tree(params))
        momentum = jax.tree.map(lambda p: jnp.zeros(p.shape, state_dtype or p.dtype), params)
        return MuonState(count=jnp.zeros([], jnp.int32), momentum=momentum)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("muon: the update needs the parameters (weight decay)")
        lr = learning_rate(state.count)

        def one(g, buf, p, view):
            g32 = g.astype(jnp.float32)
            buf = m * buf.astype(jnp.float32) + (1 - m) * g32
            u = (1 - m) * g32 + m * buf if cfg.nesterov else buf
            o = newton_schulz(view.matrices(u), cfg.ns_coefficients, cfg.ns_steps, cfg.eps, ns_dtype)
            ratio = lr_ratio(cfg.adjust_lr, *view.hf_shape(p.shape))
            o = view.from_matrices(o.astype(jnp.float32), p.shape)
            step = -(lr * weight_decay) * p.astype(jnp.float32) - (lr * ratio) * o
            return step.astype(p.dtype), buf if compensated else buf.astype(state_dtype or p.dtype)

        bufs = state_store.decode_tree(state.momentum, state.momentum_err) if compensated else state.momentum
        pairs = jax.tree.map(one, updates, bufs, params, views)
        is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and not isinstance(x, optax.MaskedNode)
        new_updates = jax.tree.map(lambda t: t[0], pairs, is_leaf=is_pair)
        momentum = jax.tree.map(lambda t: t[1], pairs, is_leaf=is_pair)
        count = optax.safe_increment(state.count)
        if compensated:
            return new_updates, MuonState(count, *state_store.encode_tree(momentum))
        return new_updates, MuonState(count=count, momentum=momentum)

    return optax.GradientTransformation(init, update)

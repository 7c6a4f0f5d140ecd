"""Low-rank adapters (LoRA, Hu et al. 2021, computed as PEFT computes them): a targeted
weight W (`model.lora.targets`) computes W x + (alpha / rank) B (A dropout(x)).

Layout: our weights keep their own multi-dimensional layouts ([embed, heads, head_dim] for
wq, ...), and so do their adapters: A covers the weight's input dims, B its output dims,

    wq [D, H, hd]  ->  a [D, r]        ("embed", "lora_rank")
                       b [r, H, hd]    ("lora_rank", "heads", "head_dim")
    wo [H, hd, D]  ->  a [H, hd, r]    ("heads", "head_dim", "lora_rank")
                       b [r, D]        ("lora_rank", "embed")
    w_gate [D, F]  ->  a [D, r], b [r, F]     (MoE experts: a leading expert dim on both)

Two adapters are not shaped like their one weight, because PEFT adapts Hugging Face's module,
which jaxtrain stores differently:
- with `model.attention_output_gate`, HF's q_proj holds per head the query rows, then the
  gate's, which jaxtrain keeps as wq and wq_gate. PEFT puts ONE adapter on q_proj (its x A
  feeds both halves), so wq's adapter spans both: b [r, H, 2 hd], the query's update the first
  hd of each head, the gate's the last (`halves`; `merged` folds each into its weight);
- gated DeltaNet's in_proj_qkv keeps its HF rows regrouped per key head
  (models/linear_attention.py); its adapter's b is regrouped the same way, which only the PEFT
  interchange sees (jaxtrain/interchange/peft.py), as a and b here keep the weight's layout.

so the sharding rules place A like the weight's input dim and B like its output dim, and
`lora_rank` (no rule) stays whole. A starts kaiming-uniform over fan_in = the input size, as
torch's Linear and PEFT initialise lora_A; B starts at zero, so a fresh adapter is the base.
PEFT's [r, in] / [out, r] matrices are A and B flattened and transposed (models/peft.py).

An adapter is a submodule named `<weight>_lora` beside its weight (params `a`, `b`): `split`
tells the trainer's trainable adapters from the frozen base by that name.

Dense layers run the adapter beside the weight (x A, then B), so training forms no
weight-sized gradient at all. MoE experts add (alpha / r) A B to each expert's weight before
the expert matmuls (`effective_weight`): exact, and it keeps every dispatch and exchange as
it is, at the cost of one expert-weight-sized temporary (and its gradient) per layer; there
is no adapter dropout there.

Two trace-time switches: `adapters_disabled()` runs the model as its base alone (a DPO
reference without a second copy of the weights), and `dropout_keys(key)` turns dropout on
(training steps; each adapter takes its own key from it, in trace order).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.config import ModelConfig

SUFFIX = "_lora"  # an adapter submodule is named <weight>_lora
RANK_AXIS = "lora_rank"

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("lora_enabled", default=True)
_DROPOUT: contextvars.ContextVar[list | None] = contextvars.ContextVar("lora_dropout", default=None)


@contextlib.contextmanager
def adapters_disabled() -> Iterator[None]:
    """Inside, models trace as their base alone: every adapter is skipped (not multiplied by
    zero: the logits are exactly the base model's). Trace-time, so one jitted function may
    run the model both ways (DPO: the policy with adapters, the reference without)."""
    token = _ENABLED.set(False)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def enabled() -> bool:
    return _ENABLED.get()


@contextlib.contextmanager
def dropout_keys(key: jax.Array | None) -> Iterator[None]:
    """Adapter dropout on inside (key None: off). Each adapter the trace meets takes
    fold_in(key, n) for the n-th one, so the layers' masks differ within a scanned body."""
    token = _DROPOUT.set(None if key is None else [key, 0])
    try:
        yield
    finally:
        _DROPOUT.reset(token)


def _dropout(x: jax.Array, rate: float) -> jax.Array:
    slot = _DROPOUT.get()
    if slot is None or rate == 0:
        return x
    key = jax.random.fold_in(slot[0], slot[1])
    slot[1] += 1
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class Adapter(nnx.Module):
    """A and B of one weight whose dims are (*lead, *in, *out) (lead: experts)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, inputs, outputs, lead=()):
        (in_shape, in_axes), (out_shape, out_axes), (lead_shape, lead_axes) = (
            _dims(inputs),
            _dims(outputs),
            _dims(lead),
        )
        r, dtype = cfg.lora.rank, cfg.param_dtype
        bound = 1.0 / math.sqrt(math.prod(in_shape))  # kaiming_uniform_(a=sqrt(5)), fan_in
        a = jax.random.uniform(rngs.params(), (*lead_shape, *in_shape, r), dtype, -bound, bound)
        self.a = nnx.Param(a, out_sharding=(*lead_axes, *in_axes, RANK_AXIS), eager_sharding=False)
        self.b = nnx.Param(
            jnp.zeros((*lead_shape, r, *out_shape), dtype),
            out_sharding=(*lead_axes, RANK_AXIS, *out_axes),
            eager_sharding=False,
        )
        self.scale = cfg.lora.scale
        self.dropout = cfg.lora.dropout
        self.n_in, self.n_out = len(in_shape), len(out_shape)

    def __call__(self, x: jax.Array) -> jax.Array:
        """(alpha / r) B (A dropout(x)) for x [..., *in] -> [..., *out] in x's dtype."""
        a, b = self.a[...].astype(x.dtype), self.b[...].astype(x.dtype)
        x = _dropout(x, self.dropout)
        h = jnp.tensordot(x, a, axes=(tuple(range(x.ndim - self.n_in, x.ndim)), tuple(range(self.n_in))))
        return jnp.tensordot(h, b, axes=((h.ndim - 1,), (0,))) * jnp.asarray(self.scale, x.dtype)


def _dims(pairs) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """[(size, logical axis), ...] -> (shape, axes)."""
    return tuple(n for n, _ in pairs), tuple(a for _, a in pairs)


def adapter(module, name: str, cfg: ModelConfig, rngs: nnx.Rngs, *, inputs, outputs, lead=()) -> None:
    """Give `module` the adapter of its weight `name` when model.lora targets it."""
    if cfg.lora is not None and name in cfg.lora.targets:
        setattr(module, name + SUFFIX, Adapter(cfg, rngs, inputs=inputs, outputs=outputs, lead=lead))


def add(module, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """y (= x @ W for `module`'s weight `name`) plus its adapter's update, if it has one and
    adapters are on."""
    u = update(module, name, x)
    return y if u is None else y + u.astype(y.dtype)


def update(module, name: str, x: jax.Array) -> jax.Array | None:
    """The adapter's (alpha / r) B (A dropout(x)) of `module`'s weight `name`, or None (no
    adapter, or adapters off). One call draws one dropout mask: a caller that adds one update
    to two weights (`halves`) calls it once, as PEFT does."""
    ad = getattr(module, name + SUFFIX, None)
    if ad is None or not enabled():
        return None
    return ad(x)


def halves(u: jax.Array | None, part: int) -> jax.Array | None:
    """The first (`part` 0) or second (1) half of the last dim of an update (or None): the
    query's or the gate's share of the gated q_proj's adapter (module docstring)."""
    if u is None:
        return None
    n = u.shape[-1] // 2
    return u[..., :n] if part == 0 else u[..., n:]


def effective_weight(module, name: str, w: jax.Array) -> jax.Array:
    """W + (alpha / r) A B in W's layout and dtype (MoE experts; see the module docstring)."""
    ad = getattr(module, name + SUFFIX, None)
    if ad is None or not enabled():
        return w
    return w + (delta(ad.a[...], ad.b[...], w.shape) * ad.scale).astype(w.dtype)


def delta(a, b, w_shape) -> jax.Array:
    """A B in the weight's layout: a [*lead, *in, r], b [*lead, r, *out] -> [*lead, *in, *out]
    (unscaled). Works on numpy arrays too (export, merge)."""
    lead = a.ndim - 1 + b.ndim - 1 - len(w_shape)
    lead_shape = tuple(w_shape[:lead])
    n = math.prod(lead_shape)
    r = a.shape[-1]
    a2 = a.reshape(n, -1, r)
    b2 = b.reshape(n, r, -1)
    return (a2 @ b2).reshape(w_shape)


# --- adapters and base as parameter trees --------------------------------------------------


def split(params: dict) -> tuple[dict, dict]:
    """(base, adapters): the parameter tree's `*_lora` subtrees apart from the rest, each
    keeping the nested-dict paths (empty branches dropped)."""
    base, adapters = {}, {}
    for k, v in params.items():
        if k.endswith(SUFFIX):
            adapters[k] = v
        elif isinstance(v, dict):
            b, a = split(v)
            if b:
                base[k] = b
            if a:
                adapters[k] = a
        else:
            base[k] = v
    return base, adapters


def join(base: dict, adapters: dict) -> dict:
    """The whole parameter tree from `split`'s two parts."""
    out = dict(base)
    for k, v in adapters.items():
        out[k] = join(out[k], v) if isinstance(v, dict) and k in out and not k.endswith(SUFFIX) else v
    return out


def merged(params: dict, cfg: ModelConfig) -> dict:
    """The base with every adapter folded in (W + alpha / r A B), no adapters left: the
    parameters of the same model without `model.lora` (numpy or jax arrays)."""
    scale = cfg.lora.scale

    def fold(tree: dict) -> dict:
        gated = "wq_gate" in tree and "wq" + SUFFIX in tree  # one adapter over both (module docstring)
        out = {}
        for k, v in tree.items():
            if k.endswith(SUFFIX):
                continue
            if isinstance(v, dict):
                out[k] = fold(v)
            elif k + SUFFIX in tree and not (gated and k == "wq"):
                ad = tree[k + SUFFIX]
                out[k] = (v + delta(ad["a"], ad["b"], v.shape) * scale).astype(v.dtype)
            else:
                out[k] = v
        if gated:
            out["wq"], out["wq_gate"] = _fold_gated_query(tree, scale)
        return out

    return fold(params)


def _fold_gated_query(tree: dict, scale: float) -> tuple:
    """(wq, wq_gate) + (alpha / r) A B when wq's adapter spans the gated q_proj: its b
    [..., r, H, 2 hd] gives the query the first hd of each head, the gate the last."""
    wq, gate, ad = tree["wq"], tree["wq_gate"], tree["wq" + SUFFIX]
    both = delta(ad["a"], ad["b"], (*wq.shape[:-1], 2 * wq.shape[-1])) * scale
    hd = wq.shape[-1]
    return (wq + both[..., :hd]).astype(wq.dtype), (gate + both[..., hd:]).astype(gate.dtype)

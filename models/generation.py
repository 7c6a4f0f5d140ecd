"""Text generation: prefill, then a jitted decode loop over a KV cache.

`generate(model, tokens, *, max_new_tokens, ...)` -> int32 `[batch, prompt + max_new_tokens]`.

Prompts are right-padded: row i's prompt is `tokens[i, :prompt_lengths[i]]` (the whole
row when `prompt_lengths` is None), at positions 0 .. L_i - 1; what the padding holds
never matters. Output row i is its prompt, then its `max_new_tokens` new tokens, then
(rows shorter than the padded width) fill. A row that emits `eos_id` emits `eos_id`
ever after, and the loop stops once every row has; fill is `eos_id`, or 0 when
`eos_id` is None. Each row is what it would be generated alone.

The cache (`KVCache`): k and v `[layers, batch, kv_heads, cache_len, head_dim]` (v's head
dim may differ from k's; latent attention, `model.mla`, caches in k one row of
kv_lora_rank + qk_rope_head_dim values per token, its latent and shared RoPE key, and
nothing in v) in the compute dtype, named `CACHE_AXES` for the sharding rules
(batch over data/fsdp, kv heads over tensor), and the position each slot holds,
`[batch, cache_len]` (-1: empty). Position p lives in slot p % cache_len. cache_len is
prompt + max_new_tokens, or the sliding window W when that is shorter: a ring buffer of
exactly the keys a query may see (q - k < W, Mistral's rule, as in the training path); the
stored positions mask the rest. Gated DeltaNet layers (`model.layer_types`) keep no keys:
`KVCache.conv` and `.state` hold each one's last conv inputs and its delta rule's state, the
same size at any length (models/linear_attention.py `prefill` / `decode`); k and v then stack
the full-attention layers only.

Prefill runs the model's own attention (`attend`: the Pallas kernel on GPU/TPU) over
the padded prompts and keeps each row's last cache_len real positions; a decode step
projects one token per row, writes its k/v into its slot and attends over the cache
(XLA, f32 softmax). The decode step carries the whole cache through the layer scan and
puts each layer back with a dynamic update, so a donated cache is updated in place
(temp memory: about one layer's cache, not a second copy). MoE layers route every
token on its own, so dropless dispatch routes exactly as a full forward pass does;
capacity dispatch groups tokens differently (one per row in decode), so its drops may
differ from a full forward.

Sampling: temperature 0 is greedy (argmax, the first index on ties); otherwise
softmax(logits / temperature) restricted to the `top_k` largest logits, then to the
nucleus (the fewest most-probable tokens whose probability, renormalised after top-k,
reaches `top_p`; never empty). Step t draws with `fold_in(key(seed), t)`: the same
seed gives the same tokens, on any mesh (threefry is partitionable).

`stream(model, tokens, ...)` yields the same tokens one step at a time (the prefill
and the loop body jitted on their own, driven from Python), for callers that show
text as it is produced (`jaxtrain generate`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.models.attention import attend, sink_softmax
from jaxtrain.models.blocks import PatternGroup, post_norm
from jaxtrain.models.layers import norm_after, norm_before
from jaxtrain.models.linear_attention import CONV_STATE_AXES, STATE_AXES, GatedDeltaNet, state_shapes
from jaxtrain.models.masks import softcapped
from jaxtrain.models.transformer import MoEGroup, Transformer
from jaxtrain.sharding import axis_rules, constrain, current_rules

CACHE_AXES = ("layers", "batch", "act_kv_heads", None, None)
CACHE_POSITION_AXES = ("batch", None)


class KVCache(NamedTuple):
    k: jax.Array  # [attention layers, batch, kv_heads, cache_len, head_dim]
    v: jax.Array
    positions: jax.Array  # int32 [batch, cache_len]: the position each slot holds; -1 empty
    # gated DeltaNet layers (model.layer_types; models/linear_attention.py state_shapes), else
    # None: each one's conv window [layers, batch, kernel - 1, hk, width] and its rule's state
    # [layers, batch, hv, dk, dv] (float32), the same size at every step
    conv: jax.Array | None = None
    state: jax.Array | None = None


def cache_shapes(cfg, batch: int, cache_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of `KVCache.k` and `.v` that generation keeps for a model of `cfg`: per
    attention layer (the full_attention ones of `model.layer_types`), row and slot, every kv
    head's key and value; with `model.mla` one row of the latent and the shared RoPE key
    (kv_lora_rank + qk_rope_head_dim values) in k, nothing in v. The DeltaNet layers' state:
    `linear_state_shapes`."""
    layers = cfg.n_layers - cfg.n_linear_layers
    if cfg.mla is not None:
        row = (layers, batch, 1, cache_len)
        return (*row, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim), (*row, 0)
    shape = (layers, batch, cfg.n_kv_heads, cache_len, cfg.resolved_head_dim)
    return shape, shape


def linear_state_shapes(cfg, batch: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The shapes of `KVCache.conv` and `.state` (None without gated DeltaNet layers)."""
    n = cfg.n_linear_layers
    return state_shapes(cfg, n, batch) if n else None


def cache_length(cfg, total_len: int) -> int:
    """Slots per row for sequences of `total_len` positions: all of them, or the window when
    every layer slides (an attention pattern's global layers need all of them)."""
    if cfg.sliding_window and "global" not in cfg.attention_pattern:
        return min(cfg.sliding_window, total_len)
    return total_len


class _Step(NamedTuple):
    """What every layer needs to know about the tokens it is fed."""

    positions: jax.Array  # [b, s] positions of the tokens fed
    slot_positions: jax.Array  # [b, cache_len] position each slot holds after this step (-1 empty)
    source: jax.Array | None  # prefill: [b, cache_len] index into the prompt each slot takes
    write: jax.Array | None  # decode: [b, cache_len] the slot each row's new token goes to
    lengths: jax.Array | None = None  # prefill: [b] each row's prompt length


def _cached_attention(q, k, v, q_positions, kv_positions, window, scale=None, softcap=None, sinks=None):
    """q [b, 1, h, d_qk] over the cache k [b, kv_heads, cache_len, d_qk] and v
    [b, kv_heads, cache_len, d_v] -> [b, 1, h, d_v] (GQA without repeating K/V, f32 softmax,
    as `xla_attention`). A slot is visible when it holds a position p with 0 <= p <= q's
    position (and q - p < window). `scale` (None: d_qk ** -0.5), `softcap` and the `[h]`
    `sinks` logits as the model's attention has them."""
    b, s, h, d = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(b, s, kv_heads, h // kv_heads, d)
    scale = d**-0.5 if scale is None else scale
    scores = softcapped(
        jnp.einsum("bskgd,bktd->bkgst", qg, k, preferred_element_type=jnp.float32) * scale, softcap
    )
    q_pos = q_positions[:, None]
    visible = (kv_positions >= 0) & (kv_positions <= q_pos)
    if window is not None:
        visible &= q_pos - kv_positions < window
    scores = jnp.where(visible[:, None, None, None, :], scores, jnp.finfo(jnp.float32).min)
    probs = sink_softmax(scores, sinks, kv_heads).astype(v.dtype)
    return jnp.einsum("bkgst,bktd->bskgd", probs, v).reshape(b, s, h, v.shape[-1])


def _sinks(attn):
    """The layer's `[heads]` sink logits (a `sinks` parameter, GPT-OSS), or None."""
    sinks = getattr(attn, "sinks", None)
    return None if sinks is None else sinks[...]


def _kept_slots(step: _Step, *new):
    """Prefill: of each t [b, s, heads, d], what the cache slots hold -> [b, heads, cache_len, d]."""
    held = (step.slot_positions >= 0)[:, :, None, None]
    keep = lambda t: jnp.where(held, jnp.take_along_axis(t, step.source[:, :, None, None], axis=1), 0)
    return tuple(constrain(keep(t).transpose(0, 2, 1, 3), CACHE_AXES[1:]) for t in new)


def _written_slots(step: _Step, cache, layer, *new):
    """Decode: layer `layer` of each cache [layers, b, heads, cache_len, d] with the new token's
    t [b, 1, heads, d] written into its slot -> [b, heads, cache_len, d]."""
    write = step.write[:, None, :, None]
    return tuple(
        constrain(
            jnp.where(write, t.transpose(0, 2, 1, 3), jax.lax.dynamic_index_in_dim(c, layer, 0, False)),
            CACHE_AXES[1:],
        )
        for t, c in zip(new, cache)
    )


def _latent_attention(attn, x, cache, step: _Step, layer=None):
    """`_attention` for latent attention (models/mla.py): the cache's k holds each token's
    normed latent and rotated shared RoPE key, [b, 1, cache_len, kv_lora + rope] per layer,
    and its v nothing (width 0). Prefill attends with the expanded keys and values, as the
    model does; decode attends with the up-projections absorbed, as one key/value head whose
    keys are the cached rows and whose values their latent part."""
    from jaxtrain.models.mla import softmax_scale

    latent, k_rope = attn.latent(x, step.positions)
    row = jnp.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1)[:, :, None, :]
    new = (row, row[..., :0])
    if step.write is None:
        q_nope, q_rope = attn.query(x, step.positions)
        k, v = attn.expand(latent, k_rope)
        out = attn.attention(jnp.concatenate([q_nope, q_rope], axis=-1), k, v, None)
        return attn.output(out), _kept_slots(step, *new)
    rows, empty = _written_slots(step, cache, layer, *new)
    out = _cached_attention(
        attn.absorbed_query(x, step.positions),
        rows,
        rows[..., : attn.cfg.mla.kv_lora_rank],
        step.positions[:, 0],
        step.slot_positions,
        attn.window,
        softmax_scale(attn.cfg),
        attn.cfg.attention_softcap,
        _sinks(attn),  # [H] over H query heads of the one latent key/value head
    )
    cache = tuple(jax.lax.dynamic_update_index_in_dim(c, t, layer, 0) for c, t in zip(cache, (rows, empty)))
    return attn.absorbed_output(out), cache


def _attention(attn, x, cache, step: _Step, layer=None):
    """Attention of one layer through the cache. Prefill (cache None) -> (output [b, s, d],
    this layer's (k, v) [b, kv_heads, cache_len, head_dim]); decode: `cache` is the whole
    (k, v) [layers, ...] -> (output, the cache with layer `layer`'s slots written)."""
    cfg = attn.cfg
    if cfg.mla is not None:
        return _latent_attention(attn, x, cache, step, layer)
    q, k, v = attn.project(x, step.positions)
    if step.write is None:  # prefill: the prompt attends to itself; keep what the slots hold
        out = attend(
            q,
            k,
            v,
            causal=True,
            impl=cfg.attention_impl,
            gpu_kernel=cfg.flash_kernel_on_gpu,
            sliding_window=attn.window,
            context_impl=cfg.context_impl,
            softmax_scale=cfg.attention_scale,
            softcap=cfg.attention_softcap,
            sinks=_sinks(attn),
        )
        return attn.output(out, gate=attn.output_gate(x)), _kept_slots(step, k, v)
    # decode: write the new token's k/v into its slot of this layer, attend over the layer's
    # cache, and put the layer back (a dynamic update of the carried cache: in place).
    k_cache, v_cache = _written_slots(step, cache, layer, k, v)
    out = _cached_attention(
        q,
        k_cache,
        v_cache,
        step.positions[:, 0],
        step.slot_positions,
        attn.window,
        cfg.attention_scale,
        cfg.attention_softcap,
        _sinks(attn),
    )
    cache = tuple(
        jax.lax.dynamic_update_index_in_dim(c, t, layer, 0) for c, t in zip(cache, (k_cache, v_cache))
    )
    return attn.output(out, gate=attn.output_gate(x)), cache


def _linear_attention(attn: GatedDeltaNet, x, cache, step: _Step, layer=None):
    """`_attention` for a gated DeltaNet layer: prefill -> (output, this layer's (conv window,
    state) after each row's prompt); decode: `cache` is the whole (conv, state) [layers, ...]
    -> (output, the cache with layer `layer`'s state advanced by one token)."""
    if step.write is None:
        return attn.prefill(x, step.lengths)
    conv, state = (jax.lax.dynamic_index_in_dim(c, layer, 0, False) for c in cache)
    out, new = attn.decode(x, conv, state)
    return out, tuple(jax.lax.dynamic_update_index_in_dim(c, t, layer, 0) for c, t in zip(cache, new))


def _block(block, x, cache, step: _Step, layer=None):
    """One decoder block (blocks.Block or moe.MoEBlock: the same residual layout) with its cache
    (a DeltaNet layer's: its (conv, state))."""
    cfg = block.attn.cfg
    mixer = _linear_attention if isinstance(block.attn, GatedDeltaNet) else _attention
    h, cache = mixer(block.attn, norm_before(block.attn_norm, x, cfg), cache, step, layer)
    x = x + norm_after(block.attn_norm, h, cfg, post_norm(block, "attn"))
    y = block.mlp(norm_before(block.mlp_norm, x, cfg))
    y = y[0] if isinstance(y, tuple) else y  # MoE: (output, router statistics)
    y = norm_after(block.mlp_norm, y, cfg, post_norm(block, "mlp"))
    return constrain(x + y, ("batch", "seq", "act_embed")), cache


def _stacks(model: Transformer):
    """(stacked layers, decoder blocks per scanned element), in layer order."""
    cfg = model.cfg
    per = cfg.layers_per_group if cfg.moe is None or cfg.scan_pattern else 1
    out = [(model.blocks, per)] if hasattr(model, "blocks") else []
    if cfg.moe is not None:  # MoEPatternGroup (a PatternGroup) or groups of moe.every blocks
        out.append((model.moe_blocks, cfg.layers_per_group if cfg.scan_pattern else cfg.moe.every))
    return out


_LINEAR = "linear_attention"


def _kind_index(kinds: tuple, j: int) -> int:
    """Block j of a scanned element: its index among the element's DeltaNet blocks, or among
    its attention blocks (local and global alike)."""
    return sum((k == _LINEAR) == (kinds[j] == _LINEAR) for k in kinds[:j])


def _run_layers(model: Transformer, x, cache, step: _Step):
    """x through every layer -> (x, the cache (k, v, conv, state), each [layers of its kind, ...];
    conv and state None without DeltaNet layers). Prefill (`cache` None) builds the cache as
    the scan's output; decode carries `cache` through the scan and updates it layer by layer
    in place, so a donated cache is never copied whole. The attention layers' k/v and the
    DeltaNet layers' state are indexed among the layers of their kind, in layer order."""
    made_by_stack, start = [], (0, 0)  # (attention, DeltaNet) layers before the stack
    axes = (CACHE_AXES, CACHE_AXES, CONV_STATE_AXES, STATE_AXES)
    if cache is not None:
        cache = tuple(None if t is None else constrain(t, a) for t, a in zip(cache, axes))
    for stack, per in _stacks(model):
        graphdef, state = nnx.split(stack)
        n = jax.tree.leaves(state)[0].shape[0]
        kinds = tuple(model.cfg.scan_pattern) if per == model.cfg.layers_per_group else ()
        kinds = kinds or ("attention",) * per
        counts = (per - kinds.count(_LINEAR), kinds.count(_LINEAR))  # per element, as `start`

        def body(carry, xs, graphdef=graphdef, start=start, kinds=kinds, counts=counts):
            x, c = carry
            layer_state, g = xs  # g: the scanned element's index
            layer = nnx.merge(graphdef, layer_state)
            if isinstance(layer, MoEGroup):
                blocks = [*(getattr(layer, f"dense_{i}") for i in range(layer.n_dense)), layer.moe]
            else:
                blocks = layer.blocks() if isinstance(layer, PatternGroup) else [layer]
            made = {True: [], False: []}
            for j, block in enumerate(blocks):
                linear = kinds[j] == _LINEAR
                if c is None:
                    x, new = _block(block, x, None, step)
                    made[linear].append(new)
                else:
                    index = start[linear] + g * counts[linear] + _kind_index(kinds, j)
                    mine = c[2:] if linear else c[:2]
                    x, mine = _block(block, x, mine, step, index)
                    c = (*c[:2], *mine) if linear else (*mine, *c[2:])
            if c is not None:
                return (x, c), None
            return (x, c), {key: tuple(map(jnp.stack, zip(*v))) for key, v in made.items() if v}

        (x, cache), made = jax.lax.scan(body, (x, cache), (state, jnp.arange(n)))
        if made is not None:
            made_by_stack.append(
                {key: tuple(t.reshape(n * t.shape[1], *t.shape[2:]) for t in v) for key, v in made.items()}
            )
        start = tuple(s0 + n * c for s0, c in zip(start, counts))
    if cache is None:
        parts = []
        for linear in (False, True):
            pieces = [m[linear] for m in made_by_stack if linear in m]
            joined = (
                [jnp.concatenate(t) if len(t) > 1 else t[0] for t in zip(*pieces)] if pieces else [None, None]
            )
            parts.extend(joined)
        cache = tuple(parts)
        if cache[0] is None:  # every layer DeltaNet: no attention cache
            k_shape, v_shape = cache_shapes(model.cfg, x.shape[0], step.slot_positions.shape[1])
            cache = (jnp.zeros(k_shape, x.dtype), jnp.zeros(v_shape, x.dtype), *cache[2:])
    return x, tuple(None if t is None else constrain(t, a) for t, a in zip(cache, axes))


def prefill(model: Transformer, tokens, prompt_lengths, cache_len: int) -> tuple[jax.Array, KVCache]:
    """Right-padded prompts int [b, P] (row i: its first prompt_lengths[i] tokens) ->
    (logits at each row's last prompt token [b, vocab], the cache of cache_len slots)."""
    b, p = tokens.shape if tokens.ndim == 2 else (0, 0)
    if tokens.ndim != 2 or prompt_lengths.shape != (b,) or cache_len < 1:
        raise ValueError(
            f"prefill: expected tokens [b, P], prompt_lengths [b] and cache_len >= 1, got "
            f"{tokens.shape}, {prompt_lengths.shape} and {cache_len}"
        )
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    last = (prompt_lengths - 1)[:, None]
    # Slot s holds the latest real position p <= last with p = s (mod cache_len); < 0: none.
    held = last - jnp.mod(last - jnp.arange(cache_len)[None], cache_len)
    slot_positions = constrain(jnp.where(held >= 0, held, -1).astype(jnp.int32), CACHE_POSITION_AXES)
    step = _Step(
        positions, slot_positions, source=jnp.clip(held, 0, p - 1), write=None, lengths=prompt_lengths
    )
    x, (k, v, conv, state) = _run_layers(model, model.embed(tokens), None, step)
    x_last = jnp.take_along_axis(x, last[:, :, None], axis=1)  # [b, 1, d]
    return model.unembed(x_last)[:, 0], KVCache(k, v, slot_positions, conv, state)


def decode_step(model: Transformer, tokens, positions, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """One token per row, int [b] at positions [b] -> (its logits [b, vocab], the updated cache)."""
    b, cache_len = cache.positions.shape
    if tokens.shape != (b,) or positions.shape != (b,):
        raise ValueError(
            f"decode_step: expected tokens and positions [batch={b}], "
            f"got {tokens.shape} and {positions.shape}"
        )
    write = jnp.arange(cache_len)[None] == (positions % cache_len)[:, None]
    slot_positions = constrain(jnp.where(write, positions[:, None], cache.positions), CACHE_POSITION_AXES)
    step = _Step(positions[:, None], slot_positions, source=None, write=write)
    carried = (cache.k, cache.v, cache.conv, cache.state)
    x, (k, v, conv, state) = _run_layers(model, model.embed(tokens[:, None]), carried, step)
    return model.unembed(x)[:, 0], KVCache(k, v, slot_positions, conv, state)


def sample(logits, key, temperature, top_k: int | None = None, top_p=None) -> jax.Array:
    """Next tokens int32 [b] from logits [b, vocab] (rules in the module docstring).
    `temperature` and `top_p` may be traced; `top_k` is static. Greedy decoding (temperature
    0) takes a `lax.cond` branch that neither sorts nor draws: only the argmax runs."""
    logits = logits.astype(jnp.float32)

    def greedy():
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def drawn():
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
        if top_k is not None:
            kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
            scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
        if top_p is not None:
            ranked = -jnp.sort(-scaled, axis=-1)  # descending
            probs = jax.nn.softmax(ranked, axis=-1)
            before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more probable tokens
            threshold = jnp.min(jnp.where(before < top_p, ranked, jnp.inf), axis=-1, keepdims=True)
            scaled = jnp.where(scaled >= threshold, scaled, -jnp.inf)
        return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)

    return jax.lax.cond(jnp.asarray(temperature) > 0, drawn, greedy)


def _choose(t, logits, done, key, temperature, top_p, eos_id, *, top_k, nucleus):
    """Step t's tokens [b] (a row already done emits eos_id) and the rows done after them."""
    tok = sample(logits, jax.random.fold_in(key, t), temperature, top_k, top_p if nucleus else None)
    tok = jnp.where(done, eos_id, tok)
    return tok, done | (tok == eos_id)


# The jitted functions take the active axis rules as a static argument (`rules`) and trace
# under them: jit's cache does not key on the rules in context, so one traced under other
# rules would otherwise be reused (sharding.with_rules).
@functools.partial(
    jax.jit, static_argnames=("graphdef", "max_new_tokens", "cache_len", "top_k", "nucleus", "rules")
)
def _generate(
    graphdef,
    state,
    tokens,
    prompt_lengths,
    key,
    temperature,
    top_p,
    eos_id,
    *,
    max_new_tokens,
    cache_len,
    top_k,
    nucleus,
    rules,
):
    with axis_rules(rules):
        return _generate_traced(
            nnx.merge(graphdef, state),
            tokens,
            prompt_lengths,
            key,
            temperature,
            top_p,
            eos_id,
            max_new_tokens=max_new_tokens,
            cache_len=cache_len,
            top_k=top_k,
            nucleus=nucleus,
        )


def _generate_traced(
    model,
    tokens,
    prompt_lengths,
    key,
    temperature,
    top_p,
    eos_id,
    *,
    max_new_tokens,
    cache_len,
    top_k,
    nucleus,
):
    """The body of `_generate`: the prefill, then the decode loop until every row is done."""
    b, p = tokens.shape
    rows = jnp.arange(b)
    fill = jnp.maximum(eos_id, 0)  # eos_id -1: none
    cols = jnp.arange(p + max_new_tokens)[None]
    out = jnp.where(cols < prompt_lengths[:, None], jnp.pad(tokens, ((0, 0), (0, max_new_tokens))), fill)

    def emit(t, logits, out, done):
        tok, done = _choose(t, logits, done, key, temperature, top_p, eos_id, top_k=top_k, nucleus=nucleus)
        return tok, out.at[rows, prompt_lengths + t].set(tok), done

    logits, cache = prefill(model, tokens, prompt_lengths, cache_len)
    tok, out, done = emit(0, logits, out, jnp.zeros((b,), bool))

    def step(carry):
        t, tok, cache, out, done = carry
        logits, cache = decode_step(model, tok, prompt_lengths + t - 1, cache)
        tok, out, done = emit(t, logits, out, done)
        return t + 1, tok, cache, out, done

    def running(carry):
        t, *_, done = carry
        return (t < max_new_tokens) & ~jnp.all(done)

    carry = (jnp.asarray(1, jnp.int32), tok, cache, out, done)
    return jax.lax.while_loop(running, step, carry)[3]


def _checked(model, tokens, max_new_tokens, temperature, top_k, top_p, seed, eos_id, prompt_lengths):
    """The door of `generate` and `stream`: every argument checked -> (tokens, prompt_lengths)."""
    if not isinstance(model, Transformer):
        raise ValueError(f"model: expected a models.Transformer, got {type(model).__name__}")
    cfg = model.cfg
    if not isinstance(tokens, jax.Array):
        tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(
            f"tokens: expected int [batch, prompt], got shape {tokens.shape} dtype {tokens.dtype}"
        )
    b, p = tokens.shape
    if b < 1 or p < 1:
        raise ValueError(f"tokens: expected at least one row and one token, got shape {(b, p)}")
    if not isinstance(tokens, jax.core.Tracer):
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= cfg.vocab_size:
            raise ValueError(f"tokens: ids must be in [0, {cfg.vocab_size}), got min {lo} max {hi}")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected a positive integer")
    if not (_is_number(temperature) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature!r}: expected a finite number >= 0 (0: greedy)")
    if top_k is not None and (not _is_int(top_k) or not 1 <= top_k <= cfg.vocab_size):
        raise ValueError(f"top_k={top_k!r}: expected None or an integer in [1, {cfg.vocab_size}]")
    if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r}: expected None or a number in (0, 1]")
    if not _is_int(seed):
        raise ValueError(f"seed={seed!r}: expected an integer")
    if eos_id is not None and (not _is_int(eos_id) or not 0 <= eos_id < cfg.vocab_size):
        raise ValueError(f"eos_id={eos_id!r}: expected None or a token id in [0, {cfg.vocab_size})")
    if prompt_lengths is None:
        prompt_lengths = np.full((b,), p, np.int32)
    lengths = np.asarray(prompt_lengths)
    if lengths.shape != (b,) or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(
            f"prompt_lengths: expected int [batch={b}], got shape {lengths.shape} dtype {lengths.dtype}"
        )
    if lengths.min() < 1 or lengths.max() > p:
        raise ValueError(f"prompt_lengths={lengths.tolist()}: expected values in [1, prompt={p}]")
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and dict(zip(mesh.axis_names, mesh.axis_sizes)).get("context", 1) > 1:
        raise ValueError("generate: the mesh in context has context > 1; generation needs context=1")
    return tokens, lengths


def _operands(tokens, lengths, seed, temperature, top_p, eos_id) -> tuple:
    """tokens, prompt_lengths, key, temperature, top_p, eos_id (-1: none) as jax operands."""
    return (
        jnp.asarray(tokens, jnp.int32),
        jnp.asarray(lengths, jnp.int32),
        jax.random.key(seed),
        jnp.asarray(temperature, jnp.float32),
        jnp.asarray(1.0 if top_p is None else top_p, jnp.float32),
        jnp.asarray(-1 if eos_id is None else eos_id, jnp.int32),
    )


def generate(
    model: Transformer,
    tokens,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_id: int | None = None,
    prompt_lengths=None,
) -> jax.Array:
    """Continue right-padded prompts int [batch, prompt] by `max_new_tokens` tokens each ->
    int32 [batch, prompt + max_new_tokens] (layout, padding, EOS and sampling rules: the
    module docstring). Prefill once, then one jitted `lax.while_loop`; compiled once per
    model structure, shapes, `max_new_tokens` and `top_k` (and whether `top_p` is set).

    Runs under the mesh and rules in context (`jax.set_mesh` + `sharding.axis_rules`),
    like the model; a `context` mesh axis > 1 is not supported.
    """
    tokens, lengths = _checked(
        model, tokens, max_new_tokens, temperature, top_k, top_p, seed, eos_id, prompt_lengths
    )
    graphdef, state = nnx.split(model)
    return _generate(
        graphdef,
        state,
        *_operands(tokens, lengths, seed, temperature, top_p, eos_id),
        max_new_tokens=max_new_tokens,
        cache_len=cache_length(model.cfg, tokens.shape[1] + max_new_tokens),
        top_k=top_k,
        nucleus=top_p is not None,
        rules=current_rules(),
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_len", "top_k", "nucleus", "rules"))
def _stream_prefill(
    graphdef,
    state,
    tokens,
    prompt_lengths,
    key,
    temperature,
    top_p,
    eos_id,
    *,
    cache_len,
    top_k,
    nucleus,
    rules,
):
    """`_generate` up to its first token: (tokens [b], rows done, cache)."""
    with axis_rules(rules):
        logits, cache = prefill(nnx.merge(graphdef, state), tokens, prompt_lengths, cache_len)
    done = jnp.zeros(tokens.shape[:1], bool)
    tok, done = _choose(0, logits, done, key, temperature, top_p, eos_id, top_k=top_k, nucleus=nucleus)
    return tok, done, cache


@functools.partial(
    jax.jit, static_argnames=("graphdef", "top_k", "nucleus", "rules"), donate_argnames=("cache",)
)
def _stream_step(
    graphdef,
    state,
    t,
    tok,
    done,
    cache,
    prompt_lengths,
    key,
    temperature,
    top_p,
    eos_id,
    *,
    top_k,
    nucleus,
    rules,
):
    """One iteration of `_generate`'s loop body: step t >= 1 -> (tokens [b], rows done, cache)."""
    with axis_rules(rules):
        logits, cache = decode_step(nnx.merge(graphdef, state), tok, prompt_lengths + t - 1, cache)
    tok, done = _choose(t, logits, done, key, temperature, top_p, eos_id, top_k=top_k, nucleus=nucleus)
    return tok, done, cache


def stream(
    model: Transformer,
    tokens,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_id: int | None = None,
    prompt_lengths=None,
) -> Iterator[np.ndarray]:
    """`generate`, one step at a time: yields each step's new tokens, int32 numpy [batch]
    (a row past its EOS yields eos_id), and stops where `generate`'s loop stops (after
    `max_new_tokens` steps, or once every row has emitted `eos_id`). Same arguments,
    checks (made at the call) and rules as `generate`, and the same computation: the
    prefill and each loop step are the same functions jitted on their own, driven from
    Python with one host sync per token, so that a caller can show text as it is made.
    The same seed gives the tokens `generate` returns (tests/test_generate.py).
    """
    tokens, lengths = _checked(
        model, tokens, max_new_tokens, temperature, top_k, top_p, seed, eos_id, prompt_lengths
    )
    graphdef, state = nnx.split(model)
    tokens, lengths, *rest = _operands(tokens, lengths, seed, temperature, top_p, eos_id)
    static = dict(top_k=top_k, nucleus=top_p is not None, rules=current_rules())
    cache_len = cache_length(model.cfg, tokens.shape[1] + max_new_tokens)

    def steps():
        tok, done, cache = _stream_prefill(
            graphdef, state, tokens, lengths, *rest, cache_len=cache_len, **static
        )
        for t in range(max_new_tokens):
            if t:
                t_ = jnp.asarray(t, jnp.int32)
                tok, done, cache = _stream_step(
                    graphdef, state, t_, tok, done, cache, lengths, *rest, **static
                )
            host_tok, host_done = jax.device_get((tok, done))
            yield host_tok
            if host_done.all():
                return

    return steps()


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def generate_traced(
    model: Transformer,
    tokens,
    prompt_lengths,
    key,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
) -> jax.Array:
    """`generate` inside a caller's trace (no checks, no jit of its own): right-padded
    prompts int32 [b, P] and their lengths [b] -> int32 [b, P + max_new_tokens], step t
    drawing with `fold_in(key, t)`. For a program that samples with the weights it trains
    (train.objective=grpo: jaxtrain/trainer/rollout.py)."""
    return _generate_traced(
        model,
        tokens,
        prompt_lengths,
        key,
        jnp.asarray(temperature, jnp.float32),
        jnp.asarray(1.0 if top_p is None else top_p, jnp.float32),
        jnp.asarray(-1 if eos_id is None else eos_id, jnp.int32),
        max_new_tokens=max_new_tokens,
        cache_len=cache_length(model.cfg, tokens.shape[1] + max_new_tokens),
        top_k=top_k,
        nucleus=top_p is not None,
    )

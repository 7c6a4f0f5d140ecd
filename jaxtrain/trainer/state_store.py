"""Optimizer state stored as bfloat16 plus an int8 error term (`optimizer.state_dtype:
bfloat16`): Adam's two moments and Muon's momentum, each read back in float32 for the update.

Why an error term. An exponential moving average m <- b m + (1 - b) x changes by a fraction
(1 - b) of itself per step. bfloat16 keeps 8 significant bits: rounded to nearest, a change
under half its step (2^-9 to 2^-8 of the value) is lost. At Adam's b2 = 0.999 the second
moment stopped decaying (after one step with g = 1 and 200 with g = 0 it stayed at 9.99e-4;
float32: 8.18e-4) and, a few hundred steps in, stopped accumulating; Muon's momentum near 1
likewise. The int8 term e keeps the rest: the value is hi (1 + e 2^-15), hi the bfloat16
nearest, so the relative error is at most 2^-16 (2^-15 where the term, 128 at most, clips to
int8's 127): about 15 significant bits, and any b with 1 - b well above 2^-15 follows float32.
The term rounds to nearest, so a decay slightly faster or slower than float32's is left: at
b = 0.999 a step is 32.8 units of the term, rounded to 33 (0.3% lower after 500 steps).

Why not stochastic rounding (2 bytes: rounded up with the probability of the fraction of the
step, so the average is float32's in expectation). Its rounding errors, each up to a bfloat16
step, add up over the average's memory of about 1 / (1 - b) steps: at b = 0.999 each entry
carried a few percent of zero-mean noise, and on configs/tiny.yaml the 300-step loss curve
drifted 5.1e-2 (relative) from float32 state's (round to nearest: 2.9e-2). Stored with the
error term it stays within 2e-3 (tests/test_state_dtype.py). It is also deterministic: no
random bits to seed, resume or keep equal across meshes; each entry is stored alone, so
every sharding stores the same bytes. The price: 3 bytes per entry, not 2 (float32's 4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: The error term's unit, relative to the bfloat16 value: |x - hi| <= 2^-8 |hi|, so the
#: term e = (x - hi) / hi * 2^15 lies within [-128, 128] (clipped to int8's 127 at the edge).
SCALE = 2.0**15


def encode(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 `x` as (bfloat16 hi, int8 e), x ~ hi (1 + e / SCALE). Where hi is 0, inf or
    nan, e is 0 (x is hi)."""
    x = x.astype(jnp.float32)
    hi = x.astype(jnp.bfloat16)
    h = hi.astype(jnp.float32)
    ok = jnp.isfinite(h) & (h != 0)
    e = jnp.where(ok, (x - h) / jnp.where(ok, h, 1.0) * SCALE, 0.0)
    return hi, jnp.clip(jnp.round(e), -127, 127).astype(jnp.int8)


def decode(hi: jax.Array, e: jax.Array) -> jax.Array:
    """`encode`'s inverse, in float32."""
    return hi.astype(jnp.float32) * (1 + e.astype(jnp.float32) / SCALE)  # the factor is exact


def compensated(state_dtype) -> bool:
    """Whether state in `state_dtype` is stored with an error term (bfloat16: yes)."""
    return state_dtype is not None and jnp.dtype(state_dtype) == jnp.dtype(jnp.bfloat16)


def encode_tree(tree) -> tuple:
    """(the bfloat16 tree, the int8 tree) of a float32 tree (XLA computes each `encode` once)."""
    return jax.tree.map(lambda x: encode(x)[0], tree), jax.tree.map(lambda x: encode(x)[1], tree)


def decode_tree(hi, e):
    return jax.tree.map(decode, hi, e)


def zeros_like_tree(params) -> tuple:
    """(bfloat16 zeros, int8 zeros) shaped as `params`."""
    return (
        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.bfloat16), params),
        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.int8), params),
    )

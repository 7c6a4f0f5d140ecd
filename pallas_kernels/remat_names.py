"""Attention's residuals under a checkpoint name, so that a remat policy can keep them.

`jax.checkpoint` policies keep values by name (`checkpoint_name`). Naming attention's output
("context") outside a kernel keeps only the output, but a flash backward also needs the
softmax statistics (the log-sum-exp) that live inside the kernel's `custom_vjp`, so the whole
forward kernel ran again in the backward pass all the same (seen in the H100 profile of
configs/gpu-peer.yaml: cuDNN's forward twice per layer). Names given inside a `custom_vjp`'s
forward rule are visible to the policy, so each kernel wrapper names its own residuals here:
the output and the statistics, not q, k and v (the caller names those, `qkv_proj`).
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

__all__ = ["ATTENTION_RESIDUALS", "with_named_residuals"]

#: The checkpoint name of attention's output and softmax statistics (models' `context`).
ATTENTION_RESIDUALS = "context"


def with_named_residuals(f, *args):
    """f(*args) (arrays in, arrays out), differentiated through `jax.vjp(f)` with every residual
    that is not one of `args` itself named ATTENTION_RESIDUALS.

    For kernels whose forward and backward are not ours to edit (cuDNN's, behind
    `jax.nn.dot_product_attention`): the residuals are the leaves of the vjp closure. `f` must
    close over no traced value (pass those as `args`; integer ones get float0 cotangents)."""

    @jax.custom_vjp
    def run(*a):
        return f(*a)

    def fwd(*a):
        out, pullback = jax.vjp(f, *a)
        # the output once: returned and kept as one value (the output projection's weight
        # gradient reads it too; two names would keep two copies)
        named_out = checkpoint_name(out, ATTENTION_RESIDUALS)
        inputs = {id(x) for x in a}

        def name(r):
            if id(r) in inputs:
                return r
            return named_out if r is out else checkpoint_name(r, ATTENTION_RESIDUALS)

        return named_out, jax.tree.map(name, pullback)

    def bwd(pullback, ct):
        return pullback(ct)

    run.defvjp(fwd, bwd)
    return run(*args)

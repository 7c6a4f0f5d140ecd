"""Pallas kernels (Mosaic TPU / Triton / CPU interpret) with plain-jnp references.

    from jaxtrain.pallas_kernels import flash_attention, reference
    out = flash_attention(q, k, v, causal=True)          # [batch, seq, heads, head_dim]
    ref = reference.attention(q, k, v, causal=True)      # the oracle

Imports only jax and numpy.
"""

from jaxtrain.pallas_kernels import reference
from jaxtrain.pallas_kernels.chunked import chunked_attention
from jaxtrain.pallas_kernels.flash_attention import BlockSizes, default_block_sizes, flash_attention
from jaxtrain.pallas_kernels.ring_attention import ring_attention
from jaxtrain.pallas_kernels.sharded import sharded_flash_attention
from jaxtrain.pallas_kernels.ulysses import ulysses_attention

__all__ = [
    "BlockSizes",
    "chunked_attention",
    "default_block_sizes",
    "flash_attention",
    "reference",
    "ring_attention",
    "sharded_flash_attention",
    "ulysses_attention",
]

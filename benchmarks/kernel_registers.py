"""ptxas' register report for the Hopper flash-attention kernels: compiler figures, no GPU.

    JAX_PLATFORMS=cpu python benchmarks/kernel_registers.py [--head-dims 64,128,256]
        [--masks causal,causal+segments,full] [--blocks "dkv_parts=1"]

For each head_dim and mask it compiles forward + backward of ``flash_attention_mgpu``
(batch 1, seq 1024, 4 query / 2 kv heads, bf16) deviceless for one H100 (sm_90a) and prints,
per kernel, what ptxas reported (``pallas_kernels/ptxas_report.py``): spill stores and loads
(static bytes of spill instructions) and whether it serialised the wgmma instructions for
want of registers (its warning C7512). A kernel that spills in its hot loop, or whose wgmmas
are serialised, loses far more than any tile choice gains. These are compiler figures: they
say nothing of the speed, which only a GPU measures (``benchmarks/attention.py --gpu``).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from attention_gpu import parse_blocks  # noqa: E402  (benchmarks/, this script's folder)
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxtrain.pallas_kernels.flash_mgpu import flash_attention_mgpu  # noqa: E402
from jaxtrain.pallas_kernels.ptxas_report import mosaic_kernel_resources  # noqa: E402
from jaxtrain.sharding import targets  # noqa: E402

MASKS = {
    "causal": dict(causal=True),
    "causal+segments": dict(causal=True, segments=True),
    "causal+window": dict(causal=True, sliding_window=256),
    "full": dict(causal=False),
}


def report(head_dim: int, mask: str, blocks: dict, seq: int = 1024):
    """The kernels' ptxas figures for one case."""
    devices = targets.h100_devices(num_hosts=1, gpus_per_host=1)
    s = NamedSharding(Mesh(np.array(devices), ("data",)), P())
    kw = dict(MASKS[mask])
    seg = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=s) if kw.pop("segments", False) else None
    q = jax.ShapeDtypeStruct((1, seq, 4, head_dim), jnp.bfloat16, sharding=s)
    k = jax.ShapeDtypeStruct((1, seq, 2, head_dim), jnp.bfloat16, sharding=s)

    def loss(q, k, v, seg):
        out = flash_attention_mgpu(q, k, v, segment_ids=seg, **kw, **blocks)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return mosaic_kernel_resources(lambda: grad.lower(q, k, k, seg).compile())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--masks", default="causal,causal+segments,full")
    ap.add_argument("--blocks", default="", help='overrides of default_blocks, e.g. "dkv_parts=1"')
    args = ap.parse_args(argv)
    blocks = parse_blocks([i for i in args.blocks.split(",") if i], "--blocks")
    print(f"jax {jax.__version__}; deviceless H100 (sm_90a); blocks {blocks or 'default'}")
    print("| head_dim | mask | kernel | spill stores / loads (bytes) | wgmma serialised |")
    print("|---:|---|---|---:|---|")
    for d in (int(x) for x in args.head_dims.split(",")):
        for mask in args.masks.split(","):
            for r in report(d, mask, blocks):
                serial = "**yes**" if r.wgmma_serialized else "no"
                spills = f"{r.spill_store_bytes} / {r.spill_load_bytes}"
                print(f"| {d} | {mask} | {r.name} | {spills} | {serial} |")


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("kernel_registers", main))

"""Tile sizes, warps and pipeline stages of the Pallas flash kernel on Triton, timed on this GPU
against cuDNN's attention in the same process.

    python benchmarks/flash_tune.py [--shape 4,4096,32,8,128] [--iters 10] [--budget 240]

Causal GQA attention, bf16, at `--shape B,S,H,KV,D`. First the forward alone over forward
tile / warp / stage choices, then forward + backward over backward choices (split dQ and
dK/dV kernels, or the fused backward) with the default forward. Every row is the median of
`--iters` runs after a warm-up, in TFLOP/s over the causal minimum (benchmarks/attention.py
`causal_flops`: 2 matmuls of S^2/2 x D per head forward, 7 forward + backward) and as a
share of cuDNN's. The kernel's warps and stages come from pallas_kernels/flash_attention.py
`_compiler_params`, which this script replaces per row; a row that fails to compile (shared
memory) shows its error. `--budget` seconds bound the sweep (rows after it are skipped).
The winning rows are what `default_block_sizes` and `_compiler_params` should say for the
GPU measured (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

import jax
import jax.numpy as jnp
from gpu_peer import causal_flops, fwd_bwd, median_time  # benchmarks/ (this script's folder)

from jaxtrain.pallas_kernels import sharded_flash_attention

# the module (the package exports a function of the same name)
fa = importlib.import_module("jaxtrain.pallas_kernels.flash_attention")

# (label, BlockSizes, fwd warps, bwd warps, stages); None: the kernel's own choice
FORWARD = (
    ("default", None, None, None, None),
    ("fwd 128x64 w8 s2", fa.BlockSizes(128, 64), 8, None, 2),
    ("fwd 128x128 w8 s3", fa.BlockSizes(128, 128), 8, None, 3),
    ("fwd 128x64 w4 s3", fa.BlockSizes(128, 64), 4, None, 3),
)
BACKWARD = (
    ("default", None, None, None, None),
    ("split dkv 64x128 dq 128x64 w8 s2", fa.BlockSizes(128, 64, 64, 128, 128, 64, False), None, 8, 2),
    ("split dkv 64x128 dq 128x64 w8 s4", fa.BlockSizes(128, 64, 64, 128, 128, 64, False), None, 8, 4),
    ("split dkv 64x128 dq 128x64 w4 s3", fa.BlockSizes(128, 64, 64, 128, 128, 64, False), None, 4, 3),
    ("split dkv 128x128 dq 128x128 w8 s2", fa.BlockSizes(128, 64, 128, 128, 128, 128, False), None, 8, 2),
    ("split dkv 64x128 dq 64x64 w8 s3", fa.BlockSizes(128, 64, 64, 128, 64, 64, False), None, 8, 3),
    ("fused dkv 64x128 w8 s3", fa.BlockSizes(128, 64, 64, 128, 128, 64, True), None, 8, 3),
)
# earlier rows (H100, 2026-11-26; docs/benchmarks.md): fwd 128x64 / 128x128 / 64x64 / 128x32 at
# w4-8 s2-4 ran 287-328 TFLOP/s (the first row timed in a process ran slow: now a warm-up
# comes first); bwd with 32-wide loop steps 136, fused 100-116

_own_params = fa._compiler_params


def _params_with(fwd_warps, bwd_warps, stages):
    """fa._compiler_params with these warps/stages where given."""

    def params(cfg, kind):
        p = _own_params(cfg, kind)
        if p is None or cfg.backend != "gpu":
            return p
        warps = fwd_warps if kind == "fwd" else bwd_warps
        return type(p)(num_warps=warps or p.num_warps, num_stages=stages or p.num_stages)

    return params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="4,4096,32,8,128")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--budget", type=float, default=240.0)
    args = ap.parse_args()
    b, s, h, kv, d = (int(x) for x in args.shape.split(","))
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, s, h, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, kv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, kv, d), jnp.bfloat16)
    c = jax.random.normal(keys[3], (b, s, h, d), jnp.float32)
    start = time.perf_counter()
    dev = jax.devices()[0]
    print(
        f"## Flash kernel tuning on {dev.device_kind} (jax {jax.__version__}): "
        f"B{b} S{s} H{h}/{kv} D{d} causal bf16"
    )

    def row(label, attend, backward):
        try:
            if backward:
                t = median_time(fwd_bwd(attend), q, k, v, c, iters=args.iters, warmup=1)
            else:
                t = median_time(jax.jit(attend), q, k, v, iters=args.iters, warmup=1)
        except Exception as e:  # noqa: BLE001 - a row that does not compile shows why
            return label, None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        return label, t, causal_flops(b, s, h, d, 7 if backward else 2) / t / 1e12

    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    row("warm-up", cudnn, True)  # the first timing of a process ran slow (clocks, allocator)
    base = {bw: row("cuDNN", cudnn, bw) for bw in (False, True)}
    for backward, table in ((False, FORWARD), (True, BACKWARD)):
        print(f"\n### {'forward + backward' if backward else 'forward'}")
        print("| kernel | ms | TFLOP/s | of cuDNN |\n|---|---:|---:|---:|")
        ref = base[backward]
        if ref[1] is not None:
            print(f"| cuDNN | {ref[1] * 1e3:.2f} | {ref[2]:.0f} | 100% |")
        else:
            print(f"| cuDNN | error | {ref[2]} | |")
        for label, blocks, fw, bw, stages in table:
            if time.perf_counter() - start > args.budget:
                print(f"| {label} | skipped: --budget {args.budget:g} s spent | | |")
                continue
            fa._compiler_params = _params_with(fw, bw, stages)
            attend = lambda q, k, v, blocks=blocks: sharded_flash_attention(
                q, k, v, mesh=None, batch_axes=(), head_axes=(), causal=True, block_sizes=blocks
            )
            label, t, value = row(label, attend, backward)
            fa._compiler_params = _own_params
            if t is None:
                print(f"| {label} | error | {value} | |")
                continue
            share = f"{100 * value / ref[2]:.0f}%" if ref[1] is not None else "n/a"
            print(f"| {label} | {t * 1e3:.2f} | {value:.0f} | {share} |", flush=True)
    print(f"\nswept in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("flash_tune", main))

"""Flash attention backward, split (dQ + dK/dV kernels) vs fused: compiler estimates, no hardware.

    JAX_PLATFORMS=cpu python benchmarks/flash_bwd.py [--seqs 8192,32768] [--targets tpu,gpu]

Shape: batch 8, 16 heads, head_dim 128, bf16, causal, forward + backward
(value_and_grad of sum(o**2)), batch-sharded over 8 compile-only devices
(TPU v5p 2x2x2 / 8 x H100), as ``benchmarks/attention.py``. Per target, seq
and backward (``BlockSizes(fused_bwd=False / True)`` on the backend's default
tiles) it prints:

* what the Pallas kernels declare (``pl.CostEstimate``, summed per kernel, per
  device): XLA's TPU cost model charges a Mosaic custom call exactly that;
* TPU v5p ``cost_analysis``: FLOPs, bytes accessed, ``optimal_seconds``;
* ``memory_analysis`` temp bytes per device (both targets; H100 compiles give
  no cost analysis).

All of these are compiler numbers from deviceless compiles, not measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from jaxtrain.pallas_kernels import default_block_sizes, sharded_flash_attention  # noqa: E402
from jaxtrain.pallas_kernels.flash_attention import declared_costs  # noqa: E402
from jaxtrain.sharding import targets  # noqa: E402

BATCH, HEADS, HEAD_DIM = 8, 16, 128
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")


def _mesh(target: str) -> Mesh:
    devices = targets.tpu_topology_devices("v5p:2x2x2") if target == "tpu" else targets.h100_devices(1, 8)
    return Mesh(np.array(devices), ("data",))


def _compile(target: str, mesh: Mesh, seq: int, fused: bool) -> dict:
    blocks = dataclasses.replace(default_block_sizes(target, HEAD_DIM, jnp.bfloat16), fused_bwd=fused)

    def loss(q, k, v):
        o = sharded_flash_attention(
            q, k, v, mesh=mesh, batch_axes=("data",), head_axes=(), causal=True, block_sizes=blocks
        )
        return jnp.sum(o.astype(jnp.float32) ** 2)

    x = jax.ShapeDtypeStruct(
        (BATCH, seq, HEADS, HEAD_DIM), jnp.bfloat16, sharding=NamedSharding(mesh, P("data"))
    )
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    start = time.perf_counter()
    declared = declared_costs(jax.make_jaxpr(fn)(x, x, x))
    try:
        compiled = fn.lower(x, x, x).compile()
    except Exception as e:  # noqa: BLE001 - reported: a kernel that does not compile is a result
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return {"error": first[:160], "declared": declared, "seconds": time.perf_counter() - start}
    return {
        "declared": declared,
        "memory": targets.compiled_memory(compiled),
        "cost": targets.compiled_cost(compiled),
        "seconds": time.perf_counter() - start,
    }


def _fmt_bytes(n) -> str:
    return f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="8192,32768")
    parser.add_argument("--targets", default="tpu,gpu")
    args = parser.parse_args(argv)
    seqs = [int(s) for s in args.seqs.split(",")]
    names = {"tpu": "TPU v5p", "gpu": "H100"}
    rows = []
    for target in [t for t in args.targets.split(",") if t]:
        try:
            mesh = _mesh(target)
        except targets.DevicelessUnavailableError as e:
            print(f"skipping {target}: {e}", file=sys.stderr)
            continue
        for seq in seqs:
            for fused in (False, True):
                r = _compile(target, mesh, seq, fused)
                print(f"[{target} seq {seq} fused={fused}: {r['seconds']:.1f}s]", file=sys.stderr)
                rows.append((target, seq, fused, r))

    shape = f"batch {BATCH}, {HEADS} heads, head_dim {HEAD_DIM}, bf16, causal, fwd+bwd, per device of 8"
    print(f"\n### Declared kernel costs ({shape})\n")
    print("| target | seq | backward | kernel | calls | FLOPs | bytes |")
    print("|---|---:|---|---|---:|---:|---:|")
    for target, seq, fused, r in rows:
        for kernel, c in sorted(r["declared"].items()):
            print(
                f"| {names[target]} | {seq} | {'fused' if fused else 'split'} | {kernel} | {c['calls']} | "
                f"{c['flops'] / 1e12:.2f} T | {_fmt_bytes(c['bytes_accessed'])} |"
            )
    print(f"\n### Compiler estimates ({shape})\n")
    print("| target | seq | backward | FLOPs | bytes accessed | XLA est. time | temp memory |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for target, seq, fused, r in rows:
        label = "fused" if fused else "split"
        if "error" in r:
            print(f"| {names[target]} | {seq} | {label} | fails: {r['error'][:80].replace('|', '/')} | | | |")
            continue
        cost = r.get("cost") or {}
        est = cost.get("optimal_seconds")
        flops = f"{cost['flops'] / 1e12:.2f} T" if "flops" in cost else "n/a"
        nbytes = _fmt_bytes(cost["bytes accessed"]) if "bytes accessed" in cost else "n/a"
        est_s = f"{est * 1e3:.2f} ms" if est is not None else "n/a"
        temp = _fmt_bytes(r["memory"]["temp"])
        print(f"| {names[target]} | {seq} | {label} | {flops} | {nbytes} | {est_s} | {temp} |")
    return 0


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("flash_bwd", main))

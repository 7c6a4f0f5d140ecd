"""Context parallelism: deviceless TPU v5p / H100 compiles of ring attention (no hardware).

    JAX_PLATFORMS=cpu python benchmarks/context.py [--seq 131072] [--contexts 2,4,8] [--targets tpu,gpu]

Shape: batch 1, 16 heads, head_dim 128, bf16, causal, forward + backward
(value_and_grad of sum(o**2)), the sequence sharded over a ``context`` mesh
axis of n compile-only devices (the first n of a TPU v5p 2x2x2 topology / of
8 H100s), load-balanced ring attention with the Pallas flash kernels per block
(``--impls ring,ulysses`` adds DeepSpeed-Ulysses; context 1 is one device).
Per context size it prints (markdown) the compiled per-device temp and
argument memory (``memory_analysis``), the number of collective-permutes in
the optimized HLO, the number of all-gathers whose result holds the full
sequence (must be 0: no device gathers K/V), and the compile time.
These are compiler facts (it partitions, fits, emits these collectives), not
speed measurements.
"""

from __future__ import annotations

import argparse
import os
import re
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

from jaxtrain.pallas_kernels import ring_attention, ulysses_attention  # noqa: E402
from jaxtrain.sharding import targets  # noqa: E402

BATCH, HEADS, HEAD_DIM = 1, 16, 128
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")


def context_mesh(target: str, n: int) -> Mesh:
    devices = targets.tpu_topology_devices("v5p:2x2x2") if target == "tpu" else targets.h100_devices(1, 8)
    return Mesh(np.array(devices[:n]), ("context",))


def full_sequence_all_gathers(hlo: str, seq: int) -> int:
    """all-gather ops whose result shape has a dimension of the whole sequence."""
    count = 0
    for line in hlo.splitlines():
        if re.search(r"\ball-gather(-start)?\(", line):
            lhs = line.split("all-gather")[0]
            dims = [int(d) for shape in re.findall(r"\[([\d,]+)\]", lhs) for d in shape.split(",")]
            count += seq in dims
    return count


def overlapped_permutes(hlo: str) -> tuple[int, int]:
    """(async collective-permutes with a Pallas kernel call scheduled between
    their start and done, all async collective-permutes), from the scheduled
    HLO text (instruction order within a computation is the schedule)."""
    open_starts: dict[str, bool] = {}
    overlapped = total = 0
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?(\S+) = .*collective-permute-start\(", line)
        if m:
            open_starts[m.group(1)] = False
            continue
        if "custom-call(" in line and ("tpu_custom_call" in line or "triton" in line):
            for name in open_starts:
                open_starts[name] = True
        m = re.search(r"collective-permute-done\((?:\S+ )?%?([\w.\-]+)\)", line)
        if m and m.group(1) in open_starts:
            total += 1
            overlapped += open_starts.pop(m.group(1))
    return overlapped, total


def compile_ring(target: str, n: int, seq: int, impl: str = "ring", **attn_kwargs) -> dict:
    """Deviceless compile of fwd+bwd ring (or Ulysses) attention over n devices
    (``attn_kwargs``: e.g. sliding_window, softcap)."""
    mesh = context_mesh(target, n)
    attn = {"ring": ring_attention, "ulysses": ulysses_attention}[impl]
    x = jax.ShapeDtypeStruct(
        (BATCH, seq, HEADS, HEAD_DIM), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "context"))
    )

    def loss(q, k, v):
        o = attn(q, k, v, mesh=mesh, causal=True, load_balanced=True, **attn_kwargs)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    start = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    except Exception as e:  # noqa: BLE001 - a program that does not compile is a row of the table
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return {"error": first[:160], "seconds": time.perf_counter() - start}
    hlo = compiled.as_text()
    return {
        "memory": targets.compiled_memory(compiled),
        "permutes": len(re.findall(r"collective-permute(-start)?\(", hlo)),
        "gathers": full_sequence_all_gathers(hlo, seq),
        "overlapped": overlapped_permutes(hlo),
        "custom_calls": targets.custom_call_targets(hlo),
        "seconds": time.perf_counter() - start,
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--contexts", default="2,4,8")
    parser.add_argument("--targets", default="tpu,gpu")
    parser.add_argument("--impls", default="ring", help="ring,ulysses")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    print(
        f"context-parallel attention fwd+bwd, batch {BATCH}, seq {args.seq}, {HEADS} heads, head_dim "
        f"{HEAD_DIM}, bf16, causal, load-balanced; deviceless compiles, per device\n"
    )
    print(
        "| impl | target | context | tokens/device | temp | arguments | temp x context "
        "| collective-permutes | async, kernel between start/done | full-seq all-gathers | compile s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    failed = False
    runs = [(i, t, n) for i in args.impls.split(",") for t in args.targets.split(",") if t for n in contexts]
    for impl, target, n in runs:
        r = compile_ring(target, n, args.seq, impl)
        name = f"{impl} | " + ("TPU v5p" if target == "tpu" else "H100")
        if "error" in r:
            failed = True
            print(
                f"| {name} | {n} | {args.seq // n} | fails: {r['error'].replace('|', '/')} "
                f"| | | | | | {r['seconds']:.0f} |",
                flush=True,
            )
            continue
        m, ov = r["memory"], r["overlapped"]
        print(
            f"| {name} | {n} | {args.seq // n} | {_mib(m['temp'])} | {_mib(m['argument'])} "
            f"| {_mib(m['temp'] * n)} | {r['permutes']} | {ov[0]} of {ov[1]} | {r['gathers']} "
            f"| {r['seconds']:.0f} |",
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("context", main))

"""Attention kernels side by side: deviceless TPU v5p / H100 compiles (no hardware).

    JAX_PLATFORMS=cpu python benchmarks/attention.py [--seqs 8192,16384,...] [--targets tpu,gpu]
        [--kernels flash,chunked,ring,tokamax,tokamax-tuned,tokamax-triton] [--batch 8] [--chunks 4]
    python benchmarks/attention.py --gpu [--check] ...   (timed on one real GPU, with a cuDNN
        column: benchmarks/attention_gpu.py)

Every kernel gets the same global problem: batch 8, 16 heads, head_dim 128,
bf16, causal, forward + backward (value_and_grad of sum(o**2)), on 8
compile-only devices (TPU v5p 2x2x2 / 8 x H100). The mesh differs by kernel
and is named in the tables:

- ``flash`` (ours, ``sharded_flash_attention``): batch-sharded, mesh data=8,
  the kernel per shard in shard_map. On TPU past about 64k tokens one head's
  K/V no longer fits VMEM and it runs chunked (``flash_attention_any_length``).
- ``chunked`` (ours, ``chunked_attention``): mesh data=8, each device's
  sequence cut into ``--chunks`` chunks (default 4: the ring's per-block
  kernels for the 10 causal chunk pairs, nothing travelling), to show what
  chunking costs next to one flash call.
- ``ring`` (ours, ``ring_attention``, load-balanced zig-zag): mesh context=8,
  the sequence sharded, each device holding all 8 batch rows of S/8 tokens.
- ``tokamax`` (Tokamax 0.0.17, ``tokamax.dot_product_attention(...,
  implementation="mosaic")``): mesh data=8, per shard in shard_map. On TPU that
  is its Mosaic TPU kernel (a Splash attention, forward kernel + one fused
  dQ/dK/dV backward kernel) with the config Tokamax picks by itself: its
  autotuning cache for device kind "TPU v5" when the exact shape is there
  (only the forward at 16k: [1, 16384, 16, 128] causal), else its heuristic
  (128 x 128 blocks; the backward is never in the v5 cache). On H100 it is its
  Mosaic GPU sm90 kernel, configured the same way: its "NVIDIA H100 80GB HBM3"
  cache has forward and backward entries for 16k, heuristics elsewhere.
- ``tokamax-tuned`` (TPU only): the same Mosaic TPU kernel with the blocks
  Tokamax's own autotuning cache lists as fastest for the nearest cached shape
  (forward: block_q 2048, block_kv 1024, block_kv_compute 256, from the v5
  entry for [1, 16384, 16, 128] causal; backward: block_kv_dkv 2048,
  block_kv_dkv_compute 512 from its only cached backward, tpu7x, same shape,
  with block_q_dkv 1024 instead of its 2048, which runs out of v5p VMEM from
  16k on), fixed for every sequence.
- ``tokamax-triton`` (GPU only): ``implementation="triton"`` (Pallas Triton;
  config from its H100 cache at 16k, heuristics elsewhere).
- ``tokamax-ring`` (TPU only): Tokamax's experimental ring attention
  (``tokamax._src.ops.experimental.tpu.splash_attention.ring_attention_kernel``,
  Splash per ring step), mesh context=8, set up as its own test does. Causal
  but not load-balanced (shard i holds contiguous chunk i), and it takes the
  mask as a dense S x S numpy array on the host, so it is skipped past 32k
  (16 GiB of host memory at 128k).
- ``upstream`` (TPU only; not in the default set):
  ``jax.experimental.pallas.ops.tpu.flash_attention`` on [B, H, S, D], data=8.
- ``xla`` (not in the default set): ``jax.nn.dot_product_attention(
  implementation="xla")``, automatic partitioning; quadratic memory.

Tokamax chooses its kernel generation from jax's default device at trace time
(``gpu_utils.is_sm90()``, ``"NVIDIA" in device_kind``), which under
JAX_PLATFORMS=cpu is the CPU; the benchmark traces its kernels under
``jax.default_device(<first compile-only device of the target>)`` and
``tokamax.config.cross_compile(True)``, so Tokamax sees the target's device kind
and compute capability (9.0). Nothing else is patched.

Prints markdown:

1. Compiled temp memory per device (``memory_analysis``) on both targets.
2. TPU v5p ``cost_analysis`` per device: FLOPs, bytes accessed and XLA's
   ``optimal_seconds``. XLA does not look inside a Pallas custom call: these
   numbers are what each kernel declares in its ``pl.CostEstimate`` plus the
   XLA ops around it. Ours counts the matmuls and HBM traffic of the blocks it
   visits: 7 seq x seq x D matmuls per head for causal fwd+bwd with the fused
   backward (the TPU default), 9 with the split one (S and dP recomputed in both
   backward kernels; BlockSizes.fused_bwd=False). Tokamax (Splash) declares 2 matmuls
   (fwd) + 5 (fused bwd) times the fraction of (q, kv) blocks not fully masked,
   and bytes as each input and output read or written once, not the re-reads
   of K/V per q block. Upstream declares its forward as dense attention and
   nothing for its backward. All are compiler estimates, not measurements;
   GPU compiles have no cost analysis, so H100 shows temp memory only.
3. The compile time of each row (this host, loaded or not: say which).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import math
import os
import sys
import time
import warnings

if __name__ == "__main__" and "--gpu" in sys.argv:  # before this process pins itself to the CPU
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import attention_gpu
    import result_file

    sys.exit(result_file.run("attention_gpu", lambda: attention_gpu.main(sys.argv[1:])))

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from jaxtrain.pallas_kernels import chunked_attention, ring_attention, sharded_flash_attention  # noqa: E402
from jaxtrain.sharding import targets  # noqa: E402

BATCH, HEADS, HEAD_DIM, DEVICES = 8, 16, 128, 8
SCALE = 1 / math.sqrt(HEAD_DIM)
TOKAMAX_PIP = "pip install tokamax==0.0.17 (or this project's 'bench' extra)"
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One attention implementation: how to build it on a mesh, and where it runs."""

    name: str
    label: str
    axis: str  # the mesh axis: "data" (batch-sharded) or "context" (sequence-sharded)
    targets: tuple[str, ...] = ("tpu", "gpu")
    layout: str = "bshd"
    tokamax: bool = False


KERNELS = {
    k.name: k
    for k in (
        Kernel("flash", "ours flash", "data"),
        Kernel("chunked", "ours chunked", "data"),
        Kernel("ring", "ours ring", "context"),
        Kernel("tokamax", "Tokamax mosaic", "data", tokamax=True),
        Kernel("tokamax-tuned", "Tokamax mosaic, tuned blocks", "data", ("tpu",), tokamax=True),
        Kernel("tokamax-triton", "Tokamax triton", "data", ("gpu",), tokamax=True),
        Kernel("tokamax-ring", "Tokamax ring (experimental)", "context", ("tpu",), tokamax=True),
        Kernel("upstream", "jax upstream Pallas", "data", ("tpu",), layout="bhsd"),
        Kernel("xla", "XLA dense", "data"),
    )
}
DEFAULT_KERNELS = "flash,chunked,ring,tokamax,tokamax-tuned,tokamax-triton,tokamax-ring"
# Tokamax's ring takes the causal mask as a dense S x S numpy array on the host.
TOKAMAX_RING_MAX_SEQ = 32768
TARGET_NAMES = {"tpu": "TPU v5p", "gpu": "H100"}


def tokamax_available() -> bool:
    return importlib.util.find_spec("tokamax") is not None


def target_devices(target: str) -> list:
    return targets.tpu_topology_devices("v5p:2x2x2") if target == "tpu" else targets.h100_devices(1, 8)


def _spec(kernel: Kernel) -> P:
    """Global input sharding: batch over data, or sequence over context."""
    if kernel.axis == "context":
        return P(None, "context")
    return P("data")


def _shard_map(local, mesh):
    spec = P("data")
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)


def _tokamax_op(kernel: Kernel, target: str):
    """The Tokamax call for ``kernel`` on ``target`` (per shard, [B, S, H, D])."""
    import tokamax

    if kernel.name == "tokamax-tuned":
        from tokamax._src.ops.attention import base, pallas_mosaic_tpu, pallas_mosaic_tpu_vjp
        from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash

        minor = splash.QKVLayout.HEAD_DIM_MINOR
        fwd = pallas_mosaic_tpu.Config(
            block_q=2048,
            block_kv=1024,
            block_kv_compute=256,
            q_layout=minor,
            k_layout=splash.QKVLayout.SEQ_MINOR,
            v_layout=minor,
            use_experimental_scheduler=False,
        )
        # The cached backward (tpu7x) has block_q_dkv 2048, which runs out of v5p VMEM from 16k on
        # (CompileTimeScopedVmemOom); 1024 compiles.
        bwd = pallas_mosaic_tpu_vjp.Config(block_q_dkv=1024, block_kv_dkv=2048, block_kv_dkv_compute=512)
        op = pallas_mosaic_tpu.PallasMosaicTpuFlashAttention(
            config=fwd, vjp=pallas_mosaic_tpu_vjp.PallasMosaicTpuFlashAttentionVjp(config=bwd)
        )
        return lambda q, k, v: op(q, k, v, mask=base.Mask(None, is_causal=True), logits_scale=SCALE)
    impl = "triton" if kernel.name == "tokamax-triton" else "mosaic"
    return lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, is_causal=True, scale=SCALE, implementation=impl
    )


def _tokamax_ring(mesh: Mesh, seq: int):
    """Tokamax's experimental ring attention (Splash per step) over mesh axis context, set up as
    its own test does (default SplashConfig with use_base2_exp=False, fuse_reciprocal=True).
    Causal without load balancing: shard i holds contiguous chunk i. Per shard it takes
    [heads, seq, head_dim]; the batch is vmapped."""
    from tokamax._src.ops.experimental.tpu.splash_attention import ring_attention_kernel as ring_lib
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as mask_lib

    n = mesh.shape["context"]
    config = dataclasses.replace(splash.SplashConfig.get_default(), use_base2_exp=False, fuse_reciprocal=True)
    kernel = ring_lib.make_ring_attention(
        mask_lib.make_causal_mask((seq, seq)),
        is_mqa=False,
        ring_axis="context",
        config=config,
        save_residuals=False,
        q_seq_shards=n,
        kv_seq_shards=n,
    )
    spec = P(None, "context")

    def local(kernel, q, k, v):  # [B, S/n, H, D]
        heads_first = lambda x: jnp.swapaxes(x, 1, 2)
        o = jax.vmap(lambda q, k, v: kernel(q, k, v, None))(
            heads_first(q * jnp.asarray(SCALE, q.dtype)), heads_first(k), heads_first(v)
        )
        return heads_first(o)

    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(kernel.manual_sharding_spec(), spec, spec, spec),
        out_specs=spec,
        check_vma=False,
    )
    return lambda q, k, v: fn(kernel, q, k, v)


def build(kernel: Kernel, target: str, mesh: Mesh, seq: int, chunks: int):
    """The global attention function for ``kernel`` on ``mesh``."""
    backend = "tpu" if target == "tpu" else "gpu"
    if kernel.name == "flash":
        return lambda q, k, v: sharded_flash_attention(
            q, k, v, mesh=mesh, batch_axes=("data",), head_axes=(), causal=True
        )
    if kernel.name == "chunked":
        return _shard_map(
            lambda q, k, v: chunked_attention(
                q, k, v, causal=True, chunks=chunks, backend=backend, block_impl="pallas"
            ),
            mesh,
        )
    if kernel.name == "ring":
        return lambda q, k, v: ring_attention(q, k, v, mesh=mesh, causal=True, load_balanced=True)
    if kernel.name == "tokamax-ring":
        return _tokamax_ring(mesh, seq)
    if kernel.tokamax:
        return _shard_map(_tokamax_op(kernel, target), mesh)
    if kernel.name == "upstream":
        from jax.experimental.pallas.ops.tpu import flash_attention as upstream

        def local(q, k, v):  # [B, H, S, D]
            return upstream.flash_attention(q, k, v, causal=True, sm_scale=SCALE)

        return _shard_map(local, mesh)
    if kernel.name == "xla":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    raise ValueError(f"unknown kernel {kernel.name!r}; expected one of {sorted(KERNELS)}")


def _error_text(e: BaseException, limit: int = 400) -> str:
    """The exception's type and message on one line (the compiler's OOM reports are several lines)."""
    text = " ".join(ln.strip() for ln in str(e).strip().splitlines() if ln.strip())
    text = f"{type(e).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def skip_reason(kernel: Kernel, target: str) -> str | None:
    """Why ``kernel`` has no row on ``target`` (None: it compiles there)."""
    if target not in kernel.targets:
        other = " / ".join(TARGET_NAMES[t] for t in kernel.targets)
        return f"n/a ({other} only)"
    if kernel.tokamax and not tokamax_available():
        return f"tokamax not installed: {TOKAMAX_PIP}"
    return None


def compile_row(kernel: Kernel, target: str, devices: list, seq: int, *, batch: int, chunks: int) -> dict:
    """Deviceless compile of fwd+bwd attention; memory, cost (TPU) and compile seconds, or the error."""
    if (reason := skip_reason(kernel, target)) is not None:
        return {"skip": reason}
    if kernel.name == "tokamax-ring" and seq > TOKAMAX_RING_MAX_SEQ:
        return {"skip": f"skipped: needs a dense S x S host mask ({fmt_bytes(seq * seq)})"}
    mesh = Mesh(np.array(devices), (kernel.axis,))
    shape = (batch, seq, HEADS, HEAD_DIM) if kernel.layout == "bshd" else (batch, HEADS, seq, HEAD_DIM)
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, _spec(kernel)))
    start = time.perf_counter()
    try:
        attn = build(kernel, target, mesh, seq, chunks)

        def loss(q, k, v):
            return jnp.sum(attn(q, k, v).astype(jnp.float32) ** 2)

        with contextlib.ExitStack() as stack:
            stack.enter_context(jax.set_mesh(mesh))
            if kernel.tokamax:
                import tokamax

                stack.enter_context(tokamax.config.cross_compile(True))
                stack.enter_context(jax.default_device(devices[0]))
            compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    except Exception as e:  # noqa: BLE001 - a kernel that cannot lower or fit: the table shows why
        return {"error": _error_text(e), "seconds": time.perf_counter() - start}
    return {
        "memory": targets.compiled_memory(compiled),
        "cost": targets.compiled_cost(compiled),
        "seconds": time.perf_counter() - start,
    }


def causal_flops(seq: int, batch: int) -> float:
    """The minimum for causal fwd+bwd: 7 matmuls of (seq^2 / 2) x head_dim per head, per device."""
    return 7 * 2 * (seq * seq / 2) * HEAD_DIM * HEADS * batch / DEVICES


def fmt_bytes(n) -> str:
    return f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


class Notes:
    """Numbered footnotes for failed compiles: the table cell names the note, the note
    gives the compiler's message (too long for a cell)."""

    def __init__(self):
        self.texts: list[str] = []

    def ref(self, text: str) -> int:
        if text not in self.texts:
            self.texts.append(text)
        return self.texts.index(text) + 1

    def print(self) -> None:
        if self.texts:
            print()
        for i, text in enumerate(self.texts, 1):
            print(f"[{i}] {text.replace('|', '/')}  ")


def is_oom(err: str) -> bool:
    return "RESOURCE_EXHAUSTED" in err or "Oom" in err or "out of memory" in err.lower()


def mem_cell(result: dict, notes: Notes) -> str:
    if "skip" in result:
        return result["skip"].replace("|", "/")
    if "error" in result:
        err = result["error"]
        what = "out of memory" if is_oom(err) else "fails"
        return f"{what} [{notes.ref(err)}]"
    return fmt_bytes(result["memory"]["temp"])


def cost_cells(result: dict, notes: Notes, mark: str = "") -> list[str]:
    """FLOPs, bytes accessed, XLA est. time (TPU)."""
    if "skip" in result or "error" in result:
        return [mem_cell(result, notes), "", ""]
    cost = result.get("cost") or {}
    est = cost.get("optimal_seconds")
    return [
        f"{cost.get('flops', float('nan')) / 1e12:.2f} T{mark}",
        fmt_bytes(cost.get("bytes accessed", 0)) + mark,
        (f"{est * 1e3:.2f} ms" if est is not None else "n/a") + mark,
    ]


def _mesh_label(kernel: Kernel) -> str:
    return "data=8" if kernel.axis == "data" else "context=8"


def print_tables(results: dict, kernels: list[Kernel], target_list: list[str], seqs: list[int], args) -> None:
    shape = (
        f"batch {args.batch}, {HEADS} heads, head_dim {HEAD_DIM}, bf16, causal, fwd+bwd, "
        f"8 devices (TPU v5p 2x2x2 / 8 x H100)"
    )
    notes = Notes()
    cols = [(t, k) for t in target_list for k in kernels if t in k.targets]
    for target in target_list:
        tcols = [k for t, k in cols if t == target]
        print(f"\n### {TARGET_NAMES[target]}: compiled temp memory per device ({shape})\n")
        print(
            "memory_analysis() of deviceless compiles: compiler numbers, not measurements. "
            "Mesh per column in brackets: data=8 shards the batch, context=8 the sequence "
            f"(same global shape). ours chunked: {args.chunks} chunks per device.\n"
        )
        print("| seq | " + " | ".join(f"{k.label} [{_mesh_label(k)}]" for k in tcols) + " |")
        print("|---:|" + "---:|" * len(tcols))
        for seq in seqs:
            cells = [mem_cell(results[(target, k.name, seq)], notes) for k in tcols]
            print(f"| {seq} | " + " | ".join(cells) + " |")

    tpu_kernels = [k for k in kernels if "tpu" in k.targets]
    if "tpu" in target_list and tpu_kernels:
        print(f"\n### TPU v5p compiler cost estimates per device ({shape})\n")
        print(
            "cost_analysis() of the same compiles: for Pallas custom calls XLA reports each kernel's "
            "own pl.CostEstimate (see the benchmark's docstring for what each declares). "
            "Estimates, not measurements. H100 compiles have no cost analysis.\n"
        )
        print("| seq | kernel [mesh] | FLOPs | bytes accessed | XLA est. time |")
        print("|---:|---|---:|---:|---:|")
        for seq in seqs:
            for k in tpu_kernels:
                mark = " *" if k.name == "ring" else ""
                cells = cost_cells(results[("tpu", k.name, seq)], notes, mark)
                print(f"| {seq} | {k.label} [{_mesh_label(k)}] | " + " | ".join(cells) + " |")
        print(
            "\nFor scale, causal fwd+bwd needs at least 7 matmuls of (S^2/2) x D per head: "
            + ", ".join(f"{causal_flops(seq, args.batch) / 1e12:.2f} T at {seq}" for seq in seqs)
            + " per device."
        )
        if any(k.name == "ring" for k in tpu_kernels):
            print(
                "\n\\* The ring's steps 1..n-2 are a fori_loop, and XLA's cost analysis counts a "
                "loop body once: the ring rows cover 3 of its 8 steps (forward and backward), "
                "so they undercount and do not compare with the other rows."
            )
    notes.print()

    print("\n### Compile seconds per row (this host)\n")
    print("| seq | " + " | ".join(f"{TARGET_NAMES[t]} {k.label}" for t, k in cols) + " |")
    print("|---:|" + "---:|" * len(cols))
    for seq in seqs:
        cells = []
        for t, k in cols:
            r = results[(t, k.name, seq)]
            cells.append(f"{r['seconds']:.0f}" if "seconds" in r else "")
        print(f"| {seq} | " + " | ".join(cells) + " |")


def parse_list(text: str, name: str, allowed=None) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise SystemExit(f"--{name}: empty list")
    if allowed is not None:
        bad = [s for s in items if s not in allowed]
        if bad:
            raise SystemExit(f"--{name}: unknown {bad}; expected some of {sorted(allowed)}")
    return items


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="8192,16384,32768,65536,131072")
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="time on one real GPU instead (benchmarks/attention_gpu.py: "
        "--cases, --impls, --iters, --check, --tiny, --json)",
    )
    parser.add_argument("--targets", default="tpu,gpu")
    parser.add_argument("--kernels", default=DEFAULT_KERNELS, help=f"any of {','.join(KERNELS)}")
    parser.add_argument("--batch", type=int, default=BATCH, help="global batch (a multiple of 8)")
    parser.add_argument("--chunks", type=int, default=4, help="sequence chunks per device for 'chunked'")
    args = parser.parse_args(argv)
    seqs = [int(s) for s in parse_list(args.seqs, "seqs")]
    if args.batch < DEVICES or args.batch % DEVICES:
        raise SystemExit(f"--batch must be a positive multiple of {DEVICES}, got {args.batch}")
    if args.chunks < 1 or any(seq % args.chunks for seq in seqs):
        raise SystemExit(f"--chunks must be >= 1 and divide every seq, got {args.chunks} for {seqs}")
    kernels = [KERNELS[n] for n in parse_list(args.kernels, "kernels", KERNELS)]
    wanted = parse_list(args.targets, "targets", TARGET_NAMES)
    if any(k.tokamax for k in kernels) and not tokamax_available():
        print(f"tokamax not installed: {TOKAMAX_PIP}; its columns say so", file=sys.stderr)

    devices, target_list = {}, []
    for target in wanted:
        try:
            devices[target] = target_devices(target)
            target_list.append(target)
        except targets.DevicelessUnavailableError as e:
            print(f"skipping {target}: {e}", file=sys.stderr)

    results = {}
    for target in target_list:
        for seq in seqs:
            for k in kernels:
                r = compile_row(k, target, devices[target], seq, batch=args.batch, chunks=args.chunks)
                results[(target, k.name, seq)] = r
                if "skip" not in r:
                    status = "ok" if "memory" in r else r["error"][:100]
                    print(f"[{target} {k.name} seq {seq}: {r['seconds']:.1f}s {status}]", file=sys.stderr)
    if target_list:
        print_tables(results, kernels, target_list, seqs, args)
    return 0


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("attention", main))

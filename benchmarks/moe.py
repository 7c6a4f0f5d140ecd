"""Mixture-of-experts dispatch: CPU throughput and deviceless TPU/H100 compiles.

    python benchmarks/moe.py [--steps 12] [--skip-train] [--skip-compile]
    python benchmarks/moe.py --gpu [--tiny] ...   (one real GPU: benchmarks/moe_gpu.py)

1. Tokens/s of configs/tiny-moe.yaml training on 8 simulated CPU devices, capacity
   vs dropless dispatch, with expert=8 (expert parallelism, all_to_all) and
   expert=1 (fsdp=8, every device holds every expert). Median step time over
   steps 3..N. CPU timings on a shared machine are indicative only.
2. One Mixtral-8x7B-shaped MoE layer (D=4096, F=14336, E=8, top-2, bf16, one
   4096-token sequence per device), forward + backward, compiled deviceless for
   8 TPU v5p chips and 8 H100s with mesh expert=8: per-device memory
   (memory_analysis) and the bytes of all-to-all results in the optimized HLO
   (for ragged-all-to-all: the size of its worst-case output buffer; the bytes on
   the wire are the real rows only). Proves it partitions, compiles and fits,
   not speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and "--gpu" in sys.argv:  # before this process pins itself to the CPU
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import moe_gpu
    import result_file

    sys.exit(result_file.run("moe_gpu", lambda: moe_gpu.main(sys.argv[1:])))

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxtrain import sharding  # noqa: E402
from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.models.config import MoEConfig  # noqa: E402
from jaxtrain.planning.report import collectives  # noqa: E402


def train_throughput(dispatch: str, expert: int, steps: int) -> dict:
    from jaxtrain.trainer import train

    mesh = ["mesh.expert=8"] if expert == 8 else ["mesh.fsdp=8"]
    out = tempfile.mkdtemp(prefix=f"moe-{dispatch}-{expert}-")
    cfg = load_config(
        REPO / "configs" / "tiny-moe.yaml",
        [
            f"output_dir={out}",
            "logging.progress=false",
            "logging.tensorboard=false",
            f"train.steps={steps}",
            f"model.moe.dispatch={dispatch}",
            *mesh,
        ],
    )
    records = train(cfg, devices=jax.devices()[:8]).metrics
    timed = [r for r in records if 3 <= r["step"] <= steps]
    step = statistics.median(r["step_time_s"] for r in timed)
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    return {
        "dispatch": dispatch,
        "expert": expert,
        "step_s": step,
        "tokens_per_s": tokens / step,
        "dropped": statistics.mean(r["moe_dropped_fraction"] for r in timed),
        "final_loss": records[-1]["loss"],
    }


def all_to_all_bytes(hlo: str) -> dict[str, int]:
    """Summed result bytes of the all-to-all / ragged-all-to-all ops in optimized HLO text."""
    found = collectives(hlo)
    return {k: v["bytes"] for k, v in found.items() if k in ("all-to-all", "ragged-all-to-all")}


def compile_mixtral_layer(devices, dispatch: str, exchange: str) -> dict:
    from jaxtrain.models.moe import moe_layer
    from jaxtrain.sharding.targets import compiled_memory

    m = MoEConfig(num_experts=8, top_k=2, dispatch=dispatch, exchange=exchange, capacity_factor=1.25)
    b, s, d, f, e = 8, 4096, 4096, 14336, 8
    mesh = sharding.make_mesh({"expert": 8}, devices)
    rules = sharding.DEFAULT_RULES
    spec = lambda axes, shape: jax.sharding.NamedSharding(
        mesh, sharding.logical_to_spec(axes, rules, mesh, shape)
    )
    shapes = {
        "x": ((b, s, d), ("batch", "seq", "act_embed"), jnp.bfloat16),
        "w_router": ((d, e), ("embed", None), jnp.float32),
        "w_gate": ((e, d, f), ("expert", "embed", "mlp"), jnp.bfloat16),
        "w_up": ((e, d, f), ("expert", "embed", "mlp"), jnp.bfloat16),
        "w_down": ((e, f, d), ("expert", "mlp", "embed"), jnp.bfloat16),
    }
    args = [
        jax.ShapeDtypeStruct(shape, dt, sharding=spec(axes, shape)) for shape, axes, dt in shapes.values()
    ]

    def loss(x, w_router, w_gate, w_up, w_down):
        y, stats = moe_layer(x, w_router, None, w_gate, w_up, w_down, m)
        return jnp.mean(y.astype(jnp.float32) ** 2) + 0.04 * stats["aux_loss"]

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    t0 = time.perf_counter()
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        compiled = fn.lower(*args).compile()
    mem = compiled_memory(compiled)
    return {"compile_s": time.perf_counter() - t0, "memory": mem, "a2a": all_to_all_bytes(compiled.as_text())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="time on one real GPU instead (benchmarks/moe_gpu.py: "
        "--only, --impls, --iters, --timeout, --tiny, --json)",
    )
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-compile", action="store_true")
    args = ap.parse_args()

    if not args.skip_train:
        print(
            f"== tiny-moe training on 8 simulated CPU devices ({args.steps} steps, median of 3..N; "
            "shared CPU: indicative only)"
        )
        print(f"{'dispatch':9} {'expert':>6} {'step s':>8} {'tokens/s':>9} {'dropped':>8} {'loss':>7}")
        rows = []
        for expert in (8, 1):
            for dispatch in ("capacity", "dropless"):
                r = train_throughput(dispatch, expert, args.steps)
                rows.append(r)
                print(
                    f"{dispatch:9} {expert:6d} {r['step_s']:8.3f} {r['tokens_per_s']:9.0f} "
                    f"{r['dropped']:8.3f} {r['final_loss']:7.3f}",
                    flush=True,
                )
        for expert in (8, 1):
            cap, drop = [r for r in rows if r["expert"] == expert]
            print(
                f"expert={expert}: dropless/capacity tokens/s = "
                f"{drop['tokens_per_s'] / cap['tokens_per_s']:.2f}"
            )

    if not args.skip_compile:
        from jaxtrain.sharding import targets

        print("\n== Mixtral-8x7B-shaped MoE layer, fwd+bwd, bf16, mesh expert=8, deviceless")
        print(
            f"{'target':6} {'dispatch':9} {'exchange':8} {'compile s':>9} {'GiB/device':>10} "
            f"{'temp GiB':>8}  all-to-all result MiB/device"
        )
        for target, make in (("tpu", targets.tpu_topology_devices), ("h100", targets.h100_devices)):
            try:
                devices = make()
            except Exception as exc:  # noqa: BLE001 - printed: libtpu / CUDA plugin missing
                print(f"{target}: unavailable ({exc})")
                continue
            for dispatch, exchange in (
                ("capacity", "padded"),
                ("dropless", "padded"),
                ("dropless", "ragged"),
            ):
                try:
                    r = compile_mixtral_layer(devices, dispatch, exchange)
                except Exception as exc:  # noqa: BLE001 - printed as the row's result
                    print(f"{target:6} {dispatch:9} {exchange:8} FAILED: {str(exc).splitlines()[0][:200]}")
                    continue
                a2a = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in r["a2a"].items()) or "none"
                print(
                    f"{target:6} {dispatch:9} {exchange:8} {r['compile_s']:9.1f} "
                    f"{r['memory']['total'] / 2**30:10.2f} {r['memory']['temp'] / 2**30:8.2f}  {a2a}",
                    flush=True,
                )


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("moe", main))

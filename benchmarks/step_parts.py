"""Where the bench-peer step's time goes, by ablation: what one layer, the attention and the
output projection with its loss each cost, against what their matmuls would take at the
measured matmul peak.

    python benchmarks/step_parts.py [--dtype bfloat16] [--steps 14] [overrides...]

Runs configs/bench-peer.yaml on 8 simulated CPU devices (fsdp=8), in this process, with
the heap settings a CPU run of the CLI gets (jaxtrain/host.py), one program at a time, and
prints medians of steps 3..N:
- the step as configured, and with twice the layers (the difference / layers = one layer);
- the step with attention replaced by an identity on v (the difference = attention; the
  CPU-tuned attention of models/cpu_tuning.py and the portable one alike);
- the chunked cross-entropy alone, forward and backward, on the mesh the step uses;
beside the matmul time of each at the peak measured in the same process (the
`planning/flops.py measure_matmul_flops` figure MFU uses). Nothing else may run meanwhile:
a timing.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxtrain import host  # noqa: E402

host.keep_freed_memory()  # as configure_host does for the CLI: before the backend starts

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxtrain import sharding  # noqa: E402
from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.data import make_data_iterator  # noqa: E402
from jaxtrain.models import attention, cpu_tuning  # noqa: E402
from jaxtrain.planning.flops import measure_matmul_flops  # noqa: E402
from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh  # noqa: E402
from jaxtrain.trainer.batches import batch_to_device  # noqa: E402
from jaxtrain.trainer.loss import chunked_cross_entropy  # noqa: E402
from jaxtrain.trainer.program import build_program  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "bench-peer.yaml"


def _median(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def step_time(cfg, steps: int) -> float:
    mesh = sharding.make_mesh(cfg.mesh.sizes(), jax.devices()[: cfg.mesh_size])
    cfg = resolve_for_mesh(cfg, mesh)
    rules = axis_rules(cfg)
    data = make_data_iterator(
        cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.train.seq_len,
        global_batch_size=cfg.train.global_batch_size, seed=cfg.seed,
    )  # fmt: skip
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        program = build_program(cfg, mesh, rules)
        box = [program.init()]

        def one():
            box[0], metrics = program.step(box[0], batch_to_device(next(data), program.batch_sharding))
            return metrics

        return _median(one, steps)


def loss_time(cfg, steps: int) -> float:
    """The chunked loss (forward and backward) on the step's final activations' shapes."""
    m, t = cfg.model, cfg.train
    mesh = sharding.make_mesh(cfg.mesh.sizes(), jax.devices()[: cfg.mesh_size])
    cfg = resolve_for_mesh(cfg, mesh)
    rules = axis_rules(cfg)
    chunk = cfg.train.loss_chunk or t.seq_len
    b, s, d, v = t.global_batch_size, t.seq_len, m.d_model, m.vocab_size
    keys = jax.random.split(jax.random.key(0), 3)
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        x = sharding.constrain(jax.random.normal(keys[0], (b, s, d), m.compute_dtype), ("batch", "seq", None))
        head = sharding.constrain(0.02 * jax.random.normal(keys[1], (d, v)), ("head_embed", "head_vocab"))
        targets = jax.random.randint(keys[2], (b, s), 0, v)
        mask = jnp.ones((b, s), jnp.float32)

        def mean_loss(x, head):
            total, count = chunked_cross_entropy(x, head, targets, mask, chunk=chunk)
            return total / count

        grad = jax.jit(jax.value_and_grad(mean_loss, argnums=(0, 1)))
        return _median(lambda: grad(x, head), steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("overrides", nargs="*", help="extra overrides, e.g. model.remat=none")
    args = ap.parse_args()
    over = [f"model.compute_dtype={args.dtype}", "model.remat=none", *args.overrides]
    cfg = load_config(CONFIG, over)
    m, t = cfg.model, cfg.train
    peak = measure_matmul_flops(dtype=args.dtype)  # the host's: its devices share its cores
    tokens = t.global_batch_size * t.seq_len
    hd = m.resolved_head_dim
    layer_params = (2 * m.n_heads + 2 * m.n_kv_heads) * m.d_model * hd + 3 * m.d_model * m.mlp_dim
    attn_flops = 12 * t.seq_len * m.n_heads * hd / 2 * tokens  # causal, per layer (flops.py)
    head_flops = 6 * m.d_model * m.vocab_size * tokens
    step = step_time(cfg, args.steps)
    double = step_time(load_config(CONFIG, [*over, f"model.n_layers={2 * m.n_layers}"]), args.steps)
    identity = lambda q, k, v, **kw: v + 0 * q + 0 * k
    with (
        mock.patch.object(cpu_tuning, "attention", identity),
        mock.patch.object(attention, "xla_attention", identity),
    ):
        no_attn = step_time(cfg, args.steps)
    loss = loss_time(cfg, args.steps)
    layer = (double - step) / m.n_layers
    rows = [
        ("step", step, None),
        ("one layer", layer, (6 * layer_params * tokens + attn_flops) / peak),
        (f"attention ({m.n_layers} layers)", step - no_attn, m.n_layers * attn_flops / peak),
        ("output projection + loss", loss, head_flops / peak),
    ]
    print(f"bench-peer {args.dtype}, remat none, host matmul peak {peak:.3g} FLOP/s, medians of steps 3..")
    print("| part | s/step | its matmuls at peak | the rest |")
    print("|---|---:|---:|---:|")
    for name, seconds, dots in rows:
        if dots is None:
            print(f"| {name} | {seconds:.3f} | | |")
        else:
            print(f"| {name} | {seconds:.3f} | {dots:.3f} | {seconds - dots:.3f} |")


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("step_parts", main))

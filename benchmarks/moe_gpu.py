"""Dropless MoE on one GPU: the grouped matmuls alone, then the training step (`benchmarks/moe.py
--gpu`, which hands its arguments here).

    python benchmarks/moe.py --gpu [--steps 12] [--only matmul,step] [--impls ragged_dot,triton,mosaic]
        [--variants "label:override ...;..."] [--iters 20] [--timeout 900] [--tiny] [--json OUT]

1. matmul: one grouped matmul at the MoE layer's shape, m = 8 x 2048 tokens x top-2 = 32768
   rows, 8 groups, (k, n) = (2048, 2 x 1408) (gate and up, one matmul over [w_gate | w_up])
   and (1408, 2048) (down), bf16, group sizes equal and skewed (one expert 50% of the rows, the
   rest shared evenly), forward and forward + backward (value and grads of sum(out * c) for a
   fixed cotangent c: the forward, dA and dW), for `jax.lax.ragged_dot`, our Pallas Triton
   kernel (`triton_grouped_matmul`) and JAX's Mosaic GPU kernels (`mosaic_grouped_matmul`),
   plus the dense batched einsum a capacity-1.25 layer runs ([8, 1.25 m / 8, k] x [8, k, n]).
   `triton+key=value+...` times the Triton kernel with other tiles (`GroupedMatmulBlocks`
   fields: `triton+block_n=256+num_stages=4`), for tuning them on a GPU (matmul section only).
   Median of `--iters` runs; TFLOP/s over the useful FLOPs (2 m k n forward, 3x that forward
   + backward; the einsum's padded rows count as waste, its raw figure beside); error:
   max|x - ref| / max|ref| of the output, dA and dW against ragged_dot in f32. One child
   process runs them all (this process never touches the GPU).
2. step: `jaxtrain train configs/gpu-peer.yaml` with the MoE overrides (8 experts of 1408,
   top-2: 1.45B parameters, about 0.55B active), each in its own process (JAX preallocates 75%
   of the GPU per process; benchmarks/gpu_peer.py's child machinery): capacity 1.25, then
   dropless with moe.grouped_matmul = each of `--impls`, then each `--variants` entry (dropless,
   the first of `--impls`, with more overrides: `unrolled:model.scan_layers=false`). s/step
   (median of steps 3..N-1), tokens/s, MoE MFU of the active FLOPs (jaxtrain/planning/flops.py)
   against the GPU's dense bf16 peak, and dropless / capacity time (< 1: dropless is faster).

`--tiny`: 256 rows, k = n = 128, and gpu_peer's tiny model with experts of 128, for a check of
the logic on CPU (the Triton kernel runs interpreted there; Mosaic GPU rows show their error).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.append(str(HERE.parent.parent))  # last: an installed jaxtrain (the GPU host's wheel) comes first
sys.path.insert(0, str(HERE.parent))

import gpu_peer  # noqa: E402  (captures the children's environment before JAX_PLATFORMS=cpu)
from attention_gpu import parse_blocks  # noqa: E402

GROUPS, TOP_K, EXPERT_DIM = 8, 2, 1408
MOE = [f"model.moe.num_experts={GROUPS}", f"model.moe.top_k={TOP_K}"]
IMPLS = ("ragged_dot", "triton", "mosaic")
SECTIONS = ("matmul", "step")


# ---------------------------------------------------------------- 1. the grouped matmul alone


def group_sizes(m: int, skewed: bool) -> list[int]:
    """Equal, or one expert with half the rows and the rest shared evenly (the last takes the remainder)."""
    if not skewed:
        sizes = [m // GROUPS] * GROUPS
    else:
        big = m // 2
        rest = (m - big) // (GROUPS - 1)
        sizes = [big] + [rest] * (GROUPS - 1)
    sizes[-1] += m - sum(sizes)
    return sizes


def tiles(impl: str):
    """The GroupedMatmulBlocks of an impl named `triton+key=value+...` (None for a plain name);
    ValueError or TypeError naming what is wrong for anything else with a `+`."""
    base, *items = impl.split("+")
    if not items:
        return None
    if base != "triton":
        raise ValueError(f"--impls {impl!r}: only triton takes tiles (triton+block_n=256+...)")
    from jaxtrain.pallas_kernels.grouped_matmul_gpu import GroupedMatmulBlocks

    return GroupedMatmulBlocks(**parse_blocks(items, f"--impls {impl!r}"))


def grouped(impl: str):
    """f(a, w, group_sizes) for one column: models/moe.py's grouped_matmul, or the Triton kernel
    with the tiles the name gives."""
    blocks = tiles(impl)
    if blocks is None:
        from jaxtrain.models.moe import grouped_matmul

        return lambda a, w, gs: grouped_matmul(a, w, gs, impl, full=True)
    from jaxtrain.pallas_kernels.grouped_matmul_gpu import triton_grouped_matmul

    return lambda a, w, gs: triton_grouped_matmul(a, w, gs, full=True, blocks=blocks)


def _median_time(f, *args, iters: int) -> float:
    import jax

    jax.block_until_ready(f(*args))  # compile
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_worker(tiny: bool, iters: int, impls: list[str]) -> dict:
    """Every row of section 1, in this (child) process."""
    import jax
    import jax.numpy as jnp

    layer_shapes = [(2048, 2 * EXPERT_DIM), (EXPERT_DIM, 2048)]  # gate and up as one matmul; down
    m, dims = (256, [(128, 128)]) if tiny else (8 * 2048 * TOP_K, layer_shapes)
    rows = []
    for k, n in dims:
        key = jax.random.key(k + n)
        ka, kw, kc = jax.random.split(key, 3)
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        w = (jax.random.normal(kw, (GROUPS, k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        c = jax.random.normal(kc, (m, n), jnp.bfloat16)
        flops = 2 * m * k * n
        for skewed in (False, True):
            gs = jnp.array(group_sizes(m, skewed), jnp.int32)
            ref = None
            for impl in impls:
                row = {"k": k, "n": n, "m": m, "groups": "skewed" if skewed else "equal", "impl": impl}
                try:
                    matmul = grouped(impl)
                    fwd = jax.jit(matmul)
                    out = fwd(a, w, gs)

                    def loss(a, w, gs, matmul=matmul):
                        out = matmul(a, w, gs)
                        return jnp.sum(out.astype(jnp.float32) * c.astype(jnp.float32))

                    # value and grads: with the grads alone, XLA drops the unused forward
                    # (the loss is linear in it), and fwd+bwd would time dA and dW only
                    both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
                    if ref is None:  # ragged_dot in f32: the output, dA and dW
                        exact = partial(jax.lax.ragged_dot, preferred_element_type=jnp.float32)
                        grads = jax.jit(jax.grad(partial(loss, matmul=exact), argnums=(0, 1)))
                        ref = (exact(a, w, gs), *grads(a, w, gs))
                    got_all = (out, *both(a, w, gs)[1])  # the output, dA and dW
                    for key, got, want in zip(("error", "error_da", "error_dw"), got_all, ref):
                        diff = jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want))
                        row[key] = float(diff)
                    row["fwd_s"] = _median_time(fwd, a, w, gs, iters=iters)
                    row["fwd_bwd_s"] = _median_time(both, a, w, gs, iters=iters)
                    row["fwd_tflops"] = flops / row["fwd_s"] / 1e12
                    row["fwd_bwd_tflops"] = 3 * flops / row["fwd_bwd_s"] / 1e12
                except Exception as e:  # noqa: BLE001  (a row shows why it failed)
                    row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        # the capacity-1.25 layer's dense batched einsum (per sequence in the model; here
        # one batch of slots, the same FLOPs)
        cap = -(-int(1.25 * m) // GROUPS)
        x = jax.random.normal(ka, (GROUPS, cap, k), jnp.bfloat16)
        cc = jax.random.normal(kc, (GROUPS, cap, n), jnp.bfloat16)
        dense = jax.jit(lambda x, w: jnp.einsum("eck,ekn->ecn", x, w))
        dloss = jax.jit(
            jax.value_and_grad(
                lambda x, w: jnp.sum(dense(x, w).astype(jnp.float32) * cc.astype(jnp.float32)), argnums=(0, 1)
            )
        )
        row = {"k": k, "n": n, "m": m, "groups": "capacity 1.25", "impl": "dense einsum"}
        row["fwd_s"] = _median_time(dense, x, w, iters=iters)
        row["fwd_bwd_s"] = _median_time(dloss, x, w, iters=iters)
        row["fwd_tflops"] = flops / row["fwd_s"] / 1e12
        row["fwd_bwd_tflops"] = 3 * flops / row["fwd_bwd_s"] / 1e12
        row["raw_fwd_tflops"] = 2 * GROUPS * cap * k * n / row["fwd_s"] / 1e12
        rows.append(row)
    return {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "rows": rows}


def run_matmul(args) -> dict:
    cmd = [sys.executable, str(HERE), "--worker", "matmul", "--iters", str(args.iters), "--impls", args.impls]
    cmd += ["--tiny"] if args.tiny else []
    rc, out, err = gpu_peer.run_child(cmd, args.timeout, str(HERE.parent.parent))
    result = gpu_peer.result_line(out)
    return result if rc == 0 and result else {"error": gpu_peer.failure(rc, err, args.timeout), "rows": []}


def matmul_table(res: dict) -> str:
    if res.get("error"):
        return f"grouped matmul section failed: {res['error']}"
    lines = [
        f"Grouped matmul on {res['device']} (jax {res['jax']}), bf16, {GROUPS} groups; "
        "TFLOP/s of useful FLOPs",
        "",
        "| k x n | groups | impl | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | error out, dA, dW |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        if "failed" in r:
            lines.append(f"| {r['k']} x {r['n']} | {r['groups']} | {r['impl']} | failed: {r['failed']} |||||")
            continue
        raw = f" (raw {r['raw_fwd_tflops']:.0f})" if "raw_fwd_tflops" in r else ""
        err = ", ".join(f"{r[k]:.1e}" for k in ("error", "error_da", "error_dw") if k in r)
        lines.append(
            f"| {r['k']} x {r['n']} | {r['groups']} | {r['impl']} | {r['fwd_s'] * 1e3:.3f} | "
            f"{r['fwd_tflops']:.0f}{raw} | {r['fwd_bwd_s'] * 1e3:.3f} | {r['fwd_bwd_tflops']:.0f} | {err} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- 2. the training step


def step_variants(impls: list[str], tiny: bool, variants: str = "") -> list[tuple[str, list[str], dict]]:
    """(label, overrides, environment) of each step run: capacity 1.25 first (the ratios'
    denominator), dropless with each grouped matmul, then each `--variants` entry: dropless with
    the first of `impls` and the entry's overrides and environment (gpu_peer's syntax)."""
    moe = [*MOE, f"model.moe.expert_mlp_dim={128 if tiny else EXPERT_DIM}"]
    runs = [("capacity 1.25", [*moe, "model.moe.dispatch=capacity", "model.moe.capacity_factor=1.25"], {})]
    dropless = {i: [*moe, "model.moe.dispatch=dropless", f"model.moe.grouped_matmul={i}"] for i in impls}
    runs += [(f"dropless {impl}", overrides, {}) for impl, overrides in dropless.items()]
    for label, overrides, env in gpu_peer.parse_variants(variants, with_auto=False):
        runs.append((f"dropless {impls[0]} {label}", [*dropless[impls[0]], *overrides], env))
    return runs


def run_steps(args) -> dict:
    os.environ["JAX_PLATFORMS"] = "cpu"  # this process: never the GPU (the children get the caller's)
    from jaxtrain.config import load_config
    from jaxtrain.planning.flops import flops_per_token

    args.config, args.batch, args.seq = str(gpu_peer.CONFIG), None, None
    shape = gpu_peer.model_shape(args)
    device = gpu_peer.gpu_name()
    peak = gpu_peer.peak_flops(device, None)
    tokens = shape["batch"] * shape["seq"]
    rows = []
    for label, overrides, env in step_variants(args.impls.split(","), args.tiny, args.variants):
        print(f"# MoE step ({label}) ...", file=sys.stderr, flush=True)
        cfg = load_config(args.config, [*gpu_peer.jaxtrain_overrides(shape, args.tiny), *overrides])
        flops_token = flops_per_token(cfg.model, cfg.train.seq_len)
        row = gpu_peer.run_jaxtrain(label, overrides, env, shape, args)
        if "step_time_s" in row:
            row["tokens_per_second"] = tokens / row["step_time_s"]
            row["moe_mfu"] = flops_token * row["tokens_per_second"] / peak if peak else None
        row["params"] = cfg.model.param_count()
        print(json.dumps(row), flush=True)
        rows.append(row)
    capacity = rows[0].get("step_time_s")
    for r in rows[1:]:
        r["vs_capacity"] = r["step_time_s"] / capacity if capacity and "step_time_s" in r else None
    return {"device": device or "cpu", "peak_flops": peak, "shape": shape, "rows": rows}


def step_table(res: dict) -> str:
    s = res["shape"]
    lines = [
        f"MoE training step on {res['device']}: gpu-peer.yaml + {GROUPS} experts, top-{TOP_K}, batch "
        f"{s['batch']} x {s['seq']}; MFU of the active FLOPs"
        + (f" against {res['peak_flops'] / 1e12:.0f} TFLOP/s" if res["peak_flops"] else " n/a (no GPU peak)"),
        "",
        "| run | s/step | tokens/s | MoE MFU | dropless / capacity | auto lines |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        if "step_time_s" not in r:
            lines.append(f"| {r['contender']} | failed: {r.get('error')} |||||")
            continue
        mfu = f"{r['moe_mfu']:.1%}" if r.get("moe_mfu") else "n/a"
        ratio = f"{r['vs_capacity']:.2f}" if r.get("vs_capacity") else ""
        autos = "; ".join(a for a in r.get("auto", []) if "moe" in a)
        lines.append(
            f"| {r['contender']} | {r['step_time_s']:.4f} | {r['tokens_per_second']:,.0f} | {mfu} | "
            f"{ratio} | {autos} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="(benchmarks/moe.py's switch to this section)")
    ap.add_argument("--steps", type=int, default=12, help="training steps per run (>= 4)")
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated: matmul,step")
    ap.add_argument("--impls", default=",".join(IMPLS), help="grouped matmuls to time")
    ap.add_argument(
        "--variants",
        default="",
        help="more dropless step runs (first of --impls): 'label:override NAME=value ...;...', "
        "as benchmarks/gpu_peer.py --jaxtrain-variants",
    )
    ap.add_argument("--iters", type=int, default=20, help="timed runs per matmul measurement")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per child process")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU logic check)")
    ap.add_argument("--json", metavar="OUT", default=None)
    ap.add_argument("--worker", choices=("matmul",), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker == "matmul":
        result = matmul_worker(args.tiny, args.iters, args.impls.split(","))
        print("RESULT " + json.dumps(result), flush=True)
        return
    impls = args.impls.split(",")
    if bad := sorted({i.split("+")[0] for i in impls} - set(IMPLS)):
        ap.error(f"--impls: unknown {bad}; expected some of {','.join(IMPLS)}")
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    try:  # a bad tile is refused here, not in the child (jax imported, no backend started)
        tiled = [i for i in impls if tiles(i) is not None]
        if tiled and "step" in only:
            raise ValueError(f"--impls {','.join(tiled)}: tiles are for the matmul section (--only matmul)")
    except (ValueError, TypeError) as e:
        ap.error(str(e))
    if args.steps < 4:
        ap.error("--steps must be at least 4 (the median is over steps 3..N-1)")
    results = {}
    if "matmul" in only:
        print("# grouped matmuls ...", file=sys.stderr, flush=True)
        results["matmul"] = run_matmul(args)
    if "step" in only:
        results["step"] = run_steps(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print()
    if "matmul" in results:
        print(matmul_table(results["matmul"]) + "\n")
    if "step" in results:
        print(step_table(results["step"]))


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("moe_gpu", main))

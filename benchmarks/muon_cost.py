"""What Muon's Newton-Schulz costs per step on a model shape, against the step: FLOPs and HBM
bytes, deviceless (no accelerator needed).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/muon_cost.py [configs/gpu-peer.yaml] [--compile]

- The matrices are the ones the optimizer takes (jaxtrain/trainer/muon.py `matrix_view` over
  the model's logical axes), in their HF [out, in] shapes.
- NS FLOPs, counted: per matrix in its wide orientation [m, n] (m <= n), each iteration is
  X X^T (2 m^2 n), A A (2 m^3) and (b A + c A^2) X (2 m^2 n); times ns_steps. Checked against
  XLA's own count (`cost_analysis()` of the iteration compiled for the CPU), which also gives
  its bytes accessed, the HBM traffic XLA's cost model charges the iteration with.
- Step FLOPs: jaxtrain/planning/flops.py (6 N + attention per token, the MFU convention) x the
  global batch's tokens.
- `--compile`: also the whole train step compiled for one H100 (deviceless, `jaxtrain compile
  --target gpu:h100 --gpus-per-host 1`) with adamw and with muon: the compiled memory figures.
Prints the figures and the table docs/benchmarks.md quotes; the run is recorded as
benchmarks/results/muon_cost/<UTC time>-<sha>.json (benchmarks/result_file.py), with the
table as `cost`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxtrain import models  # noqa: E402
from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.planning.flops import flops_per_token  # noqa: E402
from jaxtrain.trainer import muon  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
COST_HEADER = ["figure", "adamw", "muon"]


def hidden_matrices(cfg) -> list[tuple[str, int, tuple[int, int]]]:
    """(parameter path, how many matrices it stacks, HF [out, in]) for Muon's parameters."""
    _, state = models.abstract_model(lambda: models.Transformer(cfg.model, rngs=nnx.Rngs(0)))
    axes, shapes = models.logical_axes(state), nnx.to_pure_dict(state)
    out = []
    flat_axes = jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))[0]
    flat_shapes = jax.tree.leaves(shapes)
    for (path, ax), shape in zip(flat_axes, flat_shapes, strict=True):
        view = muon.matrix_view(ax)
        if view is not None:
            stack = math.prod(shape.shape[: view.n_stack])
            out.append((jax.tree_util.keystr(path), stack, view.hf_shape(shape.shape)))
    return out


def ns_flops(out_dim: int, in_dim: int, steps: int) -> int:
    m, n = min(out_dim, in_dim), max(out_dim, in_dim)
    return steps * (4 * m * m * n + 2 * m**3)


def xla_cost(mats, m_cfg) -> dict:
    """XLA's cost analysis of the iterations over every matrix (CPU compile, float32)."""
    args = [jax.ShapeDtypeStruct((stack, o, i), jnp.float32) for _, stack, (o, i) in mats]
    fn = jax.jit(
        lambda *xs: [
            muon.newton_schulz(x, m_cfg.ns_coefficients, m_cfg.ns_steps, m_cfg.eps, jnp.dtype(m_cfg.ns_dtype))
            for x in xs
        ]
    )
    cost = fn.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed")}


def compiled_memory(config: str, name: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "jaxtrain", "compile", config, "--target", "gpu:h100", "--gpus-per-host", "1",
         "--json", f"optimizer.name={name}"],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=3000,
    )  # fmt: skip
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return report.get("memory", report)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Newton-Schulz FLOPs and bytes per step, deviceless")
    parser.add_argument("config", nargs="?", default="configs/gpu-peer.yaml")
    parser.add_argument("--compile", action="store_true", help="also compile the step for one H100")
    args = parser.parse_args(argv)
    config = args.config
    cfg = load_config(REPO / config, ["optimizer.name=muon"])
    m_cfg = cfg.optimizer.muon
    mats = hidden_matrices(cfg)
    counted = sum(stack * ns_flops(o, i, m_cfg.ns_steps) for _, stack, (o, i) in mats)
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    step = flops_per_token(cfg.model, cfg.train.seq_len) * tokens
    xla = xla_cost(mats, m_cfg)
    muon_params = sum(stack * o * i for _, stack, (o, i) in mats)
    figures = {
        "config": config,
        "ns_steps": m_cfg.ns_steps,
        "ns_dtype": m_cfg.ns_dtype,
        "matrices": [{"param": p, "count": s, "hf_shape": [o, i]} for p, s, (o, i) in mats],
        "muon_params": muon_params,
        "params": cfg.model.param_count(),
        "ns_flops_counted": counted,
        "ns_flops_xla": xla["flops"],
        "ns_bytes_accessed_xla": xla["bytes_accessed"],
        "step_model_flops": step,
        "ns_share_of_step_flops": counted / step,
        "state_bytes_adamw_f32": 2 * 4 * cfg.model.param_count(),
        "state_bytes_muon_f32": 4 * (2 * cfg.model.param_count() - muon_params),
    }
    if args.compile:
        figures["h100_compiled_memory"] = {name: compiled_memory(config, name) for name in ("adamw", "muon")}
    print(json.dumps(figures, indent=2))
    rows = cost_rows(figures)
    print(f"\n| {' | '.join(COST_HEADER)} |\n|---|---:|---:|")
    for cells in rows:
        print("| " + " | ".join(cells) + " |")
    try:  # run as a script: benchmarks/ is on the path, as for the recording in __main__
        import result_file
    except ImportError:  # imported as benchmarks.muon_cost: nothing records
        from benchmarks import result_file
    result_file.add_figures(**figures)
    result_file.add_table("cost", COST_HEADER, rows)
    return 0


def cost_rows(figures: dict) -> list[list[str]]:
    """The `cost` table (COST_HEADER) from the run's figures: Newton-Schulz's FLOPs and bytes
    against the step's, the optimizer state, and the compiled H100 memory when --compile ran."""
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    counted, xla = figures["ns_flops_counted"], figures["ns_flops_xla"]
    matrices = sum(m["count"] for m in figures["matrices"])
    step = f"{figures['step_model_flops'] / 1e12:.1f} TFLOP"
    rows = [
        [
            f"parameters Muon updates ({matrices} matrices)",
            "-",
            f"{figures['muon_params'] / 1e6:.1f} M of {figures['params'] / 1e6:.1f} M",
        ],
        [
            f"Newton-Schulz FLOPs per step ({figures['ns_steps']} steps, {figures['ns_dtype']}; counted, "
            f"XLA's count within {abs(xla - counted) / counted:.2%})",
            "-",
            f"{counted / 1e12:.1f} TFLOP",
        ],
        ["the step's model FLOPs (6 N + attention)", step, step],
        [
            "Newton-Schulz bytes accessed per step (XLA:CPU's cost model, unfused)",
            "-",
            f"{figures['ns_bytes_accessed_xla'] / 1e9:.0f} GB",
        ],
        [
            "optimizer state, float32",
            gib(figures["state_bytes_adamw_f32"]),
            gib(figures["state_bytes_muon_f32"]),
        ],
    ]
    compiled = figures.get("h100_compiled_memory")
    if compiled:
        for what, key in (
            ("arguments (params + state + batch)", "argument"),
            ("temporaries", "temp"),
            ("total", "total"),
        ):
            rows.append([f"H100 compiled: {what}", gib(compiled["adamw"][key]), gib(compiled["muon"][key])])
    return rows


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("muon_cost", lambda: main(sys.argv[1:])))

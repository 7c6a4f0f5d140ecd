"""Pod estimates side by side with MaxText, both compiled deviceless the same way, in one run.

    JAX_PLATFORMS=cpu python benchmarks/pod_vs_maxtext.py            # Llama-2-7B on v5p-64
    JAX_PLATFORMS=cpu python benchmarks/pod_vs_maxtext.py --rows 7b,70b,8b

Per row, on the same TPU target, batch, sequence and remat (full):
- jaxtrain: `jaxtrain compile --json`, once as usual (the Pallas attention
  kernels charged through their pl.CostEstimate) and once with
  `--kernels-uncharged`;
- MaxText 0.2.5 (PyPI, the peer venv of benchmarks/peers/maxtext_peer.sh, plus
  the same libtpu as ours): its `train_compile` for the memory (scanned
  program, default flags) and for 1- and 2-layer unscanned variants with the
  windowed-einsum flags our cost variants use (jaxtrain/planning/compile.py), so both
  step times are extrapolated by the same rule: c1 + (L - 1) * (c2 - c1).

XLA's TPU cost model charges a Mosaic kernel only what its cost estimate says.
MaxText's splash-attention calls carry none (the table counts them), so its
estimate leaves attention out; "uncharged" rows compare on those terms. The
"derived" MaxText row adds our kernels' per-layer charge to MaxText's
estimate: an inference, not a compile. MFU everywhere is our analytic model
FLOPs (6N + causal attention, PaLM convention) over step time x the chip's peak.
All figures are compiler estimates, not measurements.
"""

from __future__ import annotations

import argparse
import ast
import glob
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from jaxtrain.planning.flops import peak_flops_for_device_kind  # noqa: E402
from jaxtrain.sharding.targets import kernel_names  # noqa: E402

PEER_REQS = REPO / "benchmarks" / "peers" / "maxtext-requirements.txt"
PEER_VENV = Path(
    os.environ.get(
        "PEER_VENV",
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxtrain-peer" / "maxtext-venv",
    )
)
WINDOWED_OFF = (
    "--xla_tpu_enable_windowed_einsum_for_all_gather=false "
    "--xla_tpu_enable_windowed_einsum_for_reduce_scatter=false"
)
GIB = 2**30

# key: (our preset, target, MaxText model_name, MaxText per_device_batch_size, layers)
ROWS = {
    "7b": ("llama2-7b", "v5p-64", "llama2-7b", 4, 32),
    "8b": ("llama3-8b", "v5p-64", "llama3-8b", 4, 32),
    "70b": ("llama2-70b", "v5p-512", "llama2-70b", 4, 80),
    "mixtral": ("mixtral-8x7b", "v5p-128", "mixtral-8x7b", 4, 32),
}


def ensure_peer_venv() -> tuple[Path, str]:
    """(python, MaxText package dir) of the MaxText venv (created as maxtext_peer.sh
    does) with our libtpu added."""
    py = PEER_VENV / "bin" / "python"
    if not py.exists() or subprocess.run([py, "-c", "import maxtext"], capture_output=True).returncode:
        if not PEER_REQS.exists():
            sys.exit(f"no MaxText venv at {PEER_VENV} and no {PEER_REQS} to build one")
        subprocess.run([sys.executable, "-m", "venv", PEER_VENV], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "-r", PEER_REQS], check=True)
    libtpu = importlib.metadata.version("libtpu")
    if subprocess.run(
        [py, "-c", f"import importlib.metadata as m, sys; sys.exit(m.version('libtpu') != '{libtpu}')"],
        capture_output=True,
    ).returncode:
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", f"libtpu=={libtpu}"], check=True)
    mt = subprocess.run(
        [py, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return py, mt


def maxtext_compile(py: Path, mt: str, model: str, topology: str, batch: int, layers: int | None) -> dict:
    """One MaxText train_compile: cost analysis, memory, and its TPU custom calls.

    layers=None: the real scanned program with default flags (memory);
    otherwise an unscanned variant with that many layers (cost).
    """
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            f"{mt}/configs/base.yml",
            f"model_name={model}",
            f"compile_topology={topology}",
            "compile_topology_num_slices=1",
            f"per_device_batch_size={batch}",
            "max_target_length=4096",
            "remat_policy=full",
            "run_name=peer-compile",
            f"base_output_directory={tmp}/out",
            "enable_goodput_recording=False",
            "monitor_goodput=False",
            "skip_jax_distributed_system=True",
        ]
        if layers is not None:
            args += [
                f"base_num_decoder_layers={layers}",
                "override_model_config=True",
                "scan_layers=False",
                f"compile_xla_flags={WINDOWED_OFF}",
            ]
        env = {
            **os.environ,
            "DECOUPLE_GCLOUD": "TRUE",
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_dump_to={tmp}/hlo --xla_dump_hlo_as_text "
            "--xla_dump_hlo_module_re=.*train_step.*",
        }
        p = subprocess.run(
            [py, "-m", "maxtext.trainers.pre_train.train_compile", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp,
        )
        out = p.stdout + p.stderr
        cost = re.search(r"Cost analysis: (\{.*\})", out)
        mem = re.search(r"Memory analysis: CompiledMemoryStats\((.*)\)", out)
        if p.returncode or not cost or not mem:
            sys.exit(f"MaxText train_compile failed ({model}, {topology}, layers={layers}):\n{out[-3000:]}")
        cost = ast.literal_eval(cost.group(1))
        stats = dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", mem.group(1)))
        hlo = "".join(Path(f).read_text() for f in glob.glob(f"{tmp}/hlo/*after_optimizations.txt"))
    kernels = [
        line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line and " = " in line
    ]
    return {
        "flops": cost.get("flops", 0.0),
        "seconds": cost.get("optimal_seconds", 0.0),
        "memory": (
            stats["argument_size_in_bytes"]
            + stats["output_size_in_bytes"]
            - stats["alias_size_in_bytes"]
            + stats["temp_size_in_bytes"]
        ),
        "kernels": len(kernels),
        "kernels_with_cost": sum('"cost_estimate"' in line for line in kernels),
        "kernel_names": sorted(kernel_names(hlo)),
    }


def ours(preset: str, topology: str, charged: bool, config: Path | None = None) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "jaxtrain",
        "compile",
        str(config or REPO / "configs" / f"{preset}.yaml"),
        "--target",
        f"tpu:{topology}",
        "--json",
    ] + ([] if charged else ["--kernels-uncharged"])
    p = subprocess.run(
        cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )
    if p.returncode not in (0, 1):
        sys.exit(f"jaxtrain compile failed: {' '.join(cmd)}\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def planned(preset: str, topology: str, tries: int = 3) -> tuple[str, dict | None]:
    """The planner's pick for the preset at its global batch, as `jaxtrain plan --top tries
    --kernels-uncharged` makes it: the analytic ranking, the best `tries` confirmed by compile
    and re-ranked by the compiler's estimate; then the winner's full `jaxtrain compile
    --kernels-uncharged` report. (label, report, or None when none of them fits)."""
    from jaxtrain.config import load_config
    from jaxtrain.planning.compile import parse_target
    from jaxtrain.planning.planner import plan, write_config

    cfg = load_config(REPO / "configs" / f"{preset}.yaml")
    p = plan(cfg, parse_target(f"tpu:{topology}"), top=tries, charge_kernels=False)
    if p.best is None:
        return "; ".join(f"{r.candidate.mesh_text()}: {r.reason}" for r in p.rejected[:tries]), None
    c = p.best.candidate
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.yaml"
        write_config(cfg, c, path)
        return f"{c.mesh_text()}, remat {c.remat}, {c.batching_text()}", ours(
            preset, topology, False, config=path
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="7b", help=f"comma-separated, of {','.join(ROWS)}")
    ap.add_argument(
        "--planned",
        action="store_true",
        help="add a row for `jaxtrain plan`'s pick (uncharged attention), at the preset's batch",
    )
    ap.add_argument("--top", type=int, default=3, help="with --planned: candidates the plan compiles")
    args = ap.parse_args()
    py, mt = ensure_peer_venv()
    print(
        "| model | target | stack | attention kernels | memory GiB/dev | XLA TFLOP/layer | "
        "est. ms/layer | est. step s | est. MFU |\n|---|---|---|---|---:|---:|---:|---:|---:|",
        flush=True,
    )
    notes = []
    for key in args.rows.split(","):
        preset, topo, mt_model, batch, L = ROWS[key]
        charged, free = ours(preset, topo, True), ours(preset, topo, False)
        model_flops = charged["model_flops_per_device"]
        peak = peak_flops_for_device_kind(charged["device_kind"])
        m1, m2 = (maxtext_compile(py, mt, mt_model, topo, batch, n) for n in (1, 2))
        mfull = maxtext_compile(py, mt, mt_model, topo, batch, None)
        mt_layer_s, mt_layer_f = m2["seconds"] - m1["seconds"], m2["flops"] - m1["flops"]
        mt_step = m1["seconds"] + (L - 1) * mt_layer_s
        charge_s = (
            charged["xla_cost"]["optimal_seconds per layer"] - free["xla_cost"]["optimal_seconds per layer"]
        )
        charge_f = charged["xla_cost"]["flops per layer"] - free["xla_cost"]["flops per layer"]

        def row(stack, kernels, mem, tflop, layer_s, step_s):
            print(
                f"| {preset} | tpu:{topo} | {stack} | {kernels} | "
                f"{mem / GIB:.1f} | {tflop / 1e12:.2f} | {layer_s * 1e3:.2f} | {step_s:.3f} | "
                f"{100 * model_flops / (step_s * peak):.1f}% |",
                flush=True,
            )

        for r, label in ((charged, "charged"), (free, "uncharged")):
            c = r["xla_cost"]
            row(
                "jaxtrain",
                label,
                r["memory"]["total"],
                c["flops per layer"],
                c["optimal_seconds per layer"],
                c["optimal_seconds"],
            )
        row(
            "MaxText 0.2.5",
            f"uncharged ({m1['kernels_with_cost']} of {m1['kernels']} carry a cost)",
            mfull["memory"],
            mt_layer_f,
            mt_layer_s,
            mt_step,
        )
        if args.planned:
            label, r = planned(preset, topo, args.top)
            if r is None:
                notes.append(f"{preset}: planner's candidates did not fit when compiled: {label}")
            else:
                c = r["xla_cost"]
                row(
                    f"jaxtrain plan: {label}",
                    "uncharged",
                    r["memory"]["total"],
                    c["flops per layer"],
                    c["optimal_seconds per layer"],
                    c["optimal_seconds"],
                )
                notes.append(
                    f"{preset}: MaxText step / planner's pick step, both uncharged: "
                    f"{mt_step / c['optimal_seconds']:.3f}"
                )
        row(
            "MaxText, derived",
            "charged as ours",
            mfull["memory"],
            mt_layer_f + charge_f,
            mt_layer_s + charge_s,
            mt_step + L * charge_s,
        )
        if mt_model.startswith("mixtral"):
            # Whether MaxText's estimate counts its experts: under remat full each routed
            # assignment's SwiGLU runs forward twice and backward once, 8 x 3 D F FLOPs, over
            # batch x seq tokens x top_k per device and layer.
            from jaxtrain.config import load_config

            mc = load_config(REPO / "configs" / f"{preset}.yaml").model
            experts = 8 * 3 * mc.d_model * mc.moe.mlp_dim(mc) * mc.moe.top_k * batch * 4096
            notes.append(
                f"{preset}: routed experts under remat full, analytic: {experts / 1e12:.2f} TFLOP/layer "
                f"of MaxText's XLA {mt_layer_f / 1e12:.2f}"
            )
        notes.append(
            f"{preset}: MaxText step / jaxtrain step, both uncharged: "
            f"{mt_step / free['xla_cost']['optimal_seconds']:.3f}; memory MaxText / jaxtrain: "
            f"{mfull['memory'] / charged['memory']['total']:.2f}; MaxText kernels: "
            f"{', '.join(m1['kernel_names'])}"
        )
    print()
    for n in notes:
        print(n)
    print(
        "\nStep times are XLA's raw estimates (1-/2-layer extrapolation, no rescaling); "
        "compiler estimates, not measurements."
    )


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("pod_vs_maxtext", main))

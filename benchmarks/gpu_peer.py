"""jaxtrain against torch at its best (transformers or torchtitan; eager, or the whole step under
torch.compile) on one GPU, same model, same batch, and an attention micro-benchmark (ours,
cuDNN, XLA), in one run.

    python benchmarks/gpu_peer.py [--steps 20] [--repeats 3] [--warmup 3]
        [--only jaxtrain,torch-eager,torch-compile,torchtitan,attention]
        [--jaxtrain-variants "remat-full:model.remat=full;flags-off:JAXTRAIN_GPU_XLA_FLAGS=off"]
        [--torch-attention auto|cudnn|flash|efficient] [--torch-loss hf|liger]
        [--torch-compile-mode default|max-autotune] [--torch-remat none|full]
        [--torch-variants "fa2:attention=flash;liger:loss=liger;titan:model=torchtitan"]
        [--batch B] [--seq S] [--tiny] [--attn-shape 4,4096,32,8,128] [--attn-dtype bfloat16]
        [--peak-tflops T] [--timeout 900] [--torch-python PATH] [--json OUT]

The model is configs/gpu-peer.yaml (a 0.886B Llama, batch 8 x 2048, bf16 compute, f32 master
weights). Every contender runs in its own process with the GPU to itself (JAX preallocates 75%
of GPU memory in any process that touches it), one after the other; this process never touches
the GPU (it imports jax with JAX_PLATFORMS=cpu, for the FLOPs and parameters only). Each
contender trains `--warmup` untimed steps, then `--repeats` windows of `--steps` (>= 20) timed
steps; its step time is the median of the windows' medians, with their min and max.

- jaxtrain: `python -m jaxtrain train configs/gpu-peer.yaml` once with no overrides (`auto`)
  and once per `--jaxtrain-variants` entry (`label:token token ...`, `;`-separated; an entry
  labelled `auto` replaces the default run). A token `NAME=value` whose NAME is upper-case
  letters, digits and underscores goes into that child's environment (over the caller's: e.g.
  `JAXTRAIN_GPU_XLA_FLAGS=off`, `XLA_FLAGS=--xla_foo=1`; the same NAME again appends its value
  after a space, for several XLA flags); any other token (`model.remat=minimal`) is a jaxtrain
  override. Step times from metrics.jsonl, `peak_memory_bytes` of its rows where present
  (device 0's `memory_stats()["peak_bytes_in_use"]`), the lines that say what
  `model.attention_impl=auto` and `model.remat=auto` resolved to, and the `GPU XLA flags:` line.
- torch (benchmarks/torch_peer.py, which says what each setting does): `torch-eager` and
  `torch-compile` (transformers' Llama), `torchtitan` (torchtitan's Llama 3, compiled), with the
  `--torch-*` settings, then one run per `--torch-variants` entry (`label:key=value ...`, keys
  model, compile, mode, attention, loss, remat; each from torch-compile's settings). Recorded:
  the SDPA operators that ran (the backend torch actually took), graphs and graph breaks under
  torch.compile, torch.cuda.max_memory_allocated (and reserved), the parameter count, which must
  equal jaxtrain's (the run exits 1 naming both otherwise). `--torch-python` runs these workers
  under another Python (they import neither jax nor jaxtrain).
- memory: jaxtrain's `auto` run against each torch run at torch's default (no remat), and every
  jaxtrain run against every torch run at the same remat policy (`model.remat=none` against
  `--torch-remat none`, `full` against `full`).
- attention: causal GQA attention at `--attn-shape B,S,H,KV,D`, forward and forward + backward
  (value_and_grad of sum(o * c) in f32, c a fixed random cotangent) of ours
  (`sharded_flash_attention`, Pallas: Triton on GPU, interpreted on CPU), cuDNN and XLA
  (`jax.nn.dot_product_attention`), median of `--attn-iters` runs; TFLOP/s over the causal
  minimum (benchmarks/attention.py `causal_flops`: 2 matmuls of S^2/2 x D per head forward,
  7 forward + backward); error: max|x - ref| / max|ref| of the output and dq, dk, dv against
  XLA in f32 at highest matmul precision. An implementation that fails shows its error.
  Then a second table, jaxtrain's cuDNN wrapper (`pallas_kernels/cudnn_attention.py`, with the
  Pallas flash kernel as its fallback, as `model.attention_impl=cudnn` calls it; segment ids
  passed traced, so its `lax.cond` picks at run time), causal, same shape: one document per row
  followed by padding (lengths differ per row), rows packing three documents (the wrapper must
  take the fallback), and a sliding window of min(1024, S/4) without segment ids. fwd + bwd
  time, and error against `pallas_kernels/reference.py` in f32 (highest precision) with the same
  mask; with padding the output error covers the real queries only and the cotangent is zero on
  padding (as the loss mask makes it); `finite`: every element of the output and dq, dk, dv
  over the full arrays, padding included (a NaN there would poison training). On CPU cuDNN
  fails: its rows show the error.

MFU: jaxtrain's FLOPs per token (jaxtrain/planning/flops.py: 6 x params without the embedding
+ causal attention) against the GPU's dense bf16 peak from jaxtrain's hardware table (989
TFLOP/s on H100 and H200) or `--peak-tflops`; n/a on CPU. Ratio: the fastest torch run's step
time over the contender's (>1: the contender is faster). The run's result file
(benchmarks/result_file.py) holds every row and the tables `step`, `memory`, `attention`.
`--tiny` shrinks both sides to a 2-layer d_model 128 model at batch 2 x 128 for a check of the
script's logic on CPU (cuDNN and memory-efficient SDPA, Liger and torchtitan's FlexAttention
backward are CUDA only: those runs refuse in one line there). Nothing else may run on the
machine meanwhile: this is a timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:  # imported as benchmarks.gpu_peer (the tests)
    from benchmarks import result_file, torch_peer
except ImportError:  # run as a script, from anywhere: its folder is on the path
    import result_file
    import torch_peer

HERE = Path(__file__).resolve()
CONFIG = HERE.parent.parent / "configs" / "gpu-peer.yaml"
SECTIONS = ("jaxtrain", "torch-eager", "torch-compile", "torchtitan", "attention")
DEFAULT_SECTIONS = ("jaxtrain", "torch-eager", "torch-compile", "attention")
MIN_TIMED_STEPS = 20
# The children's environment: this process's, before it sets JAX_PLATFORMS=cpu for itself.
CHILD_ENV = dict(os.environ)
MODEL_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim")
TINY = dict(
    vocab_size=512,
    d_model=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    mlp_dim=256,
    batch=2,
    seq=128,
)
AUTO_LINE = re.compile(r"(model\.\w+=auto -> .*)")
GPU_FLAGS_LINE = re.compile(r"(GPU XLA flags: .*)")
ENV_TOKEN = re.compile(r"[A-Z_][A-Z0-9_]*=")
GIB = 2**30


# ---------------------------------------------------------------- shape and subprocesses


def model_shape(args) -> dict:
    """The model and batch both sides run: configs/gpu-peer.yaml, `--tiny`, `--batch`/`--seq`."""
    import yaml

    cfg = yaml.safe_load(Path(args.config).read_text())
    m, t = cfg["model"], cfg["train"]
    shape = {k: m[k] for k in MODEL_KEYS}
    shape.update(
        rope_theta=float(m.get("rope_theta", 10000.0)),
        tie_embeddings=bool(m.get("tie_embeddings", False)),
        batch=t["global_batch_size"],
        seq=t["seq_len"],
    )
    if args.tiny:
        shape.update(TINY)
    shape["batch"] = args.batch or shape["batch"]
    shape["seq"] = args.seq or shape["seq"]
    return shape


def jaxtrain_overrides(shape: dict, tiny: bool) -> list[str]:
    """The overrides that give `jaxtrain train` the shape."""
    model = [f"model.{k}={shape[k]}" for k in MODEL_KEYS] if tiny else []
    return [*model, f"train.global_batch_size={shape['batch']}", f"train.seq_len={shape['seq']}"]


def run_child(
    cmd: list[str], timeout: float, cwd: str, env: dict[str, str] | None = None
) -> tuple[int | None, str, str]:
    """(exit code or None on timeout, stdout, stderr) of `cmd` in its own process group, which is
    killed as a whole on timeout (torch.compile's compile workers included); `env` goes over
    CHILD_ENV."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env={**CHILD_ENV, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def failure(rc: int | None, err: str, timeout: float) -> str:
    """One line on why a child failed: the last line of its stderr (a traceback's exception)."""
    if rc is None:
        return f"timed out after {timeout:.0f} s"
    lines = [line.strip() for line in err.splitlines() if line.strip()]
    return f"exit {rc}: {lines[-1][:300] if lines else 'no output'}"


def result_line(stdout: str) -> dict | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return None


def window_stats(times: list[float], warmup: int, steps: int, repeats: int) -> dict:
    """Step-time figures of one contender's run: the first `warmup` steps (compiles) left out,
    then `repeats` windows of `steps` steps each, a median per window; `step_time_s` is the
    median of those, with their min and max. Steps past the windows (jaxtrain's last, which
    may wait on the rest) are left out too."""
    need = warmup + steps * repeats
    if len(times) < need:
        raise ValueError(
            f"{len(times)} step times, expected at least warmup {warmup} + {repeats} x {steps} = {need}"
        )
    per_repeat = [
        statistics.median(times[warmup + r * steps : warmup + (r + 1) * steps]) for r in range(repeats)
    ]
    stats = result_file.repeat_stats(per_repeat)
    return {
        "step_time_s": stats["median"],
        "step_time_min_s": stats["min"],
        "step_time_max_s": stats["max"],
        "repeats": repeats,
        "steps_per_repeat": steps,
        "per_repeat_s": per_repeat,
    }


# ---------------------------------------------------------------- contenders


def jaxtrain_remat(overrides: list[str], auto_lines: list[str]) -> str:
    """The remat policy a jaxtrain run used: its override, else what `auto` resolved to."""
    for token in reversed(overrides):
        if token.startswith("model.remat="):
            return token.split("=", 1)[1]
    for line in auto_lines:
        if line.startswith("model.remat=auto -> "):
            return line[len("model.remat=auto -> ") :].split()[0].rstrip(":,;")
    return "auto"


def safe_name(label: str) -> str:
    """`label` as a folder name."""
    return re.sub(r"[^\w.=-]", "_", label)


def run_jaxtrain(label: str, overrides: list[str], env: dict[str, str], shape: dict, args) -> dict:
    out = tempfile.mkdtemp(prefix=f"gpu-peer-jaxtrain-{safe_name(label)}-")
    cmd = [
        sys.executable,
        "-m",
        "jaxtrain",
        "train",
        str(Path(args.config).resolve()),
        f"output_dir={out}",
        f"train.steps={total_steps(args) + 1}",
        *jaxtrain_overrides(shape, args.tiny),
        *overrides,
    ]
    row = {"contender": f"jaxtrain ({label})", "side": "jaxtrain", "overrides": overrides, "env": env}
    start = time.perf_counter()
    rc, stdout, stderr = run_child(cmd, args.timeout, out, env)
    row["wall_s"] = time.perf_counter() - start
    log = (stdout + stderr).splitlines()
    row["auto"] = [m.group(1).strip() for m in map(AUTO_LINE.search, log) if m]
    row["remat"] = jaxtrain_remat(overrides, row["auto"])
    flags = [m.group(1).strip() for m in map(GPU_FLAGS_LINE.search, log) if m]
    row["gpu_xla_flags"] = flags[-1] if flags else None
    metrics = Path(out) / "metrics.jsonl"
    if rc != 0 or not metrics.is_file():
        return {**row, "error": failure(rc, stderr, args.timeout), "output_dir": out}
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = sorted((r for r in records if "step" in r and "step_time_s" in r), key=lambda r: r["step"])
    peaks = [r["peak_memory_bytes"] for r in steps if r.get("peak_memory_bytes") is not None]
    shutil.rmtree(out, ignore_errors=True)
    timed = steps[args.warmup : total_steps(args)]
    return {
        **row,
        **window_stats([r["step_time_s"] for r in steps], args.warmup, args.steps, args.repeats),
        "peak_memory_bytes": max(peaks) if peaks else None,
        "jaxtrain_mfu": statistics.median(r["mfu"] for r in timed)
        if all("mfu" in r for r in timed)
        else None,
        "final_loss": steps[-1]["loss"],
    }


def total_steps(args) -> int:
    """Training steps a contender runs: warmup, then the repeats' timed windows."""
    return args.warmup + args.steps * args.repeats


def run_torch(run: torch_peer.TorchRun, shape: dict, args) -> dict:
    cwd = tempfile.mkdtemp(prefix=f"gpu-peer-torch-{safe_name(run.label)}-")
    cmd = [args.torch_python, str(HERE), "--worker", "torch", "--run", json.dumps(dataclasses.asdict(run))]
    cmd += ["--shape", json.dumps(shape), "--total-steps", str(total_steps(args))]
    start = time.perf_counter()
    rc, stdout, stderr = run_child(cmd, args.timeout, cwd)
    shutil.rmtree(cwd, ignore_errors=True)
    row = {
        "contender": run.label,
        "side": "torch",
        "setting": run.describe(),
        "remat": run.remat,
        "wall_s": time.perf_counter() - start,
    }
    result = result_line(stdout) if rc == 0 else None
    if result is None:
        return {**row, "error": failure(rc, stderr, args.timeout)}
    return {**row, **result, **window_stats(result["step_times_s"], args.warmup, args.steps, args.repeats)}


def run_attention(args) -> dict:
    cwd = tempfile.mkdtemp(prefix="gpu-peer-attention-")
    cmd = [sys.executable, str(HERE), "--worker", "attention", "--attn-shape", args.attn_shape]
    cmd += ["--attn-dtype", args.attn_dtype, "--attn-iters", str(args.attn_iters)]
    start = time.perf_counter()
    rc, stdout, stderr = run_child(cmd, args.timeout, cwd)
    shutil.rmtree(cwd, ignore_errors=True)
    result = result_line(stdout) if rc == 0 else None
    if result is None:
        return {"error": failure(rc, stderr, args.timeout), "wall_s": time.perf_counter() - start}
    return {**result, "wall_s": time.perf_counter() - start}


def torch_runs(only: list[str], args) -> list[torch_peer.TorchRun]:
    """The torch contenders: the sections named in --only with the --torch-* settings, then
    --torch-variants (each starting from torch.compile with those settings)."""
    base = torch_peer.TorchRun(
        "torch-compile",
        compile=True,
        mode=args.torch_compile_mode,
        attention=args.torch_attention,
        loss=args.torch_loss,
        remat=args.torch_remat,
    )
    runs = []
    if "torch-eager" in only:
        runs.append(dataclasses.replace(base, label="torch-eager", compile=False))
    if "torch-compile" in only:
        runs.append(base)
    if "torchtitan" in only:
        runs.append(dataclasses.replace(base, label="torchtitan", model="torchtitan", attention="auto"))
    runs += torch_peer.parse_runs(args.torch_variants, base)
    labels = [r.label for r in runs]
    if dupes := sorted({x for x in labels if labels.count(x) > 1}):
        raise ValueError(f"--torch-variants: labels {dupes} clash with the sections' runs")
    return runs


# ---------------------------------------------------------------- workers (own processes)


def causal_flops(b: int, s: int, h: int, d: int, matmuls: int) -> float:
    """The causal minimum, as benchmarks/attention.py counts it: `matmuls` matmuls of (s^2 / 2) x d
    per head (2 forward, 7 forward + backward)."""
    return matmuls * 2 * (s * s / 2) * d * h * b


def fwd_bwd(f):
    """jit of value_and_grad of sum(f(q, k, v) * c) in f32, over q, k, v (c: a fixed cotangent)."""
    import jax
    import jax.numpy as jnp

    loss = lambda q, k, v, c: jnp.sum(f(q, k, v).astype(jnp.float32) * c)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def median_time(f, *a, iters: int, warmup: int = 3) -> float:
    """Median seconds of `iters` calls of f(*a), after `warmup` calls, each to completion."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(f(*a))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*a))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention_worker(shape_text: str, dtype_name: str, iters: int, warmup: int = 3) -> dict:
    """Ours (Pallas), cuDNN and XLA attention, timed and checked against f32 XLA."""
    import jax
    import jax.numpy as jnp

    from jaxtrain.pallas_kernels import sharded_flash_attention

    b, s, h, kv, d = (int(x) for x in shape_text.split(","))
    dtype = jnp.dtype(dtype_name)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, s, h, d), dtype)
    k = jax.random.normal(keys[1], (b, s, kv, d), dtype)
    v = jax.random.normal(keys[2], (b, s, kv, d), dtype)
    cot = jax.random.normal(keys[3], (b, s, h, d), jnp.float32)

    def dpa(implementation):
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=implementation
        )

    impls = {
        "ours (Pallas)": lambda q, k, v: sharded_flash_attention(
            q,
            k,
            v,
            mesh=None,
            batch_axes=(),
            head_axes=(),
            causal=True,
            segment_ids=None,
            sliding_window=None,
        ),
        "cuDNN": dpa("cudnn"),
        "XLA": dpa("xla"),
    }

    # The reference, one batch row at a time (quadratic memory in f32), at full f32 precision.
    with jax.default_matmul_precision("highest"):
        ref_fwd, ref_grad = jax.jit(dpa("xla")), fwd_bwd(dpa("xla"))
        rows = []
        for i in range(b):
            args32 = [x[i : i + 1].astype(jnp.float32) for x in (q, k, v)]
            rows.append((ref_fwd(*args32), *ref_grad(*args32, cot[i : i + 1])[1]))
        ref = [jnp.concatenate(parts) for parts in zip(*rows)]
        del rows

    rel_err = jax.jit(lambda x, r: jnp.max(jnp.abs(x.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))

    timed = lambda f, *a: median_time(f, *a, iters=iters, warmup=warmup)
    flops_fwd, flops_all = causal_flops(b, s, h, d, 2), causal_flops(b, s, h, d, 7)
    results = []
    for name, f in impls.items():
        row = {"impl": name}
        try:
            fwd = jax.jit(f)
            row["err_out"] = float(rel_err(fwd(q, k, v), ref[0]))
            row["fwd_s"] = timed(fwd, q, k, v)
            row["fwd_tflops"] = flops_fwd / row["fwd_s"] / 1e12
        except Exception as e:  # noqa: BLE001 - an implementation this device lacks is a row of the table
            row["fwd_error"] = _error_text(e)
        try:
            grad = fwd_bwd(f)
            grads = grad(q, k, v, cot)[1]
            for g, r, key in zip(grads, ref[1:], ("err_dq", "err_dk", "err_dv")):
                row[key] = float(rel_err(g, r))
            row["fwd_bwd_s"] = timed(grad, q, k, v, cot)
            row["fwd_bwd_tflops"] = flops_all / row["fwd_bwd_s"] / 1e12
        except Exception as e:  # noqa: BLE001 - as above, for the backward
            row["fwd_bwd_error"] = _error_text(e)
        results.append(row)
    del ref
    device = jax.devices()[0]
    return {
        "device": f"{device.platform}: {device.device_kind}",
        "jax": jax.__version__,
        "shape": dict(zip(("batch", "seq", "heads", "kv_heads", "head_dim"), (b, s, h, kv, d))),
        "dtype": dtype.name,
        "flops_fwd": flops_fwd,
        "flops_fwd_bwd": flops_all,
        "rows": results,
        "cudnn_wrapper": cudnn_wrapper_rows(q, k, v, cot, timed),
    }


def cudnn_wrapper_rows(q, k, v, cot, timed) -> list[dict]:
    """jaxtrain's cuDNN wrapper as the model calls it (fallback: the Pallas flash kernel) on
    padded rows, packed rows and a sliding window; each case's failure is its row's error."""
    import jax
    import jax.numpy as jnp

    from jaxtrain.models.attention import attend
    from jaxtrain.pallas_kernels import reference
    from jaxtrain.pallas_kernels.cudnn_attention import single_document_lengths

    b, s = q.shape[:2]
    pos, row_i = jnp.arange(s)[None, :], jnp.arange(b)[:, None]
    # one document (id 1) per row, each row's length different and off the block sizes, then 0s
    lengths = jnp.clip(s * (b - row_i) // (b + 1) - 7 * (row_i + 1), 1, s - 1)
    padded = (pos < lengths).astype(jnp.int32)
    # three documents per row (ids 1, 2, 3), boundaries differing per row
    cut1 = jnp.minimum(s * (row_i + 1) // (2 * (b + 1)) + 3, s - 2)
    cut2 = jnp.minimum(cut1 + s // 3 + 11, s - 1)
    packed = (1 + (pos >= cut1) + (pos >= cut2)).astype(jnp.int32)
    window = max(1, min(1024, s // 4))
    cases = [
        ("cudnn-wrapper one doc + padding", padded, None),
        ("cudnn-wrapper packed docs (fallback)", packed, None),
        (f"cudnn-wrapper window {window}", None, window),
    ]

    def loss_of(f):
        return lambda q, k, v, seg, c: jnp.sum(f(q, k, v, seg).astype(jnp.float32) * c)

    def masked_err(x, r, m):
        m = jnp.broadcast_to(m, r.shape)
        num = jnp.max(jnp.where(m, jnp.abs(x.astype(jnp.float32) - r), 0.0))
        return num / jnp.max(jnp.where(m, jnp.abs(r), 0.0))

    masked_err = jax.jit(masked_err)
    finite = jax.jit(lambda x: jnp.all(jnp.isfinite(x)))
    rows = []
    for name, seg, win in cases:
        row = {"case": name, "sliding_window": win}
        if seg is not None:
            row["single_document"] = bool(single_document_lengths(seg)[1])
        real = jnp.ones((b, s), bool) if seg is None else seg != 0
        real4 = real[:, :, None, None]
        c = cot * real4

        def wrapper(q, k, v, seg, win=win):  # the model's own dispatch (no mesh: one shard)
            return attend(q, k, v, segment_ids=seg, causal=True, impl="cudnn", sliding_window=win)

        def ref_attention(q, k, v, seg, win=win):
            return reference.attention(q, k, v, causal=True, segment_ids=seg, sliding_window=win)

        try:  # the reference, one batch row at a time, in f32 at highest precision
            with jax.default_matmul_precision("highest"):
                ref_fwd = jax.jit(ref_attention)
                ref_grad = jax.jit(jax.value_and_grad(loss_of(ref_attention), argnums=(0, 1, 2)))
                parts = []
                for i in range(b):
                    a32 = [x[i : i + 1].astype(jnp.float32) for x in (q, k, v)]
                    sg = None if seg is None else seg[i : i + 1]
                    parts.append((ref_fwd(*a32, sg), *ref_grad(*a32, sg, c[i : i + 1])[1]))
                ref = [jnp.concatenate(xs) for xs in zip(*parts)]
                del parts
        except Exception as e:  # noqa: BLE001 - a case that cannot run is a row of the table
            rows.append({**row, "error": "reference: " + _error_text(e)})
            continue
        is_finite = {}
        try:
            out = jax.jit(wrapper)(q, k, v, seg)
            row["err_out"] = float(masked_err(out, ref[0], real4))
            is_finite["out"] = bool(finite(out))
            del out
        except Exception as e:  # noqa: BLE001 - as above
            row["fwd_error"] = _error_text(e)
        try:
            grad = jax.jit(jax.value_and_grad(loss_of(wrapper), argnums=(0, 1, 2)))
            grads = grad(q, k, v, seg, c)[1]
            for g, r, key in zip(grads, ref[1:], ("dq", "dk", "dv")):
                row[f"err_{key}"] = float(masked_err(g, r, True))
                is_finite[key] = bool(finite(g))
            del grads
            row["fwd_bwd_s"] = timed(grad, q, k, v, seg, c)
        except Exception as e:  # noqa: BLE001 - as above
            row["fwd_bwd_error"] = _error_text(e)
        del ref
        rows.append({**row, "finite": is_finite})
    return rows


def _error_text(e: BaseException, limit: int = 200) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- figures and tables


def gpu_name() -> str | None:
    """The first GPU's name, from nvidia-smi (this process stays off the GPU)."""
    if not shutil.which("nvidia-smi"):
        return None
    proc = subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
    )
    names = proc.stdout.strip().splitlines() if proc.returncode == 0 else []
    return names[0].strip() if names else None


def model_flops(shape: dict, args) -> tuple[float, int]:
    """(FLOPs per token, parameters) as jaxtrain counts them, from its config of the shape."""
    os.environ["JAX_PLATFORMS"] = "cpu"  # this process: never the GPU (CHILD_ENV keeps the caller's)
    from jaxtrain.config import load_config
    from jaxtrain.planning.flops import flops_per_token

    cfg = load_config(args.config, jaxtrain_overrides(shape, args.tiny))
    return flops_per_token(cfg.model, cfg.train.seq_len), cfg.model.param_count()


def peak_flops(device: str | None, override_tflops: float | None) -> float | None:
    """Dense bf16 peak FLOP/s of one `device` (a GPU name), or None: no MFU."""
    if override_tflops:
        return override_tflops * 1e12
    if device is None:
        return None
    from jaxtrain.sharding.hardware import peak_flops_for_device_kind

    return peak_flops_for_device_kind(device, "bfloat16")


def add_figures(rows: list[dict], shape: dict, flops_token: float, peak: float | None) -> None:
    """tokens/s, MFU and the fastest torch run's step time over each row's."""
    tokens = shape["batch"] * shape["seq"]
    torch_times = [r["step_time_s"] for r in rows if r.get("side") == "torch" and "step_time_s" in r]
    fastest = min(torch_times) if torch_times else None
    for r in rows:
        if "step_time_s" not in r:
            continue
        r["tokens_per_second"] = tokens / r["step_time_s"]
        r["mfu"] = flops_token * r["tokens_per_second"] / peak if peak else None
        r["vs_fastest_torch"] = fastest / r["step_time_s"] if fastest else None


def check_param_counts(params: int, rows: list[dict]) -> list[str]:
    """One line per torch run whose model has another number of parameters than jaxtrain's."""
    return [
        f"{r['contender']}: {r['params']:,} parameters, jaxtrain's model {params:,}: not the same model"
        for r in rows
        if r.get("params") is not None and r["params"] != params
    ]


def memory_pairs(rows: list[dict]) -> list[dict]:
    """Peak memory side by side: jaxtrain's default run (`auto`) against each torch run at
    torch's default (no remat), and every jaxtrain run against every torch run at the same
    remat policy (`none` or `full`)."""
    measured = [r for r in rows if r.get("peak_memory_bytes") and "error" not in r]
    jax_rows = [r for r in measured if r.get("side") == "jaxtrain"]
    torch_rows = [r for r in measured if r.get("side") == "torch"]

    def pair(what: str, j: dict, t: dict) -> dict:
        return {
            "comparison": what,
            "jaxtrain": j["contender"],
            "torch": t["contender"],
            "jaxtrain_bytes": j["peak_memory_bytes"],
            "torch_bytes": t["peak_memory_bytes"],
            "ratio": j["peak_memory_bytes"] / t["peak_memory_bytes"],
        }

    pairs = [
        pair(f"each side's default (jaxtrain remat {j['remat']}, torch none)", j, t)
        for j in jax_rows
        if j["contender"] == "jaxtrain (auto)"
        for t in torch_rows
        if t["remat"] == "none"
    ]
    pairs += [
        pair(f"same remat: {t['remat']}", j, t)
        for t in torch_rows
        for j in jax_rows
        if j["remat"] == t["remat"]
    ]
    return pairs


def _cell(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _clean(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(_clean(str(c)) for c in row) + " |" for row in rows])


STEP_HEADER = [
    "contender",
    "s/step (median)",
    "repeats min-max",
    "tokens/s",
    "MFU",
    "peak GiB",
    "fastest torch / this",
    "notes",
]


def contender_cells(rows: list[dict]) -> list[list[str]]:
    cells_of = []
    for r in rows:
        if "error" in r:
            cells = [r["contender"], f"error: {_clean(r['error'])}", *[""] * (len(STEP_HEADER) - 3)]
        else:
            peak = r.get("peak_memory_bytes")
            cells = [
                r["contender"],
                f"{r['step_time_s']:.4f}",
                f"{r['step_time_min_s']:.4f}-{r['step_time_max_s']:.4f}",
                f"{r['tokens_per_second']:,.0f}",
                "n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%",
                "n/a" if peak is None else f"{peak / GIB:.1f}",
                _cell(r.get("vs_fastest_torch"), ".2f"),
            ]
        cells.append(_clean("; ".join(contender_notes(r))))
        cells_of.append(cells)
    return cells_of


def contender_notes(r: dict) -> list[str]:
    notes = [
        a.split(":")[0] for a in r.get("auto", []) if a.startswith(("model.attention_impl", "model.remat"))
    ]
    if r.get("gpu_xla_flags"):
        notes.append(r["gpu_xla_flags"].split(";")[0].replace(" (docs/gpu.md)", ""))
    given = [f"{name}={value}" for name, value in r.get("env", {}).items()]
    if given or r.get("overrides"):
        notes.insert(0, " ".join([*given, *r.get("overrides", [])]))
    if r.get("setting"):
        notes.append(r["setting"])
    if r.get("sdpa_ops"):
        ran = sorted(
            {op.removeprefix("aten::").removesuffix("_backward") for op in r["sdpa_ops"]}
            - {"scaled_dot_product_attention"}
        )
        notes.append("ran " + ", ".join(ran))
    if "graph_breaks" in r:
        notes.append(f"{r['graphs']} graphs, {r['graph_breaks']} graph breaks")
    if r.get("reserved_memory_bytes"):
        notes.append(f"reserved {r['reserved_memory_bytes'] / GIB:.1f} GiB")
    return notes


MEMORY_HEADER = ["comparison", "jaxtrain", "GiB", "torch", "GiB", "jaxtrain / torch"]


def memory_cells(pairs: list[dict]) -> list[list[str]]:
    return [
        [
            p["comparison"],
            p["jaxtrain"],
            f"{p['jaxtrain_bytes'] / GIB:.1f}",
            p["torch"],
            f"{p['torch_bytes'] / GIB:.1f}",
            f"{p['ratio']:.2f}",
        ]
        for p in pairs
    ]


ATTENTION_HEADER = [
    "impl",
    "fwd ms",
    "fwd TFLOP/s",
    "fwd+bwd ms",
    "fwd+bwd TFLOP/s",
    "err out",
    "err dq",
    "err dk",
    "err dv",
]


def attention_cells(att: dict) -> list[list[str]]:
    rows = []
    for r in att["rows"]:
        cells = [r["impl"]]
        for part in ("fwd", "fwd_bwd"):
            if f"{part}_error" in r:
                cells += [f"error: {_clean(r[f'{part}_error'])}", ""]
            else:
                cells += [f"{1e3 * r[f'{part}_s']:.3f}", f"{r[f'{part}_tflops']:.3g}"]
        cells += [_cell(r.get(key), ".2e") for key in ("err_out", "err_dq", "err_dk", "err_dv")]
        rows.append(cells)
    return rows


def attention_table(att: dict) -> str:
    if "error" in att:
        return f"attention: error: {att['error']}"
    s = att["shape"]
    head = (
        f"Attention B{s['batch']} S{s['seq']} H{s['heads']}/{s['kv_heads']} D{s['head_dim']} causal "
        f"{att['dtype']} on {att['device']} (jax {att['jax']}): causal minimum "
        f"{att['flops_fwd'] / 1e12:.3g} TFLOP forward, {att['flops_fwd_bwd'] / 1e12:.3g} forward + backward; "
        "error = max|x - ref| / max|ref| against XLA in f32\n\n"
    )
    wrapper = att.get("cudnn_wrapper")
    table = markdown(ATTENTION_HEADER, attention_cells(att))
    return head + table + ("\n\n" + wrapper_table(wrapper) if wrapper else "")


WRAPPER_HEADER = ["case", "fwd+bwd ms", "err out", "err dq", "err dk", "err dv", "finite"]


def wrapper_cells(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        if "error" in r:
            out.append([r["case"], f"error: {_clean(r['error'])}", *[""] * 5])
            continue
        bwd_error, fwd_error = r.get("fwd_bwd_error"), r.get("fwd_error")
        cells = [r["case"]]
        cells.append(f"error: {_clean(bwd_error)}" if bwd_error else f"{1e3 * r['fwd_bwd_s']:.3f}")
        if fwd_error:
            cells.append("error (as fwd+bwd)" if fwd_error == bwd_error else f"error: {_clean(fwd_error)}")
        else:
            cells.append(_cell(r.get("err_out"), ".2e"))
        cells += [_cell(r.get(key), ".2e") for key in ("err_dq", "err_dk", "err_dv")]
        fin = r.get("finite", {})
        bad = [key for key, ok in fin.items() if not ok]
        cells.append("n/a" if not fin else f"no ({', '.join(bad)})" if bad else f"yes ({len(fin)}/4)")
        out.append(cells)
    return out


def wrapper_table(rows: list[dict]) -> str:
    head = (
        "jaxtrain's cuDNN wrapper (pallas_kernels/cudnn_attention.py, fallback: the Pallas flash "
        "kernel), causal, same shape; error against pallas_kernels/reference.py in f32 with the "
        "same mask (padding: real queries only, cotangent 0 on padding); finite: output and "
        "dq, dk, dv over the full arrays\n\n"
    )
    return head + markdown(WRAPPER_HEADER, wrapper_cells(rows))


# ---------------------------------------------------------------- main


def parse_variants(text: str, with_auto: bool = True) -> list[tuple[str, list[str], dict[str, str]]]:
    """`label:token token;...` -> [(label, overrides, environment)], the default `auto` run
    first (unless not `with_auto`); `NAME=value` tokens (NAME upper-case) are environment
    variables, a repeated NAME appending its value after a space, the others overrides."""
    variants = {"auto": ([], {})} if with_auto else {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        label, _, tokens = entry.partition(":") if ":" in entry else (entry, "", entry)
        overrides, env = [], {}
        for token in tokens.split():
            if ENV_TOKEN.match(token):
                name, _, value = token.partition("=")
                env[name] = f"{env[name]} {value}" if name in env else value
            else:
                overrides.append(token)
        variants[label.strip()] = (overrides, env)
    return [(label, overrides, env) for label, (overrides, env) in variants.items()]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per repeat (>= 20)")
    ap.add_argument("--repeats", type=int, default=3, help="timed windows per contender: min/median/max")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles)")
    ap.add_argument(
        "--only", default=",".join(DEFAULT_SECTIONS), help=f"comma-separated, of {','.join(SECTIONS)}"
    )
    ap.add_argument(
        "--jaxtrain-variants",
        default="",
        help="more jaxtrain runs: 'label:override NAME=value ...;label:...' (after the default "
        "`auto`; NAME=value: the child's environment)",
    )
    ap.add_argument("--no-auto", action="store_true", help="only the --jaxtrain-variants runs")
    ap.add_argument("--torch-attention", choices=torch_peer.ATTENTION, default="auto", help="SDPA backend")
    ap.add_argument(
        "--torch-loss", choices=torch_peer.LOSSES, default="hf", help="hf, or Liger's fused linear CE"
    )
    ap.add_argument("--torch-compile-mode", choices=torch_peer.COMPILE_MODES, default="default")
    ap.add_argument(
        "--torch-remat", choices=torch_peer.REMAT, default="none", help="activation checkpointing"
    )
    ap.add_argument(
        "--torch-variants",
        default="",
        help="more torch runs: 'label:model=torchtitan compile=1 mode=max-autotune attention=cudnn "
        "loss=liger remat=full;label:...' (each from torch.compile with the --torch-* settings)",
    )
    ap.add_argument("--config", default=str(CONFIG), help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=None, help="global batch, both sides")
    ap.add_argument("--seq", type=int, default=None, help="sequence length, both sides")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on both sides (CPU logic check)")
    ap.add_argument("--attn-shape", default="4,4096,32,8,128", help="B,S,H,KV,D")
    ap.add_argument("--attn-dtype", default="bfloat16")
    ap.add_argument("--attn-iters", type=int, default=20, help="timed runs per attention measurement")
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak for MFU (default: the GPU's bf16)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per worker")
    ap.add_argument("--torch-python", default=sys.executable, help="Python of the torch workers")
    ap.add_argument("--json", metavar="OUT", default=None, help="also write every result as JSON")
    # Hidden: the workers' own modes (this file, in a child process).
    ap.add_argument("--worker", choices=("torch", "attention"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--total-steps", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    return ap


def check_args(ap: argparse.ArgumentParser, args) -> list[str]:
    """The sections to run; exits with a usage error on a bad combination."""
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if bad := sorted(set(only) - set(SECTIONS)):
        ap.error(f"--only: unknown sections {bad}; expected some of {','.join(SECTIONS)}")
    if args.steps < MIN_TIMED_STEPS:
        ap.error(f"--steps={args.steps}: expected >= {MIN_TIMED_STEPS} timed steps per repeat")
    if args.repeats < 1 or args.warmup < 1:
        ap.error(f"--repeats={args.repeats}, --warmup={args.warmup}: expected >= 1 each")
    try:
        torch_runs(only, args)
    except ValueError as e:
        ap.error(str(e))
    return only


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)

    if args.worker == "torch":
        run = torch_peer.TorchRun(**json.loads(args.run))
        result = torch_peer.worker(json.loads(args.shape), run, args.total_steps)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if args.worker == "attention":
        result = attention_worker(args.attn_shape, args.attn_dtype, args.attn_iters)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    only = check_args(ap, args)
    with result_file.record("gpu_peer", argv if argv is None else [__file__, *argv]) as rec:
        return run_sections(only, args, rec)


def run_sections(only: list[str], args, rec) -> int:
    shape = model_shape(args)
    flops_token, params = model_flops(shape, args)

    def report(row: dict) -> dict:
        print(json.dumps(row), flush=True)
        return row

    rows = []
    if "jaxtrain" in only:
        for label, overrides, env in parse_variants(args.jaxtrain_variants, not args.no_auto):
            print(f"# jaxtrain ({label}) ...", file=sys.stderr, flush=True)
            rows.append(report(run_jaxtrain(label, overrides, env, shape, args)))
    for run in torch_runs(only, args):
        print(f"# {run.label} ({run.describe()}) ...", file=sys.stderr, flush=True)
        rows.append(report(run_torch(run, shape, args)))
    attention = None
    if "attention" in only:
        print("# attention ...", file=sys.stderr, flush=True)
        attention = report(run_attention(args))

    device = gpu_name() or next((r["device"] for r in rows if r.get("device", "cpu") != "cpu"), None)
    peak = peak_flops(device, args.peak_tflops)
    add_figures(rows, shape, flops_token, peak)
    mismatched = check_param_counts(params, rows)
    pairs = memory_pairs(rows)
    results = {
        "device": device or "cpu",
        "peak_flops": peak,
        "shape": shape,
        "params": params,
        "flops_per_token": flops_token,
        "warmup": args.warmup,
        "steps": args.steps,
        "repeats": args.repeats,
        "contenders": rows,
        "memory": pairs,
        "param_mismatches": mismatched,
        "attention": attention,
    }
    rec.figures.update(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")

    print()
    if rows:
        print(
            f"{device or 'CPU'}: Llama of {params:,} parameters (d_model {shape['d_model']}, "
            f"{shape['n_layers']} layers, {shape['n_heads']}/{shape['n_kv_heads']} heads of "
            f"{shape['head_dim']}, mlp {shape['mlp_dim']}, vocab {shape['vocab_size']}), batch "
            f"{shape['batch']} x {shape['seq']}; after {args.warmup} untimed steps, the median of "
            f"{args.repeats} repeats of the median of {args.steps} steps; "
            f"{flops_token / 1e9:.3g} GFLOP/token; MFU "
            + (f"against {peak / 1e12:.0f} TFLOP/s" if peak else "n/a (no GPU peak)")
            + "\n"
        )
        step_rows = contender_cells(rows)
        rec.table("step", STEP_HEADER, step_rows)
        print(markdown(STEP_HEADER, step_rows))
        autos = [
            (r["contender"], a)
            for r in rows
            for a in [*r.get("auto", []), r.get("gpu_xla_flags")]
            if a and a.startswith(("model.attention_impl", "model.remat", "GPU XLA flags"))
        ]
        if autos:
            print()
            for who, line in autos:
                print(f"- {who}: {line}")
    if pairs:
        print("\nPeak memory, jaxtrain against torch:\n")
        rec.table("memory", MEMORY_HEADER, memory_cells(pairs))
        print(markdown(MEMORY_HEADER, memory_cells(pairs)))
    if attention is not None:
        print()
        print(attention_table(attention))
        if "error" not in attention:
            rec.table("attention", ATTENTION_HEADER, attention_cells(attention))
            if attention.get("cudnn_wrapper"):
                rec.table("cudnn_wrapper", WRAPPER_HEADER, wrapper_cells(attention["cudnn_wrapper"]))
    if mismatched:
        print("\nparameter counts differ:\n" + "\n".join(mismatched), file=sys.stderr)
        raise SystemExit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

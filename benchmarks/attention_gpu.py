"""Attention kernels timed on one real GPU (`benchmarks/attention.py --gpu`, which hands its
arguments here): ours against cuDNN and XLA over a sweep of shapes.

    python benchmarks/attention.py --gpu [--cases base,dim64,...] [--impls triton,mosaic,cudnn,xla]
        [--iters 20] [--check] [--tiny] [--json OUT]

Every case is GQA attention in bf16, forward and forward + backward (value_and_grad of
sum(out * c) for a fixed f32 cotangent c), median of `--iters` calls after 3 warm-up calls.
TFLOP/s count the attended (query, key) pairs only: 2 matmuls of pairs x head_dim per head
forward, 7 forward + backward (the causal minimum of benchmarks/attention.py and gpu_peer.py
when there is no window; with a window, the pairs inside it).

Implementations (columns):
- `triton`: ours, `flash_attention` (Pallas; Triton on a GPU, the interpreter on CPU).
- `mosaic`: ours, `flash_mgpu.flash_attention_mgpu` (Pallas Mosaic GPU, Hopper only; a row says
  why where this jaxtrain has no such kernel or the GPU is not sm90); `mosaic+key=value`
  overrides one of its ``default_blocks`` (``mosaic+dkv_parts=1``).
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")` (a window as
  `local_window_size=(window - 1, 0)`).
- `xla`: `implementation="xla"`, skipped past `--xla-max-seq` (quadratic memory).

Cases (`--cases`, default all): `base` is the issue's shape (B4 S4096, 32 query / 8 kv heads of
128, causal); `dim64` / `dim256` change head_dim (heads 32 / 16); `seq2k`, `seq8k`, `seq16k`
keep 16k tokens per call (B8 S2048, B2 S8192, B1 S16384), `seq32k` is one row of 32k;
`win1k-s8k` / `win1k-s32k` add a causal sliding window of 1024 keys.

`--check`: each implementation's output and gradients, from the very calls then timed (every
batch row and head), against the f32 XLA reference (cases up to 8k tokens), max |x - ref| /
max |ref| over each whole array; the reference runs one batch row and kv head at a time.
`--tiny`: one small case on CPU (kernels interpreted), for the logic only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.append(str(HERE.parent.parent))  # last: an installed jaxtrain (the GPU host's wheel) comes first
sys.path.insert(0, str(HERE.parent))

import gpu_peer  # noqa: E402  (median_time, fwd_bwd: the timing rules of the attention section there)

IMPLS = ("triton", "mosaic", "cudnn", "xla")
# name: (batch, seq, q_heads, kv_heads, head_dim, window)
CASES = {
    "base": (4, 4096, 32, 8, 128, None),
    "dim64": (4, 4096, 32, 8, 64, None),
    "dim256": (4, 4096, 16, 8, 256, None),
    "seq2k": (8, 2048, 32, 8, 128, None),
    "seq8k": (2, 8192, 32, 8, 128, None),
    "seq16k": (1, 16384, 32, 8, 128, None),
    "seq32k": (1, 32768, 32, 8, 128, None),
    "win1k-s8k": (2, 8192, 32, 8, 128, 1024),
    "win1k-s32k": (1, 32768, 32, 8, 128, 1024),
}
TINY = {
    "tiny": (1, 256, 2, 1, 64, None),
    "tiny-win": (1, 256, 2, 1, 64, 64),
    "tiny-gqa": (2, 128, 8, 2, 64, None),  # two batch rows, two kv heads with groups of 4
}
CHECK_MAX_SEQ = 8192


def attended_pairs(seq: int, window: int | None) -> int:
    """(query, key) pairs a causal mask allows, with an optional sliding window of `window` keys
    (query i sees keys max(0, i - window + 1) .. i)."""
    if window is None or window >= seq:
        return seq * (seq + 1) // 2
    return window * (window + 1) // 2 + (seq - window) * window


def attention_flops(
    batch: int, seq: int, heads: int, head_dim: int, window: int | None, matmuls: int
) -> float:
    return matmuls * 2.0 * attended_pairs(seq, window) * head_dim * heads * batch


def implementation(name: str, window: int | None, on_cpu: bool):
    """f(q, k, v) for one column, or raise why it cannot run here."""
    import jax

    if name == "triton":
        from jaxtrain.pallas_kernels import flash_attention

        return lambda q, k, v: flash_attention(q, k, v, causal=True, sliding_window=window)
    if name.split("+")[0] == "mosaic":
        try:
            from jaxtrain.pallas_kernels.flash_mgpu import flash_attention_mgpu
        except ImportError as e:
            raise NotImplementedError("this jaxtrain has no Mosaic GPU flash kernel") from e
        blocks = mosaic_blocks(name)
        return lambda q, k, v: flash_attention_mgpu(
            q, k, v, causal=True, sliding_window=window, interpret=on_cpu, **blocks
        )
    if name in ("cudnn", "xla"):
        local = None if window is None else (window - 1, 0)
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=local, implementation=name
        )
    raise ValueError(f"--impls: unknown implementation {name!r}; expected some of {', '.join(IMPLS)}")


def parse_blocks(items: list[str], source: str) -> dict:
    """``key=integer`` items as overrides of ``flash_mgpu.default_blocks`` (``source`` names
    where they came from, for the error)."""
    blocks = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not value.isdigit():
            raise ValueError(f"{source}: expected key=integer items, got {item!r}")
        blocks[key] = int(value)
    return blocks


def mosaic_blocks(name: str) -> dict:
    """The block overrides of an impl named ``mosaic+key=value+...`` (e.g.
    ``mosaic+dkv_parts=1``: the head_dim-256 dK/dV kernel with full-width accumulators, as
    before it was split)."""
    return parse_blocks(name.split("+")[1:], f"--impls {name!r}")


def _inputs(batch, seq, heads, kv_heads, head_dim):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim), jnp.bfloat16)
    cot = jax.random.normal(keys[3], (batch, seq, heads, head_dim), jnp.float32)
    return q, k, v, cot


GRADS = ("dq", "dk", "dv")


def check_errors(fwd, fwd_bwd, q, k, v, cot, window) -> dict:
    """Relative errors, max |x - ref| / max |ref| over the whole array, of the timed calls'
    results against the f32 XLA reference: `fwd(q, k, v)`'s output and `fwd_bwd(q, k, v, cot)`'s
    gradients, every batch row and every head. The reference runs one batch row and one kv
    head's query group at a time, so that its f32 scores stay small at the largest checked case
    (B2 S8192 with 32 heads: 17 GB for one [B, H, S, S] f32 array whole, 1 GB per slice)."""
    import jax
    import jax.numpy as jnp

    got = (fwd(q, k, v), *fwd_bwd(q, k, v, cot)[1])
    group = q.shape[2] // k.shape[2]
    ref_f = implementation("xla", window, on_cpu=True)
    diff = dict.fromkeys(("out", *GRADS), 0.0)
    scale = dict.fromkeys(diff, 0.0)
    with jax.default_matmul_precision("highest"):
        ref_fwd, ref_fwd_bwd = jax.jit(ref_f), gpu_peer.fwd_bwd(ref_f)
        for b in range(q.shape[0]):
            for h in range(k.shape[2]):
                rows, heads, kv = slice(b, b + 1), slice(h * group, (h + 1) * group), slice(h, h + 1)
                sub = [x[rows, :, hs].astype(jnp.float32) for x, hs in ((q, heads), (k, kv), (v, kv))]
                ref = (ref_fwd(*sub), *ref_fwd_bwd(*sub, cot[rows, :, heads])[1])
                mine = [x[rows, :, hs] for x, hs in zip(got, (heads, heads, kv, kv))]
                for name, x, r in zip(diff, mine, ref):
                    diff[name] = max(diff[name], float(jnp.max(jnp.abs(x.astype(jnp.float32) - r))))
                    scale[name] = max(scale[name], float(jnp.max(jnp.abs(r))))
    return {f"err_{name}": diff[name] / scale[name] for name in diff}


def run_case(name: str, shape, impls: list[str], args) -> list[dict]:
    import jax

    on_cpu = jax.devices()[0].platform == "cpu"
    batch, seq, heads, kv_heads, head_dim, window = shape
    q, k, v, cot = _inputs(batch, seq, heads, kv_heads, head_dim)
    timed = lambda f, *a: gpu_peer.median_time(f, *a, iters=args.iters)
    rows = []
    for impl in impls:
        row = {"case": name, "shape": list(shape[:5]), "window": window, "impl": impl}
        try:
            if impl == "xla" and seq > args.xla_max_seq:
                raise NotImplementedError(f"skipped past --xla-max-seq {args.xla_max_seq} (quadratic memory)")
            f = implementation(impl, window, on_cpu)
            fwd, fwd_bwd = jax.jit(f), gpu_peer.fwd_bwd(f)  # checked, then timed: the same calls
            if args.check and seq <= CHECK_MAX_SEQ:
                row.update(check_errors(fwd, fwd_bwd, q, k, v, cot, window))
            row["fwd_s"] = timed(fwd, q, k, v)
            row["fwd_tflops"] = attention_flops(batch, seq, heads, head_dim, window, 2) / row["fwd_s"] / 1e12
            row["fwd_bwd_s"] = timed(fwd_bwd, q, k, v, cot)
            row["fwd_bwd_tflops"] = (
                attention_flops(batch, seq, heads, head_dim, window, 7) / row["fwd_bwd_s"] / 1e12
            )
        except Exception as e:  # noqa: BLE001 - an implementation this case or device lacks is a row
            row["error"] = gpu_peer._error_text(e)  # noqa: SLF001 - the same wording as gpu_peer's rows
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: one line per case and implementation; ratios against cuDNN in the same case."""
    cudnn = {r["case"]: r for r in rows if r["impl"] == "cudnn" and "fwd_bwd_s" in r}
    out = [
        "| case | B, S, Hq, Hkv, D | window | impl | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s "
        "| x cuDNN (fwd+bwd) | max rel err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            shape = ", ".join(map(str, r["shape"]))
            out.append(f"| {r['case']} | {shape} | {r['window'] or '-'} | {r['impl']} | {r['error']} ||||||")
            continue
        ref = cudnn.get(r["case"])
        ratio = f"{ref['fwd_bwd_s'] / r['fwd_bwd_s']:.2f}" if ref else "-"
        errs = [v for key, v in r.items() if key.startswith("err_")]
        err = f"{max(errs):.1e}" if errs else "-"
        out.append(
            f"| {r['case']} | {', '.join(map(str, r['shape']))} | {r['window'] or '-'} | {r['impl']} "
            f"| {r['fwd_s'] * 1e3:.3f} | {r['fwd_tflops']:.0f} | {r['fwd_bwd_s'] * 1e3:.3f} "
            f"| {r['fwd_bwd_tflops']:.0f} | {ratio} | {err} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--gpu"]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"any of {','.join(CASES)}")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--xla-max-seq", type=int, default=8192)
    parser.add_argument("--check", action="store_true", help="errors against the f32 XLA reference")
    parser.add_argument("--tiny", action="store_true", help="small cases on CPU, for the logic")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    cases = TINY if args.tiny else CASES
    names = list(cases) if args.tiny else [c for c in args.cases.split(",") if c]
    for c in names:
        if c not in cases:
            parser.error(f"--cases: unknown case {c!r}; expected some of {', '.join(cases)}")
    impls = [i for i in args.impls.split(",") if i]
    for i in impls:
        if i.split("+")[0] != "mosaic" and i not in IMPLS:
            parser.error(f"--impls: unknown implementation {i!r}; expected some of {', '.join(IMPLS)}")

    import jax

    device = jax.devices()[0]
    rows = [row for c in names for row in run_case(c, cases[c], impls, args)]
    print(f"attention on {device.platform}: {device.device_kind}, jax {jax.__version__}, iters {args.iters}")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": device.device_kind, "jax": jax.__version__, "rows": rows})
        )
    return 0


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("attention_gpu", main))

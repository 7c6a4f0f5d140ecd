"""Decode throughput of `jaxtrain.models.generate` (KV cache), without a cache, and beside
transformers' `generate` (torch, CPU) on the same weights, in one run.

    python benchmarks/generate.py [--models tiny,bench-peer] [--batches 1,8]
        [--prompt 32] [--new 128] [--repeats 3] [--hf-python /tmp/hf311/bin/python]

Each model is the `model:` section of configs/<name>.yaml (float32, remat none),
randomly initialised (seed 0), and written with `models.to_hf` so that transformers
loads the very same weights. Greedy decoding, no EOS: every row makes `--new` tokens
after a `--prompt`-token random prompt. Three ways:

- cached: `models.generate` (prefill, then one jitted while_loop over the KV cache);
- uncached: one jitted full forward over the sequence so far for every new token
  (`generation.prefill` with one cache slot, so only the last position is unembedded,
  as transformers does), the sequence padded to a multiple of 32 positions so that a
  handful of compiled shapes serve every length;
- transformers: `generate(do_sample=False, use_cache=True/False)` in the Python named by
  `--hf-python` (torch + transformers + safetensors; the recipe is in
  tests/assets/make_hf_assets.py). Skipped when that Python is missing.

Decode tokens/s = batch x (new - 1) / (time(new tokens) - time(1 token)): the prompt's
prefill is subtracted out. Times are medians of `--repeats` runs after a warm-up run
(compiles excluded). The greedy tokens of all ways are compared; random-weight logits
have near ties, so a rare late divergence is float noise, not a bug. Nothing else
should run on the machine meanwhile: this is a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxtrain import models  # noqa: E402
from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.models import generation  # noqa: E402

BUCKET = 32  # uncached: sequence lengths rounded up to this many positions

HF_SCRIPT = r"""
import json, statistics, sys, time
import numpy as np, torch, transformers
from transformers import AutoModelForCausalLM, GenerationConfig
args = json.loads(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(args["hf_dir"], dtype=torch.float32).eval()
prompt = torch.tensor(np.load(args["prompt"]).astype(np.int64))
out = {"torch": torch.__version__, "transformers": transformers.__version__,
       "threads": torch.get_num_threads(), "attn": model.config._attn_implementation}
def run(n, use_cache):
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                           pad_token_id=0, use_cache=use_cache)
    with torch.no_grad():
        t0 = time.perf_counter()
        seq = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=cfg)
        return time.perf_counter() - t0, seq
for use_cache in (True, False):
    times = {}
    for n in (1, args["new"]):
        run(n, use_cache)  # warm-up
        runs = [run(n, use_cache) for _ in range(args["repeats"])]
        times[n] = statistics.median(t for t, _ in runs)
    out["cached" if use_cache else "uncached"] = {"t1": times[1], "tn": times[args["new"]]}
    out["tokens_" + ("cached" if use_cache else "uncached")] = runs[-1][1].numpy().tolist()
print("RESULT " + json.dumps(out))
"""


def model_config(name: str) -> models.ModelConfig:
    path = REPO / "configs" / f"{name}.yaml"
    return load_config(path, ["model.remat=none", "model.compute_dtype=float32"]).model


def timed(fn, repeats: int) -> float:
    """Median wall time of fn() (which blocks) over `repeats` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cached(model, prompt: np.ndarray, n: int) -> np.ndarray:
    return np.asarray(models.generate(model, prompt, max_new_tokens=n))


def _span_fn(graphdef):
    @jax.jit
    def span(state, buf, lengths, steps_mask):
        """len(steps_mask) greedy tokens, each from a full forward over buf (right-padded)."""
        model = nnx.merge(graphdef, state)
        rows = jnp.arange(buf.shape[0])

        def body(carry, _):
            buf, lengths = carry
            logits, _ = generation.prefill(model, buf, lengths, 1)  # full forward, last position
            tok = jnp.argmax(logits, axis=-1).astype(buf.dtype)
            return (buf.at[rows, lengths].set(tok), lengths + 1), None

        return jax.lax.scan(body, (buf, lengths), steps_mask)[0]

    return span


def uncached(model, prompt: np.ndarray, n: int, span_cache: dict) -> np.ndarray:
    """Greedy tokens without a KV cache: the whole sequence so far through the model per token."""
    graphdef, state = nnx.split(model)
    span = span_cache.setdefault("fn", _span_fn(graphdef))
    b, p = prompt.shape
    buf = jnp.asarray(prompt, jnp.int32)
    lengths = jnp.full((b,), p, jnp.int32)
    t = 0
    while t < n:
        width = -(-(p + t + 1) // BUCKET) * BUCKET  # room to write position p + t
        steps = min(n - t, width - (p + t))
        buf = jnp.pad(buf, ((0, 0), (0, width - buf.shape[1])))
        buf, lengths = span(state, buf, lengths, jnp.zeros((steps,)))
        t += steps
    return np.asarray(buf[:, : p + n])


def run_hf(hf_python: str, hf_dir: Path, prompt: np.ndarray, n: int, repeats: int) -> dict | None:
    prompt_path = hf_dir / "prompt.npy"
    np.save(prompt_path, prompt)
    args = json.dumps({"hf_dir": str(hf_dir), "prompt": str(prompt_path), "new": n, "repeats": repeats})
    proc = subprocess.run([hf_python, "-c", HF_SCRIPT, args], capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        print(f"transformers run failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(line[len("RESULT ") :])


def decode_rate(batch: int, n: int, t1: float, tn: float) -> float:
    return batch * (n - 1) / max(tn - t1, 1e-9)


def agreement(a: np.ndarray, b: np.ndarray, p: int) -> str:
    """How many rows' new tokens agree, and where the earliest disagreement is."""
    a, b = np.asarray(a)[:, p:], np.asarray(b)[:, p:]
    same_rows = int((a == b).all(axis=1).sum())
    if same_rows == a.shape[0]:
        return f"all {same_rows} rows equal"
    first = min(int(np.argmax(r)) for r in (a != b) if r.any())
    return f"{same_rows}/{a.shape[0]} rows equal (earliest difference at new token {first})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,bench-peer", help="config names in configs/")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    ap.add_argument("--new", type=int, default=128, help="new tokens per row")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-python", default="/tmp/hf311/bin/python", help="a Python with torch + transformers")
    args = ap.parse_args()
    if args.new < 2 or args.prompt < 1:
        sys.exit(f"--new={args.new} --prompt={args.prompt}: expected --new >= 2 and --prompt >= 1")
    hf_python = args.hf_python if Path(args.hf_python).is_file() else None
    if hf_python is None:
        print(f"{args.hf_python} not found: transformers columns skipped", file=sys.stderr)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs")
    print(
        f"greedy, prompt {args.prompt}, {args.new} new tokens/row, median of {args.repeats}; "
        "decode tokens/s (prefill subtracted)"
    )
    rows = []
    for name in args.models.split(","):
        cfg = model_config(name)
        model = models.Transformer(cfg, rngs=nnx.Rngs(0))
        with tempfile.TemporaryDirectory(prefix=f"gen-bench-{name}-") as tmp:
            hf_dir = models.to_hf(model, Path(tmp) / "hf")
            for batch in map(int, args.batches.split(",")):
                prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, args.prompt))
                prompt = prompt.astype(np.int32)
                spans: dict = {}
                ours = cached(model, prompt, args.new)
                plain = uncached(model, prompt, args.new, spans)
                row = {"model": name, "params": cfg.param_count(), "batch": batch}
                row["cached"] = decode_rate(
                    batch,
                    args.new,
                    timed(lambda: cached(model, prompt, 1), args.repeats),
                    timed(lambda: cached(model, prompt, args.new), args.repeats),
                )
                row["uncached"] = decode_rate(
                    batch,
                    args.new,
                    timed(lambda: uncached(model, prompt, 1, spans), args.repeats),
                    timed(lambda: uncached(model, prompt, args.new, spans), args.repeats),
                )
                row["check"] = "uncached vs cached: " + agreement(ours, plain, args.prompt)
                if hf_python:
                    hf = run_hf(hf_python, hf_dir, prompt, args.new, args.repeats)
                    if hf:
                        for kind in ("cached", "uncached"):
                            row[f"hf_{kind}"] = decode_rate(batch, args.new, hf[kind]["t1"], hf[kind]["tn"])
                        row["check"] += "; transformers vs ours: " + agreement(
                            ours, hf["tokens_cached"], args.prompt
                        )
                        row["hf_versions"] = (
                            f"torch {hf['torch']}, transformers {hf['transformers']}, "
                            f"{hf['threads']} threads, attention {hf['attn']}"
                        )
                rows.append(row)
                print(json.dumps(row), flush=True)
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    hf = any("hf_cached" in r for r in rows)
    head = "| model | params | batch | jaxtrain cached | jaxtrain uncached | cache speed-up |"
    head += " transformers cached | transformers uncached | jaxtrain / transformers (cached) |" if hf else ""
    print("\n" + head)
    print("|" + "---|" * head.count(" |"))
    for r in rows:
        line = (
            f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['batch']} | {r['cached']:.0f} | "
            f"{r['uncached']:.0f} | {r['cached'] / r['uncached']:.1f}x |"
        )
        if hf:
            if "hf_cached" in r:
                line += (
                    f" {r['hf_cached']:.0f} | {r['hf_uncached']:.0f} | {r['cached'] / r['hf_cached']:.2f} |"
                )
            else:
                line += " - | - | - |"
        print(line)
    for r in rows:
        print(f"{r['model']} batch {r['batch']}: {r['check']}")
    if rows and "hf_versions" in rows[0]:
        print(rows[0]["hf_versions"])


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("generate", main))

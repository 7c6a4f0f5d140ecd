"""Data pipeline throughput: `jaxtrain tokenize` and the `tokens` loader.

    python benchmarks/data.py [--corpus-mb 64] [--shard-tokens 4194304] [--step-tokens-per-s X]

1. Tokenize throughput: a synthetic corpus (Zipf-distributed pseudo-words, documents
   of log-normal length, as .jsonl) tokenized with the byte tokenizer and with a
   byte-level BPE (8192 ids, trained here on a sample with HF `tokenizers`), each in a
   fresh process: input MB/s and tokens/s, with the core count they ran on.
2. Peak RSS while tokenizing a corpus of at least 10x the shard size: the child's RSS
   (/proc/PID/status) sampled against the shards written so far; it must stay flat
   (the verdict: the peak over the second half of the run is within 10% of the peak
   over the first half).
3. Loader tokens/s per process (`data.source: tokens`, shuffled, memory-mapped, page
   cache warm) for bench-peer's shape (8 x 512 per process) and a pod-scale one
   (64 x 2048 per process), against the tokens/s one process's training step consumes:
   estimated for bench-peer and llama2-7b on one 8 x H100 host (one JAX process per
   host) at 40% MFU, and `--step-tokens-per-s` or measured here by running configs/bench-peer.yaml (8
   simulated CPU devices, one process) for a few steps (`--no-step` skips that).

Figures are only as quiet as the machine: run it with nothing else running.
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

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def make_corpus(path: str, megabytes: float, seed: int = 0) -> int:
    """Write ~``megabytes`` MB of .jsonl; returns the byte count."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, size=int(rng.integers(1, 10)))) for _ in range(20_000)]
    vocab = np.array(vocab, dtype=object)
    zipf = 1.0 / np.arange(1, len(vocab) + 1)
    zipf /= zipf.sum()
    target, written = int(megabytes * 1e6), 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            n_words = rng.lognormal(mean=5.5, sigma=0.8, size=256).astype(int) + 1
            words = rng.choice(vocab, size=int(n_words.sum()), p=zipf)
            start = 0
            lines = []
            for n in n_words:
                text = " ".join(words[start : start + n])
                start += n
                lines.append(json.dumps({"text": text, "meta": {"n": int(n)}}))
            chunk = "\n".join(lines) + "\n"
            f.write(chunk)
            written += len(chunk)
    return os.path.getsize(path)


def train_bpe(path: str, corpus: str, sample_mb: float = 4.0) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts, size = [], 0
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(line)
            if size > sample_mb * 1e6:
                break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(path)
    return path


CHILD = """
import json, sys
from jaxtrain.data.tokenize import tokenize
corpus, out, tokenizer, shard_tokens = sys.argv[1:5]
m = tokenize([corpus], out, tokenizer, shard_tokens=int(shard_tokens), log=lambda _: None)
print(json.dumps(m["run"]))
"""


def _rss_kib(pid: int, key: str = "VmRSS") -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def tokenize_in_child(corpus: str, out: str, tokenizer: str, shard_tokens: int) -> dict:
    """Run tokenize in a fresh process; sample its RSS against the shards written so far."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, corpus, out, tokenizer, str(shard_tokens)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    samples = []  # (shards written, rss KiB)
    while proc.poll() is None:
        rss = _rss_kib(proc.pid)
        if rss is not None:
            done = sum(1 for n in os.listdir(out) if n.endswith(".tokens")) if os.path.isdir(out) else 0
            samples.append((done, rss))
        time.sleep(0.05)
    stdout, stderr = proc.communicate()
    if proc.returncode:
        sys.exit(f"tokenize failed:\n{stderr[-3000:]}")
    run = json.loads(stdout.strip().splitlines()[-1])
    run["samples"] = samples
    return run


def report_tokenize(name: str, run: dict) -> None:
    print(
        f"  {name:5s}: {run['bytes'] / 1e6:8.1f} MB in {run['seconds']:6.1f} s = "
        f"{run['bytes'] / 1e6 / run['seconds']:7.1f} MB/s, {run['tokens'] / run['seconds']:12,.0f} tokens/s "
        f"on {run['cores']} cores"
    )


def report_rss(run: dict, shard_tokens: int, total_shards: int) -> None:
    """RSS against shards written. Flat: the peak after half the shards is within 10% of
    the peak between a quarter and a half (the first quarter warms the allocator up)."""
    samples = run["samples"]
    if not samples:
        print("  (no RSS samples: the run was too short)")
        return
    mib = shard_tokens * 2 / 2**20
    print(f"  shard: {shard_tokens:,} tokens ({mib:.0f} MiB at uint16); corpus: {total_shards} shards")
    for m in sorted({max(1, round(total_shards * f)) for f in (0.1, 0.25, 0.5, 0.75, 1.0)}):
        at = [r for d, r in samples if d == m] or [r for d, r in samples if d >= m][:1]
        if at:
            print(f"    after {m:3d} shards: RSS {max(at) / 1024:7.1f} MiB")
    warm = [r for d, r in samples if total_shards / 4 <= d <= total_shards / 2]
    late = [r for d, r in samples if d > total_shards / 2]
    if warm and late:
        verdict = "flat" if max(late) <= 1.1 * max(warm) else "NOT flat"
        print(
            f"  peak RSS {max(warm) / 1024:.1f} MiB (shards 1/4..1/2), "
            f"{max(late) / 1024:.1f} MiB (last half), "
            f"overall {max(r for _, r in samples) / 1024:.1f} MiB: {verdict} (last half <= 1.1 x)"
        )


def loader_rate(directory: str, local_batch: int, seq_len: int, seconds: float = 3.0) -> float:
    """Tokens/s one process's `tokens` iterator delivers (rows local_batch x seq_len)."""
    from jaxtrain.data import make_data_iterator

    class Cfg:
        source, paths, tokenizer, shuffle, weights = "tokens", (directory,), "byte", True, ()

    processes = 4  # process 0 of 4: it reads only its quarter of each global batch
    it = make_data_iterator(
        Cfg,
        vocab_size=1 << 16,
        seq_len=seq_len,
        global_batch_size=local_batch * processes,
        seed=0,
        process_index=0,
        process_count=processes,
    )
    next(it)  # open the shards
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        next(it)
        n += 1
    return n * local_batch * seq_len / (time.perf_counter() - start)


def measure_step(steps: int) -> float:
    """bench-peer's training tokens/s in one process (8 simulated CPU devices)."""
    out = tempfile.mkdtemp(prefix="bench-data-step-")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [
        sys.executable,
        "-m",
        "jaxtrain",
        "train",
        os.path.join(REPO, "configs", "bench-peer.yaml"),
        f"output_dir={out}",
        f"train.steps={steps}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode:
        sys.exit(f"bench-peer run failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
    timed = [r["step_time_s"] for r in records if r["step"] >= 3] or [records[-1]["step_time_s"]]
    return 8 * 512 / statistics.median(timed)


def h100_host_estimate(config: str, mfu: float) -> float:
    """Tokens/s `config`'s step would take on one 8 x H100 host (one JAX process per host)
    at `mfu` of the bf16 peak: 8 * peak * mfu / training FLOPs per token."""
    from jaxtrain.config import load_config
    from jaxtrain.planning.flops import flops_per_token
    from jaxtrain.sharding.hardware import chip

    cfg = load_config(os.path.join(REPO, "configs", config))
    return 8 * chip("h100").peak_flops("bfloat16") * mfu / flops_per_token(cfg.model, cfg.train.seq_len)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus-mb", type=float, default=64.0)
    p.add_argument("--shard-tokens", type=int, default=1 << 22)
    p.add_argument("--step-tokens-per-s", type=float, default=None, help="one process's step consumption")
    p.add_argument("--step-steps", type=int, default=6, help="bench-peer steps to measure the consumption")
    p.add_argument("--no-step", action="store_true", help="do not measure bench-peer's step on CPU")
    p.add_argument("--mfu", type=float, default=0.4, help="MFU assumed for the H100-host estimate")
    p.add_argument("--keep", default=None, help="keep the corpus and token dirs here")
    args = p.parse_args()

    from jaxtrain.data.tokenize import cores

    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = args.keep or tmp
        os.makedirs(work, exist_ok=True)
        corpus = os.path.join(work, "corpus.jsonl")
        size = make_corpus(corpus, args.corpus_mb)
        bpe = train_bpe(os.path.join(work, "bpe.json"), corpus)
        print(f"corpus: {size / 1e6:.1f} MB of .jsonl; {os.cpu_count()} CPUs, this process may use {cores()}")

        print("1. tokenize throughput (fresh process each)")
        runs = {}
        for name, tok in (("byte", "byte"), ("bpe", bpe)):
            out = os.path.join(work, f"tokens-{name}")
            runs[name] = tokenize_in_child(corpus, out, tok, args.shard_tokens)
            report_tokenize(name, runs[name])

        print("2. peak RSS while tokenizing (byte tokenizer: the most tokens per MB)")
        manifest = json.load(open(os.path.join(work, "tokens-byte", "manifest.json")))
        total_shards = len(manifest["splits"]["train"]["shards"])
        if total_shards < 10:
            print(
                f"  (only {total_shards} shards: for >= 10, a larger --corpus-mb or smaller --shard-tokens)"
            )
        report_rss(runs["byte"], args.shard_tokens, total_shards)

        print("3. loader tokens/s per process (shuffled, memory-mapped, warm page cache)")
        rates = {}
        for local_batch, seq_len in ((8, 512), (64, 2048)):
            rates[(local_batch, seq_len)] = loader_rate(
                os.path.join(work, "tokens-bpe"), local_batch, seq_len
            )
            print(f"  {local_batch:3d} x {seq_len:4d} rows: {rates[(local_batch, seq_len)]:14,.0f} tokens/s")
        steps = {
            f"bench-peer, 8 x H100 host at {args.mfu:.0%} MFU: a FLOP-bound ceiling": h100_host_estimate(
                "bench-peer.yaml", args.mfu
            ),
            f"llama2-7b, 8 x H100 host at {args.mfu:.0%} MFU, estimated": h100_host_estimate(
                "llama2-7b.yaml", args.mfu
            ),
        }
        if args.step_tokens_per_s:
            steps["given (--step-tokens-per-s)"] = args.step_tokens_per_s
        elif not args.no_step:
            steps["bench-peer on 8 simulated CPU devices, measured"] = measure_step(args.step_steps)
        for source, step in steps.items():
            ratios = ", ".join(f"{b} x {l}: {r / step:,.1f}x" for (b, l), r in rates.items())
            print(
                f"  step consumption {step:12,.0f} tokens/s per process ({source}); loader / step: {ratios}"
            )


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("data", main))

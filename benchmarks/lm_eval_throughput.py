"""Requests per second of `jaxtrain.evaluation.JaxtrainLM` against lm-eval's own `hf` backend
(HFLM: torch, CPU, float32), for each request type, on the same model and requests, in one run.

    python benchmarks/lm_eval_throughput.py [--batch-size 8] [--repeats 3] [--d-model 256]
        [--layers 4] [--context 256] [--mc 64] [--rolling 16] [--gen 32] [--max-gen-toks 32]
        [--hf-python /tmp/hf311e/bin/python] [--quick]

The model: a random Llama (seed 0; `--d-model`, `--layers`, 4 query heads over 2 key/value
heads, SwiGLU 4 x d_model, tied embeddings, `--context` positions) built with
`jaxtrain.models` and written with `models.to_hf` into a scratch directory beside the BPE
tokenizer of tests/assets/lm_eval/tiny_llama (vocab 384, BOS added as Llama's). Both sides
load that directory: `JaxtrainLM(dir)` here, `HFLM(pretrained=dir, device="cpu",
dtype="float32")` in a second Python that has torch, transformers and lm-eval (`--hf-python`,
else $JAXTRAIN_HF_PYTHON, else /tmp/hf311e/bin/python; the recipe is in
tests/assets/make_lm_eval_assets.py), which runs this file with `--worker` and answers one
pass at a time over a pipe, so that the two sides' passes alternate. The same `--batch-size`
on both sides (HFLM's `auto` only probes for out-of-memory errors, which a CPU never raises:
it would take its max_batch_size, 64).

The requests, as lm-eval's `Instance`s, are built here from the repository's docs (seeded)
and handed to both sides through one JSON file, so both answer the very same ones:

- `loglikelihood`: what a multiple-choice task makes (tiny_mc's shape: a question, four
  choices of 1-5 words each starting with a space, target_delimiter ""): `--mc` questions
  of 8 to 1.25 x context tokens (the long ones cut on the left), four (context, choice)
  pairs each;
- `loglikelihood_rolling`: `--rolling` documents of 1 to 4 contexts long (several rolling
  windows each);
- `generate_until`: `--gen` prompts of 8 to context - max_gen_toks tokens, greedy,
  `max_gen_toks` new tokens, `until: ["\\n\\n"]` (random weights rarely write it: most rows
  run to max_gen_toks or EOS).

Per type, in the order above: one warm-up pass of each side, timed apart as the "first pass"
(for jaxtrain the XLA compiles of every padded shape not compiled yet: rolling windows are
loglikelihood rows of the context's length, whose programs the multiple-choice pass has
already built; for HFLM torch's first allocations), then `--repeats` rounds of one timed
pass per side, which side goes first alternating round by round, so that a load that comes
and goes on a shared machine falls on both; requests/s = requests / median pass time. The
answers of the last pass are compared (loglikelihoods relative to max(1, |x|), is_greedy
flags, generated strings): both sides computed the same thing. Progress bars off on both
sides.

Prints the table docs/benchmarks.md quotes; the run is recorded as
benchmarks/results/lm_eval_throughput/<UTC time>-<sha>.json (benchmarks/result_file.py), with
the table as `requests` and the HF side's versions and thread count under `figures.hf` (the
file's own `versions` are this Python's, which has no torch).

Nothing else should run on the machine meanwhile: this is a timing (a shared CPU makes it
noisy; the min and max of the repeats are in the result file). `--quick` is a smoke run
(a 64-wide 2-layer model, a handful of requests, one repeat).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

try:  # imported as benchmarks.lm_eval_throughput
    from benchmarks import result_file
except ImportError:  # run as a script: its folder is on the path
    import result_file

ASSET = REPO / "tests" / "assets" / "lm_eval" / "tiny_llama"
DEFAULT_HF_PYTHON = "/tmp/hf311e/bin/python"
KINDS = ("loglikelihood", "loglikelihood_rolling", "generate_until")
UNTIL = ["\n\n"]
BOS_ID, EOS_ID = 1, 2  # the asset tokenizer's <s> and </s>

HEADER = [
    "request type",
    "requests",
    "tokens per request",
    "batch",
    "jaxtrain req/s",
    "hf req/s",
    "jaxtrain / hf",
    "jaxtrain first pass s",
    "hf first pass s",
    "answers agree",
]


# --- shared by both sides (lm-eval only: the worker's Python has no jax) ---------------------


def instances(kind: str, args: list) -> list:
    """lm-eval's Instances of one request type from their JSON arguments."""
    from lm_eval.api.instance import Instance

    return [
        Instance(request_type=kind, doc={}, arguments=tuple(a), idx=0, metadata=(f"bench_{kind}", i, 1))
        for i, a in enumerate(args)
    ]


def one_pass(lm, kind: str, args: list) -> tuple[float, list]:
    """lm.<kind> over the requests (fresh Instances): (seconds, answers, JSON-able)."""
    reqs = instances(kind, args)
    t0 = time.perf_counter()
    answers = getattr(lm, kind)(reqs, disable_tqdm=True)
    seconds = time.perf_counter() - t0
    return seconds, [list(a) if isinstance(a, tuple) else a for a in answers]


def hf_worker(spec_path: str) -> int:
    """The HFLM half, in a Python with torch + transformers + lm-eval. Prints `RESULT {...}`
    once loaded, then for each line `{"kind": ...}` on stdin runs one pass and prints its
    seconds and answers the same way; ends at end of input."""
    import lm_eval
    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM

    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    lm = HFLM(pretrained=spec["model_dir"], device="cpu", dtype="float32", batch_size=spec["batch_size"])
    ready = {
        "load_s": time.perf_counter() - t0,
        "max_length": lm.max_length,
        "threads": torch.get_num_threads(),
        "attention": lm.model.config._attn_implementation,
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "lm_eval": lm_eval.__version__,
        },
    }
    print("RESULT " + json.dumps(ready), flush=True)
    for line in sys.stdin:
        kind = json.loads(line)["kind"]
        seconds, answers = one_pass(lm, kind, spec["requests"][kind])
        print("RESULT " + json.dumps({"seconds": seconds, "answers": answers}), flush=True)
    return 0


class HFSide:
    """The worker process, driven one pass at a time (its stderr goes to a scratch file)."""

    def __init__(self, hf_python: str, spec_path: Path, log_path: Path):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.hf_python, self.log_path = hf_python, log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [hf_python, __file__, "--worker", str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )

    def reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
        self.proc.wait()
        self.log.flush()
        tail = self.log_path.read_text()[-3000:]
        raise SystemExit(f"the hf worker ({self.hf_python}) failed, exit {self.proc.returncode}:\n{tail}")

    def one_pass(self, kind: str) -> tuple[float, list]:
        self.proc.stdin.write(json.dumps({"kind": kind}) + "\n")
        self.proc.stdin.flush()
        out = self.reply()
        return out["seconds"], out["answers"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


def interleaved(ours_pass, hf_pass, repeats: int) -> dict:
    """A warm-up pass of each side, then `repeats` rounds of one timed pass each, the order
    alternating (jaxtrain first in odd rounds) so that a load that comes and goes on a shared
    machine falls on both sides alike."""
    found = {}
    for side, fn in (("jaxtrain", ours_pass), ("hf", hf_pass)):
        found[side] = {"first_s": fn()[0], "times_s": []}
    for r in range(repeats):
        order = (("jaxtrain", ours_pass), ("hf", hf_pass))
        for side, fn in order if r % 2 == 0 else order[::-1]:
            seconds, answers = fn()
            found[side]["times_s"].append(seconds)
            found[side]["answers"] = answers
    return found


# --- the jaxtrain side and the run -----------------------------------------------------------


def corpus_sentences() -> list[str]:
    """ASCII words of README.md and docs/*.md in runs of 40 (as make_lm_eval_assets.py)."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    text = "\n".join(p.read_text(encoding="utf-8") for p in files)
    words = [w for w in text.replace("`", "").split() if w.isascii() and w.isprintable()]
    return [" ".join(words[i : i + 40]) for i in range(0, len(words) - 40, 40)]


class Texts:
    """Pieces of the docs of a given token length, under the benchmark's tokenizer."""

    def __init__(self, tokenizer, rng: random.Random):
        self.tok, self.rng = tokenizer, rng
        sentences = corpus_sentences()
        rng.shuffle(sentences)
        self.ids = self.tok.encode(" ".join(sentences), add_special_tokens=False).ids
        self.words = [w for w in " ".join(sentences[:200]).split() if w.isalpha()]

    def tokens(self, n: int) -> str:
        start = self.rng.randrange(0, len(self.ids) - n)
        return self.tok.decode(self.ids[start : start + n]).strip()

    def choice(self) -> str:
        return " " + " ".join(self.rng.choice(self.words) for _ in range(self.rng.randint(1, 5)))

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)


def build_requests(texts: Texts, args, context: int) -> tuple[dict, dict]:
    """(the requests per type as JSON arguments, their token counts)."""
    rng = texts.rng
    mc = []
    for _ in range(args.mc):
        question = texts.tokens(rng.randint(8, context + context // 4))
        mc += [[question, texts.choice()] for _ in range(4)]
    rolling = [[texts.tokens(rng.randint(context, 4 * context))] for _ in range(args.rolling)]
    room = context - args.max_gen_toks
    gen_kwargs = {"until": UNTIL, "max_gen_toks": args.max_gen_toks, "do_sample": False}
    gen = [[texts.tokens(rng.randint(8, room)), gen_kwargs] for _ in range(args.gen)]
    requests = {"loglikelihood": mc, "loglikelihood_rolling": rolling, "generate_until": gen}
    counts = {
        "loglikelihood": {
            "questions": args.mc,
            "context": [texts.count(c) for c, _ in mc],
            "continuation": [texts.count(x) for _, x in mc],
        },
        "loglikelihood_rolling": {
            "document": [texts.count(d) for (d,) in rolling],
            "windows": [-(-texts.count(d) // context) for (d,) in rolling],  # rolling windows
        },
        "generate_until": {"prompt": [texts.count(p) for p, _ in gen]},
    }
    return requests, counts


def write_model(where: Path, args) -> dict:
    """A random Llama written as an HF directory with the asset's tokenizer; its shape."""
    from flax import nnx

    from jaxtrain import models

    d = args.d_model
    cfg = models.ModelConfig(
        vocab_size=384,
        d_model=d,
        n_layers=args.layers,
        n_heads=4,
        n_kv_heads=2,
        mlp_dim=4 * d,
        tie_embeddings=True,
        init_std=0.1,  # as the asset's: clear argmax margins, so greedy answers agree
    )
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    models.to_hf(model, where, architecture="LlamaForCausalLM")
    config = json.loads((where / "config.json").read_text())
    config.update(max_position_embeddings=args.context, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    (where / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (where / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}, indent=2) + "\n"
    )
    shutil.copy(ASSET / "tokenizer.json", where / "tokenizer.json")
    tok_config = json.loads((ASSET / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = args.context
    (where / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return {
        "vocab": cfg.vocab_size,
        "d_model": d,
        "layers": cfg.n_layers,
        "heads": f"{cfg.n_heads} query / {cfg.n_kv_heads} kv",
        "mlp": cfg.mlp_dim,
        "context": args.context,
        "params": int(cfg.param_count()),
    }


def agreement(kind: str, ours: list, theirs: list) -> dict:
    """How closely the two sides' answers agree."""
    if kind == "generate_until":
        return {"equal": sum(a == b for a, b in zip(ours, theirs, strict=True)), "of": len(ours)}
    pairs = list(zip(ours, theirs, strict=True))
    value = (lambda a: a[0]) if kind == "loglikelihood" else (lambda a: a)
    diff = max(abs(value(a) - value(b)) / max(1.0, abs(value(b))) for a, b in pairs)
    found = {"max_rel_diff": diff}
    if kind == "loglikelihood":
        found["is_greedy_equal"] = sum(bool(a[1]) == bool(b[1]) for a, b in pairs)
        found["of"] = len(pairs)
    return found


def agree_text(kind: str, agree: dict) -> str:
    if kind == "generate_until":
        return f"{agree['equal']}/{agree['of']} strings equal"
    text = f"max rel diff {agree['max_rel_diff']:.1e}"
    if kind == "loglikelihood":
        text += f", is_greedy {agree['is_greedy_equal']}/{agree['of']}"
    return text


def spread(values: list[int]) -> str:
    return f"{min(values)}-{max(values)} (mean {statistics.mean(values):.0f})"


def token_text(kind: str, counts: dict, generated_chars: list[int], max_gen_toks: int) -> str:
    """Tokens per request (the benchmark tokenizer's, BOS not counted); generations: at most
    max_gen_toks new tokens, their text's length in characters (random weights write byte
    fragments that re-encode to more tokens than were generated, so no token count)."""
    c = counts[kind]
    if kind == "loglikelihood":
        return f"context {spread(c['context'])}, choice {spread(c['continuation'])}"
    if kind == "loglikelihood_rolling":
        return f"{spread(c['document'])}, {sum(c['windows'])} windows in all"
    return f"prompt {spread(c['prompt'])}; at most {max_gen_toks} new, text {spread(generated_chars)} chars"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--batch-size", type=int, default=8, help="requests per batch, both sides")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per side and type")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(
        "--context", type=int, default=256, help="max_position_embeddings: both sides' max_length"
    )
    ap.add_argument(
        "--mc", type=int, default=64, help="multiple-choice questions (4 loglikelihood requests each)"
    )
    ap.add_argument("--rolling", type=int, default=16, help="loglikelihood_rolling documents")
    ap.add_argument("--gen", type=int, default=32, help="generate_until prompts")
    ap.add_argument("--max-gen-toks", type=int, default=32)
    ap.add_argument(
        "--hf-python",
        default=os.environ.get("JAXTRAIN_HF_PYTHON", DEFAULT_HF_PYTHON),
        help="a Python with torch, transformers and lm-eval (default: $JAXTRAIN_HF_PYTHON, else %(default)s)",
    )
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny model, few requests, one repeat")
    ap.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return hf_worker(args.worker)
    if args.quick:
        args.d_model, args.layers, args.context = 64, 2, 64
        args.mc, args.rolling, args.gen, args.max_gen_toks, args.repeats = 3, 2, 3, 8, 1
    if min(args.batch_size, args.repeats, args.mc, args.rolling, args.gen) < 1:
        ap.error("--batch-size, --repeats, --mc, --rolling and --gen must be positive")
    if not 8 < args.context - args.max_gen_toks:
        ap.error(
            f"--context={args.context} leaves no room for prompts beside --max-gen-toks={args.max_gen_toks}"
        )
    if not Path(args.hf_python).is_file():
        ap.error(f"--hf-python={args.hf_python}: no such file (a Python with torch, transformers, lm-eval)")

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import tokenizers

    from jaxtrain.evaluation import JaxtrainLM

    tok = tokenizers.Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    texts = Texts(tok, random.Random(0))
    requests, counts = build_requests(texts, args, args.context)
    with tempfile.TemporaryDirectory(prefix="lm-eval-bench-") as tmp:
        model_dir = Path(tmp) / "model"
        shape = write_model(model_dir, args)
        spec = {"model_dir": str(model_dir), "batch_size": args.batch_size, "requests": requests}
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        print(
            f"model: random Llama, {shape['params'] / 1e6:.2f}M parameters (d_model {shape['d_model']}, "
            f"{shape['layers']} layers, heads {shape['heads']}, mlp {shape['mlp']}, vocab {shape['vocab']}, "
            f"context {shape['context']}), float32; batch size {args.batch_size} on both sides; "
            f"median of {args.repeats} passes per side (alternating) after a warm-up pass",
            flush=True,
        )
        print(
            f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({len(jax.devices())} device)",
            flush=True,
        )
        hf_side = HFSide(args.hf_python, spec_path, Path(tmp) / "hf_worker.log")
        try:
            t0 = time.perf_counter()
            lm = JaxtrainLM(model_dir, batch_size=args.batch_size)
            ours = {"load_s": time.perf_counter() - t0, "max_length": lm.max_length}
            hf = hf_side.reply()  # loaded meanwhile
            if hf["max_length"] != ours["max_length"]:
                raise SystemExit(f"max_length differs: jaxtrain {ours['max_length']}, hf {hf['max_length']}")
            print(
                f"hf: torch {hf['versions']['torch']}, transformers {hf['versions']['transformers']}, "
                f"lm-eval {hf['versions']['lm_eval']}, {hf['threads']} threads, attention "
                f"{hf['attention']}; load {hf['load_s']:.1f} s (jaxtrain {ours['load_s']:.1f} s, "
                "the two at once)",
                flush=True,
            )
            timings = {}
            for kind in KINDS:
                timings[kind] = interleaved(
                    lambda kind=kind: one_pass(lm, kind, requests[kind]),
                    lambda kind=kind: hf_side.one_pass(kind),
                    args.repeats,
                )
                print(f"{kind}: done", file=sys.stderr, flush=True)
        finally:
            hf_side.close()

    rows, cells = [], []
    for kind in KINDS:
        mine, theirs = timings[kind]["jaxtrain"], timings[kind]["hf"]
        n = len(requests[kind])
        row = {
            "type": kind,
            "requests": n,
            "batch_size": args.batch_size,
            "jaxtrain_rps": n / statistics.median(mine["times_s"]),
            "hf_rps": n / statistics.median(theirs["times_s"]),
            "jaxtrain_first_s": mine["first_s"],
            "hf_first_s": theirs["first_s"],
            "jaxtrain_pass_s": _stats(mine["times_s"]),
            "hf_pass_s": _stats(theirs["times_s"]),
            "agreement": agreement(kind, mine["answers"], theirs["answers"]),
        }
        row["ratio"] = row["jaxtrain_rps"] / row["hf_rps"]
        generated = [len(s) for s in mine["answers"]] if kind == "generate_until" else []
        if generated:
            row["generated_chars"] = generated
        row["tokens"] = token_text(kind, counts, generated, args.max_gen_toks)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "generated_chars"}), flush=True)
        cells.append(
            [
                kind,
                n,
                row["tokens"],
                args.batch_size,
                f"{row['jaxtrain_rps']:.1f}",
                f"{row['hf_rps']:.1f}",
                f"{row['ratio']:.2f}",
                f"{row['jaxtrain_first_s']:.1f}",
                f"{row['hf_first_s']:.1f}",
                agree_text(kind, row["agreement"]),
            ]
        )
    print("\n| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for c in cells:
        print("| " + " | ".join(map(str, c)) + " |")
    result_file.add_figures(model=shape, rows=rows, counts=counts, hf=hf, jaxtrain=ours)
    result_file.add_table("requests", HEADER, cells)
    return 0


def _stats(values: list[float]) -> dict:
    return result_file.repeat_stats(values)


if __name__ == "__main__":
    sys.exit(result_file.run("lm_eval_throughput", main))  # --worker: recorded by its parent only

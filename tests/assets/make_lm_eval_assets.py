"""Make tests/assets/lm_eval/: a tiny Hugging Face Llama with a BPE tokenizer, three local
lm-eval tasks, and what lm-eval's own `hf` backend (HFLM) answers on them: the oracle of
tests/test_lm_eval.py, which needs no torch.

Run from the repository root with a Python that has torch, transformers 5.25 and lm-eval
0.4.13 (CPU wheels; the project's venv has no torch):

    python3.11 -m venv /tmp/hf311e && /tmp/hf311e/bin/pip install torch "transformers==5.25.*" \
        safetensors numpy "lm-eval==0.4.13"
    HF_DATASETS_OFFLINE=1 /tmp/hf311e/bin/python tests/assets/make_lm_eval_assets.py

What it writes (seeded; about 0.5 MB):
- tiny_llama/: a LlamaForCausalLM with random weights (vocab 384, hidden 64, 2 layers, GQA
  4 query over 2 key/value heads, tied embeddings, max_position_embeddings 64, so that rolling
  windows and left truncation happen), tokenizer.json (byte-level BPE trained here on the
  repository's docs, BOS added by its post-processor as Llama's) and tokenizer_config.json
  (with a small chat template that writes BOS itself);
- tasks/: the task YAMLs and their documents. The YAMLs name their data as
  `__TASKS__/NAME.jsonl`; `task_dir(dest)` writes a copy with that folder filled in
  (lm-eval's json loader reads paths relative to the working directory):
  - tiny_mc (multiple_choice, acc/acc_norm): questions of 10-120 tokens (the long ones cut on
    the left to the 64-token context), four choices, one of them the model's own greedy two
    tokens (so that is_greedy is true somewhere);
  - tiny_rolling (loglikelihood_rolling: word/byte perplexity, bits per byte): documents of
    100-300 tokens, several 64-token windows each;
  - tiny_gen (generate_until, greedy, max_gen_toks 12, exact_match): prompts of 5-90 tokens
    (cut to 52 = 64 - 12), `until` strings picked from what the model writes so that they cut
    it, and half the targets equal to the model's answer;
- expected.json: per task and setting, lm-eval's per-request answers (`resps`: loglikelihood
  and is_greedy, the rolling sum, the generated string), the filtered ones and the metrics,
  from `lm_eval.simple_evaluate(model="hf", batch_size=1)`; settings: plain, and tiny_gen with
  --apply_chat_template. batch_size=4 is run too and must agree within 1e-5 (checked here).
"""

import glob
import json
import os
import random
import shutil
import sys
import tempfile

import lm_eval
import tokenizers
import torch
import transformers
from lm_eval.tasks import TaskManager
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(HERE, "lm_eval")
MODEL = os.path.join(OUT, "tiny_llama")
TASKS = os.path.join(OUT, "tasks")
VOCAB, MAX_LEN, MAX_GEN = 384, 64, 12
SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TASK_NAMES = ("tiny_mc", "tiny_rolling", "tiny_gen")

MC_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: __TASKS__/tiny_mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
ROLLING_YAML = """task: tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: __TASKS__/tiny_rolling.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""
GEN_YAML = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: __TASKS__/tiny_gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{target}}"
generation_kwargs:
  until: __UNTIL__
  max_gen_toks: __MAX_GEN__
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def task_dir(dest: str) -> str:
    """The committed tasks with their data folder filled in, written under `dest`."""
    os.makedirs(dest, exist_ok=True)
    for path in glob.glob(os.path.join(TASKS, "*")):
        text = open(path).read()
        if path.endswith(".yaml"):
            text = text.replace("__TASKS__", TASKS)
        with open(os.path.join(dest, os.path.basename(path)), "w") as f:
            f.write(text)
    return dest


def corpus() -> str:
    files = [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]
    return "\n".join(open(p, encoding="utf-8").read() for p in files)


def sentences(text: str) -> list[str]:
    words = [w for w in text.replace("`", "").split() if w.isascii() and w.isprintable()]
    return [" ".join(words[i : i + 40]) for i in range(0, len(words) - 40, 40)]


def make_tokenizer(text: str) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    assert tok.get_vocab_size() == VOCAB and [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2]
    return tok


def make_model() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.1,  # sharper than 0.02: clear argmax margins for is_greedy and greedy text
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(MODEL)


def greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()


def write_jsonl(name: str, rows: list[dict]) -> None:
    with open(os.path.join(TASKS, f"{name}.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def make_tasks(hf_tok, model, texts: list[str], rng: random.Random) -> None:
    enc = lambda s: hf_tok(s, add_special_tokens=False)["input_ids"]
    dec = lambda ids: hf_tok.decode(ids, skip_special_tokens=True)
    # multiple choice: question lengths spread over 10..120 tokens (context 64)
    mc = []
    for i, n in enumerate((10, 25, 40, 63, 64, 70, 90, 120)):
        q = dec(enc(" ".join(texts[3 * i : 3 * i + 4]))[:n])
        mine = dec(greedy(model, hf_tok(q)["input_ids"], 2))
        others = [" ".join(rng.choice(texts).split()[:k]) for k in (1, 2, 3)]
        choices = [" " + o for o in others]
        choices.insert(i % 4, mine)
        mc.append({"question": q, "choices": choices, "answer": (i * 3) % 4})
    write_jsonl("tiny_mc", mc)
    rolling = []
    for i, n in enumerate((100, 150, 200, 300, 40)):
        rolling.append({"text": dec(enc(" ".join(texts[40 + 8 * i : 48 + 8 * i]))[:n])})
    write_jsonl("tiny_rolling", rolling)
    # generation: a first pass picks `until` strings the model actually writes
    prompts = [
        dec(enc(" ".join(texts[90 + 3 * i : 94 + 3 * i]))[:n]) for i, n in enumerate((5, 12, 30, 52, 60, 90))
    ]
    made = [dec(greedy(model, hf_tok(p)["input_ids"][-(MAX_LEN - MAX_GEN) :], MAX_GEN)) for p in prompts]
    until = []
    for text in made[1:4]:
        piece = text[len(text) // 2 : len(text) // 2 + 2]
        if piece.strip() and piece not in until:
            until.append(piece)
    with open(os.path.join(TASKS, "tiny_gen.yaml"), "w") as f:
        f.write(GEN_YAML.replace("__UNTIL__", json.dumps(until)).replace("__MAX_GEN__", str(MAX_GEN)))
    write_jsonl("tiny_gen", [{"prompt": p, "target": "?"} for p in prompts])
    for name, text in (("tiny_mc", MC_YAML), ("tiny_rolling", ROLLING_YAML)):
        with open(os.path.join(TASKS, f"{name}.yaml"), "w") as f:
            f.write(text)


def evaluate(tasks, batch_size, **kw) -> dict:
    with tempfile.TemporaryDirectory() as d:
        return lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={MODEL},dtype=float32",
            tasks=list(tasks),
            task_manager=TaskManager(include_path=task_dir(d)),
            batch_size=batch_size,
            device="cpu",
            log_samples=True,
            **kw,
        )


def answers(out: dict) -> dict:
    """Per task: its samples (doc_id, arguments, resps, filtered_resps, metrics) and results."""
    keep = ("doc_id", "arguments", "resps", "filtered_resps", "filter")
    per = {}
    for task, samples in out["samples"].items():
        rows = sorted(samples, key=lambda s: s["doc_id"])
        metrics = {k: v for k, v in out["results"][task].items() if k != "alias"}
        per[task] = {
            "samples": [{k: s[k] for k in keep} | {"metrics": {m: s[m] for m in s["metrics"]}} for s in rows],
            "results": metrics,
        }
    return json.loads(json.dumps(per, default=float))


def numbers(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from numbers(y)
    elif isinstance(x, float):
        yield x


def check_same(a: dict, b: dict, what: str) -> None:
    for task in a:
        for s, t in zip(a[task]["samples"], b[task]["samples"], strict=True):
            assert s["arguments"] == t["arguments"]
            for x, y in zip(numbers(s["resps"]), numbers(t["resps"]), strict=True):
                assert abs(x - y) <= 1e-5 * max(1, abs(x)), (what, task, s["doc_id"], x, y)
            if task == "tiny_gen":
                assert s["resps"] == t["resps"], (what, task, s["doc_id"], s["resps"], t["resps"])
            else:
                flags = lambda r: [x[1] for x in r if isinstance(x, list) and len(x) == 2]
                assert [flags(r) for r in s["resps"]] == [flags(r) for r in t["resps"]], (what, task)


def main() -> None:
    print(
        "torch", torch.__version__, "transformers", transformers.__version__, "lm_eval", lm_eval.__version__
    )
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(TASKS)
    text = corpus()
    tok = make_tokenizer(text)
    make_model()
    tok.save(os.path.join(MODEL, "tokenizer.json"))
    with open(os.path.join(MODEL, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": MAX_LEN,
                "chat_template": CHAT_TEMPLATE,
            },
            f,
            indent=2,
        )
    hf_tok = AutoTokenizer.from_pretrained(MODEL)
    rng = random.Random(0)
    texts = sentences(text)
    rng.shuffle(texts)
    for s in texts[:50]:  # transformers encodes as the tokenizers library with its post-processor
        assert hf_tok(s)["input_ids"] == tok.encode(s).ids, s
    model = LlamaForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    make_tasks(hf_tok, model, texts, rng)

    seeds = dict(random_seed=0, numpy_random_seed=1234, torch_random_seed=1234, fewshot_random_seed=1234)
    first = answers(evaluate(["tiny_gen"], 1, **seeds))["tiny_gen"]["samples"]
    gen = [json.loads(line) for line in open(os.path.join(TASKS, "tiny_gen.jsonl"))]
    for i, (row, s) in enumerate(zip(gen, first)):
        row["target"] = s["filtered_resps"][0] if i % 2 == 0 else "no"
    write_jsonl("tiny_gen", gen)

    expected = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
    expected["lm_eval"] = lm_eval.__version__
    expected["plain"] = answers(evaluate(TASK_NAMES, 1, **seeds))
    check_same(expected["plain"], answers(evaluate(TASK_NAMES, 4, **seeds)), "batch_size=4")
    chat = evaluate(["tiny_gen"], 1, apply_chat_template=True, **seeds)
    expected["chat"] = answers(chat)
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    plain = expected["plain"]
    for task in TASK_NAMES:
        print(task, plain[task]["results"])
    mc = [r for s in plain["tiny_mc"]["samples"] for r in s["resps"]]
    print("tiny_mc is_greedy true:", sum(r[0][1] for r in mc), "of", len(mc))
    print("tiny_gen:", [s["resps"][0][0] for s in plain["tiny_gen"]["samples"]])
    print("chat:", [s["resps"][0][0] for s in expected["chat"]["tiny_gen"]["samples"]])
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(OUT, "**", "*"), recursive=True))
    print(f"{OUT}: {size / 1e6:.2f} MB")


if __name__ == "__main__":
    sys.exit(main())

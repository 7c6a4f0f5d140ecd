"""Build the chat-template oracle in tests/assets/chat/ (run once, commit the output).

Needs transformers, which the project does not depend on (see make_hf_assets.py for the venv):
    /tmp/hf311/bin/python tests/assets/make_chat_assets.py
Writes three tokenizer directories (tokenizer.json + tokenizer_config.json), each with a chat
template that marks the assistant turns with {% generation %}: ``chatml`` (Qwen-style
<|im_start|>/<|im_end|>, a default system prompt), ``llama3`` (header ids, bos, ``| trim``; its
template is the list form [{name, template}] and its special tokens AddedToken dicts),
``gemma`` (<start_of_turn>/<end_of_turn>, bos, the system prompt folded into the first user
turn, a Metaspace BPE with <unk>) and ``tools`` (ChatML with tool calls through ``tojson``,
tool results, reasoning, ``namespace`` and ``break``; its own conversations). Then
``expected.json.gz``: seeded random conversations and,
per directory, transformers' ``apply_chat_template(tokenize=True, return_dict=True,
return_assistant_tokens_mask=True)`` ids and assistant masks (a mask as a string of 0/1).
tests/test_chat.py compares `jaxtrain.data.encode_chat` with them, exactly.
"""

import gzip
import json
import random
import shutil
from pathlib import Path

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = Path(__file__).parent / "chat"
CONVERSATIONS = 120
TOOL_CONVERSATIONS = 60

CHATML = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' + message['role']) }}{%- endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}\n"
    "{%- if message['role'] == 'assistant' %}\n"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}\n"
    "{{- '\\n' }}\n"
    "{%- else %}\n"
    "{{- message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "{%- if message['role'] == 'assistant' %}\n"
    "{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}\n"
    "{%- else %}\n"
    "{{- message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}\n"
)

GEMMA = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "{%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "{%- set first_user_prefix = '' -%}\n"
    "{%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "{%- endif -%}\n"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\n"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}\n"
    "{%- if role == 'model' -%}\n"
    "{% generation %}{{ message['content'] | trim }}<end_of_turn>\n{% endgeneration %}\n"
    "{%- else -%}\n"
    "{{ message['content'] | trim }}<end_of_turn>\n\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}\n"
)

TOOLS = (
    "{%- set ns = namespace(last_user=0) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "{%- if message.role == 'user' %}{%- set ns.last_user = messages | length - 1 - loop.index0 %}"
    "{%- break %}{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "{%- if message.role in ['system', 'user'] %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- elif message.role == 'assistant' %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- generation %}\n"
    "{%- if message.reasoning_content is defined and loop.index0 > ns.last_user %}\n"
    "{{- '<think>\\n' + message.reasoning_content | trim + '\\n</think>\\n\\n' }}\n"
    "{%- endif %}\n"
    "{{- message.content }}\n"
    "{%- for call in message.tool_calls or [] %}\n"
    "{{- '\\n<tool_call>\\n' + call.function | tojson + '\\n</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{{- '<|im_end|>' }}\n"
    "{%- endgeneration %}\n"
    "{{- '\\n' }}\n"
    "{%- elif message.role == 'tool' %}\n"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}\n"
    "{%- else %}{{- raise_exception('unknown role ' + message.role) }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
)

WORDS = [
    "the", "model", "answer", "question", "hello", "world", "token", "mask", "train", "data",
    "δέλτα", "naïve", "日本語", "🙂", "über", "ça", "a\nb", "tab\tx", "  spaced  ", "c\r\nd", "x",
    "42", "3.14", "{json: 1}", "<b>", "it's", '"quoted"', "end.",
]  # fmt: skip
EDGES = ["", " ", "\n", "  lead", "trail  ", "\n\nblank lines\n\n", "\t"]


def text(rng: random.Random, specials: list[str]) -> str:
    """A message: random words, sometimes an edge case or a special token's text in it."""
    roll = rng.random()
    if roll < 0.06:
        return rng.choice(EDGES)
    words = [rng.choice(WORDS) for _ in range(rng.randint(1, 14))]
    if roll < 0.12:
        words.insert(rng.randrange(len(words) + 1), rng.choice(specials))
    s = " ".join(words)
    if rng.random() < 0.1:
        s = " " + s
    if rng.random() < 0.1:
        s = s + rng.choice([" ", "\n", "\n\n"])
    return s


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    specials = ["<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|im_start|>user"]
    out = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.4:
            messages.append({"role": "system", "content": text(rng, specials)})
        for _ in range(rng.randint(1, 4)):
            messages.append({"role": "user", "content": text(rng, specials)})
            messages.append({"role": "assistant", "content": text(rng, specials)})
        out.append(messages)
    return out


def tool_conversations(n: int, seed: int = 2) -> list[list[dict]]:
    """Tool calls (arguments through tojson, non-ASCII kept), tool results, reasoning under its
    three names (transformers aliases them), None values (transformers drops the key)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": text(rng, ["<tool_call>"])}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": text(rng, ["<|im_end|>"])})
            reply = {"role": "assistant", "content": text(rng, ["<think>"])}
            if rng.random() < 0.5:
                reply[rng.choice(["reasoning_content", "reasoning", "thinking"])] = text(rng, ["<think>"])
            if rng.random() < 0.4:
                city = rng.choice(["Zürich", "東京", "Paris"])
                args = {"city": city, "days": rng.randint(1, 9), "units": rng.choice(["°C", None])}
                call = {"type": "function", "function": {"name": "weather", "arguments": args}}
                reply["tool_calls"] = [call]
                reply["content"] = rng.choice([None, "", "Let me check."])
                messages += [reply, {"role": "tool", "content": f"{city}: {rng.randint(-5, 30)}"}]
                reply = {"role": "assistant", "content": text(rng, ["<think>"]), "tool_calls": None}
            messages.append(reply)
        out.append(messages)
    return out


def base_tokenizer(texts: list[str], *, metaspace: bool, specials: list[str]) -> Tokenizer:
    if metaspace:  # SentencePiece-like: spaces become ▁, unknown characters <unk>
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
        tok.decoder = decoders.Metaspace(prepend_scheme="never")
        trainer = trainers.BpeTrainer(vocab_size=260, special_tokens=["<unk>"], show_progress=False)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens(specials)
    return tok


def write_dir(name: str, tok: Tokenizer, config: dict) -> Path:
    d = OUT / name
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n")
    return d


def added(content: str) -> dict:
    """A special token as tokenizer_config.json writes an AddedToken."""
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True}  # fmt: skip


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    convs = conversations(CONVERSATIONS)
    corpus = [m["content"] for c in conversations(400, seed=1) for m in c] + WORDS
    cls = {"tokenizer_class": "PreTrainedTokenizerFast"}
    dirs = {
        "chatml": write_dir(
            "chatml",
            base_tokenizer(corpus, metaspace=False, specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
            {**cls, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML},
        ),
        "llama3": write_dir(
            "llama3",
            base_tokenizer(
                corpus,
                metaspace=False,
                specials=[
                    "<|begin_of_text|>",
                    "<|end_of_text|>",
                    "<|start_header_id|>",
                    "<|end_header_id|>",
                    "<|eot_id|>",
                ],
            ),
            {
                **cls,
                "bos_token": added("<|begin_of_text|>"),
                "eos_token": added("<|eot_id|>"),
                "chat_template": [
                    {"name": "default", "template": LLAMA3},
                    {"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
                ],
            },
        ),
        "gemma": write_dir(
            "gemma",
            base_tokenizer(
                corpus,
                metaspace=True,
                specials=["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
            ),
            {
                **cls,
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "chat_template": GEMMA,
            },
        ),
    }
    dirs["tools"] = write_dir(
        "tools",
        Tokenizer.from_file(str(dirs["chatml"] / "tokenizer.json")),
        {**cls, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": TOOLS},
    )
    conversations_of = {name: "conversations" for name in dirs} | {"tools": "tool_conversations"}
    expected = {
        "transformers": transformers.__version__,
        "conversations": convs,
        "tool_conversations": tool_conversations(TOOL_CONVERSATIONS),
        "encoded": {},
    }
    for name, d in dirs.items():
        tok = transformers.AutoTokenizer.from_pretrained(str(d))
        rows = []
        for messages in expected[conversations_of[name]]:
            out = tok.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            mask = "".join(map(str, out["assistant_masks"]))
            assert len(mask) == len(out["input_ids"]) and "1" in mask, (name, messages)
            rows.append({"ids": list(out["input_ids"]), "mask": mask})
        expected["encoded"][name] = rows
        print(f"{name}: {type(tok).__name__}, {sum(len(r['ids']) for r in rows)} tokens")
    with gzip.GzipFile(OUT / "expected.json.gz", "wb", mtime=0) as f:  # mtime 0: the same bytes each run
        f.write(json.dumps(expected, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))


if __name__ == "__main__":
    main()

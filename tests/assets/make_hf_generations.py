"""Greedy generations by transformers for the tiny checkpoints in tests/assets/hf/ (run once,
commit the output). The weights are not touched: each directory is loaded as it is.

Needs torch + transformers, which the project does not depend on; on this
machine's Python 3.11:
    python3 -m venv /tmp/hf311 && /tmp/hf311/bin/pip install torch==2.13.0 transformers safetensors numpy
    /tmp/hf311/bin/python tests/assets/make_hf_generations.py [NAME ...]
Each directory gets generate_prompt.npy (the first PROMPT_LEN tokens of each row of
tokens.npy) and generate_expected.npy: transformers' `generate(do_sample=False)`
(eager attention, float32, its own KV cache, EOS disabled) on that prompt,
prompt included. The suite compares `models.generate` against it token for token.

As a check on the oracle itself, every generation is also recomputed without a
cache (argmax of a full forward pass, one token at a time) and must agree: for
Mistral (sliding_window=5 < PROMPT_LEN + NEW_TOKENS) that shows transformers'
cached decode honours the window exactly as its full forward does.
"""

import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

ASSETS = Path(__file__).parent / "hf"
NAMES = (
    "llama_gqa_rope_llama3",
    "llama_tied",
    "mistral_sliding_window",
    "mixtral_moe",
    "qwen2_bias",
    "qwen3_qk_norm",
    "qwen3_moe",
    "olmo2_post_norm",
    "gemma2_softcap",
    "gemma3_pattern",
    "gpt_oss",
    "gpt_oss_yarn",
    "deepseek_v3_yarn",
    "qwen3_5_hybrid",  # transformers' cached decode: the DeltaNet conv window and state
    "qwen3_5_moe_hybrid",
    "qwen3_next_moe",
    # not deepseek_v3_plain_q: transformers 5.24's batched cached generate leaves its own
    # no-cache greedy on row 1 at step 8 (top-2 margin 0.015; one row at a time they agree);
    # tests/test_deepseek.py checks jaxtrain's latent cache against the full forward instead
)
PROMPT_LEN = 6
# longer prompts where the state is the point: the DeltaNet prefill crosses two 64-token chunks
PROMPT_LEN_FOR = {"qwen3_5_hybrid": 130, "qwen3_5_moe_hybrid": 130, "qwen3_next_moe": 130}
NEW_TOKENS = 20  # 26 positions in all: more than 5x Mistral's window of 5


def greedy_without_cache(model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    seq = prompt
    for _ in range(n):
        logits = model(seq, use_cache=False).logits[:, -1]
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq


def main(names=None):
    print("transformers", transformers.__version__, "torch", torch.__version__)
    for name in names or NAMES:
        d = ASSETS / name
        model = AutoModelForCausalLM.from_pretrained(
            d, attn_implementation="eager", dtype=torch.float32
        ).eval()
        prompt_len = PROMPT_LEN_FOR.get(name, PROMPT_LEN)
        prompt = torch.tensor(np.load(d / "tokens.npy")[:, :prompt_len].astype(np.int64))
        # eos_token_id=None: generation never stops early, whatever tokens come out.
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=0,
            use_cache=True,
        )
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
            check = greedy_without_cache(model, prompt, NEW_TOKENS)
        assert out.shape == (prompt.shape[0], prompt_len + NEW_TOKENS), out.shape
        assert torch.equal(out, check), f"{name}: cached generate differs from no-cache greedy"
        np.save(d / "generate_prompt.npy", prompt.numpy().astype(np.int32))
        np.save(d / "generate_expected.npy", out.numpy().astype(np.int32))
        print(name, "generated", out[:, prompt_len:].tolist())


if __name__ == "__main__":
    main(sys.argv[1:])  # names of NAMES, or none for all

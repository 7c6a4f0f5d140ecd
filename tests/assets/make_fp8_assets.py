"""Build tests/assets/fp8/deepseek_v3_fp8: the tiny DeepSeek-V3 of tests/assets/hf/deepseek_v3_yarn
stored as DeepSeek-V3/R1 and Kimi K2 publish theirs (run once, commit the output).

    /tmp/hf311/bin/python tests/assets/make_fp8_assets.py

Every projection (`*_proj.weight`, experts and shared experts included, not `eh_proj`) is
quantized by DeepSeek's rule, written here in torch as plain loops over blocks: per block of
weight_block_size [16, 32] (small, and not square, so that the tiny model has several blocks,
partial ones at the bottom and right edges: q_a_proj's 24 rows, kv_a_proj_with_mqa's 20,
q_b_proj's 24 columns; a swapped block axis would show), scale = amax(|block|) / 448,
q = e4m3(w / scale), stored as `<name>` (F8_E4M3) and `<name>_scale_inv` (F32). The other tensors
are stored in bfloat16 as published, e_score_correction_bias in float32. logits.npy:
transformers' float32 logits (eager) on tokens.npy with the weights dequantized by the same
loops (q * scale per block) and the bfloat16 ones widened: what a loader must reproduce.
"""

import json
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM

HF = Path(__file__).parent / "hf"
SRC = HF / "deepseek_v3_yarn"
OUT = Path(__file__).parent / "fp8" / "deepseek_v3_fp8"
BLOCK = (16, 32)


def is_quantized(name: str) -> bool:
    module = name.rsplit(".", 2)
    return name.endswith(".weight") and "_proj" in module[-2] and module[-2] != "eh_proj"


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    grid = (math.ceil(rows / BLOCK[0]), math.ceil(cols / BLOCK[1]))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(grid, dtype=torch.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            r, c = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1])
            scale[i, j] = w[r, c].abs().max() / 448.0
            q[r, c] = (w[r, c] / scale[i, j]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    w = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            r, c = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1])
            w[r, c] = q[r, c].to(torch.float32) * scale[i, j]
    return w


def main():
    source = load_file(str(SRC / "model.safetensors"))
    stored, dequantized = {}, {}
    for name, w in source.items():
        if is_quantized(name):
            q, scale = quantize(w.float())
            stored[name], stored[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize(q, scale)
        elif name.endswith("e_score_correction_bias"):
            stored[name] = dequantized[name] = w.float()
        else:
            stored[name] = w.to(torch.bfloat16)
            dequantized[name] = stored[name].float()
    hf = json.loads((SRC / "config.json").read_text())
    hf["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(BLOCK),
    }
    hf["dtype"] = "bfloat16"
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    save_file(stored, str(OUT / "model.safetensors"), metadata={"format": "pt"})
    (OUT / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    shutil.copy(SRC / "tokens.npy", OUT / "tokens.npy")
    with tempfile.TemporaryDirectory() as tmp:  # transformers' loader fuses the experts itself
        save_file(dequantized, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(SRC / "config.json", Path(tmp) / "config.json")
        model = DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    tokens = torch.as_tensor(np.load(SRC / "tokens.npy"))
    with torch.no_grad():
        logits = model(tokens).logits.float().numpy()
    np.save(OUT / "logits.npy", logits)
    print(f"wrote {OUT}: {sum(1 for n in stored if n.endswith('_scale_inv'))} block-FP8 weights")


if __name__ == "__main__":
    main()

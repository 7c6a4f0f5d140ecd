"""Host memory of `jaxtrain convert hf-to-ckpt` on a block-FP8 checkpoint, against its size.

    python benchmarks/convert_memory.py [--size-gb 2.0] [--dir /tmp] [--keep]

Writes a synthetic DeepSeek-V3-shaped checkpoint of about `--size-gb` GB on disk (latent
attention, a dense first layer, then MoE layers of 16 experts; every projection e4m3 with a
float32 `weight_scale_inv` per 128 x 128 block and `quantization_config` as DeepSeek-V3
publishes it; random codes and scales, not a trained model), converts it in a subprocess
(`python -m jaxtrain convert hf-to-ckpt`) and reports that process's peak RSS (`os.wait4`),
beside the RSS of a process that only imports the converter and starts JAX's backends, the checkpoint's
size on disk and the float32 size of the converted parameters. Streaming conversion
(interchange/stream_ckpt.py) holds a few tensors at a time, so its peak above the imports
stays near a few of the largest tensors (float32) whatever the checkpoint's size; the
float32 model would be 4x the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

try:  # imported as benchmarks.convert_memory (the tests)
    from benchmarks import result_file
except ImportError:  # run as a script: its folder is on the path
    import result_file

BLOCK = 128


def synthetic_config(layers: int, d_model: int = 1024, experts: int = 16) -> dict:
    """A DeepseekV3ForCausalLM config.json with block-FP8 quantization_config; widths scale
    with d_model (1024: about 27 MB of e4m3 per MoE layer)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 4 * d_model,
        "hidden_size": d_model,
        "intermediate_size": 2 * d_model,
        "moe_intermediate_size": d_model // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 3 * d_model // 8,
        "kv_lora_rank": d_model // 4,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,  # kv_a_proj_with_mqa: kv_lora_rank + 32 rows, a partial block
        "v_head_dim": 64,
        "n_routed_experts": experts,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [BLOCK, BLOCK],
        },
    }


def _layer_shapes(hf: dict, layer: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    """HF name -> (shape, block-FP8?) of one decoder layer's tensors."""
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    qk = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
    p = f"model.layers.{layer}."
    out = {
        p + "input_layernorm.weight": ((d,), False),
        p + "post_attention_layernorm.weight": ((d,), False),
        p + "self_attn.q_a_proj.weight": ((hf["q_lora_rank"], d), True),
        p + "self_attn.q_a_layernorm.weight": ((hf["q_lora_rank"],), False),
        p + "self_attn.q_b_proj.weight": ((h * qk, hf["q_lora_rank"]), True),
        p + "self_attn.kv_a_proj_with_mqa.weight": ((hf["kv_lora_rank"] + hf["qk_rope_head_dim"], d), True),
        p + "self_attn.kv_a_layernorm.weight": ((hf["kv_lora_rank"],), False),
        p + "self_attn.kv_b_proj.weight": (
            (h * (hf["qk_nope_head_dim"] + hf["v_head_dim"]), hf["kv_lora_rank"]),
            True,
        ),
        p + "self_attn.o_proj.weight": ((d, h * hf["v_head_dim"]), True),
    }
    mlps = {}
    if layer < hf["first_k_dense_replace"]:
        mlps["mlp."] = hf["intermediate_size"]
    else:
        out[p + "mlp.gate.weight"] = ((hf["n_routed_experts"], d), False)
        out[p + "mlp.gate.e_score_correction_bias"] = ((hf["n_routed_experts"],), False)
        mlps["mlp.shared_experts."] = hf["moe_intermediate_size"] * hf["n_shared_experts"]
        for e in range(hf["n_routed_experts"]):
            mlps[f"mlp.experts.{e}."] = hf["moe_intermediate_size"]
    for prefix, f in mlps.items():
        out[p + prefix + "gate_proj.weight"] = ((f, d), True)
        out[p + prefix + "up_proj.weight"] = ((f, d), True)
        out[p + prefix + "down_proj.weight"] = ((d, f), True)
    return out


def _tensors(shapes: dict, rng: np.random.Generator):
    """Random tensors for `_layer_shapes`' entries: e4m3 codes (no NaN) with float32 scales,
    bfloat16 norms and router, a float32 selection bias."""
    import ml_dtypes

    for name, (shape, fp8) in shapes.items():
        if fp8:
            codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
            codes[(codes & 0x7F) == 0x7F] = 0x7E  # 0x7f / 0xff are e4m3fn's NaNs
            yield name, codes.view(ml_dtypes.float8_e4m3fn)
            grid = (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK))
            yield name + "_scale_inv", rng.uniform(1e-4, 1e-3, size=grid).astype(np.float32)
        elif name.endswith("e_score_correction_bias"):
            yield name, rng.normal(size=shape).astype(np.float32)
        else:
            yield name, (1 + 0.01 * rng.normal(size=shape)).astype(ml_dtypes.bfloat16)


def write_checkpoint(
    path: str, size_bytes: float, d_model: int = 1024, experts: int = 16, seed: int = 0
) -> dict:
    """A synthetic block-FP8 DeepSeek-V3 directory of about `size_bytes` at `path`, one
    safetensors shard per layer (the embeddings and head in their own); returns config.json."""
    from jaxtrain.models.safetensors_io import write_file

    per_layer = sum(
        math.prod(s) * (1 if fp8 else 2)
        for s, fp8 in _layer_shapes(synthetic_config(2, d_model, experts), 1).values()
    )
    layers = max(2, round(size_bytes / per_layer))
    hf = synthetic_config(layers, d_model, experts)
    rng = np.random.default_rng(seed)
    os.makedirs(path, exist_ok=True)
    weight_map = {}
    d, v = hf["hidden_size"], hf["vocab_size"]
    outer = {"model.embed_tokens.weight": ((v, d), False), "model.norm.weight": ((d,), False)}
    outer["lm_head.weight"] = ((v, d), False)
    shards = [outer] + [_layer_shapes(hf, i) for i in range(layers)]
    for i, shapes in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = list(_tensors(shapes, rng))
        write_file(os.path.join(path, name), tensors, metadata={"format": "pt"})
        weight_map.update({t: name for t, _ in tensors})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    return hf


def _peak_rss(cmd: list[str]) -> tuple[int, float]:
    """(peak RSS in bytes, seconds) of one child process, which must succeed."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}")
    return usage.ru_maxrss * 1024, time.perf_counter() - start  # Linux: kilobytes


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size on disk (default 2)")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints go (default: /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the HF and converted checkpoints")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="jaxtrain-convert-memory-", dir=args.dir)
    hf_dir, ckpt_dir = os.path.join(work, "hf"), os.path.join(work, "ckpt")
    try:
        hf = write_checkpoint(hf_dir, args.size_gb * 1e9)
        hf_bytes = _dir_bytes(hf_dir)
        py = sys.executable
        # the fixed cost: the converter's imports and JAX's backends (Orbax asks for the process
        # index, which starts them: ~0.4 GB of plugin libraries on a host with TPU and CUDA wheels)
        start = "from jaxtrain import host; host.configure_host(); import jaxtrain.interchange.convert, jax"
        imports, _ = _peak_rss([py, "-c", start + "; jax.devices()"])  # as the CLI starts
        peak, seconds = _peak_rss([py, "-m", "jaxtrain", "convert", "hf-to-ckpt", hf_dir, ckpt_dir])
        from jaxtrain.models.hf import config_from_hf, param_sources

        sources = param_sources(hf_dir, config_from_hf(hf))
        model_f32 = sum(4 * math.prod(s.shape) for s in sources.values())
        largest = max(4 * math.prod(s.shape[len(s.slices[0][0]) :]) for s in sources.values())
        row = {
            "layers": hf["num_hidden_layers"],
            "checkpoint_bytes": hf_bytes,
            "model_float32_bytes": model_f32,
            "largest_tensor_float32_bytes": largest,
            "converted_bytes": _dir_bytes(ckpt_dir),
            "import_rss_bytes": imports,
            "peak_rss_bytes": peak,
            "peak_above_imports_bytes": peak - imports,
            "peak_above_imports_over_checkpoint": (peak - imports) / hf_bytes,
            "peak_over_checkpoint": peak / hf_bytes,
            "seconds": seconds,
        }
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(row))
    gib = lambda b: f"{b / 2**30:.2f}"
    header = ["checkpoint GiB", "float32 model GiB", "largest tensor MiB", "imports RSS GiB", "peak RSS GiB",
              "peak - imports / checkpoint"]  # fmt: skip
    cells = [
        gib(hf_bytes),
        gib(model_f32),
        f"{largest / 2**20:.1f}",
        gib(imports),
        gib(peak),
        f"{row['peak_above_imports_over_checkpoint']:.3f}",
    ]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n| " + " | ".join(cells) + " |")
    result_file.add_figures(**row)
    result_file.add_table("convert_memory", header, [cells])


if __name__ == "__main__":
    sys.exit(result_file.run("convert_memory", main))

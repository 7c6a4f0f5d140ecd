"""Block-quantized FP8 weights as DeepSeek-V3/R1 and Kimi K2 publish them, in and out.

The published checkpoints store each linear weight W [rows, cols] as e4m3 values Q with a
float32 `<name>_scale_inv` S of ceil(rows / br) x ceil(cols / bc) blocks (config.json's
`quantization_config`: quant_method fp8, fmt e4m3, weight_block_size [br, bc]; 128 x 128 in
every release). DeepSeek's rule (its inference code's `weight_dequant`):

    W[i, j] = Q[i, j] * S[i // br, j // bc]

with partial blocks at the right and bottom edges (kv_a_proj_with_mqa's 576 rows: 5 row
blocks, the last of 64). The block comes from weight_block_size, never from the grid's shape
(rows // grid_rows is wrong for ragged edges). Quantizing is its inverse: S = amax(|block|) /
448 (e4m3's largest finite value) and Q = e4m3(W / S), so a block's largest element lands on
+-448 and an untrained weight re-quantizes to itself within one e4m3 step.

What DeepSeek-V3 quantizes: every attention and MLP projection (`*_proj.weight`, experts
and shared experts included); not the embeddings, the heads, the norms, the router
(`mlp.gate.weight`, `e_score_correction_bias`) nor the prediction modules' `eh_proj`.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)
# quant_method values that import: block FP8 (here), MXFP4 (GPT-OSS's experts: models/hf/gpt_oss.py)
IMPORTABLE = ("fp8", "mxfp4")


class QuantizationError(ValueError):
    """A quantization this converter does not read, or a scale grid that does not fit."""


def block_size(hf: dict) -> tuple[int, int] | None:
    """The FP8 block (rows, cols) of a config.json, None when it is not block FP8; refuses, in
    one line naming it, any quant_method other than fp8 and mxfp4 (e.g. compressed-tensors,
    Kimi K2-Thinking's INT4) and an fp8 that is not e4m3 in 2-D blocks."""
    q = hf.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method not in IMPORTABLE:
        raise QuantizationError(
            f"config.json quantization_config.quant_method={method!r} is not supported "
            f"(expected one of {IMPORTABLE}, or none)"
        )
    if method != "fp8":
        return None
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(
            f"config.json quantization_config.fmt={fmt!r} is not supported (expected 'e4m3')"
        )
    block = q.get("weight_block_size") or list(DEFAULT_BLOCK)
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise QuantizationError(
            f"config.json quantization_config.weight_block_size={block!r}: expected two positive integers"
        )
    return int(block[0]), int(block[1])


def quantization_config(block: tuple[int, int] = DEFAULT_BLOCK) -> dict:
    """config.json's `quantization_config` for weights quantized by `quantize_blocks`."""
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }


def grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a [rows, cols] weight: ceil(rows / br) x ceil(cols / bc)."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def _expand(scale: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    """Each block's scale repeated over its block, cut to the weight's shape (partial edges)."""
    return np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1)[: shape[0], : shape[1]]


def dequantize_blocks(
    q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str = ""
) -> np.ndarray:
    """float32 W = Q * S per block (module docstring); the grid must be `grid(Q.shape, block)`."""
    want = list(grid(q.shape, block)) if q.ndim == 2 else "2-D"
    if q.ndim != 2 or list(scale_inv.shape) != want:
        raise QuantizationError(
            f"tensor {name!r}: {q.dtype}{list(q.shape)} with {name}{SCALE_SUFFIX} {list(scale_inv.shape)}; "
            f"expected a 2-D weight and a scale grid of {want} for weight_block_size {list(block)}"
        )
    return q.astype(np.float32) * _expand(scale_inv.astype(np.float32), q.shape, block)


def quantize_blocks(w: np.ndarray, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 Q, float32 S) of a [rows, cols] float weight: S = amax(|block|) / 448 (1 for an
    all-zero block), Q = e4m3(W / S), clipped to +-448 so that rounding never overflows."""
    w = np.asarray(w, np.float32)
    rows, cols = grid(w.shape, block)
    padded = np.zeros((rows * block[0], cols * block[1]), np.float32)
    padded[: w.shape[0], : w.shape[1]] = np.abs(w)
    amax = padded.reshape(rows, block[0], cols, block[1]).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    q = np.clip(w / _expand(scale, w.shape, block), -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return q, scale


def quantized_in_published(name: str) -> bool:
    """Whether DeepSeek-V3's published checkpoint keeps HF tensor `name` in block FP8: the
    projections' weights (`q_a_proj`, `kv_a_proj_with_mqa`, `o_proj`, `gate_proj`, experts'...),
    not `eh_proj`, embeddings, heads, norms or the router."""
    module, _, leaf = name.rpartition(".")
    module = module.rpartition(".")[2]
    return leaf == "weight" and "_proj" in module and module != "eh_proj"


# --- export (`jaxtrain convert ckpt-to-hf --dtype`) -------------------------------

EXPORT_DTYPES = ("float32", "bfloat16", "fp8-block")
BF16 = np.dtype(ml_dtypes.bfloat16)


def export_tensors(tensors, dtype: str, block: tuple[int, int] = DEFAULT_BLOCK):
    """(name, float32 tensor) pairs as `dtype` writes them: float32 unchanged; bfloat16 all
    of them; fp8-block DeepSeek-V3's published layout: the projections block-quantized
    (`quantize_blocks`, each followed by its `_scale_inv`), `e_score_correction_bias` float32,
    everything else bfloat16."""
    if dtype not in EXPORT_DTYPES:
        raise QuantizationError(f"--dtype {dtype!r}: expected one of {EXPORT_DTYPES}")
    for name, w in tensors:
        if dtype == "float32":
            yield name, w
        elif dtype == "fp8-block" and quantized_in_published(name) and w.ndim == 2:
            q, scale = quantize_blocks(w, block)
            yield name, q
            yield name + SCALE_SUFFIX, scale
        elif dtype == "fp8-block" and name.endswith("e_score_correction_bias"):
            yield name, w
        else:
            yield name, w.astype(BF16)


def export_config(dtype: str, block: tuple[int, int] = DEFAULT_BLOCK) -> dict:
    """The config.json fields `export_tensors(..., dtype)` sets."""
    if dtype == "float32":
        return {}
    out = {"torch_dtype": "bfloat16"}
    if dtype == "fp8-block":
        out["quantization_config"] = quantization_config(block)
    return out

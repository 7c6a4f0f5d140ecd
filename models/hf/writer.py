"""Writing an HF directory: `params_to_hf_tensors` (our params as HF's named float32 tensors,
one at a time), `write_hf_dir` (them as safetensors shards beside the index and config.json)
and `to_hf` (a model in memory)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from flax import nnx

from jaxtrain.models import linear_attention as linear
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf import qwen3_5 as hf_qwen3_5
from jaxtrain.models.hf.deepseek import _MTP_SHARED
from jaxtrain.models.hf.families import hf_config
from jaxtrain.models.hf.gpt_oss import _gpt_oss_expert_tensors, _has_gpt_oss_experts
from jaxtrain.models.hf.names import _hf_names, _to_hf


def params_to_hf_tensors(
    params: dict, cfg: ModelConfig, architecture: str | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 numpy tensor) pairs, one at a time (`architecture`: the class's tensor
    layout where two share a config, Qwen3-Next's fused DeltaNet projections)."""
    pending: dict[str, dict] = {}  # a fused tensor's parts until the last one comes
    for ours, index, theirs in _hf_names(cfg, arch=architecture):
        if ours[-1] == "wq_gate":
            continue  # written with wq: one q_proj
        node = params
        for key in ours:
            node = node[key]
        w = np.asarray(node[index] if index else node, dtype=np.float32)
        fused = linear.qwen3_next_fused(theirs)
        if fused:
            parts = pending.setdefault(theirs, {})
            parts[ours[-1]] = w
            if len(parts) == 2:
                yield theirs, np.ascontiguousarray(linear.qwen3_next_join(fused, pending.pop(theirs)))
            continue
        if ours[-1] == "wq" and cfg.attention_output_gate:
            gate = params
            for key in (*ours[:-1], "wq_gate"):
                gate = gate[key]
            gate = np.asarray(gate[index] if index else gate, dtype=np.float32)
            yield theirs, np.ascontiguousarray(hf_qwen3_5.gated_query_to_hf(w, gate))
            continue
        yield theirs, np.ascontiguousarray(_to_hf(ours, w, cfg))
    if cfg.mla is not None and cfg.mtp is not None:  # DeepSeek-V3's copies in each prediction layer
        # a tied head is the table itself in HF's [vocab, d_model] layout
        shared = {k: ("embedding",) if cfg.tie_embeddings else v for k, v in _MTP_SHARED.items()}
        for i in range(cfg.mtp.depth):
            for theirs, ours in shared.items():
                w = np.asarray(params[ours[0]], dtype=np.float32)
                yield f"model.layers.{cfg.n_layers + i}.{theirs}", np.ascontiguousarray(_to_hf(ours, w, cfg))
    if _has_gpt_oss_experts(cfg):
        yield from _gpt_oss_expert_tensors(params, cfg)


def write_hf_dir(
    tensors: Iterator[tuple[str, np.ndarray]],
    cfg: ModelConfig,
    path: str | Path,
    *,
    architecture: str | None = None,
    max_shard_bytes: int = 2 * 2**30,
    config_updates: dict | None = None,
    config: dict | None = None,
) -> Path:
    """Write (name, tensor) pairs (any dtype: float32, bfloat16, e4m3 with its scales) as HF
    safetensors shards plus `model.safetensors.index.json` and `config.json` (with
    `config_updates`: torch_dtype, quantization_config; `config`: the whole config.json instead
    of `hf_config`'s, e.g. a wrapper class's). Holds at most one shard in memory, so
    a 7B model converts without a second full copy."""
    from jaxtrain.models.safetensors_io import write_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    current: dict[str, np.ndarray] = {}
    size = 0
    written: list[tuple[str, list[str]]] = []

    def flush():
        nonlocal current, size
        if current:
            name = f"model-{len(written) + 1:05d}.safetensors"
            write_file(out / name, current.items(), metadata={"format": "pt"})
            written.append((name, list(current)))
            current, size = {}, 0

    for name, tensor in tensors:
        if size and size + tensor.nbytes > max_shard_bytes:
            flush()
        current[name] = tensor
        size += tensor.nbytes
    flush()
    total = len(written)
    weight_map = {}
    for i, (old, names) in enumerate(written):
        new = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        (out / old).rename(out / new)
        weight_map.update({n: new for n in names})
    total_bytes = sum((out / f).stat().st_size for f in set(weight_map.values()))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=2) + "\n"
    )
    config = {**(config or hf_config(cfg, architecture)), **(config_updates or {})}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def to_hf(
    model, path: str | Path, *, architecture: str | None = None, max_shard_bytes: int = 2 * 2**30
) -> Path:
    """Write `model` as an HF checkpoint directory (config.json + f32 safetensors shards)."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return write_hf_dir(
        params_to_hf_tensors(params, model.cfg, architecture),
        model.cfg,
        path,
        architecture=architecture,
        max_shard_bytes=max_shard_bytes,
    )

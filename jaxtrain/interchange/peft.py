"""PEFT LoRA adapters in and out: `model.lora.init_from` reads one, `jaxtrain convert
ckpt-to-hf RUN OUT --adapter` writes one that `peft.PeftModel.from_pretrained(base, OUT)`
loads (adapter_config.json + adapter_model.safetensors, float32).

Names and layouts: PEFT keys a targeted HF Linear's matrices as
`base_model.model.<its HF weight name without .weight>.lora_A.weight` [r, in] and
`....lora_B.weight` [out, r]; the HF names are models/hf/'s (`q_proj` for wq, ...). Ours
are the same matrices in the weight's own layout (models/lora.py): a [*in, r] is lora_A
transposed with `in` unflattened, b [r, *out] is lora_B transposed. HF's q/k projections
already use the rotate-half RoPE layout our wq/wk have (models/hf/), so an adapter on them
needs no permutation either. Expert adapters of MoE layers have no PEFT form here (transformers
5 fuses the experts into one parameter), and are refused.

Two of HF's modules are stored differently here, and their lora_B rows follow the weight's:
- the gated q_proj (model.attention_output_gate; per head: query rows, then gate rows) is our
  wq and wq_gate; PEFT's one adapter on it is wq's, whose b [r, H, 2 hd] is lora_B's rows in
  HF's order already (models/lora.py), so it needs no permutation;
- gated DeltaNet's in_proj_qkv (rows: every q head, every k head, every v head) is regrouped
  per key head (models/linear_attention.py); lora_B's rows are regrouped the same way
  (`_b_to_ours` / `_b_to_hf`). lora_A is the input side and needs nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from jaxtrain.models import linear_attention, lora
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf import HFConversionError, _hf_names

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
# adapter_config.json as peft 0.21 saves a plain LoRA (the fields it writes, their defaults);
# r, lora_alpha, lora_dropout, target_modules and base_model_name_or_path are filled in
_PEFT_DEFAULTS = {
    "alora_invocation_tokens": None,
    "alpha_pattern": {},
    "arrow_config": None,
    "auto_mapping": None,
    "bias": "none",
    "corda_config": None,
    "ensure_weight_tying": False,
    "eva_config": None,
    "exclude_modules": None,
    "fan_in_fan_out": False,
    "inference_mode": True,
    "init_lora_weights": True,
    "kasa_config": None,
    "layer_replication": None,
    "layers_pattern": None,
    "layers_to_transform": None,
    "loftq_config": {},
    "lora_bias": False,
    "lora_ga_config": None,
    "megatron_config": None,
    "megatron_core": "megatron.core",
    "modules_to_save": None,
    "monteclora_config": None,
    "peft_type": "LORA",
    "peft_version": "0.21.2",
    "qalora_group_size": 16,
    "rank_pattern": {},
    "revision": None,
    "target_parameters": None,
    "task_type": "CAUSAL_LM",
    "trainable_token_indices": None,
    "use_bdlora": None,
    "use_dora": False,
    "use_qalora": False,
    "use_rslora": False,
    "velora_config": None,
}
# Settings of an adapter_config.json that change what the adapter computes; we read only
# adapters that leave them at these values.
_MUST_BE = {
    "peft_type": "LORA",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "bias": "none",
    "lora_bias": False,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "modules_to_save": None,
    "target_parameters": None,
}


class PeftError(HFConversionError):
    """An adapter directory jaxtrain cannot read or a model whose adapters it cannot write."""


def _module(key_a: str) -> str:
    """`....self_attn.q_proj.lora_A.weight` -> `q_proj`."""
    return key_a.rsplit(".", 3)[-3]


def adapter_names(cfg: ModelConfig):
    """(our adapter path, stacked index, PEFT key of lora_A, of lora_B) for every adapter."""
    for ours, index, theirs in _hf_names(cfg):
        if ours[-1] not in cfg.lora.targets or ours[-2] not in ("attn", "mlp"):
            continue
        if len(index) != 1:  # (layer, expert)
            raise PeftError(
                f"model.lora.targets {ours[-1]!r} on MoE experts: PEFT adapters of experts are not "
                "supported (transformers fuses them); expected attention / dense MLP targets only"
            )
        stem = PREFIX + theirs.removesuffix(".weight")
        yield (*ours[:-1], ours[-1] + lora.SUFFIX), index, stem + ".lora_A.weight", stem + ".lora_B.weight"


def target_modules(cfg: ModelConfig) -> list[str]:
    """PEFT's target_modules (HF module names) of model.lora.targets, sorted."""
    return sorted({_module(theirs) for _, _, theirs, _ in adapter_names(cfg)})


def _node(tree: dict, path) -> dict:
    for key in path:
        tree = tree[key]
    return tree


def _regrouped(path) -> bool:
    """Whether the adapter at `path` is gated DeltaNet's in_proj_qkv's, whose lora_B rows are
    regrouped per key head here (module docstring)."""
    return path[-1] == "in_proj_qkv" + lora.SUFFIX


def _b_to_hf(path, b: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """One adapter's b [r, *out] -> PEFT's lora_B [out, r] (HF's row order)."""
    if _regrouped(path):  # b is laid out as the weight [D, hk, width] with r for D
        return linear_attention.qwen3_5_tensor_to_hf("in_proj_qkv", b, cfg)
    return b.reshape(b.shape[0], -1).T


def _b_to_ours(path, lora_b: np.ndarray, shape: tuple[int, ...], cfg: ModelConfig) -> np.ndarray:
    """`_b_to_hf`'s inverse: lora_B [out, r] -> b of `shape` [r, *out]."""
    if _regrouped(path):
        return linear_attention.qwen3_5_tensor_to_ours("in_proj_qkv", lora_b, cfg)
    return lora_b.T.reshape(shape)


def adapter_tensors(adapters: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our adapter tree (numpy or jax) -> PEFT's {key: float32 [r, in] / [out, r]}."""
    r, out = cfg.lora.rank, {}
    for path, index, key_a, key_b in adapter_names(cfg):
        node = _node(adapters, path)
        a, b = (np.asarray(node[k][index], np.float32) for k in ("a", "b"))
        out[key_a] = np.ascontiguousarray(a.reshape(-1, r).T)
        out[key_b] = np.ascontiguousarray(_b_to_hf(path, b, cfg))
    return out


def write_adapter(adapters: dict, cfg: ModelConfig, out_dir: str | Path, *, base: str = "") -> Path:
    """Write our adapters as a PEFT LoRA adapter directory (`base`: its base model's name or
    path, recorded as base_model_name_or_path)."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(adapter_tensors(adapters, cfg), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    lo = cfg.lora
    config = dict(
        _PEFT_DEFAULTS,
        base_model_name_or_path=base,
        r=lo.rank,
        lora_alpha=int(lo.alpha) if float(lo.alpha).is_integer() else lo.alpha,
        lora_dropout=lo.dropout,
        target_modules=target_modules(cfg),
    )
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def read_adapter(path: str | Path, cfg: ModelConfig, target: dict | None = None) -> dict:
    """A PEFT adapter directory -> our adapter tree, checked against model.lora (rank, alpha,
    targets) and the model's shapes; `target` (ShapeDtypeStructs with shardings, the train
    state's `params`) places it, None gives numpy arrays."""
    from safetensors import safe_open

    p, lo, label = Path(path), cfg.lora, f"model.lora.init_from={path}"
    if not (p / CONFIG_FILE).is_file() or not (p / WEIGHTS_FILE).is_file():
        raise PeftError(f"{label}: expected a PEFT adapter directory ({CONFIG_FILE} + {WEIGHTS_FILE})")
    saved = json.loads((p / CONFIG_FILE).read_text())
    for key, want in _MUST_BE.items():
        value = saved.get(key, want)
        if value != want and not (value in ({}, None) and want in ({}, None)):
            raise PeftError(
                f"{label}: {CONFIG_FILE} {key}={saved.get(key)!r} is not supported; expected {want!r}"
            )
    for key, want in (("r", lo.rank), ("lora_alpha", lo.alpha)):
        if float(saved.get(key, -1)) != float(want):
            raise PeftError(f"{label}: {CONFIG_FILE} {key}={saved.get(key)!r} but model.lora has {want!r}")
    have = saved.get("target_modules")
    have = sorted([have] if isinstance(have, str) else have or [])
    if have != target_modules(cfg):
        raise PeftError(
            f"{label}: target_modules={have} but model.lora.targets={list(lo.targets)} are "
            f"{target_modules(cfg)}; expected the same modules"
        )
    from flax import nnx

    from jaxtrain.models.params import abstract_model
    from jaxtrain.models.transformer import Transformer

    shapes = lora.split(nnx.to_pure_dict(abstract_model(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))[1]))[1]
    out = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), shapes)
    with safe_open(str(p / WEIGHTS_FILE), framework="numpy") as f:
        keys = set(f.keys())
        wanted = set()
        for path_, index, key_a, key_b in adapter_names(cfg):
            node = _node(out, path_)
            for key, name in ((key_a, "a"), (key_b, "b")):
                if key not in keys:
                    raise PeftError(f"{label}: tensor {key!r} is missing")
                wanted.add(key)
                w = f.get_tensor(key).astype(np.float32).T  # [in, r] / [r, out]
                shape = node[name].shape[len(index) :]
                if w.size != int(np.prod(shape)) or w.shape[-1 if name == "a" else 0] != lo.rank:
                    raise PeftError(f"{label}: tensor {key!r} has shape {w.T.shape}; the model needs {shape}")
                node[name][index] = w.reshape(shape) if name == "a" else _b_to_ours(path_, w.T, shape, cfg)
        extra = sorted(keys - wanted)
        if extra:
            raise PeftError(f"{label}: tensors the model has no adapter for, e.g. {extra[0]!r}")
    if target is None:
        return out
    return jax.tree.map(lambda x, t: jax.device_put(x.astype(t.dtype), t.sharding), out, target)

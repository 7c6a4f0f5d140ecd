"""Hugging Face checkpoints in and out: `from_hf(path)` and `to_hf(model, path)`.

Reads a local directory (`config.json` + `*.safetensors`, with or without a
`model.safetensors.index.json`) for LlamaForCausalLM, MistralForCausalLM and
MixtralForCausalLM (every layer MoE, softmax top-k renormalised, dropless) and
returns a ready NNX `Transformer`; writes one that `transformers` loads with the
same logits. No network, no torch: tensors are read one at a time with
`safetensors.safe_open` (numpy), so peak memory is one copy of the model plus
one tensor.

Layout mapping (HF Linear weights are `[out, in]`):
  q_proj [H*hd, D] -> wq [D, H, hd]      o_proj [D, H*hd] -> wo [H, hd, D]
  gate/up [F, D]   -> w_gate/w_up [D, F]  down [D, F]     -> w_down [F, D]
  Mixtral: gate [E, D] -> w_router [D, E]; experts.e.w1/w3 [F, D] -> w_gate/w_up[e] [D, F];
  experts.e.w2 [D, F] -> w_down[e] [F, D]  (stacked [layers, experts, ...] under moe_blocks)
HF's q/k weights are already permuted for the "rotate half" RoPE our model
uses, so no head-dim permutation is needed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.models.config import ModelConfig, MoEConfig
from jaxtrain.models.params import abstract_model, merge
from jaxtrain.models.transformer import Transformer

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")


class HFConversionError(ValueError):
    """Unsupported architecture/feature or a missing/mis-shaped tensor; names it."""


# --- config ---------------------------------------------------------------------


def _rope_settings(hf: dict) -> dict:
    """RoPE theta and scaling from either transformers 4.x (`rope_theta`, `rope_scaling`)
    or 5.x (`rope_parameters`) config layouts."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = merged.get("rope_type", merged.get("type", "default"))
    out = {"rope_theta": float(theta)}
    if kind in (None, "default"):
        return out
    if kind == "linear":
        return {**out, "rope_scaling": "linear", "rope_scaling_factor": float(merged["factor"])}
    if kind == "llama3":
        return {
            **out,
            "rope_scaling": "llama3",
            "rope_scaling_factor": float(merged["factor"]),
            "rope_low_freq_factor": float(merged["low_freq_factor"]),
            "rope_high_freq_factor": float(merged["high_freq_factor"]),
            "rope_original_max_position": int(merged["original_max_position_embeddings"]),
        }
    raise HFConversionError(
        f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)"
    )


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """ModelConfig from a parsed HF `config.json`."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise HFConversionError(
            f"architecture {arch!r} is not supported; expected one of {SUPPORTED_ARCHITECTURES}"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise HFConversionError(f"config.json {flag}=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConversionError(f"hidden_act={hf['hidden_act']!r} is not supported (expected silu)")
    n_heads = hf["num_attention_heads"]
    fields = dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        mlp_dim=hf["intermediate_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        **_rope_settings(hf),
    )
    if arch in ("MistralForCausalLM", "MixtralForCausalLM") and hf.get("sliding_window"):
        fields["sliding_window"] = int(hf["sliding_window"])
    if arch == "MixtralForCausalLM":
        k = hf["num_experts_per_tok"]
        fields["moe"] = MoEConfig(
            num_experts=hf["num_local_experts"],
            top_k=k,
            expert_mlp_dim=hf["intermediate_size"],
            scoring="softmax",
            normalize_top_k=True,
            dispatch="dropless",
            # HF sums its load-balancing loss over the k choices; ours averages (1.0 = balanced).
            aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.02)) * k,
        )
    fields.update(overrides)
    cfg = ModelConfig(**fields)
    cfg.validate()
    return cfg


def hf_config(cfg: ModelConfig, architecture: str | None = None) -> dict:
    """An HF `config.json` dict for `cfg` (Mistral when it has a sliding window)."""
    arch = architecture or (
        "MixtralForCausalLM"
        if cfg.moe is not None
        else "MistralForCausalLM"
        if cfg.sliding_window
        else "LlamaForCausalLM"
    )
    if (arch == "MixtralForCausalLM") != (cfg.moe is not None):
        raise HFConversionError(f"architecture {arch!r} does not match model.moe={cfg.moe!r}")
    if cfg.moe is not None:
        m = cfg.moe
        if (
            m.first_dense_layers,
            m.every,
            m.num_shared_experts,
            m.scoring,
            m.normalize_top_k,
            m.score_bias,
        ) != (0, 1, 0, "softmax", True, False):
            raise HFConversionError(
                "only Mixtral-style MoE converts to HF: every layer MoE, no shared "
                "experts, softmax scoring renormalised over the top-k, no score bias"
            )
    if arch not in SUPPORTED_ARCHITECTURES:
        raise HFConversionError(
            f"architecture {arch!r} is not supported; expected one of {SUPPORTED_ARCHITECTURES}"
        )
    rope: dict = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "linear":
        rope = {"rope_type": "linear", "factor": cfg.rope_scaling_factor, "rope_theta": cfg.rope_theta}
    elif cfg.rope_scaling == "llama3":
        rope = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position,
            "rope_theta": cfg.rope_theta,
        }
    out = {
        "architectures": [arch],
        "model_type": "mistral" if arch == "MistralForCausalLM" else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "max_position_embeddings": max(cfg.rope_original_max_position, 4096),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        # Both spellings: transformers 4.x reads rope_theta/rope_scaling, 5.x rope_parameters.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "rope_scaling": None if rope["rope_type"] == "default" else rope,
    }
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        out["model_type"] = "mixtral" if arch == "MixtralForCausalLM" else "mistral"
        out["sliding_window"] = cfg.sliding_window
    if arch == "MixtralForCausalLM":
        out.update(
            num_local_experts=cfg.moe.num_experts,
            num_experts_per_tok=cfg.moe.top_k,
            intermediate_size=cfg.moe.mlp_dim(cfg),
            router_aux_loss_coef=cfg.moe.aux_loss_weight / cfg.moe.top_k,
        )
    return out


# --- tensors -------------------------------------------------------------------


def _hf_names(cfg: ModelConfig) -> Iterator[tuple[tuple[str, ...], tuple[int, ...], str]]:
    """(our param path, index into the stacked array, HF tensor name) for every tensor.
    The index is () for unstacked params, (layer,) or (layer, expert) for stacked ones."""
    yield ("embedding",), (), "model.embed_tokens.weight"
    yield ("final_norm", "scale"), (), "model.norm.weight"
    if not cfg.tie_embeddings:
        yield ("lm_head",), (), "lm_head.weight"
    common = {
        ("attn", "wq"): "self_attn.q_proj.weight",
        ("attn", "wk"): "self_attn.k_proj.weight",
        ("attn", "wv"): "self_attn.v_proj.weight",
        ("attn", "wo"): "self_attn.o_proj.weight",
        ("attn_norm", "scale"): "input_layernorm.weight",
        ("mlp_norm", "scale"): "post_attention_layernorm.weight",
    }
    dense = {
        ("mlp", "w_gate"): "mlp.gate_proj.weight",
        ("mlp", "w_up"): "mlp.up_proj.weight",
        ("mlp", "w_down"): "mlp.down_proj.weight",
    }
    experts = {("mlp", "w_gate"): "w1.weight", ("mlp", "w_up"): "w3.weight", ("mlp", "w_down"): "w2.weight"}
    stack = "blocks" if cfg.moe is None else "moe_blocks"
    for layer in range(cfg.n_layers):
        prefix = f"model.layers.{layer}."
        for ours, theirs in common.items():
            yield (stack, *ours), (layer,), prefix + theirs
        if cfg.moe is None:
            for ours, theirs in dense.items():
                yield (stack, *ours), (layer,), prefix + theirs
            continue
        yield (stack, "mlp", "w_router"), (layer,), prefix + "block_sparse_moe.gate.weight"
        for e in range(cfg.moe.num_experts):
            for ours, theirs in experts.items():
                yield (stack, *ours), (layer, e), f"{prefix}block_sparse_moe.experts.{e}.{theirs}"


def _to_ours(path: tuple[str, ...], w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    d, hd = cfg.d_model, cfg.resolved_head_dim
    name = path[-1]
    if name == "wq":
        return w.T.reshape(d, cfg.n_heads, hd)
    if name in ("wk", "wv"):
        return w.T.reshape(d, cfg.n_kv_heads, hd)
    if name == "wo":
        return w.T.reshape(cfg.n_heads, hd, d)
    if name in ("w_gate", "w_up", "w_down", "lm_head", "w_router"):
        return w.T
    return w  # embedding [V, D] and norm scales keep their layout


def _to_hf(path: tuple[str, ...], w: np.ndarray) -> np.ndarray:
    name = path[-1]
    if name in ("wq", "wk", "wv"):
        return w.reshape(w.shape[0], -1).T
    if name == "wo":
        return w.reshape(-1, w.shape[-1]).T
    if name in ("w_gate", "w_up", "w_down", "lm_head", "w_router"):
        return w.T
    return w


class _SafetensorsDir:
    """Tensor-by-name access across one or more safetensors files, one tensor in memory at a time."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise HFConversionError(f"{path}: no *.safetensors files")
            weight_map = {}
            for f in files:
                with safe_open(str(path / f), framework="numpy") as h:
                    weight_map.update({k: f for k in h.keys()})
        self._handles = {f: safe_open(str(path / f), framework="numpy") for f in files}
        self.weight_map = weight_map
        self.path = path

    def get(self, name: str) -> np.ndarray:
        if name not in self.weight_map:
            raise HFConversionError(f"{self.path}: tensor {name!r} is missing")
        return self._handles[self.weight_map[name]].get_tensor(name)


def _shape_of(path: tuple[str, ...], cfg: ModelConfig) -> tuple[int, ...]:
    d, hd = cfg.d_model, cfg.resolved_head_dim
    f = cfg.moe.mlp_dim(cfg) if cfg.moe is not None else cfg.mlp_dim
    return {
        "w_router": (d, cfg.moe.num_experts if cfg.moe is not None else 0),
        "embedding": (cfg.vocab_size, d),
        "lm_head": (d, cfg.vocab_size),
        "scale": (d,),
        "wq": (d, cfg.n_heads, hd),
        "wk": (d, cfg.n_kv_heads, hd),
        "wv": (d, cfg.n_kv_heads, hd),
        "wo": (cfg.n_heads, hd, d),
        "w_gate": (d, f),
        "w_up": (d, f),
        "w_down": (f, d),
    }[path[-1]]


def load_hf_params(path: str | Path, cfg: ModelConfig, dtype=np.float32) -> dict:
    """Our nested param dict (numpy, layers stacked) from an HF directory."""
    reader = _SafetensorsDir(Path(path))
    params: dict = {}
    stacked = {1: (cfg.n_layers,), 2: (cfg.n_layers, cfg.moe.num_experts if cfg.moe else 0)}
    for ours, index, theirs in _hf_names(cfg):
        w = _to_ours(ours, np.asarray(reader.get(theirs), dtype=np.float32), cfg)
        expected = _shape_of(ours, cfg)
        if w.shape != expected:
            raise HFConversionError(
                f"tensor {theirs!r}: shape {w.shape} after conversion, expected {expected} from config.json"
            )
        node = params
        for key in ours[:-1]:
            node = node.setdefault(key, {})
        if not index:
            node[ours[-1]] = w.astype(dtype)
        else:
            if ours[-1] not in node:
                node[ours[-1]] = np.empty((*stacked[len(index)], *expected), dtype)
            node[ours[-1]][index] = w
    return params


def read_hf_config(path: str | Path) -> dict:
    p = Path(path) / "config.json"
    if not p.is_file():
        raise HFConversionError(f"{path}: config.json not found")
    return json.loads(p.read_text())


def from_hf(path: str | Path, **config_overrides):
    """A ready `Transformer` from a local HF checkpoint directory; `model.cfg` is its config.

    `config_overrides` set non-architectural ModelConfig fields (e.g.
    compute_dtype="bfloat16", attention_impl="xla").
    """
    cfg = config_from_hf(read_hf_config(path), **config_overrides)
    params = load_hf_params(path, cfg)
    graphdef, abstract = abstract_model(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    params = jax.tree.map(lambda x: jnp.asarray(x, cfg.param_dtype), params)
    return merge(graphdef, abstract, params)


def params_to_hf_tensors(params: dict, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 numpy tensor) pairs, one at a time."""
    for ours, index, theirs in _hf_names(cfg):
        node = params
        for key in ours:
            node = node[key]
        w = np.asarray(node[index] if index else node, dtype=np.float32)
        yield theirs, np.ascontiguousarray(_to_hf(ours, w))


def write_hf_dir(
    tensors: Iterator[tuple[str, np.ndarray]],
    cfg: ModelConfig,
    path: str | Path,
    *,
    architecture: str | None = None,
    max_shard_bytes: int = 2 * 2**30,
) -> Path:
    """Write (name, tensor) pairs as HF safetensors shards plus `model.safetensors.index.json`
    and `config.json`. Holds at most one shard in memory, so a 7B model converts
    without a second full copy."""
    from safetensors.numpy import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    current: dict[str, np.ndarray] = {}
    size = 0
    written: list[tuple[str, list[str]]] = []

    def flush():
        nonlocal current, size
        if current:
            name = f"model-{len(written) + 1:05d}.safetensors"
            save_file(current, str(out / name), metadata={"format": "pt"})
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
    (out / "config.json").write_text(json.dumps(hf_config(cfg, architecture), indent=2) + "\n")
    return out


def to_hf(
    model, path: str | Path, *, architecture: str | None = None, max_shard_bytes: int = 2 * 2**30
) -> Path:
    """Write `model` as an HF checkpoint directory (config.json + f32 safetensors shards)."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return write_hf_dir(
        params_to_hf_tensors(params, model.cfg),
        model.cfg,
        path,
        architecture=architecture,
        max_shard_bytes=max_shard_bytes,
    )

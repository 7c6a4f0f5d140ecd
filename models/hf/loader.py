"""Reading an HF directory: `_SafetensorsDir` (tensors by name across the shards, one in memory
at a time, block FP8 dequantized), `read_hf_config`, `config_from_hf_dir` (config.json with the
DeepSeek-V3 prediction modules the directory holds), `param_sources` (every parameter's shape
and slice readers, from the headers alone), `load_hf_params` and `from_hf` (a ready
`Transformer`)."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.models.config import ModelConfig, MTPConfig
from jaxtrain.models.hf import fp8 as hf_fp8
from jaxtrain.models.hf import qwen3_5 as hf_qwen3_5
from jaxtrain.models.hf.common import HFConversionError
from jaxtrain.models.hf.deepseek import _DEEPSEEK
from jaxtrain.models.hf.families import _fp8_block, config_from_hf
from jaxtrain.models.hf.gpt_oss import _gpt_oss_expert_sources, _has_gpt_oss_experts
from jaxtrain.models.hf.names import _hf_names, _hf_shape, _shape_of, _to_ours
from jaxtrain.models.params import abstract_model, merge
from jaxtrain.models.transformer import Transformer


def mtp_depth_in_dir(path: str | Path, hf: dict) -> int:
    """How many of DeepSeek-V3's prediction modules the directory holds: config.json's
    num_nextn_predict_layers when every one of their layers (index num_hidden_layers + i) has
    its `eh_proj`, else 0 (transformers drops them when it saves a model, config unchanged)."""
    n = hf.get("num_nextn_predict_layers") or 0
    archs = hf.get("architectures") or [None]
    if not n or archs[0] != _DEEPSEEK:
        return 0
    names = _SafetensorsDir(Path(path)).weight_map
    layers = hf["num_hidden_layers"]
    return n if all(f"model.layers.{layers + i}.eh_proj.weight" in names for i in range(n)) else 0


def config_from_hf_dir(path: str | Path, **overrides) -> ModelConfig:
    """`config_from_hf` of the directory's config.json, with model.mtp set to the prediction
    modules whose weights it holds (`mtp_depth_in_dir`; none: null)."""
    hf = read_hf_config(path)
    depth = mtp_depth_in_dir(path, hf)
    mtp = MTPConfig(depth=depth) if depth else None
    return config_from_hf(hf, **{"mtp": mtp, **overrides})


class _SafetensorsDir:
    """Tensor-by-name access across one or more safetensors files, one tensor in memory at a
    time (models/safetensors_io.py: read, not memory-mapped). Block-FP8 weights (e4m3 with a
    `<name>_scale_inv`, config.json's quantization_config) come back dequantized, float32."""

    def __init__(self, path: Path):
        from jaxtrain.models.safetensors_io import SafetensorsFile

        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            self._files = {f: SafetensorsFile(path / f) for f in files}
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise HFConversionError(f"{path}: no *.safetensors files")
            self._files = {f: SafetensorsFile(path / f) for f in files}
            weight_map = {k: f for f, h in self._files.items() for k in h.keys()}
        self.weight_map = weight_map
        self.path = path
        config = path / "config.json"
        self.fp8_block = _fp8_block(json.loads(config.read_text())) if config.is_file() else None

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        """From the headers alone: `name` is there with `shape` (a block-FP8 one with its
        scale grid), so a converter fails before it writes anything."""
        if name not in self.weight_map:
            raise HFConversionError(f"{self.path}: tensor {name!r} is missing")
        f = self._files[self.weight_map[name]]
        if f.shape(name) != tuple(shape):
            raise HFConversionError(
                f"tensor {name!r}: shape {f.shape(name)}, expected {tuple(shape)} from config.json"
            )
        scale = name + hf_fp8.SCALE_SUFFIX
        if f.dtype(name).name.startswith("float8") and self.fp8_block and scale in self.weight_map:
            have, want = self._files[self.weight_map[scale]].shape(scale), hf_fp8.grid(shape, self.fp8_block)
            if have != want:
                raise HFConversionError(
                    f"{self.path}: tensor {scale!r}: shape {have}, expected {want} "
                    f"(weight_block_size {list(self.fp8_block)} over {list(shape)})"
                )

    def raw(self, name: str) -> np.ndarray:
        """The tensor `name` as stored (no dequantization): what a converter carries unread."""
        return self._files[self.weight_map[name]].read(name)

    def get(self, name: str) -> np.ndarray:
        if name not in self.weight_map:
            raise HFConversionError(f"{self.path}: tensor {name!r} is missing")
        w = self._files[self.weight_map[name]].read(name)
        scale = name + hf_fp8.SCALE_SUFFIX
        if not w.dtype.name.startswith("float8"):
            return w
        if scale not in self.weight_map or self.fp8_block is None:
            raise HFConversionError(
                f"{self.path}: tensor {name!r} is {w.dtype} without {scale} and config.json "
                "quantization_config (quant_method fp8, weight_block_size); expected block FP8"
            )
        try:
            scale_inv = self._files[self.weight_map[scale]].read(scale)
            return hf_fp8.dequantize_blocks(w, scale_inv, self.fp8_block, name)
        except hf_fp8.QuantizationError as e:
            raise HFConversionError(f"{self.path}: {e}") from None


@dataclasses.dataclass(frozen=True)
class ParamSource:
    """One of our parameters as an HF directory holds it: its shape (layers and experts
    stacked) and its slices, each (index into the stacked array, () when unstacked; a function
    that reads, dequantizes and converts that slice's HF tensors, checking the shape)."""

    shape: tuple[int, ...]
    slices: tuple[tuple[tuple[int, ...], Callable[[], np.ndarray]], ...]


def param_sources(path: str | Path, cfg: ModelConfig) -> dict[tuple[str, ...], ParamSource]:
    """Every parameter's `ParamSource`, keyed by its path in our nested params; nothing is read
    yet (only the safetensors headers), so a converter can hold one slice at a time."""
    reader = _SafetensorsDir(Path(path))
    config = Path(path) / "config.json"
    arch = (json.loads(config.read_text()).get("architectures") or [None])[0] if config.is_file() else None
    model = next(
        (p for p in hf_qwen3_5.TEXT_PREFIXES[::-1] if f"{p}embed_tokens.weight" in reader.weight_map),
        "model.",
    )
    # the stacked layers (or pattern groups) of each stack, and the experts of MoE layers
    n_dense = cfg.n_layers if cfg.moe is None else cfg.moe.first_dense_layers
    layers = {"blocks": n_dense // cfg.layers_per_group}
    if cfg.moe is not None:
        layers["moe_blocks"] = cfg.moe.num_moe_layers(cfg) // cfg.layers_per_group
    if cfg.mtp is not None:
        layers["mtp"] = cfg.mtp.depth
    experts = (cfg.moe.num_experts,) if cfg.moe is not None else ()
    shapes: dict = {}
    parts: dict = {}
    for ours, index, theirs in _hf_names(cfg, model, arch):
        expected = _shape_of(ours, cfg)
        # HF's shape of `expected`: `_to_hf` of a zero-stride stand-in (no memory)
        reader.check(theirs, _hf_shape(ours, expected, cfg, theirs))
        stacked = () if not index else (layers[ours[0]], *(experts if len(index) == 2 else ()))
        shapes.setdefault(ours, (*stacked, *expected))
        read = functools.partial(_read_converted, reader, ours, theirs, cfg, expected)
        parts.setdefault(ours, []).append((index, read))
    if _has_gpt_oss_experts(cfg):
        _gpt_oss_expert_sources(reader, cfg, shapes, parts)
    return {p: ParamSource(shapes[p], tuple(parts[p])) for p in parts}


def _read_converted(reader, ours: tuple[str, ...], theirs: str, cfg: ModelConfig, expected) -> np.ndarray:
    w = _to_ours(ours, np.asarray(reader.get(theirs), dtype=np.float32), cfg)
    if w.shape != expected:
        raise HFConversionError(
            f"tensor {theirs!r}: shape {w.shape} after conversion, expected {expected} from config.json"
        )
    return w


def load_hf_params(path: str | Path, cfg: ModelConfig, dtype=np.float32) -> dict:
    """Our nested param dict (numpy, layers stacked) from an HF directory: one copy of the
    model plus one tensor (`jaxtrain convert hf-to-ckpt` streams instead: interchange/convert.py)."""
    params: dict = {}
    for ours, source in param_sources(path, cfg).items():
        node = params
        for key in ours[:-1]:
            node = node.setdefault(key, {})
        node[ours[-1]] = np.empty(source.shape, dtype)
        for index, read in source.slices:
            node[ours[-1]][index] = read()
    return params


def read_hf_config(path: str | Path) -> dict:
    p = Path(path) / "config.json"
    if not p.is_file():
        raise HFConversionError(f"{path}: config.json not found")
    return json.loads(p.read_text())


def from_hf(path: str | Path, **config_overrides):
    """A ready `Transformer` from a local HF checkpoint directory; `model.cfg` is its config.

    `config_overrides` set non-architectural ModelConfig fields (e.g.
    compute_dtype="bfloat16", attention_impl="xla"). A DeepSeek-V3 directory's multi-token
    prediction modules are read when it holds them (`config_from_hf_dir`).
    """
    cfg = config_from_hf_dir(path, **config_overrides)
    params = load_hf_params(path, cfg)
    graphdef, abstract = abstract_model(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    params = jax.tree.map(lambda x: jnp.asarray(x, cfg.param_dtype), params)
    return merge(graphdef, abstract, params)

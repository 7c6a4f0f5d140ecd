"""Weights in and out: `jaxtrain convert hf-to-ckpt | ckpt-to-hf` and `train.init_from`.

A converted checkpoint is a directory holding
  model.yaml   the ModelConfig (architecture only; dtypes and impls are the run's choice)
  params/      the parameter tree, an Orbax (OCDBT) PyTree, float32
Conversion streams: HF tensors are read one at a time into the stacked
layout (one copy of the model in memory), and written back one safetensors
shard at a time.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import yaml

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf import (
    HFConversionError,
    config_from_hf,
    load_hf_params,
    params_to_hf_tensors,
    read_hf_config,
    write_hf_dir,
)

# Fields that describe how a model runs, not what it is: a run may change them freely.
RUNTIME_FIELDS = (
    "param_dtype",
    "compute_dtype",
    "remat",
    "scan_layers",
    "attention_impl",
    "context_impl",
    "init_std",
)


def architecture_of(cfg: ModelConfig) -> dict:
    d = dataclasses.asdict(cfg)
    return {k: v for k, v in d.items() if k not in RUNTIME_FIELDS}


def read_model_config(ckpt_dir: str | Path) -> ModelConfig:
    path = Path(ckpt_dir) / "model.yaml"
    if not path.is_file():
        raise HFConversionError(
            f"{ckpt_dir}: model.yaml not found (not a converted checkpoint; "
            f"make one with `jaxtrain convert hf-to-ckpt`)"
        )
    from jaxtrain.config import _build  # the typed loader, for nested sections (e.g. moe)

    return _build(ModelConfig, yaml.safe_load(path.read_text()), prefix="model.")


def hf_to_ckpt(hf_dir: str | Path, out_dir: str | Path) -> ModelConfig:
    cfg = config_from_hf(read_hf_config(hf_dir))
    params = load_hf_params(hf_dir, cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((out / "params").absolute(), params, force=True)
    checkpointer.wait_until_finished()
    (out / "model.yaml").write_text(yaml.safe_dump(architecture_of(cfg), sort_keys=False))
    return cfg


def _restore_numpy(ckpt_dir: Path) -> dict:
    path = (ckpt_dir / "params").absolute()
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(path).item_metadata.tree
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))


def ckpt_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    architecture: str | None = None,
    max_shard_bytes: int = 2 * 2**30,
) -> Path:
    cfg = read_model_config(ckpt_dir)
    params = _restore_numpy(Path(ckpt_dir))
    return write_hf_dir(
        params_to_hf_tensors(params, cfg),
        cfg,
        out_dir,
        architecture=architecture,
        max_shard_bytes=max_shard_bytes,
    )


def load_params(ckpt_dir: str | Path, model_cfg: ModelConfig, abstract_params: dict) -> dict:
    """Restore converted weights straight into the run's shardings and dtypes.

    `abstract_params` is a tree of ShapeDtypeStructs carrying NamedShardings (the
    train program's). Raises HFConversionError naming the first field or parameter
    that does not match the run's model.
    """
    saved = architecture_of(read_model_config(ckpt_dir))
    wanted = architecture_of(model_cfg)
    for key in wanted:
        if saved.get(key) != wanted[key]:
            raise HFConversionError(
                f"train.init_from={ckpt_dir}: model.{key}={wanted[key]!r} but the "
                f"checkpoint has {saved.get(key)!r}"
            )
    path = (Path(ckpt_dir) / "params").absolute()
    stored = ocp.PyTreeCheckpointer().metadata(path).item_metadata.tree
    if jax.tree.structure(stored) != jax.tree.structure(abstract_params):
        raise HFConversionError(
            f"train.init_from={ckpt_dir}: the checkpoint's parameter tree does not match the model's"
        )
    for (p, want), have in zip(
        jax.tree_util.tree_flatten_with_path(abstract_params)[0], jax.tree.leaves(stored)
    ):
        if tuple(want.shape) != tuple(have.shape):
            raise HFConversionError(
                f"train.init_from={ckpt_dir}: parameter {jax.tree_util.keystr(p)} "
                f"has shape {tuple(have.shape)}, the model expects {tuple(want.shape)}"
            )
    # Read as stored (float32), then cast in the target sharding: no host-side full copy.
    stored_dtype = jax.tree.map(
        lambda a, m: jax.ShapeDtypeStruct(a.shape, m.dtype, sharding=a.sharding), abstract_params, stored
    )
    params = ocp.StandardCheckpointer().restore(path, stored_dtype)
    return jax.tree.map(lambda x, a: x.astype(a.dtype), params, abstract_params)

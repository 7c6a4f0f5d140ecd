"""Weights in and out: `jaxtrain convert hf-to-ckpt | ckpt-to-hf` and `train.init_from`.

A converted checkpoint is a directory holding
  model.yaml      the ModelConfig (architecture only; dtypes and impls are the run's choice)
  params/         the parameter tree, an Orbax (OCDBT) PyTree, float32
  tokenizer.json  the HF directory's tokenizer, when it had one (`jaxtrain generate`)
  carried/        what is not the model but must go back out with it: a Qwen3.5
                  ConditionalGeneration's vision tower and MTP layers as stored, and its
                  config.json (models/hf/qwen3_5.py); `ckpt-to-hf` writes the wrapper again
`ckpt-to-hf` and `train.init_from` also take a training run's checkpoints (a step
directory, a checkpoint.dir or an output_dir: `resolve_checkpoint`); the model
config then comes from the checkpoint's saved config, and only the parameters
are read (not the optimizer state).
Conversion streams: `hf-to-ckpt` reads one HF tensor at a time (block-FP8 ones
dequantized) and writes it into its slice of the stacked arrays (interchange/stream_ckpt.py),
so it needs host memory for a few tensors, not the model; `ckpt-to-hf` writes one
safetensors shard at a time, in float32, bfloat16 or DeepSeek's block FP8 (`--dtype`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import yaml
from etils import epath

from jaxtrain.config import ConfigError, _build
from jaxtrain.data import storage
from jaxtrain.interchange.stream_ckpt import save_streamed
from jaxtrain.models import lora
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf import (
    HFConversionError,
    _SafetensorsDir,
    config_from_hf_dir,
    hf_config,
    param_sources,
    params_to_hf_tensors,
    write_hf_dir,
)
from jaxtrain.models.hf import fp8 as hf_fp8
from jaxtrain.models.hf import qwen3_5 as hf_qwen3_5
from jaxtrain.recovery.checkpoint import Checkpointer

# Fields that describe how a model runs, not what it is: a run may change them freely.
RUNTIME_FIELDS = (
    "param_dtype",
    "compute_dtype",
    "remat",
    "remat_custom",
    "fp8",
    "fp8_amax_history",
    "scan_layers",
    "compact_grads",
    "attention_impl",
    "gpu_flash_kernel",
    "cpu_tuning",
    "context_impl",
    "init_std",
    "lora",  # adapters on the weights, not the weights (a LoRA run's base is a plain model)
)
# Inside model.moe: how the layer runs on a backend (planning/resolve.py), not what it holds.
MOE_RUNTIME_FIELDS = ("exchange", "grouped_matmul", "dispatch_per_shard")
# Inside model.linear_attention: which implementation runs the delta rule.
LINEAR_ATTENTION_RUNTIME_FIELDS = ("impl",)


def _path(path: str | os.PathLike) -> epath.Path:
    """A local path made absolute, or a URL (`gs://bucket/x`, any `etils.epath` scheme) as given."""
    if storage.is_local(path):
        return epath.Path(os.path.abspath(storage.as_path(path)))
    return storage.as_path(path)


def _copy_file(src: epath.Path, dst: epath.Path) -> None:
    """Stream one file across file systems (local <-> gs://), 16 MiB at a time."""
    with src.open("rb") as fin, dst.open("wb") as fout:
        shutil.copyfileobj(fin, fout, length=16 * 2**20)


@contextlib.contextmanager
def _local_dir(path: str | os.PathLike):
    """`path` itself when local; a remote directory's files copied to a temporary local one
    (safetensors are memory-mapped, which needs local files), removed afterwards."""
    if storage.is_local(path):
        yield path
        return
    src = _path(path)
    if not src.is_dir():
        raise HFConversionError(f"{path}: no such directory")
    with tempfile.TemporaryDirectory(prefix="jaxtrain-convert-") as tmp:
        for f in src.iterdir():
            if not f.is_dir():
                _copy_file(f, epath.Path(tmp) / f.name)
        yield tmp


def architecture_of(cfg: ModelConfig) -> dict:
    """The model config's fields that weights fix (runtime and backend choices left out)."""
    d = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RUNTIME_FIELDS}
    if d.get("moe") is not None:
        d["moe"] = {k: v for k, v in d["moe"].items() if k not in MOE_RUNTIME_FIELDS}
    if d.get("linear_attention") is not None:
        d["linear_attention"] = {
            k: v for k, v in d["linear_attention"].items() if k not in LINEAR_ATTENTION_RUNTIME_FIELDS
        }
    return d


def read_model_config(ckpt_dir: str | Path) -> ModelConfig:
    path = _path(ckpt_dir) / "model.yaml"
    if not path.is_file():
        raise HFConversionError(
            f"{ckpt_dir}: model.yaml not found (not a converted checkpoint; "
            f"make one with `jaxtrain convert hf-to-ckpt`)"
        )
    return _build(ModelConfig, yaml.safe_load(path.read_text()), prefix="model.")


def check_destination(out_dir: str | Path, *, force: bool = False) -> None:
    """Refuse to write into a folder that already holds something (a converted model, a
    user's config.json) unless `force`; a file where the folder should be is always refused.
    Checked before any weights are read."""
    out = _path(out_dir)
    if out.exists() and not out.is_dir():
        raise HFConversionError(f"{out_dir}: is a file; expected an output folder")
    if force or not out.exists():
        return
    held = sorted(p.name for p in out.iterdir())
    if held:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise HFConversionError(
            f"{out_dir}: not empty (holds {shown}); expected a new or empty folder, "
            "or pass --force to write into it"
        )


def hf_to_ckpt(hf_dir: str | Path, out_dir: str | Path, *, force: bool = False) -> ModelConfig:
    """HF_DIR -> OUT_DIR (model.yaml + params/); either may be a URL (gs://...): a remote
    HF_DIR is copied to a local temporary directory first. A non-empty OUT_DIR is refused
    unless `force`."""
    check_destination(out_dir, force=force)
    with _local_dir(hf_dir) as local_hf:
        cfg = config_from_hf_dir(local_hf)  # with the MTP modules it holds (DeepSeek-V3)
        sources = param_sources(local_hf, cfg)  # headers only: nothing read yet
        out = _path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_streamed(out / "params", sources)  # slice by slice (interchange/stream_ckpt.py)
        (out / "model.yaml").write_text(yaml.safe_dump(architecture_of(cfg), sort_keys=False))
        tokenizer = epath.Path(local_hf) / "tokenizer.json"
        if tokenizer.is_file():  # `jaxtrain generate OUT_DIR` reads it
            _copy_file(tokenizer, out / "tokenizer.json")
        _carry(Path(local_hf), out)
    return cfg


CARRIED = "carried"


def _carry(hf_dir: Path, out: epath.Path) -> None:
    """The HF directory's tensors that are not the model (models/hf/qwen3_5.py carried_names)
    into OUT/carried/, as stored, with its config.json; nothing when there are none."""
    from jaxtrain.models.hf import read_hf_config
    from jaxtrain.models.safetensors_io import write_file

    config = read_hf_config(hf_dir)
    reader = _SafetensorsDir(hf_dir)
    names = hf_qwen3_5.carried_names((config.get("architectures") or [None])[0], reader.weight_map)
    if not names:
        return
    with tempfile.TemporaryDirectory(prefix="jaxtrain-carried-") as tmp:
        tensors = ((name, reader.raw(name)) for name in names)
        write_file(Path(tmp) / "model.safetensors", tensors, metadata={"format": "pt"})
        (out / CARRIED).mkdir(parents=True, exist_ok=True)
        _copy_file(epath.Path(tmp) / "model.safetensors", out / CARRIED / "model.safetensors")
    (out / CARRIED / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _carried_dir(src: CheckpointSource) -> epath.Path | None:
    """carried/ of a converted checkpoint, or of the one a training run started from."""
    if src.step is None:
        where = src.path
    else:
        try:
            base = _init_from(src)
        except HFConversionError:  # no readable meta: nothing carried
            return None
        if not base:
            return None
        where = _path(base)
    carried = where / CARRIED
    return carried if (carried / "config.json").is_file() else None


@dataclasses.dataclass
class CheckpointSource:
    """Weights to read (see `resolve_checkpoint`): a converted checkpoint `path` (step None),
    or step `step` of the training checkpoint directory `path` (a checkpoint.dir), read with
    a read-only Checkpointer (parameters only; never the optimizer state). Close it after use."""

    path: epath.Path  # absolute, or a URL
    step: int | None = None
    _reader: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        return str(self.path if self.step is None else self.path / str(self.step))

    @property
    def reader(self):
        if self._reader is None:
            self._reader = Checkpointer(self.path, read_only=True)
        return self._reader

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def model_config(self) -> ModelConfig:
        """model.yaml, or the model section of the config the training run saved with the step."""
        if self.step is None:
            return read_model_config(self.path)
        try:
            model = self.reader.read_meta(self.step)["config"]["model"]
        except Exception as e:  # noqa: BLE001 - a missing/unreadable meta item surfaces as many types
            raise HFConversionError(
                f"checkpoint {self}: its saved config is unreadable ({type(e).__name__}: {e})"
            ) from e
        try:
            return _build(ModelConfig, model, prefix="model.")
        except ConfigError as e:
            raise HFConversionError(f"checkpoint {self}: its saved model config: {e}") from e

    def param_metadata(self) -> dict:
        """The stored parameter tree: Orbax array metadata (shape, dtype), nothing read."""
        if self.step is None:
            return ocp.PyTreeCheckpointer().metadata(_path(self.path / "params")).item_metadata.tree
        return self.reader.param_metadata(self.step)

    def restore_params(self, target: dict | None = None) -> dict:
        """The parameters, into `target`'s ShapeDtypeStructs (dtypes, shardings), or with
        None as host numpy arrays in the stored dtypes (one copy, no device memory)."""
        if self.step is None:
            path = _path(self.path / "params")
            if target is not None:
                return ocp.StandardCheckpointer().restore(path, target)
            checkpointer = ocp.PyTreeCheckpointer()
            tree = checkpointer.metadata(path).item_metadata.tree
            restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
            return checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
        try:
            return self.reader.restore_params(self.step, target)
        except Exception as e:  # noqa: BLE001 - truncated/missing files surface as many types
            detail = str(e).splitlines()[0][:300] if str(e) else ""
            raise HFConversionError(
                f"checkpoint {self}: parameters unreadable ({type(e).__name__}: {detail}); "
                "give an older step directory instead"
            ) from e


EXPECTED_SOURCES = (
    "expected a converted checkpoint (model.yaml + params/), a training checkpoint step "
    "directory ({checkpoint.dir}/{step}), a checkpoint.dir holding step directories, or a "
    "run's output_dir (config.yaml + checkpoints)"
)


def _has_step_dirs(path: str | os.PathLike) -> bool:
    """Whether `path` has step-named subdirectories (Orbax's tmp ones and `*.unreadable` are not)."""
    path = _path(path)
    return path.is_dir() and any(c.name.isdigit() and c.is_dir() for c in path.iterdir())


def _newest_step(ckpt_dir: Path, what: str) -> CheckpointSource:
    """The newest complete step of a checkpoint.dir (as Orbax and the trainer list them)."""
    source = CheckpointSource(_path(ckpt_dir))
    steps = source.reader.steps() if _has_step_dirs(ckpt_dir) else []
    source.close()
    if not steps:
        raise HFConversionError(f"{what}: {ckpt_dir} holds no complete training checkpoint")
    return dataclasses.replace(source, step=steps[-1])


def resolve_checkpoint(path: str | Path) -> CheckpointSource:
    """The checkpoint that `ckpt-to-hf SOURCE` / `train.init_from=SOURCE` names. SOURCE is
    (a) a converted checkpoint: model.yaml + params/ (`jaxtrain convert hf-to-ckpt`);
    (b) a training checkpoint step directory `{checkpoint.dir}/{step}` (it holds state/);
    (c) a checkpoint.dir: its newest complete step (Orbax's `*.orbax-checkpoint-tmp*`
        directories and `*.unreadable` ones set aside by a resume are not steps);
    (d) a run's output_dir: the checkpoint.dir of its config.yaml (default
        output_dir/checkpoints; a relative one is taken from the current directory, as
        the run did), newest complete step.
    Anything else raises HFConversionError (the CLI's exit 2) naming the path and what
    was expected. Nothing is written or cleaned up: a run may still be training there.
    Any of them may be a URL (gs://bucket/run, any `etils.epath` scheme)."""
    p = _path(path)
    if (p / "model.yaml").is_file():
        return CheckpointSource(p)
    if p.name.isdigit() and (p / "state").is_dir():
        return CheckpointSource(p.parent, int(p.name))
    if _has_step_dirs(p):
        return _newest_step(p, str(path))
    if (p / "config.yaml").is_file() or (p / "checkpoints").is_dir():
        ckpt_dir = None
        if (p / "config.yaml").is_file():
            run_cfg = yaml.safe_load((p / "config.yaml").read_text())
            section = run_cfg.get("checkpoint") if isinstance(run_cfg, dict) else None
            ckpt_dir = section.get("dir") if isinstance(section, dict) else None
        return _newest_step(
            _path(ckpt_dir) if ckpt_dir else p / "checkpoints", f"{path} (a run's output_dir)"
        )
    raise HFConversionError(f"{path}: not a checkpoint; {EXPECTED_SOURCES}")


def _init_from(src: CheckpointSource) -> str | None:
    """The train.init_from a training checkpoint's run started from (None: a random init)."""
    try:
        return src.reader.read_meta(src.step)["config"]["train"].get("init_from")
    except Exception as e:  # noqa: BLE001 - a missing/unreadable meta item surfaces as many types
        raise HFConversionError(
            f"checkpoint {src}: its saved config is unreadable ({type(e).__name__})"
        ) from e


def lora_base_of(src: CheckpointSource) -> str:
    """The train.init_from a LoRA run's checkpoint was trained on (its base's weights)."""
    base = _init_from(src)
    if not base:
        raise HFConversionError(
            f"checkpoint {src}: a LoRA run without train.init_from (a random base); only adapters on "
            "a base read from train.init_from can be exported"
        )
    return base


def ckpt_to_hf(
    source: str | Path,
    out_dir: str | Path,
    *,
    architecture: str | None = None,
    max_shard_bytes: int = 2 * 2**30,
    force: bool = False,
    adapter: bool = False,
    dtype: str = "float32",
    fp8_block: tuple[int, int] = hf_fp8.DEFAULT_BLOCK,
) -> Path:
    """Write `source` (see `resolve_checkpoint`: a converted or a training checkpoint) as an
    HF directory. Holds one float32-or-stored-dtype copy of the parameters on the host
    (a training checkpoint's optimizer state is not read) plus one output shard. A remote
    OUT_DIR (gs://...) is written locally to a temporary directory, then copied file by file.
    A non-empty OUT_DIR (a user's config.json, an earlier export) is refused unless `force`.

    A LoRA run (model.lora): with `adapter`, its adapters as a PEFT adapter directory
    (interchange/peft.py) for the base it was trained on; without, the merged model
    (W + alpha / r A B for every adapted weight, its base read from the run's train.init_from).

    `dtype`: float32 (default), bfloat16, or fp8-block: DeepSeek-V3's published layout (its
    projections e4m3 with a float32 `weight_scale_inv` per `fp8_block` block, DeepSeek's rule
    amax / 448: models/hf/fp8.py; the rest bfloat16), for latent-attention models only."""
    if dtype not in hf_fp8.EXPORT_DTYPES:
        raise HFConversionError(f"--dtype {dtype!r}: expected one of {hf_fp8.EXPORT_DTYPES}")
    if adapter and dtype != "float32":
        raise HFConversionError(f"--dtype {dtype}: --adapter writes float32 adapters; expected float32")
    check_destination(out_dir, force=force)
    with contextlib.closing(resolve_checkpoint(source)) as src:
        cfg = src.model_config()
        if dtype == "fp8-block" and cfg.mla is None:
            raise HFConversionError(
                "--dtype fp8-block writes DeepSeek-V3's block-FP8 layout; the model has no model.mla "
                "(expected a DeepseekV3ForCausalLM model, or --dtype float32 / bfloat16)"
            )
        if adapter and cfg.lora is None:
            raise HFConversionError(f"--adapter: {source} is not a LoRA run (its model.lora is null)")
        params = src.restore_params()
        base_dir = lora_base_of(src) if cfg.lora is not None else None
        carried = _carried_dir(src) if architecture in (None, *hf_qwen3_5.CONDITIONAL_GENERATIONS) else None
    if cfg.lora is not None:
        if adapter:
            from jaxtrain.interchange.peft import write_adapter

            if not storage.is_local(out_dir):
                raise HFConversionError(f"--adapter: {out_dir}: expected a local output folder")
            return write_adapter(params, cfg, out_dir, base=base_dir)
        with contextlib.closing(resolve_checkpoint(base_dir)) as base_src:
            base = base_src.restore_params()
        params = lora.merged(lora.join(base, params), cfg)
        cfg = dataclasses.replace(cfg, lora=None)

    def write(directory):
        tensors = params_to_hf_tensors(params, cfg, architecture)
        config = None
        if carried is not None:  # the wrapper again: the text model renamed, the rest as it came
            config = hf_qwen3_5.wrapper_config(
                json.loads((carried / "config.json").read_text()),
                hf_config(cfg, hf_qwen3_5.causal_lm_for(cfg)),
            )
            tensors = itertools.chain(
                ((hf_qwen3_5.wrapper_name(n), t) for n, t in tensors), _carried_tensors(carried)
            )
        return write_hf_dir(
            hf_fp8.export_tensors(tensors, dtype, fp8_block),
            cfg,
            directory,
            architecture=architecture,
            max_shard_bytes=max_shard_bytes,
            config_updates=hf_fp8.export_config(dtype, fp8_block),
            config=config,
        )

    if storage.is_local(out_dir):
        return write(out_dir)
    out = _path(out_dir)
    with tempfile.TemporaryDirectory(prefix="jaxtrain-convert-") as tmp:
        write(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for f in sorted(epath.Path(tmp).iterdir()):
            _copy_file(f, out / f.name)
    return out


def _carried_tensors(carried: epath.Path):
    from jaxtrain.models.safetensors_io import SafetensorsFile

    with _local_dir(carried) as local:
        f = SafetensorsFile(Path(local) / "model.safetensors")
        for name in f.keys():
            yield name, f.read(name)


def load_params(
    ckpt_dir: str | Path | CheckpointSource,
    model_cfg: ModelConfig,
    abstract_params: dict,
    *,
    what: str | None = None,
) -> dict:
    """Restore converted weights, or a training checkpoint's parameters (any source
    `resolve_checkpoint` accepts, or a resolved CheckpointSource), straight into the
    run's shardings and dtypes.

    `abstract_params` is a tree of ShapeDtypeStructs carrying NamedShardings (the
    train program's). Raises HFConversionError naming the first field or parameter
    that does not match the run's model; messages start with `what` (default
    `train.init_from=CKPT_DIR`).
    """
    label = what or f"train.init_from={ckpt_dir}"
    resolved = ckpt_dir if isinstance(ckpt_dir, CheckpointSource) else resolve_checkpoint(ckpt_dir)
    with contextlib.closing(resolved) as src:
        saved = architecture_of(src.model_config())
        wanted = architecture_of(model_cfg)
        for key in wanted:
            if saved.get(key) != wanted[key]:
                raise HFConversionError(
                    f"{label}: model.{key}={wanted[key]!r} but the checkpoint has {saved.get(key)!r}"
                )
        stored = src.param_metadata()
        if jax.tree.structure(stored) != jax.tree.structure(abstract_params):
            raise HFConversionError(f"{label}: the checkpoint's parameter tree does not match the model's")
        for (p, want), have in zip(
            jax.tree_util.tree_flatten_with_path(abstract_params)[0], jax.tree.leaves(stored)
        ):
            if tuple(want.shape) != tuple(have.shape):
                raise HFConversionError(
                    f"{label}: parameter {jax.tree_util.keystr(p)} "
                    f"has shape {tuple(have.shape)}, the model expects {tuple(want.shape)}"
                )
        # Read as stored (float32), then cast in the target sharding: no host-side full copy.
        stored_dtype = jax.tree.map(
            lambda a, m: jax.ShapeDtypeStruct(a.shape, m.dtype, sharding=a.sharding), abstract_params, stored
        )
        params = src.restore_params(stored_dtype)
    return jax.tree.map(lambda x, a: x.astype(a.dtype), params, abstract_params)

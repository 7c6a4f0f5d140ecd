"""`jaxtrain compile --mode decode`: generation compiled for a TPU slice or GPU cluster.

Deviceless, like the train step's compile (planning/compile.py): the prefill of `batch`
prompts into a KV cache and one decode step against it -- models.generation's `prefill` and
`decode_step`, the functions `jaxtrain generate` runs, on the config's mesh with parameters,
tokens and the cache sharded by their logical axes. Reports the KV cache and each program's
memory per device against HBM (no time estimate).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxtrain import models, sharding
from jaxtrain.config import Config, ConfigError
from jaxtrain.models.config import DTYPE_BYTES, FLASH_ATTENTION_IMPLS
from jaxtrain.models.generation import (
    CACHE_AXES,
    CACHE_POSITION_AXES,
    KVCache,
    cache_length,
    cache_shapes,
    linear_state_shapes,
)
from jaxtrain.models.generation import decode_step as decode_fn
from jaxtrain.models.generation import prefill as prefill_fn
from jaxtrain.models.linear_attention import CONV_STATE_AXES, STATE_AXES
from jaxtrain.planning.compile import (
    Target,
    _first_line,
    _oom_used_bytes,
    config_for_target,
    fill_note,
    is_out_of_memory,
    resolved_for_target,
    target_fields,
    target_mesh,
)
from jaxtrain.planning.report import collectives
from jaxtrain.planning.resolve import axis_rules
from jaxtrain.sharding.targets import compiled_memory


def kv_cache_bytes(model_cfg, batch: int, cache_len: int) -> int:
    """Bytes of the whole KV cache (models.generation.KVCache k and v, every layer) in the
    compute dtype: batch x cache_len x `kv_cache_bytes_per_token`."""
    return batch * cache_len * kv_cache_bytes_per_token(model_cfg)


def kv_cache_bytes_per_token(model_cfg) -> int:
    """Bytes one token of one sequence holds in the cache, over every layer: 2 x layers x
    kv_heads x head_dim x itemsize, or with latent attention (model.mla) layers x
    (kv_lora_rank + qk_rope_head_dim) x itemsize (models.generation.cache_shapes)."""
    itemsize = DTYPE_BYTES[model_cfg.compute_dtype]
    return sum(math.prod(s) * itemsize for s in cache_shapes(model_cfg, 1, 1))


def linear_state_bytes_per_sequence(model_cfg) -> int:
    """Bytes one sequence's gated DeltaNet layers hold in decode, whatever its length (the conv
    window in the compute dtype, the rule's state in float32); 0 without those layers."""
    shapes = linear_state_shapes(model_cfg, 1)
    if shapes is None:
        return 0
    conv, state = shapes
    return math.prod(conv) * DTYPE_BYTES[model_cfg.compute_dtype] + math.prod(state) * 4


def _per_device_bytes(shape, dtype, sharding) -> int:
    return math.prod(sharding.shard_shape(tuple(shape))) * np.dtype(dtype).itemsize


class _PallasRefused(Exception):
    """The flash kernel refused a program's shapes (compile_decode_report retries with XLA's)."""


def compile_decode_report(
    cfg: Config, target: Target, *, batch: int, max_len: int, prompt_len: int | None = None
) -> dict[str, Any]:
    """Compile generation for `target`: the prefill of `batch` prompts of `prompt_len` tokens
    (default max_len: the longest prompt the cache holds, the worst case for the prefill's
    activations) into a KV cache of `max_len` positions (the sliding window when shorter),
    and one decode step (a token per row against that cache, the cache donated and updated
    in place).

    Reports per device: the KV cache (computed from the shapes and the cache's sharding, and
    read back from the compiled decode step's argument shardings), the parameters, and each
    program's argument / output / temp / total memory against HBM; fits when both do.
    The train batch does not apply; the mesh rules, dtypes and attention are the config's.
    Raises ConfigError for a bad batch / length or a mesh the target cannot hold.
    """
    prompt_len = max_len if prompt_len is None else prompt_len
    _check_lengths(cfg, batch, max_len, prompt_len)
    requested_fsdp = cfg.mesh.fsdp
    # config_for_target checks the *train* batch against the mesh; decode has its own batch
    # (rules drop a mesh axis that does not divide it), so give it one every mesh divides.
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, global_batch_size=target.num_devices, microbatches=1)
    )
    cfg, ici, dcn = config_for_target(cfg, target)
    cfg, notes = resolved_for_target(cfg, target, ici, dcn)
    notes = [n for n in notes if n.startswith(("model.attention_impl", "model.cpu_tuning", "model.moe"))]
    mesh = target_mesh(target, ici, dcn)
    report = _decode_report(cfg, target, mesh, dcn, batch, max_len, prompt_len)
    report["notes"] += [*notes, *fill_note(cfg, requested_fsdp, dcn)]
    if report["cache_len"] < max_len:
        report["notes"].append(f"sliding window: the cache is a ring of {report['cache_len']} positions")
    try:
        _compile_programs(report, cfg, mesh, target, batch, prompt_len)
    except _PallasRefused as e:  # as compile_report: the flash kernel refused; XLA attention
        xla = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_impl="xla"))
        again = compile_decode_report(xla, target, batch=batch, max_len=max_len, prompt_len=prompt_len)
        again["notes"] = report["notes"] + [str(e), *again["notes"]]
        return again
    if not report["fits"]:
        report["suggestions"] = [
            "shard the cache wider: mesh.tensor (kv heads) or mesh.data / mesh.fsdp (batch)",
            f"a smaller --batch (now {batch}) or --max-len (now {max_len})",
            "model.param_dtype=bfloat16 halves the weights (float32 master weights are for training)",
        ]
    return report


def _check_lengths(cfg: Config, batch, max_len, prompt_len) -> None:
    for name, value in (("--batch", batch), ("--max-len", max_len), ("--prompt-len", prompt_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}={value!r}: expected a positive integer")
    if prompt_len > max_len:
        raise ConfigError(f"--prompt-len={prompt_len}: expected at most --max-len={max_len}")
    if cfg.mesh.context != 1:
        raise ConfigError(f"mesh.context={cfg.mesh.context}: generation needs mesh.context=1")


def _decode_report(cfg: Config, target: Target, mesh, dcn, batch, max_len, prompt_len) -> dict[str, Any]:
    m = cfg.model
    return {
        "mode": "decode",
        **target_fields(cfg, target, mesh, dcn),
        "params": m.param_count(),
        "param_dtype": m.param_dtype,
        "compute_dtype": m.compute_dtype,
        "batch": batch,
        "max_len": max_len,
        "prompt_len": prompt_len,
        "cache_len": cache_length(m, max_len),
        "hbm_bytes": target.hbm_bytes,
        "notes": [],
    }


def _compile_programs(report: dict, cfg: Config, mesh, target: Target, batch: int, prompt_len: int) -> None:
    """Build, compile and measure the prefill and the decode step; fills `report`."""
    m, rules, cache_len = cfg.model, axis_rules(cfg), report["cache_len"]
    graphdef, abstract = models.abstract_model(lambda: models.Transformer(m, rngs=nnx.Rngs(0)))
    shapes = nnx.to_pure_dict(abstract)
    param_shardings = sharding.tree_shardings(models.logical_axes(abstract), rules, mesh, shapes=shapes)
    params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, param_shardings
    )
    named = lambda axes, shape: NamedSharding(mesh, sharding.logical_to_spec(axes, rules, mesh, shape))
    arg = lambda shape, dtype, axes: jax.ShapeDtypeStruct(shape, dtype, sharding=named(axes, shape))
    k_shape, v_shape = cache_shapes(m, batch, cache_len)
    linear = linear_state_shapes(m, batch)
    cache = KVCache(
        arg(k_shape, m.compute_dtype, CACHE_AXES),
        arg(v_shape, m.compute_dtype, CACHE_AXES),
        arg((batch, cache_len), "int32", CACHE_POSITION_AXES),
        *(
            ()
            if linear is None
            else (arg(linear[0], m.compute_dtype, CONV_STATE_AXES), arg(linear[1], "float32", STATE_AXES))
        ),
    )
    out_shardings = (
        named(("batch", "act_vocab"), (batch, m.vocab_size)),
        jax.tree.map(lambda a: a.sharding, cache),
    )
    prefill = lambda params, tokens, lengths: prefill_fn(
        models.merge(graphdef, abstract, params), tokens, lengths, cache_len
    )
    decode = lambda params, tokens, positions, cache: decode_fn(
        models.merge(graphdef, abstract, params), tokens, positions, cache
    )
    programs = {
        "prefill": (
            jax.jit(prefill, out_shardings=out_shardings),
            (params, arg((batch, prompt_len), "int32", ("batch", None)), arg((batch,), "int32", ("batch",))),
        ),
        "decode": (
            jax.jit(decode, out_shardings=out_shardings, donate_argnums=3),
            (params, arg((batch,), "int32", ("batch",)), arg((batch,), "int32", ("batch",)), cache),
        ),
    }
    shards = math.prod(mesh.shape[a] for entry in cache.k.sharding.spec for a in sharding.axes_tuple(entry))
    report["kv_cache_bytes"] = kv_cache_bytes(m, batch, cache_len)
    report["kv_cache_bytes_per_token"] = kv_cache_bytes_per_token(m)
    report["kv_cache_spec"] = str(cache.k.sharding.spec)
    report["kv_cache_shards"] = shards
    report["kv_cache_bytes_per_device"] = report["kv_cache_bytes"] // shards
    if linear is not None:  # gated DeltaNet layers: a fixed state per sequence
        report["linear_state_bytes"] = batch * linear_state_bytes_per_sequence(m)
        report["linear_state_bytes_per_device"] = sum(
            _per_device_bytes(a.shape, a.dtype, a.sharding) for a in (cache.conv, cache.state)
        )
    report["param_bytes_per_device"] = sum(
        _per_device_bytes(p.shape, p.dtype, p.sharding) for p in jax.tree.leaves(params)
    )
    for name, (jitted, args) in programs.items():
        report[name] = _compile_one(name, jitted, args, mesh, rules, cfg, target)
        if name == "decode" and "compiled_k_sharding" in report[name]:
            k_sharding = report[name].pop("compiled_k_sharding")
            report["kv_cache_bytes_per_device_compiled"] = sum(
                _per_device_bytes(shape, m.compute_dtype, k_sharding) for shape in (k_shape, v_shape)
            )
    report["fits"] = all(report[n]["fits"] for n in programs)
    totals = [(report[n]["memory"] or {}).get("total") for n in programs]
    report["margin_bytes"] = (
        target.hbm_bytes - max(t for t in totals if t is not None) if any(totals) else None
    )


def _compile_one(name: str, jitted, args, mesh, rules, cfg: Config, target: Target) -> dict[str, Any]:
    """One program's entry: its memory and collectives, or the compiler's out-of-memory
    verdict. Raises _PallasRefused when the flash kernel refused the shapes."""
    entry: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        with jax.set_mesh(mesh), sharding.axis_rules(rules):
            compiled = jitted.lower(*args).compile()
    except Exception as e:  # the device compiler's own errors: out of memory is a verdict
        text = str(e)
        if not is_out_of_memory(text):
            if cfg.model.attention_impl not in FLASH_ATTENTION_IMPLS:
                raise
            raise _PallasRefused(
                f"pallas attention failed to compile the {name} ({_first_line(text)[:200]}); "
                "fell back to model.attention_impl=xla"
            ) from None
        used = _oom_used_bytes(text)
        entry.update(compile_error=_first_line(text), memory={"total": used} if used else None, fits=False)
    else:
        mem = compiled_memory(compiled)
        entry.update(memory=mem, fits=mem["total"] <= target.hbm_bytes)
        entry["collectives"] = collectives(compiled.as_text())
        if name == "decode":
            entry["compiled_k_sharding"] = compiled.input_shardings[0][3].k
    entry["compile_s"] = time.perf_counter() - t0
    return entry

"""Model FLOPs per token and peak FLOP/s per device, for MFU.

Peak FLOP/s come from the one hardware table, `jaxtrain.sharding.hardware`
(dense bf16, per chip or GPU); CPU has none and is measured instead.

FLOPs per token (training, forward + backward) = 6 * N (N = parameters a
token uses: for MoE, the top-k routed and shared experts only; embedding lookup
excluded; a tied embedding still counts once as the output projection) + attention:
12 * layers * seq * d_attn, halved when causal, where
d_attn = n_heads * head_dim (= d_model for the usual shapes). This is the
PaLM-paper convention MaxText also uses, so MFU figures compare. Multi-token
prediction (model.mtp) adds its modules' parameters to N, the shared output head
once more per module, and a layer of attention per module. Latent attention
(model.mla) scores with a query/key width unlike its value width: its QK^T and PV
matmuls count apart (`ModelConfig.attention_widths`; DeepSeek-V3: 192 and 128).
Gated DeltaNet layers (`model.layer_types`, Qwen3.5) have no seq-long attention: their
projections are in N, and the delta rule counts as its recurrence does, per token and value
head a read of the state by k, its rank-one write and its read by q (3 x 2 x dk x dv forward,
x3 with the backward), whatever the sequence length; the attention term counts the
full-attention layers only.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from jaxtrain.models.config import ModelConfig
from jaxtrain.sharding.hardware import peak_flops_for_device_kind

__all__ = [
    "flops_per_token",
    "measure_matmul_flops",
    "mesh_peak_flops",
    "peak_flops_for_device_kind",
    "peak_flops_per_device",
]


def flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> float:
    n = cfg.active_param_count(include_embedding=cfg.tie_embeddings)
    linear = cfg.n_linear_layers
    layers = cfg.n_layers - linear
    if cfg.mtp is not None:  # each prediction module's block attends, its logits use the head again
        layers += cfg.mtp.depth
        n += cfg.mtp.depth * cfg.d_model * cfg.vocab_size
    attn = 6 * layers * seq_len * cfg.n_heads * sum(cfg.attention_widths)
    rule = 0
    if linear:
        la = cfg.linear_attention
        rule = 3 * linear * la.num_value_heads * 3 * 2 * la.key_head_dim * la.value_head_dim
    return 6 * n + (attn / 2 if causal else attn) + rule


@functools.cache
def measure_matmul_flops(
    n: int = 1024, dtype: str = "float32", repeats: int = 20, min_seconds: float = 0.5, device=None
) -> float:
    """FLOP/s of one jitted n x n matmul on `device` (default: the default device): the best of at least
    `repeats` runs and of all the runs that fit in `min_seconds`.

    CPU has no spec-sheet peak; this measured figure is what "MFU" means there, so a low
    reading inflates every MFU of the run. Best of 5 once read 1.06e11 FLOP/s in f32 where
    the runs around it read 1.9e11. Best of 20 (0.1 s in bf16 at 1024) still read bf16
    3.74-3.90e11 at the start of some runs on a quiet AVX-512 BF16 machine whose best of
    200 reads 4.18e11 every time (best of 20 there: 4.05-4.10e11); half a second of runs
    (about 100) read 4.11-4.15e11 in three fresh processes.
    """
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best, runs, start = float("inf"), 0, time.perf_counter()
    while runs < repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return 2 * n**3 / best


def peak_flops_per_device(device, override: float | None = None, dtype: str = "float32") -> tuple[float, str]:
    """(peak FLOP/s of one device in `dtype`, the run's compute dtype; where it came from).

    The chip table's figure for the device kind and dtype (float16 reads the bfloat16 column:
    the same on every chip listed); for a device the table lacks, a matmul measured in
    `dtype` on `device` (on a CPU with native bf16 dot products the bf16 peak is about twice
    the f32 one, and an MFU against the f32 peak would overstate a bf16 run twofold)."""
    if override:
        return override, "config"
    column = "bfloat16" if dtype == "float16" else dtype
    table = peak_flops_for_device_kind(device.device_kind, column)
    if table:
        return table, f"table ({device.device_kind}, {column})"
    # A chip without a figure for this dtype (TPUs list no float32 peak: their f32 matmuls
    # run as bf16 passes at default precision): its bf16 figure, as MaxText scores TPU runs.
    table = peak_flops_for_device_kind(device.device_kind, "bfloat16")
    if table:
        return table, f"table ({device.device_kind}, bfloat16: no {column} figure)"
    return measure_matmul_flops(dtype=dtype, device=device), f"measured {dtype} matmul"


def mesh_peak_flops(device, devices: int, override: float | None = None, dtype: str = "float32"):
    """(peak FLOP/s of a mesh of `devices` devices like `device`, where it came from). A
    measured CPU figure is the host's (its simulated devices share the cores), once per
    process; every other figure is one device's, times the devices."""
    peak, source = peak_flops_per_device(device, override, dtype)
    if source.startswith("measured") and device.platform == "cpu":
        return peak * jax.process_count(), source + " (one host's, per process)"
    return peak * devices, source

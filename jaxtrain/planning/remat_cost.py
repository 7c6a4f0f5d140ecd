"""What each remat policy costs a step, for `model.remat: auto` on GPUs: the recomputed FLOPs
and the memory traffic of the activations the policy keeps.

A policy that keeps less recomputes more, but keeping is not free either: every kept
activation is written to HBM in the forward pass and read back in the backward, and a value
kept for the backward cannot stay inside the fusion that made it. On one H200
(configs/gpu-peer.yaml, 2026-11-26) `none` ran at 0.2286 s/step, `minimal` (keep the matmul
outputs, recompute attention and the elementwise work) at 0.2186 s, `save_dot_except_mlp` at
0.2370 s and `full` at 0.2394 s: counting recomputed FLOPs alone ranks `none` first, while it
is second. So a policy is charged

    cost = recomputed FLOPs / (RECOMPUTE_FRACTION x peak) + SAVED_TRAFFIC x kept bytes / HBM bandwidth

per device and step, with the two constants fitted (least squares) to those four timings:
the predicted differences from `none` are minimal -8.9 ms (measured -10.0),
save_dot_except_mlp +5.2 (+8.4), full +12.9 (+10.8), in the measured order. The cost is relative: the
model FLOPs every policy runs are left out. Recomputed per layer and token, as jax's
checkpoint policies recompute what the backward needs and was not kept:

| not kept   | recomputes                                                             |
|------------|------------------------------------------------------------------------|
| qkv_proj   | the q, k, v projections                                                |
| context    | attention's forward (and qkv_proj, if not kept either)                 |
| out_proj   | the output projection (and context)                                    |
| mlp_in     | the gate and up projections                                            |
| mlp_out    | MoE only (the router weights' gradient reads the expert outputs): the experts |

Policies are ranked only where the chip's bandwidth is in sharding/hardware.py and the
platform is a GPU: on TPU and CPU the constants are not calibrated, and `auto` keeps the
least-recompute order (planning/resolve.py).
"""

from __future__ import annotations

import dataclasses

from jaxtrain.config import Config
from jaxtrain.planning.attention_shape import attention_shape
from jaxtrain.planning.footprint import (
    SAVED_NAMES,
    activation_bytes,
    mesh_product,
    microbatch_shape,
    moe_row_factor,
)
from jaxtrain.sharding.hardware import Chip

SAVED_TRAFFIC = 2.35  # HBM bytes moved per byte a policy keeps (fitted; module docstring)
RECOMPUTE_FRACTION = 0.72  # of the chip's dense peak that recomputed work runs at (fitted)


@dataclasses.dataclass(frozen=True)
class PolicyCost:
    recompute_s: float  # recomputed FLOPs at RECOMPUTE_FRACTION of the peak
    traffic_s: float  # kept activations, SAVED_TRAFFIC x their bytes over the HBM bandwidth

    @property
    def total_s(self) -> float:
        return self.recompute_s + self.traffic_s


def _matmul_flops_per_token(cfg: Config, mesh_sizes: dict[str, int]) -> dict[str, float]:
    """FLOPs per token of one layer's forward, per device, by the checkpoint name each
    computes (heads and mlp split over tensor)."""
    m = cfg.model
    t = max(1, mesh_sizes.get("tensor", 1))
    d, att = m.d_model, attention_shape(m)
    mlp = m.mlp_dim
    if m.moe is not None:  # the routed rows' experts plus the shared ones, per token
        mlp = m.moe.mlp_dim(m) * (m.moe.top_k * moe_row_factor(cfg, mesh_sizes) + m.moe.num_shared_experts)
    seq = cfg.train.seq_len
    keys = seq / 2 if m.sliding_window is None else min(seq / 2, m.sliding_window)  # causal
    return {
        "qkv_proj": att.qkv_flops_per_device(t),
        "context": att.attention_flops(keys) / t,  # scores and weighted values
        "out_proj": att.out_flops / t,
        "mlp_in": 2 * 2 * d * mlp / t,
        "mlp_out": 2 * mlp * d / t,
    }


def recomputed_names(cfg: Config, policy: str) -> tuple[str, ...]:
    """The checkpoint names whose forward work the backward repeats under `policy`."""
    m = cfg.model
    if policy == "none":
        return ()
    if policy == "save_matmuls":  # every matmul without batch dims: all projections are kept
        kept = ("qkv_proj", "out_proj", "mlp_in", "mlp_out")
    elif policy == "custom":
        kept = tuple(n for n, mode in m.remat_custom if mode in ("device", "offload"))
    else:
        kept = SAVED_NAMES.get(policy, ())
    # the backward needs every projection's output or input (attention's output is the output
    # projection's input; q, k, v are attention's): what is not kept is recomputed
    needed = {"qkv_proj", "context", "out_proj", "mlp_in"} | ({"mlp_out"} if m.moe is not None else set())
    missing = needed - set(kept)
    if "mlp_out" in missing:  # the experts' outputs come from their inputs
        missing.add("mlp_in")
    return tuple(sorted(missing))


def policy_cost(cfg: Config, mesh_sizes: dict[str, int], chip: Chip) -> PolicyCost:
    """The cost of `cfg.model.remat` (module docstring) on one device of `chip`."""
    m = cfg.model
    rows, seq = microbatch_shape(cfg, mesh_product(mesh_sizes))
    tokens = rows * seq * max(1, cfg.train.microbatches)  # every microbatch of the step
    per_token = _matmul_flops_per_token(cfg, mesh_sizes)
    flops = m.n_layers * tokens * sum(per_token[n] for n in recomputed_names(cfg, m.remat))
    saved, _, _ = activation_bytes(cfg, mesh_sizes)  # one microbatch's, kept at the peak
    traffic = SAVED_TRAFFIC * saved * max(1, cfg.train.microbatches)  # written and read each
    return PolicyCost(
        recompute_s=flops / (RECOMPUTE_FRACTION * chip.peak_flops(m.compute_dtype)),
        traffic_s=traffic / chip.hbm_bytes_per_s,
    )

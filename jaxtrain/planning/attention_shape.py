"""One layer's attention as the planner's memory and time models count it, per token:
grouped-query attention and latent attention (model.mla) alike.

Grouped-query attention (models/layers.py `Attention`; H query heads, K key/value heads of
hd values): q [H hd], k and v [K hd], each projected from d_model.

Latent attention (models/mla.py; DeepSeek-V2/V3): the query from d_model, or through a
latent of q_lora values and its RMSNorm; keys and values from one latent of kv_lora values
(and its RMSNorm) plus a RoPE key of `rope` values shared by every head; the latent's
up-projection gives each head its no-RoPE key (nope) and its value (v). Attention then runs
on q and k [H (nope + rope)] and v [H v], expanded per head: those are what the layer names
`qkv_proj`, and its output (`context`) has H v values, not H (nope + rope).

Widths (values per token; `per_head` ones split over mesh.tensor with the heads, the
latents never do):
  qkv          q + k + v as attention reads them (the `qkv_proj` checkpoint, after RoPE)
  projected    what the projections give before RoPE and, with latent attention, before the
               per-head split and the shared RoPE key's join: q and k (GQA: v is named as it
               comes); MLA: q [H (nope + rope)] and the key/value up-projection [H (nope + v)]
  latent       MLA: the down-projections' outputs, q_lora + kv_lora + rope (0 for GQA)
  latent_normed  MLA: what the latent RMSNorms normalise, q_lora + kv_lora
  context      the attention's output, H x the value head dim
FLOPs per token, forward (a multiply-add is 2):
  qkv_flops       the projections up to q, k, v: 2 x their weights (MLA: all four, the
                  up-projections run on every token in training)
  latent_flops    MLA: the down-projections' share of qkv_flops, 2 D (q_lora + kv_lora + rope),
                  which mesh.tensor does not split (every head reads the whole latent)
  out_flops       the output projection, 2 x H v d_model
  attention_flops(keys)  QK^T and PV over `keys` keys: 2 keys H (qk + v)
Biases, sinks and QK-norm scales are parameters (param_count) but no matmul: left out here.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    heads: int
    qk_head_dim: int
    v_head_dim: int
    qkv: int
    projected: int
    latent: int
    latent_normed: int
    qkv_flops: int
    out_flops: int
    latent_flops: int = 0

    def qkv_flops_per_device(self, tensor: int) -> float:
        """qkv_flops on one of `tensor` shards: the heads' part split, the latents' whole."""
        return (self.qkv_flops - self.latent_flops) / max(1, tensor) + self.latent_flops

    @property
    def context(self) -> int:
        return self.heads * self.v_head_dim

    def attention_flops(self, keys: float) -> float:
        """Forward FLOPs per token of QK^T and PV over `keys` keys (causal: half the sequence)."""
        return 2 * keys * self.heads * (self.qk_head_dim + self.v_head_dim)

    @property
    def kv(self) -> int:
        """Key and value values per token as attention reads them (what context parallelism
        passes around the ring: MLA's expanded per head)."""
        return self.qkv - self.heads * self.qk_head_dim


def attention_shape(m) -> AttentionShape:
    """The attention of model config `m` (module docstring)."""
    d, h = m.d_model, m.n_heads
    if m.mla is None:
        hd, kv = m.resolved_head_dim, m.n_kv_heads
        return AttentionShape(
            heads=h, qk_head_dim=hd, v_head_dim=hd,
            qkv=(h + 2 * kv) * hd, projected=(h + kv) * hd, latent=0, latent_normed=0,
            qkv_flops=2 * d * (h + 2 * kv) * hd, out_flops=2 * h * hd * d,
        )  # fmt: skip
    a = m.mla
    ql, kvl, qk, v = a.q_lora_rank or 0, a.kv_lora_rank, a.qk_head_dim, a.v_head_dim
    query = d * h * qk if not ql else d * ql + ql * h * qk
    key_value = d * (kvl + a.qk_rope_head_dim) + kvl * h * (a.qk_nope_head_dim + v)
    return AttentionShape(
        heads=h, qk_head_dim=qk, v_head_dim=v,
        qkv=h * (2 * qk + v), projected=h * qk + h * (a.qk_nope_head_dim + v),
        latent=ql + kvl + a.qk_rope_head_dim, latent_normed=ql + kvl,
        qkv_flops=2 * (query + key_value), out_flops=2 * h * v * d,
        latent_flops=2 * d * (ql + kvl + a.qk_rope_head_dim),
    )  # fmt: skip

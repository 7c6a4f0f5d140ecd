"""The model's configuration: a frozen dataclass with no jax import, so the CLI
can read and validate it before any backend starts."""
from __future__ import annotations

import dataclasses

REMAT_POLICIES = ("none", "full", "save_matmuls")
ATTENTION_IMPLS = ("auto", "xla", "pallas")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only Llama-style transformer (RMSNorm, RoPE, GQA, SwiGLU)."""
    vocab_size: int = 512
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 4
    head_dim: int | None = None      # None: d_model // n_heads
    mlp_dim: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    param_dtype: str = "float32"     # master weights (and optimizer state)
    compute_dtype: str = "float32"   # matmuls and activations
    remat: str = "none"              # none | full | save_matmuls
    scan_layers: bool = True         # False unrolls the layer loop (same parameters)
    attention_impl: str = "auto"     # auto | xla | pallas (auto: pallas on GPU/TPU, xla on CPU)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    def validate(self) -> None:
        """Raise ValueError naming the key, the value and what was expected."""
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_dim"):
            value = getattr(self, key)
            if value < 1:
                raise ValueError(f"model.{key}={value}: expected a positive integer")
        if self.head_dim is not None and self.head_dim < 1:
            raise ValueError(f"model.head_dim={self.head_dim}: expected a positive integer or null")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"model.d_model={self.d_model}: expected a multiple of model.n_heads="
                             f"{self.n_heads} (or set model.head_dim)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_kv_heads={self.n_kv_heads}: expected a divisor of "
                             f"model.n_heads={self.n_heads}")
        if self.resolved_head_dim % 2:
            raise ValueError(f"model.head_dim={self.resolved_head_dim}: RoPE needs an even head_dim")
        for key in ("param_dtype", "compute_dtype"):
            if getattr(self, key) not in DTYPES:
                raise ValueError(f"model.{key}={getattr(self, key)!r}: expected one of {DTYPES}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={self.remat!r}: expected one of {REMAT_POLICIES}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"model.attention_impl={self.attention_impl!r}: expected one of {ATTENTION_IMPLS}")
        if self.rope_theta <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ValueError("model.rope_theta, model.norm_eps and model.init_std must be positive")

    def param_count(self, *, include_embedding: bool = True) -> int:
        """Exact number of parameters (matches the built model; tests check it)."""
        d, hd, L = self.d_model, self.resolved_head_dim, self.n_layers
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * d * self.mlp_dim
        per_layer = attn + mlp + 2 * d
        embed = self.vocab_size * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return L * per_layer + d + head + (embed if include_embedding else 0)

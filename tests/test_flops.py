"""FLOPs per token and peak-FLOP lookup against hand-computed values."""

import pytest

from jaxtrain.flops import flops_per_token, peak_flops_for_device_kind
from jaxtrain.models import ModelConfig


def test_flops_per_token_by_hand():
    cfg = ModelConfig(vocab_size=1000, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=128)
    # per layer: q,o 64*64 each; k,v 64*32 each; mlp 3*64*128; 2 norms of 64
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    n = 2 * per_layer + 64 + 1000 * 64  # + final norm + untied lm_head (embedding excluded)
    attn = 12 * 2 * 256 * 64  # 12 * layers * seq * (heads * head_dim)
    assert flops_per_token(cfg, 256) == 6 * n + attn / 2
    assert flops_per_token(cfg, 256, causal=False) == 6 * n + attn


def test_tied_embedding_counts_once_as_output_projection():
    untied = ModelConfig(vocab_size=1000, d_model=64, n_layers=1, n_heads=4, n_kv_heads=4, mlp_dim=64)
    tied = ModelConfig(
        vocab_size=1000, d_model=64, n_layers=1, n_heads=4, n_kv_heads=4, mlp_dim=64, tie_embeddings=True
    )
    assert flops_per_token(tied, 16) == flops_per_token(untied, 16)


@pytest.mark.parametrize(
    "kind,peak",
    [
        ("TPU v4", 275e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5", 459e12),
        ("TPU v6 lite", 918e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("cpu", None),
    ],
)
def test_peak_table(kind, peak):
    assert peak_flops_for_device_kind(kind) == peak


def test_moe_counts_only_active_experts():
    from jaxtrain.models.config import MoEConfig

    dense = ModelConfig(vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, mlp_dim=16)
    moe = ModelConfig(
        vocab_size=100,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        mlp_dim=16,
        moe=MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=16),
    )
    # per MoE layer, a token uses 2 experts' SwiGLU (2x dense mlp) plus the router d*E
    extra_per_layer = 3 * 32 * 16 + 32 * 8
    assert flops_per_token(moe, 8) == flops_per_token(dense, 8) + 6 * 2 * extra_per_layer

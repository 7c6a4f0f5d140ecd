"""FLOPs per token and peak-FLOP lookup against hand-computed values."""

import pytest

from jaxtrain.models import ModelConfig
from jaxtrain.planning.flops import flops_per_token, peak_flops_for_device_kind


def test_flops_per_token_by_hand():
    cfg = ModelConfig(vocab_size=1000, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=128)
    # per layer: q,o 64*64 each; k,v 64*32 each; mlp 3*64*128; 2 norms of 64
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    n = 2 * per_layer + 64 + 1000 * 64  # + final norm + untied lm_head (embedding excluded)
    attn = 12 * 2 * 256 * 64  # 12 * layers * seq * (heads * head_dim)
    assert flops_per_token(cfg, 256) == 6 * n + attn / 2
    assert flops_per_token(cfg, 256, causal=False) == 6 * n + attn


def test_latent_attention_counts_qk_and_v_widths_apart():
    """MLA (DeepSeek-V3): QK^T runs over qk_nope + qk_rope = 192 values a head, PV over
    v_head_dim = 128; the parameters come from param_count (checked in test_deepseek)."""
    from jaxtrain.models.config import MLAConfig

    mla = MLAConfig(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
    cfg = ModelConfig(vocab_size=1000, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, mlp_dim=128, mla=mla)
    n = cfg.active_param_count(include_embedding=False)
    # per layer, forward: QK^T 2 * seq * 4 * 24 and PV 2 * seq * 4 * 12; x3 with the backward
    attn = 2 * 3 * 256 * (2 * 4 * 24 + 2 * 4 * 12)
    assert flops_per_token(cfg, 256, causal=False) == 6 * n + attn
    assert flops_per_token(cfg, 256) == 6 * n + attn / 2


def test_deltanet_layers_count_their_recurrence_not_attention():
    """Qwen3.5's hybrid: the seq-long attention term counts the full layers only (1 of 4); each
    DeltaNet layer adds its rule, 3 x 2 x dk x dv per value head forward (x3 with the backward),
    at any length; their projections are parameters (param_count, checked in test_hybrid_layers)."""
    from jaxtrain.models.config import LinearAttentionConfig

    la = LinearAttentionConfig(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=8)
    cfg = ModelConfig(
        vocab_size=1000, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, mlp_dim=128, head_dim=16,
        layer_types=("linear_attention",) * 3 + ("full_attention",), linear_attention=la,
    )  # fmt: skip
    n = cfg.active_param_count(include_embedding=False)
    attn = 12 * 1 * 256 * 4 * 16
    rule = 3 * 3 * 4 * (3 * 2 * 16 * 8)  # x3 backward, 3 layers, 4 value heads
    assert flops_per_token(cfg, 256, causal=False) == 6 * n + attn + rule
    assert flops_per_token(cfg, 256) == 6 * n + attn / 2 + rule
    assert flops_per_token(cfg, 512) - flops_per_token(cfg, 256) == attn / 2  # the full layer alone


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


def test_one_hardware_table_feeds_mfu_compile_and_the_gpu_target_configs():
    """flops, compile and sharding.targets read sharding.hardware; the figures the docs'
    tables rest on stay put (v5p and H100 peaks and HBM)."""
    import re

    from jaxtrain.planning.compile import parse_target
    from jaxtrain.sharding import hardware, targets

    v5p, h100 = parse_target("tpu:v5p-8"), parse_target("gpu:h100")
    assert (v5p.peak_flops, v5p.hbm_bytes) == (459e12, 95 * 2**30)
    assert (h100.peak_flops, h100.hbm_bytes) == (989e12, 84942979072)  # XLA's h100_sxm.txtpb
    for text, kind, proto in [
        ("gpu:h100", "NVIDIA H100 80GB HBM3", targets.H100_SXM_TARGET_CONFIG),
        ("gpu:a100", "NVIDIA A100-SXM4-80GB", targets.A100_SXM_TARGET_CONFIG),
    ]:
        t = parse_target(text)
        assert t.peak_flops == peak_flops_for_device_kind(kind)
        assert t.hbm_bytes == int(re.search(r"device_memory_size: (\d+)", proto).group(1))
        assert kind in proto
    # The A100 80GB reports 85100068864 bytes (XLA's a100_sxm_80.txtpb), not a nominal 80 GiB.
    assert parse_target("gpu:a100").hbm_bytes == 85100068864 < 80 * 2**30
    assert parse_target("gpu:h100").num_devices == hardware.chip("h100").chips_per_host == 8
    # Other dtypes where the vendor gives a figure; None where it gives none.
    assert peak_flops_for_device_kind("NVIDIA H100 80GB HBM3", "float8") == 1979e12
    assert peak_flops_for_device_kind("NVIDIA A100-SXM4-80GB", "float32") == 19.5e12
    assert peak_flops_for_device_kind("TPU v5 lite", "float8") is None
    with pytest.raises(ValueError, match="dtype='int4'"):
        hardware.chip("v5p").peak_flops("int4")


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


def test_cpu_peak_is_measured_in_the_compute_dtype(monkeypatch):
    """MFU on CPU divides by a matmul peak measured in the run's compute dtype, so a bf16
    run is not scored against the (about half as high) f32 peak."""
    import jax

    from jaxtrain.planning import flops

    seen = []
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda dtype="float32", **_: seen.append(dtype) or 1e9)
    cpu = jax.devices("cpu")[0]
    assert flops.peak_flops_per_device(cpu, dtype="bfloat16") == (1e9, "measured bfloat16 matmul")
    assert flops.peak_flops_per_device(cpu) == (1e9, "measured float32 matmul")
    assert flops.peak_flops_per_device(cpu, 5e12, dtype="bfloat16") == (5e12, "config")
    assert seen == ["bfloat16", "float32"]


def test_matmul_peak_runs_for_at_least_min_seconds():
    """measure_matmul_flops keeps timing runs until `min_seconds` have passed, however few
    `repeats` were asked for (a 0.1 s start-up sample read the peak up to 10% low). Oracle:
    the wall clock."""
    import time

    from jaxtrain.planning.flops import measure_matmul_flops

    t0 = time.perf_counter()
    peak = measure_matmul_flops(n=64, repeats=1, min_seconds=0.3)
    assert time.perf_counter() - t0 >= 0.3
    assert 0 < peak < float("inf")

"""Make hf_reference.npz: transformers 5.25's own torch code on small random inputs, the
oracle of tests/test_gated_deltanet.py (which needs no torch).

Run from the repository root with a Python that has torch and transformers 5.25 (CPU wheels):

    python -m venv /tmp/hf311 && /tmp/hf311/bin/pip install torch==2.13.0 "transformers==5.25.*" numpy
    /tmp/hf311/bin/python tests/assets/gated_deltanet/make_assets.py

What it holds (float32; names prefixed by case):
- rule_*: torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule (qwen3_5) on q, k
  [1, 140, 2, 16], v [1, 140, 4, 8] (two key heads over four value heads, dk != dv), g, beta,
  an initial state, use_qk_l2norm_in_kernel=True: outputs and final states;
- conv_*: causal_conv1d_fn (SiLU) over 140 tokens of 12 channels, kernel 4, then
  causal_conv1d_update of one more token from the state of the last 4 inputs;
- norm_*: Qwen3_5RMSNormGated with a random weight;
- q35_*: a whole Qwen3_5GatedDeltaNet layer (no cache) with random weights: its parameters,
  input and output;
- next_*: the same for Qwen3NextGatedDeltaNet (in_proj_qkvz / in_proj_ba);
- attn_*: a whole Qwen3NextAttention (the full-attention layer of both families: q_proj with
  its output gate, (1 + w) QK-norm, partial RoPE 0.25 of head_dim 16, 4 query heads over 2
  key/value heads, sdpa causal) at positions 0..139, with its rotary embedding.
"""

import os

import numpy as np
import torch
import transformers
from transformers.models.qwen3_5 import modeling_qwen3_5 as q35
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_next import modeling_qwen3_next as qnext
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

HERE = os.path.dirname(os.path.abspath(__file__))
B, S, HK, HV, DK, DV, D, KERNEL = 1, 140, 2, 4, 16, 8, 32, 4


def t(x):
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def n(x):
    return x.detach().numpy().astype(np.float32)


def rule(rng, out):
    q = rng.standard_normal((B, S, HK, DK))
    k = rng.standard_normal((B, S, HK, DK))
    v = rng.standard_normal((B, S, HV, DV))
    g = -0.5 * rng.random((B, S, HV))
    beta = rng.random((B, S, HV))
    state = 0.3 * rng.standard_normal((B, HV, DK, DV))
    args = [t(x) for x in (q, k, v, g, beta)]
    kw = dict(initial_state=t(state), output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_chunk, s_chunk = q35.torch_chunk_gated_delta_rule(*args, chunk_size=64, **kw)
    o_rec, s_rec = q35.torch_recurrent_gated_delta_rule(*args, **kw)
    for name, x in dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=state).items():
        out[f"rule_{name}"] = np.asarray(x, np.float32)
    out.update(rule_out_chunk=n(o_chunk), rule_state_chunk=n(s_chunk))
    out.update(rule_out_recurrent=n(o_rec), rule_state_recurrent=n(s_rec))


def conv(rng, out):
    channels = 12
    x = rng.standard_normal((B, S + 1, channels))
    w = 0.5 * rng.standard_normal((channels, KERNEL))
    xt = t(x).transpose(1, 2)  # [b, channels, seq] as the layers pass it
    full = q35.causal_conv1d_fn(xt[:, :, :S], t(w), None, activation="silu")
    state = xt[:, :, S - KERNEL : S].clone()  # transformers keeps the last `kernel` inputs
    step = q35.causal_conv1d_update(xt[:, :, S:], state, t(w), None, activation="silu")
    out.update(conv_x=np.asarray(x, np.float32), conv_weight=np.asarray(w, np.float32))
    out.update(conv_out=n(full.transpose(1, 2)), conv_step=n(step.transpose(1, 2)))


def norm(rng, out):
    x, z = rng.standard_normal((2, B, 16, HV, DV))
    module = q35.Qwen3_5RMSNormGated(DV, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(t(1 + 0.3 * rng.standard_normal(DV)))
    out.update(norm_x=np.asarray(x, np.float32), norm_z=np.asarray(z, np.float32))
    out.update(norm_weight=n(module.weight), norm_out=n(module(t(x), t(z))))


def layer(rng, out, prefix, config_cls, layer_cls):
    config = config_cls(
        hidden_size=D,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        linear_num_key_heads=HK,
        linear_num_value_heads=HV,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        linear_conv_kernel_dim=KERNEL,
        rms_norm_eps=1e-6,
        hidden_act="silu",
    )
    module = layer_cls(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name == "A_log":
                value = np.log(rng.uniform(0.01, 16, p.shape))
            elif name == "dt_bias":
                value = 1 + 0.5 * rng.standard_normal(p.shape)
            elif name == "norm.weight":
                value = 1 + 0.3 * rng.standard_normal(p.shape)
            else:
                value = rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])
            p.copy_(t(value))
            out[f"{prefix}_{name}"] = n(p)
    x = rng.standard_normal((B, S, D))
    with torch.no_grad():
        y = module(t(x))
    out.update({f"{prefix}_x": np.asarray(x, np.float32), f"{prefix}_out": n(y)})


def attention(rng, out):
    config = Qwen3NextConfig(
        hidden_size=D,
        num_hidden_layers=1,
        layer_types=["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.25,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
    )
    config._attn_implementation = "sdpa"
    module = qnext.Qwen3NextAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.3 if name.endswith("norm.weight") else 1 / np.sqrt(p.shape[-1])
            p.copy_(t(scale * rng.standard_normal(p.shape)))
            out[f"attn_{name}"] = n(p)
    x = rng.standard_normal((B, S, D))
    rotary = qnext.Qwen3NextRotaryEmbedding(config)
    with torch.no_grad():
        cos_sin = rotary(t(x), torch.arange(S)[None])
        y, _ = module(t(x), position_embeddings=cos_sin, attention_mask=None)
    out.update({"attn_x": np.asarray(x, np.float32), "attn_out": n(y)})


def main():
    torch.manual_seed(0)
    rng = np.random.default_rng(64)
    out = {}
    rule(rng, out)
    conv(rng, out)
    norm(rng, out)
    layer(rng, out, "q35", Qwen3_5TextConfig, q35.Qwen3_5GatedDeltaNet)
    layer(rng, out, "next", Qwen3NextConfig, qnext.Qwen3NextGatedDeltaNet)
    attention(rng, out)
    out["transformers_version"] = np.array(transformers.__version__)
    out["torch_version"] = np.array(torch.__version__)
    np.savez_compressed(os.path.join(HERE, "hf_reference.npz"), **out)
    print({k: v.shape for k, v in out.items()})


if __name__ == "__main__":
    main()

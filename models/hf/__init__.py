"""Hugging Face checkpoints in and out: `from_hf(path)` and `to_hf(model, path)`.

Reads a local directory (`config.json` + `*.safetensors`, with or without a
`model.safetensors.index.json`) for LlamaForCausalLM, MistralForCausalLM,
MixtralForCausalLM (every layer MoE, softmax top-k renormalised, dropless),
Qwen2ForCausalLM (q/k/v biases), Qwen3ForCausalLM (QK-norm per head, free head_dim),
Qwen3MoeForCausalLM (QK-norm, every layer MoE), Olmo2ForCausalLM (post-norms, QK-norm
over whole projections), Gemma 2 and 3, DeepseekV3ForCausalLM (also Kimi K2 and Moonlight:
latent attention, YaRN, group-limited sigmoid routing, shared experts, dense first layers)
and GptOssForCausalLM (sinks, q/k/v/o biases, sliding and full layers, experts with biases
and the clamped SwiGLU, MXFP4 experts dequantized), Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
and the text model of their ConditionalGeneration wrappers, Qwen3NextForCausalLM (gated DeltaNet,
gated full attention, MoE with a gated shared expert: models/hf/qwen3_5.py)
and returns a ready NNX `Transformer`; writes one that
`transformers` loads with the same logits. What each family adds is a ModelConfig
feature (`qkv_bias`, `qk_norm`, `norm_placement`), never a branch on the family. No
network, no torch: tensors are read one at a time (models/safetensors_io.py: any dtype,
BF16 and FP8 included), so peak memory is one copy of the model plus one tensor. DeepSeek-V3's
and Kimi K2's block-FP8 weights (`weight_scale_inv`) are dequantized as they are read
(models/hf/fp8.py); a quantization other than block FP8 or GPT-OSS's MXFP4 is refused.

Layout mapping (HF Linear weights are `[out, in]`):
  q_proj [H*hd, D] -> wq [D, H, hd]      o_proj [D, H*hd] -> wo [H, hd, D]
  gate/up [F, D]   -> w_gate/w_up [D, F]  down [D, F]     -> w_down [F, D]
  Mixtral: gate [E, D] -> w_router [D, E]; experts.e.w1/w3 [F, D] -> w_gate/w_up[e] [D, F];
  experts.e.w2 [D, F] -> w_down[e] [F, D]  (stacked [layers, experts, ...] under moe_blocks)
  Qwen3-MoE: mlp.gate [E, D] -> w_router; mlp.experts.e.gate_proj/up_proj/down_proj as above
  q/k/v_proj.bias [H*hd] -> bq/bk/bv [H, hd]      o_proj.bias [D] -> bo    sinks [H] -> sinks
  GPT-OSS: mlp.router.weight/bias -> w_router/b_router; mlp.experts.gate_up_proj [E, D, 2F]
  (gate even columns, up odd) -> w_gate/w_up [E, D, F], down_proj [E, F, D] -> w_down, and
  their biases (`_gpt_oss_experts`)
  q_norm/k_norm [hd] (per head) -> scale [hd]; [H*hd] (whole projection) -> scale [H, hd]
  DeepSeek-V3 (models/mla.py): q_proj [H*(nope+rope), D] -> wq [D, H, nope+rope], or q_a_proj
  [q_lora, D] -> wq_a, q_a_layernorm -> q_norm, q_b_proj [H*(nope+rope), q_lora] -> wq_b
  [q_lora, H, nope+rope]; kv_a_proj_with_mqa [kv_lora+rope, D] -> wkv_a [D, kv_lora+rope];
  kv_a_layernorm -> kv_norm; kv_b_proj [H*(nope+v), kv_lora] -> wkv_b [kv_lora, H, nope+v];
  o_proj [D, H*v] -> wo [H, v, D]; mlp.gate.weight -> w_router, mlp.gate.e_score_correction_bias
  -> router_bias; mlp.experts.e.* one by one; mlp.shared_experts.* -> shared_gate/up/down;
  layers below first_k_dense_replace are dense (`blocks`, intermediate_size), the rest MoE
  (`moe_blocks`, indexed from the first MoE layer)
HF's q/k weights are already permuted for the "rotate half" RoPE our model
uses, so no head-dim permutation is needed.

The modules (a new family is a new module beside these, and a row of `_FAMILIES`):
  families.py  the families table; config.json both ways (`config_from_hf`, `hf_config`)
  rope.py      RoPE settings both ways (default, linear, llama3, yarn)
  names.py     our parameters' HF tensor names and layouts (`_hf_names`, `_to_ours`, `_to_hf`)
  loader.py    reading a directory (`_SafetensorsDir`, `param_sources`, `from_hf`)
  writer.py    writing one (`params_to_hf_tensors`, `write_hf_dir`, `to_hf`)
  deepseek.py, gemma.py, gpt_oss.py, qwen3_5.py  what a family has of its own
  fp8.py       block-FP8 weights in and out; common.py: what they all share
"""

from jaxtrain.models.hf.common import HFConversionError
from jaxtrain.models.hf.families import SUPPORTED_ARCHITECTURES, config_from_hf, hf_config
from jaxtrain.models.hf.gpt_oss import dequantize_mxfp4
from jaxtrain.models.hf.loader import (
    ParamSource,
    config_from_hf_dir,
    from_hf,
    load_hf_params,
    mtp_depth_in_dir,
    param_sources,
    read_hf_config,
)
from jaxtrain.models.hf.loader import _SafetensorsDir as _SafetensorsDir
from jaxtrain.models.hf.names import _hf_names as _hf_names
from jaxtrain.models.hf.writer import params_to_hf_tensors, to_hf, write_hf_dir

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "HFConversionError",
    "ParamSource",
    "config_from_hf",
    "config_from_hf_dir",
    "dequantize_mxfp4",
    "from_hf",
    "hf_config",
    "load_hf_params",
    "mtp_depth_in_dir",
    "param_sources",
    "params_to_hf_tensors",
    "read_hf_config",
    "to_hf",
    "write_hf_dir",
]

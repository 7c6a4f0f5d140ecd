"""Qwen3.5 checkpoints in and out (models/hf/qwen3_5.py), against transformers 5.25
(tests/assets/make_hf_assets.py wrote the assets):

- tests/assets/hf/qwen3_5_hybrid (Qwen3_5ForCausalLM) joins tests/test_hf.py's checkpoints:
  logits within LOGIT_ATOL of transformers', and an export that holds transformers' own
  tensors and config;
- here, the layout the Hub publishes (Qwen3_5ForConditionalGeneration: the text model under
  model.language_model., a vision tower beside it, tied embeddings from the top-level config):
  the text model's logits, its streamed conversion (`convert hf-to-ckpt`), which carries the
  vision tower back out (`ckpt-to-hf`, also of a run fine-tuned from it) bit for bit, and
  `to_hf` as Qwen3_5ForCausalLM with the source's text tensors, nothing else;
- the config mapping by hand, transformers' defaults where a key is absent;
- fine-tuning from the converted checkpoint: the first loss is the HF logits' cross-entropy,
  and the export is the wrapper again;
- what the export refuses, one line naming the key.
"""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxtrain.models.config import LinearAttentionConfig
from jaxtrain.models.hf import HFConversionError, config_from_hf, from_hf, hf_config, to_hf
from tests.test_hf import LOGIT_ATOL
from tests.test_model_families import train_from_converted

ASSETS = Path(__file__).parent / "assets"
CAUSAL = ASSETS / "hf" / "qwen3_5_hybrid"
VL = ASSETS / "hf_multimodal" / "qwen3_5_vl_text"


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_config_mapping_by_hand():
    cfg = config_from_hf(_config(CAUSAL))
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.linear_attention == LinearAttentionConfig(
        num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=8, conv_kernel=4
    )
    assert (cfg.attention_output_gate, cfg.partial_rotary_factor, cfg.norm_scale_offset) == (True, 0.25, 1.0)
    assert (cfg.qk_norm, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling) == ("head", 32, 1e7, None)
    # transformers' defaults: layer_types from full_attention_interval (4), a quarter rotated
    bare = {k: v for k, v in _config(CAUSAL).items() if k != "layer_types"}
    bare["num_hidden_layers"] = 8
    bare["full_attention_interval"] = 2
    bare["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e7}
    cfg = config_from_hf(bare)
    assert cfg.layer_kinds_by_type == ("linear_attention", "full_attention") * 4
    assert cfg.partial_rotary_factor == 0.25
    del bare["full_attention_interval"]
    assert config_from_hf(bare).layer_kinds_by_type == (("linear_attention",) * 3 + ("full_attention",)) * 2
    # a ConditionalGeneration config is its text_config, tied by the top-level key
    vl = _config(VL)
    assert config_from_hf(vl) == dataclasses.replace(config_from_hf(_config(CAUSAL)), tie_embeddings=True)
    with pytest.raises(HFConversionError, match="no text_config"):
        config_from_hf({k: v for k, v in vl.items() if k != "text_config"})


@pytest.mark.composes("lm+linear_attention")
def test_conditional_generation_checkpoint_opens_as_its_text_model(tmp_path):
    """The Hub's layout: the text model's logits are transformers' (Qwen3_5ForConditionalGeneration
    on text); its streamed conversion is the same model and converts back to the source's
    tensors, vision tower included (carried); `to_hf` of the model in memory writes
    Qwen3_5ForCausalLM with exactly the source's text tensors."""
    from jaxtrain.interchange.convert import ckpt_to_hf, hf_to_ckpt, load_params

    model = from_hf(VL)
    tokens = jax.numpy.asarray(np.load(VL / "tokens.npy"))
    logits = np.asarray(model(tokens))
    assert np.max(np.abs(logits - np.load(VL / "logits.npy"))) <= LOGIT_ATOL

    cfg = hf_to_ckpt(VL, tmp_path / "ckpt")
    assert cfg == model.cfg
    # ... and back: the wrapper, every tensor as the source holds it (text and vision tower)
    back = ckpt_to_hf(tmp_path / "ckpt", tmp_path / "back")
    assert _config(back)["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    source = load_file(str(VL / "model.safetensors"))
    again = {k: v for f in back.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert set(again) == set(source) and all(np.array_equal(again[k], v) for k, v in source.items())
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    streamed = load_params(tmp_path / "ckpt", cfg, abstract)
    jax.tree.map(np.testing.assert_array_equal, streamed, params)

    out = to_hf(model, tmp_path / "hf")
    assert _config(out)["architectures"] == ["Qwen3_5ForCausalLM"]
    source = load_file(str(VL / "model.safetensors"))
    text = {k.replace("model.language_model.", "model."): v for k, v in source.items() if "visual" not in k}
    written = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert set(written) == set(text)  # tied: no lm_head, as the source
    for key, value in text.items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)
    np.testing.assert_array_equal(np.asarray(from_hf(out)(tokens)), logits)


@pytest.mark.composes("lm+linear_attention")
def test_training_starts_from_a_converted_qwen3_5_checkpoint_and_exports_the_wrapper(tmp_path):
    """The Hub's layout through a fine-tune: `convert hf-to-ckpt` carries the vision tower,
    `train.init_from` starts from the text model (the first loss is the HF logits'
    cross-entropy on the first batch), and `ckpt-to-hf` of the run writes the wrapper again:
    the same class and config, the vision tower bit for bit, the text model's tensors renamed
    back under model.language_model."""
    first, expected, out = train_from_converted(VL, tmp_path)
    assert abs(first - expected) < 1e-4
    source = _config(VL)
    written = _config(out)
    assert written["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert {**written, "text_config": None} == {**source, "text_config": None}
    assert {k: v for k, v in written["text_config"].items() if k != "dtype"} == source["text_config"]
    theirs = load_file(str(VL / "model.safetensors"))
    ours = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert set(ours) == set(theirs)
    visual = [k for k in theirs if k.startswith("model.visual.")]
    assert visual and all(np.array_equal(ours[k], theirs[k]) for k in visual)


def test_export_names_what_qwen3_5_cannot_hold():
    cfg = config_from_hf(_config(CAUSAL))
    with pytest.raises(HFConversionError, match=r"model.attention_sinks=True \(expected False\)"):
        hf_config(dataclasses.replace(cfg, attention_sinks=True))
    with pytest.raises(HFConversionError, match="holds the text model only"):
        hf_config(cfg, "Qwen3_5ForConditionalGeneration")
    with pytest.raises(HFConversionError, match="convert as 'Qwen3_5ForCausalLM' only"):
        hf_config(cfg, "Qwen3ForCausalLM")
    # Qwen3-Next's router keeps its weights unrenormalised (norm_topk_prob false): Qwen3.5-MoE
    # cannot hold that, Qwen3NextForCausalLM (asked for by name) can; partly dense is refused
    qwen3_next = _config(ASSETS / "hf" / "qwen3_next_moe")
    nxt = config_from_hf(qwen3_next)
    with pytest.raises(HFConversionError, match=r"model.moe.normalize_top_k=False \(expected True\)"):
        hf_config(nxt)
    assert config_from_hf(hf_config(nxt, "Qwen3NextForCausalLM")) == nxt
    with pytest.raises(HFConversionError, match=r"mlp_only_layers=\[0\]"):
        config_from_hf({**qwen3_next, "mlp_only_layers": [0]})
    # without the output gate a Qwen3.5 is not what the class computes
    with pytest.raises(HFConversionError, match=r"model.attention_output_gate=False \(expected True\)"):
        hf_config(dataclasses.replace(cfg, attention_output_gate=False))

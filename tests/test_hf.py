"""Hugging Face interchange. Oracle: transformers' own float32 logits for tiny random
checkpoints it saved (tests/assets/make_hf_assets.py; committed under tests/assets/hf/)."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxtrain import models
from jaxtrain.models.hf import HFConversionError, config_from_hf, from_hf, to_hf

ASSETS = Path(__file__).parent / "assets" / "hf"
CHECKPOINTS = sorted(p.name for p in ASSETS.iterdir() if (p / "config.json").is_file())
LOGIT_ATOL = 1e-5  # f32; the issue asks <= 1e-4, we see ~2e-7. A wrong RoPE theta moves logits 5e-4.
# the model-feature pairs a checkpoint's logits check against transformers (jaxtrain/compose.py)
PAIRS = {
    "gemma2_softcap": ("dense+attention_pattern", "dense+final_softcap", "attention_pattern+final_softcap"),
    "gemma3_pattern": ("dense+attention_pattern", "dense+qk_norm", "attention_pattern+qk_norm"),
    "qwen3_moe": ("moe+qk_norm",),
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.composes(*PAIRS[n])) if n in PAIRS else n for n in CHECKPOINTS]
)
def test_from_hf_logits_match_transformers(name):
    model = from_hf(ASSETS / name)
    tokens = np.load(ASSETS / name / "tokens.npy")
    logits = np.asarray(model(jax.numpy.asarray(tokens)))
    expected = np.load(ASSETS / name / "logits.npy")
    assert logits.shape == expected.shape
    assert np.max(np.abs(logits - expected)) <= LOGIT_ATOL


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_to_hf_writes_what_transformers_wrote(tmp_path, name):
    """Round trip from_hf -> to_hf: the same tensors (names, shapes, values) and the
    config fields transformers reads, so transformers loads it with the same logits;
    and from_hf of the written directory gives the same logits again."""
    src = ASSETS / name
    model = from_hf(src)
    arch = json.loads((src / "config.json").read_text())["architectures"][0]  # (Qwen3-Next: by name)
    out = to_hf(model, tmp_path / name, max_shard_bytes=100_000, architecture=arch)  # shards + index
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    theirs = load_file(str(src / "model.safetensors"))
    ours = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        np.testing.assert_array_equal(ours[key], value.astype(np.float32), err_msg=key)
    hf_src, hf_out = (
        json.loads((src / "config.json").read_text()),
        json.loads((out / "config.json").read_text()),
    )
    assert config_from_hf(hf_out) == config_from_hf(hf_src)
    tokens = jax.numpy.asarray(np.load(src / "tokens.npy"))
    np.testing.assert_array_equal(np.asarray(from_hf(out)(tokens)), np.asarray(model(tokens)))


def test_config_mapping_by_hand():
    cfg = config_from_hf(json.loads((ASSETS / "llama_gqa_rope_llama3" / "config.json").read_text()))
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.mlp_dim) == (
        128,
        64,
        2,
        4,
        2,
        96,
    )
    assert cfg.rope_scaling == "llama3" and cfg.rope_scaling_factor == 8.0 and cfg.rope_theta == 500000.0
    assert not cfg.tie_embeddings
    mistral = config_from_hf(json.loads((ASSETS / "mistral_sliding_window" / "config.json").read_text()))
    assert mistral.sliding_window == 5 and mistral.n_kv_heads == 1


def test_unsupported_architecture_and_missing_tensor_are_named(tmp_path):
    bad = json.loads((ASSETS / "llama_tied" / "config.json").read_text())
    bad["architectures"] = ["GPT2LMHeadModel"]
    with pytest.raises(HFConversionError, match="GPT2LMHeadModel"):
        config_from_hf(bad)
    broken = tmp_path / "broken"
    shutil.copytree(ASSETS / "llama_tied", broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    from safetensors.numpy import save_file

    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(HFConversionError, match="model.layers.1.mlp.up_proj.weight"):
        from_hf(broken)
    with pytest.raises(HFConversionError, match="config.json"):
        from_hf(tmp_path / "nowhere")


def test_hf_model_is_a_ready_nnx_model():
    model = from_hf(ASSETS / "llama_tied")
    assert isinstance(model, models.Transformer) and model.cfg.tie_embeddings

"""Block-FP8 checkpoints as DeepSeek-V3/R1 and Kimi K2 publish them: `from_hf`, `convert
hf-to-ckpt` (streaming) and `ckpt-to-hf --dtype`.

Oracles: the asset tests/assets/fp8/deepseek_v3_fp8 (tests/assets/make_fp8_assets.py: the tiny
DeepSeek-V3 of tests/assets/hf/deepseek_v3_yarn quantized in torch, block loops, weight_block_size
[16, 32], so that the tiny model has several blocks per weight, partial ones at the edges, and a
swapped block axis would show) with transformers' float32 logits on its weights dequantized by
the same loops; a numpy transcription of DeepSeek's `weight_dequant` written here (block loops);
this file's own safetensors reader (header + bytes); tracemalloc for the converter's peak."""

import contextlib
import json
import math
import re
import shutil
import struct
import tracemalloc
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxtrain import cli
from jaxtrain.interchange.convert import ckpt_to_hf, hf_to_ckpt, resolve_checkpoint
from jaxtrain.models.hf import (
    HFConversionError,
    config_from_hf_dir,
    from_hf,
    load_hf_params,
    params_to_hf_tensors,
)
from jaxtrain.models.hf.fp8 import dequantize_blocks

ASSET = Path(__file__).parent / "assets" / "fp8" / "deepseek_v3_fp8"
HF_ASSETS = Path(__file__).parent / "assets" / "hf"
SOURCES = sorted(p for p in HF_ASSETS.iterdir() if (p / "config.json").is_file())
BLOCK = (16, 32)  # the asset's weight_block_size
LOGIT_ATOL = 1e-5  # tests/test_hf.py's (f32); measured 1.5e-7. Ignoring the scales moves them 0.5.
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
_DTYPES = {"F8_E4M3": E4M3, "BF16": BF16, "F32": np.dtype(np.float32)}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file, by its header (independent of models/safetensors_io.py)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + begin : 8 + n + end], _DTYPES[e["dtype"]]).reshape(e["shape"])
    return out


def read_hf_dir(path: Path) -> dict[str, np.ndarray]:
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in read_safetensors(f).items()}


def deepseek_dequant(q: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    """DeepSeek's weight_dequant, block by block: W[i, j] = Q[i, j] * S[i // br, j // bc]."""
    br, bc = block
    assert scale.shape == (math.ceil(q.shape[0] / br), math.ceil(q.shape[1] / bc))
    w = np.empty(q.shape, np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            w[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (
                q[i * br : (i + 1) * br, j * bc : (j + 1) * bc].astype(np.float32) * scale[i, j]
            )
    return w


def oracle_weights(stored: dict[str, np.ndarray], block) -> dict[str, np.ndarray]:
    """The float32 weights a loader must produce from a block-FP8 directory's tensors."""
    out = {}
    for name, w in stored.items():
        if name.endswith("_scale_inv"):
            continue
        scale = stored.get(name + "_scale_inv")
        out[name] = deepseek_dequant(w, scale, block) if scale is not None else w.astype(np.float32)
    return out


def hf_tensors(model) -> dict[str, np.ndarray]:
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return dict(params_to_hf_tensors(params, model.cfg))


@pytest.mark.composes("mla+moe")
def test_from_hf_dequantizes_by_deepseeks_rule_and_matches_transformers():
    """Every weight from_hf reads equals the block-loop dequantization exactly (the e4m3
    projections with partial edge blocks: kv_a_proj_with_mqa's 20 rows, q_b_proj's 24
    columns; the bfloat16 rest widened), and the logits equal transformers' on the dequantized
    weights within LOGIT_ATOL."""
    stored = read_safetensors(ASSET / "model.safetensors")
    kv_a = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    assert stored[kv_a].dtype == E4M3 and stored[kv_a].shape == (20, 64)
    assert stored[kv_a + "_scale_inv"].shape == (2, 2)  # rows 16 + 4, columns 32 + 32
    assert stored["model.layers.1.self_attn.q_b_proj.weight_scale_inv"].shape == (3, 1)  # 24 of 32 columns
    model = from_hf(ASSET)
    want = oracle_weights(stored, BLOCK)
    got = hf_tensors(model)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    tokens = jax.numpy.asarray(np.load(ASSET / "tokens.npy"))
    err = np.max(np.abs(np.asarray(model(tokens)) - np.load(ASSET / "logits.npy")))
    assert err <= LOGIT_ATOL, err


def test_dequantize_blocks_at_128_with_partial_edges():
    """DeepSeek-V3's kv_a_proj_with_mqa has 576 rows: a 5 x ceil(cols / 128) grid whose last
    row block holds 64 rows; columns ragged too. A grid derived from the shape (576 // 5) or
    a wrong grid is wrong: the latter is refused naming the tensor."""
    rng = np.random.default_rng(0)
    q = rng.normal(scale=100, size=(576, 300)).astype(E4M3)
    scale = rng.uniform(1e-4, 1e-2, size=(5, 3)).astype(np.float32)
    np.testing.assert_array_equal(
        dequantize_blocks(q, scale, (128, 128)), deepseek_dequant(q, scale, (128, 128))
    )
    with pytest.raises(ValueError, match=r"kv_a.*\[5, 3\]"):
        dequantize_blocks(q, scale[:4], (128, 128), "kv_a")


@pytest.mark.parametrize("src", [ASSET, *SOURCES], ids=lambda p: p.name)
def test_hf_to_ckpt_streams_to_the_params_from_hf_reads(tmp_path, src):
    """`convert hf-to-ckpt` (streamed, slice by slice) restores to exactly the parameters
    `load_hf_params` assembles in memory, tree included: the block-FP8 directory, and every
    family's asset (pattern groups, MXFP4 experts, latent attention, tied embeddings)."""
    cfg = hf_to_ckpt(src, tmp_path / "ckpt")
    with contextlib.closing(resolve_checkpoint(tmp_path / "ckpt")) as ckpt:
        restored = ckpt.restore_params()
    want = load_hf_params(src, config_from_hf_dir(src))
    assert cfg == config_from_hf_dir(src)
    assert jax.tree.structure(restored) == jax.tree.structure(want)
    jax.tree.map(np.testing.assert_array_equal, restored, want)


@pytest.mark.parametrize(
    "quantization,match",
    [
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized"},
            "quant_method='compressed-tensors'",
        ),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt='e5m2'"),
        (None, "without model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv|quantization_config"),
    ],
    ids=["int4-compressed-tensors", "e5m2", "no-quantization-config"],
)
def test_other_quantizations_are_refused_in_one_line(tmp_path, capsys, quantization, match):
    """Kimi K2-Thinking's INT4 (compressed-tensors) and anything but block e4m3 or MXFP4 are
    refused by from_hf and by `convert hf-to-ckpt` (exit 2) in one line naming it; e4m3
    tensors without a quantization_config are not read as plain values."""
    src = tmp_path / "src"
    shutil.copytree(ASSET, src)
    hf = json.loads((src / "config.json").read_text())
    if quantization is None:
        del hf["quantization_config"]
    else:
        hf["quantization_config"] = quantization
    (src / "config.json").write_text(json.dumps(hf))
    with pytest.raises(HFConversionError, match=match) as e:
        from_hf(src)
    assert "\n" not in str(e.value)
    code = cli.main(["convert", "hf-to-ckpt", str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and re.search(match, err), err


def test_a_scale_grid_that_does_not_fit_the_block_is_refused_before_writing(tmp_path, capsys):
    """o_proj [64, 48] in blocks of [16, 32] has a 4 x 2 grid; given 4 x 1 (a loader deriving
    the block from the grid would take 48-column blocks), `hf-to-ckpt` exits 2 naming the
    tensor, the shapes and the block, before it writes anything."""
    from jaxtrain.models.safetensors_io import write_file

    src = tmp_path / "src"
    shutil.copytree(ASSET, src)
    tensors = read_safetensors(src / "model.safetensors")
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :1]
    write_file(src / "model.safetensors", tensors.items())
    code = cli.main(["convert", "hf-to-ckpt", str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert name in err and "(4, 1), expected (4, 2)" in err and "[16, 32]" in err
    assert not (tmp_path / "out" / "params").exists()


def e4m3_ordinal(q: np.ndarray) -> np.ndarray:
    """e4m3 codes in value order (sign-magnitude to a signed integer): adjacent values differ by 1."""
    bits = q.view(np.uint8).astype(np.int32)
    return np.where(bits & 0x80, -(bits & 0x7F), bits & 0x7F)


def test_ckpt_to_hf_fp8_block_round_trip(tmp_path):
    """hf-to-ckpt then ckpt-to-hf --dtype fp8-block (the asset's block): every e4m3 weight comes
    back within one e4m3 step of the published one (most exactly), its scale within one
    float32 ulp; the router, norms, embeddings and head in bfloat16 as published (exactly),
    e_score_correction_bias float32; config.json carries the quantization_config; and
    from_hf of it matches transformers on the original within 1e-3 (one-step changes)."""
    hf_to_ckpt(ASSET, tmp_path / "ckpt")
    out = ckpt_to_hf(
        tmp_path / "ckpt", tmp_path / "hf", dtype="fp8-block", fp8_block=BLOCK, max_shard_bytes=60_000
    )
    assert len(list(out.glob("*.safetensors"))) > 1
    stored, back = read_safetensors(ASSET / "model.safetensors"), read_hf_dir(out)
    assert sorted(back) == sorted(stored)
    exact = total = 0
    for name, want in stored.items():
        got = back[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if name.endswith("_scale_inv"):
            assert np.all(np.abs(got - want) <= np.spacing(want)), name
        elif want.dtype == E4M3:
            steps = np.abs(e4m3_ordinal(got) - e4m3_ordinal(want))
            assert steps.max() <= 1, name
            exact, total = exact + np.sum(steps == 0), total + steps.size
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)
    assert exact / total > 0.99
    hf = json.loads((out / "config.json").read_text())
    assert hf["quantization_config"] == json.loads((ASSET / "config.json").read_text())["quantization_config"]
    logits = np.asarray(from_hf(out)(jax.numpy.asarray(np.load(ASSET / "tokens.npy"))))
    assert np.max(np.abs(logits - np.load(ASSET / "logits.npy"))) <= 1e-3


def test_ckpt_to_hf_dtype_bfloat16_and_default_float32(tmp_path, capsys):
    """`--dtype bfloat16` writes every tensor BF16 (the float32 parameters rounded), the
    default float32; fp8-block on a model without latent attention is refused in one line."""
    hf_to_ckpt(ASSET, tmp_path / "ckpt")
    assert (
        cli.main(
            ["convert", "ckpt-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "bf16"), "--dtype", "bfloat16"]
        )
        == 0
    )
    assert cli.main(["convert", "ckpt-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "f32")]) == 0
    f32, bf16 = read_hf_dir(tmp_path / "f32"), read_hf_dir(tmp_path / "bf16")
    assert sorted(f32) == sorted(bf16) and all(w.dtype == np.float32 for w in f32.values())
    for name, w in bf16.items():
        assert w.dtype == BF16, name
        np.testing.assert_array_equal(w, f32[name].astype(BF16), err_msg=name)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    hf_to_ckpt(HF_ASSETS / "llama_gqa_rope_llama3", tmp_path / "llama")
    capsys.readouterr()
    code = cli.main(
        ["convert", "ckpt-to-hf", str(tmp_path / "llama"), str(tmp_path / "x"), "--dtype", "fp8-block"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "model.mla" in err


def test_hf_to_ckpt_holds_a_few_tensors_not_the_model(tmp_path):
    """A synthetic block-FP8 DeepSeek-V3 (benchmarks/convert_memory.py) of 20 layers, ~40 MB as
    float32 parameters: converting it allocates (tracemalloc: numpy and Python, every thread)
    at most 8 times its largest float32 slice plus 2 MB, under a sixth of the model, where
    assembling the stacked arrays first needs the whole model."""
    from benchmarks.convert_memory import write_checkpoint

    src = tmp_path / "hf"
    hf = write_checkpoint(str(src), 9e6, d_model=128, experts=8)
    shapes = [
        e["shape"]
        for f in src.glob("*.safetensors")
        for name, e in json.loads(f.read_bytes()[8 : 8 + struct.unpack("<Q", f.read_bytes()[:8])[0]]).items()
        if name != "__metadata__" and not name.endswith("_scale_inv")
    ]
    model, largest = sum(4 * math.prod(s) for s in shapes), max(4 * math.prod(s) for s in shapes)
    bound = 8 * largest + 2 * 2**20
    assert hf["num_hidden_layers"] >= 16 and model > 6 * bound, (model, bound)
    tracemalloc.start()
    try:
        hf_to_ckpt(src, tmp_path / "ckpt")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= bound, (peak, bound, model)

"""`model.attention_impl: cudnn` and the GPU dispatcher (planning/attention_speeds.py).

cuDNN runs only on a GPU, so here: the run-time test that decides between cuDNN and the
flash-kernel fallback against hand-made segment ids; the dispatcher's choices against the
measured table and cuDNN's documented limits; and deviceless H100 compiles of the train step
(the compiled program calls cuDNN's fused attention forward and backward, and the Triton
flash kernel exactly where rows may pack documents), on one GPU, under shard_map on 8, and
with context parallelism. Its numbers against the reference are checked on a real GPU by
benchmarks/gpu_peer.py's attention section (docs/benchmarks.md).
"""

from __future__ import annotations

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.config import load_config
from jaxtrain.pallas_kernels.cudnn_attention import single_document_lengths
from jaxtrain.planning.attention_speeds import SPEEDS, choose_gpu_attention
from jaxtrain.planning.resolve import Placement, resolve
from tests.conftest import REPO

GPU_PEER = f"{REPO}/configs/gpu-peer.yaml"
# jax 0.12 warns on every Triton lowering; the fallback kernel is Triton on purpose
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def test_one_document_then_padding_is_what_cudnn_takes():
    seg = np.array(
        [
            [1, 1, 1, 1, 0, 0],  # one document, then padding: cuDNN, length 4
            [3, 3, 3, 3, 3, 3],  # one document (any id), no padding: length 6
        ],
        np.int32,
    )
    lengths, ok = single_document_lengths(jnp.asarray(seg))
    np.testing.assert_array_equal(lengths, [4, 6])
    assert bool(ok)
    for rows in (
        [[1, 1, 2, 2, 0, 0]],  # two documents packed
        [[1, 1, 0, 0, 1, 1]],  # padding inside the row
        [[0, 0, 0, 0, 0, 0]],  # all padding: an empty row
        [[0, 1, 1, 1, 1, 1]],  # padding first
    ):
        assert not bool(single_document_lengths(jnp.asarray(rows, jnp.int32))[1]), rows


@pytest.mark.parametrize(
    "case,expected,reason",
    [
        (dict(chip="h100", head_dim=128, window=False, compute_dtype="bfloat16"), "cudnn", "on this chip"),
        (
            dict(chip="a100", head_dim=128, window=False, compute_dtype="bfloat16"),
            "cudnn",
            "none measured on a100",
        ),
        (dict(chip="h200", head_dim=64, window=True, compute_dtype="bfloat16"), "pallas_mosaic", "on H100"),
        (dict(chip="a100", head_dim=128, window=True, compute_dtype="bfloat16"), "cudnn", "on H100"),
        (dict(chip="h100", head_dim=128, window=False, compute_dtype="float32"), "pallas", "float32"),
        (dict(chip="a100", head_dim=256, window=False, compute_dtype="bfloat16"), "pallas", "up to 128"),
        (  # this process has no GPU: jax refuses cuDNN past 128, as in a deviceless H100 compile
            dict(chip="h100", head_dim=256, window=False, compute_dtype="bfloat16"),
            "pallas_mosaic",
            "up to 128",
        ),
        (  # a process on a real H100: cuDNN measured 339 against the Hopper kernel's 219
            dict(chip="h100", head_dim=256, window=False, compute_dtype="bfloat16", cudnn_head_dim_max=256),
            "cudnn",
            "339",
        ),
        (dict(chip="h100", head_dim=64, window=False, compute_dtype="bfloat16"), "cudnn", "within 5%"),
        (dict(chip="h100", head_dim=96, window=False, compute_dtype="bfloat16"), "cudnn", "head_dim 128"),
        (dict(chip=None, head_dim=128, window=False, compute_dtype="bfloat16"), "pallas", "unknown"),
    ],
)
def test_the_gpu_dispatcher_takes_the_fastest_that_can_run_the_case(case, expected, reason):
    impl, why = choose_gpu_attention(**case)
    assert impl == expected and reason in why, why
    # the table's order on every chip measured, which the choices above follow
    for chip in {s.chip for s in SPEEDS}:
        measured = {s.impl: s.tflops for s in SPEEDS if (s.chip, s.head_dim, s.window) == (chip, 128, False)}
        assert measured["cudnn"] > measured["pallas"] > measured["xla"], chip


def test_resolve_on_an_h100_picks_cudnn_and_says_why():
    cfg = load_config(GPU_PEER)
    resolution = resolve(cfg, Placement("gpu", {"fsdp": 1}, 80 * 2**30, "H100", chip="h100"))
    assert resolution.config.model.attention_impl == "cudnn"
    note = next(n for n in resolution.notes if n.startswith("model.attention_impl=auto -> cudnn: "))
    assert "TFLOP/s" in note


def test_cudnn_needs_16_bit_compute():
    from jaxtrain.models.config import ModelConfig

    with pytest.raises(ValueError, match="attention_impl=cudnn with model.compute_dtype=float32"):
        ModelConfig(attention_impl="cudnn", compute_dtype="float32").validate()


# --- deviceless H100 compiles ----------------------------------------------------------------


def _cudnn_installed() -> bool:
    return importlib.util.find_spec("nvidia.cudnn") is not None


def _compiled_kernels(n: int, *overrides: str) -> set[str]:
    """Custom-call targets of the compiled train step of a small bf16 model on n H100s (the
    `jaxtrain compile` path: the config's mesh on the target, resolved for it). One layer: every
    layer calls the same attention, and on one GPU the layers are unrolled, so a second layer
    would only lower and compile the same kernels again."""
    from jaxtrain.planning import compile as deviceless
    from jaxtrain.sharding import targets
    from tests.conftest import tiny_config

    if not targets.cuda_available() or not _cudnn_installed():
        pytest.skip("deviceless GPU compiles with cuDNN need the gpu-aot extra")
    cfg = tiny_config(
        None,
        "model.compute_dtype=bfloat16",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.head_dim=64",
        "train.seq_len=256",
        "train.global_batch_size=8",
        "model.attention_impl=cudnn",
        "model.n_layers=1",
        *overrides,
    )
    report = deviceless.compile_report(
        cfg, deviceless.parse_target("gpu:h100", gpus_per_host=n), estimate=False
    )
    return set(report["custom_calls"])


CUDNN = {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
TRITON = "__gpu$xla.gpu.triton"


@pytest.mark.deviceless
def test_rows_of_one_document_compile_to_cudnn_alone():
    """Synthetic rows are one document each: the model gets no segment ids, no fallback."""
    calls = _compiled_kernels(1, "data.source=synthetic")
    assert CUDNN <= calls and TRITON not in calls, calls


@pytest.mark.deviceless
def test_rows_that_may_pack_documents_also_compile_the_flash_kernel(tmp_path):
    """Text rows pack documents: cuDNN where a batch's rows are one document each, the flash
    kernel otherwise (on an H100 the Hopper one: gpu_flash_kernel auto); here on 8 GPUs, batch
    and heads split (shard_map)."""
    text = tmp_path / "a.txt"
    text.write_text("some words\n")
    calls = _compiled_kernels(8, "data.source=text", f"data.paths=[{text}]", "mesh.fsdp=4", "mesh.tensor=2")
    assert CUDNN <= calls and any(c.startswith("mosaic_gpu") for c in calls), calls
    assert TRITON not in calls, calls


@pytest.mark.deviceless
def test_context_parallel_runs_the_flash_kernel_in_the_ring():
    """The ring's chunks here (256 / 2 shards / 2 zig-zag halves = 64 tokens) are no multiple
    of the Hopper kernel's tile, so gpu_flash_kernel auto resolves to the Triton kernel."""
    calls = _compiled_kernels(8, "mesh.fsdp=4", "mesh.context=2")
    assert TRITON in calls and not (CUDNN & calls), calls


@pytest.mark.deviceless
def test_pallas_compiles_to_the_hopper_kernels_alone_on_an_h100():
    """`model.attention_impl: pallas` on an H100 (gpu_flash_kernel auto -> mosaic): the step's
    attention is the Mosaic GPU flash kernels (forward, dQ, dK/dV), with neither cuDNN nor the
    Triton kernel beside them; `gpu_flash_kernel: triton` keeps the Triton one."""
    calls = _compiled_kernels(1, "data.source=synthetic", "model.attention_impl=pallas")
    assert any(c.startswith("mosaic_gpu") for c in calls), calls
    assert TRITON not in calls and not (CUDNN & calls), calls
    calls = _compiled_kernels(
        1, "data.source=synthetic", "model.attention_impl=pallas", "model.gpu_flash_kernel=triton"
    )
    assert TRITON in calls and not any(c.startswith("mosaic_gpu") for c in calls), calls


@pytest.mark.deviceless
def test_pallas_mosaic_runs_the_hopper_kernel_in_the_ring():
    """Under context parallelism `pallas_mosaic`'s ring blocks are the Hopper kernels too."""
    calls = _compiled_kernels(
        2,
        "mesh.context=2",
        "model.attention_impl=pallas_mosaic",
        "train.seq_len=512",  # chunks of 128 (seq / 2 shards / 2 zig-zag chunks): the kernel's tile
    )
    assert any(c.startswith("mosaic_gpu") for c in calls), calls
    assert TRITON not in calls and not (CUDNN & calls), calls


def test_auto_takes_the_hopper_kernel_only_where_measured_faster(monkeypatch):
    """The rule reads the table: with a (hypothetical) H100 row for pallas_mosaic more than
    CUDNN_MARGIN above cuDNN's, auto picks it on an H100 but not on an A100 (not Hopper) nor with
    a softcap or head_dim 96; with the measured row (2% ahead), cuDNN keeps the case."""
    from jaxtrain.planning import attention_speeds as speeds

    args = dict(head_dim=128, window=False, compute_dtype="bfloat16")
    assert choose_gpu_attention(chip="h100", **args)[0] == "cudnn"
    measured = next(s for s in speeds.SPEEDS if s.impl == "pallas_mosaic" and s.head_dim == 128)
    assert not measured.window and measured.tflops > next(
        s.tflops
        for s in speeds.SPEEDS
        if (s.chip, s.impl, s.head_dim, s.window) == ("h100", "cudnn", 128, False)
    )
    row = speeds.Speed("h100", 128, False, "pallas_mosaic", 450.0, "hypothetical")
    monkeypatch.setattr(speeds, "SPEEDS", (*speeds.SPEEDS, row))
    assert speeds.choose_gpu_attention(chip="h100", **args)[0] == "pallas_mosaic"
    assert speeds.choose_gpu_attention(chip="a100", **args)[0] != "pallas_mosaic"
    assert speeds.choose_gpu_attention(chip="h100", **{**args, "head_dim": 96})[0] != "pallas_mosaic"
    assert speeds.choose_gpu_attention(chip="h100", softcap=True, **args)[0] == "pallas"


@pytest.mark.parametrize(
    "placement,overrides,kernel,why",
    [
        (("gpu", "h100"), (), "mosaic", "faster than the Triton one on this chip at head_dim 128: 424"),
        (("gpu", "h200"), (), "mosaic", "on H100 at head_dim 128"),
        (("gpu", "a100"), (), "triton", "needs an sm90 chip"),
        (("gpu", "h100"), ("model.compute_dtype=float32",), "triton", "16-bit compute"),
        (("gpu", "h100"), ("model.head_dim=96",), "triton", "head_dim 64/128/256"),
        (("tpu", "v5p"), (), "triton", None),  # not used there: resolved, not logged
    ],
)
def test_the_gpu_flash_kernel_is_the_hopper_one_where_it_can_run(placement, overrides, kernel, why):
    """`model.gpu_flash_kernel: auto`: the Hopper kernel on sm90 chips (measured faster than
    Triton on the H100 at every head_dim timed), Triton where the Hopper kernel cannot run the
    case; a value given is kept and not logged."""
    platform, chip = placement
    cfg = load_config(GPU_PEER, list(overrides))
    resolution = resolve(cfg, Placement(platform, {"fsdp": 1}, 80 * 2**30, chip.upper(), chip=chip))
    assert resolution.config.model.gpu_flash_kernel == kernel
    notes = [n for n in resolution.notes if n.startswith("model.gpu_flash_kernel")]
    if why is None:
        assert not notes, notes
    else:
        assert len(notes) == 1 and notes[0].startswith(f"model.gpu_flash_kernel=auto -> {kernel}: "), notes
        assert why in notes[0], notes
    given = resolve(
        load_config(GPU_PEER, ["model.gpu_flash_kernel=triton"]),
        Placement("gpu", {"fsdp": 1}, 80 * 2**30, "H100", chip="h100"),
    )
    assert given.config.model.gpu_flash_kernel == "triton"
    assert not any(n.startswith("model.gpu_flash_kernel") for n in given.notes)


def test_the_hopper_kernel_yields_to_triton_where_the_ring_chunks_miss_its_tile():
    """Under ring attention the Hopper kernel needs chunks (seq_len / (2 x context)) a multiple
    of its tile: 2048 / 4 = 512 is; 2176 / 4 = 544 is not, so auto resolves to Triton there."""
    h100 = dict(device_memory=80 * 2**30, memory_source="H100", chip="h100")
    fits = resolve(load_config(GPU_PEER), Placement("gpu", {"fsdp": 1, "context": 2}, **h100))
    assert fits.config.model.gpu_flash_kernel == "mosaic"
    cfg = load_config(GPU_PEER, ["train.seq_len=2176"])
    misses = resolve(cfg, Placement("gpu", {"fsdp": 1, "context": 2}, **h100))
    assert misses.config.model.gpu_flash_kernel == "triton"
    assert any("chunks of 544 tokens" in n for n in misses.notes), misses.notes

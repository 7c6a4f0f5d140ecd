# ruff: noqa: E501  (HLO lines are as long as XLA writes them)
"""benchmarks/step_profile.py --gpu sums a GPU trace by what each kernel does. Oracle: HLO
instructions as XLA writes them for one H100 (a deviceless compile of the dropless MoE step),
classified by hand: a Pallas grouped matmul is a matmul, not attention, though both are Pallas
Triton custom calls; cuDNN's attention; a cuBLAS GEMM; a reduction fusion."""

import sys

from tests.conftest import REPO

sys.path.insert(0, f"{REPO}/benchmarks")

import step_profile  # noqa: E402

GROUPED = (
    '  %pallas_call.31 = bf16[32768,1408]{1,0} custom-call(%get-tuple-element.934, %get-tuple-element.933, '
    "%get-tuple-element.932, %get-tuple-element.931, %bitcast.48.0, /*index=5*/%bitcast.50.0), "
    'custom_call_target="__gpu$xla.gpu.triton", operand_layout_constraints={s32[264]{0}, s32[264]{0}, '
    "s32[264]{0}, s32[264]{0}, bf16[32768,2048]{1,0}, bf16[8,2048,1408]{2,1,0}}, "
    'api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(traced)/jvp(forward)/while/body/eval_jaxpr/'
    'jvp(grouped_matmul)/pallas_call" scheduling_name="pallas_call.31" stack_frame_id=568}, '
    'backend_config={debug = false, grid_x = 11 : i32, ir = "ML\\EFR", name = "grouped_matmul"}'
)
FLASH = (
    '  %pallas_call.2 = bf16[8,2048,16,128]{3,2,1,0} custom-call(%q, %k, %v), custom_call_target='
    '"__gpu$xla.gpu.triton", metadata={op_name="jit(traced)/jvp(forward)/flash_attention/pallas_call"}, '
    'backend_config={name = "mha_forward"}'
)
CUDNN = (
    '  %custom-call.7 = (bf16[8,16,2048,128]{3,2,1,0}, f32[8,16,2048]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), '
    'custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(traced)/jvp(forward)/dot_product_attention"}'
)
GEMM = (
    '  %gemm_fusion_dot.98 = bf16[16384,2048]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion_dot.98_computation, '
    'metadata={op_name="jit(traced)/jvp(forward)/...d,df->...f/dot_general"}'
)
REDUCE = (
    "  %input_reduce_fusion.5 = f32[16384]{0} fusion(%x), kind=kInput, calls=%fused_reduce.5, "
    'metadata={op_name="jit(traced)/transpose(jvp(forward))/reduce_sum"}'
)


def test_kernels_are_summed_by_what_they_do():
    ops, _, names = step_profile.hlo_table("\n".join([GROUPED, FLASH, CUDNN, GEMM, REDUCE]))
    assert names["pallas_call.31"].endswith("jvp(grouped_matmul)/pallas_call")
    # the trace names a Pallas kernel after the HLO op, or (on some versions) its own name
    for kernel in ("pallas_call_31", "grouped_matmul"):
        assert step_profile.gpu_kind("pallas_call.31", kernel, ops) == "grouped matmuls (Pallas)"
    assert step_profile.gpu_kind("pallas_call.2", "pallas_call_2", ops) == "attention"
    assert step_profile.gpu_kind("custom-call.7", "cudnn_sdpa_fwd", ops) == "attention"
    assert step_profile.gpu_kind("gemm_fusion_dot.98", "gemm_fusion_dot_98", ops) == "matmuls"
    assert step_profile.gpu_kind("input_reduce_fusion.5", "input_reduce_fusion_5", ops) == "reductions"
    assert step_profile.phase(names["input_reduce_fusion.5"]) == "backward"

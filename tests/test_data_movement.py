# ruff: noqa: E501  (HLO lines are as long as XLA writes them)
"""jaxtrain/planning/data_movement.py: bytes a compiled program writes only to move or fill
memory, and what each of its kernels reads and writes. Oracle: a hand-written program whose
bytes are counted by hand (a zero fill, a loop of four steps writing a slice of a stacked
buffer in place, squaring a value and copying it, a slice, a two-output slice fusion in a TPU
layout, whose tuple shape holds parentheses, a cuBLAS GEMM with its workspace, a Pallas
kernel, a reduction fusion, a slice of converted weights, and an AllocateBuffer)."""

from __future__ import annotations

from jaxtrain.planning.data_movement import data_movement, traffic
from jaxtrain.planning.report import shape_bytes

HLO = """HloModule jit_step, entry_computation_layout={(bf16[8,16]{1,0})->bf16[4,8,16]{2,1,0}}

%fused_broadcast (param_0: f32[]) -> bf16[4,8,16] {
  %param_0 = f32[] parameter(0)
  %convert.1 = bf16[] convert(%param_0)
  ROOT %broadcast.1 = bf16[4,8,16]{2,1,0} broadcast(%convert.1), dimensions={}
}

%fused_dus (param_0.1: bf16[4,8,16], param_1.1: bf16[8,16], param_2.1: s32[]) -> bf16[4,8,16] {
  %param_0.1 = bf16[4,8,16]{2,1,0} parameter(0)
  %param_1.1 = bf16[8,16]{1,0} parameter(1)
  %bitcast.1 = bf16[1,8,16]{2,1,0} bitcast(%param_1.1)
  %param_2.1 = s32[] parameter(2)
  %constant_0 = s32[] constant(0)
  %add.1 = s32[] add(%param_2.1, %constant_0)
  ROOT %dynamic-update-slice.1 = bf16[4,8,16]{2,1,0} dynamic-update-slice(%param_0.1, %bitcast.1, %add.1, %constant_0, %constant_0)
}

%fused_multiply (param_0.2: bf16[8,16]) -> bf16[8,16] {
  %param_0.2 = bf16[8,16]{1,0} parameter(0)
  ROOT %multiply.1 = bf16[8,16]{1,0} multiply(%param_0.2, %param_0.2)
}

%fused_two_slices (param_0.3: bf16[8,16]) -> (bf16[2,16], bf16[4,16]) {
  %param_0.3 = bf16[8,16]{1,0:T(8,128)(2,1)} parameter(0)
  %slice.2 = bf16[2,16]{1,0:T(8,128)(2,1)} slice(%param_0.3), slice={[0:2], [0:16]}
  %slice.3 = bf16[4,16]{1,0:T(8,128)(2,1)} slice(%param_0.3), slice={[2:6], [0:16]}
  ROOT %tuple.1 = (bf16[2,16]{1,0:T(8,128)(2,1)}, bf16[4,16]{1,0:T(8,128)(2,1)}) tuple(%slice.2, %slice.3)
}

%fused_reduce (param_0.4: bf16[8,16]) -> f32[8] {
  %param_0.4 = bf16[8,16]{1,0} parameter(0)
  %convert.2 = f32[8,16]{1,0} convert(%param_0.4)
  %constant_1 = f32[] constant(0)
  ROOT %reduce.1 = f32[8]{0} reduce(%convert.2, %constant_1), dimensions={1}, to_apply=%add_f32
}

%fused_convert_slice (param_0.5: f32[4,8,16]) -> bf16[1,8,16] {
  %param_0.5 = f32[4,8,16]{2,1,0} parameter(0)
  %convert.3 = bf16[4,8,16]{2,1,0} convert(%param_0.5)
  ROOT %slice.4 = bf16[1,8,16]{2,1,0} slice(%convert.3), slice={[0:1], [0:8], [0:16]}
}

%add_f32 (x: f32[], y: f32[]) -> f32[] {
  %x.1 = f32[] parameter(0)
  %y.1 = f32[] parameter(1)
  ROOT %add.2 = f32[] add(%x.1, %y.1)
}

%body (p: (s32[], bf16[8,16], bf16[4,8,16])) -> (s32[], bf16[8,16], bf16[4,8,16]) {
  %p = (s32[], bf16[8,16]{1,0}, bf16[4,8,16]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[8,16]{1,0} get-tuple-element(%p), index=1
  %buf = bf16[4,8,16]{2,1,0} get-tuple-element(%p), index=2
  %y = bf16[8,16]{1,0} fusion(%x), kind=kLoop, calls=%fused_multiply
  %upd = bf16[4,8,16]{2,1,0} fusion(%buf, %y, %i), kind=kLoop, calls=%fused_dus
  %c = bf16[8,16]{1,0} copy(%y)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[8,16]{1,0}, bf16[4,8,16]{2,1,0}) tuple(%next, %c, %upd)
}

%cond (q: (s32[], bf16[8,16], bf16[4,8,16])) -> pred[] {
  %q = (s32[], bf16[8,16]{1,0}, bf16[4,8,16]{2,1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%j, %four), direction=LT
}

ENTRY %main.9 (a: bf16[8,16], wts: f32[4,8,16]) -> bf16[4,8,16] {
  %a = bf16[8,16]{1,0} parameter(0)
  %wts = f32[4,8,16]{2,1,0} parameter(1)
  %layer0 = bf16[1,8,16]{2,1,0} fusion(%wts), kind=kLoop, calls=%fused_convert_slice
  %zero = f32[] constant(0)
  %fill = bf16[4,8,16]{2,1,0} fusion(%zero), kind=kLoop, calls=%fused_broadcast
  %s = bf16[2,16]{1,0} slice(%a), slice={[0:2], [0:16]}
  %two = (bf16[2,16]{1,0:T(8,128)(2,1)}, bf16[4,16]{1,0:T(8,128)(2,1)}) fusion(%a), kind=kLoop, calls=%fused_two_slices
  %dot = (bf16[8,8]{1,0}, s8[4096]{0}) custom-call(%a, %a), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/forward/dot_general"}
  %sum = f32[8]{0} fusion(%a), kind=kInput, calls=%fused_reduce
  %att = bf16[8,16]{1,0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", backend_config={debug = false, grid_x = 1 : i32, name = "mha_forward", num_warps = 4 : i32}
  %spare = bf16[4,8,16]{2,1,0} custom-call(), custom_call_target="AllocateBuffer"
  %start = s32[] constant(0)
  %t0 = (s32[], bf16[8,16]{1,0}, bf16[4,8,16]{2,1,0}) tuple(%start, %a, %fill)
  %w = (s32[], bf16[8,16]{1,0}, bf16[4,8,16]{2,1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"},"known_init_step":{"init":"0","step":"1"}}
  ROOT %r = bf16[4,8,16]{2,1,0} get-tuple-element(%w), index=2
}
"""


def test_shape_bytes_of_arrays_and_tuples():
    assert shape_bytes("bf16[4,8,16]{2,1,0}") == 4 * 8 * 16 * 2
    assert shape_bytes("(f32[3]{0}, s8[2,2]{1,0:T(8,128)(4,1)}, pred[])") == 12 + 4 + 1
    assert shape_bytes("f8e4m3fn[10]{0}") == 10


def test_counts_each_kind_as_counted_by_hand():
    row = 8 * 16 * 2  # one [8, 16] bf16 value
    assert data_movement(HLO) == {
        "fills": (1, 4 * row),  # the stacked buffer, once, before the loop
        "in-place updates": (4, 4 * row),  # one slice a step: the update, not the buffer
        "slices": (2, 2 * 16 * 2 + (2 + 4) * 16 * 2),  # the slice, then both of the fusion's
        "copies and transposes": (4, 4 * row),  # the copy, every step
    }  # the multiply computes: not counted


def test_traffic_counts_what_each_kernel_reads_and_writes_as_counted_by_hand():
    row = 8 * 16 * 2
    assert traffic(HLO) == {
        "matmuls": (1, 2 * row, 8 * 8 * 2),  # both operands; the product, not the s8 workspace
        "attention": (1, row, row),  # a Pallas kernel, by its name
        # the square, every step; one layer's bf16 copy of float32 weights, which reads only
        # that layer's part of them (the slice after the convert)
        "elementwise fusions": (5, 4 * row + 8 * 16 * 4, 4 * row + 8 * 16 * 2),
        "reductions": (1, row, 8 * 4),
        # the fill reads a scalar; the slices their slices; the in-place update its update,
        # not the buffer; the copy its input. The AllocateBuffer moves nothing.
        "moves": (11, (2 + 2 + 4) * 16 * 2 + 4 * row + 4 * row, 4 * row + (2 + 2 + 4) * 16 * 2 + 8 * row),
    }

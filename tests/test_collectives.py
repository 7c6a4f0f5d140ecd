"""Each parallelism emits the collectives it promises, over the mesh axis it promises.

The oracle is the parallelism's definition (FSDP gathers weights and reduces
gradients over `fsdp`, tensor parallelism all-reduces over `tensor`, ...), read
off the optimized HLO of the tiny model's forward + backward program with
`sharding.collectives` (replica groups mapped back to mesh axes). A rule change
that silently all-gathers full weights over an axis that does not shard them
fails here even though training would still be correct.

A new parallelism is one more row in CASES.
"""

import itertools
import math
import os
import re

import jax
import pytest
from flax import nnx

from jaxtrain import sharding
from jaxtrain.config import load_config
from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh
from jaxtrain.sharding import targets
from jaxtrain.sharding.collectives import (
    _OP,
    COLLECTIVES,
    collectives_by_axes,
    match_op,
    parse_groups,
    spanned_axes,
)
from jaxtrain.trainer.batches import abstract_batch
from jaxtrain.trainer.program import build_program
from tests.conftest import REPO, replace, tiny_config

# attention_impl=xla: the flash kernel's TPU blocks need longer sequences, and these tests are
# about the collectives the partitioner emits, the same around either attention
SMALL = (
    "model.d_model=64",
    "model.mlp_dim=128",
    "model.vocab_size=128",
    "train.seq_len=32",
    "model.attention_impl=xla",
)
MOE = ("model.moe.expert_mlp_dim=64",)

# name: (config overrides, mesh, rules, {kind: axes it must appear over})
CASES = {
    "dp": ((), dict(data=8), "data_parallel", {"all-reduce": ("data",)}),
    # CPU lowers the FSDP gradient reduce-scatter as all-reduce + dynamic-slice (see the TPU test)
    "fsdp": ((), dict(fsdp=8), "fsdp", {"all-gather": ("fsdp",), "all-reduce": ("fsdp",)}),
    "tp": ((), dict(data=4, tensor=2), "fsdp_tensor", {"all-reduce": ("tensor",)}),
    "ep": (MOE, dict(expert=8), "fsdp_tensor", {"all-to-all": ("expert",)}),
    # Megatron sequence parallelism: the residual stream split on seq over tensor, gathered
    # at each TP region's input (XLA:CPU leaves the reduce-scatter an all-reduce; see
    # tests/test_sequence_parallel.py for the TPU compile)
    "sp": ((), dict(data=4, tensor=2), "fsdp_tensor_sp", {"all-gather": ("tensor",)}),
    # pipeline: the stage buffer's shift is a collective-permute over stage (sharding/pipeline.py)
    "pp": (
        ("pipeline.schedule=gpipe",),
        dict(data=4, stage=2),
        "fsdp_tensor",
        {"collective-permute": ("stage",)},
    ),
    "cp": (
        ("model.context_impl=ring",),
        dict(data=2, context=4),
        "fsdp_tensor",
        {"collective-permute": ("context",)},
    ),
}


def small_config(overrides, mesh, rules):
    if overrides == MOE:  # configs/tiny-moe.yaml: 8 experts, top-2, dropless
        base = ["logging.progress=false", "logging.tensorboard=false", *SMALL, *overrides]
        cfg = load_config(os.path.join(REPO, "configs", "tiny-moe.yaml"), base)
    else:
        cfg = tiny_config(None, *SMALL, *overrides)
    return replace(cfg, mesh=dict(mesh, rules=rules))


def compiled_hlo(cfg, devices):
    """Optimized HLO of the forward + backward program (loss_and_grads) on `devices`."""
    mesh = sharding.make_mesh(cfg.mesh.sizes(), devices)
    cfg = resolve_for_mesh(cfg, mesh)
    rules = axis_rules(cfg)
    # build_program runs a few eager ops, which compile-only devices cannot (jaxtrain/planning/compile.py)
    with sharding.axis_rules(rules):
        program = build_program(cfg, mesh, rules)
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        params = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(program.abstract_params)
        )
        return (
            program,
            mesh,
            program.loss_and_grads.lower(params, abstract_batch(cfg, program.batch_sharding)),
        )


def while_bodies(hlo: str) -> dict[str, str]:
    """{while loop body computation name: its text} of optimized HLO text."""
    bodies = set(re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", hlo))
    comps = re.split(r"\n(?=\S)", hlo)
    return {c.split()[0].lstrip("%"): c for c in comps if c.split() and c.split()[0].lstrip("%") in bodies}


def param_shapes_and_axes(program, mesh, rules):
    """{shape a parameter can have in the program: mesh axes sharding that parameter}.

    The shapes: global, and split by any subset of its sharding axes (a gather over one
    axis leaves the others split), each also without the stacked `layers` dim (a scan
    body sees one layer); leading 1s dropped (`_dims`)."""
    sizes = dict(mesh.shape)
    shapes = nnx.to_pure_dict(program.abstract_params)
    out: dict[tuple[int, ...], set[str]] = {}
    for axes, x in zip(
        jax.tree.leaves(program.param_axes, is_leaf=lambda a: isinstance(a, tuple)), jax.tree.leaves(shapes)
    ):
        spec = list(sharding.logical_to_spec(axes, rules, mesh, x.shape))
        spec += [None] * (len(x.shape) - len(spec))
        placed = [(d, a) for d, entry in enumerate(spec) for a in sharding.axes_tuple(entry)]
        sharded = {a for _, a in placed}
        for subset in itertools.product((False, True), repeat=len(placed)):
            shape = list(x.shape)
            for (d, a), split in zip(placed, subset):
                shape[d] //= sizes[a] if split else 1
            for s in (shape, shape[1:] if axes and axes[0] == "layers" else None):
                if s is not None:
                    out.setdefault(_strip(s), set()).update(sharded)
    return out


def _strip(dims):
    dims = list(dims)
    while dims and dims[0] == 1:
        dims.pop(0)
    return tuple(dims)


def _dims(shape_text):
    m = re.match(r"\(?\w+\[([0-9,]*)\]", shape_text)
    return _strip(int(d) for d in m.group(1).split(",") if d) if m else None


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    overrides, mesh, rules, expected = CASES[request.param]
    cfg = small_config(overrides, mesh, rules)
    n = math.prod(cfg.mesh.sizes().values())
    program, m, lowered = compiled_hlo(cfg, jax.devices()[:n])
    hlo = lowered.compile().as_text()
    cfg = resolve_for_mesh(cfg, m)
    rules = axis_rules(cfg)
    return request.param, program, m, rules, expected, collectives_by_axes(hlo, m)


def test_parallelism_emits_its_collectives_over_its_axis(case):
    name, _, _, _, expected, ops = case
    for kind, axes in expected.items():
        found = {op.axes for op in ops if op.kind == kind}
        assert axes in found, f"{name}: no {kind} over {axes}; {kind} ops span {found or 'nothing'}"
    # Nothing communicates over an axis the mesh does not use (size-1 axes never appear).
    used = {op_axis for op in ops for op_axis in op.axes}
    assert used <= {a for a, s in dict(case[2].shape).items() if s > 1}


def test_no_parameter_is_gathered_over_an_axis_that_does_not_shard_it(case):
    name, program, mesh, rules, _, ops = case
    by_shape = param_shapes_and_axes(program, mesh, rules)
    param_axes = set().union(*by_shape.values())
    for op in ops:
        if op.kind != "all-gather":
            continue
        # No axis that shards no parameter gathers anything parameter-shaped...
        dims = _dims(op.shape)
        if dims in by_shape:
            assert set(op.axes) <= by_shape[dims], f"{name}: {op.name} {op.shape} gathered over {op.axes}"
    if name == "dp":  # pure data parallelism: parameters replicated, nothing to gather
        assert not [op for op in ops if op.kind == "all-gather"]
        assert not param_axes
    if name == "sp":  # the activations are gathered, never the weights
        params = [op for op in ops if op.kind == "all-gather" and _dims(op.shape) in by_shape]
        assert not params, f"sp gathers parameter-shaped arrays: {[(op.name, op.shape) for op in params]}"
    if name == "tp":  # `data` shards no parameter: no all-gather over it at all
        assert not [op for op in ops if op.kind == "all-gather" and "data" in op.axes]


@pytest.mark.parametrize(
    "remat, dtype, passes", [("none", "bfloat16", 1), ("full", "bfloat16", 2), ("none", "float32", 2)]
)
def test_cpu_gathers_layer_weights_once_under_remat_none(remat, dtype, passes):
    """With model.cpu_tuning in bfloat16 under remat none the backward pass reuses the
    forward's fsdp-gathered layer weights (models/cpu_tuning.py gathered_weight): the layer
    scans' weight all-gathers sit in one loop body (the forward's), and in two (forward and
    recompute) under remat full, as in float32, which keeps the partitioner's layout. Either
    way they gather over fsdp only: the tensor-sharded dims stay sharded."""
    overrides = ("model.n_layers=2", f"model.remat={remat}", f"model.compute_dtype={dtype}")
    cfg = small_config(overrides, dict(fsdp=4, tensor=2), "fsdp_tensor")
    program, mesh, lowered = compiled_hlo(cfg, jax.devices()[:8])
    hlo = lowered.compile().as_text()
    by_shape = param_shapes_and_axes(program, mesh, axis_rules(resolve_for_mesh(cfg, mesh)))
    gathering = []
    for name, body in while_bodies(hlo).items():
        ops = [op for op in collectives_by_axes(body, mesh) if op.kind == "all-gather"]
        weights = [op for op in ops if _dims(op.shape) in by_shape]
        assert all(op.axes == ("fsdp",) for op in weights), [(op.shape, op.axes) for op in weights]
        if len(ops) >= 7:  # q, k, v, o and the three MLP weights of a layer (their layouts vary)
            gathering.append(name)
    assert len(gathering) == passes, gathering


def test_spanned_axes_by_hand():
    """Mesh (data=2, tensor=4), ids row-major: {0..3} differ in tensor only; {0,4} in data."""
    names = ("data", "tensor")
    assert spanned_axes([[0, 1, 2, 3], [4, 5, 6, 7]], (2, 4), names) == ("tensor",)
    assert spanned_axes([[0, 4], [1, 5]], (2, 4), names) == ("data",)
    assert spanned_axes([[0, 5]], (2, 4), names) == ("data", "tensor")
    assert spanned_axes([[3]], (2, 4), names) == ()
    # iota form: [4,2]<=[2,4]T(1,0) is the transpose: groups {0,4}, {1,5}, ...
    assert parse_groups("[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert parse_groups("{{0,1},{2,3}}") == [[0, 1], [2, 3]]
    # Shardy's named form: groups run along the braced axes of a row-major mesh
    assert parse_groups("mesh['axis_0'=4,'axis_1'=2] {'axis_1'}") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert parse_groups("mesh['data'=2,'stage'=1,'tensor'=2] {'data'}") == [[0, 2], [1, 3]]
    assert parse_groups("mesh['a'=2,'b'=2] {'a','b'}") == [[0, 1, 2, 3]]
    assert "ragged-all-to-all" in COLLECTIVES


def test_match_op_reads_lines_as_the_plain_pattern_does():
    """`match_op` cuts the line after the first collective opcode before matching `_OP` (which
    is quadratic in a line's length); on lines of every form it matches what `_OP` matches.
    The long line is a kernel serialised into a custom call, as in a GPU program."""
    lines = [
        "  %all-gather.3 = bf16[8,128]{1,0} all-gather(bf16[2,128]{1,0} %p), replica_groups={{0,1,2,3}}",
        "  ROOT %ar = (f32[4]{0}, f32[4]{0}) all-reduce-start(f32[4]{0} %x), to_apply=%add",
        "  %ard = f32[4]{0} all-reduce-done((f32[4]{0}, f32[4]{0}) %ar)",
        "  %f = f32[4]{0} fusion(f32[4]{0} %all-reduce.1), kind=kLoop, calls=%fused",
        "  %cp = bf16[2]{0} collective-permute(bf16[2]{0} %a), source_target_pairs={{0,1},{1,0}}",
        "  %m = f32[2]{0} multiply(f32[2]{0} %a, f32[2]{0} %b)",
        '  %k = bf16[8]{0} custom-call(bf16[8]{0} %a), backend_config="' + "ab=c" * 2000 + '"',
    ]
    for line in lines:
        ours, plain = match_op(line), _OP.search(line)
        assert (ours and ours.groups()) == (plain and plain.groups()), line[:80]
    assert [bool(match_op(line)) for line in lines] == [True, True, False, False, True, False, False]
    assert match_op(lines[0]).group(3) == "all-gather" and match_op(lines[1]).group(4) == "-start"


# --- deviceless: what the accelerator compilers emit ---------------------------------

needs_tpu = pytest.mark.skipif(not targets.tpu_available(), reason="libtpu not installed")
needs_cuda = pytest.mark.skipif(not targets.cuda_available(), reason="jax-cuda12-plugin not installed")


@needs_tpu
def test_fsdp_reduce_scatters_gradients_on_tpu():
    """The TPU compiler keeps the FSDP gradient reduction a reduce-scatter (CPU: all-reduce)."""
    cfg = small_config((), dict(fsdp=4), "fsdp")
    _, mesh, lowered = compiled_hlo(cfg, targets.tpu_topology_devices("v5p:2x2x1"))
    ops = collectives_by_axes(lowered.compile().as_text(), mesh)
    kinds = {(op.kind, op.axes) for op in ops}
    assert ("all-gather", ("fsdp",)) in kinds and ("reduce-scatter", ("fsdp",)) in kinds


def _ragged_moe_hlo(devices):
    import jax.numpy as jnp

    from jaxtrain.models.config import MoEConfig
    from jaxtrain.models.moe import moe_layer

    m = MoEConfig(num_experts=8, top_k=2, dispatch="dropless", exchange="ragged")
    b, s, d, f, e = 8, 64, 128, 128, 8
    mesh = sharding.make_mesh({"expert": 8}, devices)
    rules = sharding.DEFAULT_RULES
    spec = lambda axes, shape: jax.sharding.NamedSharding(
        mesh, sharding.logical_to_spec(axes, rules, mesh, shape)
    )
    shapes = [
        ((b, s, d), ("batch", "seq", "act_embed"), jnp.bfloat16),
        ((d, e), ("embed", None), jnp.float32),
        ((e, d, f), ("expert", "embed", "mlp"), jnp.bfloat16),
        ((e, d, f), ("expert", "embed", "mlp"), jnp.bfloat16),
        ((e, f, d), ("expert", "mlp", "embed"), jnp.bfloat16),
    ]
    args = [jax.ShapeDtypeStruct(shape, dt, sharding=spec(axes, shape)) for shape, axes, dt in shapes]

    def loss(x, w_router, w_gate, w_up, w_down):
        y, stats = moe_layer(x, w_router, None, w_gate, w_up, w_down, m)
        return jnp.mean(y.astype(jnp.float32) ** 2) + 0.01 * stats["aux_loss"]

    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 2))).lower(*args).compile().as_text()
    return collectives_by_axes(hlo, mesh)


@needs_tpu
def test_ragged_moe_exchange_compiles_to_ragged_all_to_all_on_tpu():
    ops = _ragged_moe_hlo(targets.tpu_topology_devices("v5p:2x2x2"))
    assert ("ragged-all-to-all", ("expert",)) in {(op.kind, op.axes) for op in ops}


@needs_cuda
def test_ragged_moe_exchange_compiles_to_ragged_all_to_all_on_h100():
    ops = _ragged_moe_hlo(targets.h100_devices(1, 8))
    assert ("ragged-all-to-all", ("expert",)) in {(op.kind, op.axes) for op in ops}

"""sharding/: rule resolution (hand-written expectations), meshes, and import isolation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain import sharding
from jaxtrain.sharding import DEFAULT_RULES, logical_to_spec


def mesh(**sizes):
    n = int(np.prod(list(sizes.values())))
    return sharding.make_mesh(sizes, jax.devices()[:n])


def test_size_one_axes_drop_out():
    m = mesh(data=8)
    assert logical_to_spec(("embed", "mlp"), DEFAULT_RULES, m) == P()
    assert logical_to_spec(("batch", "seq", "act_embed"), DEFAULT_RULES, m) == P("data")


def test_fsdp_tensor_assignments():
    m = mesh(data=2, fsdp=2, tensor=2)
    assert logical_to_spec(("embed", "mlp"), DEFAULT_RULES, m) == P("fsdp", "tensor")
    assert logical_to_spec(("layers", "embed", "heads", "head_dim"), DEFAULT_RULES, m) == P(
        None, "fsdp", "tensor"
    )
    assert logical_to_spec(("batch", "seq", "act_mlp"), DEFAULT_RULES, m) == P(
        ("data", "fsdp"), None, "tensor"
    )
    assert logical_to_spec(("vocab", "embed"), DEFAULT_RULES, m) == P("tensor", "fsdp")


def test_axis_used_once_per_array_and_first_rule_wins():
    m = mesh(fsdp=4, tensor=2)
    rules = (("a", "tensor"), ("b", "tensor"), ("b", "fsdp"))
    assert logical_to_spec(("a", "b"), rules, m) == P("tensor", "fsdp")
    assert logical_to_spec(("b", "a"), rules, m) == P("tensor")


def test_non_dividing_axes_drop_when_shape_known():
    m = mesh(data=2, fsdp=4)
    assert logical_to_spec(("batch",), DEFAULT_RULES, m, shape=(8,)) == P(("data", "fsdp"))
    assert logical_to_spec(("batch",), DEFAULT_RULES, m, shape=(2,)) == P("data")
    assert logical_to_spec(("batch",), DEFAULT_RULES, m, shape=(3,)) == P()


def test_presets_differ_as_documented():
    m = mesh(fsdp=4, tensor=2)
    names = ("embed", "mlp")
    assert logical_to_spec(names, sharding.DATA_PARALLEL, m) == P()
    assert logical_to_spec(names, sharding.FSDP, m) == P("fsdp")
    assert logical_to_spec(names, sharding.FSDP_TENSOR, m) == P("fsdp", "tensor")


def test_make_mesh_fills_and_validates():
    m = sharding.make_mesh({"data": 2, "tensor": -1})
    assert dict(m.shape) == {"data": 2, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 4}
    assert all(t == jax.sharding.AxisType.Auto for t in m.axis_types)
    with pytest.raises(ValueError, match="device count 8"):
        sharding.make_mesh({"data": 3})
    with pytest.raises(ValueError, match="unknown"):
        sharding.make_mesh({"model": 8})
    with pytest.raises(ValueError, match="at most one"):
        sharding.make_mesh({"data": -1, "fsdp": -1})


def test_tree_shardings_and_parameter_table():
    m = mesh(fsdp=4, tensor=2)
    params = {"w": jnp.zeros((16, 8), jnp.float32), "norm": jnp.zeros((16,), jnp.float32)}
    axes = {"w": ("embed", "mlp"), "norm": ("norm",)}
    sh = sharding.tree_shardings(axes, DEFAULT_RULES, m, shapes=params)
    assert sh["w"].spec == P("fsdp", "tensor") and sh["norm"].spec == P()
    rows = {r["name"]: r for r in sharding.parameter_table(params, axes, DEFAULT_RULES, m)}
    assert rows["w"]["bytes_per_device"] == 16 * 8 * 4 // 8  # split 4 x 2
    assert rows["norm"]["bytes_per_device"] == 16 * 4  # replicated
    text = sharding.format_parameter_table(list(rows.values()))
    assert "w" in text and "total" in text


def test_constrain_is_noop_without_mesh_and_applies_with_one():
    x = jnp.ones((8, 4))
    assert sharding.constrain(x, ("batch", None)) is x
    m = mesh(data=8)
    with jax.set_mesh(m), sharding.axis_rules(DEFAULT_RULES):
        y = jax.jit(lambda x: sharding.constrain(x * 2, ("batch", None)))(x)
    assert y.sharding.spec == P("data")
    np.testing.assert_array_equal(y, 2 * x)


def test_bad_inputs_name_the_problem():
    m = mesh(data=8)
    with pytest.raises(ValueError, match="logical_axes"):
        logical_to_spec(("batch",), DEFAULT_RULES, m, shape=(8, 2))
    with pytest.raises(ValueError, match="rules"):
        logical_to_spec(("batch",), (("batch",),), m)


def test_program_traces_under_its_own_rules_wherever_it_is_called():
    """The train program's jitted functions are traced under the rules they were built with
    (sharding.with_rules), not whatever table is active at the call: lowered inside and
    outside `axis_rules`, `loss_and_grads` is the same program, with its constraints."""
    from flax import nnx

    from jaxtrain.planning.resolve import resolve_for_mesh
    from jaxtrain.trainer.batches import abstract_batch
    from jaxtrain.trainer.program import build_program
    from tests.conftest import tiny_config

    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2}, jax.devices()[:4])
    cfg = resolve_for_mesh(tiny_config(None, "mesh.fsdp=2", "mesh.tensor=2"), mesh)
    program = build_program(cfg, mesh)
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(program.abstract_params)
    )
    batch = abstract_batch(cfg, program.batch_sharding)
    with jax.set_mesh(mesh):
        outside = program.loss_and_grads.lower(params, batch).as_text()
        with sharding.axis_rules(sharding.DATA_PARALLEL):  # another table in context
            other = program.loss_and_grads.lower(params, batch).as_text()
    assert "sharding_constraint" in outside
    assert outside == other


@pytest.mark.deviceless
def test_tpu_devices_without_a_torus_order_are_refused_unless_asked():
    """6 of a v5p slice's 8 chips have no torus-aware order in jax's mesh_utils: a plain order
    would put mesh neighbours far apart, so make_mesh refuses, naming the way out; asked for
    (mesh.allow_plain_grid), it takes the plain order with a warning line."""
    import logging

    from jaxtrain.sharding import targets

    if not targets.tpu_available():
        pytest.skip("libtpu not installed")
    devices = targets.tpu_topology_devices("v5p:2x2x2")[:6]
    with pytest.raises(
        ValueError, match=r"no torus-aware device order for 6 TPU v5 devices.*allow_plain_grid"
    ):
        sharding.make_mesh({"fsdp": 6}, devices)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("jaxtrain.sharding").addHandler(handler)
    try:
        mesh = sharding.make_mesh({"fsdp": 6}, devices, allow_plain_grid=True)
    finally:
        logging.getLogger("jaxtrain.sharding").removeHandler(handler)
    assert list(mesh.devices.flat) == devices
    assert len(records) == 1 and "plain order, as asked" in records[0].getMessage()

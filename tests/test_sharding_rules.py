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

"""sharding.logical_axes_by_path and parameter_table on models jaxtrain did not write.

The same two-layer MLP (in 16 -> hidden 32 -> out 8, gelu) written four ways: Flax linen,
Flax NNX (`nnx.state`), Equinox and a plain dict, none of which names its axes. Each gets its
logical axes from regex patterns over its parameter paths; the oracles are hand-written
expectations (axes, paths in the errors) and a one-device run of the same code.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain import sharding

D_IN, D_HIDDEN, D_OUT, BATCH = 16, 32, 8, 8
RULES = (("batch", ("data", "fsdp")), ("features", ("fsdp",)), ("hidden", ("tensor",)))


@dataclasses.dataclass(frozen=True)
class Case:
    """One library's MLP: its parameters, how to apply them, its patterns and what they give."""

    init: Callable[[int], object]  # seed -> the parameter tree
    apply: Callable[[object, jax.Array], jax.Array]
    patterns: list
    expected: dict[str, tuple]  # path -> logical axes
    up_kernel: str  # the path of the first layer's weight
    bias: str  # the path of the last layer's bias


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(D_OUT, name="down")(nn.gelu(nn.Dense(D_HIDDEN, name="up")(x)))


def linen_case() -> Case:
    model = LinenMLP()
    return Case(
        init=lambda seed: model.init(jax.random.key(seed), jnp.zeros((1, D_IN))),
        apply=model.apply,
        patterns=[
            (r"up\.kernel$", ("features", "hidden")),
            (r"up\.bias$", ("hidden",)),
            (r"down\.kernel$", ("hidden", None)),
            (r"down\.bias$", None),
        ],
        expected={
            "params.up.kernel": ("features", "hidden"),
            "params.up.bias": ("hidden",),
            "params.down.kernel": ("hidden", None),
            "params.down.bias": (None,),
        },
        up_kernel="params.up.kernel",
        bias="params.down.bias",
    )


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(D_IN, D_HIDDEN, rngs=rngs)
        self.down = nnx.Linear(D_HIDDEN, D_OUT, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def nnx_case() -> Case:
    graphdef = nnx.graphdef(NnxMLP(nnx.Rngs(0)))
    return Case(
        init=lambda seed: nnx.state(NnxMLP(nnx.Rngs(seed)), nnx.Param),
        apply=lambda params, x: nnx.merge(graphdef, params)(x),
        patterns=[
            (r"up\.kernel$", ("features", "hidden")),
            (r"up\.bias$", ("hidden",)),
            (r"kernel$", ("hidden", None)),
            (r"down\.bias$", None),
        ],
        expected={  # the variables' own `.value` is not part of the path
            "up.kernel": ("features", "hidden"),
            "up.bias": ("hidden",),
            "down.kernel": ("hidden", None),
            "down.bias": (None,),
        },
        up_kernel="up.kernel",
        bias="down.bias",
    )


class EqxMLP(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    activation: Callable  # a leaf that is no array: it gets None, as eqx.partition gives it

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(D_IN, D_HIDDEN, key=k1)
        self.down = eqx.nn.Linear(D_HIDDEN, D_OUT, key=k2)
        self.activation = jax.nn.gelu

    def __call__(self, x):
        return jax.vmap(lambda v: self.down(self.activation(self.up(v))))(x)


def eqx_case() -> Case:
    static = eqx.partition(EqxMLP(jax.random.key(0)), eqx.is_array)[1]
    return Case(
        init=lambda seed: eqx.filter(EqxMLP(jax.random.key(seed)), eqx.is_array),
        apply=lambda params, x: eqx.combine(params, static)(x),
        patterns=[  # Equinox stores a Linear's weight as [out, in]
            (r"up\.weight$", ("hidden", "features")),
            (r"up\.bias$", ("hidden",)),
            (r"down\.weight$", (None, "hidden")),
            (r"down\.bias$", None),
        ],
        expected={
            "up.weight": ("hidden", "features"),
            "up.bias": ("hidden",),
            "down.weight": (None, "hidden"),
            "down.bias": (None,),
        },
        up_kernel="up.weight",
        bias="down.bias",
    )


def dict_case() -> Case:
    def init(seed):
        k1, k2 = jax.random.split(jax.random.key(seed))
        return {
            "layers": [
                {"w": jax.random.normal(k1, (D_IN, D_HIDDEN)) / 4, "b": jnp.zeros(D_HIDDEN)},
                {"w": jax.random.normal(k2, (D_HIDDEN, D_OUT)) / 6, "b": jnp.zeros(D_OUT)},
            ]
        }

    def apply(params, x):
        up, down = params["layers"]
        return jax.nn.gelu(x @ up["w"] + up["b"]) @ down["w"] + down["b"]

    return Case(
        init=init,
        apply=apply,
        patterns=[
            (r"^layers\.0\.w$", ("features", "hidden")),
            (r"^layers\.0\.b$", ("hidden",)),
            (r"^layers\.1\.w$", ("hidden", None)),
            (r"^layers\.1\.b$", None),
        ],
        expected={
            "layers.0.w": ("features", "hidden"),
            "layers.0.b": ("hidden",),
            "layers.1.w": ("hidden", None),
            "layers.1.b": (None,),
        },
        up_kernel="layers.0.w",
        bias="layers.1.b",
    )


CASES = {"linen": linen_case, "nnx": nnx_case, "equinox": eqx_case, "dict": dict_case}


@pytest.fixture(params=list(CASES), scope="module")
def case(request) -> Case:
    return CASES[request.param]()


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices()[:8])


def _axes_leaves(tree) -> list:
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple))


def test_axes_by_path(case, mesh):
    params = case.init(0)
    axes = sharding.logical_axes_by_path(params, case.patterns)
    rows = sharding.parameter_table(params, axes, RULES, mesh)
    assert {r["name"]: r["logical_axes"] for r in rows} == case.expected
    specs = {r["name"]: r["spec"] for r in rows}
    assert specs[case.up_kernel] in (P("fsdp", "tensor"), P("tensor", "fsdp"))
    assert specs[case.bias] == P()
    # From shapes alone (nothing allocated), the same axes in the same structure.
    abstract = jax.eval_shape(lambda: case.init(0))
    from_shapes = sharding.logical_axes_by_path(abstract, case.patterns)
    assert jax.tree.structure(from_shapes) == jax.tree.structure(axes)
    assert _axes_leaves(from_shapes) == _axes_leaves(axes)


def test_equinox_module_whole_gives_none_for_what_is_no_array():
    model = EqxMLP(jax.random.key(0))
    axes = sharding.logical_axes_by_path(model, eqx_case().patterns)
    assert axes.activation is None and axes.up.weight == ("hidden", "features")
    # The structure eqx.partition gives: None where the module holds no array.
    params = eqx.filter(model, eqx.is_array)
    assert jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple)) == jax.tree.structure(params)


def test_unmatched_path_is_named(case, mesh):
    params = case.init(0)
    patterns = [p for p in case.patterns if not p[0].endswith((r"bias$", r"\.b$"))]
    unmatched = rf"no pattern matches .*'{re.escape(case.bias)}' \({D_OUT},\).*default=None"
    with pytest.raises(ValueError, match=unmatched):
        sharding.logical_axes_by_path(params, patterns)
    # default=None replicates what no pattern names.
    replicated = sharding.logical_axes_by_path(params, patterns, default=None)
    rows = {r["name"]: r for r in sharding.parameter_table(params, replicated, RULES, mesh)}
    assert rows[case.bias]["logical_axes"] == (None,) and rows[case.bias]["spec"] == P()
    assert rows[case.up_kernel]["logical_axes"] == case.expected[case.up_kernel]
    everything = sharding.logical_axes_by_path(params, [], default=None)
    assert _axes_leaves(everything) == [(None,) * np.ndim(x) for x in jax.tree.leaves(params)]


def test_rank_mismatch_names_path_axes_and_shape(case):
    params = case.init(0)
    pattern = case.patterns[-1][0]
    wrong = [(pattern, ("hidden", "features")), *case.patterns]
    message = (
        f"patterns[0] ({pattern!r}) gives '{case.bias}' the axes ('hidden', 'features'): "
        f"2 names for an array of shape ({D_OUT},)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        sharding.logical_axes_by_path(params, wrong)
    default_rank = r"default gives '.+' the axes \('hidden',\): 1 names for an array of shape \(\d+, \d+\)"
    with pytest.raises(ValueError, match=default_rank):
        sharding.logical_axes_by_path(params, [], default=("hidden",))


def test_bad_patterns_are_named():
    params = {"w": jnp.zeros((2, 2))}
    with pytest.raises(ValueError, match="patterns=.*ordered list"):
        sharding.logical_axes_by_path(params, {"w": ("a", "b")})
    with pytest.raises(ValueError, match=r"patterns\[0\]=.*\(regex, axes\) pair"):
        sharding.logical_axes_by_path(params, [("w",)])
    with pytest.raises(ValueError, match=r"patterns\[0\]: '\(' is not a regular expression"):
        sharding.logical_axes_by_path(params, [("(", None)])
    with pytest.raises(ValueError, match=r"patterns\[0\] axes='embed': expected None .* tuple"):
        sharding.logical_axes_by_path(params, [("w", "embed")])


def _nested(pairs) -> collections.OrderedDict:
    """A tree of OrderedDicts (flattened in insertion order) from (dotted path, leaf) pairs."""
    root = collections.OrderedDict()
    for name, leaf in pairs:
        *parents, last = name.split(".")
        node = root
        for key in parents:
            node = node.setdefault(key, collections.OrderedDict())
        node[last] = leaf
    return root


def test_parameter_table_refuses_a_reordered_axes_tree(case, mesh):
    """The same paths and axes in another order: pairing leaves by order alone mislabelled rows;
    now the first path that differs is named."""
    params = case.init(0)
    axes = sharding.logical_axes_by_path(params, case.patterns)
    names = [r["name"] for r in sharding.parameter_table(params, axes, RULES, mesh)]
    reordered = _nested((name, case.expected[name]) for name in reversed(names))
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"differ in structure at leaf 0: params has '{names[0]}', logical_tree has '{names[-1]}'"
        ),
    ):
        sharding.parameter_table(params, reordered, RULES, mesh)
    # In params' own order, the nested pure dict is accepted (an NNX state's too).
    in_order = _nested((name, case.expected[name]) for name in names)
    assert [r["name"] for r in sharding.parameter_table(params, in_order, RULES, mesh)] == names
    # One leaf short: the path it lacks is named.
    with pytest.raises(ValueError, match=re.escape(f"params has '{names[-1]}', logical_tree has None")):
        sharding.parameter_table(params, _nested((n, case.expected[n]) for n in names[:-1]), RULES, mesh)


def _specs(shardings) -> list:
    return [s.spec for s in jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, NamedSharding))]


def _train(case: Case, params, axes, mesh=None, steps: int = 3):
    """`steps` Adam steps on a fixed regression batch; on `mesh` the parameters are placed by
    the rules and the batch split over data x fsdp. Returns (losses, params, optimizer state)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps, BATCH, D_IN)).astype(np.float32)
    y = rng.normal(size=(steps, BATCH, D_OUT)).astype(np.float32)
    if mesh is not None:
        params = jax.device_put(params, sharding.tree_shardings(axes, RULES, mesh, params))
        batch = sharding.named_sharding((None, "batch", None), RULES, mesh)  # [step, batch, features]
        x, y = jax.device_put(x, batch), jax.device_put(y, batch)
    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((case.apply(p, x) - y) ** 2))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = optimizer.init(params)
    losses = []
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, x[i], y[i])
        losses.append(float(loss))
    return losses, params, opt_state


def test_sharded_adam_steps_equal_one_device(case, mesh):
    """3 Adam steps on data x fsdp x tensor = 2 x 2 x 2 equal one device (losses rtol 1e-5,
    parameters rtol 1e-4 / atol 1e-6: float32 reduction order only); parameters and both Adam
    moments stay laid out as the rules say."""
    params = case.init(0)
    axes = sharding.logical_axes_by_path(params, case.patterns)
    expected_specs = _specs(sharding.tree_shardings(axes, RULES, mesh, params))
    losses8, params8, opt_state8 = _train(case, params, axes, mesh)
    losses1, params1, _ = _train(case, case.init(0), axes)
    np.testing.assert_allclose(losses8, losses1, rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
        params8,
        params1,
    )
    rows = {r["name"]: r["spec"] for r in sharding.parameter_table(params8, axes, RULES, mesh)}
    assert rows[case.up_kernel] in (P("fsdp", "tensor"), P("tensor", "fsdp"))
    for tree in (params8, opt_state8[0].mu, opt_state8[0].nu):
        assert _specs(jax.tree.map(lambda a: a.sharding, tree)) == expected_specs

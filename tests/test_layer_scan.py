"""models/layer_scan.py: the layer loop keeps float32 weights' gradients in bfloat16 until
the backward loop ends.

Oracles: autodiff's own scan (`jax.lax.scan`'s transpose) through the whole train program, bit
for bit or its bfloat16 rounding; the XLA:GPU compiler's memory for an H100 step, whose saving
is the layer stack's gradients at two bytes fewer per parameter."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import models
from jaxtrain.models import layer_scan
from jaxtrain.trainer.batches import batch_to_device
from tests.conftest import REPO, child_env, program_on_mesh, tiny_config

BF16 = ["model.compute_dtype=bfloat16", "model.param_dtype=float32", "train.steps=1", "model.n_layers=2"]
CASES = {
    # two fsdp shards, two microbatches, fp8 sites, QK-norm, biases, Gemma's norms, a pattern
    "dense-fp8-pattern": [
        "mesh.fsdp=2",
        "train.microbatches=2",
        "model.fp8=true",
        "model.qk_norm=head",
        "model.qkv_bias=true",
        "model.norm_placement=both",
        "model.attention_pattern=[local,global]",
        "model.sliding_window=32",
        "model.remat=minimal_with_context",
    ],
    # a dense prefix, then MoE layers (two stacks, router statistics as scan outputs)
    "moe": [
        "model.moe.num_experts=4",
        "model.moe.top_k=2",
        "model.moe.first_dense_layers=1",
        "model.remat=full",
    ],
}


def _grads(overrides, compact: bool):
    """(loss, gradients) of the tiny model's train program on its first batch, on host."""
    cfg = tiny_config(None, *BF16, *overrides, f"model.compact_grads={str(compact).lower()}")
    with program_on_mesh(cfg) as (program, state, data):
        batch = batch_to_device(next(data), program.batch_sharding)
        loss, _, grads = program.loss_and_grads(state.params, batch)
        return jax.device_get((loss, grads))


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_are_autodiffs_rounded_as_the_program_says(case):
    """Every gradient equals autodiff's scan's, or its bfloat16 rounding: the jaxpr rounds
    those weight gradients to bfloat16, and XLA may skip that rounding where it widens them
    again at once (xla_allow_excess_precision: MoE's expert matmuls on CPU); the compact loop
    stores them in bfloat16, so it keeps the rounding. Dense layers match bit for bit."""
    (loss_a, plain), (loss_b, compact) = (_grads(CASES[case], c) for c in (False, True))
    assert loss_a == loss_b
    rounded = []
    for path, a in jax.tree_util.tree_leaves_with_path(plain):
        b = np.asarray(dict(jax.tree_util.tree_leaves_with_path(compact))[path])
        name = jax.tree_util.keystr(path)
        if not np.array_equal(np.asarray(a), b):
            np.testing.assert_array_equal(
                np.asarray(jnp.asarray(a).astype(jnp.bfloat16), np.float32), b, err_msg=name
            )
            rounded.append(name)
    assert all("moe_blocks" in n and "w_router" not in n for n in rounded), rounded


UNROLLED = [
    "model.scan_layers=false",
    "model.n_layers=3",
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.first_dense_layers=1",
    "model.remat=minimal_with_context",
]


def test_unrolled_loops_are_autodiffs_bit_for_bit_where_xla_rounds_as_written():
    """The unrolled loops (a one-layer dense stack, then two MoE layers with router statistics
    as outputs) against autodiff's unrolled scan, in a process where XLA rounds every bfloat16
    value the program rounds (`--xla_allow_excess_precision=false`): the same loss and
    gradients, bit for bit. With excess precision allowed, XLA fuses the two unrolled programs
    differently, and which roundings it skips moves the gradients by up to 2% of their scale,
    as much as unrolling autodiff's own scan does."""
    code = (
        "import json, jax, numpy as np\n"
        "from tests.test_layer_scan import UNROLLED, _grads\n"
        "(la, a), (lb, b) = (_grads(UNROLLED, c) for c in (False, True))\n"
        "pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)\n"
        "same = [bool(np.array_equal(np.asarray(x), np.asarray(y))) for x, y in pairs]\n"
        "print(json.dumps({'loss': bool(la == lb), 'grads': same}))\n"
    )
    env = child_env(devices=8)
    env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} --xla_allow_excess_precision=false"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["loss"] and result["grads"] and all(result["grads"]), result


def test_bfloat16_gradients_are_found_where_the_backward_computes_them():
    """The attention, MLP and expert weights (and biases) have bfloat16 gradients; the norm
    scales and the router (float32 math) keep float32 ones."""
    cfg = models.ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, mlp_dim=64, qkv_bias=True,
        compute_dtype="bfloat16", param_dtype="float32",
        moe=models.MoEConfig(num_experts=4, top_k=2, first_dense_layers=1),
    )  # fmt: skip
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 8, 32), jnp.bfloat16)
    pos, seg = jnp.arange(8)[None], jnp.ones((1, 8), jnp.int32)
    found = {}
    for name in ("blocks", "moe_blocks"):
        graphdef, state = nnx.split(getattr(model, name))
        leaves, tree = jax.tree_util.tree_flatten_with_path(jax.tree.map(lambda v: v[0], state))
        run = lambda x, ls: nnx.merge(graphdef, jax.tree.unflatten(tree, ls))(x, pos, seg)
        dtypes = layer_scan.narrow_grads(run, x, [v for _, v in leaves])
        found |= {f"{name}{jax.tree_util.keystr(p)}": d for (p, _), d in zip(leaves, dtypes, strict=True)}
    narrow = {k for k, d in found.items() if d == jnp.bfloat16}
    assert narrow | {k for k, d in found.items() if d is None} == set(found)
    want = [f"blocks{k}" for k in ("['attn']['wq']", "['attn']['wo']", "['attn']['bq']", "['mlp']['w_down']")]
    want += [
        f"moe_blocks{k}"
        for k in ("['attn']['wk']", "['mlp']['w_gate']", "['mlp']['w_up']", "['mlp']['w_down']")
    ]
    assert all(any(k.startswith(w) for k in narrow) for w in want), sorted(narrow)
    kept = set(found) - narrow
    assert kept and all("norm" in k or "router" in k for k in kept), sorted(kept)


@pytest.mark.deviceless
def test_an_h100_step_holds_the_layers_gradients_in_bfloat16():
    """configs/gpu-peer.yaml compiled for one H100: the compact loop's peak is lower by the
    layer stack's float32-minus-bfloat16 gradient bytes (within 20%: the peak moves)."""
    from jaxtrain.config import load_config
    from jaxtrain.planning import compile as deviceless
    from jaxtrain.planning.footprint import layer_stack_params
    from jaxtrain.sharding import targets

    if not targets.cuda_available():
        pytest.skip("deviceless GPU compiles need the gpu-aot extra")
    target = deviceless.parse_target("gpu:h100", gpus_per_host=1)
    total = {}
    for compact in (False, True):
        overrides = [
            "model.remat=minimal",
            "model.attention_impl=cudnn",
            f"model.compact_grads={str(compact).lower()}",
        ]
        cfg = load_config(f"{REPO}/configs/gpu-peer.yaml", overrides)
        total[compact] = deviceless.compile_report(cfg, target, estimate=False)["memory"]["total"]
    saved, want = total[False] - total[True], 2 * layer_stack_params(cfg.model)
    assert 0.8 <= saved / want <= 1.2, (saved / 2**30, want / 2**30)


def test_the_loop_into_uninitialised_buffers_is_the_scan():
    """`_scan_into_empty` against `jax.lax.scan`, forward and reverse, with a tree of stacked
    outputs: the same carry and outputs, bit for bit."""

    def step(c, x):
        a, b = x
        c = jnp.tanh(c * a + b.sum(-1))
        return c, (c * 2, {"mean": b.mean(-1).astype(jnp.bfloat16)})

    keys = jax.random.split(jax.random.key(0), 3)
    c0 = jax.random.normal(keys[0], (3,))
    xs = (jax.random.normal(keys[1], (5, 3)), jax.random.normal(keys[2], (5, 3, 4)))
    for reverse in (False, True):
        want = jax.jit(lambda c, x: jax.lax.scan(step, c, x, reverse=reverse))(c0, xs)
        got = jax.jit(lambda c, x: layer_scan._scan_into_empty(step, c, x, reverse=reverse))(c0, xs)
        jax.tree.map(np.testing.assert_array_equal, got, want)


def test_stacked_buffers_start_uninitialised_only_on_one_device():
    """The gradient's jaxpr allocates with `lax.empty` under a one-device mesh; without a mesh
    (inputs may be sharded) and under a two-device one (XLA's partitioner would build the
    allocation whole on each device) the loops keep `jax.lax.scan`'s zeros."""
    w = jnp.ones((4, 8, 8), jnp.float32)

    def loss(w, x):
        body = lambda x, w, consts: (jnp.tanh(x @ w.astype(jnp.bfloat16)), None)
        return layer_scan.scan(body, x, w)[0].astype(jnp.float32).sum()

    def allocates(mesh) -> bool:
        x = jnp.ones((2, 8), jnp.bfloat16)
        if mesh is None:
            return "empty[" in str(jax.make_jaxpr(jax.grad(loss))(w, x))
        with jax.set_mesh(mesh):
            return "empty[" in str(jax.make_jaxpr(jax.grad(loss))(w, x))

    one, two = (jax.sharding.Mesh(np.array(jax.devices()[:n]), ("fsdp",)) for n in (1, 2))
    assert (allocates(None), allocates(one), allocates(two)) == (False, True, False)


@pytest.mark.deviceless
def test_an_h100_step_neither_fills_nor_hoists():
    """configs/gpu-peer.yaml with 4 layers compiled for one H100. Scanned: the layer loops'
    stacked buffers are AllocateBuffers, and no broadcast fills a bf16 buffer as deep as the
    layer stack (jax.lax.scan fills each with zeros first). Unrolled: no activation is copied
    into a stacked buffer, and its temporaries stay below the scanned loop's (XLA hoists every
    layer's weight slices to the backward's start unless each waits for the layer before: then
    4586 MiB against the scanned 4531; 4371 tied)."""
    from jaxtrain.config import load_config
    from jaxtrain.planning import compile as deviceless
    from jaxtrain.planning.data_movement import data_movement
    from jaxtrain.sharding import targets

    if not targets.cuda_available():
        pytest.skip("deviceless GPU compiles need the gpu-aot extra")
    target = deviceless.parse_target("gpu:h100", gpus_per_host=1)
    texts, temp = {}, {}
    for scan in (True, False):
        overrides = [
            "model.n_layers=4",
            "model.attention_impl=cudnn",
            f"model.scan_layers={str(scan).lower()}",
        ]
        cfg = load_config(f"{REPO}/configs/gpu-peer.yaml", overrides)
        cfg, ici, dcn = deviceless.config_for_target(cfg, target)
        cfg, _ = deviceless.resolved_for_target(cfg, target, ici, dcn)
        compiled = deviceless.lower_step(cfg, deviceless.target_mesh(target, ici, dcn)).compile()
        texts[scan], temp[scan] = compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes
    fill = r"= \(?bf16\[4,[^=]*? fusion\(\), kind=kLoop, calls=%fused_broadcast"  # a [layers, ...] buffer
    assert "AllocateBuffer" in texts[True] and not re.findall(fill, texts[True])
    copied = {scan: data_movement(texts[scan]).get("in-place updates", (0, 0))[1] for scan in texts}
    assert copied[False] < 0.05 * copied[True], copied
    assert temp[False] < temp[True], (temp[False] / 2**20, temp[True] / 2**20)

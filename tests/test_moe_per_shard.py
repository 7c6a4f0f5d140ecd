"""Dropless expert parallelism that sends a token once per expert shard it needs
(`model.moe.dispatch_per_shard`, DeepSeek-V3's node-limited dispatch): when each shard holds
whole routing groups, a token reaches at most `top_k_groups` shards.

Oracles: the single-device layer and today's per-expert exchange (outputs and gradients,
f32); hand-computed all-to-all bytes of the compiled step (CPU, padded exchange) and the rows
of the ragged exchange's buffers (deviceless TPU compile); hand-worked shard bounds; the
planner's memory estimate against a hand count of the buffers and the CPU compiler's temp memory."""

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import sharding
from jaxtrain.config import load_config
from jaxtrain.models import ModelConfig, MoEConfig
from jaxtrain.models.moe import dispatch_per_shard, moe_layer, shards_per_token
from jaxtrain.planning.report import collectives, shape_bytes
from jaxtrain.planning.resolve import Placement, resolve
from jaxtrain.sharding import targets
from jaxtrain.sharding.collectives import collectives_by_axes, match_op
from tests.conftest import REPO

# f32; sharding and the per-shard combine change summation order only
RTOL, ATOL = 1e-5, 1e-6
E, D, F, B, S = 16, 32, 16, 8, 6  # experts, d_model, expert width, batch, sequence


def grouped(k: int, **extra) -> MoEConfig:
    """DeepSeek-V3's routing on 16 experts: 4 groups, the best 2, top-k, sigmoid + selection bias."""
    return MoEConfig(
        num_experts=E, top_k=k, scoring="sigmoid", score_bias=True, num_groups=4, top_k_groups=2,
        routed_scaling_factor=2.5, dispatch="dropless", exchange="padded", **extra,
    )  # fmt: skip


@pytest.mark.parametrize(
    "overrides,ep,shards,per_shard",
    [
        (dict(top_k=8), 4, 2, True),  # groups on shards: at most top_k_groups = 2 of 4
        (dict(top_k=8), 8, 4, True),  # a group spans 2 of 8 shards: at most 2 x 2
        (dict(top_k=4, num_groups=2, top_k_groups=1), 8, 4, False),  # a group spans 4 shards: 4
        (dict(top_k=8, num_groups=1, top_k_groups=1), 4, 4, True),  # fewer shards than top_k
        (dict(top_k=2, num_groups=1, top_k_groups=1), 8, 2, False),  # Mixtral-like: no gain
        (dict(top_k=8, receive_factor=1.25), 4, 2, False),  # bounded receive keeps today's path
        (dict(top_k=8, dispatch="capacity"), 4, 2, False),
        (dict(top_k=8), 1, 1, False),  # no expert parallelism
        (dict(top_k=2, num_groups=1, top_k_groups=1, dispatch_per_shard=True), 8, 2, True),
        (dict(top_k=8, dispatch_per_shard=False), 4, 2, False),
    ],
)
def test_shards_per_token_and_when_auto_sends_per_shard(overrides, ep, shards, per_shard):
    m = dataclasses.replace(grouped(8), **overrides)
    assert shards_per_token(m, ep) == shards
    assert dispatch_per_shard(m, ep) is per_shard


def test_per_shard_needs_dropless_without_a_receive_bound():
    for bad in (dict(dispatch="capacity"), dict(receive_factor=1.5)):
        cfg = ModelConfig(moe=dataclasses.replace(grouped(4), dispatch_per_shard=True, **bad))
        with pytest.raises(ValueError, match="model.moe.dispatch_per_shard=true"):
            cfg.validate()


def test_presets_resolve_dispatch_per_shard_where_their_mesh_allows():
    """configs/deepseek-v3-671b.yaml: 8 groups over expert=8 (one group a shard), best 4 of
    them: a token's 8 experts lie on at most 4 shards, so auto sends per shard (and logs why).
    configs/moonlight-16b-a3b.yaml has no group limit and no expert axis (fsdp=8 on one node):
    no exchange, nothing to choose (false, no log line)."""
    cfg = load_config(os.path.join(REPO, "configs", "deepseek-v3-671b.yaml"), ["model.remat=full"])
    placement = Placement("tpu", {"data": 1, "fsdp": 64, "expert": 8, "tensor": 1}, 95 * 2**30, chip="v5p")
    resolution = resolve(cfg, placement)
    assert resolution.config.model.moe.dispatch_per_shard is True
    note = next(n for n in resolution.notes if n.startswith("model.moe.dispatch_per_shard"))
    assert "at most 4 of the 8 expert shards" in note, note
    cfg = load_config(os.path.join(REPO, "configs", "moonlight-16b-a3b.yaml"), ["model.remat=full"])
    resolution = resolve(cfg, Placement("gpu", {"fsdp": 8}, 80 * 2**30, chip="h100"))
    assert resolution.config.model.moe.dispatch_per_shard is False
    assert not [n for n in resolution.notes if n.startswith("model.moe.dispatch_per_shard")]


def test_footprint_counts_the_per_shard_buffers():
    """footprint.estimate's MoE rows under per-shard dispatch against a hand count of
    `_per_shard_exchange`'s buffers (16 experts, top-8, groups whole on expert=4 shards):
    a token goes to n = 2 shards, each receives ep x T rows expanded to k_local = min(8, 16/4)
    = 4 slots, so the expert matmuls run over ep x k_local = 16 rows a token (r = 16/8 = 2)
    instead of the per-expert worst case ep x top_k = 32 (r = 4, as before), and the padded
    exchange's buffers are [ep, T, D] instead of [ep, T x k, D]. Exact (integer bytes)."""
    from jaxtrain.planning import footprint

    ep, k, n, k_local = 4, 8, 2, 4
    over = ["model.moe.num_experts=16", f"model.moe.top_k={k}", "model.moe.num_groups=4"]
    over += ["model.moe.top_k_groups=2", "model.moe.exchange=padded", f"mesh.expert={ep}"]
    path = os.path.join(REPO, "configs", "tiny-moe.yaml")
    cfgs = {ps: load_config(path, [*over, f"model.moe.dispatch_per_shard={ps}"]) for ps in ("true", "false")}
    sizes = {"expert": ep}
    assert footprint.moe_row_factor(cfgs["true"], sizes) == ep * k_local / k
    assert footprint.moe_row_factor(cfgs["false"], sizes) == ep  # receive_rows' worst case, unchanged
    m = cfgs["true"].model
    d, f, a = m.d_model, m.moe.mlp_dim(m), 4  # float32

    def rows_bytes(rows, back, exchange):
        """Per token: gate and up over the expanded rows and SwiGLU's three operands (5 F), the
        sorted input and the outputs sorted and in buffer order (3 D) over them; the rows a
        token gets back; the padded send and receive buffers (2 D each row)."""
        return (5 * f * rows + 3 * d * rows + d * back + 2 * d * exchange) * a

    per_shard = rows_bytes(ep * k_local, n, ep)
    per_expert = rows_bytes(ep * k, k, ep * k)
    tokens = cfgs["true"].train.global_batch_size // ep * cfgs["true"].train.seq_len
    working = {ps: footprint.activation_bytes(c, sizes)[1] for ps, c in cfgs.items()}
    assert working["false"] - working["true"] == tokens * (per_expert - per_shard)
    # the per-expert path whole: the layer with no expert rows (its k rows back left out) plus
    # the hand count, and the experts gathered
    bare = footprint.layer_bytes_per_token(m, moe_rows=0, ep=ep) - k * d * a
    weights = footprint.moe_weight_bytes(cfgs["false"], sizes)
    assert working["false"] == tokens * (bare + per_expert) + weights


def test_footprint_per_shard_follows_the_compiled_temp_memory():
    """Oracle: the CPU compiler's temp memory of the whole train step (one MoE layer, remat
    full, padded exchange over expert=4, the layout of the test above) with and without
    per-shard dispatch. The estimate's activations (saved + the larger of working set and
    logits) shrink by the compiled ratio within 10% (measured: 0.480 estimated, 0.502
    compiled; before the per-shard buffers were counted the estimate did not move, 1.0)."""
    from jaxtrain.planning.footprint import estimate
    from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh
    from jaxtrain.sharding.targets import compiled_memory
    from jaxtrain.trainer.batches import abstract_batch
    from jaxtrain.trainer.program import build_program

    mesh = sharding.make_mesh({"expert": 4}, jax.devices()[:4])
    over = ["model.moe.num_experts=16", "model.moe.top_k=8", "model.moe.num_groups=4"]
    over += ["model.moe.top_k_groups=2", "model.moe.exchange=padded", "mesh.expert=4"]
    over += ["model.remat=full", "model.n_layers=1"]
    compiled, estimated = {}, {}
    for ps in ("true", "false"):
        path = os.path.join(REPO, "configs", "tiny-moe.yaml")
        cfg = resolve_for_mesh(load_config(path, [*over, f"model.moe.dispatch_per_shard={ps}"]), mesh)
        rules = axis_rules(cfg)
        with jax.set_mesh(mesh), sharding.axis_rules(rules):
            program = build_program(cfg, mesh, rules)
            state = jax.tree.map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                jax.eval_shape(program.init),
                program.state_shardings,
            )
            step = program.step.lower(state, abstract_batch(cfg, program.batch_sharding)).compile()
        compiled[ps] = compiled_memory(step)["temp"]
        est = estimate(cfg, {"expert": 4})
        estimated[ps] = est.total - est.state
    ratio = (estimated["true"] / estimated["false"]) / (compiled["true"] / compiled["false"])
    assert 0.9 <= ratio <= 1.1, (estimated, compiled)


def layer_step(m: MoEConfig, mesh_sizes=None):
    """Outputs and gradients of moe_layer (a fixed random cotangent) and, on a mesh, its
    compiled gradient program's HLO text."""
    ks = jax.random.split(jax.random.key(0), 7)
    x = jax.random.normal(ks[0], (B, S, D), jnp.float32)
    args = (
        x,
        jax.random.normal(ks[1], (D, E), jnp.float32),
        0.3 * jax.random.normal(ks[2], (E, D, F), jnp.float32),
        0.3 * jax.random.normal(ks[3], (E, D, F), jnp.float32),
        0.3 * jax.random.normal(ks[4], (E, F, D), jnp.float32),
    )
    bias = 0.1 * jax.random.normal(ks[5], (E,), jnp.float32)
    ct = jax.random.normal(ks[6], x.shape, jnp.float32)

    def loss(x, w_router, w_gate, w_up, w_down):
        y, stats = moe_layer(x, w_router, bias, w_gate, w_up, w_down, m)
        return jnp.sum(y * ct) + stats["aux_loss"], y

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
    if mesh_sizes is None:
        return step(*args), None
    n = int(np.prod(list(mesh_sizes.values())))
    mesh = sharding.make_mesh(mesh_sizes, jax.devices()[:n])
    with jax.set_mesh(mesh), sharding.axis_rules(sharding.PRESETS["fsdp_tensor"]):
        compiled = step.lower(*args).compile()
        return compiled(*args), compiled.as_text()


_single = {}


@pytest.mark.parametrize(
    "k,mesh",
    [(4, dict(expert=4)), (8, dict(fsdp=2, expert=4))],
    ids=lambda v: ",".join(f"{a}={n}" for a, n in v.items()) if isinstance(v, dict) else f"k={v}",
)
def test_per_shard_dispatch_equals_per_expert_and_moves_k_times_fewer_bytes(k, mesh):
    """Outputs and gradients (x, router, experts) of the per-shard exchange equal the
    single-device layer and today's per-expert exchange; the compiled step's all-to-all bytes
    are the hand-computed ones: per expert, 4 token-row all-to-alls (send, return and their
    transposes) of [ep, A = T k, d] plus the [ep, E/ep] counts; per shard, 4 of [ep, T, d],
    3 of [ep, T, k_local] (ids, weights, the weights' transpose) and the [ep, 1] counts.
    (The receivers' kept-row counts serve only `dropped_fraction`, unused here: no all-to-all.)"""
    m = grouped(k)
    if k not in _single:
        _single[k] = layer_step(m)[0]
    ref = _single[k]
    ours, ours_hlo = layer_step(dataclasses.replace(m, dispatch_per_shard=True), mesh)
    today, today_hlo = layer_step(dataclasses.replace(m, dispatch_per_shard=False), mesh)
    for got in (ours, today):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), got, ref)

    ep, e_local = mesh["expert"], E // mesh["expert"]
    t = B * S // (mesh.get("fsdp", 1) * ep)  # tokens a device holds
    k_local = min(k, e_local)
    expected_today = 4 * ep * t * k * D * 4 + ep * e_local * 4
    expected_ours = 4 * ep * t * D * 4 + 3 * ep * t * k_local * 4 + ep * 4
    measured_today = collectives(today_hlo)["all-to-all"]["bytes"]
    measured_ours = collectives(ours_hlo)["all-to-all"]["bytes"]
    assert (measured_today, measured_ours) == (expected_today, expected_ours)
    assert token_rows(today_hlo) == k * token_rows(ours_hlo)


def token_rows(hlo: str) -> int:
    """Bytes of the all-to-alls of d-wide f32 token rows in a compiled program."""
    ops = (match_op(line) for line in hlo.splitlines())
    wide = re.compile(r"f32\[[0-9,]*," + str(D) + r"\]")
    return sum(
        shape_bytes(op.group(2))
        for op in ops
        if op and op.group(3) == "all-to-all" and wide.match(op.group(2))
    )


needs_tpu = pytest.mark.skipif(not targets.tpu_available(), reason="libtpu not installed")
needs_cuda = pytest.mark.skipif(not targets.cuda_available(), reason="jax-cuda12-plugin not installed")


@pytest.mark.parametrize(
    "platform", [pytest.param("tpu", marks=needs_tpu), pytest.param("gpu", marks=needs_cuda)]
)
def test_ragged_exchange_buffers_shrink_by_top_k_over_top_k_groups(platform):
    """Deviceless v5p / H100, expert=4, 16 experts in 4 groups (one a shard), best 2, top-8,
    bf16: each device's T = 32 tokens. Per expert, the ragged all-to-alls move rows between a
    source's T k = 256 assignment rows and a shard's ep T k = 1024-row receive buffer; per
    shard between T n = 64 token rows (n = top_k_groups = 2) and ep T = 128: the rows a
    source sends shrink by k / n = 4 and the receive buffers by k = 8 (the rows of every
    ragged-all-to-all buffer in the compiled program). TPU: the gradient program, and the
    per-expert one beside it; GPU: the per-shard forward (its compiles are the slower)."""
    devices = targets.tpu_topology_devices("v5p:2x2x2") if platform == "tpu" else targets.h100_devices(1, 8)
    mesh = sharding.make_mesh({"expert": 4}, devices[:4])
    rules = sharding.PRESETS["fsdp_tensor"]
    b, s, d, f = 8, 16, 128, 128
    spec = lambda axes, shape: jax.sharding.NamedSharding(
        mesh, sharding.logical_to_spec(axes, rules, mesh, shape)
    )
    shapes = [
        ((b, s, d), ("batch", "seq", "act_embed"), jnp.bfloat16),
        ((d, E), ("embed", None), jnp.float32),
        ((E, d, f), ("expert", "embed", "mlp"), jnp.bfloat16),
        ((E, d, f), ("expert", "embed", "mlp"), jnp.bfloat16),
        ((E, f, d), ("expert", "mlp", "embed"), jnp.bfloat16),
    ]
    args = [jax.ShapeDtypeStruct(shape, dt, sharding=spec(axes, shape)) for shape, axes, dt in shapes]
    rows = {}
    for per_shard in (True, False) if platform == "tpu" else (True,):
        m = dataclasses.replace(
            grouped(8),
            score_bias=False,
            exchange="ragged",
            grouped_matmul="ragged_dot",
            dispatch_per_shard=per_shard,
        )

        def loss(x, w_router, w_gate, w_up, w_down, m=m):
            y, _ = moe_layer(x, w_router, None, w_gate, w_up, w_down, m)
            return jnp.mean(y.astype(jnp.float32) ** 2)

        program = jax.grad(loss, argnums=(0, 2)) if platform == "tpu" else loss
        with jax.set_mesh(mesh), sharding.axis_rules(rules):
            hlo = jax.jit(program).lower(*args).compile().as_text()
        ragged = [c for c in collectives_by_axes(hlo, mesh) if c.kind == "ragged-all-to-all"]
        assert ragged and all(c.axes == ("expert",) for c in ragged)
        # every buffer's rows (the offsets and sizes, s32[ep], aside)
        rows[per_shard] = {int(r) for c in ragged for r in re.findall(r"\w+\[([0-9]+),[0-9,]+\]", c.shape)}
    t, ep, n = b * s // 4, 4, 2
    assert rows[True] == {t * n, ep * t}
    if platform == "tpu":
        assert rows[False] == {t * 8, ep * t * 8}

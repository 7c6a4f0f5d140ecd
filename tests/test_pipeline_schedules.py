"""Pipeline schedules as tick tables (sharding/pipeline_tables.py) and the schedules that
run their backward inside the pipeline (sharding/tick_pipeline.py: 1f1b, interleaved_1f1b,
zero_bubble).

Oracles: the tables' rules checked cell by cell (each op once, in dependency order) and
bubbles counted by hand from the drawn tables; the executor against a plain `lax.scan`
over the same layers and `jax.grad` of the same loss; the model's loss and gradients on a
stage x fsdp x tensor mesh against one device (tolerances of tests/test_pipeline.py)."""

import collections
import dataclasses
import functools
import itertools
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import sharding
from jaxtrain.config import ConfigError, validate
from jaxtrain.sharding.pipeline import Schedule, bubble_fraction
from jaxtrain.sharding.pipeline_tables import BW, IDLE, B, F, W, docs_markdown, table
from jaxtrain.sharding.tick_pipeline import _tick_program, pipeline_loss, slots
from jaxtrain.trainer import train
from tests.conftest import replace, tiny_config
from tests.test_pipeline import SMALL, assert_matches, loss_and_grads, moe_cfg

# (schedule, stages, microbatches, repeats)
TICK_CASES = [
    ("1f1b", 2, 1, 1),
    ("1f1b", 2, 4, 1),
    ("1f1b", 4, 2, 1),
    ("1f1b", 4, 8, 1),
    ("zero_bubble", 2, 4, 1),
    ("zero_bubble", 4, 8, 1),
    ("zero_bubble", 4, 2, 1),
    ("interleaved_1f1b", 2, 4, 2),
    ("interleaved_1f1b", 4, 8, 2),
    ("interleaved_1f1b", 2, 2, 3),
]


def _when(tb):
    """{(kind, stage, micro, chunk): [ticks]} with BW counted as B and as W."""
    seen = {}
    for t, s in itertools.product(range(tb.ticks), range(tb.stages)):
        op = int(tb.ops[t, s])
        for kind in {F: [F], B: [B], W: [W], BW: [B, W]}.get(op, []):
            seen.setdefault((kind, s, int(tb.micro[t, s]), int(tb.repeat[t, s])), []).append(t)
    return seen


@pytest.mark.parametrize("name,S,M,R", TICK_CASES, ids=str)
def test_tick_table_runs_every_op_once_after_what_it_needs(name, S, M, R):
    tb = table(name, S, M, R)
    seen = _when(tb)
    cells = list(itertools.product(range(S), range(M), range(R)))
    for kind in (F, B, W):
        assert sorted(k[1:] for k in seen if k[0] == kind) == cells
    assert all(len(ticks) == 1 for ticks in seen.values())
    at = {k: v[0] for k, v in seen.items()}
    for s, m, r in cells:
        assert at[(B, s, m, r)] > at[(F, s, m, r)]  # its own forward first
        assert at[(W, s, m, r)] >= at[(B, s, m, r)]
        if (s, r) != (0, 0):  # the previous chunk's forward of m
            prev = (s - 1, r) if s else (S - 1, r - 1)
            assert at[(F, s, m, r)] > at[(F, prev[0], m, prev[1])]
        if (s, r) != (S - 1, R - 1):  # the next chunk's backward of m
            nxt = (s + 1, r) if s < S - 1 else (0, r + 1)
            assert at[(B, s, m, r)] > at[(B, nxt[0], m, nxt[1])]
    if name == "zero_bubble":
        assert not np.any(tb.ops == BW)  # B and W split
    else:
        assert not np.any((tb.ops == B) | (tb.ops == W))


@pytest.mark.parametrize("S,M", [(2, 1), (2, 4), (4, 2), (4, 8), (4, 32)], ids=str)
def test_1f1b_keeps_at_most_s_inputs_whatever_m(S, M):
    tb = table("1f1b", S, M)
    # stage s: S - s warm-up forwards before its first backward (M permitting)
    assert list(tb.live_inputs()) == [min(S - s, M) for s in range(S)]
    stash, inbox = slots(tb)  # the executor's buffers: S inputs, one gradient at a time
    assert stash == min(S, M) and inbox == 1
    assert list(table("gpipe", S, M).live_inputs()) == [M] * S  # the contrast: all M


def test_bubbles_by_hand():
    # gpipe S=2 M=4: 10 ticks (4 F + 4 B + 2 idle per stage); circular R=2: 2 idle of 18
    assert table("gpipe", 2, 4).bubble == pytest.approx(2 / 10)
    assert table("circular", 2, 4, 2).bubble == pytest.approx(2 / 18)
    # 1f1b S=4 M=8 (drawn in docs/parallelism.md): 22 ticks, 6 idle per stage
    assert table("1f1b", 4, 8).ticks == 22
    assert table("1f1b", 4, 8).bubble == pytest.approx(6 / 22)
    # zero_bubble (ZB-H1), F, B, W a tick each: 3M busy + S-1 idle per stage, the paper's
    # (S-1)(T_F + T_B - T_W): S=2 M=4 1 of 13, S=4 M=8 3 of 27 (1f1b: 6 of 22)
    assert table("zero_bubble", 2, 4).bubble == pytest.approx(1 / 13)
    assert table("zero_bubble", 4, 8).bubble == pytest.approx(3 / 27)
    # interleaved S=2 M=4 R=2: 16 chunk ops + 2 idle per stage, as circular
    assert table("interleaved_1f1b", 2, 4, 2).bubble == pytest.approx(2 / 18)


@pytest.mark.parametrize("name", ["gpipe", "circular", "1f1b", "interleaved_1f1b"])
def test_table_bubble_equals_the_formula(name):
    repeats = (2, 3) if name in ("circular", "interleaved_1f1b") else (1,)
    for S, M, R in itertools.product((2, 4), (4, 8), repeats):
        assert table(name, S, M, R).bubble == pytest.approx(bubble_fraction(S, M, R)), (S, M, R)


@pytest.mark.parametrize("S,M", [(2, 2), (2, 4), (3, 5), (4, 8), (4, 32), (8, 32)], ids=str)
def test_zero_bubble_is_zb_h1(S, M):
    """ZB-H1's bubble (S-1)/(3M+S-1) (M >= S), and every stage holds S inputs at most:
    stage 0's 1f1b peak (stages after it defer their first weight gradients up to it)."""
    tb = table("zero_bubble", S, M)
    assert tb.ticks == 3 * M + S - 1
    assert tb.bubble == pytest.approx((S - 1) / (3 * M + S - 1))
    assert list(tb.live_inputs()) == [S] * S
    assert max(tb.live_inputs()) == max(table("1f1b", S, M).live_inputs())
    # the executor's stash and inbox: S inputs, and S gradients (stage s keeps s + 1: those
    # of the s weight gradients it defers, and the current one's)
    assert slots(tb) == (S, S)


@pytest.mark.parametrize(
    "S,M,R", [(2, 2, 3), (2, 4, 2), (4, 8, 2), (4, 32, 2), (4, 8, 3), (8, 32, 2)], ids=str
)
def test_interleaved_holds_r_times_s_chunk_inputs(S, M, R):
    """Device s holds at most R*S - s microbatch-chunk inputs whatever M is (R*S chunks of
    L/(S*R) layers: 1f1b's S stages' worth), fewer than Megatron's warm-up count keeps
    ((S-s-1)*2 + (R-1)*S forwards before the first backward, then one more), at the bubble
    (S-1)/(R*M+S-1)."""
    tb = table("interleaved_1f1b", S, M, R)
    assert list(tb.live_inputs()) == [R * S - s for s in range(S)]
    assert all(tb.live_inputs() <= [(S - s - 1) * 2 + (R - 1) * S + 1 for s in range(S)])
    assert slots(tb)[0] == R * S  # the executor's stash: the table's peak, stage 0's
    assert tb.bubble == pytest.approx((S - 1) / (R * M + S - 1))


def test_interleaved_buffers_pool_their_slots_by_hand():
    """The executor's stash and inbox share one pool of slots per stage across chunks, so
    they hold what the table keeps alive at once, not K slots per chunk (K = 2S with
    Megatron's groups: 2RS). Hand counts from the rendered tables, an input alive from its
    arrival to its last backward, a gradient from its arrival to the same op; the last
    stage keeps an output for stage 0's next chunk until the tick before its forward:

    - S=2 M=4 R=2 (drawn in docs/parallelism.md): stash 4, the table's peak R*S, at tick 8
      on stage 0 (F3a): 0a 1a 2a 3a (2b, out of stage 1's F2a at tick 7, stays on stage 1
      until tick 9, for stage 0's forward at 10); inbox 2, at tick 8 on stage 1: 0a's
      gradient (stage 0's B0b, tick 5; read by B0a at 8) and 1a's (B1b, tick 7). Per chunk
      the buffers took 4 slots: 8 each.
    - S=4 M=8 R=2: stash 8, at tick 18 on stage 0 (F7a): 0a..7a (4b and 5b, out of stage
      3's F4a at 15 and F5a at 17, stay there until ticks 19 and 21); inbox 3, at tick 14 on
      stage 3: 0a's and 1a's gradients (stage 0's B0b at 11, B1b at 13, read by B0a at 16
      and B1a at 18) and 3b's loss gradient (F3b at 13, B3b at 14). Was 16 each."""
    small, large = table("interleaved_1f1b", 2, 4, 2), table("interleaved_1f1b", 4, 8, 2)
    cell = lambda tb, t, s: (int(tb.ops[t, s]), int(tb.micro[t, s]), int(tb.repeat[t, s]))
    # the cells the counts above read (so that they count this table)
    assert [cell(small, 8, 0), cell(small, 7, 1), cell(small, 10, 0)] == [(F, 3, 0), (F, 2, 0), (F, 2, 1)]
    assert [cell(large, 18, 0), cell(large, 15, 3), cell(large, 17, 3)] == [(F, 7, 0), (F, 4, 0), (F, 5, 0)]
    assert [cell(large, 20, 0), cell(large, 22, 0), cell(large, 14, 3)] == [(F, 4, 1), (F, 5, 1), (BW, 3, 1)]
    assert slots(small) == (4, 2) and max(small.live_inputs()) == 4
    assert slots(large) == (8, 3) and max(large.live_inputs()) == 8
    assert slots(table("interleaved_1f1b", 4, 32, 2)) == (8, 3)  # whatever M


@pytest.mark.parametrize("name,S,M,R", TICK_CASES, ids=str)
def test_no_buffer_slot_is_overwritten_while_live(name, S, M, R):
    """The tick program's buffer traffic simulated in numpy, each slot holding a label of
    what was written into it: every op reads its own input (stage 0's load of m, or the
    output of the forward before it) and its own output gradient (the tail's, or the input
    gradient of the backward after it), so nothing it needs was overwritten, in buffers of
    `slots(table)`."""
    tb = table(name, S, M, R)
    prog, (n_stash, n_inbox) = _tick_program(tb), slots(tb)
    stash, inbox = [[None] * n_stash for _ in range(S)], [[None] * n_inbox for _ in range(S)]

    def put(buf, s, i, label):
        if i >= 0:
            assert i < len(buf[s]), (name, S, M, R, s, i)
            buf[s][i] = label

    for t in range(tb.ticks):
        ops, micro, chunk = prog["op"][t], prog["micro"][t], prog["chunk"][t]
        if prog["load"][t] >= 0:
            put(stash, 0, prog["slot"][t, 0], ("x", int(prog["load"][t])))
        outs, grads = [None] * S, [None] * S
        for s in range(S):
            op, m, r = int(ops[s]), int(micro[s]), int(chunk[s])
            if op == IDLE:
                continue
            prev = ((s - 1, r) if s else (S - 1, r - 1)) if (s, r) != (0, 0) else None
            nxt = ((s + 1, r) if s < S - 1 else (0, r + 1)) if (s, r) != (S - 1, R - 1) else None
            want_in = ("x", m) if prev is None else ("y", *prev, m)
            assert stash[s][prog["slot"][t, s]] == want_in, (t, s, op, m, r)
            if op != F:
                want_ct = ("loss", m) if nxt is None else ("dh", *nxt, m)
                assert inbox[s][prog["gslot"][t, s]] == want_ct, (t, s, op, m, r)
            outs[s] = ("y", s, r, m) if op == F else None
            grads[s] = ("dh", s, r, m) if op in (B, BW) else None
        if prog["tail"][t] >= 0:
            put(inbox, S - 1, prog["gslot"][t, S - 1], ("loss", int(prog["tail"][t])))
        for s in range(S):  # an output kept for a later send; one sent from where it was kept
            kept = outs[s]
            if prog["send"][t, s] >= 0:
                outs[s] = stash[s][prog["send"][t, s]]
            put(stash, s, prog["keep"][t, s], kept)
        for s in range(S):  # the permutes: outputs one stage on, gradients one stage back
            put(stash, s, prog["recv_act"][t, s], outs[(s - 1) % S])
            put(inbox, s, prog["recv_grad"][t, s], grads[(s + 1) % S])


def test_schedule_reports_its_tables_bubble():
    assert Schedule(4, 8, name="zero_bubble").bubble == table("zero_bubble", 4, 8).bubble
    assert Schedule(4, 8, 2).schedule == "circular" and not Schedule(4, 8, 2).backward_inside
    assert Schedule(2, 4, name="1f1b").backward_inside
    with pytest.raises(ValueError, match="interleaved_1f1b needs microbatches divisible by stages"):
        Schedule(4, 6, 2, name="interleaved_1f1b")


def test_rendered_table():
    assert table("1f1b", 2, 4).render() == "\n".join(
        [
            "tick     0  1  2  3  4  5  6  7  8  9",
            "stage 0 F0 F1  . B0 F2 B1 F3 B2  . B3",
            "stage 1  . F0 B0 F1 B1 F2 B2 F3 B3  .",
        ]
    )
    assert (table("1f1b", 2, 4).ops == IDLE).sum() == 4
    # drawn by hand from ZB-H1 (stage 1 defers W0 past B1) and Megatron's interleaved order
    # (groups of S microbatches per chunk; warm-up (S-s-1) + (R-1)*S forwards)
    assert table("zero_bubble", 2, 3).render() == "\n".join(
        [
            "tick     0  1  2  3  4  5  6  7  8  9",
            "stage 0 F0 F1  . B0 W0 F2 B1 W1 B2 W2",
            "stage 1  . F0 B0 F1 B1 W0 F2 B2 W1 W2",
        ]
    )
    assert table("interleaved_1f1b", 2, 4, 2).render() == "\n".join(
        [
            "tick      0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15  16  17",
            "stage 0 F0a F1a F0b F1b   . B0b F2a B1b F3a B0a F2b B1a F3b B2b   . B3b B2a B3a",
            "stage 1   . F0a F1a F0b B0b F1b B1b F2a B0a F3a B1a F2b B2b F3b B3b B2a B3a   .",
        ]
    )


def test_docs_hold_the_tables_the_code_renders():
    """docs/parallelism.md's tick tables, bubbles and inputs held are the code's own
    (regenerate with `pipeline_tables.docs_markdown()` when a table changes)."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "parallelism.md").read_text()
    assert page.count("<!-- tick tables -->\n") == 1 and page.count("<!-- /tick tables -->") == 1
    drawn = page.split("<!-- tick tables -->\n")[1].split("<!-- /tick tables -->")[0]
    assert drawn == docs_markdown()


# --- the executor alone, on a toy layer ---------------------------------------------------

L, BATCH, D = 8, 8, 16


def toy_layer(p, h, ex):
    return jnp.tanh(h @ p["w"] + p["b"]) + h * ex[..., None], None


def toy_tail(tp, y, target):
    return jnp.sum((y @ tp["v"] - target) ** 2)


@pytest.fixture(scope="module")
def toy():
    k = jax.random.split(jax.random.key(0), 6)
    params = {"w": jax.random.normal(k[0], (L, D, D)) / 4, "b": jax.random.normal(k[1], (L, D))}
    tail_params = {"v": jax.random.normal(k[2], (D,))}
    x, ex = jax.random.normal(k[3], (BATCH, 4, D)), jax.random.uniform(k[4], (BATCH, 4))
    target = jax.random.normal(k[5], (BATCH, 4))

    def sequential(params, tail_params, x):
        y = jax.lax.scan(lambda h, p: toy_layer(p, h, ex), x, params)[0]
        return toy_tail(tail_params, y, target)

    ref = jax.value_and_grad(sequential, argnums=(0, 1, 2))(params, tail_params, x)
    return (params, tail_params, x, ex, target), ref


@pytest.mark.parametrize(
    "name,S,M,R", [("1f1b", 2, 4, 1), ("zero_bubble", 4, 8, 1), ("interleaved_1f1b", 2, 4, 2)], ids=str
)
def test_tick_pipeline_equals_sequential_on_stage_mesh(toy, name, S, M, R):
    (params, tail_params, x, ex, target), (ref_loss, ref_grads) = toy
    f = pipeline_loss(toy_layer, toy_tail, table=table(name, S, M, R))
    grad = jax.jit(jax.value_and_grad(lambda p, tp, x: f(p, tp, x, ex, target), argnums=(0, 1, 2)))
    with jax.set_mesh(sharding.make_mesh({"stage": S, "data": 8 // S})):
        loss, grads = grad(params, tail_params, x)
        hlo = grad.lower(params, tail_params, x).compile().as_text()
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5), grads, ref_grads)
    assert "collective-permute" in hlo
    # each device branches on its stage's op (IDLE, F, B, W, BW): a 5-way conditional
    assert re.search(r" conditional\(.*branch_computations=\{(%[\w.]+, ){4}%[\w.]+\}", hlo)


def aux_layer(p, h, ex):
    y = toy_layer(p, h, ex)[0]
    return y, {"sq": jnp.mean(y**2), "positive": jnp.sum(y > 0)}  # an integer leaf: no gradient


@pytest.mark.parametrize("name,S,M,R", [("zero_bubble", 2, 4, 1), ("interleaved_1f1b", 2, 4, 2)], ids=str)
def test_layer_aux_and_its_loss_equal_sequential(toy, name, S, M, R):
    """The layers' aux comes out [L, M] in model order, and with aux_weights the gradients
    hold the aux loss's, taken in each stage's backward (W's peeled first layer included);
    against each microbatch run through a plain scan (rows m, m+M, ...) and jax.grad of
    its loss plus 0.3 x the sum of every layer's `sq`."""
    (params, tail_params, x, ex, target), _ = toy
    weight = 0.3

    def sequential(params, tail_params, x):
        total, auxes = 0.0, []
        for m in range(M):
            rows = slice(m, None, M)
            y, aux = jax.lax.scan(lambda h, p: aux_layer(p, h, ex[rows]), x[rows], params)
            total += toy_tail(tail_params, y, target[rows]) + weight * jnp.sum(aux["sq"])
            auxes.append(aux)
        return total, jax.tree.map(lambda *a: jnp.stack(a, axis=1), *auxes)  # [L, M]

    (ref_loss, ref_aux), ref_grads = jax.value_and_grad(sequential, argnums=(0, 1, 2), has_aux=True)(
        params, tail_params, x
    )
    f = pipeline_loss(aux_layer, toy_tail, table=table(name, S, M, R))

    def objective(p, tp, x):  # the aux term added as the contract says: its gradient is inside
        loss, aux = f(p, tp, x, ex, target, {"sq": weight, "positive": 0})
        return loss + weight * jnp.sum(aux["sq"]), aux

    grad = jax.jit(jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True))
    with jax.set_mesh(sharding.make_mesh({"stage": S, "data": 8 // S})):
        (loss, aux), grads = grad(params, tail_params, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(aux["sq"], ref_aux["sq"], rtol=1e-6)
    np.testing.assert_array_equal(aux["positive"], ref_aux["positive"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5), grads, ref_grads)


# Executions of the stage's layers, counted by the layers themselves: a callback in the
# forward, and a gradient marker (identity with a custom VJP) on the layer's input and on its
# weight whose backward calls back. The callbacks take a loop-varying operand, so none is
# hoisted out of the layer scan.
_RUNS = collections.Counter()


def _note(kind, operand):
    def record(stage, _):
        _RUNS[(kind, int(stage))] += 1

    jax.debug.callback(record, jax.lax.axis_index("stage"), operand)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _grad_marker(a, kind):
    return a


def _marker_bwd(kind, _, g):
    _note(kind, g)
    return (g,)


_grad_marker.defvjp(lambda a, kind: (a, None), _marker_bwd)


def counted_layer(p, h, ex):
    _note("forward", h)
    return jnp.tanh(_grad_marker(h, "input grad") @ _grad_marker(p["w"], "weight grad")), None


@pytest.mark.parametrize(
    "name, forwards, input_grads, weight_grads",
    [
        # 2 layers x (4 F + 4 BW); the every-tick executor ran 2 x 10 ticks of each
        ("1f1b", 2 * 8, 2 * 4, 2 * 4),
        # 2 layers x (4 F + 4 B + 4 W) forwards; input grads: 2 layers x 4 B, and in W the
        # second layer's input (the first layer's weight gradient needs it); weight grads:
        # 2 layers x 4 W only, none in B
        ("zero_bubble", 2 * 12, 2 * 4 + 4, 2 * 4),
    ],
)
def test_each_stage_runs_only_its_tables_ops(name, forwards, input_grads, weight_grads):
    """S=2, M=4, 2 layers per stage: per stage, each layer runs as often as the table's ops
    need (F: a forward; B: a forward and the input gradient; W: a forward and the weight
    gradient; BW: both), not once per tick (10 ticks for 1f1b, 14 for zero_bubble)."""
    S, M = 2, 4
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(k[0], (2 * S, 8, 8)) / 3}
    x, target = jax.random.normal(k[1], (M, 8)), jax.random.normal(k[2], (M,))
    f = pipeline_loss(counted_layer, lambda v, y, t: jnp.sum((y @ v - t) ** 2), table=table(name, S, M))
    grad = jax.jit(jax.grad(lambda p, x: f(p, jnp.ones(8), x, None, target), argnums=(0, 1)))
    # a mesh of `stage` alone: jax 0.12.0.1's debug callback fails inside a shard_map that
    # leaves several mesh axes automatic (debugging.py passes them all to axis_index)
    _RUNS.clear()
    with jax.set_mesh(jax.sharding.Mesh(np.array(jax.devices()[:S]), ("stage",))):
        jax.block_until_ready(grad(params, x))
        jax.effects_barrier()
    for s in range(S):
        assert [_RUNS[(kind, s)] for kind in ("forward", "input grad", "weight grad")] == [
            forwards,
            input_grads,
            weight_grads,
        ], s


# --- the model and train step: loss and gradients equal one device ------------------------


def _cfg(n_layers):
    return tiny_config(None, *SMALL, f"model.n_layers={n_layers}")


@pytest.fixture(scope="module")
def four_layer_single_device():
    return loss_and_grads(_cfg(4))


@pytest.mark.composes("lm+1f1b", "dense+1f1b", "fsdp+1f1b", "tensor+1f1b")
@pytest.mark.parametrize("microbatches", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_1f1b_stage2_fsdp2_tensor2_equals_one_device(four_layer_single_device, microbatches):
    cfg = replace(
        _cfg(4),
        mesh=dict(stage=2, fsdp=2, tensor=2),
        pipeline=dict(schedule="1f1b", microbatches=microbatches),
    )
    assert_matches(loss_and_grads(cfg), four_layer_single_device)


@pytest.mark.slow
@pytest.mark.composes("lm+zero_bubble", "dense+zero_bubble", "tensor+zero_bubble")
@pytest.mark.parametrize("microbatches", [2, 4])
def test_zero_bubble_equals_one_device(four_layer_single_device, microbatches):
    cfg = replace(
        _cfg(4),
        mesh=dict(stage=2, fsdp=2, tensor=2),
        pipeline=dict(schedule="zero_bubble", microbatches=microbatches),
    )
    assert_matches(loss_and_grads(cfg), four_layer_single_device)


@pytest.fixture(scope="module")
def eight_layer_single_device():
    """The one-device oracle of both interleaved cases, computed once."""
    return loss_and_grads(_cfg(8))


@pytest.mark.slow
@pytest.mark.composes(
    "lm+interleaved_1f1b", "dense+interleaved_1f1b", "fsdp+interleaved_1f1b", "tensor+interleaved_1f1b"
)
@pytest.mark.parametrize("microbatches", [2, 4])
def test_interleaved_1f1b_8_layers_repeats2_equals_one_device(eight_layer_single_device, microbatches):
    ref = eight_layer_single_device
    cfg = replace(
        _cfg(8),
        mesh=dict(stage=2, fsdp=2, tensor=2),
        pipeline=dict(schedule="interleaved_1f1b", repeats=2, microbatches=microbatches),
    )
    assert_matches(loss_and_grads(cfg), ref)


@pytest.mark.composes("moe+fsdp", "moe+expert", "fsdp+expert")
@pytest.mark.parametrize(
    "schedule, dense_prefix",
    [
        pytest.param("1f1b", 0, marks=pytest.mark.composes("moe+1f1b", "expert+1f1b", "fsdp+1f1b")),
        pytest.param(
            "zero_bubble",
            2,
            marks=pytest.mark.composes("moe+zero_bubble", "expert+zero_bubble", "fsdp+zero_bubble"),
        ),
    ],
)
def test_moe_stages_with_expert_parallelism_equal_one_device(schedule, dense_prefix):
    """MoE layers inside the stages (stage 2 x expert 2 x fsdp 2, 2 microbatches; 2 MoE
    layers, after 2 dense ones with zero_bubble, which run as a gpipe forward): the loss and
    the gradients, the router losses' included (taken in each stage's backward; without them
    the router's gradients differ by up to 1e-4, 17x), equal one device's with
    train.microbatches=2 (the router losses are means over microbatches either way);
    tolerances of tests/test_pipeline.py."""
    cfg = moe_cfg()
    moe = dataclasses.replace(cfg.model.moe, first_dense_layers=dense_prefix)
    cfg = replace(cfg, model=dict(n_layers=2 + dense_prefix, moe=moe))
    ref = loss_and_grads(replace(cfg, train=dict(microbatches=2)))
    got = loss_and_grads(
        replace(cfg, mesh=dict(stage=2, expert=2, fsdp=2), pipeline=dict(schedule=schedule, microbatches=2))
    )
    assert_matches(got, ref)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["mesh.stage=2", "pipeline.schedule=1f1b", "pipeline.repeats=2"],
            "pipeline.repeats=2: schedule 1f1b",
        ),
        (
            ["mesh.stage=2", "pipeline.schedule=interleaved_1f1b"],
            "pipeline.repeats=1: schedule interleaved_1f1b",
        ),
        (
            [
                "mesh.stage=2",
                "pipeline.schedule=interleaved_1f1b",
                "pipeline.repeats=2",
                "pipeline.microbatches=3",
            ],
            "pipeline.microbatches=3: the interleaved_1f1b schedule expects a multiple of mesh.stage=2",
        ),
        (["pipeline.schedule=1f1b", "train.objective=dpo"], "train.objective=dpo"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        cfg = tiny_config(None, *SMALL, "model.n_layers=8", "mesh.stage=2", *overrides)
        validate(cfg, math.prod(cfg.mesh.sizes().values()))


def test_tick_loop_program_is_flat_in_microbatches(toy):
    """The table is the scan's input, not unrolled code: the compiled program on a stage mesh
    has as many instructions at M=16 as at M=2, within 2% (measured: 1137 and 1138; K <= S
    slots either way). An unrolled schedule would grow 8-fold."""
    (params, tail_params, x, ex, target), _ = toy
    x16, ex16, t16 = (jnp.concatenate([a] * 2) for a in (x, ex, target))  # 16 rows, 16 microbatches

    def instructions(M, x, ex, target):
        f = pipeline_loss(toy_layer, toy_tail, table=table("1f1b", 2, M))
        grad = jax.jit(jax.grad(lambda p: f(p, tail_params, x, ex, target)))
        return sum(" = " in line for line in grad.lower(params).compile().as_text().splitlines())

    with jax.set_mesh(sharding.make_mesh({"stage": 2, "data": 4})):
        assert instructions(16, x16, ex16, t16) == pytest.approx(instructions(2, x, ex, target), rel=0.02)


# --- checkpoints: the schedule is how a step runs, not what it computes --------------------


@pytest.mark.slow
def test_checkpoint_from_gpipe_resumes_under_zero_bubble(tmp_path, capfd):
    """Two steps under gpipe, saved, two more under zero_bubble (as its bubble, printed at
    start and logged, shows: 1 of 13 ticks against gpipe's 2 of 10): the losses of an
    uninterrupted 4-step gpipe run, the same math in another order (f32, rtol 1e-5)."""

    def run(name, schedule, steps):
        cfg = tiny_config(
            tmp_path / name,
            *SMALL,
            "model.n_layers=4",
            "mesh.stage=2",
            "pipeline.microbatches=4",
            f"pipeline.schedule={schedule}",
            f"train.steps={steps}",
            "checkpoint.every=2",
        )
        return train(cfg, devices=jax.devices()[:2])

    ref = run("ref", "gpipe", 4)
    first = run("switch", "gpipe", 2)
    capfd.readouterr()
    resumed = run("switch", "zero_bubble", 4)
    assert "bubble (idle share of its tick table) = 0.077" in capfd.readouterr().err
    assert resumed.start_step == 2
    assert [m["pipeline_bubble"] for m in first.metrics + resumed.metrics] == pytest.approx(
        [2 / 10, 2 / 10, 1 / 13, 1 / 13]
    )
    losses = [m["loss"] for m in first.metrics + resumed.metrics]
    np.testing.assert_allclose(losses, [m["loss"] for m in ref.metrics], rtol=1e-5)
    assert len(set(losses)) == 4  # it trains

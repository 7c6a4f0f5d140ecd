"""Pipeline schedules with interleaved forwards and backwards (1F1B, interleaved 1F1B,
zero bubble), executed from their tick table as one SPMD program.

`sharding/pipeline.py` runs every forward and lets autodiff run every backward afterwards,
so each stage keeps the input of every microbatch until the backward pass: memory grows
with M. Here the backward of a microbatch runs as soon as the schedule says so, which
autodiff cannot express: the whole forward and backward of the pipelined layers, the loss
included, run inside one function (`pipeline_loss_and_grads`), and `pipeline_loss` wraps it
in a `jax.custom_vjp` whose forward computes the loss and every gradient at once and whose
backward only scales those gradients by the loss's cotangent. The train step then
differentiates its loss as before: the embedding before the pipeline gets its gradient
through the returned input gradient, and the head's parameters are the tail's.

The tick loop (`lax.scan` over the table's ticks, on the pattern of `sharding/pipeline.py`):

* the weights are viewed `[stage, repeat, layers_per_stage, ...]` on mesh axis `stage`;
  per stage, a stash `[R*K, rows, ...]` holds the stage inputs of the microbatches in
  flight and an inbox `[R*K, rows, ...]` their output gradients, K slots per chunk
  (microbatch m in slot m mod K). K comes from the table (`slots`): the fewest slots in which
  no two microbatches in flight collide; for 1F1B it is at most S, whatever M is;
* at each tick every stage (one `jax.vmap` over stages, `spmd_axis_name="stage"`, under
  one `jax.vjp`) runs the vjp of its stage (a `lax.scan` over its layers, each with the caller's remat) from
  a stashed input, with the inbox's gradient as the cotangent on a backward op and zero on a
  forward op: the primal output is the forward's result, the cotangent's pullback the
  backward's. Which of them a stage keeps (sends its output on, sends its input gradient
  back, adds its weight gradient) is read from the table;
* the last stage's forward of the last chunk also runs the tail (`tail_fn`: norm, head,
  loss of that microbatch) and its vjp, which puts the loss gradient in the last stage's
  inbox for its backward;
* outputs move one stage on and input gradients one stage back by `jnp.roll` on the
  stage-sharded dimension (a collective-permute over `stage`), into the receivers' stash
  and inbox slots.

Cost. A vmapped stage cannot branch per stage, so every tick runs one forward and one
backward of a stage, masked by the table: a forward tick costs as much as a backward one.
Per step that is about 2(M*R + S - 1) stage forward+backward passes, against GPipe's
M*R + S - 1 forwards plus as many rematerialized forward+backward passes here: about 1.5x
GPipe's compute, for memory bounded by K (<= S) microbatches instead of M. Running only the
table's op (a per-stage branch under `shard_map`) would remove that overhead; it is not done.
The zero-bubble table splits B and W; executed this way both run the full vjp (W
recomputes it from the kept input and gradient), so it is correct but not faster here.

Imports only jax and numpy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtrain.sharding.microbatches import merge_microbatches, split_microbatches
from jaxtrain.sharding.microbatches import stage_axis_size as _stage_axis_size
from jaxtrain.sharding.pipeline_tables import BW, IDLE, B, F, TickTable, W


def slots(table: TickTable) -> int:
    """The fewest slots K per (stage, chunk) such that microbatch m in slot m mod K never
    overwrites one still in use, for the stash (input kept from its arrival to its last
    backward op) and the inbox (gradient kept from its arrival to its last backward op)."""
    stash, inbox = _occupancy(table)
    for k in range(1, table.microbatches + 1):
        if all(_fits(spans, k) for spans in (*stash.values(), *inbox.values())):
            return k
    raise AssertionError("unreachable: M slots always fit")


def _occupancy(table: TickTable):
    """{(stage, chunk): {micro: (written at the end of tick, last read at tick)}} for the
    stash and the inbox."""
    S, R = table.stages, table.repeats
    at = {}
    for t in range(table.ticks):
        for s in range(S):
            op = int(table.ops[t, s])
            if op != IDLE:
                kind = B if op == BW else op
                at[(kind, s, int(table.micro[t, s]), int(table.repeat[t, s]))] = t
    stash, inbox = {}, {}
    for (kind, s, m, r), t in at.items():
        if kind != F:
            continue
        last = at.get((W, s, m, r), at[(B, s, m, r)])
        if (s, r) == (0, 0):
            written = t - 1  # loaded at the start of its forward's tick
        else:
            prev = (s - 1, r) if s > 0 else (S - 1, r - 1)
            written = at[(F, prev[0], m, prev[1])]
        stash.setdefault((s, r), {})[m] = (written, last)
        if (s, r) == (S - 1, R - 1):
            g_written = t  # the tail's gradient, formed in the forward's tick
        else:
            nxt = (s + 1, r) if s < S - 1 else (0, r + 1)
            g_written = at[(B, nxt[0], m, nxt[1])]
        inbox.setdefault((s, r), {})[m] = (g_written, last)
    return stash, inbox


def _fits(spans: dict, k: int) -> bool:
    for m1, (w1, u1) in spans.items():
        for m2, (w2, u2) in spans.items():
            if m1 < m2 and m1 % k == m2 % k and w2 < u1 and w1 < u2:
                return False
    return True


def _tick_program(table: TickTable, k: int) -> dict[str, np.ndarray]:
    """Per tick, what every stage does and where arrivals go (int32 arrays, -1 for none)."""
    S, R, T = table.stages, table.repeats, table.ticks
    ops, micro, rep = table.ops, np.maximum(table.micro, 0), np.maximum(table.repeat, 0)
    slot = rep * k + micro % k
    recv_act, recv_grad = np.full((T, S), -1), np.full((T, S), -1)
    load, tail, dx = np.full(T, -1), np.full(T, -1), np.full(T, -1)
    for t in range(T):
        for s in range(S):
            op, m, r = int(ops[t, s]), int(micro[t, s]), int(rep[t, s])
            if op == F:
                if (s, r) == (0, 0):
                    load[t] = m
                if (s, r) == (S - 1, R - 1):
                    tail[t] = m
                else:  # the next chunk's stage receives it
                    nxt, nr = (s + 1, r) if s < S - 1 else (0, r + 1)
                    recv_act[t, nxt] = nr * k + m % k
            if op in (B, BW):
                if (s, r) == (0, 0):
                    dx[t] = m
                else:
                    prev, pr = (s - 1, r) if s > 0 else (S - 1, r - 1)
                    recv_grad[t, prev] = pr * k + m % k
    to32 = lambda a: np.asarray(a, np.int32)
    return dict(
        op=to32(ops),
        micro=to32(micro),
        chunk=to32(rep),
        slot=to32(slot),
        recv_act=to32(recv_act),
        recv_grad=to32(recv_grad),
        load=to32(load),
        tail=to32(tail),
        dx=to32(dx),
    )


def pipeline_loss_and_grads(
    layer_fn: Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]],
    params: Any,
    x: jax.Array,
    extras: Any,
    tail_fn: Callable[[Any, jax.Array, Any], jax.Array],
    tail_params: Any,
    tail_inputs: Any,
    *,
    table: TickTable,
    axis: str = "stage",
    x_spec: P | None = None,
) -> tuple[jax.Array, tuple[Any, Any, jax.Array]]:
    """The summed loss of every microbatch and its gradients, by the schedule `table`.

    layer_fn, params, x, extras, axis, x_spec: as `sharding.run_pipeline` (the layers' aux is
      dropped). params' layers are in model order; chunk r of stage s holds layers
      `r*S*lps + s*lps .. + lps - 1`, the layout of the circular schedule.
    tail_fn(tail_params, y_rows, tail_rows) -> scalar: the loss of one microbatch from the
      last layer's output (its rows of `tail_inputs`, a pytree of `[B, ...]`).

    Returns (loss, (d params, d tail_params, d x)): the sum over microbatches of tail_fn and
    its gradients.
    """
    S, M, R = table.stages, table.microbatches, table.repeats
    leaves = jax.tree.leaves(params)
    n_layers = leaves[0].shape[0]
    if any(leaf.shape[:1] != (n_layers,) for leaf in leaves) or n_layers % (S * R):
        raise ValueError(
            f"pipeline: params need one leading layer dim dividing into stages={S} x repeats={R}"
        )
    if x.shape[0] % M:
        raise ValueError(f"pipeline: x batch {x.shape[:1]} is not a multiple of microbatches={M}")
    mesh_size = _stage_axis_size(axis)
    if mesh_size not in (None, 1, S):
        raise ValueError(f"pipeline: stages={S} but mesh axis {axis!r} has size {mesh_size}")
    spmd = axis if mesh_size == S and S > 1 else None
    if mesh_size is None:
        x_spec = None
    lps = n_layers // (S * R)
    k = slots(table)
    program = {key: jnp.asarray(v) for key, v in _tick_program(table, k).items()}

    def on_stage(a, rows_dim: int | None = None, stage_dim: bool = True):
        """Dim 0 on `stage` (replicated there if not `stage_dim`); the rows at `rows_dim`
        held to x_spec; the rest unconstrained."""
        axis0 = spmd if stage_dim else None
        if axis0 is None and (x_spec is None or rows_dim is None):
            return a
        spec = [axis0, *[P.UNCONSTRAINED] * (a.ndim - 1)]
        if x_spec is not None and rows_dim is not None:
            rows = [*x_spec, *[None] * (a.ndim - rows_dim - len(x_spec))]
            spec[rows_dim:] = rows
        return jax.lax.with_sharding_constraint(a, P(*spec))

    def to_stages(p):  # [L, ...] -> [S, R, lps, ...]
        return on_stage(p.reshape(R, S, lps, *p.shape[1:]).swapaxes(0, 1))

    def from_stages(g):  # [S, R, lps, ...] -> [L, ...]
        return g.swapaxes(0, 1).reshape(n_layers, *g.shape[3:])

    stage_params = jax.tree.map(to_stages, params)
    xs = on_stage(split_microbatches(x, M), rows_dim=1, stage_dim=False)  # [M, rows, ...]
    ex = jax.tree.map(lambda e: split_microbatches(e, M), extras)
    tail_rows = jax.tree.map(lambda e: split_microbatches(e, M), tail_inputs)

    def stage_fn(p_stage, chunk, h, ex_rows):
        p = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, chunk, 0, keepdims=False), p_stage)
        return jax.lax.scan(lambda h, lp: (layer_fn(lp, h, ex_rows)[0], None), h, p)[0]

    def stage_forward(p_stage, chunk, micro, h):
        ex_rows = jax.tree.map(lambda e: jnp.take(e, micro, axis=0), ex)
        return stage_fn(p_stage, chunk, h, ex_rows)

    forward_stages = jax.vmap(stage_forward, spmd_axis_name=spmd)

    def per_stage(mask, a):  # [S] -> broadcastable against a [S, ...]
        return mask.reshape(S, *[1] * (a.ndim - 1))

    def run_stages(acc, op, chunk, micro, h, ct):
        """Every stage's tick: outputs, input gradients and the weight-gradient sums. The
        vjp is taken of the vmapped forward (not vmapped itself), as autodiff of
        `run_pipeline` does: kernels with a custom VJP (cuDNN attention) batch their forward
        only then."""
        backward = (op == B) | (op == W) | (op == BW)
        ct = jnp.where(per_stage(backward, ct), ct, jnp.zeros_like(ct))
        y, pull = jax.vjp(lambda p, h: forward_stages(p, chunk, micro, h), stage_params, h)
        dp, dh = pull(ct)
        keep = (op == W) | (op == BW)
        acc = jax.tree.map(lambda a, g: a + jnp.where(per_stage(keep, g), g, 0).astype(a.dtype), acc, dp)
        return y, dh, acc

    def put(buf, i, v):  # one stage: buf[i] = v unless i < 0
        old = jax.lax.dynamic_index_in_dim(buf, jnp.maximum(i, 0), 0, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(i >= 0, v, old), jnp.maximum(i, 0), 0)

    def get(buf, i):
        return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)

    stage_ids = jnp.arange(S)

    def broadcast(v):  # one microbatch's rows -> [S, rows, ...], each stage's copy
        return on_stage(jnp.broadcast_to(v, (S, *v.shape)), rows_dim=1)

    put_stages = jax.vmap(put, spmd_axis_name=spmd)
    get_stages = jax.vmap(get, spmd_axis_name=spmd)

    def tail_vjp(tp, y, m):
        rows = jax.tree.map(lambda e: jnp.take(e, m, axis=0), tail_rows)
        loss, pull = jax.vjp(lambda tp, y: tail_fn(tp, y, rows), tp, y)
        return (loss, *pull(jnp.ones_like(loss)))

    def tick(carry, now):
        stash, inbox, dxs, acc, tail_acc, loss = carry
        # stage 0 takes a new microbatch into its stash at the start of its forward
        first = jnp.maximum(now["load"], 0)
        # (written through the per-stage put with one target stage, so that no stage-sharded
        # buffer is updated at a fixed stage index, which XLA does with an all-reduce)
        into = jnp.where((stage_ids == 0) & (now["load"] >= 0), now["slot"], -1)
        stash = on_stage(put_stages(stash, into, broadcast(get(xs, first))), rows_dim=2)
        h = on_stage(get_stages(stash, now["slot"]), rows_dim=1)
        ct = on_stage(get_stages(inbox, now["slot"]), rows_dim=1)
        y, dh, acc = run_stages(acc, now["op"], now["chunk"], now["micro"], h, ct)
        y, dh = on_stage(y, rows_dim=1), on_stage(dh, rows_dim=1)
        # the last chunk's forward: its microbatch's loss and loss gradient
        m = jnp.maximum(now["tail"], 0)
        valid = now["tail"] >= 0
        loss_m, d_tail, dy = tail_vjp(tail_params, y[S - 1], m)
        loss = loss + jnp.where(valid, loss_m, 0).astype(loss.dtype)
        tail_acc = jax.tree.map(lambda a, g: a + jnp.where(valid, g, 0).astype(a.dtype), tail_acc, d_tail)
        into = jnp.where((stage_ids == S - 1) & valid, now["slot"], -1)
        inbox = on_stage(put_stages(inbox, into, broadcast(dy.astype(inbox.dtype))), rows_dim=2)
        # stage 0's backward of the first chunk: the gradient of the pipeline's input
        dxs = on_stage(put(dxs, now["dx"], dh[0]), rows_dim=1, stage_dim=False)
        # outputs one stage on, input gradients one stage back (collective permutes)
        stash = on_stage(put_stages(stash, now["recv_act"], jnp.roll(y, 1, axis=0)), rows_dim=2)
        inbox = on_stage(put_stages(inbox, now["recv_grad"], jnp.roll(dh, -1, axis=0)), rows_dim=2)
        return (stash, inbox, dxs, acc, tail_acc, loss), None

    buffers = on_stage(jnp.zeros((S, R * k, *xs.shape[1:]), xs.dtype), rows_dim=2)
    acc0 = jax.tree.map(lambda a: on_stage(jnp.zeros_like(a)), stage_params)
    tail0 = jax.tree.map(jnp.zeros_like, tail_params)
    loss0 = jnp.zeros((), jnp.float32)
    carry = (buffers, buffers, jnp.zeros_like(xs), acc0, tail0, loss0)
    (_, _, dxs, acc, d_tail, loss), _ = jax.lax.scan(tick, carry, program)
    return loss, (jax.tree.map(from_stages, acc), d_tail, merge_microbatches(dxs))


def pipeline_loss(layer_fn, tail_fn, *, table: TickTable, axis: str = "stage", x_spec: P | None = None):
    """f(params, tail_params, x, extras, tail_inputs) -> the summed loss, differentiable in
    params, tail_params and x: a `jax.custom_vjp` whose forward runs
    `pipeline_loss_and_grads` (every gradient at once, by the schedule) and whose backward
    scales those gradients by the loss's cotangent. extras and tail_inputs (positions,
    targets: integers) get no gradient."""

    def run(params, tail_params, x, extras, tail_inputs):
        return pipeline_loss_and_grads(
            layer_fn,
            params,
            x,
            extras,
            tail_fn,
            tail_params,
            tail_inputs,
            table=table,
            axis=axis,
            x_spec=x_spec,
        )

    @jax.custom_vjp
    def f(params, tail_params, x, extras, tail_inputs):
        return run(params, tail_params, x, extras, tail_inputs)[0]

    def fwd(params, tail_params, x, extras, tail_inputs):
        loss, grads = run(params, tail_params, x, extras, tail_inputs)
        return loss, (grads, extras, tail_inputs)

    def bwd(res, g):
        grads, extras, tail_inputs = res
        scaled = jax.tree.map(lambda a: (a * g).astype(a.dtype), grads)
        no_grad = lambda tree: jax.tree.map(_zero_cotangent, tree)
        return (*scaled, no_grad(extras), no_grad(tail_inputs))

    f.defvjp(fwd, bwd)
    return f


def _zero_cotangent(a):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros_like(a)
    return np.zeros(a.shape, jax.dtypes.float0)

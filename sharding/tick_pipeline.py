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
  per stage, a stash `[n, rows, ...]` holds the stage inputs in flight and an inbox
  `[n', rows, ...]` their output gradients, one pool of slots per stage shared by its
  chunks: each (microbatch, chunk) takes the lowest slot free when it arrives and frees it
  after its last backward op, the table's slots per tick computed once in numpy
  (`_assign_slots`), so n and n' are the most the table keeps alive at once on a stage
  (`slots`): S inputs and one gradient for 1F1B whatever M is, not K slots per chunk.
  The last stage sends an output for stage 0's next chunk at the tick before that chunk's
  forward, keeping it in its own stash until then, where stage 0 would keep it waiting;
* at each tick every stage runs the table's op, and only it, in a `jax.shard_map` manual
  over `stage` alone (fsdp, tensor, data stay automatic: XLA partitions the layers inside
  as it does for GPipe): a `lax.switch` on the op code, so each device takes its own
  branch. IDLE does nothing; F runs the stage forward (a `lax.scan` over its layers, each
  with the caller's remat), no vjp; B the vjp in the stage input alone (the weights are
  constants: no weight-gradient work); W the vjp in the weights alone, recomputed from the
  stashed input and the inbox's gradient (its first layer outside the layer scan, so that
  no gradient of the stage input is formed); BW the vjp in both;
* the last stage's forward of the last chunk also runs the tail (`tail_fn`: norm, head,
  loss of that microbatch) and its vjp, which puts the loss gradient in the last stage's
  inbox for its backward. The tail runs outside the manual region, under a `lax.cond` on
  the table, so on every stage's devices: XLA's partitioner aborts on the loss's gather
  from vocab-sharded logits inside a region manual over `stage` (jax 0.12.0.1);
* outputs move one stage on and input gradients one stage back by `lax.ppermute` over
  `stage` (collective permutes), into the receivers' stash and inbox slots.

Without a mesh axis `stage` (one device, tests) the same per-stage program runs with the
stages vmapped, where the switch runs every branch and selects: correct, not fast.

Cost. A stage's forward runs once per op of the table, its backward halves only where the
op needs them. Per step and stage, with a chunk's forward as the unit (a backward about
two): 1F1B and interleaved 1F1B run M*R forwards and M*R BWs (a forward again plus the
backward, the layers' own remat inside as `model.remat` says), the compute of GPipe with
its stage recompute; zero bubble runs M F, M B (forward + input gradient) and M W (forward +
weight gradient, the gradient chain through the chunk's later layers included), one
forward more per microbatch than BW, placed in ticks that would otherwise idle. Idle ticks
cost nothing but the permutes, which every tick sends (zeros where the table sends
nothing). The tail runs at the M ticks that have one, on every device (above), as GPipe's
head, which runs after its pipeline on every device too. Memory: the stash and inbox hold
what the table keeps alive (S inputs for 1F1B, R*S for interleaved 1F1B), not M.

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


def slots(table: TickTable) -> tuple[int, int]:
    """(stash slots, inbox slots): the size of each per-stage buffer, the most stage inputs
    (output gradients) any stage holds at once by the table, every (micro, chunk) of a stage
    sharing one pool (`_assign_slots`). An input is held from its arrival (the end of the
    previous stage's forward, or stage 0's load at the start of its own) to its stage's last
    backward op, a gradient from its arrival to the same op (`_occupancy`): 1F1B holds at
    most S inputs, interleaved 1F1B R*S."""
    stash, inbox = _assign_slots(table)
    return 1 + max(stash.values()), 1 + max(inbox.values())


def _occupancy(table: TickTable):
    """{(stage, chunk): {micro: (written at the end of tick, last read at tick)}} for the
    stash, the inbox and the last stage's held outputs (`held`, by the chunk they leave).

    A last-stage output for the next chunk's forward on stage 0 is sent just in time, at
    the tick before that forward: until then the last stage keeps it in its own stash
    (stage 0, which holds the most, would otherwise keep it waiting)."""
    S, R = table.stages, table.repeats
    at = {}
    for t in range(table.ticks):
        for s in range(S):
            op = int(table.ops[t, s])
            if op != IDLE:
                kind = B if op == BW else op
                at[(kind, s, int(table.micro[t, s]), int(table.repeat[t, s]))] = t
    stash, inbox, held = {}, {}, {}
    for (kind, s, m, r), t in at.items():
        if kind != F:
            continue
        last = at.get((W, s, m, r), at[(B, s, m, r)])
        if s == 0:
            written = t - 1  # loaded at the start of its forward's tick, or sent just before it
            if r > 0 and at[(F, S - 1, m, r - 1)] < written:
                held.setdefault((S - 1, r - 1), {})[m] = (at[(F, S - 1, m, r - 1)], written)
        else:
            written = at[(F, s - 1, m, r)]
        stash.setdefault((s, r), {})[m] = (written, last)
        if (s, r) == (S - 1, R - 1):
            g_written = t  # the tail's gradient, formed in the forward's tick
        else:
            nxt = (s + 1, r) if s < S - 1 else (0, r + 1)
            g_written = at[(B, nxt[0], m, nxt[1])]
        inbox.setdefault((s, r), {})[m] = (g_written, last)
    return stash, inbox, held


def _assign_slots(table: TickTable) -> tuple[dict, dict]:
    """({(stage, chunk, micro): stash slot} and, keyed ("held", chunk, micro), the last
    stage's held outputs; {(stage, chunk, micro): inbox slot}): per stage one pool over all
    its chunks, each arrival taking the lowest slot free at its arrival (freed after its
    last read; a write at the end of that tick may reuse it). In order of arrival this
    colours the interval graph of the lifetimes optimally: a stage needs as many slots as
    it has (micro, chunk) alive at once, whatever the chunk."""

    def colour(items):  # [(stage, written, last read, key)] -> {key: slot}
        out, free_after = {}, {}  # stage -> [the tick of each slot's occupant's last read]
        for w, u, s, key in sorted((w, u, s, key) for s, w, u, key in items):
            ends = free_after.setdefault(s, [])
            i = next((i for i, end in enumerate(ends) if end <= w), len(ends))
            ends[i : i + 1] = [u]
            out[key] = i
        return out

    stash, inbox, held = _occupancy(table)
    spans = lambda occ, tag: [
        (s, w, u, (*tag, r, m) if tag else (s, r, m)) for (s, r), d in occ.items() for m, (w, u) in d.items()
    ]
    return colour(spans(stash, ()) + spans(held, ("held",))), colour(spans(inbox, ()))


def _tick_program(table: TickTable) -> dict[str, np.ndarray]:
    """Per tick, what every stage does and where arrivals go (int32 arrays, -1 for none):
    `slot` / `gslot` the stash / inbox slot the stage's op reads (the last chunk's forward
    on the last stage: where its loss gradient goes), 0 where it reads none; `keep` the
    stash slot where the last stage keeps its output for a later send, `send` the slot it
    sends from instead of this tick's output (`_occupancy`)."""
    S, R, T = table.stages, table.repeats, table.ticks
    ops, micro, rep = table.ops, np.maximum(table.micro, 0), np.maximum(table.repeat, 0)
    stash_at, inbox_at = _assign_slots(table)
    _, _, held = _occupancy(table)
    slot, gslot = np.zeros((T, S)), np.zeros((T, S))
    recv_act, recv_grad = np.full((T, S), -1), np.full((T, S), -1)
    keep, send = np.full((T, S), -1), np.full((T, S), -1)
    load, tail, dx = np.full(T, -1), np.full(T, -1), np.full(T, -1)
    for (s, r), spans in held.items():
        for m, (w, u) in spans.items():
            keep[w, s] = send[u, s] = stash_at[("held", r, m)]
    for t in range(T):
        for s in range(S):
            op, m, r = int(ops[t, s]), int(micro[t, s]), int(rep[t, s])
            if op == IDLE:
                continue
            slot[t, s], gslot[t, s] = stash_at[(s, r, m)], inbox_at[(s, r, m)]
            if op == F:
                if (s, r) == (0, 0):
                    load[t] = m
                elif s == 0:  # the last stage sends it at the tick before
                    recv_act[t - 1, 0] = slot[t, 0]
                if (s, r) == (S - 1, R - 1):
                    tail[t] = m
                elif s < S - 1:  # the next stage receives it
                    recv_act[t, s + 1] = stash_at[(s + 1, r, m)]
            if op in (B, BW):
                if (s, r) == (0, 0):
                    dx[t] = m
                else:
                    prev, pr = (s - 1, r) if s > 0 else (S - 1, r - 1)
                    recv_grad[t, prev] = inbox_at[(prev, pr, m)]
    to32 = lambda a: np.asarray(a, np.int32)
    return dict(
        op=to32(ops),
        micro=to32(micro),
        chunk=to32(rep),
        slot=to32(slot),
        gslot=to32(gslot),
        recv_act=to32(recv_act),
        recv_grad=to32(recv_grad),
        keep=to32(keep),
        send=to32(send),
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
    aux_weights: Any = None,
) -> tuple[jax.Array, Any, tuple[Any, Any, jax.Array]]:
    """The summed loss of every microbatch and its gradients, by the schedule `table`.

    layer_fn, params, x, extras, axis, x_spec: as `sharding.run_pipeline`. params' layers
      are in model order; chunk r of stage s holds layers `r*S*lps + s*lps .. + lps - 1`,
      the layout of the circular schedule.
    tail_fn(tail_params, y_rows, tail_rows) -> scalar: the loss of one microbatch from the
      last layer's output (its rows of `tail_inputs`, a pytree of `[B, ...]`).
    aux_weights: None, the layers' aux is dropped; else a pytree of one layer's aux
      structure with leaves broadcastable to its leaves (MoE: the router losses' weights),
      and the gradients are those of `loss + sum over layers and microbatches of
      sum(aux_weights * aux)`: the layers' aux losses are differentiated in each stage's
      backward, where the layer ran.

    Returns (loss, aux, (d params, d tail_params, d x)): the sum over microbatches of tail_fn,
    the layers' aux stacked `[L, M, ...]` as `run_pipeline` gives it (None without
    aux_weights), and the gradients.
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
    on_mesh = mesh_size == S and S > 1
    if mesh_size is None:
        x_spec = None
    lps = n_layers // (S * R)
    n_stash, n_inbox = slots(table)
    program = {key: jnp.asarray(v) for key, v in _tick_program(table).items()}

    def hold(a, rows_dim: int):
        """The rows at `rows_dim` held to x_spec, the other dims left to the partitioner."""
        if x_spec is None:
            return a
        rows = [*x_spec, *[None] * (a.ndim - rows_dim - len(x_spec))]
        return jax.lax.with_sharding_constraint(a, P(*[P.UNCONSTRAINED] * rows_dim, *rows))

    def on_stage(a, rows_dim: int | None = None):
        """Dim 0 on `stage`, the rows at `rows_dim` held to x_spec, the rest unconstrained."""
        if not on_mesh:
            return a if rows_dim is None else hold(a, rows_dim)
        spec = [axis, *[P.UNCONSTRAINED] * (a.ndim - 1)]
        if x_spec is not None and rows_dim is not None:
            spec[rows_dim:] = [*x_spec, *[None] * (a.ndim - rows_dim - len(x_spec))]
        return jax.lax.with_sharding_constraint(a, P(*spec))

    def to_stages(p):  # [L, ...] -> [S, R, lps, ...]
        return on_stage(p.reshape(R, S, lps, *p.shape[1:]).swapaxes(0, 1))

    def from_stages(g):  # [S, R, lps, ...] -> [L, ...]
        return g.swapaxes(0, 1).reshape(n_layers, *g.shape[3:])

    stage_params = jax.tree.map(to_stages, params)
    xs = hold(split_microbatches(x, M), 1)  # [M, rows, ...]
    ex = jax.tree.map(lambda e: split_microbatches(e, M), extras)
    tail_rows = jax.tree.map(lambda e: split_microbatches(e, M), tail_inputs)

    def per_stage(fn, staged_in, staged_out):
        """fn on one stage's share of its arguments (`staged_in`: which carry a leading stage
        dim, the rest every stage sees whole), its outputs stacked on a stage dim where
        `staged_out`; `axis_index(axis)` is the stage. On the mesh a `shard_map` manual over
        `stage` only: each device runs its own stage (a `lax.switch` there branches per
        device), while XLA keeps partitioning the other axes (fsdp, tensor, data) inside.
        Without one, the stages are vmapped (a switch then runs every branch and selects:
        correct, not fast)."""
        if not on_mesh:
            in_axes = tuple(0 if st else None for st in staged_in)
            return jax.vmap(
                fn, in_axes=in_axes, out_axes=tuple(0 if st else None for st in staged_out), axis_name=axis
            )

        def local(*args):
            args = [jax.tree.map(lambda a: a[0], a) if st else a for a, st in zip(args, staged_in)]
            outs = fn(*args)
            return tuple(jax.tree.map(lambda a: a[None], o) if st else o for o, st in zip(outs, staged_out))

        spec = lambda staged: tuple(P(axis) if st else P() for st in staged)
        return jax.shard_map(
            local, in_specs=spec(staged_in), out_specs=spec(staged_out), axis_names={axis}, check_vma=False
        )

    def put(buf, i, v):  # buf[i] = v unless i < 0
        old = jax.lax.dynamic_index_in_dim(buf, jnp.maximum(i, 0), 0, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(i >= 0, v, old), jnp.maximum(i, 0), 0)

    def get(buf, i):
        return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)

    zeros_x = jnp.zeros(xs.shape[1:], xs.dtype)

    keep_aux = aux_weights is not None

    def stage_fn(p_chunk, h, micro, *, peel_first: bool = False):
        """(the chunk's lps layers on microbatch `micro`'s rows h, their aux stacked
        `[lps, ...]` or None). `peel_first`: the first layer outside the layer scan, so that
        a vjp in the weights alone computes no gradient of the stage input (a scan's carry
        is differentiated at every layer once any is)."""
        ex_rows = jax.tree.map(lambda e: get(e, micro), ex)

        def body(h, lp):
            h, aux = layer_fn(lp, h, ex_rows)
            return h, aux if keep_aux else None

        if not (peel_first or lps == 1):
            return jax.lax.scan(body, h, p_chunk)
        h, aux = body(h, jax.tree.map(lambda a: a[0], p_chunk))
        aux = jax.tree.map(lambda a: a[None], aux)
        if lps == 1:
            return h, aux
        h, rest = jax.lax.scan(body, h, jax.tree.map(lambda a: a[1:], p_chunk))
        return h, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), aux, rest)

    # a chunk's aux [lps, ...] and its cotangent: the weights
    chunk_aux = None
    if keep_aux:
        chunk_aux = jax.eval_shape(
            lambda p, h: stage_fn(p, h, 0)[1], jax.tree.map(lambda a: a[0, 0], stage_params), xs[0]
        )
    aux_ct = jax.tree.map(
        lambda a, w: (
            jnp.broadcast_to(jnp.asarray(w, a.dtype), a.shape)
            if jnp.issubdtype(a.dtype, jnp.inexact)
            else np.zeros(a.shape, jax.dtypes.float0)
        ),
        chunk_aux,
        aux_weights,
    )

    def add(acc, chunk, dp):  # acc[chunk] += dp
        def one(a, g):
            cur = jax.lax.dynamic_index_in_dim(a, chunk, 0, keepdims=False)
            return jax.lax.dynamic_update_index_in_dim(a, cur + g.astype(a.dtype), chunk, 0)

        return jax.tree.map(one, acc, dp)

    # One branch per op code, each running only its own work:
    # (acc, aux_acc, p_chunk, chunk, micro, h, ct) -> (y, dh, acc, aux_acc)
    def idle(acc, aux_acc, p_chunk, chunk, micro, h, ct):
        return zeros_x, zeros_x, acc, aux_acc

    def forward(acc, aux_acc, p_chunk, chunk, micro, h, ct):  # F: no vjp; records the aux
        y, aux = stage_fn(p_chunk, h, micro)

        def record(a, v):  # a [R, lps, M, ...] <- v [lps, ...] at (chunk, :, micro)
            return jax.lax.dynamic_update_slice(
                a, v[None, :, None].astype(a.dtype), (chunk, 0, micro, *[0] * (v.ndim - 1))
            )

        return hold(y, 0), zeros_x, acc, jax.tree.map(record, aux_acc, aux)

    def input_grad(acc, aux_acc, p_chunk, chunk, micro, h, ct):  # B: the weights are constants
        _, pull = jax.vjp(lambda h: stage_fn(p_chunk, h, micro), h)
        return zeros_x, hold(pull((ct, aux_ct))[0], 0), acc, aux_acc

    def weight_grad(acc, aux_acc, p_chunk, chunk, micro, h, ct):  # W: the input is a constant
        _, pull = jax.vjp(lambda p: stage_fn(p, h, micro, peel_first=True), p_chunk)
        return zeros_x, zeros_x, add(acc, chunk, pull((ct, aux_ct))[0]), aux_acc

    def both_grads(acc, aux_acc, p_chunk, chunk, micro, h, ct):  # BW
        _, pull = jax.vjp(lambda p, h: stage_fn(p, h, micro), p_chunk, h)
        dp, dh = pull((ct, aux_ct))
        return zeros_x, hold(dh, 0), add(acc, chunk, dp), aux_acc

    branches = [None] * 5
    for code, fn in ((IDLE, idle), (F, forward), (B, input_grad), (W, weight_grad), (BW, both_grads)):
        branches[code] = fn

    def stage_op(p_stage, acc, aux_acc, stash, xs, inbox, now):
        """One stage's op of the tick -> (stash, acc, aux_acc, y, dh)."""
        s = jax.lax.axis_index(axis)
        op, chunk, micro = (get(now[key], s) for key in ("op", "chunk", "micro"))
        slot, gslot = get(now["slot"], s), get(now["gslot"], s)
        # stage 0 takes a new microbatch into its stash at the start of its forward
        load = now["load"]
        stash = put(stash, jnp.where((s == 0) & (load >= 0), slot, -1), get(xs, jnp.maximum(load, 0)))
        h, ct = hold(get(stash, slot), 0), hold(get(inbox, gslot), 0)
        p_chunk = jax.tree.map(lambda a: get(a, chunk), p_stage)
        y, dh, acc, aux_acc = jax.lax.switch(op, branches, acc, aux_acc, p_chunk, chunk, micro, h, ct)
        return stash, acc, aux_acc, y, dh

    def stage_send(stash, inbox, y, dh, dy, now):
        """The tail's loss gradient into the last stage's inbox; outputs one stage on and
        input gradients one stage back (collective permutes) -> (stash, inbox)."""
        s = jax.lax.axis_index(axis)
        at_tail = (now["tail"] >= 0) & (s == S - 1)
        inbox = put(inbox, jnp.where(at_tail, get(now["gslot"], s), -1), dy)
        # the last stage sends an output it kept, or keeps this tick's for a later send
        send = get(now["send"], s)
        out = jnp.where(send >= 0, get(stash, jnp.maximum(send, 0)), y)
        stash = put(stash, get(now["keep"], s), y)
        y_in = jax.lax.ppermute(out, axis, [(i, (i + 1) % S) for i in range(S)])
        dh_in = jax.lax.ppermute(dh, axis, [(i, (i - 1) % S) for i in range(S)])
        stash = hold(put(stash, get(now["recv_act"], s), y_in), 1)
        inbox = hold(put(inbox, get(now["recv_grad"], s), dh_in), 1)
        return stash, inbox

    run_op = per_stage(stage_op, (True, True, True, True, False, True, False), (True,) * 5)
    run_send = per_stage(stage_send, (True, True, True, True, False, False), (True, True))

    # The tail (the last chunk's forward: its microbatch's loss and loss gradient) runs
    # outside the stage-manual region, on every stage's devices: XLA's partitioner aborts on
    # the loss's gather of vocab-sharded logits inside it (spmd_partitioner_util.cc "Check
    # failed: partition_group_list.num_replica_groups() * ..."; jax 0.12.0.1).
    def tail(tail_acc, loss, ys, m):  # ys [S, rows, ...]: the last stage's output is the input
        y = hold(ys[S - 1], 0)
        rows = jax.tree.map(lambda e: get(e, m), tail_rows)
        loss_m, pull = jax.vjp(lambda tp, y: tail_fn(tp, y, rows), tail_params, y)
        d_tail, dy = pull(jnp.ones_like(loss_m))
        tail_acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), tail_acc, d_tail)
        return tail_acc, loss + loss_m.astype(loss.dtype), hold(dy.astype(xs.dtype), 0)

    def no_tail(tail_acc, loss, ys, m):
        return tail_acc, loss, zeros_x

    def tick(carry, now):
        stash, inbox, dxs, acc, aux_acc, tail_acc, loss = carry
        stash, acc, aux_acc, y, dh = run_op(stage_params, acc, aux_acc, stash, xs, inbox, now)
        valid, m = now["tail"] >= 0, jnp.maximum(now["tail"], 0)
        tail_acc, loss, dy = jax.lax.cond(valid, tail, no_tail, tail_acc, loss, y, m)
        # stage 0's backward of the first chunk: the gradient of the pipeline's input
        dxs = hold(put(dxs, now["dx"], dh[0]), 1)
        stash, inbox = run_send(stash, inbox, y, dh, dy, now)
        return (stash, inbox, dxs, acc, aux_acc, tail_acc, loss), None

    stash0 = on_stage(jnp.zeros((S, n_stash, *xs.shape[1:]), xs.dtype), 2)
    inbox0 = on_stage(jnp.zeros((S, n_inbox, *xs.shape[1:]), xs.dtype), 2)
    acc0 = jax.tree.map(lambda a: on_stage(jnp.zeros_like(a)), stage_params)
    tail0 = jax.tree.map(jnp.zeros_like, tail_params)
    # the layers' aux per stage [S, R, lps, M, ...]; entries of idle slots are never written
    aux0 = jax.tree.map(lambda a: on_stage(jnp.zeros((S, R, lps, M, *a.shape[1:]), a.dtype)), chunk_aux)
    carry = (stash0, inbox0, jnp.zeros_like(xs), acc0, aux0, tail0, jnp.zeros((), jnp.float32))
    (_, _, dxs, acc, aux, d_tail, loss), _ = jax.lax.scan(tick, carry, program)
    # [S, R, lps, M, ...] -> [R, S, lps, M, ...] -> [L, M, ...] (model order)
    aux = jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(n_layers, M, *a.shape[4:]), aux)
    return loss, aux, (jax.tree.map(from_stages, acc), d_tail, merge_microbatches(dxs))


def pipeline_loss(layer_fn, tail_fn, *, table: TickTable, axis: str = "stage", x_spec: P | None = None):
    """f(params, tail_params, x, extras, tail_inputs, aux_weights=None) -> the summed loss
    (aux_weights given: (loss, the layers' aux `[L, M, ...]`)), differentiable in params,
    tail_params and x: a `jax.custom_vjp` whose forward runs `pipeline_loss_and_grads`
    (every gradient at once, by the schedule) and whose backward scales those gradients by
    the loss's cotangent. extras and tail_inputs (positions, targets: integers) and
    aux_weights get no gradient, and the aux's cotangent is not used: the loss's gradient
    already holds `aux_weights * aux` (`pipeline_loss_and_grads`), so a caller adds that
    term to its objective as a constant."""

    def run(params, tail_params, x, extras, tail_inputs, aux_weights):
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
            aux_weights=aux_weights,
        )

    @jax.custom_vjp
    def f(params, tail_params, x, extras, tail_inputs, aux_weights):
        return run(params, tail_params, x, extras, tail_inputs, aux_weights)[:2]

    def fwd(params, tail_params, x, extras, tail_inputs, aux_weights):
        loss, aux, grads = run(params, tail_params, x, extras, tail_inputs, aux_weights)
        return (loss, aux), (grads, extras, tail_inputs, aux_weights)

    def bwd(res, cotangents):
        grads, extras, tail_inputs, aux_weights = res
        g = cotangents[0]  # the aux's is not used (see above)
        scaled = jax.tree.map(lambda a: (a * g).astype(a.dtype), grads)
        no_grad = lambda tree: jax.tree.map(_zero_cotangent, tree)
        return (*scaled, no_grad(extras), no_grad(tail_inputs), no_grad(aux_weights))

    f.defvjp(fwd, bwd)

    def loss(params, tail_params, x, extras, tail_inputs, aux_weights=None):
        aux_weights = jax.tree.map(jnp.asarray, aux_weights)  # Python numbers: arrays
        out = f(params, tail_params, x, extras, tail_inputs, aux_weights)
        return out[0] if aux_weights is None else out

    return loss


def _zero_cotangent(a):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros_like(a)
    return np.zeros(a.shape, jax.dtypes.float0)

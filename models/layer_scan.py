"""The layer loop: `jax.lax.scan` over the stacked layers, with the weight gradients kept in
the compute dtype until the backward loop ends.

Why: autodiff of a scan writes each layer's gradient into one stacked buffer of the scanned
input's dtype, allocated whole when the backward loop starts, while every layer's saved
activations are still held. With float32 master weights used in bfloat16 that buffer is
float32, although each value in it is a bfloat16 value widened (the gradient of a cast is the
cast back): on configs/gpu-peer.yaml 2.8 GiB at the step's peak where 1.4 would do. This scan
runs the same forward and backward (one `jax.vjp` of the layer per step, its residuals stacked
as autodiff's scan stacks them) but writes those gradients in bfloat16 and widens them after
the loop, when the activations are gone. The gradients are the same values: only inputs whose
gradient the layer's backward pass computes as a widening cast of a narrower float get this
(`narrow_grads` reads it from that pass's jaxpr), and those are exactly representable in it.
torch autocast produces the same values (a bfloat16 weight gradient, widened into a float32
`.grad`). A weight also used in float32 (norm scales, the MoE router), or whose custom rule
returns a wider gradient, keeps a float32 one. One caveat: XLA may skip a bfloat16 rounding
that is widened again at once (`xla_allow_excess_precision`, on by default; seen for MoE's
expert matmuls on CPU), which this loop keeps, so there the gradients are the rounding of
autodiff's scan's, as the jaxpr specifies them.

Both loops also start their stacked outputs (the saved activations, the layers' gradients)
uninitialised where the program runs on one device (`_scan_into_empty`): `jax.lax.scan` fills
them with zeros first, 12.5 GiB of writes a step on configs/gpu-peer.yaml's H100 program,
although every layer overwrites its slice before anything reads it.

Unrolled (`model.scan_layers: false`), the loops are Python loops (`_unrolled_forward`,
`_unrolled_backward`): each layer's activations stay the arrays it made, with no stacked
buffer to copy them into (12 GiB of copies a step on that H100 program), and each layer's
weights are sliced from the stack only once the previous layer is done, so XLA cannot hoist
every layer's slices to the start of the backward pass (there, 2.8 GiB of float32 slices held
at the peak).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

# Ops that move or relabel a value without changing it: the transpose of each is a bijection,
# so a cast reached through them still gets an exactly representable gradient.
_LAYOUT_OPS = frozenset(
    {"reshape", "transpose", "squeeze", "expand_dims", "sharding_constraint", "copy", "copy_p", "mesh_cast"}
)
# Calls whose transpose is autodiff's own (custom rules may compute their gradient in any dtype).
_CALLS = frozenset({"pjit", "jit", "remat2", "checkpoint", "remat", "closed_call", "core_call"})


def _inner_jaxpr(eqn):
    for key in ("jaxpr", "call_jaxpr"):
        inner = eqn.params.get(key)
        if inner is not None:
            return getattr(inner, "jaxpr", inner)
    return None


def _widened_from(jaxpr, var):
    """The narrower float dtype that `var` is a widening cast of (reached back through layout
    ops and plain calls), or None."""
    producers = {id(o): (eqn, k) for eqn in jaxpr.eqns for k, o in enumerate(eqn.outvars)}
    if id(var) not in producers:  # an input or a literal
        return None
    eqn, k = producers[id(var)]
    name = eqn.primitive.name
    if name == "convert_element_type":
        old, new = np.dtype(eqn.invars[0].aval.dtype), np.dtype(var.aval.dtype)
        floats = jnp.issubdtype(old, jnp.floating) and jnp.issubdtype(new, jnp.floating)
        return old if floats and old.itemsize < new.itemsize else None
    if name in _LAYOUT_OPS:
        return _widened_from(jaxpr, eqn.invars[0])
    inner = _inner_jaxpr(eqn) if name in _CALLS else None
    if inner is not None and len(inner.outvars) == len(eqn.outvars):
        return _widened_from(inner, inner.outvars[k])
    return None


def narrow_grads(f: Callable, carry, diff: list) -> list:
    """For each array of `diff`, the narrower float dtype that its gradient under `f(carry,
    diff)` is a widening cast of (so exactly representable in it), or None. Read from the
    jaxpr of the backward pass itself, so custom rules that return wider gradients count."""

    def grads(carry, diff):  # any cotangent: only the backward pass's structure is read
        out, vjp_fn = jax.vjp(f, carry, diff)
        ct = jax.tree.map(lambda o: jnp.ones(o.shape, o.dtype) if _is_float(o.dtype) else _zeros(o), out)
        return vjp_fn(ct)[1]

    closed = jax.make_jaxpr(grads)(carry, diff)
    return [_widened_from(closed.jaxpr, v) for v in closed.jaxpr.outvars]


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def scan(body: Callable, carry, xs, consts=(), *, unroll: int = 1, compact_grads: bool = True):
    """`jax.lax.scan(lambda c, x: body(c, x, consts), carry, xs, unroll=unroll)`, whose
    gradient keeps each scanned input's gradient in the narrower dtype it is computed in
    (`narrow_grads`) until the loop ends. `consts`: integer inputs that every step reads
    (positions, segment ids). A float const, or `compact_grads=False`, runs the plain scan."""
    if not compact_grads or any(_is_float(jnp.result_type(c)) for c in jax.tree.leaves(consts)):
        return jax.lax.scan(lambda c, x: body(c, x, consts), carry, xs, unroll=unroll)
    return _compact_scan(body, unroll)(carry, xs, consts)


def _values(primals):
    """The values and `perturbed` flags of custom_vjp's CustomVJPPrimal leaves."""
    wrapped = lambda x: isinstance(x, CustomVJPPrimal)
    leaves, tree = jax.tree.flatten(primals, is_leaf=wrapped)
    return (
        jax.tree.unflatten(tree, [p.value if wrapped(p) else p for p in leaves]),
        [wrapped(p) and bool(p.perturbed) for p in leaves],
    )


def _zeros(aval):
    """A zero cotangent for a value of `aval` (float0 for integer and key values)."""
    if _is_float(aval.dtype):
        return jnp.zeros(aval.shape, aval.dtype)
    return np.zeros(aval.shape, jax.dtypes.float0)


def _unpartitioned() -> bool:
    """Whether the program being traced runs on one device of a known mesh (`jax.set_mesh`,
    as jaxtrain traces its programs). Only then may a stacked buffer start as `lax.empty` (an
    AllocateBuffer on GPU and TPU, zeros on CPU): XLA's SPMD partitioner does not partition
    that allocation but builds it whole on every device and slices it (a deviceless compile of
    configs/gpu-peer.yaml on 8 H100s: 1.9 GiB of temporaries become 9.8). Without a mesh the
    inputs may still be sharded, so zeros stay there too."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size == 1


def _scan_into_empty(step: Callable, carry, xs, *, reverse: bool = False):
    """`jax.lax.scan(step, carry, xs, reverse=reverse)`, its stacked outputs started as
    `lax.empty` buffers instead of zeros: every step writes its own slice before any is read.
    The same steps in the same order, so the same values."""
    n = jax.tree.leaves(xs)[0].shape[0]
    y_avals = jax.eval_shape(lambda c, x: step(c, x)[1], carry, jax.tree.map(lambda v: v[0], xs))
    ys = jax.tree.map(lambda a: jax.lax.empty((n, *a.shape), a.dtype), y_avals)

    def body(state, x):  # xs sliced by scan itself, as the plain loop slices them
        c, ys, k = state
        c, y = step(c, x)
        update = lambda b, v: jax.lax.dynamic_update_index_in_dim(b, v, k, 0, allow_negative_indices=False)
        return (c, jax.tree.map(update, ys, y), k - 1 if reverse else k + 1), None

    start = jnp.int32(n - 1 if reverse else 0)
    (carry, ys, _), _ = jax.lax.scan(body, (carry, ys, start), xs, reverse=reverse)
    return carry, ys


def _loop(step: Callable, carry, xs, *, unroll: int, reverse: bool = False):
    """The scanned layer loop over `xs`' leading axis: `_scan_into_empty` on one device
    (unless partly unrolled), `jax.lax.scan` otherwise."""
    if unroll == 1 and _unpartitioned():
        return _scan_into_empty(step, carry, xs, reverse=reverse)
    return jax.lax.scan(step, carry, xs, reverse=reverse, unroll=unroll)


def _layer(leaves: list, i: int, after):
    """Layer `i`'s slices of the stacked `leaves`, cut only once `after` exists (an
    optimization barrier ties them): XLA schedules a slice as early as its operand allows,
    and every layer's weights exist from the step's start. Returns (slices, after)."""
    tied, after = jax.lax.optimization_barrier((leaves, after))
    return [leaf[i] for leaf in tied], after


def _unrolled_forward(step: Callable, carry, x_leaves: list):
    """The forward loop unrolled: (carry, (stacked outputs, each layer's own residuals))."""
    ys, residuals = [], []
    for i in range(x_leaves[0].shape[0]):
        x_step, carry = _layer(x_leaves, i, carry)
        carry, (y, res) = step(carry, x_step)
        ys.append(y)
        residuals.append(res)
    return carry, (jax.tree.map(lambda *y: jnp.stack(y), *ys), residuals)


def _unrolled_backward(step: Callable, ct_carry, x_leaves: list, residuals: list, ct_ys: list):
    """The backward loop unrolled, last layer first: (carry cotangent, stacked gradients)."""
    grads = [None] * len(residuals)
    for i in reversed(range(len(residuals))):
        x_step, ct_carry = _layer(x_leaves, i, ct_carry)
        ct_carry, grads[i] = step(ct_carry, (x_step, residuals[i], [c[i] for c in ct_ys]))
    return ct_carry, [jnp.stack(g) for g in zip(*grads, strict=True)]


def _compact_scan(body: Callable, unroll: int):
    """The scan as a custom_vjp for one call: the forward trace records in `plan` what the
    backward needs (the residuals' tree, which residuals are the step's own inputs rather than
    stacked values, the gradients' dtypes)."""
    plan = {}

    @jax.custom_vjp
    def run(carry, xs, consts):
        return jax.lax.scan(lambda c, x: body(c, x, consts), carry, xs, unroll=unroll)

    def fwd(carry, xs, consts):
        (carry, _), (xs, xs_perturbed), (consts, _) = _values(carry), _values(xs), _values(consts)
        x_leaves, x_tree = jax.tree.flatten(xs)
        diff = [p and _is_float(v.dtype) for v, p in zip(x_leaves, xs_perturbed, strict=True)]
        const_ids = {id(v): ("const", k) for k, v in enumerate(jax.tree.leaves(consts))}

        def step(c, x_step):
            def f(c, d):  # the body as a function of the carry and the differentiated inputs
                it = iter(d)
                return body(
                    c,
                    jax.tree.unflatten(x_tree, [next(it) if k else v for v, k in zip(x_step, diff)]),
                    consts,
                )

            d = [v for v, k in zip(x_step, diff) if k]
            plan["grad_dtypes"] = narrow_grads(f, c, d)
            out, vjp_fn = jax.vjp(f, c, d)
            plan["out"] = jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype), out)
            res, plan["res_tree"] = jax.tree.flatten(vjp_fn)
            # residuals that are this step's inputs or a const are read again, not stacked
            known = {**const_ids, **{id(v): ("x", k) for k, v in enumerate(x_step)}}
            plan["refs"] = [known.get(id(r)) for r in res]
            return out[0], (out[1], [r for r, ref in zip(res, plan["refs"]) if ref is None])

        if unroll >= x_leaves[0].shape[0]:
            carry, (ys, stacked) = _unrolled_forward(step, carry, x_leaves)
        else:
            carry, (ys, stacked) = _loop(step, carry, x_leaves, unroll=unroll)
        plan["x_tree"], plan["diff"] = x_tree, diff
        return (carry, ys), (x_leaves, consts, stacked)

    def bwd(saved, ct):
        x_leaves, consts, stacked = saved
        carry_aval, y_aval = plan["out"]
        is_zero = lambda c: isinstance(c, SymbolicZero)
        ct_carry = jax.tree.map(
            lambda c, a: _zeros(a) if is_zero(c) else c, ct[0], carry_aval, is_leaf=is_zero
        )
        y_avals, y_tree = jax.tree.flatten(y_aval)
        steps = x_leaves[0].shape[0]
        ct_ys = [  # the float outputs' cotangents, scanned; the rest are float0 zeros per step
            jnp.zeros((steps, *a.shape), a.dtype) if is_zero(c) else c
            for c, a in zip(jax.tree.leaves(ct[1], is_leaf=is_zero), y_avals, strict=True)
            if _is_float(a.dtype)
        ]
        const_leaves = jax.tree.leaves(consts)

        def step(ct_c, inp):
            x_step, res_step, ct_y_step = inp
            res, ct_y = iter(res_step), iter(ct_y_step)
            res = [
                next(res) if ref is None else (x_step if ref[0] == "x" else const_leaves)[ref[1]]
                for ref in plan["refs"]
            ]
            ct_y = [next(ct_y) if _is_float(a.dtype) else _zeros(a) for a in y_avals]
            ct_prev, ct_d = jax.tree.unflatten(plan["res_tree"], res)(
                (ct_c, jax.tree.unflatten(y_tree, ct_y))
            )
            return ct_prev, [g if dt is None else g.astype(dt) for g, dt in zip(ct_d, plan["grad_dtypes"])]

        if unroll >= steps:
            ct_carry, ct_d = _unrolled_backward(step, ct_carry, x_leaves, stacked, ct_ys)
        else:
            ct_carry, ct_d = _loop(step, ct_carry, (x_leaves, stacked, ct_ys), unroll=unroll, reverse=True)
        ct_d = iter(ct_d)
        ct_x = [next(ct_d).astype(v.dtype) if k else None for v, k in zip(x_leaves, plan["diff"])]
        return ct_carry, jax.tree.unflatten(plan["x_tree"], ct_x), None

    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run

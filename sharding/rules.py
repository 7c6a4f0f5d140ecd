"""Logical axis names -> mesh axes, as data.

Models name every parameter and activation dimension with a *logical* axis
("embed", "mlp", "batch", ...). An ordered rule table maps each logical name to
mesh axes; changing a parallelism plan is editing that table, not model code.

Resolution for one array (`logical_to_spec`): for each dimension, the rules
whose logical name matches are tried in order; from a rule's mesh axes we drop
those of size 1 (or missing from the mesh), those already used by an earlier
dimension of the same array, and -- when the shape is known -- those whose size
does not divide the dimension. The first rule with any axes left wins. So one
table serves every mesh: with `tensor=1` all tensor rules simply drop out.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
AxisRules = tuple[tuple[str, MeshAxes], ...]
LogicalAxes = tuple[str | None, ...]

# Activation names carry an `act_` prefix where the parameter dimension of the
# same meaning is sharded differently: parameters are stored FSDP-sharded on
# `embed` (ZeRO-3), while activations keep `act_embed` whole and are sharded on
# `batch` instead.
_ACTIVATIONS: AxisRules = (
    ("batch", ("data", "fsdp", "expert")),
    ("seq", ("context",)),
    ("residual_seq", ("context",)),  # the residual stream's seq (models.layers.RESIDUAL_AXES)
    ("act_embed", None),
    ("act_heads", ("tensor",)),
    ("act_kv_heads", ("tensor",)),
    ("act_mlp", ("tensor",)),
    ("act_vocab", ("tensor",)),
    # The rows (tokens) of the output head's matmul: the batch's layout, unless the head is
    # vocab-parallel (`vocab_parallel_head`), which gathers them over fsdp instead.
    ("head_batch", ("data", "fsdp", "expert")),
)

# Parameter dimensions that no table shards, listed so that the tables say so: the stacked
# multi-token prediction modules' depth (models/mtp.py: a few modules, outside any pipeline)
# and their eh_proj's concatenated input (its output dim is `embed`, sharded as any weight's).
_REPLICATED: AxisRules = (("mtp_depth", None), ("mtp_concat", None))

#: Pure data parallelism: parameters and optimizer state replicated, batch
#: split over every data-like axis (data, fsdp).
DATA_PARALLEL: AxisRules = _ACTIVATIONS + _REPLICATED

#: FSDP / ZeRO-3: parameters and optimizer state sharded over `fsdp` on their
#: embed dimension (all-gathered in the forward pass, gradients
#: reduce-scattered), batch over data x fsdp.
#: The latents of latent attention (`q_lora`, `kv_lora`) shard over fsdp where `embed` does not
#: already take it (their up-projections), never over tensor: every head reads the whole latent.
FSDP: AxisRules = DATA_PARALLEL + (
    ("embed", ("fsdp",)),
    ("head_embed", ("fsdp",)),
    ("q_lora", ("fsdp",)),
    ("kv_lora", ("fsdp",)),
)

#: FSDP + Megatron tensor parallelism: heads / mlp / vocab dims over `tensor`.
FSDP_TENSOR: AxisRules = FSDP + (
    ("vocab", ("tensor",)),
    ("head_vocab", ("tensor",)),  # an untied output head's vocab (see vocab_parallel_head)
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("sink_heads", ("tensor",)),  # attention sinks [heads]: split with their heads
    ("mlp", ("tensor",)),
    ("layers", ("stage",)),
    ("expert", ("expert",)),
)

#: FSDP + tensor + Megatron sequence parallelism (Korthikanti et al. 2022): the residual
#: stream and the norms on it -- the activations between tensor-parallel regions -- are
#: split on seq over `tensor` (inside `context`). Each TP region then starts with an
#: all-gather over tensor and ends with a reduce-scatter where plain TP all-reduces: the
#: same bytes moved, 1/tensor of the norm activations stored and computed.
FSDP_TENSOR_SP: AxisRules = (("residual_seq", ("context", "tensor")),) + FSDP_TENSOR

DEFAULT_RULES: AxisRules = FSDP_TENSOR
PRESETS: dict[str, AxisRules] = {
    "data_parallel": DATA_PARALLEL,
    "fsdp": FSDP,
    "fsdp_tensor": FSDP_TENSOR,
    "fsdp_tensor_sp": FSDP_TENSOR_SP,
}


#: Logical names of the output head whose layout `vocab_parallel_head` changes: fsdp moves
#: from the first two (the head's rows and an untied head's d_model) to the last two.
_HEAD_ROWS = ("head_batch", "head_embed")
_HEAD_VOCAB = ("head_vocab", "act_vocab")


def vocab_parallel_head(rules: AxisRules) -> AxisRules:
    """`rules` with the output head vocab-parallel over `fsdp` (Megatron's vocab-parallel
    cross-entropy, on the FSDP axis).

    Under FSDP the head [d_model, vocab] is sharded on d_model like every weight, so each step
    all-gathers it whole and reduce-scatters its gradient: 2 x d_model x vocab values per
    microbatch, whatever the batch. Here an untied head (`head_embed`, `head_vocab`) is stored
    sharded on vocab over fsdp instead (after any tensor sharding), and what moves is the final
    activations: all-gathered over fsdp into the head's rows, and their gradient summed back,
    about 2 x tokens x d_model values per fsdp group. That is cheaper when a microbatch has
    far fewer tokens per fsdp group than the vocabulary has entries (small batches, long
    vocabularies; jaxtrain's planning/resolve.py decides for a run). The log-sum-exp of the
    cross-entropy is then reduced over fsdp (a few floats per token). The embedding table
    (`vocab`, `embed`) keeps its layout: a tied head is its transpose, resharded to the
    vocab-parallel layout where it is used.
    """
    _validate_rules(rules)
    names = {name for name, _ in rules}
    out: list[tuple[str, MeshAxes]] = []
    for name, axes in rules:
        if name in _HEAD_ROWS:
            axes = tuple(a for a in axes_tuple(axes) if a != "fsdp")
            if not axes:
                continue  # no rule: replicated, not the next rule's axes
        elif name in _HEAD_VOCAB and "fsdp" not in axes_tuple(axes):
            axes = (*axes_tuple(axes), "fsdp")
        out.append((name, axes))
    return tuple(out) + tuple((name, ("fsdp",)) for name in _HEAD_VOCAB if name not in names)


def is_vocab_parallel(rules: AxisRules) -> bool:
    """Whether `rules` shard the vocabulary over fsdp (`vocab_parallel_head`)."""
    return any(name == "head_vocab" and "fsdp" in axes_tuple(axes) for name, axes in rules)


def axes_tuple(axes: MeshAxes) -> tuple[str, ...]:
    """Mesh axes of a rule or PartitionSpec entry (None, a name, or names) as a tuple."""
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _validate_rules(rules: AxisRules) -> None:
    for i, rule in enumerate(rules):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(f"rules[{i}]={rule!r}: expected a (logical_name, mesh_axes) pair")


def logical_to_spec(
    logical_axes: Sequence[str | None],
    rules: AxisRules,
    mesh: Mesh | jax.sharding.AbstractMesh,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """The PartitionSpec for one array whose dims carry `logical_axes` names.

    `None` in `logical_axes` means "never sharded". See the module docstring for
    the resolution order.
    """
    _validate_rules(rules)
    if shape is not None and len(shape) != len(logical_axes):
        raise ValueError(
            f"logical_axes {tuple(logical_axes)} has {len(logical_axes)} names but the array "
            f"has shape {tuple(shape)}"
        )
    sizes = dict(mesh.shape)
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for dim, name in enumerate(logical_axes):
        chosen: tuple[str, ...] = ()
        if name is not None:
            for rule_name, rule_axes in rules:
                if rule_name != name:
                    continue
                axes = [a for a in axes_tuple(rule_axes) if sizes.get(a, 1) > 1 and a not in used]
                if shape is not None:
                    kept, prod = [], 1
                    for a in axes:
                        if shape[dim] % (prod * sizes[a]) == 0:
                            kept.append(a)
                            prod *= sizes[a]
                    axes = kept
                if axes:
                    chosen = tuple(axes)
                    break
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def named_sharding(
    logical_axes: Sequence[str | None], rules: AxisRules, mesh: Mesh, shape: Sequence[int] | None = None
) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, rules, mesh, shape))


def _is_axes_leaf(x: Any) -> bool:
    return x is None or (isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x))


def tree_specs(logical_tree: Any, rules: AxisRules, mesh: Mesh, shapes: Any = None) -> Any:
    """Map a pytree whose leaves are logical-axes tuples to PartitionSpecs.

    `shapes`, if given, is a matching pytree of arrays / ShapeDtypeStructs; it
    lets non-dividing mesh axes drop out per array. Where `shapes` holds None (no array there:
    `eqx.partition` leaves None for an Equinox module's other fields) the spec is None too.
    """
    if shapes is None:
        return jax.tree.map(
            lambda ax: logical_to_spec(ax or (), rules, mesh), logical_tree, is_leaf=_is_axes_leaf
        )
    return jax.tree.map(
        lambda ax, x: None if x is None else logical_to_spec(ax or (), rules, mesh, np.shape(x)),
        logical_tree,
        shapes,
        is_leaf=_is_axes_leaf,
    )


def tree_shardings(logical_tree: Any, rules: AxisRules, mesh: Mesh, shapes: Any = None) -> Any:
    """Like `tree_specs`, but returns NamedShardings on `mesh`."""
    specs = tree_specs(logical_tree, rules, mesh, shapes)
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def shard_further(
    spec: PartitionSpec, shape: Sequence[int], mesh: Mesh | jax.sharding.AbstractMesh, axis: str = "data"
) -> PartitionSpec:
    """`spec` with mesh `axis` added to the largest dimension it still divides.

    ZeRO-1 (`optimizer.shard_state`): the optimizer state is laid out like its
    parameter and then also split over the data-parallel axis, so each data
    replica keeps 1/data of the moments while parameters stay replicated. The
    axis goes innermost on the chosen dimension (after the axes already there);
    `spec` comes back unchanged when `axis` has size 1, is already used, or
    divides no dimension's local size (such small leaves stay replicated).
    """
    sizes = dict(mesh.shape)
    if sizes.get(axis, 1) == 1:
        return spec
    entries = [axes_tuple(e) for e in spec] + [()] * (len(shape) - len(spec))
    if any(axis in e for e in entries):
        return spec
    local = [d // math.prod(sizes[a] for a in e) for d, e in zip(shape, entries)]
    fits = [i for i, n in enumerate(local) if n % sizes[axis] == 0]
    if not fits:
        return spec
    i = max(fits, key=lambda j: (local[j], -j))
    entries[i] = (*entries[i], axis)
    out = [None if not e else e[0] if len(e) == 1 else e for e in entries]
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


# --- activation constraints -------------------------------------------------

_RULES: contextvars.ContextVar[AxisRules | None] = contextvars.ContextVar("axis_rules", default=None)


@contextlib.contextmanager
def axis_rules(rules: AxisRules | None) -> Iterator[AxisRules | None]:
    """Make `rules` the table `constrain` uses (together with `jax.set_mesh`); None: no table
    (constrain is a no-op), e.g. to trace a function as single-device code."""
    if rules is not None:
        _validate_rules(rules)
        rules = tuple(rules)
    token = _RULES.set(rules)
    try:
        yield rules
    finally:
        _RULES.reset(token)


def with_rules(fn, rules: AxisRules | None):
    """`fn`, always run (traced) under `rules`, whatever table is active where it is called.

    `constrain` reads the active table when a function is traced, and `jax.jit` does not key
    its cache on it: a jitted function traced under one table would be reused under another.
    Jit `with_rules(fn, rules)` instead (the table is then fixed with the function), or pass
    the table as a static argument and enter `axis_rules` inside (models/generation.py)."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with axis_rules(rules):
            return fn(*args, **kwargs)

    return traced


def current_rules() -> AxisRules | None:
    return _RULES.get()


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Hint XLA that activation `x` is laid out by `logical_axes`.

    A no-op unless a mesh is set (`jax.set_mesh`) and rules are active
    (`axis_rules`), so models stay runnable as plain single-device code.
    """
    rules = _RULES.get()
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return x
    if x.ndim != len(logical_axes):
        raise ValueError(f"constrain: array of shape {x.shape} given logical_axes {tuple(logical_axes)}")
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, rules, mesh, x.shape))


# --- paths: naming parameters, and naming their axes by path ---------------------------------


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


#: `logical_axes_by_path`'s `default` when none is given: a leaf no pattern matches is an error.
MISSING: Any = _Missing()


def _key_name(key: Any) -> str:
    return str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))


def _path_str(path: tuple) -> str:
    return ".".join(_key_name(k) for k in path)


def _named_leaves(tree: Any, is_leaf: Any = None) -> list[tuple[str, Any]]:
    """`tree`'s leaves (`jax.tree.leaves` order) with their paths written `a.b.0.c`: dict keys,
    sequence indices and attributes (dataclass fields, Equinox and NNX modules) joined by dots.

    A Flax NNX variable (`nnx.Param`) is a pytree node whose one child is its `value`; that last
    step is left out, so `nnx.state(model)` names its leaves as `nnx.to_pure_dict` of it does. The
    variable type is looked up only if flax is already imported: a tree can hold one only then,
    and this module must not import flax.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    nnx = sys.modules.get("flax.nnx")
    variable = getattr(nnx, "Variable", None)
    holders: set[tuple] = set()
    if variable is not None:
        stop = lambda x: isinstance(x, variable) or (is_leaf is not None and is_leaf(x))
        for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=stop)[0]:
            if isinstance(x, variable):
                holders.add(tuple(path))
    named = []
    for path, x in flat:
        if path and _key_name(path[-1]) == "value" and tuple(path[:-1]) in holders:
            path = path[:-1]
        named.append((_path_str(path), x))
    return named


def _is_array(x: Any) -> bool:
    """An array leaf (jax or numpy array, ShapeDtypeStruct), as opposed to the other leaves a
    model's tree may hold (an Equinox module's activation function, a Python number)."""
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _axes_or_none(axes: Any, where: str) -> LogicalAxes | None:
    if axes is None:
        return None
    if isinstance(axes, (tuple, list)) and all(a is None or isinstance(a, str) for a in axes):
        return tuple(axes)
    raise ValueError(f"{where}={axes!r}: expected None (replicated) or a tuple of logical names")


def _compile_patterns(patterns: Any) -> list[tuple[re.Pattern, LogicalAxes | None]]:
    if isinstance(patterns, (str, bytes, dict)) or not isinstance(patterns, Sequence):
        raise ValueError(f"patterns={patterns!r}: expected an ordered list of (regex, axes) pairs")
    compiled = []
    for i, pair in enumerate(patterns):
        is_pair = isinstance(pair, (tuple, list)) and len(pair) == 2
        if not (is_pair and isinstance(pair[0], (str, re.Pattern))):
            raise ValueError(f"patterns[{i}]={pair!r}: expected a (regex, axes) pair")
        try:
            regex = re.compile(pair[0])
        except re.error as e:
            raise ValueError(f"patterns[{i}]: {pair[0]!r} is not a regular expression ({e})") from None
        compiled.append((regex, _axes_or_none(pair[1], f"patterns[{i}] axes")))
    return compiled


def logical_axes_by_path(tree: Any, patterns: Sequence[tuple[str, Any]], *, default: Any = MISSING) -> Any:
    """Logical axis names for a model that does not name its own, from its parameters' paths.

    `tree` holds the parameters (or their `ShapeDtypeStruct`s): a plain dict, Flax linen's
    `variables`, Flax NNX's `nnx.state(model)`, an Equinox module. `patterns` is an ordered list
    of `(regex, axes)`; each array leaf's path, written as `parameter_table` writes it
    (`params.Dense_0.kernel`, `layers.0.weight`), is matched with `re.search` and the first
    pattern that matches gives its axes: a tuple with one logical name (or None) per dimension,
    or None for replicated at any rank. These are EasyLM's regex partition rules, producing
    logical names for the rule table rather than mesh axes.

    Returns a tree of `tree`'s structure with an axes tuple at each array leaf (None axes become
    `(None,) * rank`), ready for `tree_shardings(..., shapes=tree)` and `parameter_table`.
    Leaves that are not arrays (an Equinox module's activation function) become None, as
    `eqx.partition(model, eqx.is_array)` leaves them. A leaf no pattern matches is an error
    naming its path unless `default` is given (`default=None`: replicated); axes whose length is
    not the leaf's rank are an error naming the path, the axes and the shape.
    """
    compiled = _compile_patterns(patterns)
    if default is not MISSING:
        default = _axes_or_none(default, "default")
    leaves, unmatched = [], []
    for name, x in _named_leaves(tree):
        if not _is_array(x):
            leaves.append(None)
            continue
        shape = tuple(x.shape)
        match = next((i for i, (regex, _) in enumerate(compiled) if regex.search(name)), None)
        if match is not None:
            axes, source = compiled[match][1], f"patterns[{match}] ({compiled[match][0].pattern!r})"
        elif default is not MISSING:
            axes, source = default, "default"
        else:
            unmatched.append(f"{name!r} {shape}")
            leaves.append(None)
            continue
        if axes is None:
            axes = (None,) * len(shape)
        elif len(axes) != len(shape):
            raise ValueError(
                f"{source} gives {name!r} the axes {axes}: {len(axes)} names for an array of shape {shape}"
            )
        leaves.append(axes)
    if unmatched:
        shown = ", ".join(unmatched[:8]) + (f" and {len(unmatched) - 8} more" if len(unmatched) > 8 else "")
        raise ValueError(
            f"no pattern matches {shown}: add a pattern for it, or pass default=None to "
            "replicate the leaves no pattern names"
        )
    return jax.tree.structure(tree).unflatten(leaves)


# --- a table for humans -------------------------------------------------------


def parameter_table(params: Any, logical_tree: Any, rules: AxisRules, mesh: Mesh) -> list[dict]:
    """One row per parameter: name, shape, dtype, logical axes, spec, bytes per device.

    Parameters and axes are paired by path, so the two trees must have the same structure (the
    leaves' paths, as the rows name them, agree one by one; an NNX state and its pure dict
    agree): otherwise a ValueError names the first path that differs, where pairing by leaf
    order would silently mislabel rows. Where `params` holds None (what `eqx.partition` leaves
    where a module holds no array) there is no parameter: no row, and `logical_tree` may hold
    None there or nothing.
    """
    sizes = dict(mesh.shape)
    flat_params = _named_leaves(params, is_leaf=lambda x: x is None)
    no_array = {name for name, x in flat_params if x is None}
    flat_params = [(name, x) for name, x in flat_params if x is not None]
    flat_axes = [
        (name, axes)
        for name, axes in _named_leaves(logical_tree, is_leaf=_is_axes_leaf)
        if not (axes is None and name in no_array)
    ]
    for i in range(max(len(flat_params), len(flat_axes))):
        in_params = flat_params[i][0] if i < len(flat_params) else None
        in_axes = flat_axes[i][0] if i < len(flat_axes) else None
        if in_params != in_axes:
            raise ValueError(
                f"params and logical_tree differ in structure at leaf {i}: params has "
                f"{in_params if in_params is None else repr(in_params)}, logical_tree has "
                f"{in_axes if in_axes is None else repr(in_axes)} (logical_tree needs params' "
                "structure; logical_axes_by_path builds one from paths)"
            )
    rows = []
    for (name, x), (_, axes) in zip(flat_params, flat_axes):
        shape = tuple(np.shape(x))
        spec = logical_to_spec(axes or (), rules, mesh, shape)
        local = list(shape)
        for dim, entry in enumerate(spec):
            n = math.prod(sizes[a] for a in axes_tuple(entry))
            local[dim] = -(-shape[dim] // n)
        itemsize = np.dtype(x.dtype).itemsize
        rows.append(
            dict(
                name=name,
                shape=shape,
                dtype=str(np.dtype(x.dtype)),
                logical_axes=tuple(axes or ()),
                spec=spec,
                bytes_per_device=math.prod(local) * itemsize,
                bytes_total=math.prod(shape) * itemsize,
            )
        )
    return rows


def format_parameter_table(rows: list[dict]) -> str:
    """Render `parameter_table` rows as aligned text, with a total line."""
    head = ("name", "shape", "logical axes", "spec", "MiB/device")
    body = [
        (
            r["name"],
            "x".join(map(str, r["shape"])) or "scalar",
            ",".join(a or "-" for a in r["logical_axes"]),
            str(tuple(r["spec"])),
            f"{r['bytes_per_device'] / 2**20:.3f}",
        )
        for r in rows
    ]
    total = sum(r["bytes_per_device"] for r in rows)
    body.append(("total", "", "", "", f"{total / 2**20:.3f}"))
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
    return "\n".join([fmt(head), fmt(tuple("-" * w for w in widths)), *map(fmt, body)])

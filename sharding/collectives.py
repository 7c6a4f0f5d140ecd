"""Which collectives a compiled program runs, and over which mesh axes.

A parallelism plan is a promise about communication: FSDP all-gathers weights
and reduce-scatters gradients over `fsdp`, tensor parallelism all-reduces over
`tensor`, expert parallelism moves tokens with all-to-all over `expert`, ring
attention and pipelines pass blocks with collective-permute over `context` /
`stage`. A rule that silently all-gathers a full weight over the wrong axis
still trains (just slower, with more memory), so tests read the optimized HLO
and check the promise.

In an SPMD program the collectives name *logical* device ids: positions in the
executable's device assignment, which for a jit over `NamedSharding`s on one
mesh is `mesh.devices.flat`. A replica group (or a source->target pair) then
spans exactly the mesh axes along which its members' coordinates differ.

Imports only numpy (and reads a `jax.sharding.Mesh`'s shape and names).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

COLLECTIVES: tuple[str, ...] = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
)

# `%name = <result shape> <kind>(` or `<kind>-start(` (the async form carries the attributes;
# its `-done` partner does not and is skipped).
_OP = re.compile(r"%?([\w.\-]+)\s*=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_KIND = re.compile(r"\s(?:" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_GROUPS = re.compile(
    r"replica_groups=(\{[0-9,{} ]*\}|\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?|mesh\[[^\]]*\]\s*\{[^}]*\})"
)
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9]+,[0-9]+\},?)*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective in the HLO text (static: an op inside a loop body appears once)."""

    kind: str  # one of COLLECTIVES
    name: str  # HLO instruction name
    shape: str  # result shape text, e.g. "f32[2,64,128]{2,1,0}"
    groups: tuple[tuple[int, ...], ...]  # replica groups, or source->target pairs for permutes
    axes: tuple[str, ...]  # mesh axes the groups span, in mesh order; () for a no-op
    computation: str = ""  # the HLO computation holding it (a fusion body, a loop body, ENTRY)


def match_op(line: str) -> re.Match | None:
    """`_OP`'s match in one HLO line (groups: name, result shape, kind, "-start"), or None.

    `_OP` alone is quadratic in a line's length, and a GPU program has lines of hundreds of KB
    (a Mosaic GPU or Triton kernel serialised into its custom call): 13 s for one H100 step's
    text. A collective's opcode is the first `<space><kind>(` of its line, so the search first
    finds that in linear time and is then cut off right after it."""
    for kind in _KIND.finditer(line):
        m = _OP.search(line, 0, kind.end())
        if m:
            return m
    return None


def parse_groups(text: str) -> list[list[int]]:
    """A `replica_groups=` value: explicit (`{{0,1},{2,3}}`), iota (`[2,4]<=[4,2]T(1,0)`) or
    named (`mesh['axis_0'=4,'axis_1'=2] {'axis_1'}`)."""
    if text.startswith("mesh["):
        # Shardy's named form: mesh['a'=4,'b'=2] {'b'} -- ids row-major over that mesh (our
        # axis names, or anonymous axis_0.. after size-1 axes drop out); the braces name the
        # axes each group runs along.
        m = re.fullmatch(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", text)
        dims = [(a, int(n)) for a, n in re.findall(r"'([^']+)'=([0-9]+)", m.group(1))]
        along = re.findall(r"'([^']+)'", m.group(2))
        names = [a for a, _ in dims]
        unknown = [a for a in along if a not in names]
        if unknown:
            raise ValueError(f"replica_groups={text!r}: axis {unknown[0]!r} is not in its mesh")
        ids = np.arange(math.prod(n for _, n in dims)).reshape([n for _, n in dims] or [1])
        order = [i for i, a in enumerate(names) if a not in along] + [names.index(a) for a in along]
        size = math.prod(n for a, n in dims if a in along)
        return ids.transpose(order or [0]).reshape(-1, size).tolist()
    if text.startswith("{"):
        return [
            [int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([0-9, ]*)\}", text[1:-1])
        ]
    m = re.fullmatch(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text)
    if not m:
        raise ValueError(f"replica_groups={text!r}: not an explicit, iota or named replica-group list")
    out_shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(out_shape).tolist()


def replica_groups(hlo_text: str, kind: str) -> list[list[list[int]]]:
    """The replica groups (lists of logical device ids) of every `kind` collective."""
    out = []
    for line in hlo_text.splitlines():
        m = match_op(line)
        g = _GROUPS.search(line) if m and m.group(3) == kind else None
        if g:
            out.append(parse_groups(g.group(1)))
    return out


def spanned_axes(
    groups: Sequence[Sequence[int]], mesh_shape: Sequence[int], axis_names: Sequence[str]
) -> tuple[str, ...]:
    """Mesh axes along which members of any one group differ (logical id i is the i-th
    device of the mesh in row-major order)."""
    n = math.prod(mesh_shape)
    spanned = np.zeros(len(mesh_shape), bool)
    for group in groups:
        ids = np.asarray(group, dtype=np.int64)
        if ids.size == 0:
            continue
        if ids.max() >= n:
            raise ValueError(f"device id {int(ids.max())} in a replica group is outside the {n}-device mesh")
        coords = np.stack(np.unravel_index(ids, tuple(mesh_shape)), axis=1)
        spanned |= (coords != coords[:1]).any(axis=0)
    return tuple(a for a, s in zip(axis_names, spanned) if s)


def collectives_by_axes(hlo_text: str, mesh) -> list[Collective]:
    """Every collective in `hlo_text` (a compiled program's `as_text()`) with the axes of
    `mesh` (a `jax.sharding.Mesh` or anything with `.devices.shape` / `.axis_names`; or
    an `AbstractMesh`, via `.axis_sizes`) that it communicates over.

    An empty `replica_groups={}` means all devices. The TPU compiler writes a
    reduce-scatter as an all-reduce + dynamic-slice inside an `all-reduce-scatter`
    fusion (which it runs as one reduce-scatter); that all-reduce is listed as
    "reduce-scatter". (XLA:CPU leaves the two ops apart in ordinary code: an
    all-reduce.) Multi-slice TPU programs' DCN transfers (host sends) are not
    collectives in this sense and are not listed.
    """
    names = tuple(mesh.axis_names)
    shape = tuple(mesh.devices.shape) if hasattr(mesh, "devices") else tuple(mesh.axis_sizes)
    n = math.prod(shape)
    out = []
    computation = ""
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            computation = head.group(1)
            continue
        m = match_op(line)
        if not m:
            continue
        name, result, kind = m.group(1), m.group(2), m.group(3)
        if kind == "all-reduce" and computation.startswith("all-reduce-scatter"):
            kind = "reduce-scatter"
        if kind == "collective-permute":
            p = _PAIRS.search(line)
            pairs = (
                [[int(a), int(b)] for a, b in re.findall(r"\{([0-9]+),([0-9]+)\}", p.group(1))] if p else []
            )
            groups = [tuple(pr) for pr in pairs]
        else:
            g = _GROUPS.search(line)
            groups = [tuple(x) for x in parse_groups(g.group(1))] if g else []
            if not groups or groups == [()]:
                groups = [tuple(range(n))]
        axes = spanned_axes(groups, shape, names)
        out.append(Collective(kind, name, result, tuple(groups), axes, computation))
    return out


def collective_axes(hlo_text: str, mesh) -> dict[str, set[tuple[str, ...]]]:
    """{kind: the set of axis tuples its ops span}; ops that span no axis are left out."""
    out: dict[str, set[tuple[str, ...]]] = {}
    for c in collectives_by_axes(hlo_text, mesh):
        if c.axes:
            out.setdefault(c.kind, set()).add(c.axes)
    return out

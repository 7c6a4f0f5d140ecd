"""Bytes a compiled program writes only to move or fill memory, per step, read from its HLO.

A GPU step at 47% MFU loses its time in many small places, and the ones a compiler can show
without a GPU are the kernels that compute nothing: buffers filled with a constant, slices
and copies, concatenations, dynamic-update-slices into stacked buffers. Each writes its
output once (and most read as much), so GiB written / HBM bandwidth bounds their time.
`benchmarks/data_movement.py` prints this for a config compiled deviceless; the figures
found `jax.lax.scan`'s 12.5 GiB of zero fills a step on configs/gpu-peer.yaml's H100 program
(models/layer_scan.py now starts those buffers uninitialised on one device).

What counts: instructions of the entry computation and of everything it runs (loop bodies
times their known trip count, called and branch computations once), whose operation, or
whose fused computation's every operation, only moves data (`MOVES`). A fusion's bytes are
its root's: a dynamic-update-slice root writes only its update in place.

`traffic` goes further and counts what every kernel of the step reads and writes, by the
kinds `benchmarks/step_profile.py --gpu` sums a GPU trace by (matmuls, attention, elementwise
fusions, reductions, moves, collectives): the bytes a kernel must move at the least, so
bytes / HBM bandwidth is the time it would take at the chip's full memory speed. Against a
GPU profile's time per kind, this says how far from memory speed each kind runs.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

from jaxtrain.planning.report import shape_bytes

# operations that compute nothing: a fusion made only of these moves or fills memory
MOVES = frozenset(
    {
        "parameter", "constant", "broadcast", "bitcast", "reshape", "copy", "transpose", "slice",
        "dynamic-slice", "dynamic-update-slice", "concatenate", "tuple", "get-tuple-element", "pad",
    }
)  # fmt: skip
KINDS = ("fills", "in-place updates", "slices", "concatenations", "copies and transposes")
# moves that launch no kernel of their own (relabels, or a value already there)
_NO_KERNEL = frozenset({"parameter", "constant", "bitcast", "reshape", "tuple", "get-tuple-element"})
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ")
_INSTR = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = ")


@dataclass(frozen=True)
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    line: str
    root: bool


def _scalar(shape: str) -> bool:
    return re.fullmatch(r"[a-z0-9]+\[\](\{[^}]*\})?", shape) is not None


def _split_shape(rest: str) -> tuple[str, str]:
    """(shape, what follows it) from the text after `name = `: a tuple shape is balanced parens."""
    if not rest.startswith("("):
        shape, _, tail = rest.partition(" ")
        return shape, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return rest[: i + 1], rest[i + 2 :]
    return rest, ""


def _parse(text: str) -> tuple[dict[str, list[_Instr]], str]:
    """Computations by name (instructions in order) and the entry's name."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        is_header = line.endswith("{") and not line.startswith((" ", "}"))
        head = _HEADER.match(line) if is_header else None
        if head:
            current = comps.setdefault(head.group(1), [])
            entry = head.group(1) if line.startswith("ENTRY") else entry
            continue
        m = _INSTR.match(line) if current is not None else None
        if not m:
            continue
        shape, tail = _split_shape(line[m.end() : m.end() + 20000])
        opcode, _, args = tail.partition("(")
        operands = re.findall(r"%([\w.\-]+)", args.split(")", 1)[0])
        current.append(_Instr(m.group(1), shape, opcode, operands, line, "ROOT " in line[: m.end()]))
    return comps, entry


def _callees(ins: _Instr) -> list[tuple[str, int]]:
    """(computation, times it runs per run of `ins`) for what `ins` runs, fusions aside."""
    if ins.opcode == "while":
        body = re.search(r"body=%([\w.\-]+)", ins.line)
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.line)
        return [(body.group(1), int(trips.group(1)) if trips else 1)] if body else []
    if ins.opcode in ("call", "async-start"):
        found = re.search(r"(?:to_apply|calls)=%([\w.\-]+)", ins.line)
        return [(found.group(1), 1)] if found else []
    if ins.opcode == "conditional":
        found = re.search(r"branch_computations=\{([^}]*)\}", ins.line)
        return [(c, 1) for c in re.findall(r"%([\w.\-]+)", found.group(1))] if found else []
    return []


def _ops(comps, name: str) -> set[str]:
    """Every operation on arrays of a fused computation, through nested fusions (scalar
    arithmetic, such as clamping a dynamic-update-slice's index, computes nothing here)."""
    ops = set()
    for ins in comps.get(name, []):
        callee = re.search(r"calls=%([\w.\-]+)", ins.line) if ins.opcode == "fusion" else None
        if callee:
            ops |= _ops(comps, callee.group(1))
        elif not _scalar(ins.shape):
            ops.add(ins.opcode)
    return ops


def _kind(ops: set[str]) -> str:
    if "dynamic-update-slice" in ops:
        return "in-place updates"
    if "concatenate" in ops:
        return "concatenations"
    if ops & {"slice", "dynamic-slice"}:
        return "slices"
    if "broadcast" in ops or "pad" in ops:
        return "fills"
    return "copies and transposes"


def _written(comps, comp: str, ins: _Instr) -> int:
    """Bytes `ins` writes: its shape; for a dynamic-update-slice its update (written in
    place); for a tuple (a multi-output fusion's root) what its elements write."""
    if ins.opcode in ("dynamic-update-slice", "tuple"):
        by_name = {i.name: i for i in comps[comp]}
        if ins.opcode == "tuple":
            return sum(_written(comps, comp, by_name[o]) if o in by_name else 0 for o in ins.operands)
        if len(ins.operands) > 1 and ins.operands[1] in by_name:
            return shape_bytes(by_name[ins.operands[1]].shape)
    return shape_bytes(ins.shape)


def moves(text: str):
    """(instruction name, kind, bytes written per run, runs per step) for each instruction of
    compiled HLO `text` that only moves or fills memory (kinds as `KINDS`)."""
    comps, entry = _parse(text)
    stack = [(entry, 1)]
    while stack:
        comp, times = stack.pop()
        for ins in comps.get(comp, []):
            stack.extend((c, times * n) for c, n in _callees(ins))
            if _scalar(ins.shape):
                continue
            if ins.opcode in ("fusion", "fusion-start"):
                callee = re.search(r"calls=%([\w.\-]+)", ins.line)
                ops = _ops(comps, callee.group(1)) if callee else {"?"}
                if not ops <= MOVES:
                    continue
                body = comps[callee.group(1)]
                root = next((i for i in body if i.root), body[-1])
                yield ins.name, _kind(ops), _written(comps, callee.group(1), root), times
            elif ins.opcode in MOVES - _NO_KERNEL:
                yield ins.name, _kind({ins.opcode}), _written(comps, comp, ins), times
            elif ins.opcode == "copy-start":
                yield ins.name, "copies and transposes", shape_bytes(_split_shape(ins.shape[1:])[0]), times


def data_movement(text: str) -> dict[str, tuple[int, int]]:
    """{kind: (operations run per step, bytes written per step)} for compiled HLO `text`,
    kinds as `KINDS` (absent when none)."""
    count, written = Counter(), Counter()
    for _, kind, size, times in moves(text):
        count[kind] += times
        written[kind] += size * times
    return {k: (count[k], written[k]) for k in KINDS if count[k]}


# ---------------------------------------------------------------- every kernel's traffic

CLASSES = ("matmuls", "attention", "elementwise fusions", "reductions", "moves", "collectives", "other")
# no kernel of their own, or no memory traffic (AllocateBuffer only reserves)
_NO_TRAFFIC = _NO_KERNEL | frozenset(
    {
        "while", "call", "conditional", "opt-barrier", "after-all", "partition-id", "replica-id",
        "add-dependency",
    }
)  # fmt: skip
_COLLECTIVE = re.compile(
    r"^(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute|ragged-all-to-all)"
)
_REDUCING = frozenset({"reduce", "reduce-window", "scatter", "sort"})


def _array_shapes(shape: str) -> list[str]:
    """The array shapes of a (possibly tuple) shape, in order."""
    return re.findall(r"[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?", shape)


def _elements(shape: str) -> int:
    dims = re.match(r"[a-z][a-z0-9]*\[([0-9,]*)\]", shape)
    return math.prod(int(d) for d in dims.group(1).split(",") if d) if dims else 0


def _fusion_read(comps, fused: str) -> int:
    """Bytes a fused computation reads from memory: each parameter whole, except one only
    sliced (the slices' elements: a loop fusion computes only the elements its root needs,
    so a slice after an elementwise op such as a convert reads only its part) or only updated
    in place (nothing); scalars not at all."""
    body = comps[fused]
    users: dict[str, list[tuple[_Instr, int]]] = {}
    for ins in body:
        for k, operand in enumerate(ins.operands):
            users.setdefault(operand, []).append((ins, k))

    def uses(name: str, elements: int) -> list[tuple[_Instr, int]]:
        """`name`'s users, through bitcasts and one-operand elementwise ops (same elements)."""
        out = []
        for ins, k in users.get(name, []):
            passes = len(ins.operands) == 1 and ins.opcode not in MOVES - {"bitcast", "copy"}
            if passes and _elements(ins.shape) == elements:
                out.extend(uses(ins.name, elements))
            else:
                out.append((ins, k))
        return out

    read = 0
    for ins in body:
        if ins.opcode != "parameter" or _scalar(ins.shape):
            continue
        elements = _elements(ins.shape)
        found = uses(ins.name, elements)
        if found and all(u.opcode in ("slice", "dynamic-slice") and k == 0 for u, k in found):
            per_element = shape_bytes(ins.shape) / max(elements, 1)
            read += int(sum(_elements(u.shape) for u, _ in found) * per_element)
        elif found and all(u.opcode == "dynamic-update-slice" and k == 0 for u, k in found):
            continue  # the buffer updated in place
        else:
            read += shape_bytes(ins.shape)
    return read


def _fused_written(comps, fused: str) -> int:
    body = comps[fused]
    by_name = {i.name: i for i in body}
    root = next((i for i in body if i.root), body[-1])
    while root.opcode == "bitcast" and root.operands and root.operands[0] in by_name:
        root = by_name[root.operands[0]]
    return _written(comps, fused, root)


def _traffic_class(comps, ins: _Instr) -> str:
    if ins.opcode in ("custom-call", "custom-call-start"):
        # the library call, or a Pallas kernel's name (`name = "grouped_matmul"`) and op_name
        found = re.findall(r'custom_call_target="([^"]+)"|\bname = "([^"]+)"|op_name="([^"]+)"', ins.line)
        names = " ".join(part for match in found for part in match).lower()
        if any(k in names for k in ("gemm", "cublas", "matmul", "ragged_dot")):
            return "matmuls"
        if any(k in names for k in ("cudnn", "fmha", "flash", "attention", "mha")):
            return "attention"
        return "other"
    if _COLLECTIVE.match(ins.opcode):
        return "collectives"
    if ins.opcode in ("fusion", "fusion-start"):
        callee = re.search(r"calls=%([\w.\-]+)", ins.line)
        if "gemm" in ins.line and ("__triton_gemm" in ins.line or "__cublas" in ins.line):
            return "matmuls"
        if "__cudnn" in ins.line:
            return "attention"
        ops = _ops(comps, callee.group(1)) if callee else set()
        if ops <= MOVES:
            return "moves"
        if "dot" in ops or "convolution" in ops:
            return "matmuls"
        if "kind=kInput" in ins.line or "kind=kLoop" in ins.line:  # XLA's reduction / loop emitters
            return "reductions" if "kind=kInput" in ins.line else "elementwise fusions"
        return "reductions" if ops & _REDUCING else "elementwise fusions"  # e.g. a Triton norm
    if ins.opcode in MOVES or ins.opcode == "copy-start":
        return "moves"
    if ins.opcode in ("dot", "convolution"):
        return "matmuls"
    return "reductions" if ins.opcode in _REDUCING else "elementwise fusions"


def _op_bytes(comps, by_name: dict[str, _Instr], ins: _Instr) -> tuple[int, int]:
    """(bytes read, bytes written) by one run of `ins`, an instruction that runs a kernel."""
    callee = re.search(r"calls=%([\w.\-]+)", ins.line) if "fusion" in ins.opcode else None
    if callee and callee.group(1) in comps:
        return _fusion_read(comps, callee.group(1)), _fused_written(comps, callee.group(1))
    operands = [by_name[o] for o in ins.operands if o in by_name and not _scalar(by_name[o].shape)]
    shapes = _array_shapes(ins.shape)
    if ins.opcode.endswith("-start"):  # async: ((operands), result, context): the result
        written = shape_bytes(shapes[len(ins.operands)]) if len(shapes) > len(ins.operands) else 0
    elif ins.opcode == "custom-call" and len(shapes) > 1:  # a byte-typed output is its workspace
        written = sum(shape_bytes(a) for a in shapes if not a.startswith(("s8[", "u8[")))
    else:
        written = sum(shape_bytes(a) for a in shapes)
    if ins.opcode in ("slice", "dynamic-slice"):
        return written, written
    if ins.opcode == "dynamic-update-slice" and len(operands) > 1:
        update = shape_bytes(operands[1].shape)
        return update, update
    return sum(shape_bytes(o.shape) for o in operands), written


def kernels(text: str):
    """(instruction name, class, bytes read per run, bytes written per run, runs per step,
    metadata op_name) for every instruction of compiled HLO `text` that runs a kernel (classes
    as `CLASSES`; AllocateBuffer, tuples, loops and their like are not kernels). Reads count
    arrays only (scalars are indices and flags), a sliced operand for its slice, the buffer
    of an in-place update not at all; a custom call's writes leave out its byte workspace."""
    comps, entry = _parse(text)
    stack = [(entry, 1)]
    while stack:
        comp, times = stack.pop()
        by_name = {i.name: i for i in comps.get(comp, [])}
        for ins in comps.get(comp, []):
            stack.extend((c, times * n) for c, n in _callees(ins))
            if ins.opcode in _NO_TRAFFIC or ins.opcode.endswith(("-done", "-update")) or _scalar(ins.shape):
                continue
            if ins.opcode.startswith("custom-call") and "AllocateBuffer" in ins.line:
                continue
            read, written = _op_bytes(comps, by_name, ins)
            op_name = re.search(r'op_name="([^"]*)"', ins.line)
            cls = _traffic_class(comps, ins)
            yield ins.name, cls, read, written, times, op_name.group(1) if op_name else ""


def traffic(text: str) -> dict[str, tuple[int, int, int]]:
    """{class: (kernels run per step, bytes read, bytes written per step)} of compiled HLO
    `text` (`kernels`), classes as `CLASSES` (absent when none)."""
    totals: dict[str, list[int]] = {}
    for _, cls, read, written, times, _ in kernels(text):
        t = totals.setdefault(cls, [0, 0, 0])
        t[0], t[1], t[2] = t[0] + times, t[1] + read * times, t[2] + written * times
    return {c: tuple(totals[c]) for c in CLASSES if c in totals}

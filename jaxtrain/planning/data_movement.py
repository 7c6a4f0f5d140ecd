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
"""

from __future__ import annotations

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

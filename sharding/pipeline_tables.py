"""Pipeline schedules as data: which stage does what at each tick.

A `TickTable` says, for every tick t and stage s, one operation on one microbatch of one
layer chunk (`repeat`): a forward F, a backward B (input gradient only), a weight gradient
W, a full backward BW (input and weight gradients together), or nothing (the bubble).
Every tick is one unit of time: F, B, W and BW are drawn the same length, which is the
convention of the zero-bubble paper's tables (in reality B and W each take about one F, BW
two). The bubble of a schedule is the share of idle (stage, tick) cells of its table, so it
is computed, not assumed.

The tables of `gpipe` and `circular` describe what `sharding/pipeline.py` runs (every
forward, then autodiff's mirror image of them); those of `1f1b`, `interleaved_1f1b` and
`zero_bubble` are what `sharding/tick_pipeline.py` executes, tick by tick. They are built
by one list scheduler (`_simulate`): each stage has its order of operations, and at each
tick every stage runs its next one if what it depends on ran at an earlier tick:

* F(s, m, r) needs F of m on the stage before it (stage s-1, or stage S-1 of repeat r-1);
* B / BW(s, m, r) needs F(s, m, r) and B of m on the stage after it (the last chunk's
  loss gradient is formed in the tick of its forward);
* W(s, m, r) needs B(s, m, r).

Imports only numpy.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

IDLE, F, B, W, BW = 0, 1, 2, 3, 4
OP_NAMES = {IDLE: ".", F: "F", B: "B", W: "W", BW: "B"}

TABLE_SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zero_bubble")


@dataclasses.dataclass(frozen=True, eq=False)
class TickTable:
    """ops / micro / repeat: int arrays [ticks, stages] (micro and repeat are -1 where idle)."""

    name: str
    stages: int
    microbatches: int
    repeats: int
    ops: np.ndarray
    micro: np.ndarray
    repeat: np.ndarray

    @property
    def ticks(self) -> int:
        return self.ops.shape[0]

    @property
    def bubble(self) -> float:
        """Idle share of every stage's ticks (the same for all stages in these schedules)."""
        return float(np.mean(self.ops == IDLE))

    def live_inputs(self) -> np.ndarray:
        """[stages]: the most microbatch-chunk stage inputs any stage holds at once; one is
        held from the tick its forward runs to the tick of its last backward op (BW or W)."""
        peak = np.zeros(self.stages, int)
        for s in range(self.stages):
            held = 0
            for t in range(self.ticks):
                if self.ops[t, s] == F:
                    held += 1
                peak[s] = max(peak[s], held)
                if self.ops[t, s] in (BW, W):
                    held -= 1
        return peak

    def render(self) -> str:
        """The table as text, one row per stage: `F3` forward of microbatch 3, `B3` its
        backward, `W3` its weight gradient, `.` idle; with repeats, `F3b` is chunk b."""
        cells = [[self._cell(t, s) for t in range(self.ticks)] for s in range(self.stages)]
        width = max(len(c) for row in cells for c in row)
        header = "tick    " + " ".join(f"{t:>{width}}" for t in range(self.ticks))
        rows = [f"stage {s} " + " ".join(f"{c:>{width}}" for c in row) for s, row in enumerate(cells)]
        return "\n".join([header, *rows])

    def markdown(self) -> str:
        """The table as a Markdown table: a column per tick, a row per stage (cells as `render`)."""
        lines = [
            "| stage | " + " | ".join(str(t) for t in range(self.ticks)) + " |",
            "|---|" + "---|" * self.ticks,
        ]
        for s in range(self.stages):
            lines.append(f"| {s} | " + " | ".join(self._cell(t, s) for t in range(self.ticks)) + " |")
        return "\n".join(lines)

    def _cell(self, t: int, s: int) -> str:
        op = int(self.ops[t, s])
        if op == IDLE:
            return "."
        chunk = chr(ord("a") + int(self.repeat[t, s])) if self.repeats > 1 else ""
        return f"{OP_NAMES[op]}{self.micro[t, s]}{chunk}"


@functools.lru_cache(maxsize=64)
def table(name: str, stages: int, microbatches: int, repeats: int = 1) -> TickTable:
    """The tick table of schedule `name` (TABLE_SCHEDULES)."""
    S, M, R = stages, microbatches, repeats
    for key, v in (("stages", S), ("microbatches", M), ("repeats", R)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"pipeline: {key}={v!r}: expected a positive integer")
    if name in ("gpipe", "circular"):
        return _autodiff_table(name, S, M, R)
    if name == "1f1b":
        _expect_repeats(name, R, 1)
        return _simulate(name, S, M, 1, [_one_f_one_b(S, M, s) for s in range(S)])
    if name == "zero_bubble":
        _expect_repeats(name, R, 1)
        return _simulate(name, S, M, 1, [_zero_bubble_h1(S, M, s) for s in range(S)])
    if name == "interleaved_1f1b":
        if R < 2:
            raise ValueError(f"pipeline: interleaved_1f1b needs repeats >= 2; got repeats={R}")
        if M % S:
            raise ValueError(
                "pipeline: interleaved_1f1b needs microbatches divisible by stages; "
                f"got microbatches={M}, stages={S}"
            )
        return _simulate(name, S, M, R, [_interleaved(S, M, R, s) for s in range(S)])
    raise ValueError(f"pipeline: schedule={name!r}: expected one of {', '.join(TABLE_SCHEDULES)}")


# The tables docs/parallelism.md draws (`docs_markdown`), and the M of its memory column.
DOCS_TABLES = (
    ("gpipe", 4, 8, 1),
    ("1f1b", 4, 8, 1),
    ("zero_bubble", 4, 8, 1),
    ("circular", 2, 4, 2),
    ("interleaved_1f1b", 2, 4, 2),
)
DOCS_SUMMARY = (
    ("gpipe", 4, 8, 1),
    ("circular", 4, 8, 2),
    ("1f1b", 4, 8, 1),
    ("interleaved_1f1b", 4, 8, 2),
    ("zero_bubble", 4, 8, 1),
)
DOCS_LARGE_M = 32


def docs_markdown() -> str:
    """docs/parallelism.md's tick tables and the memory and bubble of each schedule, as the
    tables of this module give them (tests/test_pipeline_schedules.py checks the page holds
    this text between its `<!-- tick tables -->` markers)."""
    out = []
    for name, S, M, R in DOCS_TABLES:
        tb = table(name, S, M, R)
        held = ", ".join(str(int(n)) for n in tb.live_inputs())
        shape = f"S={S}, M={M}" + (f", R={R}" if R > 1 else "")
        idle = int((tb.ops == IDLE).sum())
        out += [
            f"**{name}**, {shape}: bubble {tb.bubble:.3f} ({idle} idle of {tb.ticks} x {S} cells), "
            f"inputs held per stage {held}",
            "",
            tb.markdown(),
            "",
        ]
    out += [
        f"| schedule | S, M, R | bubble | inputs held by stage 0 | at M = {DOCS_LARGE_M} |",
        "|---|---|---|---|---|",
    ]
    for name, S, M, R in DOCS_SUMMARY:
        tb, large = table(name, S, M, R), table(name, S, DOCS_LARGE_M, R)
        out.append(
            f"| {name} | {S}, {M}, {R} | {tb.bubble:.3f} | {int(tb.live_inputs()[0])} "
            f"| {int(large.live_inputs()[0])} |"
        )
    return "\n".join(out) + "\n"


def _expect_repeats(name: str, repeats: int, expected: int) -> None:
    if repeats != expected:
        raise ValueError(f"pipeline: {name} runs repeats={expected}; got repeats={repeats}")


def _autodiff_table(name: str, S: int, M: int, R: int) -> TickTable:
    """sharding/pipeline.py: iteration t runs step k = t - s of stage s (microbatch k mod M,
    repeat k // M) for M*R + S - 1 iterations; the backward runs them in reverse."""
    n = M * R + S - 1
    ops = np.full((2 * n, S), IDLE)
    micro, repeat = np.full((2 * n, S), -1), np.full((2 * n, S), -1)
    for t in range(n):
        for s in range(S):
            k = t - s
            if 0 <= k < M * R:
                for tick, op in ((t, F), (2 * n - 1 - t, BW)):
                    ops[tick, s], micro[tick, s], repeat[tick, s] = op, k % M, k // M
    return TickTable(name, S, M, R, ops, micro, repeat)


def _one_f_one_b(S: int, M: int, s: int) -> list[tuple[int, int, int]]:
    """Stage s: S - 1 - s warm-up forwards, then one forward and one backward in turn."""
    warm = min(S - 1 - s, M)
    order = [(F, m, 0) for m in range(warm)]
    for i in range(M - warm):
        order += [(F, warm + i, 0), (BW, i, 0)]
    return order + [(BW, m, 0) for m in range(M - warm, M)]


def _zero_bubble_h1(S: int, M: int, s: int) -> list[tuple[int, int, int]]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023, Figure 3 top) for stage s:
    1F1B's S - s forwards before the first backward, each backward split into B and W, and
    the first s weight gradients deferred, so that every stage keeps at most S inputs (stage
    0's 1F1B peak) and from its first B on runs B, W, F without a gap. With F, B and W a tick
    each, a stage is idle S - 1 ticks of 3M + S - 1 (M >= S): the paper's
    (S-1)(T_F + T_B - T_W), a third of 1F1B's (S-1)(T_F + T_B + T_W)."""
    warm = min(S - s, M)
    order = [(F, m, 0) for m in range(warm)]
    deferred_w = 0
    for i in range(M):
        order.append((B, i, 0))
        if i >= s:
            order.append((W, deferred_w, 0))
            deferred_w += 1
        if warm + i < M:
            order.append((F, warm + i, 0))
    return order + [(W, m, 0) for m in range(deferred_w, M)]


def _interleaved(S: int, M: int, R: int, s: int) -> list[tuple[int, int, int]]:
    """Megatron's interleaved order for device s: forwards in groups of S microbatches per
    chunk, chunks in turn (backwards the same, the last chunk first), one forward and one
    backward alternating after a warm-up. Megatron warms up with (S-s-1)*2 + (R-1)*S
    forwards, the extra S-s-1 covering a backward twice a forward's length; in ticks of one
    length (S-s-1) + (R-1)*S give the same bubble, (S-1)/(M*R+S-1), and keep device s at
    R*S - s microbatch-chunk inputs: R*S chunks of L/(S*R) layers, S stages' worth of
    layers, the 1f1b bound (Megatron's count keeps up to (R+1)*S - 1)."""
    n = M * R

    def fwd(k):
        return (F, (k // (S * R)) * S + k % S, (k // S) % R)

    def bwd(k):
        return (BW, (k // (S * R)) * S + k % S, R - 1 - (k // S) % R)

    warm = min(S - s - 1 + (R - 1) * S, n)
    order = [fwd(k) for k in range(warm)]
    for i in range(n - warm):
        order += [fwd(warm + i), bwd(i)]
    return order + [bwd(k) for k in range(n - warm, n)]


def _simulate(name, S, M, R, orders) -> TickTable:
    """Run each stage's order as early as its dependencies allow (see the module doc): at
    each tick a stage runs its next op if what it needs ran at an earlier tick, else idles."""
    done: dict[tuple, int] = {}  # (op kind, stage, micro, repeat) -> tick
    pos = [0] * S
    ops_rows, micro_rows, repeat_rows = [], [], []
    t = 0
    limit = 8 * (M * R + S) * 3
    while any(pos[s] < len(orders[s]) for s in range(S)):
        if t > limit:
            raise RuntimeError(f"pipeline: schedule {name} does not finish (S={S}, M={M}, R={R})")
        row = [(IDLE, -1, -1)] * S
        for s in range(S):
            nxt = orders[s][pos[s]] if pos[s] < len(orders[s]) else None
            if nxt is not None and _ready(done, nxt, s, S, R, t):
                row[s] = nxt
                pos[s] += 1
        for s, (op, m, r) in enumerate(row):
            if op != IDLE:
                done[(F if op == F else (W if op == W else B), s, m, r)] = t
        ops_rows.append([c[0] for c in row])
        micro_rows.append([c[1] for c in row])
        repeat_rows.append([c[2] for c in row])
        t += 1
    return TickTable(name, S, M, R, np.array(ops_rows), np.array(micro_rows), np.array(repeat_rows))


def _ready(done: dict, op: tuple[int, int, int], s: int, S: int, R: int, t: int) -> bool:
    kind, m, r = op

    def ran(key):
        return key in done and done[key] < t

    if kind == F:
        if s == 0 and r == 0:
            return True
        prev = (s - 1, r) if s > 0 else (S - 1, r - 1)
        return ran((F, prev[0], m, prev[1]))
    if kind == W:
        return ran((B, s, m, r))
    # B or BW: its own forward, and the input gradient from the stage after it
    if not ran((F, s, m, r)):
        return False
    if s == S - 1 and r == R - 1:
        return True
    nxt = (s + 1, r) if s < S - 1 else (0, r + 1)
    return ran((B, nxt[0], m, nxt[1]))

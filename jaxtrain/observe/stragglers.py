"""Which process is slow, in a multi-process run.

In one SPMD program every process takes the same time per step: the collectives make the
fast ones wait for the slowest. What differs is where each process spends it. A process's
*own* time is its step time less the time it sat waiting for the device at the loop's sync
point (the device waits there for the other processes' collectives): data loading, host
work, dispatch. The slow process is the one with the largest own time; the others show the
same seconds as waiting.

Every `logging.stragglers.every` steps each process's own time and data wait per step over
the window are gathered (`multihost_utils.process_allgather`, a host-side collective every
process reaches at the same step). A process whose own time is over the median's by more than
`slower_by` of the step time is named in a warning line and in a metrics.jsonl record
`{"step", "event": "stragglers", "step_time_s", "own_time_s": [...], "data_wait_s": [...],
"slow": [...]}` (the lists in process order).

What it cannot see: a device that computes slowly (a throttled GPU) delays every process's
wait equally; the device-side view of that is the profiler's (`profile.steps`).
"""

from __future__ import annotations

import dataclasses
import socket
import time

import numpy as np


@dataclasses.dataclass
class Window:
    """This process's times since the last report."""

    steps: int = 0
    data_wait: float = 0.0
    # at the loop's sync points: waiting for the device (and through it for the other
    # processes), evaluation and checkpoint saves, which every process waits through alike
    waited: float = 0.0
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def own_per_step(self, now: float) -> float:
        return max(0.0, now - self.started - self.waited) / max(1, self.steps)


def slow_processes(own: np.ndarray, step_time: float, slower_by: float) -> list[int]:
    """Indices of the processes whose own time per step is over the median's by more than
    `slower_by` x the step time: what each of them adds to every step of the run. (Against the
    median own time alone, a few milliseconds of host noise would be a large fraction.)"""
    median = float(np.median(own))
    return [int(i) for i in np.flatnonzero(own - median > slower_by * step_time)]


class StragglerReport:
    """Times this process's window and, every `every` steps, gathers every process's."""

    def __init__(self, every: int, slower_by: float, process_count: int, gather=None):
        self.every = every if process_count > 1 else 0
        self.slower_by = slower_by
        self.window = Window()
        self._gather = gather or _process_allgather
        self._hosts: list[str] | None = None

    @property
    def on(self) -> bool:
        return self.every > 0

    def reset(self) -> None:
        self.window = Window()

    def step_done(self) -> None:
        self.window.steps += 1

    def due(self, step: int) -> bool:
        return self.on and step % self.every == 0

    def report(self, step: int) -> tuple[dict, str | None]:
        """Gather the window of every process (all of them call this at `step`): (the metrics
        record, the warning line or None). Starts a new window."""
        w, now = self.window, time.perf_counter()
        steps = max(1, w.steps)
        mine = np.array([w.own_per_step(now), w.data_wait / steps, (now - w.started) / steps])
        table = np.asarray(self._gather(mine)).reshape(-1, 3)
        if self._hosts is None:
            self._hosts = gather_hostnames(self._gather)
        own, data, step_time = table[:, 0], table[:, 1], float(np.max(table[:, 2]))
        slow = slow_processes(own, step_time, self.slower_by)
        record = {
            "step": step,
            "event": "stragglers",
            "step_time_s": round(step_time, 6),
            "own_time_s": [round(float(x), 6) for x in own],
            "data_wait_s": [round(float(x), 6) for x in data],
            "slow": slow,
        }
        median = float(np.median(own))
        line = None
        if slow:
            named = [
                f"process {i} ({self._hosts[i]}) own time {own[i]:.3f} s/step against a median of "
                f"{median:.3f} s, {100 * (own[i] - median) / step_time:.0f}% of the {step_time:.3f} s "
                f"step; data wait {data[i]:.3f} s/step"
                for i in slow
            ]
            line = f"stragglers, steps {step - w.steps + 1}..{step}: " + "; ".join(named)
        self.reset()
        return record, line


def _process_allgather(x: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils  # only multi-process runs gather

    return multihost_utils.process_allgather(x)


def gather_hostnames(gather) -> list[str]:
    """Every process's host name, in process order (fixed-size bytes through the same gather)."""
    name = socket.gethostname().encode()[:64].ljust(64, b"\0")
    table = np.asarray(gather(np.frombuffer(name, dtype=np.uint8).astype(np.int32))).reshape(-1, 64)
    return [bytes(row.astype(np.uint8)).rstrip(b"\0").decode(errors="replace") for row in table]

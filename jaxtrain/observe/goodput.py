"""Goodput: where a run's wall time went, over all its attempts (restarts included).

One clock per attempt charges every moment, from `train()`'s start to its end, to exactly one
bucket (the one open at the time), so an attempt's buckets sum to its wall time:

- `startup`: mesh, data, program and state built, config written (the bucket open at first);
- `restore`: reading a checkpoint (at the start, and at a fault rollback);
- `compile`: the train step's compile;
- `steps`: the loop's own time: the steps, their metrics and logging (productive);
- `data_wait`: the loop waiting for the next batch;
- `checkpoint_save`: the loop blocked by a save (and waiting for the last one at the end);
- `eval`: evaluations, their compile included;
- `lost`: steps done again: after a restart, the previous attempt's time from the checkpoint
  this attempt resumed from (of either tier: recovery/tiers.py) to that attempt's last logged
  step (moved out of the buckets that time was charged to: steps, data wait, evals, saves);
  after a fault rollback, this
  attempt's time since the checkpoint it rolled back to.

Across attempts `between_attempts` is the time from an attempt's last record to the next
one's start (the process restart, imports, the scheduler): the run's wall time is then the
sum of everything. `goodput` = steps / wall time.

`{output_dir}/goodput.json` is rewritten by process 0 at each log step (locally; on object
stores, with the metrics' syncs) and at the end; a killed attempt keeps what its last write
said. Time before `train()` is called (imports, jax start-up) counts only for a resumed
attempt, inside `between_attempts`.
"""

from __future__ import annotations

import contextlib
import json
import time

from jaxtrain.data import storage

BUCKETS = ("startup", "restore", "compile", "steps", "data_wait", "sample", "checkpoint_save", "eval", "lost")
# sample: train.objective=grpo's rollouts (the sampler and the old log-probs; trainer/rollout.py;
# its wait for the update it samples from is the steps')
LOOP_BUCKETS = ("steps", "data_wait", "sample", "checkpoint_save", "eval")  # what redone steps spent
FILE = "goodput.json"
KEEP_SAVES = 16  # checkpoint snapshots kept per attempt


class GoodputClock:
    """One attempt's wall time in buckets; `phase(name)` charges a stretch to `name` and then
    returns to the bucket open before it. The buckets are also kept as they stood at each
    checkpoint save and at the last logged step, to tell what a restart lost."""

    def __init__(self, first_step: int, *, clock=time.perf_counter, wall=time.time):
        self._clock, self._wall = clock, wall
        self.started = wall()
        self._t0 = self._mark = clock()
        self._open = "startup"
        self.seconds = dict.fromkeys(BUCKETS, 0.0)
        self.first_step = first_step
        self.at_loop: dict[str, float] | None = None  # the buckets when the steps began
        self.at_save: dict[int, dict[str, float]] = {}  # checkpoint step -> the buckets then
        self._local_saves: set[int] = set()  # the steps of at_save saved to the local tier
        self.last_logged: tuple[int, dict[str, float]] | None = None  # (step, the buckets then)

    def elapsed(self) -> float:
        return self._clock() - self._t0

    def switch(self, bucket: str) -> None:
        """Charge the time since the last switch to the open bucket; open `bucket`."""
        now = self._clock()
        self.seconds[self._open] += now - self._mark
        self._mark, self._open = now, bucket

    @contextlib.contextmanager
    def phase(self, bucket: str):
        before = self._open
        self.switch(bucket)
        try:
            yield
        finally:
            self.switch(before)

    def snapshot(self) -> dict[str, float]:
        self.switch(self._open)
        return dict(self.seconds)

    def looping(self) -> None:
        """The steps begin (the `steps` bucket opens)."""
        self.at_loop = self.snapshot()
        self.switch("steps")

    def logged(self, step: int) -> None:
        self.last_logged = (step, self.snapshot())

    def saved(self, step: int, tier: str = "persistent") -> None:
        """A checkpoint of `step` was started (`tier`: "persistent" or "local"). The newest
        KEEP_SAVES of each tier are kept: frequent local saves must not push out the
        persistent step a restart may fall back to."""
        self.at_save[step] = self.snapshot()
        if tier == "local":
            self._local_saves.add(step)
        else:
            self._local_saves.discard(step)
        for local in (True, False):
            steps = sorted(s for s in self.at_save if (s in self._local_saves) == local)
            for old in steps[:-KEEP_SAVES]:  # a restart or rollback uses recent ones
                del self.at_save[old]
                self._local_saves.discard(old)

    def rolled_back(self, to_step: int) -> None:
        """A fault rollback to checkpoint `to_step`: the time since this attempt saved it is
        lost (an older attempt's checkpoint: since the steps began)."""
        since = self.at_save.get(to_step, self.at_loop)
        if since is not None:
            move_to_lost(self.seconds, since, self.snapshot())
        self.at_save = {s: v for s, v in self.at_save.items() if s <= to_step}

    def record(self) -> dict:
        """This attempt as goodput.json keeps it (the open bucket charged up to now)."""
        seconds = self.snapshot()
        return {
            "started": self.started,
            "ended": self._wall(),
            "first_step": self.first_step,
            "wall_s": self._mark - self._t0,  # the instant the snapshot charged up to
            "seconds": seconds,
            "at_loop": self.at_loop,
            "at_save": {str(s): v for s, v in sorted(self.at_save.items())},
            "last_logged": list(self.last_logged) if self.last_logged else None,
        }


def move_to_lost(seconds: dict, since: dict, until: dict) -> float:
    """Move what each of the loop's buckets gained from `since` to `until` (two snapshots)
    into `lost`; returns the seconds moved. (A rollback's own restore stays a restore.)"""
    moved = 0.0
    for k in LOOP_BUCKETS:
        gained = max(0.0, min(seconds[k], until.get(k, 0.0) - since.get(k, 0.0)))
        seconds[k] -= gained
        moved += gained
    seconds["lost"] += moved
    return moved


def charge_restart(earlier: list[dict], resumed_step: int | None) -> float:
    """Move the previous attempt's time from the checkpoint this attempt resumed from (or,
    when an older attempt saved it, from the start of its steps) to its last logged step
    into its `lost`; returns the seconds moved. Charged once per attempt."""
    if not earlier:
        return 0.0
    prev = earlier[-1]
    last = prev.get("last_logged")
    if not last or prev.get("restart_charged"):
        return 0.0
    step, until = last
    if step <= (resumed_step or 0):
        return 0.0
    since = prev["at_save"].get(str(resumed_step)) or prev.get("at_loop") or {}
    prev["restart_charged"] = True
    return move_to_lost(prev["seconds"], since, until)


def summary(attempts: list[dict]) -> dict:
    """goodput.json: the attempts, their buckets summed, the gaps between them, the ratio."""
    total = dict.fromkeys(BUCKETS, 0.0)
    for a in attempts:
        for k in BUCKETS:
            total[k] += a["seconds"].get(k, 0.0)
    gaps = sum(max(0.0, b["started"] - a["ended"]) for a, b in zip(attempts, attempts[1:]))
    total["between_attempts"] = gaps
    wall = sum(a["wall_s"] for a in attempts) + gaps
    return {
        "wall_s": wall,
        "goodput": total["steps"] / wall if wall > 0 else 0.0,
        "seconds": total,
        "attempts": attempts,
    }


def describe(doc: dict) -> str:
    """One line: `goodput 71.3% of 42.0 s (2 attempts): steps 30.0 s, compile 5.1 s, ...`."""
    parts = ", ".join(
        f"{k} {v:.1f} s" for k, v in sorted(doc["seconds"].items(), key=lambda kv: -kv[1]) if v >= 0.05
    )
    n = len(doc["attempts"])
    attempts = f"{n} attempt{'s' * (n > 1)}"
    return f"goodput {100 * doc['goodput']:.1f}% of {doc['wall_s']:.1f} s ({attempts}): {parts}"


def load(text: str | None) -> list[dict]:
    """The earlier attempts from a goodput.json's text (none if missing or unreadable)."""
    if not text:
        return []
    try:
        return list(json.loads(text).get("attempts", []))
    except (ValueError, AttributeError):
        return []


class GoodputFile:
    """`{output_dir}/goodput.json`, written by process 0: the earlier attempts (read once, at
    the start, with the restart charged to the last of them) and this one."""

    def __init__(self, output_dir: str, primary: bool):
        self.primary = primary
        self.path = storage.as_path(storage.join(output_dir, FILE))
        self.remote = not storage.is_local(output_dir)
        self.earlier: list[dict] = []
        self.started = False

    def start(self, resumed_step: int | None) -> float:
        """Read the earlier attempts; returns the seconds the restart lost (charge_restart)."""
        if not self.primary:
            return 0.0
        self.started = True
        self.earlier = load(self.path.read_text() if self.path.exists() else None)
        return charge_restart(self.earlier, resumed_step)

    def document(self, clock: GoodputClock) -> dict:
        return summary([*self.earlier, clock.record()])

    def write(self, clock: GoodputClock, *, durable: bool = False) -> dict | None:
        """Rewrite the file (on an object store only when `durable`: at checkpoints, evals and
        the end, as the metrics are synced)."""
        if not self.started or (self.remote and not durable):
            return None  # a run refused at the start leaves output_dir as it was
        doc = self.document(clock)
        # whole or not at all: a process killed mid-write leaves the previous file, not an empty
        # one (no fsync at every log step: a killed process, not a lost host, is the case)
        storage.write_atomic(self.path, (json.dumps(doc, indent=1) + "\n").encode(), fsync=False)
        return doc

"""Numerical fault policy: which steps are faults, and what to do after a run of them.

Each step is judged inside the jitted step, before its update is applied
(trainer/step.py `judge_step`): a *fault* is a loss or gradient that is not finite,
or a loss above `faults.spike_factor` x the median of the last
`faults.spike_window` good losses; a faulty step's update is skipped and its
`fault` metric says why. This monitor, on the host, reads those verdicts in
step order and applies the policy: after `faults.max_consecutive` faults in a
row it says `rollback` (restore the newest checkpoint from before the streak
and continue past the streak's batches, as PaLM did for its loss spikes) or
`stop`.

Deterministic: every process sees the same (replicated) metrics, so every
process reaches the same verdict at the same step; the loss window lives in the
train state and the monitor's counters in each checkpoint, so a resumed run
judges exactly as an uninterrupted one would. Nothing here imports jax.
"""

from __future__ import annotations

import dataclasses

from jaxtrain.config import FaultsConfig


class TrainingFault(RuntimeError):
    """The fault policy decided to stop the run; the message says why and what to do."""


@dataclasses.dataclass
class Streak:
    """Consecutive faulty steps: the first and last step, and the batches they consumed."""

    first_step: int
    last_step: int
    first_batch: int
    last_batch: int
    reasons: list[str]

    @property
    def length(self) -> int:
        return self.last_step - self.first_step + 1


# The step's `fault` metric (set by trainer/step.py judge_step): why its update was
# skipped, and the name used in messages.
FAULT_NONE, FAULT_NONFINITE, FAULT_SPIKE = 0, 1, 2
FAULT_REASONS = {FAULT_NONE: None, FAULT_NONFINITE: "nonfinite", FAULT_SPIKE: "spike"}


class FaultMonitor:
    """Feed it every step's (loss, skipped, fault code) in order; it returns None,
    "rollback" or "stop"."""

    def __init__(self, cfg: FaultsConfig):
        self.cfg = cfg
        self.streak: Streak | None = None
        self.skipped_total = 0
        self.spikes_total = 0
        self.rollbacks = 0

    def observe(self, step: int, batch_index: int, loss: float, skipped: bool, fault: int) -> str | None:
        """Record one step; returns the action due ("rollback" or "stop"), if any."""
        reason = FAULT_REASONS[int(fault)]
        self.skipped_total += int(bool(skipped))
        if reason is None:
            self.streak = None
            return None
        if reason == "spike":
            self.spikes_total += 1
        if self.streak is None:
            self.streak = Streak(step, step, batch_index, batch_index, [])
        self.streak.last_step, self.streak.last_batch = step, batch_index
        self.streak.reasons.append(f"step {step}: {reason} (loss {loss:.4g})")
        if self.streak.length < self.cfg.max_consecutive:
            return None
        if self.cfg.on_too_many == "rollback" and self.rollbacks < self.cfg.max_rollbacks:
            return "rollback"
        return "stop"

    def describe_streak(self) -> str:
        s = self.streak
        if s is None:
            return "no faults"
        shown = s.reasons if len(s.reasons) <= 4 else [*s.reasons[:2], "...", *s.reasons[-1:]]
        return (
            f"{s.length} consecutive faulty steps {s.first_step}..{s.last_step} "
            f"(batches {s.first_batch}..{s.last_batch}): {'; '.join(shown)}"
        )

    def stop_error(self, why: str | None = None) -> TrainingFault:
        if why is None:
            why = (
                f"faults.on_too_many={self.cfg.on_too_many}"
                if self.cfg.on_too_many == "stop"
                else f"faults.max_rollbacks={self.cfg.max_rollbacks} rollbacks already done"
            )
        return TrainingFault(
            f"{self.describe_streak()}; stopping ({why}). Lower "
            "optimizer.lr, raise optimizer.warmup_steps or check the data at those batches; "
            "rerunning resumes from the newest checkpoint"
        )

    def after_rollback(self, restored: dict | None) -> None:
        """Rolled back: the streak is dealt with; keep the totals."""
        rollbacks, skipped, spikes = self.rollbacks + 1, self.skipped_total, self.spikes_total
        if restored:
            self.load_state_dict(restored)
        self.streak = None
        self.rollbacks, self.skipped_total, self.spikes_total = rollbacks, skipped, spikes

    def state_dict(self) -> dict:
        return {
            "skipped_total": self.skipped_total,
            "spikes_total": self.spikes_total,
            "rollbacks": self.rollbacks,
            "streak": dataclasses.asdict(self.streak) if self.streak else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.skipped_total = int(state.get("skipped_total", 0))
        self.spikes_total = int(state.get("spikes_total", 0))
        self.rollbacks = int(state.get("rollbacks", 0))
        streak = state.get("streak")
        self.streak = Streak(**streak) if streak else None

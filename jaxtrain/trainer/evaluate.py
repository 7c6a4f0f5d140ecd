"""Held-out evaluation during training (`eval.*`): the loss over the same batches every time."""

from __future__ import annotations

import math
import time

import jax

from jaxtrain.config import Config
from jaxtrain.trainer.batches import BatchFeeder
from jaxtrain.trainer.program import TrainProgram
from jaxtrain.trainer.step import TrainState


class Evaluator:
    """`eval.*`: the held-out loss over the same `eval.batches` batches every time (batches
    0 .. eval.batches - 1 of the eval data, a pure function of seed and data), placed with
    the step's batch sharding and sequence order (context parallelism), through a jitted
    forward that donates nothing (`TrainProgram.eval_step`). eval_loss = the summed token
    losses of all batches / their counted tokens (MoE router losses excluded);
    eval_perplexity = exp(eval_loss)."""

    def __init__(self, cfg: Config, data, feeder: BatchFeeder, program: TrainProgram, log):
        self.every, self.batches = cfg.eval.every, cfg.eval.batches
        self.data, self.feeder, self.program, self.log = data, feeder, program, log
        self._compiled = None

    def describe(self) -> str:
        rows = self.data.global_batch_size
        text = f"eval every {self.every} steps and at the end: {self.batches} batches of {rows} rows"
        windows = getattr(self.data, "num_windows", None)
        windows = sum(windows) if isinstance(windows, list) else windows
        if windows is not None and windows < self.batches * rows:
            text += f" (the eval data holds {windows} windows of train.seq_len: some are read twice)"
        return text

    def due(self, step: int, total: int) -> bool:
        return step % self.every == 0 or step == total

    def __call__(self, state: TrainState, step: int) -> dict:
        """Evaluate `state` (not donated); returns the metrics record of step `step`."""
        sums, t0 = [], time.perf_counter()
        for k in range(self.batches):
            batch = self.feeder.place(self.data.batch_at(k))
            if self._compiled is None:
                self._compiled = self.program.eval_step.lower(state, batch).compile()
                self.log(f"compiled eval step in {time.perf_counter() - t0:.1f} s")
                t0 = time.perf_counter()
            sums.append(self._compiled(state, batch))  # dispatched: reading batch k+1 overlaps it
        sums = jax.device_get(sums)
        total, count = math.fsum(float(t) for t, _ in sums), sum(float(c) for _, c in sums)
        loss = total / count if count else math.nan
        perplexity = math.inf if loss >= 700 else math.exp(loss)  # nan stays nan
        record = {
            "step": step,
            "eval_loss": loss,
            "eval_perplexity": perplexity,
            "eval_tokens": int(count),
            "eval_time_s": time.perf_counter() - t0,
        }
        self.log(
            f"eval step {step}: loss {loss:.4f}, perplexity {perplexity:.3f} "
            f"({int(count):,} tokens, {self.batches} batches, {record['eval_time_s']:.1f} s)"
        )
        return record

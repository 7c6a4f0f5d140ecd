"""Evaluation during training (`eval.*`): the held-out loss over the same batches every time,
and `eval.tasks`, lm-evaluation-harness benchmarks on the training weights."""

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


class TaskEvaluator:
    """`eval.tasks`: lm-evaluation-harness tasks on the training weights, on the training mesh
    (jaxtrain/evaluation.py's `JaxtrainLM` over the model of the state's parameters, a context
    of train.seq_len, the run's tokenizer), `eval.task_batch_size` requests per batch. Its
    record: each task metric as `eval_<task>/<metric>` (lm-eval's filter appended when it is
    not `none`) and `eval_tasks_time_s`. Needs the `eval` extra (lm-eval), imported only here."""

    def __init__(self, cfg: Config, mesh, rules, program: TrainProgram, log):
        from lm_eval.tasks import TaskManager

        from jaxtrain.config import ConfigError
        from jaxtrain.interchange import generate as gen

        e = cfg.eval
        self.cfg, self.mesh, self.rules, self.program, self.log = cfg, mesh, rules, program, log
        self.manager = TaskManager(include_path=e.include_path)
        unknown = [t for t in e.tasks if t not in self.manager.all_tasks]
        if unknown:
            raise ConfigError(
                f"eval.tasks: unknown task(s) {', '.join(unknown)}: not lm-eval's"
                + (f" or under eval.include_path={e.include_path}" if e.include_path else "")
            )
        try:
            self.tokenizer = gen.Tokenizer(gen._run_tokenizer(cfg), vocab_size=cfg.model.vocab_size)
        except gen.GenerateError as err:
            raise ConfigError(f"eval.tasks: {err}") from None

    def describe(self) -> str:
        e = self.cfg.eval
        limit = f", limit {e.limit}" if e.limit is not None else ""
        shots = f", {e.num_fewshot}-shot" if e.num_fewshot is not None else ""
        return (
            f"eval tasks every {e.every} steps and at the end: {', '.join(e.tasks)}{limit}{shots} "
            f"({e.task_batch_size} requests per batch, context {self.cfg.train.seq_len})"
        )

    def __call__(self, state: TrainState, step: int) -> dict:
        from lm_eval import simple_evaluate

        from jaxtrain import models
        from jaxtrain.evaluation import JaxtrainLM, task_metrics
        from jaxtrain.trainer.step import whole_params

        cfg, e, t0 = self.cfg, self.cfg.eval, time.perf_counter()
        params = whole_params(state.params, state.frozen)
        model = models.merge(self.program.graphdef, self.program.abstract_params, params)
        lm = JaxtrainLM.from_model(
            model,
            self.tokenizer,
            mesh=self.mesh,
            rules=self.rules,
            max_length=cfg.train.seq_len,
            name=str(cfg.output_dir),
            batch_size=e.task_batch_size,
            seed=cfg.seed,
        )
        limit = None if e.limit is None else (e.limit if e.limit < 1 else int(e.limit))
        results = simple_evaluate(
            model=lm,
            tasks=list(e.tasks),
            num_fewshot=e.num_fewshot,
            limit=limit,
            task_manager=self.manager,
            log_samples=False,
        )
        record = {**task_metrics(results), "eval_tasks_time_s": time.perf_counter() - t0}
        shown = ", ".join(f"{k[len('eval_') :]} {v:.4f}" for k, v in record.items() if "/" in k)
        self.log(f"eval step {step}: {shown} ({record['eval_tasks_time_s']:.1f} s)")
        return record


class Evaluations:
    """What runs every `eval.every` steps and after the last one: the held-out loss
    (`Evaluator`), `eval.tasks` (`TaskEvaluator`), or both; one metrics record."""

    def __init__(self, every: int, held_out: Evaluator | None, tasks: TaskEvaluator | None):
        self.every, self.held_out, self.tasks = every, held_out, tasks

    def describe(self) -> str:
        return "; ".join(part.describe() for part in (self.held_out, self.tasks) if part is not None)

    def due(self, step: int, total: int) -> bool:
        return step % self.every == 0 or step == total

    def __call__(self, state: TrainState, step: int) -> dict:
        record = {"step": step}
        for part in (self.held_out, self.tasks):
            if part is not None:
                record.update(part(state, step))
        return record

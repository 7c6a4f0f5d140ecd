"""GRPO rollouts (train.objective=grpo): prompts -> sampled completions -> rewards -> a batch.

`RolloutFeeder` stands where `BatchFeeder` stands for the other objectives: the loop asks it
for the batch of the next step, with the train state. Every `grpo.updates_per_rollout` (mu)
steps it samples a new rollout, which steps s .. s + mu - 1 reuse whole:

1. prompt batch k = step // mu (data/prompts.py: `global_batch_size / group_size` prompts,
   each repeated `group_size` times, consecutive), right-padded to `grpo.max_prompt_len`;
2. sampling on the training mesh with the training weights themselves (no copy; LoRA: base
   and adapters), batched, with the KV cache (models/generation.py `generate_traced`):
   temperature, then top-k, then top-p; key ``fold_in(fold_in(key(seed), 0x9290), k)``, so a
   resumed run draws what an uninterrupted one does. A completion ends at the EOS
   `jaxtrain generate` uses (the init_from directory's config.json ``eos_token_id``, else the
   tokenizer's), which it keeps and is trained on, or after `grpo.max_new_tokens` (truncated);
3. the rewards (trainer/rewards.py) on the decoded completions, the advantages and the
   loss weights (trainer/grpo.py), and ``old_logps``: the sampling weights' log-probs of the
   completion tokens at `grpo.temperature`, one forward pass over the batch. On several
   processes every process gathers the whole batch's tokens and old log-probs, scores its
   own rows (as TRL does) and gathers the scores, so each computes the same advantages,
   weights and metrics from the same numbers;
4. one row per completion in ``output_dir/rollouts.jsonl`` (process 0), and the rollout's
   arrays in ``output_dir/rollouts/<k>.npz`` (grpo.updates_per_rollout > 1; the last
   checkpoint.every / mu + 2 of them kept), from which a run resumed in the middle of a
   reused rollout takes it back (the weights that sampled it are gone by then).

Time spent here is the goodput bucket ``sample`` (the sampling and the old log-probs).
"""

from __future__ import annotations

import contextlib
import io
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from jax.experimental import multihost_utils

from jaxtrain import models, sharding
from jaxtrain.config import Config
from jaxtrain.data import storage
from jaxtrain.data.core import batch_from_windows
from jaxtrain.data.prompts import PromptIterator
from jaxtrain.models import generation
from jaxtrain.trainer import grpo
from jaxtrain.trainer.batches import batch_to_device
from jaxtrain.trainer.rewards import load_rewards, score
from jaxtrain.trainer.step import whole_params

_SAMPLE_STREAM = 0x9290  # the sampler's key stream, apart from the model's init and dropout


def eos_id_for(cfg: Config, tokenizer_eos: int) -> int:
    """The EOS `jaxtrain generate` stops at: train.init_from's config.json ``eos_token_id``
    (the first when it lists several), else the tokenizer's."""
    if cfg.train.init_from:
        config = storage.join(cfg.train.init_from, "config.json")
        if storage.is_file(config):
            eos = json.loads(storage.read_bytes(config)).get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) and eos else eos
            if isinstance(eos, int):
                return eos
    return int(tokenizer_eos)


class _Spec:
    """What grpo.policy_logps reads of a StepSpec."""

    def __init__(self, cfg: Config):
        self.cfg, self.pipeline = cfg, None


def _sampler(program, cfg: Config, eos_id: int, rules):
    g = cfg.grpo

    def run(params, frozen, tokens, lengths, key):
        model = models.merge(program.graphdef, program.abstract_params, whole_params(params, frozen))
        return generation.generate_traced(
            model,
            tokens,
            lengths,
            key,
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            top_k=g.top_k or None,
            top_p=None if g.top_p >= 1.0 else g.top_p,
            eos_id=eos_id,
        )

    return jax.jit(sharding.with_rules(run, rules))


def _old_logps(program, cfg: Config, rules):
    spec = _Spec(cfg)

    def run(params, frozen, batch):
        model = models.merge(program.graphdef, program.abstract_params, whole_params(params, frozen))
        return grpo.policy_logps(model, batch, None, spec)[0]

    return jax.jit(sharding.with_rules(run, rules), out_shardings=program.batch_sharding)


def _whole(x: jax.Array) -> np.ndarray:
    """A batch-sharded array -> the whole batch on this host. `jax.device_get` refuses an
    array with rows on other processes' devices; process_allgather (a collective: every
    process calls it, in the same order) gathers them."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _gathered(local):
    """Numpy arrays of this process's rows (`RolloutFeeder._mine`) -> the whole batch's,
    concatenated in process order, on every process (TRL's gather of the local rewards)."""
    if jax.process_count() == 1:
        return local
    return tuple(np.asarray(a) for a in multihost_utils.process_allgather(tuple(local), tiled=True))


class RolloutFeeder:
    """The GRPO loop's batches (module docstring); `next(state)` -> (device batch, prompt batch)."""

    def __init__(self, cfg: Config, prompts: PromptIterator, mesh, program, rules, log, clock=None):
        if cfg.optimizer.offload_params:
            raise ValueError(
                "optimizer.offload_params with train.objective=grpo: the sampler reads the weights on "
                "the device; expected optimizer.offload_params=false"
            )
        self.cfg, self.prompts, self.program, self.log, self.clock = cfg, prompts, program, log, clock
        self.batch_sharding = program.batch_sharding
        self.rewards = load_rewards(cfg.grpo.rewards)
        self.decoder = tokenizers.Tokenizer.from_str(prompts.tokenizer.json_bytes.decode("utf-8"))
        self.eos_id = eos_id_for(cfg, prompts.tokenizer.eos_id)
        self.sample_fn = _sampler(program, cfg, self.eos_id, rules)
        self.logps_fn = _old_logps(program, cfg, rules)
        self.key = jax.random.fold_in(jax.random.key(cfg.seed), _SAMPLE_STREAM)
        self.held: tuple[int, dict, dict] | None = None  # (prompt batch k, device batch, metrics)
        self.metrics: dict[int, dict] = {}  # step -> the rollout's host metrics
        log(prompts.describe())
        log(
            f"grpo: {prompts.global_batch_size} prompts x {cfg.grpo.group_size} completions per rollout, "
            f"{cfg.grpo.updates_per_rollout} step(s) each; EOS id {self.eos_id}; the sampler runs on the "
            "training mesh (generation refuses mesh.stage > 1)"
        )

    # --- the loop's side ---------------------------------------------------------------------

    def next(self, state) -> tuple[dict, int]:
        step = int(jax.device_get(state.step))
        mu = self.cfg.grpo.updates_per_rollout
        k = step // mu
        if self.held is None or self.held[0] != k:
            if step % mu == 0:
                rows, metrics = self._sample(state, k, step + 1)
            else:  # resumed in the middle of a reused rollout: the one sampled then
                rows, metrics = self._reload(k)
            self.held = (k, self._place(rows), metrics)
        self.metrics[step + 1] = self.held[2]
        return self.held[1], k

    def data_state(self) -> dict:
        return {"source": "prompts", "batch": self.held[0] + 1 if self.held else 0}

    def seek(self, data_state: dict) -> None:
        """Nothing to do: the prompt batch follows from the step (`next`)."""

    def start(self, step: int) -> None:
        """A run starting at `step` (0, or the checkpoint's): rows of rollouts.jsonl sampled
        for later steps (by an attempt that got further than its checkpoint) are dropped, so
        the file holds each rollout once."""
        path = storage.as_path(self.cfg.under_output("rollouts.jsonl"))
        if jax.process_index() != 0 or not path.exists():
            return
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))

    def metrics_for(self, step: int) -> dict:
        """The host metrics of the rollout `step` trained on (those of earlier steps dropped)."""
        found = self.metrics.get(step, {})
        self.metrics = {s: m for s, m in self.metrics.items() if s > step}
        return found

    # --- one rollout ---------------------------------------------------------------------------

    def _phase(self, bucket: str = "sample"):
        return self.clock.phase(bucket) if self.clock is not None else contextlib.nullcontext()

    def _sample(self, state, k: int, first_step: int) -> tuple[dict, dict]:
        cfg, g = self.cfg, self.cfg.grpo
        prompts = [p for p in self.prompts.batch_at(k) for _ in range(g.group_size)]
        width = g.prompt_len(cfg.train.seq_len)
        tokens = np.zeros((len(prompts), width), np.int32)
        lengths = np.array([len(p.ids) for p in prompts], np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p.ids)] = p.ids
        # The update that made these weights was dispatched just before (the loop does not wait
        # for it): wait for it here, as the step's time, so that neither the `sample` bucket nor
        # grpo/sample_tokens_per_second holds the update's device time.
        with self._phase("steps"):
            jax.block_until_ready(state.params)
        with self._phase():
            t0 = time.perf_counter()
            out = self.sample_fn(
                state.params,
                state.frozen,
                jnp.asarray(tokens),
                jnp.asarray(lengths),
                jax.random.fold_in(self.key, k),
            )
            out = _whole(out)
            seconds = time.perf_counter() - t0
        completions, truncated = [], []
        for i, n in enumerate(lengths):
            new = out[i, n : n + g.max_new_tokens]
            ends = np.flatnonzero(new == self.eos_id)
            completions.append(new[: ends[0] + 1] if ends.size else new)
            truncated.append(not ends.size)
        rows = self._batch(prompts, completions)
        texts = [self.decoder.decode(c.tolist(), skip_special_tokens=True) for c in completions]
        fields = {
            key: [p.fields.get(key) for p in prompts]
            for key in sorted({f for p in prompts for f in p.fields})
        }
        mine = self._mine(len(prompts))  # each process scores its own rows; all get all the scores
        table, reward = _gathered(
            score(
                self.rewards,
                g.reward_weights,
                [p.text for p in prompts[mine]],
                texts[mine],
                [c.tolist() for c in completions[mine]],
                {key: values[mine] for key, values in fields.items()},
            )
        )
        adv = grpo.advantages(reward, g.group_size, g.scale_rewards)
        weight, share = grpo.loss_weights(
            rows["loss_mask"], g.loss_type, g.max_new_tokens, cfg.train.microbatches
        )
        rows.update(
            advantages=np.repeat(adv[:, None], cfg.train.seq_len, axis=1),
            loss_weight=weight,
            token_share=share,
        )
        with self._phase():
            partial = {k_: v for k_, v in rows.items() if k_ != "old_logps"}
            logps = self.logps_fn(state.params, state.frozen, self._place(partial))
            rows["old_logps"] = _whole(logps) * rows["loss_mask"]
        generated = int(sum(len(c) for c in completions))
        metrics = {
            "grpo/reward": float(reward.mean()),
            "grpo/reward_std": grpo.reward_std(reward),
            "grpo/completion_length": generated / len(completions),
            "grpo/sample_tokens_per_second": generated / max(seconds, 1e-9),
        }
        if jax.process_index() == 0:
            self._record(
                k, first_step, prompts, completions, texts, table, reward, adv, rows, truncated, metrics
            )
        return rows, metrics

    def _batch(self, prompts, completions) -> dict:
        """The LM fields of prompt + completion rows, loss_mask 1 on the completion tokens."""
        seq = self.cfg.train.seq_len
        tokens = np.zeros((len(prompts), seq + 1), np.int64)
        docs = np.zeros_like(tokens, dtype=np.int32)
        mask = np.zeros_like(tokens, dtype=np.int32)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            n, m = len(p.ids), len(c)
            tokens[i, :n], tokens[i, n : n + m] = p.ids, c
            docs[i, : n + m] = 1
            mask[i, n : n + m] = 1
        return batch_from_windows(tokens, docs, mask)

    @staticmethod
    def _mine(n: int) -> slice:
        """This process's rows of a global batch of `n` (the data loaders' split, which
        batch_to_device assumes: process i holds the i-th of process_count equal parts)."""
        i, p = jax.process_index(), jax.process_count()
        return slice(i * n // p, (i + 1) * n // p)

    def _place(self, rows: dict) -> dict:
        """The global rows -> the device batch (each process places its own rows)."""
        mine = self._mine(len(rows["inputs"]))
        return batch_to_device({k: v[mine] for k, v in rows.items()}, self.batch_sharding)

    def _npz(self, k: int) -> str:
        return storage.join(self.cfg.under_output("rollouts"), f"{k}.npz")

    def _record(
        self, k, first_step, prompts, completions, texts, table, reward, adv, rows, truncated, metrics
    ):
        if self.cfg.grpo.updates_per_rollout > 1:  # kept for a resume inside the rollout
            buf = io.BytesIO()
            np.savez(buf, metrics=json.dumps(metrics), **rows)
            storage.make_dirs(self.cfg.under_output("rollouts"))
            storage.write_atomic(self._npz(k), buf.getvalue())
            # A checkpoint is at most checkpoint.every steps old when the next one is written:
            # the rollouts it may still need are the last every / mu + 1; older ones go.
            mu = self.cfg.grpo.updates_per_rollout
            stale = self._npz(k - 2 - self.cfg.checkpoint.every // mu)
            if storage.exists(stale):
                storage.remove(stale)
        names = [name for name, _ in self.rewards]
        lines = []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            at = rows["loss_mask"][i] > 0
            lines.append(
                json.dumps(
                    {
                        "step": first_step,
                        "prompt_index": p.index,
                        "prompt_ids": p.ids.tolist(),
                        "completion_ids": c.tolist(),
                        "completion": texts[i],
                        "rewards": {n: (None if np.isnan(v) else float(v)) for n, v in zip(names, table[i])},
                        "reward": float(reward[i]),
                        "advantage": float(adv[i]),
                        "old_logprobs": rows["old_logps"][i][at].tolist(),
                        "truncated": bool(truncated[i]),
                    }
                )
            )
        path = self.cfg.under_output("rollouts.jsonl")
        with storage.as_path(path).open("a") as f:
            f.write("\n".join(lines) + "\n")

    def _reload(self, k: int) -> tuple[dict, dict]:
        path = self._npz(k)
        if not storage.exists(path):
            raise FileNotFoundError(
                f"{path}: the rollout in use at this checkpoint is missing; a run resumed inside a "
                "reused rollout (grpo.updates_per_rollout > 1) takes it from there"
            )
        with np.load(io.BytesIO(storage.read_bytes(path))) as z:
            rows = {key: z[key] for key in z.files if key != "metrics"}
            metrics = json.loads(str(z["metrics"]))
        self.log(f"grpo: rollout {k} (in use at the checkpoint) read back from {path}")
        return rows, metrics

"""lm-evaluation-harness on a jaxtrain model: `JaxtrainLM`, an `lm_eval.api.model.LM`
(lm-eval 0.4.13) that answers every request type as lm-eval's own `hf` backend (HFLM) does.

Built from any SOURCE `jaxtrain generate` takes (a run config and its newest checkpoint, a
training or converted checkpoint, a Hugging Face directory; interchange/generate.py), on the
source's mesh (context and stage axes refused, as for generation). The context is
`max_length` positions: the argument, else the run's train.seq_len or an HF directory's
max_position_embeddings, else 2048 (HFLM's default).

Text in and out, as HFLM with the same tokenizer.json: strings are encoded with the
tokenizer's post-processor (an HF model's BOS) unless they already start with the BOS text
(a chat-templated prompt); a loglikelihood pair is encoded whole and split where the
context's own encoding ends (trailing spaces of the context moved to the continuation), an
empty context becomes the prefix token (BOS, else EOS); generations are decoded on their
own, special tokens skipped.

- `loglikelihood`: each (context, continuation) is cut on the left to max_length + 1 tokens
  and scored in one forward pass: the sum of the continuation's log-softmax (f32) and
  whether every continuation token is the argmax (is_greedy).
- `loglikelihood_rolling`: the document's tokens in lm-eval's disjoint rolling windows
  (`get_rolling_token_windows` + `make_disjoint_window`, the prefix token first), each
  scored as a loglikelihood request; the windows' sum.
- `generate_until`: greedy, or sampled with `do_sample` (temperature, top_k (50 when unset,
  as transformers), top_p), up to `max_gen_toks` tokens after the context cut on the left to
  max_length - max_gen_toks; stopped at EOS or once an `until` string appears, the text cut
  at the first one. One jitted prefill and one decode step program per shape
  (models.generation.stream), driven from Python so that a batch stops when all its rows
  have. Sampled text depends on the seed and on the batch (one key draws for all rows);
  greedy text on neither.

Batches: requests are sorted longest first (as HFLM) and taken `batch_size` rows at a time
(`auto`: as many rows of the batch's length as hold about 16k tokens), rows padded to a
multiple of the mesh's batch shards and right-padded to a power-of-two length (at least 16,
at most the context), so that few programs serve all requests. Causal attention keeps every
real position blind to the padding after it: padding changes no answer.

`JaxtrainLM.from_model` wraps a model already on its mesh (trainer/evaluate.py's
`TaskEvaluator`: `eval.tasks` on the training weights); `run` is `jaxtrain eval` (lm-eval's
`simple_evaluate` and its EvaluationTracker files); `task_metrics` names lm-eval's results
as the metrics log does (`eval_<task>/<metric>`).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from jaxtrain import sharding
from jaxtrain.interchange import generate as gen
from jaxtrain.models.generation import stream
from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh

DEFAULT_MAX_LENGTH = 2048  # HFLM's, for a source that names no context
MIN_BUCKET = 16  # the shortest padded length
AUTO_TOKENS = 16384  # batch_size=auto: rows x padded length per batch
HF_TOP_K = 50  # transformers' GenerationConfig default, applied when sampling without top_k
SAMPLING_KEYS = {"do_sample", "temperature", "top_k", "top_p"}


class EvaluateError(gen.GenerateError):
    """A bad option or request for `JaxtrainLM` / `jaxtrain eval` (exit 2)."""


def bucket(n: int, cap: int) -> int:
    """The padded length for n positions: the next power of two >= max(n, MIN_BUCKET), at most cap."""
    return max(n, min(cap, max(MIN_BUCKET, 1 << (n - 1).bit_length())))


def _special_token(tokenizer_path: str | None, key: str) -> str | None:
    """`key` (bos_token, eos_token) of the tokenizer_config.json beside a tokenizer.json."""
    if tokenizer_path is None or tokenizer_path == "byte":
        return None
    config = Path(tokenizer_path).parent / "tokenizer_config.json"
    try:
        value = json.loads(config.read_text()).get(key)
    except (OSError, ValueError):
        return None
    return value.get("content") if isinstance(value, dict) else value


@functools.partial(jax.jit, static_argnames=("graphdef", "rules"))
def _token_scores(graphdef, state, tokens, targets, *, rules):
    """Right-padded rows int32 [b, L] and the next token at each position [b, L] ->
    (log p(next) f32 [b, L], whether next is the argmax [b, L])."""
    with sharding.axis_rules(rules):
        logits = nnx.merge(graphdef, state)(tokens).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logits, axis=-1) == targets


def parse_batch_size(value: int | str) -> int | str:
    """A positive number of requests per batch, or 'auto' (as lm-eval's --batch_size)."""
    if value == "auto":
        return value
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if isinstance(value, bool) or n < 1 or str(n) != str(value).strip():
        raise EvaluateError(f"batch_size={value!r}: expected a positive integer or 'auto'")
    return n


class JaxtrainLM(TemplateLM):
    """lm-eval's LM interface over a jaxtrain model (module docstring).

    `JaxtrainLM(source, overrides)` loads SOURCE as `jaxtrain generate` does; `from_model`
    wraps a model already on its mesh (training weights)."""

    def __init__(
        self,
        source: str | os.PathLike,
        overrides: Sequence[str] = (),
        *,
        batch_size: int | str = 1,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        tokenizer: str | None = None,
        seed: int = 1234,
        devices=None,
    ):
        super().__init__()
        src = gen.open_source(str(source), list(overrides), tokenizer=tokenizer)
        try:
            if src.tokenizer is None:
                raise EvaluateError(
                    f"{src.path}: no tokenizer.json there; pass tokenizer='byte' or a tokenizer.json"
                )
            tok = gen.Tokenizer(
                src.tokenizer, vocab_size=src.cfg.model.vocab_size, special_tokens=src.special_tokens
            )
            mesh = gen.make_mesh(src.cfg, devices)
            cfg = resolve_for_mesh(src.cfg, mesh)
            rules = axis_rules(cfg)
            with jax.set_mesh(mesh), sharding.axis_rules(rules):
                model = gen.load_model(src, mesh, cfg)
        finally:
            src.close()
        eos = src.eos_id if src.eos_id is not None and src.eos_id < cfg.model.vocab_size else tok.eos_id
        self._setup(
            model,
            tok,
            mesh=mesh,
            rules=rules,
            name=str(source),
            max_length=max_length if max_length is not None else src.max_len or DEFAULT_MAX_LENGTH,
            eos_id=eos,
            batch_size=batch_size,
            max_gen_toks=max_gen_toks,
            seed=seed,
        )

    @classmethod
    def from_model(
        cls,
        model,
        tokenizer: gen.Tokenizer,
        *,
        mesh,
        rules,
        max_length: int,
        name: str = "jaxtrain",
        eos_id: int | None = None,
        batch_size: int | str = 1,
        max_gen_toks: int = 256,
        seed: int = 1234,
    ) -> JaxtrainLM:
        """An LM over `model` as it is, on `mesh` with `rules` (e.g. the training weights)."""
        lm = cls.__new__(cls)
        TemplateLM.__init__(lm)
        lm._setup(
            model,
            tokenizer,
            mesh=mesh,
            rules=rules,
            name=name,
            max_length=max_length,
            eos_id=tokenizer.eos_id if eos_id is None else eos_id,
            batch_size=batch_size,
            max_gen_toks=max_gen_toks,
            seed=seed,
        )
        return lm

    def _setup(self, model, tok, *, mesh, rules, name, max_length, eos_id, batch_size, max_gen_toks, seed):
        batch_size = parse_batch_size(batch_size)
        if int(max_length) < 2:
            raise EvaluateError(f"max_length={max_length}: expected at least 2 positions")
        if int(max_gen_toks) < 1:
            raise EvaluateError(f"max_gen_toks={max_gen_toks}: expected a positive integer")
        self._model, self._tok, self._mesh, self._rules = model, tok, mesh, rules
        self._graphdef, self._state = nnx.split(model)
        self._name, self._max_length, self._max_gen_toks = name, int(max_length), int(max_gen_toks)
        self.batch_size, self._seed, self._gen_eos = batch_size, int(seed), int(eos_id)
        spec = sharding.logical_to_spec(("batch",), rules, mesh)
        axes = sharding.axes_tuple(spec[0]) if len(spec) else ()
        self._row_multiple = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        path = None if tok.spec == "byte" else tok.spec
        eos_text, bos_text = _special_token(path, "eos_token"), _special_token(path, "bos_token")
        eot = tok.token_id(eos_text) if eos_text else None
        self._eot = tok.eos_id if eot is None else eot
        self._bos = tok.token_id(bos_text) if bos_text else None
        self._bos_text = tok.decode([self.prefix_token_id], skip_special_tokens=False)
        self._chat = None

    # --- what lm-eval asks of an LM -------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        return self._bos if self._bos is not None else self._eot

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self._name.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kw):
        if add_special_tokens is None and self._bos_text and string.startswith(self._bos_text):
            add_special_tokens = False  # already there (a chat template wrote it)
        ids = self._tok.encode(string, special_tokens=add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _rows(self, length: int) -> int:
        """Rows per batch for padded length `length`, a multiple of the batch shards."""
        n = max(1, AUTO_TOKENS // length) if self.batch_size == "auto" else self.batch_size
        return -(-n // self._row_multiple) * self._row_multiple

    def _call(self, fn, *args, **kw):
        with jax.set_mesh(self._mesh), sharding.axis_rules(self._rules):
            return fn(*args, **kw)

    # --- loglikelihood ---------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw) -> list[tuple[float, bool]]:
        """((context, continuation) | None, context ids, continuation ids) each -> (sum of the
        continuation's log-probs, is_greedy), the input cut on the left as HFLM's."""
        windows, cont_lens = [], []
        for _, ctx, cont in requests:
            if not ctx or not cont:
                raise EvaluateError(
                    f"a loglikelihood request with {len(ctx)} context and {len(cont)} continuation tokens"
                )
            if len(cont) > self.max_length:
                raise EvaluateError(
                    f"a continuation of {len(cont)} tokens does not fit the model's "
                    f"{self.max_length}-position context"
                )
            windows.append((ctx + cont)[-(self.max_length + 1) :])
            cont_lens.append(len(cont))
        order = sorted(range(len(windows)), key=lambda i: (-len(windows[i]), windows[i]))
        out: list[tuple[float, bool] | None] = [None] * len(windows)
        bar = tqdm(total=len(windows), disable=disable_tqdm, desc="Running loglikelihood requests")
        start = 0
        while start < len(order):
            length = bucket(len(windows[order[start]]) - 1, self.max_length)
            rows = self._rows(length)
            batch = order[start : start + rows]
            tokens, targets = np.zeros((2, rows, length), np.int32)
            for r, i in enumerate(batch):
                w = windows[i]
                tokens[r, : len(w) - 1], targets[r, : len(w) - 1] = w[:-1], w[1:]
            picked, greedy = jax.device_get(
                self._call(_token_scores, self._graphdef, self._state, tokens, targets, rules=self._rules)
            )
            for r, i in enumerate(batch):
                end = len(windows[i]) - 1
                span = slice(end - cont_lens[i], end)
                out[i] = (float(np.sum(picked[r, span], dtype=np.float64)), bool(greedy[r, span].all()))
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
            bar.update(len(batch))
            start += len(batch)
        bar.close()
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            pairs = get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for ctx, cont in map(make_disjoint_window, pairs):
                windows.append((None, ctx, cont))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, scores):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --- generate_until ---------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        args = [req.args for req in requests]
        groups: dict[str, list[int]] = {}
        for i, (_, gen_kwargs) in enumerate(args):
            groups.setdefault(json.dumps(gen_kwargs, sort_keys=True, default=str), []).append(i)
        out: list[str | None] = [None] * len(args)
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        plans = []  # every group's options checked before any generates
        for members in groups.values():
            kwargs = dict(normalize_gen_kwargs(args[members[0]][1], self.max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_gen = int(kwargs.pop("max_gen_toks"))
            if max_gen >= self.max_length:
                raise EvaluateError(
                    f"max_gen_toks={max_gen} leaves no room for a context in the model's "
                    f"{self.max_length}-position context"
                )
            plans.append((members, until, max_gen, self._sampling(kwargs)))
        bar = tqdm(total=len(args), disable=disable_tqdm, desc="Running generate_until requests")
        batches = 0
        for members, until, max_gen, sampling in plans:
            room = self.max_length - max_gen
            prompts = {i: self.tok_encode(args[i][0])[-room:] or [self.prefix_token_id] for i in members}
            order = sorted(members, key=lambda i: -len(prompts[i]))
            start = 0
            while start < len(order):
                length = bucket(len(prompts[order[start]]), room)
                rows = self._rows(length + max_gen)  # positions the KV cache holds per row
                batch = order[start : start + rows]
                seed = self._seed + batches if sampling["temperature"] > 0 else 0
                texts = self._generate(
                    [prompts[i] for i in batch], rows, length, max_gen, until, sampling, seed
                )
                for i, text in zip(batch, texts):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", args[i], text)
                bar.update(len(batch))
                start += len(batch)
                batches += 1
        bar.close()
        return out

    def _sampling(self, kwargs: dict) -> dict:
        """lm-eval's normalized generation kwargs -> `stream`'s sampling arguments."""
        unknown = set(kwargs) - SAMPLING_KEYS
        if unknown:
            raise EvaluateError(
                f"generation_kwargs {sorted(unknown)}: not supported (expected until, max_gen_toks, "
                "do_sample, temperature, top_k, top_p)"
            )
        temperature = float(kwargs.get("temperature") or 0.0)
        if not kwargs.get("do_sample"):
            return dict(temperature=0.0, top_k=None, top_p=None)
        temperature = 1.0 if kwargs.get("temperature") is None else temperature
        top_k = kwargs.get("top_k", HF_TOP_K)
        top_k = None if top_k in (None, 0) else min(int(top_k), self._model.cfg.vocab_size)
        top_p = kwargs.get("top_p")
        top_p = None if top_p is None or float(top_p) >= 1.0 else float(top_p)
        return dict(temperature=temperature, top_k=top_k, top_p=top_p)

    def _generate(self, prompts, rows, length, max_gen, until, sampling, seed) -> list[str]:
        """Continue the prompts (each at most `length` ids; padded to `rows` rows) by up to
        max_gen tokens -> their text, cut at the first `until` string."""
        tokens = np.zeros((rows, length), np.int32)
        lengths = np.ones((rows,), np.int32)
        for r, ids in enumerate(prompts):
            tokens[r, : len(ids)], lengths[r] = ids, len(ids)
        new: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        stops = [s for s in until if s]
        with jax.set_mesh(self._mesh), sharding.axis_rules(self._rules):
            steps = stream(
                self._model,
                tokens,
                max_new_tokens=max_gen,
                prompt_lengths=lengths,
                eos_id=self._gen_eos,
                seed=seed,
                **sampling,
            )
            for step in steps:
                for r in range(len(prompts)):
                    if done[r]:
                        continue
                    if int(step[r]) == self._gen_eos:
                        done[r] = True
                        continue
                    new[r].append(int(step[r]))
                    # a character still split over tokens ends in U+FFFD: only text before it is final
                    text = self.tok_decode(new[r]).rstrip("\ufffd")
                    done[r] = any(s in text for s in stops)
                if all(done):
                    break
        return [postprocess_generated_text(self.tok_decode(ids), until, None) for ids in new]

    # --- chat templates ----------------------------------------------------------------------

    def _chat_template(self):
        if self._chat is None:
            from jaxtrain.data.chat import compile_template, read_chat_config

            if self._tok.spec == "byte":
                raise EvaluateError("the byte tokenizer has no chat template")
            source, variables, _ = read_chat_config(str(Path(self._tok.spec).parent))
            self._chat = (source, compile_template(source), variables)
        return self._chat

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        return self._chat_template()[0]

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The conversation rendered with the tokenizer's chat template, as HFLM's
        `tokenizer.apply_chat_template(..., continue_final_message=not add_generation_prompt)`:
        without the generation prompt, the text ends where the final message's content does."""
        from jaxtrain.data.chat import _messages, render

        _, template, variables = self._chat_template()
        messages = _messages(chat_history)
        tag = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of the final message's end
        if not add_generation_prompt:
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + tag}
        text, _ = render(template, messages, variables, add_generation_prompt=add_generation_prompt)
        if not add_generation_prompt:
            at = text.rindex(tag.strip())
            text = text[:at] if text[at : at + len(tag)] == tag else text[:at].rstrip()
        return text


# --- `jaxtrain eval` ------------------------------------------------------------------------


def parse_limit(text: str | None) -> int | float | None:
    """--limit as lm-eval takes it: a count of documents per task, or a fraction (< 1) of them."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value > 0 and (value < 1 or value == int(value))):
        raise EvaluateError(f"--limit={text}: expected a positive count or a fraction in (0, 1)")
    return value if value < 1 else int(value)


def run(
    source: str,
    overrides: Sequence[str] = (),
    *,
    tasks: Sequence[str],
    include_path: str | None = None,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    batch_size: int | str = 1,
    apply_chat_template: bool = False,
    output_path: str | None = None,
    log_samples: bool = False,
    max_length: int | None = None,
    tokenizer: str | None = None,
    seed: int = 1234,
    log=lambda line: None,
) -> dict:
    """lm-eval's `simple_evaluate` with a `JaxtrainLM` of SOURCE: lm-eval's results dict.
    With `output_path`, lm-eval's EvaluationTracker writes its own files under
    `<output_path>/<model name>/` (results_<date>.json; with `log_samples` also
    samples_<task>_<date>.jsonl), the model name sanitized from SOURCE as lm-eval sanitizes
    `pretrained=`."""
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise EvaluateError("--tasks: expected one or more comma-separated task names")
    batch_size = parse_batch_size(batch_size)
    if log_samples and not output_path:
        raise EvaluateError("--log-samples: needs --output-path (where lm-eval writes the samples)")
    if num_fewshot is not None and num_fewshot < 0:
        raise EvaluateError(f"--num-fewshot={num_fewshot}: expected an integer >= 0")
    if include_path is not None and not Path(include_path).is_dir():
        raise EvaluateError(f"--include-path={include_path}: no such directory")
    src = gen.open_source(str(source), list(overrides), tokenizer=tokenizer)  # reads no weights
    try:
        gen.make_mesh(src.cfg)  # context and stage axes, device count: refused before any task loads
    finally:
        src.close()
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or under {include_path}" if include_path else " (pass --include-path for local tasks)"
        raise EvaluateError(f"--tasks: unknown task(s) {', '.join(unknown)}: not lm-eval's{where}")
    lm = JaxtrainLM(
        source, overrides, batch_size=batch_size, max_length=max_length, tokenizer=tokenizer, seed=seed
    )
    shape = {a: s for a, s in lm._mesh.shape.items() if s > 1} or "one device"
    log(
        f"evaluating {source} on {', '.join(tasks)}: mesh {shape}, context {lm.max_length}, "
        f"batch_size {batch_size}"
    )
    tracker = EvaluationTracker(output_path=output_path) if output_path else None
    results = simple_evaluate(
        model=lm,
        model_args={"pretrained": str(source)},
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        batch_size=batch_size,
        log_samples=log_samples,
        evaluation_tracker=tracker,
        apply_chat_template=apply_chat_template,
        task_manager=manager,
        random_seed=0,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    if tracker is not None:
        samples = results.pop("samples", None) if log_samples else None
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results["configs"] if log_samples else ():
            tracker.save_results_samples(task_name=task, samples=samples[task])
        if samples is not None:
            results["samples"] = samples
    return results


def task_metrics(results: dict) -> dict[str, float]:
    """lm-eval's results -> {`eval_<task>/<metric>`: value}: every numeric metric of every task
    (no standard errors), lm-eval's filter appended when it is not `none`
    (`eval_gsm8k/exact_match_strict-match`)."""
    out = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            if "," not in key or "_stderr," in key or isinstance(value, bool):
                continue
            if not isinstance(value, (int, float, np.number)):
                continue
            metric, filt = key.split(",", 1)
            out[f"eval_{task}/{metric if filt == 'none' else f'{metric}_{filt}'}"] = float(value)
    return out

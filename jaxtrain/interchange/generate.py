"""`jaxtrain generate SOURCE --prompt TEXT [overrides]`: sample text from a model, streamed.

SOURCE is, the first that applies:
  a YAML run config       the newest complete checkpoint in its checkpoint.dir, with the
                          config's model, mesh and tokenizer. No checkpoint there: exit 2,
                          unless --random-init (the config's seeded initialisation: a smoke
                          test of the decode path, never a silent fallback)
  a Hugging Face dir      config.json + *.safetensors (Llama, Mistral, Mixtral); tokenizer.json
  a converted checkpoint  model.yaml + params/ (`jaxtrain convert hf-to-ckpt`); tokenizer.json
  a training checkpoint   a step directory, a checkpoint.dir or a run's output_dir
                          (interchange/convert.py `resolve_checkpoint`): the newest complete step and the
                          config the run saved with it
Dotted overrides (`mesh.tensor=2`, `model.compute_dtype=bfloat16`) change that config, as
for `train`; architecture keys must still match the weights.

Tokenizer: --tokenizer (byte | a tokenizers JSON file), else the run's (data.tokenizer; for
data.source=tokens the first token directory's), else tokenizer.json in an HF or converted
directory. Prompts are encoded as the model was trained: jaxtrain runs without special
tokens (as their documents were tokenized), HF and converted weights with the tokenizer's
own post-processor (e.g. Llama's BOS), as transformers does.

Decoding runs on the config's mesh in this process (on a CPU host the CLI simulates the
devices it needs; a mesh smaller than the host uses its first devices, -1 fills them all):
`models.generation.stream`, i.e. a jitted prefill, then one jitted decode step per token
driven from Python. Each token's text goes to stdout as soon as it is sampled; the tokens
are those `models.generate` returns for the same seed. Generation stops at EOS (the
tokenizer's; an HF directory's config.json eos_token_id), after --max-new-tokens, or at
the end of the context: --max-len positions, prompt included (default: train.seq_len of
a run, max_position_embeddings of an HF directory, no limit for a converted checkpoint).
Ids with no text in the tokenizer (a model vocab padded past it) print nothing.

Bad input (unknown SOURCE, no checkpoint, an empty prompt, a prompt that leaves no room
in the context, a tokenizer with more ids than the model's vocab, a mesh the devices
cannot hold, a bad option) raises GenerateError or the config/data/conversion error that
names it: the CLI's one line and exit 2.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import tokenizers
import yaml
from flax import nnx

from jaxtrain import models, sharding
from jaxtrain.config import (
    Config,
    ConfigError,
    _build,
    _set_dotted,
    load_config,
    parse_override,
    to_dict,
    validate,
)
from jaxtrain.data import DataError, load_tokenizer
from jaxtrain.interchange.convert import (
    _has_step_dirs,
    architecture_of,
    load_params,
    read_model_config,
    resolve_checkpoint,
)
from jaxtrain.models import lora
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.generation import stream
from jaxtrain.models.hf import HFConversionError, config_from_hf, load_hf_params, read_hf_config
from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh


class GenerateError(ValueError):
    """A bad SOURCE, prompt, tokenizer or option for `jaxtrain generate` (exit 2)."""


SOURCES = (
    "expected a run config (YAML), a Hugging Face directory (config.json), a converted "
    "checkpoint (model.yaml + params/), a training checkpoint step directory, a "
    "checkpoint.dir or a run's output_dir"
)


@dataclasses.dataclass
class Source:
    """Where the weights, config and tokenizer come from (`open_source`)."""

    kind: str  # "config" | "hf" | "converted" | "checkpoint"
    path: Path
    cfg: Config
    checkpoint: Any = None  # convert.CheckpointSource (config with a checkpoint, converted, checkpoint)
    tokenizer: str | None = None  # "byte" or a tokenizers JSON path; None: none known
    max_len: int | None = None  # the context the model was trained for, where known
    special_tokens: bool = False  # encode with the tokenizer's post-processor (BOS, ...)
    eos_id: int | None = None  # the model's own EOS (HF config.json); None: the tokenizer's
    random_init: bool = False

    def describe(self) -> str:
        if self.random_init:
            return f"{self.path} (random initialisation, seed {self.cfg.seed})"
        if self.kind == "hf":
            return f"{self.path} (Hugging Face)"
        if self.checkpoint is not None and self.checkpoint.step is not None:
            return f"checkpoint {self.checkpoint} (step {self.checkpoint.step})"
        return f"{self.path} (converted checkpoint)"

    def close(self) -> None:
        if self.checkpoint is not None:
            self.checkpoint.close()


# --- before any backend: how many devices the mesh asks for -------------------------


def plan_devices(source: str, overrides: list[str] | tuple[str, ...] = ()) -> int | None:
    """The devices SOURCE's mesh (with overrides) needs, read without starting a backend
    (the CLI simulates that many CPU devices); None when unknown or -1 fills the host.
    Errors are left for `open_source` to report."""
    try:
        p = Path(source)
        if p.is_file():
            return load_config(p, overrides).mesh_size or None
        data: dict = {}
        if not ((p / "config.json").is_file() or (p / "model.yaml").is_file()):
            data = _saved_config_peek(p) or {}
        data = {"mesh": dict(data.get("mesh") or {})}
        for text in overrides:
            key, value = parse_override(text)
            if key.startswith("mesh."):
                _set_dotted(data, key, value)
        return _build(Config, data).mesh_size or None
    except Exception as e:  # noqa: BLE001 - a guess only; open_source names what is wrong
        logging.getLogger("jaxtrain.generate").debug("no device count from %s (%s)", source, e)
        return None


def _saved_config_peek(p: Path) -> dict | None:
    """The config a training run saved, from the files alone: a step directory's meta item,
    the newest step's in a checkpoint.dir, or an output_dir's config.yaml."""
    if (p / "meta" / "metadata").is_file():
        return json.loads((p / "meta" / "metadata").read_text()).get("config")
    steps = sorted((int(c.name) for c in p.iterdir() if c.name.isdigit() and c.is_dir()), reverse=True)
    for step in steps:
        meta = p / str(step) / "meta" / "metadata"
        if meta.is_file():
            return json.loads(meta.read_text()).get("config")
    if (p / "config.yaml").is_file():
        return yaml.safe_load((p / "config.yaml").read_text())
    return None


# --- the source ---------------------------------------------------------------------


def open_source(
    source: str,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    tokenizer: str | None = None,
    random_init: bool = False,
) -> Source:
    """Resolve SOURCE (module docstring) into its config, weights and tokenizer (`tokenizer`
    replaces the source's); reads no weights. Raises GenerateError, ConfigError or
    HFConversionError naming what is wrong. Close the Source after use."""
    src = _open_source(source, overrides, random_init)
    if tokenizer is not None:
        src.tokenizer = tokenizer
    return src


def _open_source(source: str, overrides, random_init: bool) -> Source:
    p = Path(source)
    if p.is_file():
        return _run_config_source(p, overrides, random_init)
    if random_init:
        raise GenerateError(f"--random-init: only for a run config (YAML) SOURCE, got {source}")
    if not p.is_dir():
        raise GenerateError(f"{source}: no such file or directory; {SOURCES}")
    if (p / "config.json").is_file() and not (p / "model.yaml").is_file():
        hf = read_hf_config(p)
        cfg = _config_around(config_from_hf(hf), overrides, f"{p} (config.json)")
        eos = hf.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        return Source(
            "hf",
            p,
            cfg,
            tokenizer=_beside(p),
            max_len=hf.get("max_position_embeddings"),
            special_tokens=True,
            eos_id=eos if isinstance(eos, int) else None,
        )
    try:
        ckpt = resolve_checkpoint(p)
    except HFConversionError:
        raise GenerateError(f"{source}: not a model source; {SOURCES}") from None
    if ckpt.step is None:
        cfg = _config_around(read_model_config(p), overrides, f"{p}/model.yaml")
        return Source("converted", p, cfg, checkpoint=ckpt, tokenizer=_beside(p), special_tokens=True)
    return _training_checkpoint_source(p, ckpt, overrides)


def _run_config_source(p: Path, overrides, random_init: bool) -> Source:
    """A run config: its newest complete checkpoint (or its random init, asked for)."""
    cfg = load_config(p, overrides)
    ckpt_dir = Path(cfg.checkpoint_dir)
    src = Source("config", p, cfg, tokenizer=_run_tokenizer(cfg), max_len=cfg.train.seq_len)
    if random_init:
        src.random_init = True
        return src
    try:
        src.checkpoint = resolve_checkpoint(ckpt_dir) if _has_step_dirs(ckpt_dir) else None
    except HFConversionError:
        src.checkpoint = None
    if src.checkpoint is None:
        raise GenerateError(
            f"{p}: no complete checkpoint in {ckpt_dir} (its checkpoint.dir) to generate from; "
            "train it with checkpoint.every > 0 first, or pass --random-init to sample from "
            "the config's random initialisation"
        )
    return src


def _training_checkpoint_source(p: Path, ckpt, overrides) -> Source:
    """A training checkpoint: the config the run saved with the step, overrides applied."""
    try:
        saved = ckpt.reader.read_meta(ckpt.step)["config"]
    except Exception as e:  # a missing or unreadable meta item surfaces as many types
        ckpt.close()
        raise GenerateError(f"checkpoint {ckpt}: its saved config is unreadable ({type(e).__name__})") from e
    try:
        for text in overrides:
            _set_dotted(saved, *parse_override(text))
        cfg = _build(Config, saved)
        validate(cfg)
    except ConfigError:
        ckpt.close()
        raise
    return Source(
        "checkpoint", p, cfg, checkpoint=ckpt, tokenizer=_run_tokenizer(cfg), max_len=cfg.train.seq_len
    )


def _config_around(model: ModelConfig, overrides, where: str) -> Config:
    """A default Config around the weights' model, overrides applied; architecture keys
    may not change (the weights fix them)."""
    data = {"model": to_dict(model)}
    for text in overrides:
        _set_dotted(data, *parse_override(text))
    cfg = _build(Config, data)
    validate(cfg)
    have, want = architecture_of(model), architecture_of(cfg.model)
    for key in have:
        if have[key] != want[key]:
            raise GenerateError(
                f"model.{key}={want[key]!r}: {where} has {have[key]!r} "
                "(architecture keys are fixed by the weights)"
            )
    return cfg


def _beside(p: Path) -> str | None:
    return str(p / "tokenizer.json") if (p / "tokenizer.json").is_file() else None


def _run_tokenizer(cfg: Config) -> str:
    """What a training run tokenized with: data.tokenizer, or (tokens) its first directory's."""
    d = cfg.data
    if d.source != "tokens" or not d.paths:
        return d.tokenizer
    directory = Path(d.paths[0])
    try:
        name = json.loads((directory / "manifest.json").read_text())["tokenizer"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        raise GenerateError(
            f"data.paths[0]={d.paths[0]!r}: no readable manifest.json to take the tokenizer from; "
            "pass --tokenizer"
        ) from None
    return "byte" if name == "byte" else str(directory / "tokenizer.json")


# --- text in and out -----------------------------------------------------------------


class Tokenizer:
    """The prompt's ids, and the text of new ids, for `byte` or a tokenizers JSON file."""

    def __init__(self, spec: str, *, vocab_size: int, special_tokens: bool = False):
        if spec == "byte":
            n = 257  # bytes + EOS
        else:
            try:
                tok = load_tokenizer(spec, vocab_size=vocab_size)
            except DataError as e:
                raise GenerateError(str(e).replace("data.tokenizer=", "tokenizer ")) from None
            n = tok.vocab_size
        if n > vocab_size:
            raise GenerateError(
                f"vocab mismatch: tokenizer {spec!r} has {n} ids but the model's vocab_size is "
                f"{vocab_size}; pass the model's own tokenizer (--tokenizer)"
            )
        self.spec, self.vocab_size, self.special_tokens = spec, n, special_tokens
        if spec == "byte":
            self._hf, self.eos_id = None, 256
        else:
            self._hf = tokenizers.Tokenizer.from_str(tok.json_bytes.decode("utf-8"))
            self.eos_id = tok.eos_id

    def encode(self, text: str, *, special_tokens: bool | None = None) -> list[int]:
        """`special_tokens`: apply the tokenizer's post-processor (BOS, ...); None: as the
        source's prompts are encoded."""
        if self._hf is None:
            return list(text.encode("utf-8"))
        add = self.special_tokens if special_tokens is None else special_tokens
        return list(self._hf.encode(text, add_special_tokens=add).ids)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        if self._hf is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str) -> int | None:
        """The id of a token's text (a special token such as '<s>'), or None."""
        return None if self._hf is None else self._hf.token_to_id(text)

    def continuation(self, prompt: list[int], new: list[int]) -> str:
        """The text `new` adds after `prompt` (decoded together: word-initial spaces and
        multi-token characters come out right)."""
        base, full = self.decode(prompt), self.decode(prompt + new)
        return full[len(base) :] if full.startswith(base) else self.decode(new)

    def detokenizer(self, prompt: list[int]) -> Callable[[int | None], str]:
        """A function of each new id (None: the end) -> the text to print now; what it
        returns, joined, is `continuation(prompt, new ids)`."""
        if self._hf is None:
            utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            return lambda i: (
                utf8.decode(b"", final=True) if i is None else utf8.decode(bytes([i]) if i < 256 else b"")
            )
        new: list[int] = []
        printed = [""]

        def push(i: int | None) -> str:
            if i is not None:
                new.append(i)
            text = self.continuation(prompt, new)
            if i is not None and text.endswith("\ufffd"):
                return ""  # a character split over tokens: wait for the rest
            if not text.startswith(printed[0]):
                return ""  # decoding revised earlier text (rare): nothing more to add safely
            piece, printed[0] = text[len(printed[0]) :], text
            return piece

        return push


# --- the model on its mesh ------------------------------------------------------------


def make_mesh(cfg: Config, devices=None):
    """The config's mesh over the first devices it needs (-1: all of them); the DCN
    degrees fold into data / fsdp, as one host runs it."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = cfg.mesh.sizes()
    for axis, n in cfg.mesh.dcn_sizes().items():
        sizes[axis] = sizes[axis] * n if sizes[axis] != -1 else -1
    if sizes["context"] != 1:
        raise GenerateError(f"mesh.context={sizes['context']}: generation needs mesh.context=1")
    if sizes["stage"] != 1:
        raise GenerateError(
            f"mesh.stage={sizes['stage']}: generation has no pipeline schedule; "
            "override mesh.stage=1 (and fold the stages into mesh.fsdp or mesh.tensor)"
        )
    fixed = math.prod(s for s in sizes.values() if s != -1)
    need = len(devices) if -1 in sizes.values() else fixed
    if need > len(devices) or fixed > len(devices):
        shape = " x ".join(f"{a}={s}" for a, s in sizes.items() if s != 1)
        raise GenerateError(f"mesh {shape} needs {max(need, fixed)} devices; {len(devices)} available")
    try:
        ici = sharding.mesh_shape_from_sizes(sizes, need)
    except ValueError as e:
        raise GenerateError(str(e)) from None
    return sharding.make_mesh(ici, devices[:need], allow_plain_grid=cfg.mesh.allow_plain_grid)


def load_model(src: Source, mesh, cfg: Config | None = None):
    """The Transformer with its weights read straight into their shardings on `mesh`
    (run under `jax.set_mesh(mesh)` and the config's axis rules). `cfg`: the source's config
    resolved for the mesh (default: resolved here)."""
    cfg = resolve_for_mesh(src.cfg, mesh) if cfg is None else cfg
    mcfg, rules = cfg.model, axis_rules(cfg)
    make = lambda: models.Transformer(mcfg, rngs=nnx.Rngs(cfg.seed))
    graphdef, abstract = models.abstract_model(make)
    shapes = nnx.to_pure_dict(abstract)
    shardings = sharding.tree_shardings(models.logical_axes(abstract), rules, mesh, shapes=shapes)
    if src.random_init:
        init = jax.jit(lambda: nnx.to_pure_dict(nnx.state(make(), nnx.Param)), out_shardings=shardings)
        params = init()
    elif src.kind == "hf":
        host = load_hf_params(src.path, mcfg)
        params = jax.tree.map(
            lambda x, s, sh: jax.device_put(jnp.asarray(x, s.dtype), sh), host, shapes, shardings
        )
    else:
        target = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
        )
        if mcfg.lora is None:
            params = load_params(src.checkpoint, mcfg, target, what=f"generate {src.path}")
        else:  # a LoRA run's checkpoint holds the adapters; its base is its train.init_from
            base_target, adapter_target = lora.split(target)
            if not cfg.train.init_from:
                raise GenerateError(
                    f"{src.path}: a LoRA run without train.init_from: no base to generate with"
                )
            base = load_params(cfg.train.init_from, mcfg, base_target, what=f"generate {src.path} (base)")
            adapters = load_params(src.checkpoint, mcfg, adapter_target, what=f"generate {src.path}")
            params = lora.join(base, adapters)
    return models.merge(graphdef, abstract, params)


# --- generating -------------------------------------------------------------------------


@dataclasses.dataclass
class Generation:
    text: str  # what was printed: the continuation of the prompt
    prompt_ids: list[int]
    new_ids: list[int]  # the sampled tokens (the EOS that ended it included)
    stop: str  # "eos" | "max_new_tokens" | "context"
    first_token_s: float  # from the prefill's start (its compile included) to the first token
    seconds: float  # the whole generation


def prepare_prompt(
    tok: Tokenizer, prompt: str, *, max_new_tokens: int, max_len: int | None
) -> tuple[list[int], int]:
    """(prompt ids, new tokens to make): the prompt non-empty and leaving room for at least
    one new token in max_len positions; max_new_tokens cut to the room there is."""
    if not prompt:
        raise GenerateError("the prompt is empty; expected --prompt TEXT or a non-empty --prompt-file")
    ids = tok.encode(prompt)
    if not ids:
        raise GenerateError(f"the prompt {prompt[:40]!r} encodes to no tokens with tokenizer {tok.spec!r}")
    if max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens={max_new_tokens}: expected a positive integer")
    if max_len is not None and len(ids) >= max_len:
        raise GenerateError(
            f"the prompt is {len(ids)} tokens, which leaves no room in the model's {max_len}-position "
            "context for a new token (--max-len)"
        )
    room = max_new_tokens if max_len is None else min(max_new_tokens, max_len - len(ids))
    return ids, room


def run(
    src: Source,
    prompt: str,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    max_len: int | None = None,
    write: Callable[[str], Any] = lambda s: None,
    log: Callable[[str], Any] = lambda s: None,
    devices=None,
) -> Generation:
    """Tokenize, build the mesh, load the weights, and stream: `write` gets each new token's
    text as it is produced (one call per token; '' for a token that completes no character)
    and a newline at the end; `log` a line before and after. Returns what was generated."""
    spec = src.tokenizer
    if spec is None:
        raise GenerateError(f"{src.path}: no tokenizer.json there; pass --tokenizer byte or a tokenizer.json")
    if max_len is not None and max_len < 2:
        raise GenerateError(f"--max-len={max_len}: expected at least 2 (a prompt token and a new one)")
    tok = Tokenizer(spec, vocab_size=src.cfg.model.vocab_size, special_tokens=src.special_tokens)
    max_len = max_len if max_len is not None else src.max_len
    ids, room = prepare_prompt(tok, prompt, max_new_tokens=max_new_tokens, max_len=max_len)
    eos = src.eos_id if src.eos_id is not None and src.eos_id < src.cfg.model.vocab_size else tok.eos_id
    _check_sampling(temperature, top_k, top_p, src.cfg.model.vocab_size)
    mesh = make_mesh(src.cfg, devices)
    cfg = resolve_for_mesh(src.cfg, mesh)  # attention and sharding choices for these devices
    with jax.set_mesh(mesh), sharding.axis_rules(axis_rules(cfg)):
        model = load_model(src, mesh, cfg)
        shape = {a: s for a, s in mesh.shape.items() if s > 1} or "one device"
        cut = f" (the {max_len}-position context allows {room})" if room < max_new_tokens else ""
        log(
            f"generating from {src.describe()}: mesh {shape}, tokenizer {tok.spec}, "
            f"{len(ids)} prompt tokens, up to {max_new_tokens} new{cut}"
        )
        t0 = time.perf_counter()
        steps = stream(
            model,
            [ids],
            max_new_tokens=room,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            eos_id=eos,
        )
        new, times = _print_tokens(steps, tok.detokenizer(ids), eos, write, t0)
        seconds = time.perf_counter() - t0
    stop = "eos" if new and new[-1] == eos else ("context" if room < max_new_tokens else "max_new_tokens")
    text = tok.continuation(ids, [i for i in new if i != eos])
    # The second token waits for the decode step's compile; the rate is over the ones after.
    rate = f", then {(len(times) - 2) / (times[-1] - times[1]):.1f} tokens/s" if len(times) > 2 else ""
    log(
        f"{len(new)} new tokens ({'stopped at EOS' if stop == 'eos' else 'stopped at ' + stop}); "
        f"first after {times[0]:.2f} s, second after {times[min(1, len(times) - 1)]:.2f} s "
        f"(compiles included){rate}"
    )
    return Generation(text, ids, new, stop, times[0], seconds)


def _print_tokens(steps, push, eos: int, write, t0: float) -> tuple[list[int], list[float]]:
    """Write each sampled token's text as it comes (up to EOS); (the new ids, when each came)."""
    new: list[int] = []
    times: list[float] = []
    for step in steps:
        times.append(time.perf_counter() - t0)
        new.append(int(step[0]))
        if new[-1] == eos:
            break
        write(push(new[-1]))
    write(push(None) + "\n")
    return new, times


def _check_sampling(temperature, top_k, top_p, vocab_size: int) -> None:
    if not (math.isfinite(temperature) and temperature >= 0):
        raise GenerateError(f"--temperature={temperature}: expected a finite number >= 0 (0: greedy)")
    if top_k is not None and not 1 <= top_k <= vocab_size:
        raise GenerateError(f"--top-k={top_k}: expected an integer in [1, {vocab_size}] (the model's vocab)")
    if top_p is not None and not 0 < top_p <= 1:
        raise GenerateError(f"--top-p={top_p}: expected a number in (0, 1]")

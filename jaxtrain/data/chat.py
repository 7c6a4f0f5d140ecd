"""Chat conversations -> token ids and a training mask, as Hugging Face transformers makes them.

``encode_chat(messages, tokenizer_dir)`` renders the directory's chat template and tokenizes
the text exactly as ``tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
return_assistant_tokens_mask=True)`` does (transformers 5.x, checked token for token by
tests/test_chat.py), without depending on transformers:

- the template: ``chat_template.jinja`` when the directory has one (transformers 5 saves it
  there and prefers it), else ``tokenizer_config.json``'s ``chat_template``: a string, or a list
  of ``{name, template}`` of which ``default`` is used;
- rendering: Jinja's ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)``
  with the ``generation`` tag and ``loopcontrols``, the ``tojson`` filter (no HTML escaping),
  ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace`` as transformers defines
  them; the variables are ``messages`` (keys whose value is None dropped, reasoning under its
  aliases), ``tools=None``, ``documents=None``, ``add_generation_prompt=False`` and the named
  special tokens of ``tokenizer_config.json`` (``bos_token`` etc., AddedToken dicts as their
  ``content``);
- tokenizing: ``tokenizer.json`` with the `tokenizers` library, ``add_special_tokens=False``
  (the template writes BOS and the turn markers itself), as transformers does;
- the mask: ``{% generation %} ... {% endgeneration %}`` records the character span of its
  output; ``mask[i] = 1`` when token ``i``'s character span overlaps a recorded span, with
  transformers' single pass over the tokens (a token counts when it ends after the span
  starts and starts before it ends; the closing end-of-turn token written inside the block
  counts, the ``<|im_start|>assistant`` header before it does not).

A template without ``{% generation %}`` is refused (the mask would be all zeros, as
transformers returns it with only a warning), unless ``mask_by_role=True``: then each
assistant message's ``content`` is looked up in the rendered text, in order, and the tokens
overlapping it get 1 (the end-of-turn token after it does not; a template that rewrites the
content, say with ``| trim``, is looked up by the trimmed text).

`ChatEncoder` holds one directory's template and tokenizer; DPO-style objectives render a
prompt with a chosen and a rejected reply through the same `ChatEncoder.encode`, and the
mask marks each reply's tokens.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import numpy as np

from . import storage
from .core import DataError
from .tokenizers import HFTokenizer

CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER = "tokenizer.json"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the special tokens a template sees as variables.
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# What transformers looks for (render_jinja_template) before it warns that the mask will be empty.
GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


# --------------------------------------------------------------------------- reading the directory


def _read_json(path: str) -> dict:
    try:
        value = json.loads(storage.read_bytes(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_text(value: Any, path: str, key: str) -> str:
    """A special token as the config writes it: a string, or an AddedToken dict's ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise DataError(
        f"{path}: {key}={value!r}; expected a string or an AddedToken object with a 'content' string"
    )


def _pick_template(value: Any, path: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for item in value:
            if not (
                isinstance(item, dict)
                and isinstance(item.get("name"), str)
                and isinstance(item.get("template"), str)
            ):
                raise DataError(
                    f"{path}: chat_template entry {item!r}; expected {{'name': str, 'template': str}}"
                )
            named[item["name"]] = item["template"]
        if "default" not in named:
            raise DataError(f"{path}: chat_template names {sorted(named)}; expected one named 'default'")
        return named["default"]
    raise DataError(
        f"{path}: chat_template={value!r}; expected a Jinja template string or a list of {{name, template}}"
    )


def read_chat_config(tokenizer_dir: str) -> tuple[str, dict[str, str], str]:
    """``(template, special-token variables, where the template came from)`` of a tokenizer directory."""
    config_path = storage.join(tokenizer_dir, CONFIG)
    if not storage.is_file(config_path):
        raise DataError(
            f"{config_path}: no such file; expected a Hugging Face tokenizer directory "
            f"({CONFIG} with a chat_template, and {TOKENIZER})"
        )
    config = _read_json(config_path)
    tokens = {k: config[k] for k in SPECIAL_TOKEN_KEYS if config.get(k) is not None}
    if isinstance(config.get("extra_special_tokens"), dict):  # model-specific names, e.g. image_token
        tokens.update({k: v for k, v in config["extra_special_tokens"].items() if v is not None})
    legacy = storage.join(tokenizer_dir, "special_tokens_map.json")
    if "added_tokens_decoder" not in config and storage.is_file(legacy):  # transformers' legacy path
        tokens.update(
            {k: v for k, v in _read_json(legacy).items() if k in SPECIAL_TOKEN_KEYS and v is not None}
        )
    variables = {k: _token_text(v, config_path, k) for k, v in tokens.items()}
    jinja_path = storage.join(tokenizer_dir, TEMPLATE_FILE)
    if storage.is_file(jinja_path):
        return storage.read_bytes(jinja_path).decode("utf-8"), variables, jinja_path
    if config.get("chat_template") is None:
        raise DataError(
            f"{config_path}: no 'chat_template' key (and no {TEMPLATE_FILE}); expected the model's chat "
            "template, a Jinja string"
        )
    return _pick_template(config["chat_template"], config_path), variables, f"{config_path}: chat_template"


# --------------------------------------------------------------------------- rendering


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """The Jinja template, in the environment transformers renders chat templates in."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTracker(jinja2.ext.Extension):
        """``{% generation %}``: while tracking, appends the ``(start, end)`` character span of
        the block's output, counted from the text yielded so far (transformers' AssistantTracker)."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(track_generation=self.track)
            self._tracking: ContextVar = ContextVar("generation_tracker", default=None)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

        def _generation(self, caller) -> str:
            out = caller()
            tracking = self._tracking.get()
            if tracking is not None:
                blocks, spans = tracking
                start = len("".join(blocks))
                spans.append((start, start + len(out)))
            return out

        @contextmanager
        def track(self, blocks: list[str], spans: list[tuple[int, int]]):
            token = self._tracking.set((blocks, spans))
            try:
                yield
            finally:
                self._tracking.reset(token)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:  # `dict(...)` without the attributes a sandbox escape could use
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore-prefixed attributes
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set namespace attribute {name!r}"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=strftime_now,
        dict=TemplateDict(),
        namespace=TemplateNamespace,
    )
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """Messages as the template sees them: JSON types only (transformers' _plain_template_data)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums ...) back to the base type
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _messages(messages: Any) -> list[dict]:
    """transformers' normalization: None-valued keys dropped, reasoning under all its aliases."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError(
            f"messages={messages!r:.200}: expected a non-empty list of {{'role', 'content'}} dicts"
        )
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise DataError(f"message {m!r:.200}: expected a dict with 'role' and 'content'")
        m = _plain({k: v for k, v in m.items() if v is not None})
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render(
    template, messages: list[dict], variables: dict[str, str], *, add_generation_prompt: bool = False
) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, character spans of the ``{% generation %}`` blocks), as transformers'
    _render_with_assistant_indices: a block's start is the length of what was yielded before it.
    `add_generation_prompt`: end with the assistant's header (a prompt to sample a reply to)."""
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    with template.environment.track_generation(blocks, spans):
        for block in template.generate(
            **variables,
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
        ):
            blocks.append(block)
        return "".join(blocks), spans


def overlap_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose ``[start, end)`` overlaps a span; transformers' one pass (spans in order)."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    s = 0
    for i, (start, end) in enumerate(offsets):
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        if s == len(spans):
            break
        if end > spans[s][0]:
            mask[i] = 1
    return mask


def role_spans(text: str, messages: list[dict]) -> list[tuple[int, int]]:
    """Spans of the assistant messages' contents in the rendered text, found in order."""
    spans, at = [], 0
    for m in messages:
        content = m.get("content")
        if m.get("role") != "assistant" or not isinstance(content, str) or not content.strip():
            continue
        for candidate in (content, content.strip()):
            found = text.find(candidate, at)
            if found >= 0:
                break
        else:
            raise DataError(
                f"mask_by_role: assistant content {content[:80]!r} is not in the rendered chat (after "
                f"character {at}); the template rewrites it, so it cannot be masked by role"
            )
        spans.append((found, found + len(candidate)))
        at = found + len(candidate)
    return spans


# --------------------------------------------------------------------------- encoding


class ChatEncoder:
    """One tokenizer directory's chat template and tokenizer: messages -> (ids, mask)."""

    def __init__(self, tokenizer_dir: str, *, mask_by_role: bool = False):
        self.directory = os.fspath(tokenizer_dir)
        self.source, self.variables, self.where = read_chat_config(self.directory)
        self.mask_by_role = bool(mask_by_role)
        if not self.mask_by_role and not GENERATION_TAG.search(self.source):
            raise DataError(
                f"{self.where}: the chat template has no {{% generation %}} ... {{% endgeneration %}} block, "
                "so it does not say which tokens are the assistant's; add the markers around the assistant "
                "turns (as transformers' return_assistant_tokens_mask needs), or mask the assistant "
                "messages' content instead with --mask-by-role (mask_by_role=True)"
            )
        try:
            self.template = compile_template(self.source)
        except Exception as e:  # jinja2.TemplateSyntaxError and kin
            raise DataError(f"{self.where}: not a valid Jinja template ({type(e).__name__}: {e})") from e
        self.tokenizer = HFTokenizer(storage.join(self.directory, TOKENIZER))

    def render(
        self, messages: Any, *, add_generation_prompt: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """(text, the character spans whose tokens the mask marks); `add_generation_prompt`:
        the text ends with the assistant's header (GRPO prompts: trainer/rollout.py)."""
        messages = _messages(messages)
        try:
            text, spans = render(
                self.template, messages, self.variables, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # raise_exception's TemplateError, or the template's own errors
            raise DataError(f"{self.where}: rendering failed ({type(e).__name__}: {e})") from e
        return text, (role_spans(text, messages) if self.mask_by_role else spans)

    def encode_batch(self, conversations: Sequence[Any]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each conversation's ``(ids int64, mask uint8)``; tokenized as one batch (all cores)."""
        return self.encode_rendered([self.render(c) for c in conversations])

    def encode_rendered(self, rendered: Sequence[tuple[str, list]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """`render`'s ``(text, spans)`` pairs -> ``(ids, mask)`` each, tokenized as one batch."""
        encodings = self.tokenizer.encode_with_offsets([text for text, _ in rendered])
        return [
            (np.asarray(e.ids, dtype=np.int64), overlap_mask(e.offsets, spans))
            for e, (_, spans) in zip(encodings, rendered)
        ]

    def encode(self, messages: Any) -> tuple[np.ndarray, np.ndarray]:
        return self.encode_batch([messages])[0]


@functools.lru_cache(maxsize=8)
def _encoder(tokenizer_dir: str, mask_by_role: bool) -> ChatEncoder:
    return ChatEncoder(tokenizer_dir, mask_by_role=mask_by_role)


def encode_chat(
    messages: Any, tokenizer_dir: str, *, mask_by_role: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` of one conversation (module docstring): ``mask[i] == 1`` on the tokens
    the model learns to produce. The directory is read once per process (cached)."""
    return _encoder(os.fspath(tokenizer_dir), bool(mask_by_role)).encode(messages)

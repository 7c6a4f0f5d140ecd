"""MkDocs hook: the configuration reference, generated from the config dataclasses at build time.

A page that contains the marker `<!-- config-reference -->` gets, in its place, one table per
config section (`jaxtrain.config.Config` and every dataclass nested in it: `model`,
`model.moe`, `mesh`, ..., `optimizer.loss_scale`), one row per field: the dotted key, its type
as YAML spells it, its default, and its description. The description is the field's comment
in the source: the comment lines directly above the field plus its trailing `# ...` comment,
read with `inspect.getsource` + `tokenize` + `ast`. A section's intro is its class docstring.
Nothing is written twice, so the reference cannot drift from the code.

Fields named `testing_*` are test hooks, not settings, and are left out. A field with no
comment of its own that directly follows a field whose comment block sits above it (no blank
line between) refers to that field (the block was written for both). Fields with no
description at all are listed in the build log (INFO), so they can be given one.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import logging
import os
import re
import textwrap
import tokenize
import types
import typing

MARKER = "<!-- config-reference -->"
log = logging.getLogger("mkdocs.hooks.config_reference")


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    # jaxtrain.config needs no backend; if anything on the way imports jax, keep it on the CPU
    # (the CUDA plugin and libtpu, installed for deviceless compiles, complain otherwise).
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxtrain.config import Config

    return markdown.replace(MARKER, render(Config))


# --- reading the source -------------------------------------------------------------------------


def _comment_text(token: str) -> str:
    return token.lstrip("#").strip()


def field_comments(cls: type) -> dict[str, str | tuple[str]]:
    """{field name: its comment}, from the class's source (comments above + trailing); a
    field that shares the comment block of the field before it maps to `(that field,)`."""
    source = textwrap.dedent(inspect.getsource(cls))
    classdef = ast.parse(source).body[0]
    assert isinstance(classdef, ast.ClassDef), cls
    lines = source.splitlines()
    # line -> (text, whole line?) for every comment token of the class
    comments: dict[int, tuple[str, bool]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            comments[line] = (tok.string, lines[line - 1].lstrip().startswith("#"))

    out: dict[str, str | tuple[str]] = {}
    previous_end = classdef.lineno  # the `class` line: comments above the first field count
    previous_field: str | None = None
    previous_had_block = False
    for stmt in classdef.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            previous_end, previous_field, previous_had_block = stmt.end_lineno, None, False
            continue
        name = stmt.target.id
        above: list[str] = []
        line = stmt.lineno - 1
        while line > previous_end and line in comments and comments[line][1]:
            above.insert(0, _comment_text(comments[line][0]))
            line -= 1
        trailing = [
            _comment_text(comments[n][0])
            for n in range(stmt.lineno, stmt.end_lineno + 1)
            if n in comments and not comments[n][1]
        ]
        text = " ".join(t for t in (*above, *trailing) if t)
        adjacent = stmt.lineno == previous_end + 1
        if not text and adjacent and previous_field is not None and previous_had_block:
            out[name] = (previous_field,)
        else:
            out[name] = text
            previous_field, previous_had_block = name, bool(above)
        previous_end = stmt.end_lineno
    return out


def class_docstring(cls: type) -> str | None:
    """The class's own docstring (dataclasses invent one from the signature when there is none)."""
    classdef = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    doc = ast.get_docstring(classdef)
    return " ".join(doc.split()) if doc else None


# --- rendering ----------------------------------------------------------------------------------

_NAMES = {int: "int", float: "float", bool: "bool", str: "str"}


def _nested(tp) -> type | None:
    """The dataclass a field's type holds (`X` or `X | None`), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


def type_name(tp) -> str:
    """An annotation as a YAML user reads it: `int`, `float or null`, `list of str`, ..."""
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "section"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        item = typing.get_args(tp)[0]
        if typing.get_origin(item) is tuple:  # (key, value) pairs: a YAML mapping
            return "mapping"
        return f"list of {type_name(item)}"
    return _NAMES.get(tp, getattr(tp, "__name__", str(tp)))


def default_text(field: dataclasses.Field, tp) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(section)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, tuple):
        if type_name(tp) == "mapping":  # stored as (key, value) pairs
            return f"`{dict(value)}`"
        return f"`{list(value)}`"
    return f"`{value!r}`" if isinstance(value, float) else f"`{value}`"


def _cell(text: str) -> str:
    """Markdown for one table cell: pipes escaped, `<` and `*` made literal outside code spans."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # outside backticks
        parts[i] = parts[i].replace("<", "&lt;").replace("*", r"\*")
    return "`".join(parts).replace("|", r"\|")


def _anchor(section: str) -> str:
    return re.sub(r"[^a-z0-9_-]", "", section.replace(".", "").lower()) or "top-level"


def sections(cls: type, prefix: str = "", optional: bool = False) -> list[tuple[str, type, bool]]:
    """(dotted section, dataclass, whether the section may be `null`) for `cls` and every
    dataclass nested in it, in field order."""
    hints = typing.get_type_hints(cls)
    out = [(prefix, cls, optional)]
    for f in dataclasses.fields(cls):
        inner = _nested(hints[f.name])
        if inner is not None:
            out += sections(inner, f"{prefix}{f.name}.", optional=inner is not hints[f.name])
    return out


def _row(key: str, tp, field: dataclasses.Field, description: str) -> str:
    return f"| `{key}` | {_cell(type_name(tp))} | {default_text(field, tp)} | {_cell(description)} |"


def render(root: type) -> str:
    blocks = []
    undocumented = []
    for prefix, cls, optional in sections(root):
        hints = typing.get_type_hints(cls)
        comments = field_comments(cls)
        section = prefix.rstrip(".")
        block = [f"### `{section}`" if section else "### Top level", ""]
        if optional:
            block += [
                "A section that may be `null` (off); when it is set, keys left out take these defaults.",
                "",
            ]
        intro = class_docstring(cls)
        if intro and cls is not root:
            block += [_cell(intro).replace(r"\|", "|"), ""]
        block += ["| key | type | default | description |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            if f.name.startswith("testing_"):
                continue
            key = f"{prefix}{f.name}"
            description = comments.get(f.name, "")
            if isinstance(description, tuple):  # the comment block above the previous field
                description = f"see `{prefix}{description[0]}`"
            if _nested(hints[f.name]) is not None:
                link = f"see [`{key}`](#{_anchor(key)})"
                description = f"{description}; {link}" if description else link
            if not description:
                undocumented.append(key)
            block.append(_row(key, hints[f.name], f, description))
        blocks.append("\n".join(block))
    if undocumented:
        log.info("config fields without a comment in the source: %s", ", ".join(undocumented))
    return "\n\n".join(blocks) + "\n"

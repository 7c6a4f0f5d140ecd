"""docs/composition.md ("What works with what"), generated from the table in jaxtrain/compose.py:

    python -m jaxtrain.compose_page > docs/composition.md

Apart from compose.py because it builds configs (jaxtrain.config), which imports compose."""

from __future__ import annotations

from pathlib import Path

import yaml

from jaxtrain import compose
from jaxtrain.config import Config, _build, _set_dotted, parse_override


def example_config(overrides: list[str]) -> Config:
    """configs/tiny.yaml with these overrides, not validated (a refused pair's message)."""
    data = yaml.safe_load((Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml").read_text())
    for text in overrides:
        _set_dotted(data, *parse_override(text))
    return _build(Config, data)


def page() -> str:
    return compose.docs_markdown(example_config)


if __name__ == "__main__":
    print(page(), end="")

"""What every module of models/hf/ shares: the error it raises, HF's `layer_types` as an
attention pattern (Gemma, GPT-OSS) and the names of our experts' weights."""

from __future__ import annotations


class HFConversionError(ValueError):
    """Unsupported architecture/feature or a missing/mis-shaped tensor; names it."""


_EXPERT_PARAMS = (("mlp", "w_gate"), ("mlp", "w_up"), ("mlp", "w_down"))


def _layer_pattern(layer_types: list[str]) -> tuple[str, ...]:
    """The shortest unit that, repeated, is HF's `layer_types` ("sliding_attention" /
    "full_attention"), as model.attention_pattern kinds (at worst the whole list)."""
    kinds = {"sliding_attention": "local", "full_attention": "global"}
    if any(t not in kinds for t in layer_types):
        raise HFConversionError(f"config.json layer_types={layer_types}: expected sliding/full_attention")
    ours = [kinds[t] for t in layer_types]
    n = len(ours)
    p = next(p for p in range(1, n + 1) if n % p == 0 and ours == ours[:p] * (n // p))
    return tuple(ours[:p])

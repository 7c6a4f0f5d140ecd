"""Reward functions for train.objective=grpo (`grpo.rewards`, `grpo.reward_weights`).

Each entry is ``module:function``, imported from the working directory or ``PYTHONPATH``,
and called with TRL's signature::

    f(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **fields)
        -> list[float | None]

``prompts`` are the prompt texts as the model saw them (rendered when the row had
``messages``), ``fields`` the rows' other columns as lists, one entry per completion. The
reward of a completion is the weighted sum of the functions' values, a None left out
(TRL's convention: nansum). A function that raises, returns the wrong length or a value
that is not a number (or None) stops the run with one line naming it (`RewardError`).
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable, Sequence

import numpy as np


class RewardError(RuntimeError):
    """A reward function failed; the message names it."""


def load_rewards(names: Sequence[str]) -> list[tuple[str, Callable]]:
    """[(name, callable)] for `grpo.rewards` entries ``module:function``."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # the working directory, as `python -m` would see it
    out = []
    for name in names:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
            fn = getattr(module, attr)
        except Exception as e:  # noqa: BLE001 - user code: whatever it raises, one line naming it
            raise RewardError(f"grpo.rewards {name!r}: cannot import it ({type(e).__name__}: {e})") from None
        if not callable(fn):
            raise RewardError(f"grpo.rewards {name!r}: not callable ({type(fn).__name__})")
        out.append((name, fn))
    return out


def score(
    rewards: Sequence[tuple[str, Callable]],
    weights: Sequence[float],
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    fields: dict[str, list],
) -> tuple[np.ndarray, np.ndarray]:
    """(per function [completions, functions] f32 with NaN for None, the weighted sum
    [completions] f32 with the NaNs left out)."""
    n = len(completions)
    table = np.full((n, len(rewards)), np.nan, np.float32)
    for j, (name, fn) in enumerate(rewards):
        try:
            values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **fields)
        except Exception as e:  # noqa: BLE001 - user code: whatever it raises, one line naming it
            raise RewardError(f"reward {name} raised {type(e).__name__}: {e}") from None
        try:
            values = list(values)
        except TypeError:
            raise RewardError(f"reward {name} returned {type(values).__name__}; expected a list") from None
        if len(values) != n:
            raise RewardError(f"reward {name} returned {len(values)} values for {n} completions")
        for i, v in enumerate(values):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise RewardError(f"reward {name} returned {v!r} at {i}; expected a number or None")
            if not math.isfinite(float(v)):
                raise RewardError(f"reward {name} returned {v!r} at {i}; expected a finite number")
            table[i, j] = v
    w = np.asarray(list(weights) or [1.0] * len(rewards), np.float32)
    total = np.nansum(table * w[None], axis=1).astype(np.float32)
    return table, total

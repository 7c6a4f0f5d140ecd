"""Reward functions of the GRPO examples (docs/grpo.md, notebooks/rl_grpo.ipynb, tests):
TRL's signature, `f(prompts, completions, completion_ids, **fields) -> list[float | None]`."""


def letter_share(prompts, completions, completion_ids, letter, **fields):
    """The share of the completion's characters that are the row's `letter` (verifiable:
    1.0 for a completion of that letter alone)."""
    return [c.count(x) / max(len(c), 1) for c, x in zip(completions, letter)]


def brevity(prompts, completions, completion_ids, **fields):
    """A small penalty per completion token (longer answers cost more)."""
    return [-0.01 * len(ids) for ids in completion_ids]

"""Weights & Biases: the records metrics.jsonl gets, and the resolved config, in one W&B run.

Process 0 alone logs (as it alone writes metrics.jsonl). The run id is written to
`{output_dir}/wandb_run_id` the first time, and read back by a resumed attempt, which then
continues the same W&B run (`resume="allow"`). Step records log at their step, eval rows and
events (stragglers, rollback) at theirs; strings are left out. Online, W&B drops rows below
the newest step it holds, so the steps a resumed attempt redoes keep their first values
there (metrics.jsonl keeps both, after a `resume` marker); offline, each attempt is its own
file of the same run id, which `wandb sync` merges.

`mode: offline` writes under `{output_dir}/wandb` (a local output_dir; else W&B's own
default, `./wandb`) for `wandb sync` later; nothing there needs the network.
"""

from __future__ import annotations

import math
import os
import uuid
from pathlib import Path

from jaxtrain.config import WandbConfig
from jaxtrain.data import storage

RUN_ID_FILE = "wandb_run_id"


def run_id(output_dir: str) -> str:
    """This run's W&B id: the one an earlier attempt wrote to output_dir, or a new one."""
    path = storage.as_path(storage.join(output_dir, RUN_ID_FILE))
    if path.exists():
        existing = path.read_text().strip()
        if existing:
            return existing
    new = uuid.uuid4().hex[:12]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new + "\n")
    return new


class WandbLogger:
    """One W&B run; `write(record)` as MetricsWriter's, `close()` finishes it."""

    def __init__(self, cfg: WandbConfig, config: dict, *, output_dir: str, log=print):
        try:
            import wandb  # optional: `pip install wandb` (or jaxtrain[wandb])
        except ImportError as e:
            raise ImportError(
                f"logging.wandb.mode={cfg.mode!r} needs the wandb package: pip install wandb"
            ) from e
        wandb_dir = None  # W&B writes under DIR/wandb; a URL output_dir: its default, ./wandb
        if storage.is_local(output_dir):
            wandb_dir = os.fspath(output_dir)
        self.id = run_id(output_dir)
        self.run = wandb.init(
            project=cfg.project or "jaxtrain",
            entity=cfg.entity,
            name=cfg.name or Path(str(output_dir).rstrip("/")).name,
            tags=list(cfg.tags) or None,
            mode=cfg.mode,
            id=self.id,
            resume="allow",
            dir=wandb_dir,
            config=config,
            # our own log lines, not W&B's console capture or banner; no code upload
            settings=wandb.Settings(console="off", save_code=False, silent=True),
        )
        self._last_step = -1
        online = cfg.mode == "online"  # (an offline run's url warns that it has none)
        where = self.run.url if online else f"files in {self.run.dir}; `wandb sync` uploads them"
        log(f"W&B run {self.id} ({cfg.mode}): {where}")

    def write(self, record: dict) -> None:
        step = int(record["step"])
        if step < self._last_step:
            return  # W&B drops rows of a step below its newest (a rollback's redone steps)
        values = as_panels(record)
        if values:
            self._last_step = step
            self.run.log(values, step=step)

    def summary(self, values: dict) -> None:
        self.run.summary.update(values)

    def close(self) -> None:
        self.run.finish()


def as_panels(record: dict) -> dict:
    """A metrics.jsonl record as W&B keys: `train/loss`, `eval/loss`, an event's numbers
    under its name (`stragglers/own_time_s/1`: lists by index); strings and flags left out."""
    event = record.get("event")
    if event is not None:
        prefix = f"{event}/"
    elif any(k.startswith("eval_") for k in record):
        prefix = "eval/"
    else:
        prefix = "train/"
    out = {}
    for k, v in record.items():
        if k in ("step", "event"):
            continue
        name = prefix + (k[len("eval_") :] if prefix == "eval/" and k.startswith("eval_") else k)
        if isinstance(v, list):
            out.update({f"{name}/{i}": x for i, x in enumerate(v) if _number(x)})
        elif _number(v):
            out[name] = v
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

"""Where metrics go: `{output_dir}/metrics.jsonl` (one JSON object per logged
step), TensorBoard event files (tensorboardX), and a rich progress bar."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class MetricsWriter:
    def __init__(
        self, output_dir: str | Path, *, total_steps: int, tensorboard: bool = True, progress: bool = True
    ):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        self.console = Console(stderr=True)
        self._progress = None
        if progress:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s  mfu {task.fields[mfu]}"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self._progress.add_task("train", total=total_steps, loss="-", tps="-", mfu="-")
            self._progress.start()

    def write(self, record: dict) -> None:
        """`record` must hold `step`; other numeric fields go to TensorBoard too."""
        self._jsonl.write(json.dumps(record) + "\n")
        step = int(record["step"])
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(f"train/{k}", v, step)
        if self._progress is not None:
            self._progress.update(
                self._task,
                completed=step,
                loss=f"{record.get('loss', float('nan')):.4f}",
                tps=f"{record.get('tokens_per_second', 0):,.0f}",
                mfu=f"{100 * record.get('mfu', 0):.1f}%",
            )

    def log(self, message: str) -> None:
        self.console.print(message)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        self._jsonl.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_metrics(output_dir: str | Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

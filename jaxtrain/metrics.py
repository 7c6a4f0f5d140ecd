"""Where metrics go: `{output_dir}/metrics.jsonl` (one JSON object per record), TensorBoard
event files (tensorboardX), and a rich progress bar.

Records: one per logged step (`loss`, `grad_norm`, `lr`, throughput, ...), one per evaluation
(`{"step", "eval_loss", "eval_perplexity", "eval_tokens", "eval_time_s"}`: no `loss` key, so
a reader that wants the training curve keeps the records that have `loss`), and events
(`{"step", "event": "rollback", ...}`). TensorBoard gets the numbers of each: `train/loss`,
`eval/loss`, `eval/perplexity`, ...

`output_dir` may be a URL (`gs://bucket/run`, any `etils.epath` scheme). Object stores
cannot append, so there `metrics.jsonl` and the event file are kept in memory and each is
rewritten whole (an upload replaces an object atomically: a reader sees the old object or
the new one): at most every `sync_every_s` seconds, whenever `sync()` is called (the trainer
does at every checkpoint and evaluation) and on close. Locally, lines are appended as they
come. Only process 0 of a run writes these (jaxtrain/trainer/loop.py).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from jaxtrain.data import storage


class MetricsWriter:
    def __init__(
        self,
        output_dir: str | os.PathLike,
        *,
        total_steps: int,
        tensorboard: bool = True,
        progress: bool = True,
        sync_every_s: float = 30.0,
        wandb=None,
    ):
        """`wandb`: (logging.wandb, the resolved config as a dict) to log every record to W&B
        as well (jaxtrain/observe/wandb_log.py), or None."""
        self.remote = not storage.is_local(output_dir)
        self.output_dir = output_dir
        self.dir = storage.as_path(output_dir)
        self.sync_every_s = sync_every_s
        self._jsonl_path = self.dir / "metrics.jsonl"
        self._tensorboard = tensorboard
        self._wandb_args, self._wandb = wandb, None
        # Nothing is created until the first record: a run refused at start (bad data, a
        # checkpoint of another model) leaves an existing output_dir exactly as it was.
        self._opened = False
        self._jsonl = None
        self._tb = None
        self._last_sync = time.monotonic()
        self.console = Console(stderr=True)
        self._progress = None
        if progress:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(
                    "loss {task.fields[loss]}  eval {task.fields[eval]}  "
                    "{task.fields[tps]} tok/s  mfu {task.fields[mfu]}"
                ),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self._progress.add_task(
                "train", total=total_steps, loss="-", eval="-", tps="-", mfu="-"
            )
            self._progress.start()

    def has_earlier_records(self) -> bool:
        """Whether metrics.jsonl already holds records (of an earlier or interrupted run)."""
        try:
            return self._jsonl_path.exists() and storage.file_size(os.fspath(self._jsonl_path)) > 0
        except OSError:
            return False

    def open(self) -> None:
        """Create the files (and start W&B) now rather than at the first record."""
        if not self._opened:
            self._open()

    def _open(self) -> None:
        self._opened = True
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.remote:  # the whole object, rewritten at each sync (a resumed run adds to it)
            self._lines = [self._jsonl_path.read_text()] if self._jsonl_path.exists() else []
            self._dirty = False
        else:
            self._jsonl = open(self._jsonl_path, "a", buffering=1)
        if self._tensorboard:
            from tensorboardX import SummaryWriter  # only where TensorBoard is on (logging.tensorboard)

            logdir = storage.join(self.output_dir, "tensorboard")
            if self.remote:
                _register_object_store_events(os.fspath(self.output_dir).split("://", 1)[0])
                self._tb = SummaryWriter(logdir, flush_secs=max(1, int(self.sync_every_s)))
            else:
                self._tb = SummaryWriter(logdir)
        if self._wandb_args is not None and self._wandb_args[0].mode != "disabled":
            from jaxtrain.observe.wandb_log import WandbLogger  # imports wandb, only where it is on

            self._wandb = WandbLogger(*self._wandb_args, output_dir=self.output_dir, log=self.log)

    def write(self, record: dict) -> None:
        """`record` must hold `step`; its other finite numbers go to TensorBoard too
        (`eval_*` keys as `eval/*`, the rest as `train/*`)."""
        if not self._opened:
            self._open()
        line = json.dumps(record) + "\n"
        if self.remote:
            self._lines.append(line)
            self._dirty = True
        else:
            self._jsonl.write(line)
        step = int(record["step"])
        if self._tb is not None and "event" not in record:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    tag = f"eval/{k[len('eval_') :]}" if k.startswith("eval_") else f"train/{k}"
                    self._tb.add_scalar(tag, v, step)
        if self._wandb is not None:
            self._wandb.write(record)
        if self._progress is not None:
            fields = {}
            if "loss" in record:
                fields.update(
                    loss=f"{record['loss']:.4f}",
                    tps=f"{record.get('tokens_per_second', 0):,.0f}",
                    mfu=f"{100 * record.get('mfu', 0):.1f}%",
                )
            if "eval_loss" in record:
                fields["eval"] = f"{record['eval_loss']:.4f}"
            self._progress.update(self._task, completed=step, **fields)
        if self.remote and time.monotonic() - self._last_sync >= self.sync_every_s:
            self.sync()

    def scalars(self, prefix: str, values: dict[str, float], step: int) -> None:
        """Numbers that are not a metrics.jsonl record (goodput at the end): TensorBoard as
        `prefix/key`, and W&B's run summary."""
        self.open()
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(f"{prefix}/{k}", v, step)
        if self._wandb is not None:
            self._wandb.summary({f"{prefix}/{k}": v for k, v in values.items()})

    def sync(self) -> None:
        """Make everything written so far durable in `output_dir` (remote: rewrite the objects)."""
        if not self._opened:
            return
        if self.remote and self._dirty:
            self._jsonl_path.write_text("".join(self._lines))
            self._dirty = False
        if self._tb is not None:
            self._tb.flush()
        self._last_sync = time.monotonic()

    def log(self, message: str) -> None:
        # soft_wrap: a long line (a path, a reason) stays one line, whole, for grep and logs.
        self.console.print(message, soft_wrap=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
        if self.remote:
            self.sync()
        elif self._jsonl is not None:
            self._jsonl.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _ObjectEventFile:
    """A tensorboardX record writer for object stores: it keeps the event file's bytes and
    rewrites the object whole on flush (tensorboardX flushes from its writer thread every
    `flush_secs`, and on `SummaryWriter.flush()` / `close()`)."""

    def __init__(self, path: str):
        self.path = storage.as_path(path)
        self._data = bytearray()
        self._flushed = -1
        self._lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self._lock:
            self._data += data

    def flush(self) -> None:
        with self._lock:
            if len(self._data) != self._flushed:
                self.path.write_bytes(bytes(self._data))
                self._flushed = len(self._data)

    def close(self) -> None:
        self.flush()


class _ObjectEventFiles:
    def open(self, path: str) -> _ObjectEventFile:
        return _ObjectEventFile(path)

    def directory_check(self, path: str) -> None:
        pass  # object stores have no directories to create


def _register_object_store_events(scheme: str) -> None:
    """Route tensorboardX's event files under `scheme://` through etils.epath (gcsfs for gs://)
    instead of its own writers (google-cloud-storage for gs://, boto3 for s3://, nothing
    for other schemes), so that every URL the rest of the run writes to works here too."""
    from tensorboardX import record_writer  # as SummaryWriter: only where TensorBoard is on

    record_writer.register_writer_factory(scheme, _ObjectEventFiles())


def read_metrics(output_dir: str | os.PathLike) -> list[dict]:
    path = storage.as_path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

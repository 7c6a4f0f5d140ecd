"""A profiler window: `profile.steps: [first, last]` traces those steps with jax.profiler.

Every process traces (a multi-process run's slow host is often what one wants to see), each
into its own `process_<i>` folder when there are several, so that two processes on one host
do not write the same `<host>.xplane.pb`. The files are XProf's layout,
`DIR/plugins/profile/steps_<first>_<last>_<time>/<host>.xplane.pb`: `xprof --logdir DIR`
or TensorBoard with the profile plugin opens them. Each step of the window is a
`StepTraceAnnotation("train", step_num=step)`, which XProf's step views key on. The ops carry
trainer/step.py's named scopes in their metadata (XProf's graph viewer, op profile on
TPU/GPU): `forward`, `loss`, `optimizer`, and the backward pass as `transpose(jvp(forward))`.

The trace starts before the window's first step is dispatched and stops after its last step's
results are ready, so it holds exactly the window's steps. On an object store (gs://) the
trace is written to a local folder first and uploaded when it stops.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import jax

from jaxtrain.data import storage


class ProfileWindow:
    def __init__(self, steps: tuple[int, ...], directory: str, log):
        self.first, self.last = steps if steps else (0, -1)
        if jax.process_count() > 1:
            directory = storage.join(directory, f"process_{jax.process_index()}")
        self.directory = directory
        self._log = log
        self._local: str | None = None
        self.tracing = False

    def step(self, step: int):
        """Context for dispatching step `step` (1-based): starts the trace at the window's first."""
        if not self.first <= step <= self.last:
            return contextlib.nullcontext()
        if not self.tracing:
            self._start()
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after(self, step: int, state) -> None:
        """After step `step` was dispatched: at the window's last, wait for it and stop."""
        if self.tracing and step >= self.last:
            jax.block_until_ready(state)
            self.stop()

    def _start(self) -> None:
        if storage.is_local(self.directory):
            self._local = os.fspath(self.directory)
            Path(self._local).mkdir(parents=True, exist_ok=True)
        else:
            self._local = tempfile.mkdtemp(prefix="jaxtrain-profile-")
        # A session named for the window: XProf's default, the time to the second, would let a
        # second window in the same second (a rollback, a short run) replace the first.
        options = jax.profiler.ProfileOptions()
        options.session_id = f"steps_{self.first}_{self.last}_{time.strftime('%Y_%m_%d_%H_%M_%S')}"
        jax.profiler.start_trace(self._local, profiler_options=options)
        self.tracing = True
        self._log(f"profiling steps {self.first}..{self.last} into {self.directory}")

    def stop(self) -> None:
        """Stop a trace in progress (the window's end, or the loop ending inside it)."""
        if not self.tracing:
            return
        jax.profiler.stop_trace()
        self.tracing = False
        if self._local != os.fspath(self.directory):
            _upload(self._local, self.directory)
            shutil.rmtree(self._local, ignore_errors=True)
        self._log(f"profile written: {self.directory} (open with `xprof --logdir {self.directory}`)")


def _upload(local: str, remote: str) -> None:
    for path in Path(local).rglob("*"):
        if path.is_file():
            dest = storage.as_path(storage.join(remote, path.relative_to(local).as_posix()))
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(path.read_bytes())

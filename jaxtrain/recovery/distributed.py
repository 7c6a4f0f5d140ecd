"""Multi-process (multi-controller) runs: joining the job, and not hanging when a peer dies.

`initialize` must run before the JAX backend starts (the CLI calls it first).
It uses the explicit `distributed.*` settings when given, JAX's cluster
auto-detection otherwise (Cloud TPU pods, SLURM, Open MPI: the environments
`jax.distributed.initialize()` understands with no arguments), and does
nothing for a plain single-process run.

Peer failure. JAX's coordination service already aborts every process some
time after one stops sending heartbeats, but its message is a C++ fatal log
and, by default, only after 100 s. We add a small watchdog thread: each
process bumps a counter in the coordinator's key-value store every
`heartbeat_timeout / 10` seconds and watches the others' counters; a peer
whose counter has not moved for `heartbeat_timeout` seconds is declared lost
and this process exits with EXIT_PEER_LOST and one line naming it. JAX's own
heartbeat timeout is set a little longer, as a backstop.

If the lost process is the coordinator (process 0), JAX's client aborts the
survivors (SIGABRT, a C++ fatal log) within about a second, before any Python
code can speak. So a multi-process `jaxtrain train` runs as a small supervisor
(`supervise`: no jax backend, forwards SIGTERM) around the real worker
process; when the worker is aborted, the supervisor probes the coordinator's
address and exits EXIT_PEER_LOST with one line naming the lost coordinator
(or, if it still answers, saying JAX's runtime aborted the worker).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
from jax._src import clusters
from jax._src import distributed as jax_distributed

from jaxtrain.config import DistributedConfig

_log = logging.getLogger("jaxtrain.distributed")

EXIT_PEER_LOST = 4
_KEY = "jaxtrain/heartbeat"
_SUPERVISED = "JAXTRAIN_SUPERVISED"  # set in the worker's environment by `supervise`


@dataclasses.dataclass(frozen=True)
class Membership:
    process_id: int
    num_processes: int
    coordinator_address: str
    how: str  # "explicit" or the detected cluster type (e.g. "SlurmCluster")


_membership: Membership | None = None
_watchdog: PeerWatchdog | None = None


def detect_cluster() -> str | None:
    """The cluster environment JAX would auto-detect here (TPU pod, SLURM, ...), or None."""
    for env in clusters.ClusterEnv._cluster_types:
        try:
            if not env.opt_in_only_method and env.is_env_present():
                return env.__name__
        except Exception as e:  # noqa: BLE001 - a probe that fails means "not this environment"
            _log.debug("cluster probe %s failed (%s): not this environment", env.__name__, e)
            continue
    return None


def initialize(cfg: DistributedConfig) -> Membership | None:
    """Join the multi-process job described by `cfg` (or detected); None if single-process."""
    global _membership, _watchdog

    backstop = cfg.heartbeat_timeout + max(10, cfg.heartbeat_timeout // 2)
    timeouts = dict(
        initialization_timeout=cfg.initialization_timeout,
        heartbeat_timeout_seconds=backstop,
        shutdown_timeout_seconds=backstop,
    )
    if cfg.coordinator_address is not None:
        how = "explicit"
        jax.distributed.initialize(
            cfg.coordinator_address, num_processes=cfg.num_processes, process_id=cfg.process_id, **timeouts
        )
    elif cfg.auto_detect and (how := detect_cluster()) is not None:
        jax.distributed.initialize(**timeouts)
    else:
        return None

    state = jax_distributed.global_state
    _membership = Membership(
        process_id=state.process_id,
        num_processes=state.num_processes,
        coordinator_address=state.coordinator_address,
        how=how,
    )
    if state.num_processes > 1:
        _watchdog = PeerWatchdog(
            state.client, state.process_id, state.num_processes, timeout=cfg.heartbeat_timeout
        )
        _watchdog.start()
    return _membership


def membership() -> Membership | None:
    return _membership


def describe_topology() -> str:
    """One line about the job this process joined (call after the backend is up)."""
    m = _membership
    local = jax.local_devices()
    kind = local[0].device_kind if local else "?"
    if m is None:
        return f"single process, {len(local)} local {kind} devices"
    return (
        f"process {m.process_id} of {m.num_processes} ({m.how}, coordinator "
        f"{m.coordinator_address}): {len(local)} local {kind} devices, "
        f"{jax.device_count()} in all"
    )


def finish() -> None:
    """This process is done (normally or by a handled error): peers must not treat its
    silence as a failure."""
    if _watchdog is not None:
        _watchdog.finish()


def wait_for_peer_verdict() -> None:
    """After an unexplained runtime error in a multi-process run, give the watchdog time
    to name a lost peer (it exits the process if it finds one)."""
    if _watchdog is not None and not _watchdog.finished:
        time.sleep(_watchdog.timeout + 2 * _watchdog.interval)


class PeerWatchdog(threading.Thread):
    """Heartbeat counters through the coordinator's key-value store; see the module doc."""

    def __init__(self, client, process_id: int, num_processes: int, *, timeout: float, exit_fn=os._exit):
        super().__init__(name="jaxtrain-peer-watchdog", daemon=True)
        self.client, self.me, self.n = client, process_id, num_processes
        self.timeout = float(timeout)
        self.interval = max(0.2, min(5.0, self.timeout / 10))
        self.finished = False
        self._exit = exit_fn
        self._stop = threading.Event()

    def finish(self) -> None:
        self.finished = True
        try:
            self.client.key_value_set(f"{_KEY}/{self.me}", "done", allow_overwrite=True)
        except Exception as e:  # noqa: BLE001 - the coordinator may already be gone
            _log.debug("could not say 'done' to the coordinator (%s): it may be gone already", e)
        self._stop.set()

    def _lost(self, who: int, why: str) -> None:
        if self.finished:
            return
        role = "the coordinator, process 0" if who == 0 else f"process {who}"
        print(
            f"jaxtrain: error: lost {role} of {self.n}: {why}; process {self.me} exits "
            f"(code {EXIT_PEER_LOST}). Restart every process to resume from the newest "
            "checkpoint.",
            file=sys.stderr,
            flush=True,
        )
        self._exit(EXIT_PEER_LOST)

    def run(self) -> None:
        count = 0
        start = time.monotonic()
        seen: dict[int, tuple[str | None, float]] = {p: (None, start) for p in range(self.n) if p != self.me}
        unreachable_since = None
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            count += 1
            try:
                self.client.key_value_set(f"{_KEY}/{self.me}", str(count), allow_overwrite=True)
                unreachable_since = None
            except Exception as e:  # noqa: BLE001 - counted: a silence past the timeout is a loss
                _log.debug("heartbeat not written (%s)", e)
                unreachable_since = unreachable_since or now
                if now - unreachable_since > self.timeout:
                    self._lost(
                        0,
                        f"its key-value service has been unreachable for "
                        f"{self.timeout:.0f} s ({type(e).__name__})",
                    )
                continue
            for peer, (last_value, last_change) in seen.items():
                try:
                    value = self.client.key_value_try_get(f"{_KEY}/{peer}")
                except Exception as e:  # noqa: BLE001 - not written yet (its silence is timed below)
                    _log.debug("no heartbeat of process %d yet (%s)", peer, e)
                    value = None
                if value == "done":
                    continue
                if value != last_value:
                    seen[peer] = (value, now)
                elif now - last_change > self.timeout:
                    self._lost(
                        peer,
                        f"no heartbeat for {now - last_change:.0f} s "
                        f"(distributed.heartbeat_timeout={self.timeout:.0f})",
                    )


# ----------------------------------------------------------------------------
# The supervisor: names a lost coordinator after JAX's runtime aborts the worker.
# ----------------------------------------------------------------------------


def is_multiprocess(cfg: DistributedConfig) -> bool:
    """Whether `initialize` will join a multi-process job (explicitly or detected)."""
    if cfg.coordinator_address is not None:
        return (cfg.num_processes or 1) > 1
    return cfg.auto_detect and detect_cluster() is not None


def coordinator_reachable(address: str, timeout: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _die_with_parent() -> None:
    """In the worker (Linux): SIGKILL it if the supervisor dies, so that killing the
    supervisor alone never leaves an orphan holding devices."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def supervise(cfg: DistributedConfig, argv: list[str]) -> int | None:
    """Run `python -m jaxtrain *argv` as a worker and return its exit code, or None
    if this process is the worker (or the run is single-process) and should train.

    The supervisor imports no jax backend. SIGTERM is forwarded to the worker
    (preemption: it saves and exits 0); SIGINT is ignored here, since a terminal
    sends it to the worker too. A worker killed by SIGABRT (JAX's distributed
    runtime terminating it) becomes EXIT_PEER_LOST with a line naming the lost
    coordinator where the probe confirms it.
    """
    if os.environ.get(_SUPERVISED) or not is_multiprocess(cfg):
        return None
    worker = subprocess.Popen(
        [sys.executable, "-m", "jaxtrain", *argv],
        env={**os.environ, _SUPERVISED: "1"},
        preexec_fn=_die_with_parent,
    )
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, lambda s, f: worker.send_signal(s)),
        signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
    }
    try:
        code = worker.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code != -signal.SIGABRT:
        return code if code >= 0 else 128 - code
    me = "this process" if cfg.process_id is None else f"process {cfg.process_id}"
    address = cfg.coordinator_address
    if address and cfg.process_id != 0 and not coordinator_reachable(address):
        n = f" of {cfg.num_processes}" if cfg.num_processes else ""
        why = f"lost the coordinator, process 0{n}: {address} no longer accepts connections"
    else:
        why = (
            "JAX's distributed runtime aborted the worker: a peer process died or the "
            "network failed (see the runtime's message above)"
        )
    print(
        f"jaxtrain: error: {why}; {me} exits (code {EXIT_PEER_LOST}). Restart every "
        "process to resume from the newest checkpoint.",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_PEER_LOST

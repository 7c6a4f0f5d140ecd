"""One result file per benchmark run: what it measured, and enough to trace it.

Every script in benchmarks/ that prints figures runs its work inside `record(...)`:

    with result_file.record("throughput") as rec:
        ...                                            # prints as before
        rec.figures["runs"] = rows                     # the raw figures, numbers unrounded
        rec.table("bf16", header, cells)               # a table the docs may quote, as printed

and on success writes `benchmarks/results/<script>/<UTC time>-<sha>.json` holding

- `git`: the commit, whether the tree was clean (`git status --porcelain` empty) and if not,
  which tracked files differed. A copy
  of the tree without `.git` (a lent GPU host) reads `.whl/REVISION`, which the GPU recipe
  writes before the copy travels (docs/gpu.md);
- `date` (UTC), `machine` (host name, CPU model and count, memory), `devices` (GPU names from
  nvidia-smi, and JAX's devices when the process has imported jax), `versions` (python, jax,
  jaxlib, flax, optax, orbax, numpy; torch, transformers, liger-kernel, torchtitan where
  installed; read from package metadata, so nothing is imported for it);
- `command`: the exact command line, and the environment variables that change what runs
  (JAX_*, XLA_FLAGS, JAXTRAIN_*, CUDA_VISIBLE_DEVICES);
- `figures`: what the script put there, and `json_rows`: every JSON object it printed on a
  line of stdout or stderr (the raw rows most scripts print as they go);
- `tables`: the tables it named, as cells (what benchmarks/report.py copies into the docs),
  and every Markdown table it printed, as `printed_1`, `printed_2`, ... in order;
- `printed`: everything it wrote to stdout.

A script whose whole work is `main()` ends with `sys.exit(result_file.run("name", main))`, and
adds its figures and tables from inside with `result_file.add_figures(...)` and
`result_file.add_table(...)` (no-ops when nothing records, as when a test calls `main`).

JAXTRAIN_RESULTS_DIR moves the folder (the test suite points it at a scratch directory);
`JAXTRAIN_RESULTS_DIR=off` writes nothing. A run that raises (SystemExit included: `--help`,
a usage error) or returns a non-zero exit code writes nothing, and neither does a script's own
worker process (`--worker`, `--child` on its command line): its parent records the run.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
REVISION_FILE = REPO / ".whl" / "REVISION"
VERSIONED = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "numpy",
    "torch",
    "transformers",
    "liger-kernel",
    "torchtitan",
)
ENV_PREFIXES = ("JAX_", "XLA_", "JAXTRAIN_", "CUDA_VISIBLE_DEVICES", "TORCH")
WORKER_FLAGS = ("--worker", "--child")
_ACTIVE: list[Recorder] = []


def results_dir() -> Path | None:
    """Where result files go: JAXTRAIN_RESULTS_DIR, else benchmarks/results; None for `off`."""
    where = os.environ.get("JAXTRAIN_RESULTS_DIR")
    if where == "off":
        return None
    return Path(where) if where else RESULTS_DIR


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    if not shutil.which(cmd[0]):
        return None
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except OSError:  # no such folder
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_state(repo: Path = REPO, revision_file: Path = REVISION_FILE) -> dict:
    """{"sha", "clean"} of `repo`'s checkout (and "changed": the files that differ from the
    commit, when some do), from git or else `revision_file` (`SHA clean` or `SHA dirty`, one
    line); both None when neither says."""
    sha = _run(["git", "rev-parse", "HEAD"], repo)
    if sha is not None:
        status = _run(["git", "status", "--porcelain", "--untracked-files=no"], repo)
        changed = None if status is None else [line[3:] for line in status.splitlines() if line.strip()]
        state = {"sha": sha.strip(), "clean": None if changed is None else not changed}
        return {**state, "changed": changed} if changed else state
    if revision_file.is_file():
        sha, _, state = revision_file.read_text().strip().partition(" ")
        return {"sha": sha, "clean": {"clean": True, "dirty": False}.get(state.strip())}
    return {"sha": None, "clean": None}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine() -> dict:
    return {
        "host": platform.node(),
        "os": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": _memory_gib(),
    }


def devices() -> dict:
    """GPU names (nvidia-smi: no process touches the GPU for it) and, if this process has
    imported jax, what jax runs on."""
    found: dict = {}
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    if smi:
        found["gpus"] = [line.strip() for line in smi.splitlines() if line.strip()]
    if "jax" in sys.modules:
        jax = sys.modules["jax"]
        try:
            devs = jax.devices()
            found["jax"] = {"platform": devs[0].platform, "kind": devs[0].device_kind, "count": len(devs)}
        except Exception as e:  # noqa: BLE001 - a backend that cannot start is recorded, not fatal
            found["jax"] = {"error": f"{type(e).__name__}: {e}"[:200]}
    return found


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def command(argv: list[str] | None = None) -> dict:
    argv = sys.argv if argv is None else argv
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    return {"argv": list(argv), "line": shlex.join(["python", *argv]), "env": env}


def provenance(argv: list[str] | None = None) -> dict:
    """Everything a result file says besides its figures."""
    return {
        "git": git_state(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "devices": devices(),
        "versions": versions(),
        "command": command(argv),
    }


def repeat_stats(values: list[float]) -> dict:
    """min, median and max of per-repeat figures, and how many."""
    if not values:
        raise ValueError("repeat_stats: no values")
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def check_table(name: str, header: list[str], rows: list[list]) -> dict:
    """A table as a result file holds it: every row as many cells as the header, cells text."""
    header = [str(h) for h in header]
    cells = []
    for i, row in enumerate(rows):
        if len(row) != len(header):
            raise ValueError(f"table {name!r} row {i}: {len(row)} cells, expected {len(header)} ({header})")
        cells.append(["" if c is None else str(c).replace("|", "/").replace("\n", " ") for c in row])
    return {"header": header, "rows": cells}


SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")


def split_row(line: str) -> list[str]:
    """The cells of a Markdown table row (`\\|` inside a cell is not a separator)."""
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    return [c.strip() for c in re.split(r"(?<!\\)\|", body)]


def markdown_tables(text: str) -> list[dict]:
    """Every Markdown table in `text` (a header row, a separator, rows), as {"header", "rows"}."""
    lines, found, i = text.splitlines(), [], 0
    while i + 1 < len(lines):
        if lines[i].lstrip().startswith("|") and SEPARATOR.match(lines[i + 1].strip()):
            j = i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                j += 1
            found.append({"header": split_row(lines[i]), "rows": [split_row(r) for r in lines[i + 2 : j]]})
            i = j
        else:
            i += 1
    return found


def json_rows(text: str) -> list[dict]:
    """The JSON objects of `text`, one per line at most (`name: {...} (3 s)` counts)."""
    rows = []
    for line in text.splitlines():
        start, end = line.find("{"), line.rfind("}")
        if start < 0 or end < start:
            continue
        try:
            row = json.loads(line[start : end + 1])
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


class _Tee(io.TextIOBase):
    def __init__(self, stream):
        self.stream, self.buffer_ = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.buffer_.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


class Recorder:
    """Collects one run's figures and tables; `record` writes them when the run ends well."""

    def __init__(self, script: str, argv: list[str] | None = None):
        self.script, self.argv = script, argv
        self.enabled = not any(flag in (sys.argv if argv is None else argv) for flag in WORKER_FLAGS)
        self.failed = False
        self.figures: dict = {}
        self.tables: dict[str, dict] = {}
        self.path: Path | None = None
        self._tee: _Tee | None = None
        self._err: _Tee | None = None

    def table(self, name: str, header: list[str], rows: list[list]) -> None:
        self.tables[name] = check_table(name, header, rows)

    def content(self) -> dict:
        printed = self._tee.buffer_.getvalue() if self._tee else ""
        logged = self._err.buffer_.getvalue() if self._err else ""
        figures = dict(self.figures)
        if rows := json_rows(printed + "\n" + logged):
            figures.setdefault("json_rows", rows)
        tables = dict(self.tables)
        for i, table in enumerate(markdown_tables(printed), 1):
            tables.setdefault(f"printed_{i}", table)
        return {
            "script": self.script,
            **provenance(self.argv),
            "figures": figures,
            "tables": tables,
            "printed": printed,
        }

    def write(self, where: Path | None = None) -> Path | None:
        where = results_dir() if where is None else where
        if where is None or not self.enabled:
            return None
        body = self.content()
        stamp = body["date"].replace("-", "").replace(":", "").replace("+0000", "Z")
        sha = (body["git"]["sha"] or "nogit")[:8]
        folder = where / self.script
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{stamp}-{sha}.json"
        n = 1
        while path.exists():  # two runs in one second
            n += 1
            path = folder / f"{stamp}-{sha}-{n}.json"
        path.write_text(json.dumps(body, indent=1, default=_jsonable) + "\n")
        self.path = path
        return path

    def __enter__(self) -> Recorder:
        self._tee, self._err = _Tee(sys.stdout), _Tee(sys.stderr)
        sys.stdout, sys.stderr = self._tee, self._err
        _ACTIVE.append(self)
        return self

    def __exit__(self, kind, value, tb) -> None:
        sys.stdout, sys.stderr = self._tee.stream, self._err.stream
        _ACTIVE.remove(self)
        ended_well = kind is None and not self.failed  # not on --help's SystemExit(0) either
        if ended_well:
            path = self.write()
            if path is not None:
                print(f"result file: {_relative(path)}", file=sys.stderr)


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def _jsonable(x):
    """numpy scalars and arrays, paths, tuples of the figures, as JSON takes them."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, (Path, set, frozenset)):
        return str(x) if isinstance(x, Path) else sorted(x)
    return repr(x)


def record(script: str, argv: list[str] | None = None) -> Recorder:
    """`with record("name") as rec:` around a benchmark's work (see the module docstring)."""
    return Recorder(script, argv)


def run(script: str, main, argv: list[str] | None = None):
    """`main()` recorded as `script`; its return value (a non-zero exit code: nothing written)."""
    with record(script, argv) as rec:
        code = main()
        rec.failed = code not in (None, 0)
    return code


def current() -> Recorder | None:
    """The innermost recording run, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def add_figures(**named) -> None:
    """Figures of the current run, by name (nothing when no run records)."""
    if rec := current():
        rec.figures.update(named)


def add_table(name: str, header: list[str], rows: list[list]) -> None:
    """A printed table of the current run (nothing when no run records)."""
    if rec := current():
        rec.table(name, header, rows)

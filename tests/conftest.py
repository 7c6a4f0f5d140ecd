"""Test setup: 8 simulated CPU devices (set before jax is imported) and shared fixtures."""

import atexit
import os
import shutil
import tempfile
from importlib.metadata import version

from jaxtrain.host import has_accelerator

if "JAX_PLATFORMS" not in os.environ and not has_accelerator():
    os.environ["JAX_PLATFORMS"] = "cpu"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
# Deviceless GPU compiles (compile-only H100s) skip XLA's GEMM autotuning: with no GPU to time
# candidates on, it still compiles each of them, which doubled every H100 compile here. What the
# tests check (that a program compiles and fits, its kernels and collectives) does not depend on
# which tiling a GEMM gets; a real GPU (benchmarks/) autotunes as usual. Not under jax 0.11
# (`make test-jax011`), whose compiler then finds no tiling for its Triton GEMM fusions.
if "xla_gpu_autotune_level" not in os.environ["XLA_FLAGS"] and not version("jax").startswith("0.11."):
    os.environ["XLA_FLAGS"] += " --xla_gpu_autotune_level=0"
# The suite's programs are tiny and run for milliseconds: most of its time went to LLVM optimising
# their machine code. Unoptimised codegen halved the slowest files (test_moe 402 -> 143 s,
# test_generate 269 -> 87 s on 2 cores). It changes no HLO and no buffer (memory figures and
# collectives are read before codegen) and keeps IEEE semantics (no fast-math either way); only
# the odd last bit of an f32 sum may differ from the optimised build (tiny.yaml, 10 steps: 8 of
# 10 losses bit-identical, the rest within 1e-7). Every comparison here runs under the same flags.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# One persistent compilation cache for the whole session, in-process and CLI subprocesses alike
# (they inherit the environment): the suite compiles the same tiny programs again and again.
# XLA:CPU compiles deterministically, so a cached executable is the one a fresh compile gives
# and no oracle depends on it. Made by the first process to import this file (xdist's
# controller: its workers inherit it), removed when that process exits.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxtrain-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# Benchmark scripts the suite runs (their --help, a --tiny check) write no result file into
# benchmarks/results/ (benchmarks/result_file.py); tests of the files set their own folder.
os.environ.setdefault("JAXTRAIN_RESULTS_DIR", "off")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import collections  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

import pytest  # noqa: E402

from jaxtrain.config import load_config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(*drop: str, devices: int | None = None) -> dict:
    """This environment for a subprocess that picks its own device count (the CLI, a script
    that simulates more devices): XLA_FLAGS keeps the suite's compiler flags above but not the
    simulated device count, or sets it to `devices`. `drop`: further variables left out."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    return env


def assert_adam_weights_close(got, want, *, atol, rtol=0.0, step_bound, outliers=5e-3, err_msg=""):
    """`got` equals `want` (weights after a few Adam steps on two ways of summing the same
    gradients) within atol + rtol*|want|, but for at most a fraction `outliers` of the elements,
    which may differ by up to `step_bound` (the learning rates summed over the steps).

    Adam divides each gradient element by its own RMS, so an element whose gradient is at
    rounding level (a token seen once, a weight the loss barely reaches) moves by up to the
    learning rate in either direction depending on the last bits of its sum: another CPU, or
    another order of summation, puts a few such elements (at most an embedding row) further
    than any fixed tolerance, yet never more than the steps could move them. A wrong gradient
    moves far more elements, and the per-step losses and gradient norms the callers check
    first catch it."""
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    diff = np.abs(got - want)
    over = diff > atol + rtol * np.abs(want)
    allowed = max(1, int(outliers * diff.size))
    assert int(over.sum()) <= allowed, (
        f"{err_msg}: {int(over.sum())} of {diff.size} elements differ by more than atol {atol} "
        f"(allowed {allowed}); largest {diff.max():.3g}"
    )
    assert diff.max() <= step_bound, f"{err_msg}: an element moved {diff.max():.3g} > {step_bound:.3g}"


def tiny_config(tmp_path=None, *overrides: str):
    """configs/tiny.yaml with quiet logging, written under tmp_path."""
    base = ["logging.progress=false", "logging.tensorboard=false"]
    if tmp_path is not None:
        base.append(f"output_dir={tmp_path}")
    return load_config(os.path.join(REPO, "configs", "tiny.yaml"), [*base, *overrides])


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """Run pytest's unraisable-exception hook one report at a time.

    pytest formats each report's traceback in the thread that raised it, and XLA's and
    TensorStore's threads can raise several at once. CPython 3.12.1 crashed (segfault in
    linecache/tokenize) with two threads formatting together in CI, and xdist then hung
    replacing the worker. Reentrant: formatting can itself collect an object that
    reports."""
    hook, lock = sys.unraisablehook, threading.RLock()

    def one_at_a_time(unraisable):
        with lock:
            hook(unraisable)

    sys.unraisablehook = one_at_a_time
    # and count what each test spends making programs (pytest_runtest_protocol below)
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


# The tiers `make test-fast` leaves out (docs/testing.md), by file: what these run is their point
NOTEBOOK_FILES = {"test_notebooks.py"}
MULTIPROCESS_FILES = {"test_multiprocess.py", "test_grpo_multiprocess.py", "test_multiprocess_rows.py"}


# Tests that took over .ci/test_report.py's FAST_LIMIT seconds in a full run, one node id per line:
# `slow` (left out of `make test-fast`), written by `make test-report ARGS=--write-slow`
SLOW_LIST = os.path.join(REPO, "tests", "slow_tests.txt")


def slow_node_ids(path: str = SLOW_LIST) -> set[str]:
    with open(path) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


# Worker seconds per test file in the last full run (`make test-report ARGS=--write-slow`)
FILE_TIMES = os.path.join(REPO, "tests", "file_times.txt")


def file_seconds(path: str = FILE_TIMES) -> dict[str, float]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = [line.split() for line in f if line.strip() and not line.startswith("#")]
    return {name: float(seconds) for seconds, name in rows}


def longest_files_first(items: list) -> None:
    """Reorder `items` in place, whole files together, the longest file (tests/file_times.txt)
    first. xdist's --dist loadfile hands files to the workers in collection order, so a long
    file collected late (a multi-process fixture of minutes) ran alone at the end while the
    other worker idled. Longest-first keeps the two workers' ends together; files not listed
    (new ones) keep their order after the listed ones. Deterministic, as xdist requires of
    every worker's collection."""
    seconds = file_seconds()
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::", 1)[0], len(first_seen))

    def key(item):
        name = item.nodeid.split("::", 1)[0]
        return (-seconds.get(name, 0.0), first_seen[name])

    items.sort(key=key)  # stable: the tests of a file keep their order


def pytest_collection_modifyitems(config, items):
    """`notebook` on the notebooks' tests, `multiprocess` on the files that launch several
    processes (single tests elsewhere carry the marker themselves) and `slow` on the tests
    tests/slow_tests.txt lists (measured, not guessed: the unit tier is what runs quickly);
    then the files longest first (longest_files_first)."""
    longest_files_first(items)
    slow = slow_node_ids()
    for item in items:
        name = item.path.name
        if name in NOTEBOOK_FILES:
            item.add_marker(pytest.mark.notebook)
        if name in MULTIPROCESS_FILES:
            item.add_marker(pytest.mark.multiprocess)
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)


# What each test's own process spent making programs (CLI and worker subprocesses not counted),
# from jax.monitoring: written into the JUnit file as each test's properties, summed by
# `make test-report`. Tracing and lowering are Python; compiling is XLA (a cache hit skips it).
_JAX_DURATIONS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
}
_jax_spent: collections.Counter = collections.Counter()
_JAX_BEFORE = pytest.StashKey[dict]()


def _on_duration(event: str, seconds: float, **_) -> None:
    key = _JAX_DURATIONS.get(event)
    if key is not None:
        _jax_spent[key] += seconds
        _jax_spent[key.replace("_s", "s")] += 1


def _on_event(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _jax_spent["cache_hits"] += 1


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[_JAX_BEFORE] = dict(_jax_spent)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Before the teardown report is made (JUnit takes a test's properties from it): what the
    test's setup, call and teardown spent."""
    if call.when == "teardown" and _JAX_BEFORE in item.stash:
        before = item.stash[_JAX_BEFORE]
        for key, value in _jax_spent.items():
            if value - before.get(key, 0):
                item.user_properties.append((key, round(value - before.get(key, 0), 3)))
    return (yield)


@pytest.fixture
def repo_root():
    return REPO


def replace(cfg, **sections):
    """dataclasses.replace on nested sections: replace(cfg, train=dict(steps=3))."""
    return dataclasses.replace(
        cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()}
    )


@contextlib.contextmanager
def program_on_mesh(cfg):
    """cfg's mesh on the first devices it needs, its rules, the train program, a fresh
    state and the data iterator; yields (program, state, data) inside the mesh and rules."""
    import math

    import jax

    from jaxtrain import sharding
    from jaxtrain.data import make_data_iterator
    from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh
    from jaxtrain.trainer.program import build_program

    n = math.prod(cfg.mesh.sizes().values())
    mesh = sharding.make_mesh(cfg.mesh.sizes(), jax.devices()[:n])
    cfg = resolve_for_mesh(cfg, mesh)  # every auto, as jaxtrain train resolves them
    rules = axis_rules(cfg)
    data = make_data_iterator(
        cfg.data,
        vocab_size=cfg.model.vocab_size,
        seq_len=cfg.train.seq_len,
        global_batch_size=cfg.train.global_batch_size,
        seed=cfg.seed,
    )
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        program = build_program(cfg, mesh, rules)
        yield program, program.init(), data


# The suite's default (above) skips LLVM's optimisation of the CPU code, which halves the compile
# time of the many programs run a few times each. A program run hundreds of times (a 300-step loss
# curve, a module fixture's 50-step curve) pays for it in every step instead: optimised code ran
# the tiny step 2.3x faster (17 against 38 ms) for the same compile time, and took the 300-step
# bfloat16-state curve from 56 to 32 s (two full runs of the suite on one host). Tests marked
# `optimized_codegen` get it, in their own process (below) and in the CLI subprocesses they start
# (child_env copies this environment).
OPTIMIZED_CODEGEN = {"xla_backend_optimization_level": 2}


@contextlib.contextmanager
def optimized_codegen():
    """XLA's optimised CPU code for every program compiled inside the block, in this process and
    in the subprocesses started from it (their XLA_FLAGS). The option is part of JAX's cache key,
    so an executable compiled either way is never served for the other."""
    from jax._src import compiler

    real = compiler.get_compile_options  # the one place JAX builds a compile's options (jax 0.11/0.12)

    def get_compile_options(*args, env_options_overrides=None, **kwargs):
        overrides = {**(env_options_overrides or {}), **OPTIMIZED_CODEGEN}
        return real(*args, env_options_overrides=overrides, **kwargs)

    flags = os.environ.get("XLA_FLAGS", "")
    compiler.get_compile_options = get_compile_options
    os.environ["XLA_FLAGS"] = " ".join(
        [f for f in flags.split() if "xla_backend_optimization_level" not in f]
        + [f"--{k}={v}" for k, v in OPTIMIZED_CODEGEN.items()]
    )
    try:
        yield
    finally:
        compiler.get_compile_options = real
        os.environ["XLA_FLAGS"] = flags


@pytest.fixture(autouse=True)
def _optimized_codegen_where_marked(request):
    """Tests marked `optimized_codegen` run inside optimized_codegen()."""
    if request.node.get_closest_marker("optimized_codegen") is None:
        yield
        return
    with optimized_codegen():
        yield


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches_per_module():
    """Each test file starts with JAX's in-memory caches empty (the persistent compilation cache
    stays): an xdist worker runs hundreds of tests, and the jit caches and live executables they
    leave behind made later files run up to three times slower than alone."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()

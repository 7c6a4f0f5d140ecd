"""jaxtrain/host.py: on a CPU run, XLA's buffers are reused from one execution to the next
instead of being mapped and faulted in again (the glibc heap settings), and a user's own
malloc choice (an LD_PRELOAD allocator, MALLOC_* variables, the opt-out) is left alone and
named in the log. The oracle is the kernel's count of minor page faults (getrusage), in
fresh processes, since the heap is process-wide and set before XLA's threads start."""

import json
import os
import subprocess
import sys

import pytest

from jaxtrain import host
from tests.conftest import REPO

# A jitted function whose 64 MiB output is freed before the next call: how many pages the
# kernel faults in per call once warm, and the note configure_host left.
_PROBE = """
import json, resource, statistics
from jaxtrain import host
host.configure_host()
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.broadcast_to(x, (4096, 4096)) + 1.0)
x = jnp.ones((4096,), jnp.float32)
faults = []
for _ in range(33):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# the tuned heap grows to fit within about ten calls; the median is past that
print(json.dumps({"faults_per_call": statistics.median(faults[3:]), "note": host.note()}))
"""
_PAGES_64MIB = 64 * 2**20 // 4096
_USER_VARS = ("GLIBC_TUNABLES", "LD_PRELOAD", host.OPT_OUT)


def _users_malloc_vars() -> list[str]:
    """The environment variables through which a user chooses malloc settings."""
    return [k for k in os.environ if k.startswith("MALLOC_") or k in _USER_VARS]


def _probe(**env_extra):
    drop = {"XLA_FLAGS", *_users_malloc_vars()}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="glibc malloc settings are Linux-only")
def test_cpu_run_reuses_xla_buffers_instead_of_faulting_them_in_each_call():
    tuned = _probe(JAX_PLATFORMS="cpu")
    assert tuned["note"].startswith("host malloc: one glibc arena"), tuned
    # the default: the 64 MiB output is a fresh mmap every call, so its pages fault in again
    default = _probe(JAX_PLATFORMS="cpu", JAXTRAIN_HOST_MALLOC="system")
    assert default["note"] == "host malloc: left as chosen (JAXTRAIN_HOST_MALLOC=system)"
    assert default["faults_per_call"] > 0.9 * _PAGES_64MIB, default
    assert tuned["faults_per_call"] < 0.05 * _PAGES_64MIB, tuned


@pytest.mark.parametrize(
    "var,value",
    [
        ("MALLOC_ARENA_MAX", "4"),
        ("MALLOC_MMAP_THRESHOLD_", "131072"),
        ("GLIBC_TUNABLES", "glibc.malloc.arena_max=2"),
        ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
        (host.OPT_OUT, "system"),
    ],
)
def test_the_users_own_malloc_settings_win_and_are_named(monkeypatch, var, value):
    for k in _users_malloc_vars():
        monkeypatch.delenv(k)
    assert host._user_chose() is None
    monkeypatch.setenv(var, value)
    # named, so keep_freed_memory() logs it and never calls mallopt
    assert var in host._user_chose()
    monkeypatch.setattr(host, "_heap_note", None)
    monkeypatch.setattr(host.ctypes, "CDLL", lambda *_: pytest.fail("mallopt called over the user's choice"))
    assert host.keep_freed_memory() == f"host malloc: left as chosen ({host._user_chose()})"


def test_huge_pages_alone_combine_with_the_settings(monkeypatch):
    for k in _users_malloc_vars():
        monkeypatch.delenv(k)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    assert host._user_chose() is None


@pytest.mark.parametrize("value", ["tuned", "ON", "1"])
def test_opting_in_by_name_applies_the_settings(monkeypatch, value):
    for k in _users_malloc_vars():
        monkeypatch.delenv(k)
    monkeypatch.setenv(host.OPT_OUT, value)
    assert host._user_chose() is None


@pytest.mark.parametrize("value", ["sytem", "tcmalloc", "glibc"])
def test_a_value_it_does_not_take_is_refused_not_ignored(monkeypatch, value):
    """`sytem` must not silently keep the tuned heap, and the allocator names an older
    version took (it preloaded tcmalloc) are refused now that it does not: the error names
    the variable, the value and the values it takes."""
    monkeypatch.setenv(host.OPT_OUT, value)
    monkeypatch.setattr(host, "_heap_note", None)
    with pytest.raises(host.UnknownSettingError) as e:
        host.keep_freed_memory()
    assert str(e.value).startswith(f"{host.OPT_OUT}={value!r}: expected one of system, off, 0")

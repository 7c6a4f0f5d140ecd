"""jaxtrain/host_malloc.py: on a CPU run, XLA's buffers are reused from one execution to
the next instead of being mapped and faulted in again, by tcmalloc where a CLI start
preloads it, else by glibc settings. The oracles are the kernel's count of minor page
faults (getrusage) and its map of the process (/proc/self/maps: which allocator is
loaded), in fresh processes, since the allocator is process-wide and chosen before XLA's
threads start."""

import json
import os
import subprocess
import sys

import pytest

from jaxtrain import host_malloc
from tests.conftest import REPO

# A jitted function whose 64 MiB output is freed before the next call: how many pages the
# kernel faults in per call once warm, and the note configure_host left.
# PRELOAD=1 starts it as the CLI starts: re-executed with tcmalloc where it is found.
_PROBE = """
import json, os, resource, statistics
from jaxtrain import host_malloc
from jaxtrain.platform import configure_host
if os.environ.get("PRELOAD"):
    host_malloc.preload_tcmalloc(cpu=True)
configure_host()
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.broadcast_to(x, (4096, 4096)) + 1.0)
x = jnp.ones((4096,), jnp.float32)
faults = []
for _ in range(33):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# the tuned heap grows to fit within about ten calls; the median is past that
maps = open("/proc/self/maps").read()
print(json.dumps({"faults_per_call": statistics.median(faults[3:]), "note": host_malloc.note(),
                  "tcmalloc_mapped": "libtcmalloc" in maps}))
"""
_PAGES_64MIB = 64 * 2**20 // 4096


_USER_VARS = ("GLIBC_TUNABLES", "LD_PRELOAD", host_malloc.OPT_OUT, host_malloc.PRELOADED)
_TCMALLOC = host_malloc.find_tcmalloc()
_needs_tcmalloc = pytest.mark.skipif(
    _TCMALLOC is None, reason="no tcmalloc here (make venv fetches Debian's libtcmalloc-minimal4)"
)


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
    assert tuned["note"] and "host malloc" in tuned["note"]
    # the default: the 64 MiB output is a fresh mmap every call, so its pages fault in again
    default = _probe(JAX_PLATFORMS="cpu", JAXTRAIN_HOST_MALLOC="system")
    assert default["note"] is None
    assert default["faults_per_call"] > 0.9 * _PAGES_64MIB, default
    assert tuned["faults_per_call"] < 0.05 * _PAGES_64MIB, tuned
    assert not tuned["tcmalloc_mapped"] and not default["tcmalloc_mapped"]  # not a CLI start


@_needs_tcmalloc
@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD is Linux's")
def test_a_cli_start_on_cpu_runs_again_under_tcmalloc_which_reuses_xla_buffers():
    preloaded = _probe(JAX_PLATFORMS="cpu", PRELOAD="1")
    assert preloaded["tcmalloc_mapped"], preloaded
    note = f"host malloc: tcmalloc ({_TCMALLOC}), preloaded by the CLI"
    assert preloaded["note"].startswith(note), preloaded
    assert preloaded["faults_per_call"] < 0.05 * _PAGES_64MIB, preloaded
    # asking for glibc's settings keeps them, and keeps tcmalloc out
    glibc = _probe(JAX_PLATFORMS="cpu", PRELOAD="1", JAXTRAIN_HOST_MALLOC="glibc")
    assert not glibc["tcmalloc_mapped"] and glibc["note"].startswith("host malloc: one glibc arena"), glibc
    assert glibc["faults_per_call"] < 0.05 * _PAGES_64MIB, glibc


class _Exec(Exception):
    """Raised by the stand-in for os.execve: the decision tests must not replace pytest."""


@pytest.fixture
def no_exec(monkeypatch):
    """os.execve replaced by a recorder that raises _Exec with (path, argv, env)."""
    for k in _users_malloc_vars():
        monkeypatch.delenv(k)

    def execve(path, argv, env):
        raise _Exec(path, argv, env)

    monkeypatch.setattr(host_malloc.os, "execve", execve)
    monkeypatch.setattr(host_malloc, "find_tcmalloc", lambda: "/lib/libtcmalloc_minimal.so.4")
    monkeypatch.setattr(host_malloc.platform, "system", lambda: "Linux")
    monkeypatch.setattr(host_malloc.platform, "libc_ver", lambda: ("glibc", "2.36"))


def test_the_preload_reruns_the_same_command_line_with_tcmalloc_first(no_exec, monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/lib/libother.so")
    with pytest.raises(_Exec) as e:
        host_malloc.preload_tcmalloc(cpu=True)
    path, argv, env = e.value.args
    assert path == sys.executable and argv == [sys.executable, *sys.orig_argv[1:]]
    assert env["LD_PRELOAD"] == "/lib/libtcmalloc_minimal.so.4:/lib/libother.so"
    assert env[host_malloc.PRELOADED] == "/lib/libtcmalloc_minimal.so.4"


@pytest.mark.parametrize(
    "cpu,env",
    [
        (False, {}),  # a TPU or GPU host: device memory is not malloc's
        (True, {host_malloc.OPT_OUT: "glibc"}),
        (True, {host_malloc.OPT_OUT: "system"}),
        (True, {"MALLOC_ARENA_MAX": "2"}),  # the user's own malloc settings win
        (True, {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}),
        (True, {host_malloc.PRELOADED: "/lib/libtcmalloc_minimal.so.4"}),  # already re-executed
    ],
)
def test_no_preload_where_it_does_not_apply(no_exec, monkeypatch, cpu, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert host_malloc.preload_tcmalloc(cpu=cpu) is None


def test_tcmalloc_asked_for_and_not_found_is_an_error_naming_where_it_looked(no_exec, monkeypatch):
    monkeypatch.setattr(host_malloc, "find_tcmalloc", lambda: None)
    monkeypatch.setenv(host_malloc.OPT_OUT, "tcmalloc")
    with pytest.raises(host_malloc.UnknownSettingError) as e:
        host_malloc.preload_tcmalloc(cpu=True)
    assert str(e.value).startswith(f"{host_malloc.OPT_OUT}='tcmalloc': no tcmalloc library")
    assert str(host_malloc.VENV_DIR) in str(e.value) and "make venv" in str(e.value)
    # unset (the default) without the library: no error, the glibc settings apply later
    monkeypatch.delenv(host_malloc.OPT_OUT)
    assert host_malloc.preload_tcmalloc(cpu=True) is None


def test_find_tcmalloc_prefers_the_venv_copy(monkeypatch, tmp_path):
    venv, system = tmp_path / "venv", tmp_path / "usr-lib"
    system.mkdir()
    (system / "libtcmalloc.so.4").write_bytes(b"")
    monkeypatch.setattr(host_malloc, "VENV_DIR", venv)
    monkeypatch.setattr(host_malloc, "SYSTEM_DIRS", (str(system),))
    assert host_malloc.find_tcmalloc() == str(system / "libtcmalloc.so.4")
    venv.mkdir()
    (venv / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert host_malloc.find_tcmalloc() == str(venv / "libtcmalloc_minimal.so.4")
    monkeypatch.setattr(host_malloc, "SYSTEM_DIRS", ())
    (venv / "libtcmalloc_minimal.so.4").unlink()
    assert host_malloc.find_tcmalloc() is None


@pytest.mark.parametrize(
    "var,value",
    [
        ("MALLOC_ARENA_MAX", "4"),
        ("MALLOC_MMAP_THRESHOLD_", "131072"),
        ("GLIBC_TUNABLES", "glibc.malloc.arena_max=2"),
        ("LD_PRELOAD", "/usr/lib/libtcmalloc_minimal.so.4"),
        (host_malloc.OPT_OUT, "system"),
    ],
)
def test_the_users_own_malloc_settings_win(monkeypatch, var, value):
    for k in _users_malloc_vars():
        monkeypatch.delenv(k)
    assert host_malloc._user_chose() is None
    monkeypatch.setenv(var, value)
    # named, so keep_freed_memory() returns None before calling mallopt
    assert var in host_malloc._user_chose()


def test_huge_pages_alone_combine_with_the_settings(monkeypatch):
    for k in _users_malloc_vars():
        monkeypatch.delenv(k)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    assert host_malloc._user_chose() is None


@pytest.mark.parametrize("value", ["tuned", "ON", "1", "glibc", "tcmalloc"])
def test_opting_in_by_name_applies_the_settings(monkeypatch, value):
    for k in _users_malloc_vars():
        monkeypatch.delenv(k)
    monkeypatch.setenv(host_malloc.OPT_OUT, value)
    assert host_malloc._user_chose() is None


def test_a_misspelt_opt_out_is_refused_not_ignored(monkeypatch):
    """`sytem` must not silently keep the tuned heap: the error names the variable, the
    value and the values it takes."""
    monkeypatch.setenv(host_malloc.OPT_OUT, "sytem")
    with pytest.raises(host_malloc.UnknownSettingError) as e:
        host_malloc.keep_freed_memory()
    assert str(e.value).startswith(f"{host_malloc.OPT_OUT}='sytem': expected one of system, off, 0")

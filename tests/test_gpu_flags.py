"""jaxtrain/gpu_flags.py: the XLA flags a GPU process starts with.

Oracles: the installed XLA itself, which aborts at start on a flag it does not know (the
control case shows that it does), and the environment a fresh process ends up with.
"""

from __future__ import annotations

import os
import subprocess
import sys

from jaxtrain import gpu_flags


def _start_xla(flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(2).sum()))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_default_is_a_flag_this_xla_knows():
    flags, added = gpu_flags.merged("")
    assert len(added) == len(gpu_flags.DEFAULTS)
    ok = _start_xla(flags)
    assert ok.returncode == 0 and ok.stdout.strip() == "2.0", ok.stderr[-2000:]
    unknown = _start_xla(flags + " --xla_gpu_no_such_flag_jaxtrain=true")  # the control
    assert unknown.returncode != 0 and "Unknown flag" in unknown.stderr


def test_the_users_flags_win_and_the_opt_out_leaves_xla_flags_alone():
    user = "--xla_gpu_enable_pipelined_all_gather=false --xla_dump_to=/tmp/x"
    code = (
        "import os; from jaxtrain import host; host.configure_host(); "
        "print(os.environ.get('XLA_FLAGS', '')); print(host.note())"
    )
    run = lambda extra: subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "JAX_PLATFORMS": "cuda", "XLA_FLAGS": user, **extra},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    flags, line = run({})
    tokens = flags.split()
    assert "--xla_gpu_enable_pipelined_all_gather=false" in tokens  # the user's value, once
    assert not any(t.startswith("--xla_gpu_enable_pipelined_all_gather=true") for t in tokens)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in tokens
    assert flags.endswith(user)  # the user's come last (XLA takes the last of a repeated flag)
    assert line.startswith(f"GPU XLA flags: {len(gpu_flags.DEFAULTS) - 1} launch defaults added")
    flags, line = run({gpu_flags.OPT_OUT: "off"})
    assert flags == user and "left as given" in line

"""One compile per distinct deviceless program in a test module.

The suite's persistent compilation cache (tests/conftest.py) cannot serve compile-only TPU and
GPU devices: JAX writes their executables but cannot read them back ("PjRtCompiler must be
constructed with a Client to call Deserialize"), so a deviceless program that two tests (or a
test and the planner it calls) compile is compiled twice. `each_program_compiled_once` makes
`jaxtrain.planning.compile`'s step compiles reuse the executable of a program already compiled
in the module: the config, its resolution, the program and its lowering are all made afresh as
before, and only the device compiler's run on a lowered module identical to one already
compiled (the same StableHLO text, devices and compiler options) is not repeated. XLA compiles
deterministically, so the reused executable is the one a fresh compile gives.
"""

from __future__ import annotations

import contextlib
import hashlib

from jaxtrain.planning import compile as deviceless


@contextlib.contextmanager
def each_program_compiled_once():
    """Within the block, `compile._compile_step` compiles each distinct lowered step once;
    yields the dict of executables (key: text digest, devices, compiler options)."""
    real = deviceless._compile_step
    done: dict = {}

    def compile_step(cfg, mesh, rules=None, compiler_options=None):
        lowered = deviceless.lower_step(cfg, mesh, rules)
        key = (
            hashlib.sha256(lowered.as_text().encode()).hexdigest(),
            tuple(mesh.axis_names),
            tuple(str(d) for d in mesh.devices.flat),
            repr(sorted((compiler_options or {}).items())),
        )
        if key not in done:
            done[key] = lowered.compile(compiler_options=compiler_options)
        return done[key]

    deviceless._compile_step = compile_step
    try:
        yield done
    finally:
        deviceless._compile_step = real
        done.clear()

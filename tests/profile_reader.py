"""Reading a jax.profiler trace with XProf's own converter (the code behind `xprof --logdir`):
the steps a trace holds and the named scopes of the ops it ran. XProf writes caches next to
the file it reads, so it reads a private copy."""

import contextlib
import json
import os
import re
import shutil
import tempfile

from xprof.convert import raw_to_tool_data


@contextlib.contextmanager
def _private_copy(xplane_path):
    folder = tempfile.mkdtemp(prefix="xplane-read-")
    try:
        copy = os.path.join(folder, os.path.basename(xplane_path))
        shutil.copyfile(xplane_path, copy)
        yield copy
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _trace_events(path):
    data, _ = raw_to_tool_data.xspace_to_tool_data([path], "trace_viewer", {"use_saved_result": False})
    if data is None:
        raise RuntimeError(f"xprof could not convert {path}")
    if isinstance(data, bytes):
        data = data.decode()
    return [e for e in json.loads(data).get("traceEvents", []) if e]


def steps_in_trace(xplane_path, name="train"):
    """The step numbers of the trace's `StepTraceAnnotation(name, step_num=...)` events."""
    with _private_copy(xplane_path) as path:
        events = _trace_events(path)
    steps = set()
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") == "X" and "step_num" in args and args.get("step_name", "").startswith(name + " "):
            steps.add(int(args["step_num"]))
    return sorted(steps)


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def scope_names(xplane_path):
    """Every part of the ops' `op_name` metadata paths in the modules the trace ran
    (`transpose(jvp(forward))` gives itself and `forward`)."""
    names = set()
    with _private_copy(xplane_path) as path:
        ran = {(e.get("args") or {}).get("hlo_module") for e in _trace_events(path)} - {None}
        raw_to_tool_data.xspace_to_tool_names([path])  # writes <module>(<id>).hlo_proto.pb beside it
        suffix = ".hlo_proto.pb"
        modules = sorted(f[: -len(suffix)] for f in os.listdir(os.path.dirname(path)) if f.endswith(suffix))
        for module in modules:
            if re.sub(r"\(\d+\)$", "", module) not in ran:
                continue
            options = {"module_name": module, "type": "long_txt", "show_metadata": 1}
            data, _ = raw_to_tool_data.xspace_to_tool_data(
                [path], "graph_viewer", {"graph_viewer_options": options}
            )
            if data is not None:
                names.update(
                    _OP_NAME.findall(data.decode(errors="replace") if isinstance(data, bytes) else data)
                )
    parts = set()
    for op in names:
        for part in op.split("/"):
            inner = part
            parts.add(part)
            while m := re.fullmatch(r"[A-Za-z_]\w*\((.*)\)", inner):
                inner = m.group(1)
                parts.add(inner)
    parts.discard("")
    return parts

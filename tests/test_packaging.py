"""Import names: everything lives under `jaxtrain.`, so a user's own `models.py`,
`sharding.py` or `pallas_kernels/` package can never shadow ours, and the reusable
rooms import no more than they promise.

Every check runs in a fresh interpreter whose working directory is a folder of the
user's (the first entry of `sys.path` for `python -c` and `python -m`).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO

BIN = os.path.dirname(sys.executable)
ENV = {"JAX_PLATFORMS": "cpu", "PATH": f"{BIN}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}


@pytest.fixture
def user_folder(tmp_path):
    """A project of the user's with its own top-level `models`, `sharding` and
    `pallas_kernels`; importing any of them from our code would fail loudly."""
    for name in ("models", "sharding"):
        message = f"the user's own {name}.py was imported"
        (tmp_path / f"{name}.py").write_text(f"raise ImportError({message!r})\n")
    pkg = tmp_path / "pallas_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('the user\\'s own pallas_kernels/ was imported')\n")
    return tmp_path


def run(args, cwd, timeout=300):
    return subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_cli_trains_beside_a_users_models_py(user_folder):
    config = os.path.join(REPO, "configs", "tiny.yaml")
    common = ["train.steps=2", "logging.progress=false", "logging.tensorboard=false"]
    cli = run([f"{BIN}/jaxtrain", "train", config, f"output_dir={user_folder}/a", *common], user_folder)
    assert cli.returncode == 0, cli.stderr[-3000:]
    module_args = [sys.executable, "-m", "jaxtrain", "train", config, f"output_dir={user_folder}/b"]
    module = run([*module_args, *common], user_folder)
    assert module.returncode == 0, module.stderr[-3000:]
    losses = [
        [json.loads(line)["loss"] for line in (user_folder / d / "metrics.jsonl").read_text().splitlines()]
        for d in "ab"
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 2


def test_notebook_style_imports_beside_a_users_modules(user_folder):
    code = textwrap.dedent("""
        import jaxtrain.models, jaxtrain.sharding, jaxtrain.pallas_kernels
        from jaxtrain.models import Transformer, ModelConfig
        from jaxtrain.sharding import make_mesh, FSDP_TENSOR
        try:
            import models
        except ImportError as e:
            print("user:", e)
        import os
        print(os.path.dirname(jaxtrain.models.__file__))
    """)
    out = run([sys.executable, "-c", code], user_folder)
    assert out.returncode == 0, out.stderr
    assert "user: the user's own models.py was imported" in out.stdout  # theirs is still theirs
    assert out.stdout.strip().splitlines()[-1] == os.path.join(REPO, "models")


def test_no_generic_top_level_names_installed(tmp_path):
    code = (
        "import importlib.util, json; "
        "print(json.dumps({n: importlib.util.find_spec(n) is not None "
        "for n in ('models', 'sharding', 'pallas_kernels', 'jaxtrain')}))"
    )
    out = run([sys.executable, "-c", code], tmp_path)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert found == {"models": False, "sharding": False, "pallas_kernels": False, "jaxtrain": True}


def _modules_after(imports: str, cwd) -> set[str]:
    code = f"import sys, json; {imports}; print(json.dumps(sorted(sys.modules)))"
    out = run([sys.executable, "-c", code], cwd)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout))


def _roots(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


# What jax, numpy and Pallas pull in by themselves: the budget of the two reusable rooms.
JAX_BASELINE = "import jax, numpy, jax.experimental.pallas, jax.experimental.mesh_utils"


@pytest.mark.parametrize(
    "room, allowed",
    [
        ("sharding", ("jaxtrain", "jaxtrain.sharding")),
        ("pallas_kernels", ("jaxtrain", "jaxtrain.pallas_kernels")),
    ],
)
def test_reusable_rooms_import_only_jax_and_numpy(tmp_path, room, allowed):
    baseline = _roots(_modules_after(JAX_BASELINE, tmp_path))
    loaded = _modules_after(f"import jaxtrain.{room}", tmp_path)
    extra_roots = _roots(loaded) - baseline - {"jaxtrain"}
    assert not extra_roots, f"jaxtrain.{room} pulls in {sorted(extra_roots)}"
    ours = {m for m in loaded if m.split(".")[0] == "jaxtrain"}
    strays = {m for m in ours if not any(m == a or m.startswith(a + ".") for a in allowed)}
    assert not strays, f"jaxtrain.{room} imports {sorted(strays)}"


def test_models_never_import_the_trainer(tmp_path):
    loaded = _modules_after("import jaxtrain.models, jaxtrain.models.hf", tmp_path)
    ours = {m for m in loaded if m.startswith("jaxtrain.")}
    rooms = ("jaxtrain.models", "jaxtrain.sharding", "jaxtrain.pallas_kernels")
    strays = sorted(m for m in ours if not m.startswith(rooms))
    assert not strays, f"jaxtrain.models imports trainer modules {strays}"


def test_config_is_read_without_jax(tmp_path):
    """The CLI reads and validates a config before any backend starts, and a bad one is
    refused without paying for JAX: `jaxtrain.config` (and the model's config within it)
    imports no jax, flax or optax."""
    loaded = _modules_after("import jaxtrain.config, jaxtrain.models.config", tmp_path)
    heavy = sorted(m for m in loaded if m.split(".")[0] in ("jax", "flax", "optax", "orbax"))
    assert not heavy, f"jaxtrain.config imports {heavy[:5]}"


def _import_graph() -> dict[str, set[str]]:
    """{module: the jaxtrain modules it imports}, from the source of every module of the four
    import packages, function-local imports included (a cycle hidden inside a function is a
    cycle). `from pkg import name` counts as importing pkg.name when that is a module."""
    import ast
    from pathlib import Path

    roots = {"jaxtrain": "jaxtrain", "jaxtrain.models": "models", "jaxtrain.sharding": "sharding"}
    roots["jaxtrain.pallas_kernels"] = "pallas_kernels"
    files = {}
    for package, folder in roots.items():
        for path in (Path(REPO) / folder).rglob("*.py"):
            parts = [
                p for p in path.relative_to(Path(REPO) / folder).with_suffix("").parts if p != "__init__"
            ]
            files[".".join([package, *parts])] = path
    graph = {}
    for name, path in files.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxtrain"):
                edges |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                    for a in node.names
                }
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name.startswith("jaxtrain")}
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


def test_no_import_cycles_among_jaxtrain_modules():
    graph = _import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module, path):
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_model_files_hold_no_platform_branch():
    """Backend choices reach the model as resolved config values (planning/resolve.py); no
    file in models/ asks which platform it runs on."""
    import ast
    from pathlib import Path

    asks = {"default_backend", "platform", "device_kind", "devices", "local_devices", "backends"}
    names = {"cpu", "tpu", "gpu", "cuda", "rocm"}
    found = []
    for path in sorted((Path(REPO) / "models").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in asks:
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.Compare):
                consts = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant)]
                found += [f"{path.name}:{node.lineno} == {v!r}" for v in consts if v in names]
    assert not found, found

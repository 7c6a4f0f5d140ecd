"""The kernel room's structure (``pallas_kernels/``), read from the source with ``ast``.

Its modules use one another only through public names, their imports form no
cycle (function-level imports included: a lazy import must not hide one), no
module is loaded through ``importlib``, and nothing outside jax, numpy and the
standard library is imported (the room is reusable alone; see DESIGN.md).
No jax needed: these tests only parse files.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOM = Path(__file__).resolve().parent.parent / "pallas_kernels"
PACKAGE = "jaxtrain.pallas_kernels"
INIT = "__init__"
ALLOWED_ROOTS = {"jax", "numpy"} | set(sys.stdlib_module_names)


def _room_modules() -> set[str]:
    return {p.stem for p in ROOM.glob("*.py")}


class _Import:
    def __init__(self, target: str, names: list[str], line: int):
        self.target, self.names, self.line = target, names, line  # target: a room module


def _scan(source: str, modules: set[str]) -> tuple[list[_Import], list[str]]:
    """(imports of room modules, problems) for one module's source."""
    tree = ast.parse(source)
    imports: list[_Import] = []
    problems: list[str] = []
    aliases: dict[str, str] = {}  # local name bound to a room module -> that module

    def room_module(dotted: str) -> str | None:
        if dotted == PACKAGE:
            return INIT
        if dotted.startswith(PACKAGE + "."):
            return dotted[len(PACKAGE) + 1 :].split(".")[0]
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]
                if root == "importlib":
                    problems.append(f"line {node.lineno}: imports importlib")
                target = room_module(alias.name)
                if target is not None:
                    imports.append(_Import(target, [], node.lineno))
                    if alias.asname:
                        aliases[alias.asname] = target
                elif root not in ALLOWED_ROOTS:
                    problems.append(f"line {node.lineno}: imports {alias.name} (only jax, numpy, stdlib)")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = PACKAGE if node.level == 1 else None
                dotted = base + ("." + node.module if node.module else "") if base else "?"
            else:
                dotted = node.module or ""
            names = [a.name for a in node.names]
            if dotted.split(".")[0] == "importlib":
                problems.append(f"line {node.lineno}: imports from importlib")
            target = room_module(dotted)
            if target is None:
                if dotted.split(".")[0] not in ALLOWED_ROOTS:
                    problems.append(f"line {node.lineno}: imports from {dotted} (only jax, numpy, stdlib)")
                continue
            if target == INIT:
                # `from jaxtrain.pallas_kernels import x`: a submodule, or the package's namespace.
                for a in node.names:
                    if a.name in modules:
                        imports.append(_Import(a.name, [], node.lineno))
                        aliases[a.asname or a.name] = a.name
                    else:
                        imports.append(_Import(INIT, [a.name], node.lineno))
            else:
                imports.append(_Import(target, names, node.lineno))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
            problems.append(f"line {node.lineno}: calls __import__")
        elif (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
            and node.value.func.attr == "import_module"
            and node.value.args
            and isinstance(node.value.args[0], ast.Constant)
        ):
            # m = importlib.import_module("jaxtrain.pallas_kernels.x"): m is x too.
            target = room_module(str(node.value.args[0].value))
            if target is not None:
                imports.append(_Import(target, [], node.lineno))
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        aliases[t.id] = target
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
        ):
            used = f"{node.value.id}.{node.attr}"
            problems.append(f"line {node.lineno}: uses {used} of {aliases[node.value.id]}")
    for imp in imports:
        for name in imp.names:
            if name.startswith("_"):
                problems.append(f"line {imp.line}: imports private {name} from {imp.target}")
    return imports, problems


def _graph() -> dict[str, set[str]]:
    modules = _room_modules()
    graph = {}
    for m in sorted(modules):
        imports, _ = _scan((ROOM / f"{m}.py").read_text(), modules)
        graph[m] = {i.target for i in imports} - {m}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


@pytest.mark.parametrize("module", sorted(_room_modules()))
def test_module_uses_public_names_only_and_no_importlib(module):
    _, problems = _scan((ROOM / f"{module}.py").read_text(), _room_modules())
    assert not problems, f"pallas_kernels/{module}.py: " + "; ".join(problems)


def test_imports_are_acyclic_and_modules_never_import_the_package():
    graph = _graph()
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    through_init = sorted(m for m, deps in graph.items() if m != INIT and INIT in deps)
    assert not through_init, f"modules importing the package namespace (a cycle via __init__): {through_init}"


@pytest.mark.parametrize(
    "source, problem",
    [
        ("import importlib\n", "importlib"),
        ("from jaxtrain.pallas_kernels.flash_attention import _Config\n", "private _Config"),
        ("import jaxtrain.pallas_kernels.blocks as b\nb._chunk(1)\n", "b._chunk"),
        ("from jaxtrain.pallas_kernels import blocks\nblocks._merge\n", "blocks._merge"),
        ("from .sharded import _any_length\n", "private _any_length"),
        ("fa = importlib.import_module('jaxtrain.pallas_kernels.flash_attention')\nfa._x\n", "fa._x"),
        ("import flax\n", "flax"),
        ("from jaxtrain.sharding import rules\n", "jaxtrain.sharding"),
    ],
)
def test_checker_catches(source, problem):
    _, problems = _scan(source, _room_modules())
    assert any(problem in p for p in problems), problems


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None

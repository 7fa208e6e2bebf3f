"""Dependencies point down: each part of the package imports only from the parts below it (STYLE.md 18).

The order, bottom first: the driver runtime (cuda), the kernels' launchers and the graph manager, the KV cache,
the model, the engine's config (built once at the top and passed down), the runner, the engine, then the APIs
over it: LLM, generate, chat, the package's public names (its __init__), the server, the command line. Every
import in every module counts, those inside functions too: a lazy import from above is still a dependency on it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Where each top-level part of the package sits; a module may import from its own part and the ones below.
LAYERS = {
    "cuda": 0, "cuda_src": 0, "demo": 0,  # demo: the demo model's files and their paths
    "kernels": 1, "graphs": 1,
    "kv": 2,
    "model": 3,
    "config": 4,
    "runner": 5,
    "engine": 6,
    "llm": 7,
    "generate": 8,
    "chat": 9,
    "__init__": 10,  # `import tileinfer`: the public names
    "server": 11,
    "cli": 12, "sizing_cli": 12,
    "__main__": 13,
}


def package_files() -> dict[str, Path]:
    """Every module of the package by dotted name, graphs/ and cuda_src/ as tileinfer.graphs and
    tileinfer.cuda_src (pyproject's package-dir)."""
    files = {}
    for base, prefix in ((ROOT / "tileinfer", "tileinfer"), (ROOT / "graphs", "tileinfer.graphs"),
                         (ROOT / "cuda_src", "tileinfer.cuda_src")):
        for path in base.rglob("*.py"):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join((prefix, *parts))] = path
    return files


def imported_modules(name: str, path: Path, files: dict[str, Path]) -> list[tuple[str, int]]:
    """(dotted name, line) of every tileinfer module `path` imports, relative imports resolved; `from A import b`
    counts as importing A.b where that is a module of `files`, else as importing A."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            found += [(f"{module}.{alias.name}" if f"{module}.{alias.name}" in files else module, node.lineno)
                      for alias in node.names]
    return [(module, line) for module, line in found if module == "tileinfer" or module.startswith("tileinfer.")]


def part(module: str) -> str:
    """The top-level part of the package a module belongs to ("tileinfer" itself: "__init__", its public names)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(files: dict[str, Path]) -> list[str]:
    """Each import of a module in `files` from a layer above its own, as "module:line (part) imports ..."."""
    wrong = []
    for name, path in sorted(files.items()):
        here = part(name)
        for module, line in imported_modules(name, path, files):
            there = part(module)
            if LAYERS[there] > LAYERS[here]:
                wrong.append(f"{name}:{line} ({here}) imports {module} ({there})")
    return wrong


def test_every_part_of_the_package_has_a_layer():
    parts = {part(name) for name in package_files()}
    assert parts - set(LAYERS) == set(), "a new top-level module: give it a place in LAYERS"


def test_no_module_imports_from_a_layer_above_it():
    assert upward_imports(package_files()) == []


@pytest.mark.parametrize("source, upward", [
    ("from ..engine import Engine\n", True),        # runner -> engine: up
    ("from ..kv import Sequence\n", False),         # runner -> kv: down
    ("def f():\n    from .. import LLM\n", True),   # a lazy import of the package's public names
    ("import tileinfer.cli\n", True),
    ("from . import gpu\n", False),                 # its own part
])
def test_the_check_sees_an_import_from_above(tmp_path, source, upward):
    """The checker itself: a module of the runner importing each of these is (or is not) reported."""
    path = tmp_path / "probe.py"
    path.write_text(source)
    found = upward_imports(package_files() | {"tileinfer.runner.probe": path})
    assert any(line.startswith("tileinfer.runner.probe:") for line in found) == upward

"""Imports flow one way: parallel <- models <- runtime (engine, scheduler <- loop <- frontend) <- launch, scripts.

Read from the source with ``ast`` (lazy imports inside functions count too), so nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYERS = ["parallel", "models", "runtime", "launch", "scripts"]  # each may import only those before it
# Inside runtime/: the packages a module (left) must not import (right).
RUNTIME_FORBIDDEN = {
    "runtime.engine": ("runtime.scheduler", "runtime.frontend", "runtime.loop", "runtime.worker"),
    "runtime.scheduler": ("runtime.engine", "runtime.frontend", "runtime.loop", "runtime.worker"),
    "runtime.loop": ("runtime.frontend",),
    "runtime.output": ("runtime.frontend",),
    "runtime.worker": ("runtime.frontend",),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    files = [REPO / "launch.py"] + [p for layer in LAYERS for p in (REPO / layer).rglob("*.py")]
    return {_module_name(p): p for p in files if p.is_file()}


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports, resolved to the longest known module name."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    found = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(path, known) - {name} for name, path in known.items()}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _layer(name: str) -> int:
    return LAYERS.index(name.split(".")[0])


def test_layers_import_downwards() -> None:
    bad = [f"{m} -> {d}" for m, deps in _graph().items() for d in deps if _layer(d) > _layer(m)]
    assert not bad, bad


def test_runtime_packages_import_downwards() -> None:
    bad = [
        f"{m} -> {d}"
        for m, deps in _graph().items()
        for d in deps
        for pkg, forbidden in RUNTIME_FORBIDDEN.items()
        if _within(m, pkg) and any(_within(d, f) for f in forbidden)
    ]
    assert not bad, bad


def test_no_import_cycles() -> None:
    # A module importing its own package's __init__ (which re-exports it) is the usual package shape, not a cycle.
    graph = {m: {d for d in deps if not _within(m, d)} for m, deps in _graph().items()}
    done: set[str] = set()

    def visit(m: str, stack: list[str]) -> None:
        if m in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
        if m in done:
            return
        for d in sorted(graph[m]):
            visit(d, stack + [m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])

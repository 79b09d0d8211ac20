"""tpweave's imports flow one way, runtime -> ops -> models -> tuning -> compiler -> engine -> server -> bench -> cli,
with no import cycle anywhere (function-level imports included; `if TYPE_CHECKING:` blocks excluded).
Parsed from the sources, nothing imported."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import tpweave
from tpweave.compiler import api

SRC = Path(tpweave.__file__).parent
# Lower layers never import higher ones. log.py and version.py are leaves every layer may use; the package's
# __init__ (the public facade) and __main__ sit on top.
LAYERS = [
    "log",
    "version",
    "runtime",
    "ops",
    "models",
    "tuning",
    "compiler",
    "engine",
    "server",
    "bench",
    "cli",
    "__main__",
    "__init__",
]


def _module_name(path: Path) -> str:
    parts = ["tpweave", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in SRC.rglob("*.py")}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported tpweave module, line) for every import in the file: `from a.b import c` names a.b.c
    when that is a module, else a.b."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("tpweave")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if not base.startswith("tpweave"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in modules else base, node.lineno))
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return LAYERS.index(top)


def import_graph() -> dict[str, list[tuple[str, int]]]:
    modules = _modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def upward_imports(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    return [
        f"{src}:{line} imports {dst} ({LAYERS[_layer(src)]} may not import {LAYERS[_layer(dst)]})"
        for src, edges in graph.items()
        for dst, line in edges
        if _layer(dst) > _layer(src)
    ]


def cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a module importing itself)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or any(w == v for w, _ in graph.get(v, [])):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_imports_flow_one_way_without_cycles():
    graph = import_graph()
    assert len(graph) > 40 and any(edges for edges in graph.values())
    assert not upward_imports(graph), "\n".join(upward_imports(graph))
    assert not cycles(graph), cycles(graph)


def test_the_checker_sees_cycles_and_upward_imports():
    """The checks above would fail on the layouts they forbid."""
    fake = {
        "tpweave.ops.a": [("tpweave.ops.b", 1)],
        "tpweave.ops.b": [("tpweave.ops.a", 2)],
        "tpweave.tuning.t": [("tpweave.bench.x", 3)],
        "tpweave.bench.x": [],
    }
    assert cycles(fake) == [["tpweave.ops.a", "tpweave.ops.b"]]
    assert upward_imports(fake) == ["tpweave.tuning.t:3 imports tpweave.bench.x (tuning may not import bench)"]
    modules = _modules()
    path = SRC / "ops" / "strategies" / "registry.py"
    edges = {dst for dst, _ in imports_of("tpweave.ops.strategies.registry", path, modules)}
    assert "tpweave.ops.strategies.sequential" in edges and "tpweave.ops.strategies.contract" in edges


def test_compile_is_short():
    """`tpweave.compile` stays a readable orchestration (options, plan, agreement, variants)."""
    lines = inspect.getsource(api.compile).splitlines()
    assert len(lines) <= 25, len(lines)


@pytest.mark.parametrize("layer", LAYERS[1:-2])
def test_every_layer_exists(layer):
    assert (SRC / layer).is_dir() or (SRC / f"{layer}.py").is_file()

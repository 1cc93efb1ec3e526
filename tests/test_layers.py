"""The package's layers: which part of jetctl may import which (issue 24).

    foundations   the modules at the package root, recipe/, proto/, kernels/: what every
                  process shares (types, the recipe, the wire format, run-dir paths, auth)
    processes     server/, client/, controller/: one each per kind of process; none imports
                  another (they talk over gRPC, and through the foundations' types)
    tools         run/ (what reads a whole run: status, ledger, chaos, plot, eval, replay,
                  ...), envs/, view/, research/, bench/, cli/: may import anything below

Read from the source (every import statement, also those inside functions and under
TYPE_CHECKING), not by importing: a lazy import that goes upward is still an upward import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import jetctl

PACKAGE = Path(jetctl.__file__).parent
FOUNDATION_PACKAGES = {"recipe", "proto", "kernels"}
PROCESSES = {"server", "client", "controller"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    return {
        _module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))
        if "_gen" not in p.parts  # protoc's output imports only itself
    }


SOURCES = _sources()


def _resolve(name: str) -> str:
    """The module an imported name lives in: the longest known module prefix."""
    while name and name not in SOURCES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str, path: Path, *, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes = _top_level(tree.body) if top_level_only else ast.walk(tree)
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from jetctl import status` imports the module jetctl.status
            names = [f"{stem}.{alias.name}" for alias in node.names] + [stem]
        else:
            continue
        for name in names:
            if name == "jetctl" or name.startswith("jetctl."):
                target = _resolve(name)
                if target and target != module:
                    found.add(target)
    return found


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements a module runs when it is imported: its own, with the bodies of its
    top-level `if` and `try` (optional imports), not functions' or classes', and not an
    `if TYPE_CHECKING:` block (the type checker's, never run)."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If):
            if ast.unparse(node.test) in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}:
                continue
            out += _top_level(node.body) + _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            out += _top_level(node.body) + _top_level(node.orelse) + _top_level(node.finalbody)
            for handler in node.handlers:
                out += _top_level(handler.body)
    return out


def _part(module: str) -> str:
    """The layer's part a module belongs to: 'root' for a module at the package root."""
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    if len(parts) == 2 and not (PACKAGE / parts[1]).is_dir():
        return "root"
    return parts[1]


def _is_foundation(module: str) -> bool:
    return _part(module) in {"root"} | FOUNDATION_PACKAGES


def test_the_wire_format_imports_only_the_shared_types() -> None:
    wrong = {
        (module, target)
        for module, path in SOURCES.items() if _part(module) == "proto"
        for target in _imports(module, path)
        if _part(target) != "proto" and target != "jetctl.types"
    }
    assert not wrong, f"proto/ imports upward: {sorted(wrong)}"


def test_foundations_import_only_foundations() -> None:
    wrong = {
        (module, target)
        for module, path in SOURCES.items() if _is_foundation(module)
        for target in _imports(module, path)
        if not _is_foundation(target)
    }
    assert not wrong, (
        "a foundation (package root, recipe/, proto/, kernels/) imports from above it; move "
        f"the importer up (run/, or beside what it uses) or the imported name down: {sorted(wrong)}"
    )


def test_a_process_imports_only_itself_and_the_foundations() -> None:
    wrong = {
        (module, target)
        for module, path in SOURCES.items() if _part(module) in PROCESSES
        for target in _imports(module, path)
        if not (_is_foundation(target) or _part(target) == _part(module))
    }
    assert not wrong, (
        "server/, client/ or controller/ imports another process's code or a tool above it: "
        f"{sorted(wrong)}"
    )


def test_no_import_cycle_among_modules() -> None:
    """Cycles through the imports a module runs when it is imported. An import inside a
    function is a deliberate lazy one and may close a loop, as may one the type checker
    alone reads (`if TYPE_CHECKING:`, a module typing the object that calls it); the tests
    above keep both from pointing upward."""
    graph = {m: _imports(m, p, top_level_only=True) for m, p in SOURCES.items()}
    # a package's __init__ is imported by every module inside it: an edge from a module to
    # its own package is how Python works, not a design cycle
    graph = {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in graph.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "module-level import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_rules_see_the_package() -> None:
    """The scan finds the modules and edges it is about (a broken scan would pass the rest)."""
    assert {"jetctl.server.trainer", "jetctl.client.proxy", "jetctl.recipe.schema",
            "jetctl.proto.convert"} <= set(SOURCES)
    assert "jetctl.recipe.schema" in _imports(
        "jetctl.server.algorithms", SOURCES["jetctl.server.algorithms"])
    assert "jetctl.server.step" in _imports(
        "jetctl.server.trainer", SOURCES["jetctl.server.trainer"])
    assert _is_foundation("jetctl.rundir") and _is_foundation("jetctl.recipe.schema")
    assert not _is_foundation("jetctl.server.trainer")

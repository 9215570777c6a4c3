"""The package's import graph: no cycles, and every import of the package's own modules at
the top of its module."""
import ast
from pathlib import Path

import positronic_brain

ROOT = Path(positronic_brain.__file__).parent
PACKAGE = "positronic_brain"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]):
    """(imported module, line, at top level) for every import of a module of the package."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t == PACKAGE or t.startswith(PACKAGE + "."):
                yield t, node.lineno, id(node) in top


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {t for t, _, _ in _imports(name, path, modules) if t in modules and t != name}
            for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of module names, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_inside_the_package():
    graph = _graph()
    assert len(graph) > 20 and graph[f"{PACKAGE}.loop"] >= {f"{PACKAGE}.capture",
                                                             f"{PACKAGE}.stages.apply"}
    cycle = _cycle({m: {n for n in deps if n != PACKAGE} for m, deps in graph.items()
                    if m != PACKAGE})
    assert cycle is None, " -> ".join(cycle or [])


def test_no_module_imports_the_package_root_or_imports_inside_functions():
    modules = _modules()
    late = [f"{path.relative_to(ROOT.parent)}:{line} imports {t}"
            for name, path in modules.items() if name != PACKAGE
            for t, line, top in _imports(name, path, modules) if t == PACKAGE or not top]
    assert not late, late

"""The import graph of the ckpt_tool package, read from its source with ast (nothing is imported).

Every `import` / `from ... import` of a ckpt_tool module is an edge, wherever it is written:
at module level, or inside a function (a lazy import; marked so). Imports under
`if TYPE_CHECKING:` are left out: they never run. Relative imports are resolved; `from pkg import
name` is an edge to the sub-module pkg.name when there is one, else to pkg itself.

    python tests/import_graph.py [TREE]      # a report on TREE (default: this checkout)

test_import_layers.py uses it to hold the package to its layers.
"""
from __future__ import annotations

import ast
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "ckpt_tool"


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    lazy: bool  # written inside a function (runs when the function is called)
    line: int
    typing: bool = False  # under `if TYPE_CHECKING:` (read by type checkers only; never runs)

    def __str__(self) -> str:
        where = "for typing, " if self.typing else "in a function, " if self.lazy else ""
        return f"{self.importer.removeprefix(PACKAGE + '.')} -> {self.imported.removeprefix(PACKAGE + '.')} ({where}line {self.line})"


def modules(tree: Path) -> dict[str, Path]:
    """Module name -> file, for every .py file of the package under `tree` (a checkout's root)."""
    root = tree / PACKAGE
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(tree).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_package(name: str, known: dict[str, Path]) -> bool:
    return known[name].name == "__init__.py"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


_Found = list[tuple[ast.Import | ast.ImportFrom, bool, bool]]


def _imports(body: list[ast.stmt], lazy: bool, typing: bool = False) -> _Found:
    """The import statements in `body` and below it, each with whether it sits in a function and
    whether it is under `if TYPE_CHECKING:`."""
    found: _Found = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append((node, lazy, typing))
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            found.extend(_imports(node.body, lazy, True))
            found.extend(_imports(node.orelse, lazy, typing))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.extend(_imports(node.body, True, typing))
        elif isinstance(node, ast.ClassDef):
            found.extend(_imports(node.body, lazy, typing))
        else:
            for field_name in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field_name, None)
                if isinstance(inner, list):
                    found.extend(_imports([n for n in inner if isinstance(n, ast.stmt)] +
                                          [s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body],
                                          lazy, typing))
    return found


def edges(tree: Path, *, typing: bool = False) -> list[Edge]:
    """Every import of a ckpt_tool module by a ckpt_tool module under `tree` that runs; `typing`:
    those under `if TYPE_CHECKING:` too."""
    known = modules(tree)
    found = []
    for name, path in known.items():
        package = name if _is_package(name, known) else name.rpartition(".")[0]
        for node, lazy, for_typing in _imports(ast.parse(path.read_text(), str(path)).body, False):
            if for_typing and not typing:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base_parts = package.split(".")
                    if node.level > len(base_parts):
                        raise ImportError(f"{path}:{node.lineno}: relative import beyond the package")
                    base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in known else base)
            for target in targets:
                # `import ckpt_tool.a.b` names a module; a name that is no module is its package's
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target.startswith(PACKAGE) and target in known and target != name:
                    found.append(Edge(name, target, lazy, node.lineno, for_typing))
    return sorted(set(found), key=lambda e: (e.importer, e.imported, e.line))


def cycles(graph_edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), largest first."""
    graph: dict[str, set[str]] = {}
    for e in graph_edges:
        graph.setdefault(e.importer, set()).add(e.imported)
        graph.setdefault(e.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:  # iterative: the recursion would be as deep as the longest path
        nonlocal counter
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components, key=lambda c: (-len(c), c))


def report(tree: Path) -> str:
    from test_import_layers import layer_of, violations  # the layers are the test's

    graph = edges(tree)
    known = modules(tree)
    comps = cycles(graph)
    lines = [f"{len(known)} modules, {len(graph)} imports ({sum(e.lazy for e in graph)} in functions)"]
    lines.append(f"cycles: {len(comps)} (sizes {[len(c) for c in comps]})")
    for c in comps:
        lines.append("  " + ", ".join(m.removeprefix(PACKAGE + ".") for m in c))
    found = violations(graph, known)
    for kind, items in found.items():
        lines.append(f"{kind}: {len(items)}")
        lines.extend(f"  {item}" for item in items)
    layers = Counter(layer_of(m, known) for m in known)
    lines.append("modules per layer: " + ", ".join(f"{k}={v}" for k, v in layers.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    import conftest  # noqa: F401 - puts every test folder on sys.path (test_import_layers is in one)
    print(report(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent.parent).resolve()))

"""The engine stays split (issue 47): convert's module small, its functions and the planner's short,
and reshard built on the public names of the modules it uses.

Read from the source (nothing is imported): ops/engine.py under 400 lines, no function of ops/engine.py
or ops/planner.py over 80 lines (a nested one counted in its own right), and ops/reshard.py importing or
reaching into no `_private` name of another module.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "ckpt_tool"


def _functions(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            found.append((node.name, (node.end_lineno or node.lineno) - start + 1))
    return found


def test_engine_module_is_under_400_lines() -> None:
    lines = len((PACKAGE / "ops/engine.py").read_text(encoding="utf-8").splitlines())
    assert lines < 400, f"engine.py is {lines} lines"


def test_no_function_of_the_engine_or_planner_is_over_80_lines() -> None:
    long = [(f"{name} ({path})", n) for path in ("ops/engine.py", "ops/planner.py")
            for name, n in _functions(PACKAGE / path) if n > 80]
    assert not long, long


def test_reshard_uses_no_private_name_of_another_module() -> None:
    tree = ast.parse((PACKAGE / "ops/reshard.py").read_text(encoding="utf-8"))
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    private = [f"import {a.name} (line {n.lineno})" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               for a in n.names if a.name.startswith("_") and not a.name.startswith("__")]
    # `module._name`, where `module` is a name this file imported (not an attribute of its own objects)
    private += [f"{n.value.id}.{n.attr} (line {n.lineno})" for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in imported
                and n.attr.startswith("_") and not n.attr.startswith("__")]
    assert not private, private

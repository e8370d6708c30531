"""ckpt_tool's modules import in layers, and its tree is the diagram: one folder per layer, each folder
using only the folders below it.

    cli/, __main__     the `ckpt` command: parses, calls one core function, renders
    __init__.py        the library's face: ckpt_tool.open, ckpt_tool.latest
    ops/               operations over opened checkpoints and run roots: convert (engine and the parts
                         beside it), reshard, diff, runs, validate, manifest, inspect, the destination's rules
    formats/           the registry (__init__.py; roots, steps, unknown beside it) and one package per
                         format: a format package imports no other one and nothing of the registry (its
                         registration.py excepted); the packages are loaded by name (importlib) through
                         the registry's table, never imported from outside them
    machinery/         what several formats share: arrays, DCP's files, torch.save, integrity, HF's index
    scheduler/         the one read scheduler
    core/              the checkpoint model, the write plan, codecs, casts, the format contract
    storage/           bytes from files and object stores
    base/              errors, text, dtypes, findings, names, ...

Checked from the source (tests/import_graph.py, nothing is imported), counting imports inside
functions as well as at module level (`if TYPE_CHECKING:` imports, which never run, are not):
no module imports one in a higher layer, no import cycle exists (so a function-level import is
only ever a lazy import downward, for start-up time, never a way around a cycle), and no format
package imports another one.

Package initialisation counts: importing a module runs the __init__.py of each package it is in, so
a module's layer is never below its packages' (a module inside formats/ is in the registry's layer,
whatever the table says), and the table may not place one below them.

At run time too: opening a checkpoint (ckpt_tool.open) of every format, and a step of run roots,
loads no module above the registry (runs, validate, manifest, ...).

CKPT_LAYERS_TREE=/path/to/checkout runs the checks on another checkout (its ckpt_tool/).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from import_graph import PACKAGE, Edge, cycles, edges, modules  # noqa: E402

Layers = list[tuple[str, tuple[str, ...]]]

# lowest first: one line per folder of ckpt_tool/ ("": the package's own __init__.py)
LAYERS: Layers = [
    ("base", ("base",)),
    ("storage", ("storage",)),
    ("core", ("core",)),
    ("scheduler", ("scheduler",)),
    ("machinery", ("machinery",)),
    ("formats", ("formats",)),
    ("ops", ("ops",)),
    ("api", ("",)),
    ("cli", ("cli", "__main__")),
]
_RANK = {name: rank for rank, (name, _) in enumerate(LAYERS)}


def format_package(module: str, known: dict[str, Path]) -> str | None:
    """The format package a module belongs to ("ckpt_tool.formats.orbax": a directory under
    formats/), None for any other (formats/roots.py, formats/steps.py, ...). `known`: the tree's
    modules (import_graph.modules).

    DeepSpeed's universal checkpoints (formats/deepspeed/universal/) are part of the deepspeed
    package: they share its reader by design."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "formats":
        return None
    top = ".".join(parts[:3])
    path = known.get(top)
    return top if path is not None and path.name == "__init__.py" else None


def table_layer(module: str, layers: Layers = LAYERS) -> str | None:
    """The layer of the longest prefix of `layers` naming `module`; None when none does."""
    inner = module.removeprefix(PACKAGE).removeprefix(".")
    best, best_len = None, -1
    for layer, prefixes in layers:
        for prefix in prefixes:
            # ("": the package's own __init__ only: a module no prefix names has no layer)
            if (inner == prefix or (prefix and inner.startswith(prefix + "."))) and len(prefix) > best_len:
                best, best_len = layer, len(prefix)
    return best


def layer_of(module: str, known: dict[str, Path], layers: Layers = LAYERS) -> str:
    """`module`'s layer: its table row's, raised to that of each package it is in below the root
    (importing it runs their __init__.py: a module whose import runs the registry is in the
    registry's layer)."""
    rank = {name: r for r, (name, _) in enumerate(layers)}
    own = table_layer(module, layers)
    if own is None:
        raise AssertionError(f"{module} is in no layer: add its folder to LAYERS in {__file__}")
    parts = module.split(".")
    for k in range(2, len(parts)):
        package = ".".join(parts[:k])
        outer = table_layer(package, layers) if package in known else None
        if outer is not None and rank[outer] > rank[own]:
            own = outer
    return own


def placed_below_their_packages(known: dict[str, Path], layers: Layers = LAYERS) -> list[str]:
    """Modules a table places below a package they are in (the table would not see what their
    import runs)."""
    return [f"{m.removeprefix(PACKAGE + '.')}: placed in {table_layer(m, layers)}, its import runs a package "
            f"of {layer_of(m, known, layers)}" for m in known if table_layer(m, layers) != layer_of(m, known, layers)]


def violations(graph: list[Edge], known: dict[str, Path], layers: Layers = LAYERS) -> dict[str, list[str]]:
    """What breaks the layering: imports up the layers, imports between format packages, imports of a
    format package from outside it or of the registry from inside one, and the function-level imports
    inside a cycle."""
    rank_of = {name: r for r, (name, _) in enumerate(layers)}
    rank = {m: rank_of[layer_of(m, known, layers)] for m in known}
    upward = [e for e in graph if rank[e.importer] < rank[e.imported]]
    package = {m: format_package(m, known) for m in known}
    across = [e for e in graph if package[e.importer] and package[e.imported] and package[e.importer] != package[e.imported]]
    # the registry and the modules beside it (roots, steps, unknown) load a format package by name, through
    # the registry's table; nothing outside a format package imports one (above the formats: ask the registry)
    into = [e for e in graph if package[e.imported] and not package[e.importer]]
    # a format package answers through the contract; only its registration.py (read by the registry by file
    # path) uses the registry's FormatInfo
    registry = [e for e in graph if package[e.importer] and not package[e.imported]
                and e.imported.startswith(f"{PACKAGE}.formats") and not e.importer.endswith(".registration")]
    in_cycles = {m for c in cycles(graph) for m in c}
    lazy_in_cycles = [e for e in graph if e.lazy and e.importer in in_cycles and e.imported in in_cycles]
    return {
        "imports up the layers": [str(e) for e in upward],
        "imports of another format package": [str(e) for e in across],
        "imports of a format package from outside it": [str(e) for e in into],
        "imports of the registry from a format package": [str(e) for e in registry],
        "function-level imports inside a cycle": [str(e) for e in lazy_in_cycles],
    }


@pytest.fixture(scope="module")
def tree() -> Path:
    return Path(os.environ.get("CKPT_LAYERS_TREE") or Path(__file__).parents[2]).resolve()


@pytest.fixture(scope="module")
def graph(tree: Path) -> list[Edge]:
    return edges(tree)


def test_every_module_has_a_layer(tree: Path) -> None:
    known = modules(tree)
    for module in known:
        layer_of(module, known)


def test_the_package_holds_only_its_layer_folders(tree: Path) -> None:
    # the tree is the diagram: ckpt_tool/ holds a folder per row of LAYERS, __init__.py and __main__.py
    folders = {p for _, prefixes in LAYERS for p in prefixes if p}
    assert all("." not in p for p in folders), "one folder a row: a prefix names a folder of ckpt_tool/"
    found = {p.name for p in (tree / PACKAGE).iterdir()
             if p.name != "__pycache__" and (p.suffix == ".py" or (p.is_dir() and any(p.rglob("*.py"))))}
    assert found == {f"{f}.py" if f == "__main__" else f for f in folders} | {"__init__.py"}, \
        sorted(found ^ ({f"{f}.py" if f == "__main__" else f for f in folders} | {"__init__.py"}))


def test_no_module_is_placed_below_its_package(tree: Path) -> None:
    below = placed_below_their_packages(modules(tree))
    assert not below, "\n".join(below)


def test_the_graph_sees_function_level_and_relative_imports(tree: Path, graph: list[Edge]) -> None:
    # the checks below mean something only if the graph holds what the source says
    found = {(e.importer, e.imported, e.lazy) for e in graph}
    assert (f"{PACKAGE}.cli.app", f"{PACKAGE}.formats", False) in found  # `from .. import __version__, formats`
    assert (PACKAGE, f"{PACKAGE}.formats", True) in found  # ckpt_tool.open's lazy `from .formats import ...`


def test_no_import_cycles(graph: list[Edge]) -> None:
    found = cycles(graph)
    assert not found, "import cycles (function-level imports counted):\n" + "\n".join(
        ", ".join(m.removeprefix(PACKAGE + ".") for m in c) for c in found)


def test_no_import_runs_up_the_layers(tree: Path, graph: list[Edge]) -> None:
    upward = violations(graph, modules(tree))["imports up the layers"]
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_no_format_package_imports_another(tree: Path, graph: list[Edge]) -> None:
    across = violations(graph, modules(tree))["imports of another format package"]
    assert not across, "format packages importing each other:\n" + "\n".join(across)


def test_no_module_outside_a_format_package_imports_one(tree: Path, graph: list[Edge]) -> None:
    # (formats/roots.py asks the packages' run-root rules through the registry's table: issue 47)
    into = violations(graph, modules(tree))["imports of a format package from outside it"]
    assert not into, "format packages imported from outside (load them through the registry):\n" + "\n".join(into)


def test_no_format_package_imports_the_registry(tree: Path, graph: list[Edge]) -> None:
    found = violations(graph, modules(tree))["imports of the registry from a format package"]
    assert not found, "format packages importing the registry (ask through the contract):\n" + "\n".join(found)


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / PACKAGE / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / PACKAGE / rel).write_text(text)


def test_the_checks_catch_a_cycle_an_upward_import_and_a_format_pair(tmp_path: Path) -> None:
    # a tree made to break each rule once: the checks above would see it
    _write_tree(tmp_path, {
        "__init__.py": "",
        "base/__init__.py": "",
        "base/errors.py": "def f():\n    from ..ops import runs\n",  # base -> ops, in a function
        "ops/__init__.py": "",
        "ops/runs.py": "from ..base.errors import f\n",
        "core/__init__.py": "",
        "core/contract.py": "",
        "formats/__init__.py": "",
        "formats/roots.py": "def f():\n    from .b import reader\n",  # beside the packages, importing one
        "formats/a/__init__.py": "from ..b import reader\nfrom ...core.contract import Base\nfrom .. import steps\n",
        "formats/steps.py": "",
        "formats/b/__init__.py": "",
        "formats/b/registration.py": "from .. import FormatInfo\n",  # the registry's entry: may use it
        "formats/b/reader.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import x\n",
    })
    graph = edges(tmp_path)
    assert cycles(graph) == [[f"{PACKAGE}.base.errors", f"{PACKAGE}.ops.runs"]]  # the TYPE_CHECKING import is no edge
    found = violations(graph, modules(tmp_path))
    assert found["imports up the layers"] == ["base.errors -> ops.runs (in a function, line 2)"]
    assert found["imports of another format package"] == ["formats.a -> formats.b.reader (line 1)"]
    assert found["imports of a format package from outside it"] == ["formats.roots -> formats.b.reader (in a function, line 2)"]
    assert found["imports of the registry from a format package"] == ["formats.a -> formats.steps (line 3)"]


def test_package_initialisation_counts(tmp_path: Path) -> None:
    # the blind spot of a table that places modules one by one: a contract kept inside formats/ and
    # placed with the model by a row of its own; a core module importing it runs formats/__init__.py,
    # the registry, which runs every format's registration
    planted = {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/model.py": "from ..formats import contract\n",  # the planted import
        "formats/__init__.py": "from . import roots\n",
        "formats/roots.py": "from .contract import RunRules\n",
        "formats/contract.py": "",
    }
    _write_tree(tmp_path, planted)
    graph, known = edges(tmp_path), modules(tmp_path)
    by_row: Layers = [("core", ("core", "formats.contract")), ("formats", ("formats",)), ("api", ("",))]
    # module by module, the rows see nothing wrong: core.model -> formats.contract is core -> core ...
    rank = {name: r for r, (name, _) in enumerate(by_row)}
    assert not [e for e in graph if rank[table_layer(e.importer, by_row)] < rank[table_layer(e.imported, by_row)]]
    # ... but formats.contract's import runs the registry: the checks place it there and report the import
    assert layer_of(f"{PACKAGE}.formats.contract", known, by_row) == "formats"
    assert violations(graph, known, by_row)["imports up the layers"] == ["core.model -> formats.contract (line 1)"]
    assert placed_below_their_packages(known, by_row) == [
        "formats.contract: placed in core, its import runs a package of formats"]


def test_a_registry_import_planted_in_the_core_is_reported(tree: Path, tmp_path: Path) -> None:
    # the same on a copy of this tree: a core module importing something of formats/ runs the registry
    shutil.copytree(tree / PACKAGE, tmp_path / PACKAGE, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    model = tmp_path / PACKAGE / "core" / "model.py"
    model.write_text("from ..formats import roots\n" + model.read_text())
    upward = violations(edges(tmp_path), modules(tmp_path))["imports up the layers"]
    assert "core.model -> formats.roots (line 1)" in upward, upward


# one checkpoint of every format and family, and run roots whose step the registry picks
OPENED = ["orbax_manager", "orbax_v0_4_plain", "dcp_single", "safetensors_llama_sharded", "flax_msgpack", "t5x",
          "torch_hf_bin_sharded", "megatron_run", "megatron_nemo2", "megatron_zarr_tp2", "megatron_legacy",
          "deepspeed_z2_fp32", "deepspeed_pp2_z1", "deepspeed_universal_z1_fp32", "runs_torchtitan", "runs_hf_trainer"]


def test_opening_checkpoints_loads_nothing_above_the_registry(tree: Path) -> None:
    fixtures = tree / "fixtures"
    code = ("import sys, ckpt_tool\n"
            "for path in sys.argv[1:]:\n"
            "    ckpt_tool.open(path)\n"
            "print('\\n'.join(sorted(sys.modules)))\n")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    r = subprocess.run([sys.executable, "-c", code, *(str(fixtures / f) for f in OPENED)], capture_output=True,
                       text=True, timeout=600, cwd=tree, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = [m for m in r.stdout.split() if m.startswith(PACKAGE + ".")]
    assert any(m.startswith(f"{PACKAGE}.formats.megatron.") for m in loaded)  # (the opens above were real)
    known = modules(tree)
    above = [m for m in loaded if m in known and _RANK[layer_of(m, known)] > _RANK["formats"]]
    assert not above, f"ckpt_tool.open loaded modules above the registry: {above}"

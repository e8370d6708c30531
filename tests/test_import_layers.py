"""ckpt_tool's modules import in layers: each layer uses only the layers below it.

    cli/, __main__                    the `ckpt` command: parses, calls one core function, renders
    ckpt_tool (the package)           the library's face: ckpt_tool.open, ckpt_tool.latest
    runs, engine, diff, reshard,      operations over checkpoints and run roots (convert: engine, and
      planner, streaming,               the parts beside it)
      stored_copy, free_space, preflight
    validate/, manifest/, inspect,    what is asked of one opened checkpoint
      structure, output, hf_export
    formats (the registry),           which format a path holds, opening it, a run root's steps
      formats.steps, .roots, .unknown   (these are handed the registry's table); the format
                                        packages are loaded by name (importlib), never imported
    formats/<name>/                   one package per format: never imports another format
    torchsave/, arrays/, distcp/,     machinery several formats share (torch.save archives,
      integrity/, hf_index              zarr / TensorStore arrays, DCP's files, integrity manifests,
                                        Hugging Face's shard index)
    model, scheduler/, codecs, ...    the checkpoint model, reading plans, chunk codecs
    storage/                          bytes from files and object stores
    errors, text, dtypes, names, ...  the base

Checked from the source (tests/import_graph.py, nothing is imported), counting imports inside
functions as well as at module level (`if TYPE_CHECKING:` imports, which never run, are not):
no module imports one in a higher layer, no import cycle exists (so a function-level import is
only ever a lazy import downward, for start-up time, never a way around a cycle), and no format
package imports another one.

At run time too: opening a checkpoint (ckpt_tool.open) of every format, and a step of run roots,
loads no module above the registry (runs, validate, manifest, ...).

CKPT_LAYERS_TREE=/path/to/checkout runs the checks on another checkout (its ckpt_tool/).
"""
from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from import_graph import PACKAGE, Edge, cycles, edges, modules  # noqa: E402

# lowest first. A module is in the layer of a pattern naming it (fnmatch), else in "format" when it
# is part of a format package (a directory formats/<name>/), else in the layer of the longest prefix
# listed. The format contract (formats/contract.py: base classes and protocols, imported by the
# format packages and the scheduler) sits with the model; a format package's registration.py (its
# registry entries, read by the registry by file path) is the registry's.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("errors", "text", "sizes", "checksum", "directio", "pagecache", "bufferpool", "parallel", "findings",
              "dtypes", "values", "filters", "distributed", "version", "names", "strict_json", "read_options",
              "topology")),
    ("storage", ("storage",)),
    ("model", ("model", "casting", "unstack", "optim_keys", "codecs", "scheduler", "writers", "blocks", "formats.contract")),
    ("machinery", ("torchsave", "arrays", "distcp", "integrity", "hf_index")),
    ("format", ()),  # every module of a format package: formats/<name>/ (format_package)
    ("registry", ("formats", "formats.roots", "formats.unknown", "formats.steps", "formats.*.registration")),
    ("checkpoint", ("validate", "manifest", "inspect", "structure", "output", "output_remote", "hf_export")),
    ("operations", ("runs", "engine", "planner", "streaming", "stored_copy", "free_space", "preflight", "diff",
                    "reshard", "supervise")),
    ("api", ("",)),  # the package's __init__: ckpt_tool.open, ckpt_tool.latest
    ("cli", ("cli", "__main__")),
]
_RANK = {name: rank for rank, (name, _) in enumerate(LAYERS)}


def format_package(module: str, known: dict[str, Path]) -> str | None:
    """The format package a module belongs to ("ckpt_tool.formats.orbax": a directory under
    formats/), None for any other (formats/roots.py, formats/contract.py, ...). `known`: the tree's
    modules (import_graph.modules).

    DeepSpeed's universal checkpoints (formats/deepspeed/universal/) are part of the deepspeed
    package: they share its reader by design."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "formats":
        return None
    top = ".".join(parts[:3])
    path = known.get(top)
    return top if path is not None and path.name == "__init__.py" else None


def layer_of(module: str, known: dict[str, Path]) -> str:
    inner = module.removeprefix(PACKAGE).removeprefix(".")
    for layer, patterns in LAYERS:
        if any("*" in p and fnmatch.fnmatchcase(inner, p) for p in patterns):
            return layer
    if format_package(module, known) is not None:
        return "format"
    best, best_len = None, -1
    for layer, prefixes in LAYERS:
        for prefix in prefixes:
            # ("": the package's own __init__ only: a module no prefix names has no layer)
            if "*" not in prefix and (inner == prefix or (prefix and inner.startswith(prefix + "."))):
                if len(prefix) > best_len:
                    best, best_len = layer, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return best


def violations(graph: list[Edge], known: dict[str, Path]) -> dict[str, list[str]]:
    """What breaks the layering: imports up the layers, imports between format packages, the
    function-level imports among them, and the modules of each cycle."""
    rank = {m: _RANK[layer_of(m, known)] for m in known}
    upward = [e for e in graph if rank[e.importer] < rank[e.imported]]
    package = {m: format_package(m, known) for m in known}
    across = [e for e in graph if package[e.importer] and package[e.imported] and package[e.importer] != package[e.imported]]
    # the registry and the modules beside it (roots, steps, unknown) load a format package by name, through
    # the registry's table; nothing outside a format package imports one (above the formats: ask the registry)
    into = [e for e in graph if package[e.imported] and not package[e.importer]]
    in_cycles = {m for c in cycles(graph) for m in c}
    lazy_in_cycles = [e for e in graph if e.lazy and e.importer in in_cycles and e.imported in in_cycles]
    return {
        "imports up the layers": [str(e) for e in upward],
        "imports of another format package": [str(e) for e in across],
        "imports of a format package from outside it": [str(e) for e in into],
        "function-level imports inside a cycle": [str(e) for e in lazy_in_cycles],
    }


@pytest.fixture(scope="module")
def tree() -> Path:
    return Path(os.environ.get("CKPT_LAYERS_TREE") or Path(__file__).parent.parent).resolve()


@pytest.fixture(scope="module")
def graph(tree: Path) -> list[Edge]:
    return edges(tree)


def test_every_module_has_a_layer(tree: Path) -> None:
    known = modules(tree)
    for module in known:
        layer_of(module, known)


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


def test_the_checks_catch_a_cycle_an_upward_import_and_a_format_pair(tmp_path: Path) -> None:
    # a tree made to break each rule once: the checks above would see it
    pkg = tmp_path / PACKAGE
    for rel, text in {
        "__init__.py": "",
        "errors.py": "def f():\n    from . import runs\n",  # base -> operations, in a function
        "runs.py": "from .errors import f\n",
        "formats/__init__.py": "",
        "formats/contract.py": "",  # a module beside the packages, not a format package
        "formats/roots.py": "def f():\n    from .b import reader\n",  # beside the packages, importing one
        "formats/a/__init__.py": "from ..b import reader\nfrom ..contract import Base\n",
        "formats/b/__init__.py": "",
        "formats/b/registration.py": "from .. import FormatInfo\n",  # the registry's entry: may use it
        "formats/b/reader.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import x\n",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    graph = edges(tmp_path)
    assert cycles(graph) == [[f"{PACKAGE}.errors", f"{PACKAGE}.runs"]]  # the TYPE_CHECKING import is no edge
    found = violations(graph, modules(tmp_path))
    assert found["imports up the layers"] == ["errors -> runs (in a function, line 2)"]
    assert found["imports of another format package"] == ["formats.a -> formats.b.reader (line 1)"]
    assert found["imports of a format package from outside it"] == ["formats.roots -> formats.b.reader (in a function, line 2)"]


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
    above = [m for m in loaded if m in known and _RANK[layer_of(m, known)] > _RANK["registry"]]
    assert not above, f"ckpt_tool.open loaded modules above the registry: {above}"

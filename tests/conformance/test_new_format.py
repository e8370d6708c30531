"""A new format is its package, its fixture generator and its catalogue file, and nothing else names
it (issue 31).

A throwaway format, `toyst` (safetensors bytes in `.toyst` files), is written in tmp as exactly
those three: ckpt_tool/formats/toyst/ with its registration.py, fixtures/gen_toyst.py with its
`# fixtures-run` line, tests/conformance/formats/toyst.py with its rows. Each is found by the
discovery the real formats go through (formats.discover, fixtures/generate_all.py, catalogue.load)
and the format passes the conformance suite's properties. The lint below keeps the rest of the
tree from naming a format's package, or listing the formats, where the registry or the catalogue
should be asked.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import catalogue as C
from toy import TOY, passes_the_suite, safetensors_as_toy
from conftest import ROOT


REGISTRATION = f'''"""The throwaway format's entry in the registry."""
from __future__ import annotations

from .. import FormatInfo

PACKAGE = __name__.rsplit(".", 1)[0]

FORMATS = [
    FormatInfo("{TOY}", "Toy (safetensors bytes in .{TOY} files)", PACKAGE, can_write=False,
               value_kinds=frozenset({{"array", "scalar"}}), claims=("*.{TOY}",), short="Toy", reads="Toy files",
               single_file="claimed", file_suffixes=(".{TOY}",), claims_flat=True, listed=99, detection=45),
]
'''

GENERATOR = f'''#!/usr/bin/env python3
# fixtures-run: test
"""{TOY}_tiny/model.{TOY}: two arrays, written by the safetensors library (a {TOY} file is its bytes)."""
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

out = Path(__file__).resolve().parent / "{TOY}_tiny"
out.mkdir(exist_ok=True)
rng = np.random.default_rng(0)
save_file({{"w": rng.standard_normal((4, 3)).astype(np.float32), "b": np.arange(5, dtype=np.int64)}},
          str(out / "model.{TOY}"))
'''

ROWS = f'''"""The throwaway format's catalogue rows; the safetensors library's safe_open is its oracle."""
from __future__ import annotations

from pathlib import Path

from references import Ref, by_name
from rows import Damage, Entry


def toy_values(path: Path, step: str | None = None) -> dict:
    from safetensors import safe_open

    out = {{}}
    for f in sorted(Path(path).glob("*.{TOY}")):
        with safe_open(str(f), framework="np") as h:
            for k in h.keys():
                out[by_name(k)] = h.get_tensor(k)
    return out


def toy_reference(path: Path, step: str | None = None) -> dict:
    return {{k: Ref("array", tuple(a.shape), a.dtype.name) for k, a in toy_values(path).items()}}


ENTRIES = [Entry("{TOY}_tiny", "{TOY}", toy_reference, toy_values)]
DAMAGE = [
    Damage("{TOY}", "truncated-file", "{TOY}_tiny", "model.{TOY}", "truncate", "truncated-file"),
    Damage("{TOY}", "wrong-size", "{TOY}_tiny", "model.{TOY}", "grow", "bad-metadata"),
    Damage("{TOY}", "garbage-metadata", "{TOY}_tiny", "model.{TOY}", "header-length", "bad-metadata"),
    Damage("{TOY}", "path-escape", "{TOY}_tiny", "model.{TOY}", "symlink-out", "path-escape"),
]
NOT_APPLICABLE = {{"{TOY}": {{"missing-file": "one file: without it the directory holds no {TOY} checkpoint"}}}}
'''


def _package(where: Path) -> Path:
    """The toy's package (safetensors' modules renamed) and its own registration.py."""
    dst = safetensors_as_toy(where)
    (dst / "registration.py").write_text(REGISTRATION)
    return dst


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _generate_all(*args: str) -> str:
    r = subprocess.run([sys.executable, str(ROOT / "fixtures" / "generate_all.py"), "--test-python", sys.executable,
                        *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The throwaway format's three places in tmp, each found by its discovery; (catalogue, fixtures root)."""
    from ckpt_tool import formats

    pkg = _package(tmp_path / "formats")
    generator = _write(tmp_path / "fixtures" / f"gen_{TOY}.py", GENERATOR)
    _write(tmp_path / "catalogue" / f"{TOY}.py", ROWS)
    # the package: a directory on formats' path holding a registration.py
    monkeypatch.setattr(formats, "__path__", [*formats.__path__, str(pkg.parent)])
    monkeypatch.setattr(formats, "REGISTRY", formats.discover(list(formats.__path__)))
    # the generator: run by generate_all, as `make fixtures` runs every generator
    root = generator.parent
    plan = _generate_all("--fixtures", str(root), "--plan").splitlines()
    assert len(plan) == 1 and plan[0].endswith(f"gen_{TOY}.py"), plan
    _generate_all("--fixtures", str(root))
    for d in C.fixture_dirs():  # beside the committed fixtures, as if it were one of them
        (root / d).symlink_to(C.FIXTURES / d)
    # the rows: one more catalogue file
    cat = C.load([C.FORMATS_DIR, tmp_path / "catalogue"])
    yield cat, root
    for name in [m for m in sys.modules if m.startswith(f"{formats.__name__}.{TOY}")]:
        del sys.modules[name]


def test_a_new_format_is_its_package_generator_and_catalogue_file(toy, tmp_path):
    from ckpt_tool import formats

    cat, root = toy
    # registered, in detection order between DCP and safetensors; help and convert's lists name it
    names = list(formats.REGISTRY)
    assert names.index("dcp") < names.index(TOY) < names.index("safetensors")
    assert formats.get(TOY).package == f"{formats.__name__}.{TOY}"
    assert "Toy (safetensors bytes in .toyst files)" in formats.titles_joined()
    # the catalogue finds its rows; nothing is flagged
    infos = C.registered()
    assert [e.format for e in cat.entries].count(TOY) == 1
    assert C.formats_without_fixtures(infos, cat.entries) == []
    assert C.uncatalogued(cat.entries, root) == []
    assert C.unregistered_entries(infos, cat.entries) == []
    have = {d.cls for d in cat.damage if d.format == TOY}
    assert not set(C.DAMAGE_CLASSES) - have - set(cat.not_applicable.get(TOY, {}))
    # ... and it passes the suite's properties, read through its own package
    [entry] = [e for e in C.cases(infos, cat.entries) if e.format == TOY]
    damage = C.damage_cases([formats.get(TOY)], cat.damage)
    assert len(damage) == 4
    passes_the_suite(entry, root, tmp_path, damage, cat.entries)


# --- lint: nothing outside a format's own places names it --------------------------------------

# files that name a format's package on purpose, and why (each must still name one)
ALLOWED = {
    # profiles: the writers' and readers' own functions are the rows of their time tables
    "bench/convert_bench.py": "profiles named functions of the Orbax and DCP readers and writers",
    "bench/reshard_bench.py": "profiles named functions of the Orbax reader and writer",
    "tests/fuzz_oracle.py": "loads torch.save files with megatron's allow-list, as megatron's reader does",
    "tests/base/test_directio.py": "direct I/O is measured on the DCP writer",
    "tests/ops/convert/test_nontensor_items.py": "DCP's bytes items, written with its value_archive",
    "tests/scheduler/test_scheduler_small.py": "the scheduler's small reads, through the DCP writer",
    "tests/imports/test_startup_imports.py": "which reader an Orbax or DCP inspect imports",
    "tests/storage/test_storage_faults.py": "storage faults reaching the Orbax and DCP readers",
    "tests/formats/deepspeed/test_deepspeed_pipe_moe.py": "DeepSpeed's files are torch.save archives, read by torch_save's code",
    "tests/conformance/toy.py": "the throwaway format both throwaway tests use is safetensors' modules renamed",
    "pyproject.toml": "a dependency's comment says which reader needs it",
    "ckpt_tool/machinery/dcp/__init__.py": "its docstring says which format packages read DCP files through it",
    "tests/imports/test_import_layers.py": "its docstrings name a format package as the example of a layer, and its "
                                   "open-time check proves a Megatron open was real",
}
# the documentation lists the code's layout (docs engineer's: README.md's "Layout of the code")
DOCUMENTATION = (".md",)


def _packages() -> dict[str, set[str]]:
    """{format package directory: the registry names and families of its formats}."""
    from ckpt_tool import formats

    out: dict[str, set[str]] = {}
    for info in formats.registered():
        directory = info.package[len(formats.__name__) + 1:].split(".")[0]
        out.setdefault(directory, set()).update({info.name, *info.families})
    return out


def _tree() -> list[Path]:
    """The project's own text files (not the fixtures' data, venvs or build outputs): git's tracked
    and untracked files less what it ignores (a developer's scratch, which .gitignore or
    .git/info/exclude names); every file under the root where git cannot say."""
    skip = {".git", ".venv", ".venv-demo", "build", "__pycache__", "fuzz_corpus", "node_modules"}
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True)
    candidates = (sorted(ROOT / name for name in listed.stdout.decode().split("\0") if name)
                  if listed.returncode == 0 else sorted(ROOT.rglob("*")))
    out = []
    for p in candidates:
        rel = p.relative_to(ROOT)
        if not p.is_file() or skip & set(rel.parts) or ".egg-info" in str(rel):
            continue
        if rel.parts[0] == "fixtures" and len(rel.parts) > 2:
            continue  # a fixture's files
        if p.suffix in (".py", ".md", ".toml", ".sh", ".cfg", ".txt", ".yml", ".yaml") or p.name == "Makefile":
            out.append(p)
    return out


def _own(rel: str, directory: str, names: set[str], packages: set[str]) -> bool:
    """Whether `rel` is one of the places a format's package may be named: a format's package (one
    format's reader builds on another's: Megatron's on DCP's), a fixture generator, its catalogue
    file, a test file about it (tests/.../test_..._<package or format>_....py, or any test file in
    tests/formats/<package>/)."""
    words = {directory, *(n.replace("-", "_") for n in names)}
    stem = rel.rsplit("/", 1)[-1].removesuffix(".py")
    return (any(rel.startswith(f"ckpt_tool/formats/{d}/") for d in packages)
            or re.fullmatch(r"fixtures/gen\w*\.py", rel) is not None
            or rel == f"tests/conformance/formats/{directory}.py"
            or rel.startswith(f"tests/formats/{directory}/")
            or (rel.startswith("tests/") and stem.startswith("test_")
                and any(re.search(rf"(^|_){re.escape(w)}(_|$)", stem) for w in words)))


def test_no_file_outside_a_formats_places_names_its_package():
    packages = _packages()
    found: dict[str, list[str]] = {}
    for p in _tree():
        rel = p.relative_to(ROOT).as_posix()
        if rel.endswith(DOCUMENTATION):
            continue
        text = p.read_text(errors="replace")
        for directory, names in packages.items():
            # (not tests/formats/<package>/: the folder of that format's tests, which a path may name)
            pattern = re.compile(rf"(?<!tests/)formats[./]{directory}\b|formats import [\w, (]*\b{directory}\b")
            if pattern.search(text) and not _own(rel, directory, names, set(packages)):
                found.setdefault(rel, []).append(directory)
    unexplained = {rel: dirs for rel, dirs in found.items() if rel not in ALLOWED}
    assert not unexplained, f"files naming a format's package outside its places: {unexplained}"
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"allowed files that no longer name a format's package (drop them from ALLOWED): {stale}"


# a literal holding this many formats' names is a list of the formats: ask the registry or the catalogue
LISTS_FROM = 4
# ... except the fuzz oracle's loaders (a format without one is fuzzed for the contract alone) and the
# key-space test's writers (each format's colliding keys written by its own library, each output read
# back by its own loader: a new format without one is not tested there, as with the oracle)
LISTS_ALLOWED = {"tests/fuzz_oracle.py", "tests/base/test_key_space.py"}


def test_no_literal_lists_the_formats():
    names = {n for directory, ns in _packages().items() for n in (*ns, directory)}
    found = []
    for p in _tree():
        rel = p.relative_to(ROOT).as_posix()
        if p.suffix != ".py" or rel.startswith("ckpt_tool/formats/") or rel in LISTS_ALLOWED:
            continue
        for node in ast.walk(ast.parse(p.read_text(), rel)):
            if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                elts = node.elts
            elif isinstance(node, ast.Dict):
                elts = [k for k in node.keys if k is not None]
            else:
                continue
            named = {e.value for e in elts if isinstance(e, ast.Constant) and e.value in names}
            if len(named) >= LISTS_FROM:
                found.append(f"{rel}:{node.lineno}: {sorted(named)}")
    assert not found, found


def test_every_fixture_generator_says_how_it_runs():
    """generate_all's plan names every generator (each has its `# fixtures-run` line)."""
    plan = _generate_all("--plan")
    generators = sorted(p.name for p in (ROOT / "fixtures").glob("gen*.py") if p.name != "generate_all.py")
    assert sorted(re.findall(r"fixtures/(gen\w*\.py)", plan)) == generators

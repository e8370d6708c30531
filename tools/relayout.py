#!/usr/bin/env python3
"""Issue 47 item 1: make ckpt_tool/'s tree the layer diagram, as one mechanical step.

    python tools/relayout.py            # on a clean checkout: moves, rewrites, stages (git add); commits nothing
    python tools/relayout.py --dry-run  # says what it would move and which files it would change
    python tools/relayout.py --table    # prints the table (old module -> new module)

Everything is computed from MOVES below (old module -> new module), not from a diff, so the script
runs on any later main: new code in a module that moves is moved with it, and a new top-level module
that no row places stops the run with its name (add a row). Run it, read `git diff --cached --stat`,
then run the checks it prints at the end.

What it does, in order:
1. checks the tree: a git work tree without staged or unstaged changes to tracked files (--force skips),
   every top-level module of ckpt_tool/ placed by a row of MOVES or already in a layer folder;
2. rewrites, in every tracked text file (ckpt_tool/, tests/, bench/, fuzz/, fixtures/'s scripts, docs,
   README, Makefile, pyproject.toml, .ci/; not fixtures' data, not tests/fuzz_corpus/):
   - Python `from X import a, b` statements (ast: relative and absolute, at any depth, multi-line):
     the module resolved from the file's OLD place, mapped, spelled again from the file's NEW place
     (relative stays relative, absolute stays absolute); `from pkg import sub` where the subs now
     live in different folders is split into one statement per folder; a renamed module keeps its
     local name (`from ..machinery import torch_save as torchsave`);
   - dotted names `ckpt_tool.old.mod` anywhere (import statements, importlib and mock strings,
     `-m ckpt_tool.x`, subprocess `-c` snippets, pyproject's mypy module lists, docs);
   - `from ckpt_tool[.x] import a, b` written inside strings (subprocess snippets);
   - paths: `ckpt_tool/old/mod.py` and `ckpt_tool/oldpkg/` anywhere; a module inside a moved package
     or a folder (`torchsave/payload.py`, `formats/contract.py`) anywhere; a bare `engine.py` of a
     moved top-level module and a package as a folder in backticks (`distcp/`) in pages and in
     Python comments and docstrings, and a string that is just such a name ("engine.py",
     "torchsave/") in a Python file that builds paths under the package (`ROOT / "ckpt_tool"`);
     elsewhere in Python a bare file name may be a test's synthetic tree, and `arrays/0` a leaf's
     key: left alone; a renamed package's dotted spelling in prose (`torchsave.safe_pickle`);
   - a literal listing loaded modules (it holds "ckpt_tool" itself: test_startup_imports' sets) gets
     the layer folders its modules now sit in ("ckpt_tool.base"), which importing them loads;
3. `git mv`s the modules and packages into the layer folders, and writes each new folder's
   `__init__.py` (a docstring only: importing a layer folder runs nothing);
4. keeps user-visible names: each module docs/python-api.md imports from `ckpt_tool` (`from ckpt_tool
   import manifest`) stays an attribute of `ckpt_tool` (ckpt_tool/__init__.py's __getattr__, lazily);
   `ckpt_tool.open`, `ckpt_tool.latest` and the `ckpt` entry point (`ckpt_tool.cli.main:main`) do not
   move; `python -m ckpt_tool` is unchanged;
5. applies the templates in tools/relayout_templates/*.tmpl (the layer test and docs/
   architecture.md) as a three-way merge (`git merge-file`) from TEMPLATE_BASE: a file changed on main
   since then keeps main's change where it does not collide; where it collides the template's side
   is kept and main's is printed (REVIEW: ...) for a reader;
6. removes the emptied folders' __pycache__ and stages what it changed (`git add -u`: the tree was
   clean; and the new files by name); it commits nothing, and prints what it left for a reader:
   old spellings that remain (a bare `engine.py` in a Python string, say).

Idempotent: a second run finds nothing to move and nothing to rewrite (the new names never match an
old one). Nothing here imports ckpt_tool.
"""
from __future__ import annotations

import argparse
import ast
import io
import re
import shutil
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "ckpt_tool"
ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = Path(__file__).resolve().parent / "relayout_templates"
# the commit the templates were written against (their merge base)
TEMPLATE_BASE = "c178058a9354c8c0a8d1c4e1e5fa261304bd82aa"

# old module (under ckpt_tool, dotted) -> its new place. A package's sub-modules follow it. Each top-level
# module sits above everything it imports (tests/imports/test_import_layers.py checks it after the move).
MOVES: dict[str, str] = {
    # base: imports nothing of ckpt_tool but the base
    "errors": "base.errors",
    "text": "base.text",
    "sizes": "base.sizes",
    "checksum": "base.checksum",
    "directio": "base.directio",
    "pagecache": "base.pagecache",
    "bufferpool": "base.bufferpool",
    "parallel": "base.parallel",
    "findings": "base.findings",
    "dtypes": "base.dtypes",
    "distributed": "base.distributed",
    "version": "base.version",
    "names": "base.names",
    "strict_json": "base.strict_json",
    "read_options": "base.read_options",
    # core: the format-neutral checkpoint, what a writer is handed, and the contract (over base, storage)
    "formats.contract": "core.contract",
    "model": "core.model",
    "values": "core.values",
    "filters": "core.filters",
    "writers": "core.write_plan",  # the write plan (WritePlan, TargetArray), not writers
    "blocks": "core.blocks",
    "casting": "core.casting",
    "codecs": "core.codecs",
    "unstack": "core.unstack",
    "optim_keys": "core.optim_keys",
    # machinery: what several format packages share; one spelling each for torch.save and DCP
    "arrays": "machinery.arrays",
    "distcp": "machinery.dcp",
    "torchsave": "machinery.torch_save",
    "integrity": "machinery.integrity",
    "hf_index": "machinery.hf_index",
    # ops: one module (or package) per command's core, over the registry
    "engine": "ops.engine",
    "planner": "ops.planner",
    "streaming": "ops.streaming",
    "stored_copy": "ops.stored_copy",
    "free_space": "ops.free_space",
    "preflight": "ops.preflight",
    "reshard": "ops.reshard",
    "topology": "ops.topology",
    "diff": "ops.diff",
    "structure": "ops.structure",
    "runs": "ops.runs",
    "validate": "ops.validate",
    "manifest": "ops.manifest",
    "inspect": "ops.inspect",
    "output": "ops.destination",  # the destination directory's life (cli/render.py is what prints)
    "output_remote": "ops.destination_remote",
    "hf_export": "ops.hf_export",
    # cli: the process the console script starts (only cli/main.py uses it; it imports base and storage)
    "supervise": "cli.supervise",
}
# the layer folders, lowest first (the layer test's table is one line per folder, in this order)
LAYERS = ["base", "storage", "core", "scheduler", "machinery", "formats", "ops", "cli"]
# a new folder's __init__.py: a docstring, nothing imported
FOLDER_DOCS = {
    "base": "The base layer: errors, text, sizes, dtypes, findings, names, checksums, buffers, page cache,\n"
            "parallelism, the reader options' context. Imports nothing of ckpt_tool above it.\n",
    "core": "The format-neutral core: the checkpoint model (model.py), values and filters, the write plan a\n"
            "writer is handed (write_plan.py), codecs, casts, and the typed contract every format package\n"
            "implements (contract.py). Over base and storage; names no format.\n",
    "machinery": "Machinery several format packages share, below them and naming none: zarr / TensorStore arrays\n"
                 "(arrays/), DCP's files (dcp/), torch.save archives and the allow-list unpickler (torch_save/),\n"
                 "integrity manifests (integrity/), Hugging Face's shard index (hf_index.py).\n",
    "ops": "Operations over opened checkpoints and run roots, one module or package per command's core: convert\n"
           "(engine.py and the parts beside it), reshard, diff, runs (ls, latest), validate/, manifest/,\n"
           "inspect, the destination directory's rules. Over the registry (formats/); never prints.\n",
}
# text files rewritten: tracked files with these suffixes (or names), outside these folders
SUFFIXES = (".py", ".md", ".toml", ".sh", ".cfg", ".txt", ".yml", ".yaml", ".ini")
NAMES = ("Makefile", "run")
SKIP = ("tests/fuzz_corpus/", "tools/")  # tools/: this script, its templates, the other re-layout scripts


def git(*args: str, check: bool = True) -> str:
    r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if check and r.returncode != 0:
        sys.exit(f"git {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


# --- the mapping -------------------------------------------------------------------------------

def new_name(dotted: str) -> str:
    """The new place of a module `dotted` ("ckpt_tool.x.y", or a name below one); unchanged if no row moves it."""
    if dotted != PACKAGE and not dotted.startswith(PACKAGE + "."):
        return dotted
    inner = dotted[len(PACKAGE) + 1:]
    parts = inner.split(".")
    for k in range(len(parts), 0, -1):
        head = ".".join(parts[:k])
        if head in MOVES:
            return ".".join([PACKAGE, MOVES[head], *parts[k:]])
    return dotted


def old_modules(root: Path) -> dict[str, bool]:
    """Module name -> whether it is a package, for the tree under `root` (namespace folders included)."""
    found: dict[str, bool] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
            found[".".join(parts)] = True
        else:
            found[".".join(parts)] = False
        for k in range(1, len(parts)):  # a folder without __init__.py (integrity/) is a namespace package
            found.setdefault(".".join(parts[:k]), True)
    return found


@dataclass
class Move:
    old: str  # dotted, under ckpt_tool
    new: str
    src: Path
    dst: Path


def planned_moves(root: Path) -> list[Move]:
    moves = []
    for old, new in MOVES.items():
        src, dst = root / PACKAGE / old.replace(".", "/"), root / PACKAGE / new.replace(".", "/")
        if src.is_dir():
            moves.append(Move(old, new, src, dst))
        elif src.with_suffix(".py").is_file():
            moves.append(Move(old, new, src.with_suffix(".py"), dst.with_suffix(".py")))
        elif not (dst.is_dir() or dst.with_suffix(".py").is_file()):
            sys.exit(f"MOVES: {old} is neither in ckpt_tool/ nor at its new place {new}: drop or fix its row")
    return moves


def unplaced(root: Path) -> list[str]:
    """Top-level entries of ckpt_tool/ that no row of MOVES moves and that are no layer folder."""
    out = []
    for p in sorted((root / PACKAGE).iterdir()):
        if p.name in ("__init__.py", "__main__.py", "__pycache__") or p.name in LAYERS:
            continue
        if p.suffix == ".py" and p.stem not in MOVES:
            out.append(p.name)
        elif p.is_dir() and any(p.rglob("*.py")) and p.name not in MOVES:
            out.append(p.name + "/")
    return out


# --- Python imports ------------------------------------------------------------------------------

def _spell(target: str, importer_package: str, relative: bool) -> str:
    """`target` (absolute) as written in a `from ... import` of a module in `importer_package`."""
    if not relative:
        return target
    ip, tp = importer_package.split("."), target.split(".")
    common = 0
    while common < min(len(ip), len(tp)) and ip[common] == tp[common]:
        common += 1
    return "." * (len(ip) - common + 1) + ".".join(tp[common:])


def _resolve(node: ast.ImportFrom, package: str | None) -> str | None:
    if node.level:
        if package is None:
            return None  # a relative import of a test or bench package: not ckpt_tool's
        parts = package.split(".")
        if node.level > len(parts):
            return None
        base = parts[:len(parts) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))
    return node.module


def _groups(base: str, names: list[tuple[str, str | None]], known: dict[str, bool]) -> list[tuple[str, list[str]]]:
    """`from base import names` again, in the new tree: [(new module, ["a", "b as c"])], in order."""
    groups: dict[str, list[str]] = {}
    for name, asname in names:
        sub = f"{base}.{name}"
        if name != "*" and sub in known:  # a module: it goes where its row says, under its local name
            moved = new_name(sub)
            parent, _, last = moved.rpartition(".")
            local = asname or name
            groups.setdefault(parent, []).append(last if local == last else f"{last} as {local}")
        else:
            groups.setdefault(new_name(base), []).append(name if asname is None else f"{name} as {asname}")
    return list(groups.items())


def _module_of(rel: str) -> tuple[str | None, bool]:
    """The module a file of ckpt_tool/ is (dotted) and whether it is a package; (None, False) outside it."""
    if not rel.startswith(PACKAGE + "/") or not rel.endswith(".py"):
        return None, False
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _new_module(module: str, moved_to: dict[str, str]) -> str:
    return moved_to.get(module, new_name(module))


def rewrite_imports(text: str, rel: str, known: dict[str, bool], moved_to: dict[str, str]) -> str:
    """Every `from X import ...` statement of a Python file, for the new tree (see the module docstring)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    module, is_package = _module_of(rel)
    old_package = None if module is None else (module if is_package else module.rpartition(".")[0])
    new_module = None if module is None else _new_module(module, moved_to)
    new_package = None if new_module is None else (new_module if is_package else new_module.rpartition(".")[0])
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, list[str]]] = []  # (first line, last line, replacement lines), 0-based
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = _resolve(node, old_package)
        if base is None or not (base == PACKAGE or base.startswith(PACKAGE + ".")):
            continue
        relative = node.level > 0
        if relative and new_package is None:
            continue
        groups = _groups(base, [(a.name, a.asname) for a in node.names], known)
        original = [a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names]
        spelled = [(_spell(m, new_package or "", relative), names) for m, names in groups]
        first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        old_spelling = "." * node.level + (node.module or "")
        if len(spelled) == 1 and spelled[0][1] == original:
            if spelled[0][0] == old_spelling:
                continue
            # only the module changes: replace it in place, keeping the names' layout and comments
            line = lines[first]
            head = re.compile(r"(\bfrom\s+)" + re.escape(old_spelling) + r"(\s+import\b)")
            new_line, n = head.subn(lambda m: m.group(1) + spelled[0][0] + m.group(2), line, count=1)
            if n == 1:
                edits.append((first, first, [new_line]))
                continue
        # split or renamed: the statement written again (a trailing comment of its last line kept)
        first_line = lines[first].encode()
        last_line = lines[last].encode()
        prefix = first_line[:node.col_offset].decode()
        suffix = last_line[node.end_col_offset or 0:].decode()
        indent = prefix if not prefix.strip() else ""
        statements = [_statement(m, names, indent or " " * len(prefix)) for m, names in spelled]
        if prefix.strip():  # `try: from x import y`: keep it on one line
            body = prefix + "; ".join(s.strip() for s in statements) + suffix
        else:
            body = prefix + ("\n" + indent).join(s.lstrip() if i == 0 else s.strip()
                                                  for i, s in enumerate(statements)) + suffix
        edits.append((first, last, [body]))
    for first, last, new in sorted(edits, reverse=True):
        lines[first:last + 1] = new
    return "".join(lines)


def _statement(module: str, names: list[str], indent: str, width: int = 120) -> str:
    one = f"{indent}from {module} import {', '.join(names)}"
    if len(one) <= width:
        return one
    out, line = [], f"{indent}from {module} import ("
    for i, name in enumerate(names):
        piece = name + (", " if i < len(names) - 1 else ")")
        if len(line) + len(piece.rstrip()) > width and not line.endswith("("):
            out.append(line.rstrip())
            line = indent + "    "
        line += piece
    out.append(line)
    return "\n".join(out)


# --- text: dotted names, strings, paths ---------------------------------------------------------------

def _alternation(names: list[str]) -> str:
    return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))


DOTTED = re.compile(rf"(?<![\w.]){PACKAGE}\.({_alternation(list(MOVES))})(?!\w)")
FROM_IN_TEXT = re.compile(rf"(?<![\w.])from ({PACKAGE}(?:\.\w+)*) import (\w+(?: as \w+)?(?:, \w+(?: as \w+)?)*)")


def rewrite_dotted(text: str) -> str:
    return DOTTED.sub(lambda m: f"{PACKAGE}.{MOVES[m.group(1)]}", text)


def rewrite_from_in_text(text: str, known: dict[str, bool], keep: set[str]) -> str:
    """`from ckpt_tool[.x] import a, b` written in strings and pages (a real statement was rewritten by
    rewrite_imports already: its new names match no old module, so it is left as it is)."""
    def one(m: re.Match[str]) -> str:
        base = m.group(1)
        names = []
        for piece in m.group(2).split(", "):
            name, _, asname = piece.partition(" as ")
            names.append((name, asname or None))
        if base == PACKAGE and all(n in keep for n, _ in names):
            return m.group(0)  # a documented name of the package itself (`from ckpt_tool import manifest`)
        groups = _groups(base, names, known)
        return "; ".join(f"from {mod} import {', '.join(ns)}" for mod, ns in groups)
    return FROM_IN_TEXT.sub(one, text)


def _path_rules() -> list[tuple[re.Pattern[str], str, bool]]:
    """(pattern, replacement, also in Python files) for the spellings of a moved module's path."""
    rules = []
    for old, new in MOVES.items():
        o, n = old.replace(".", "/"), new.replace(".", "/")
        package = (ROOT / PACKAGE / o).is_dir() or (ROOT / PACKAGE / n).is_dir()
        form_old, form_new = (o + "/", n + "/") if package else (o + ".py", n + ".py")
        # with the package's name: anywhere, and in every kind of file
        rules.append((re.compile(rf"(?<![\w./-]){PACKAGE}/{re.escape(form_old)}"), f"{PACKAGE}/{form_new}", True))
        if package:
            # without it: a module inside a moved package (`torchsave/payload.py`) anywhere, and the
            # package as a folder in backticks (`distcp/`) in pages, comments and docstrings (elsewhere
            # `arrays/0` or `validate/**` may be a leaf's key or pattern: left alone)
            rules.append((re.compile(rf"(?<![\w./*-]){re.escape(form_old)}(?=[\w/]*\.py\b)"), form_new, True))
            rules.append((re.compile(rf"(?<=`){re.escape(form_old)}(?=`)"), form_new, False))
        else:
            # a module inside a folder (`formats/contract.py`) anywhere; a bare top-level file name
            # (`engine.py`) outside Python (in Python: in comments and docstrings, rewrite_python_prose)
            rules.append((re.compile(rf"(?<![\w./-]){re.escape(form_old)}(?![\w])"), form_new, "/" in o))
        # a renamed package's dotted spelling in prose (`torchsave.safe_pickle`): comments, docstrings, pages
        if "." not in old and old.rpartition(".")[2] != new.rpartition(".")[2] and (ROOT / PACKAGE / o).is_dir():
            rules.append((re.compile(rf"(?<![\w./-]){re.escape(o)}\.(?=[a-z_])"), new.rpartition(".")[2] + ".", False))
        # `ckpt_tool/validate` without a slash after it (a package cited as a folder)
        rules.append((re.compile(rf"(?<![\w./-]){PACKAGE}/{re.escape(o)}(?![\w/.])"), f"{PACKAGE}/{n}", True))
    return rules


PATH_RULES = _path_rules()


def rewrite_paths(text: str, python: bool) -> str:
    for pattern, replacement, in_python in PATH_RULES:
        if in_python or not python:
            text = pattern.sub(replacement, text)
    return rewrite_python_prose(text) if python else text


BUILDS_PACKAGE_PATH = re.compile(rf"""/ ["']{PACKAGE}["']""")
# a string that is just a moved module's file or a moved package's folder, as a path under ckpt_tool/
BARE_FILE = re.compile(rf"""^[rbuf]*(["'])({_alternation([o.replace(".", "/") + ".py" for o in MOVES]
                                                     + [o.replace(".", "/") + "/" for o in MOVES])})\1$""")


def rewrite_python_prose(text: str) -> str:
    """A bare `engine.py` in a Python file's comments and docstrings (prose about the module), and a
    string that is just such a name (or a moved package's folder, "torchsave/") in a file that builds
    paths under the package (`PACKAGE / "engine.py"`); other strings may be a test's synthetic files
    (`tmp / "model.py"`): left alone."""
    try:
        tree = ast.parse(text)
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (SyntaxError, tokenize.TokenError):
        return text
    prose = {(n.lineno, n.col_offset) for n in ast.walk(tree)
             if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
    paths = BUILDS_PACKAGE_PATH.search(text) is not None
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    edits = []
    for tok in tokens:
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.start in prose):
            new = tok.string
            for pattern, replacement, _ in PATH_RULES:
                new = pattern.sub(replacement, new)
        elif tok.type == tokenize.STRING and paths and BARE_FILE.match(tok.string):
            m = BARE_FILE.match(tok.string)
            assert m is not None
            old = m.group(2)
            stem, suffix = (old[:-1], "/") if old.endswith("/") else (old[:-3], ".py")
            moved = MOVES[stem.replace("/", ".")].replace(".", "/") + suffix
            new = tok.string.replace(old, moved)
        else:
            continue
        if new != tok.string:
            a = starts[tok.start[0] - 1] + tok.start[1]
            b = starts[tok.end[0] - 1] + tok.end[1]
            edits.append((a, b, new))
    for a, b, new in sorted(edits, reverse=True):
        text = text[:a] + new + text[b:]
    return text


def public_modules() -> set[str]:
    """Modules docs/python-api.md imports from the package itself (`from ckpt_tool import manifest`)."""
    page = ROOT / "docs" / "python-api.md"
    found: set[str] = set()
    if page.exists():
        for m in FROM_IN_TEXT.finditer(page.read_text()):
            if m.group(1) == PACKAGE:
                found.update(p.partition(" as ")[0] for p in m.group(2).split(", "))
        found.update(re.findall(rf"(?<![\w.]){PACKAGE}\.(\w+)", page.read_text()))
    return {name for name in found if name in MOVES}


def add_layer_packages(text: str) -> str:
    """A literal listing loaded modules ({"ckpt_tool", "ckpt_tool.base.errors", ...}: it holds the package
    itself) lists the layer folders its modules now sit in too: importing base/errors.py loads base/."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    folders = {f"{PACKAGE}.{f}" for f in FOLDER_DOCS}
    lines = text.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Set, ast.List, ast.Tuple)) or not node.elts:
            continue
        values = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        if PACKAGE not in values or len(values) != len(node.elts):
            continue
        missing = sorted({".".join(v.split(".")[:2]) for v in values if ".".join(v.split(".")[:2]) in folders}
                         - set(values))
        if missing:
            last = node.elts[-1]
            quote = lines[last.lineno - 1].encode()[last.col_offset:last.col_offset + 1].decode()
            edits.append((last.end_lineno or last.lineno, last.end_col_offset or 0, "".join(f", {quote}{m}{quote}" for m in missing)))
    for line_no, col, insert in sorted(edits, reverse=True):
        raw = lines[line_no - 1].encode()
        lines[line_no - 1] = (raw[:col] + insert.encode() + raw[col:]).decode()
    return "".join(lines)


def rewrite_file(rel: str, text: str, known: dict[str, bool], moved_to: dict[str, str], keep: set[str]) -> str:
    python = rel.endswith(".py")
    if python:
        text = rewrite_imports(text, rel, known, moved_to)
    text = rewrite_from_in_text(text, known, keep if not python else set())
    text = rewrite_dotted(text)
    if python:
        text = add_layer_packages(text)
    return rewrite_paths(text, python)


def tracked_text_files() -> list[str]:
    out = []
    for rel in git("ls-files").splitlines():
        if rel.startswith(SKIP):
            continue
        if rel.startswith("fixtures/") and rel.count("/") > 1:
            continue  # a fixture's own files (data, the scripts the libraries wrote)
        name = rel.rsplit("/", 1)[-1]
        if rel.endswith(SUFFIXES) or name in NAMES:
            if (ROOT / rel).is_file():
                out.append(rel)
    return out


# --- the package's face ----------------------------------------------------------------------------

def keep_public_names(init: Path, keep: set[str]) -> bool:
    """ckpt_tool/__init__.py answers each documented module name from its new place, lazily."""
    text = init.read_text()
    raise_line = '    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")\n'
    added = []
    for name in sorted(keep):
        parent, _, last = MOVES[name].rpartition(".")
        block = (f"    if name == {name!r}:  # documented as `from ckpt_tool import {name}` (docs/python-api.md)\n"
                 f"        from .{parent} import {last}\n\n"
                 f"        return {last}\n")
        if block not in text:
            added.append(block)
    if not added:
        return False
    if raise_line not in text:
        sys.exit(f"{init}: no `{raise_line.strip()}` in its __getattr__ to add {sorted(keep)} before: add them by hand")
    init.write_text(text.replace(raise_line, "".join(added) + raise_line, 1))
    return True


# --- templates ------------------------------------------------------------------------------------

def template_targets() -> dict[str, Path]:
    """{path in the tree: template}; a test the tests/ re-layout moved is found by its file name."""
    out = {}
    tracked = git("ls-files").splitlines()
    # (stored as NAME.tmpl: the tree's lints and pytest read no template as the project's own file)
    for tpl in sorted(TEMPLATES.rglob("*.tmpl")):
        rel = tpl.relative_to(TEMPLATES).as_posix().removesuffix(".tmpl")
        name = rel.rsplit("/", 1)[-1]
        if not (ROOT / rel).exists():
            same = [t for t in tracked if t.rsplit("/", 1)[-1] == name and t.startswith(rel.split("/")[0] + "/")]
            if len(same) == 1:
                rel = same[0]
        out[rel] = tpl
    return out


def apply_template(rel: str, tpl: Path, original_rel: str) -> str | None:
    """Writes the template over `rel`, merged with main's changes to it since TEMPLATE_BASE (`git
    merge-file`); where a change of main's collides with the template, the template's side is kept
    (its usual cause: a new module's row in the layer table, which MOVES now places) and what main
    had there is returned for a reader to check."""
    base = subprocess.run(["git", "show", f"{TEMPLATE_BASE}:{original_rel}"], cwd=ROOT, capture_output=True,
                          text=True)
    target = ROOT / rel
    current = target.read_text() if target.exists() else ""
    new = tpl.read_text()
    if base.returncode != 0 or current == base.stdout:
        target.write_text(new)
        return None
    tmp = ROOT / "build" / "relayout"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "base").write_text(base.stdout)
    (tmp / "new").write_text(new)
    (tmp / "current").write_text(current)
    files = [str(tmp / "current"), str(tmp / "base"), str(tmp / "new")]
    labels = ["-L", "main", "-L", "base", "-L", "template"]
    plain = subprocess.run(["git", "merge-file", "-p", *labels, *files], cwd=ROOT, capture_output=True, text=True)
    if plain.returncode == 0:
        target.write_text(plain.stdout)
        return None
    theirs = subprocess.run(["git", "merge-file", "-p", "--theirs", *labels, *files], cwd=ROOT, capture_output=True,
                            text=True)
    target.write_text(theirs.stdout)
    mains = re.findall(r"^<<<<<<< main\n(.*?)^=======", plain.stdout, flags=re.S | re.M)
    shown = " | ".join(" ".join(m.split())[:200] for m in mains)
    return f"{rel}: {len(mains)} change(s) of main's since {TEMPLATE_BASE[:8]} collided with the template, " \
           f"which was kept there; main had: {shown}"


# --- the run -----------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="say what would move and change; touch nothing")
    ap.add_argument("--table", action="store_true", help="print the table of moves and exit")
    ap.add_argument("--force", action="store_true", help="run on a tree with changes to tracked files")
    args = ap.parse_args()
    if args.table:
        for old, new in MOVES.items():
            print(f"{PACKAGE}.{old:<18} -> {PACKAGE}.{new}")
        return 0
    if not args.force and not args.dry_run and git("status", "--porcelain", "--untracked-files=no").strip():
        sys.exit("tracked files have changes: run on a clean checkout (or --force)")
    stray = unplaced(ROOT)
    if stray:
        sys.exit(f"ckpt_tool/ holds modules no row of MOVES places: {', '.join(stray)} "
                 f"(add a row to MOVES in {Path(__file__).name}: the lowest layer folder above all it imports)")
    moves = planned_moves(ROOT)
    known = old_modules(ROOT)
    # each file's module after the move (for spelling its relative imports from its new place)
    moved_to = {m: new_name(m) for m in known}
    keep = public_modules()
    templates = template_targets()

    changed: dict[str, str] = {}
    own = {f"{PACKAGE}/{f}/__init__.py" for f in FOLDER_DOCS}  # written below, for the new tree already
    for rel in tracked_text_files():
        if rel in templates or rel in own:
            continue
        text = (ROOT / rel).read_text(errors="surrogateescape")
        new = rewrite_file(rel, text, known, moved_to, keep)
        if new != text:
            changed[rel] = new
    print(f"{len(moves)} moves, {len(changed)} files rewritten, {len(templates)} templates")
    if args.dry_run:
        for m in moves:
            print(f"  git mv {m.src.relative_to(ROOT)} {m.dst.relative_to(ROOT)}")
        for rel in sorted(changed):
            print(f"  rewrite {rel}")
        for rel in sorted(templates):
            print(f"  template {rel}")
        return 0

    for rel, text in changed.items():
        (ROOT / rel).write_text(text, errors="surrogateescape")
    touched: set[str] = set(changed)
    for folder, doc in FOLDER_DOCS.items():
        init = ROOT / PACKAGE / folder / "__init__.py"
        if not init.exists():
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text(f'"""{doc}"""\n')
            touched.add(init.relative_to(ROOT).as_posix())
    for m in moves:
        m.dst.parent.mkdir(parents=True, exist_ok=True)
        # (a rewritten file was written at its old path: git mv takes the new text along)
        git("mv", str(m.src.relative_to(ROOT)), str(m.dst.relative_to(ROOT)))
        if m.src.is_dir():  # what git did not move: bytecode of the old place
            shutil.rmtree(m.src / "__pycache__", ignore_errors=True)
            if not any(m.src.iterdir()):
                m.src.rmdir()
    init = ROOT / PACKAGE / "__init__.py"
    keep_public_names(init, keep)
    conflicts = []
    for rel, tpl in templates.items():
        problem = apply_template(rel, tpl, tpl.relative_to(TEMPLATES).as_posix().removesuffix(".tmpl"))
        if problem:
            conflicts.append(problem)
        touched.add(rel)
    shutil.rmtree(ROOT / PACKAGE / "__pycache__", ignore_errors=True)
    # the tree was clean (tracked files): what changed in tracked files is this run's; new files are named
    git("add", "-u", "--", ".")
    git("add", "--", *sorted(t for t in touched if (ROOT / t).exists()))
    leftovers = residue(set(templates))
    print("staged; now check:\n"
          "  .venv/bin/python -m mypy\n"
          "  .venv/bin/python -m pytest -q -p no:xdist tests/imports/test_import_layers.py tests/imports/test_startup_imports.py\n"
          "  .venv/bin/python tests/import_graph.py\n"
          "  .venv/bin/ckpt --help && .venv/bin/ckpt inspect fixtures/orbax_ocdbt_zarr2")
    for line in leftovers:
        print("left for a reader:", line)
    for c in conflicts:
        print("REVIEW:", c)
    return 0


def residue(templated: set[str]) -> list[str]:
    """Old spellings left after the run, for a reader to judge: a bare top-level file name in Python
    (`engine.py` in a comment; in Python a bare name may be a test's synthetic file, so it is not
    rewritten) and the old package spellings without the package's prefix (`torchsave.safe_pickle`)."""
    files = [o for o in MOVES if "." not in o]
    pattern = re.compile(rf"(?<![\w./-])(?:({_alternation(files)})\.py\b|(distcp|torchsave)\.[a-z_]+\b)")
    out = []
    for rel in tracked_text_files():
        if not (ROOT / rel).exists() or rel in {f"{PACKAGE}/{f}/__init__.py" for f in FOLDER_DOCS} | set(templated):
            continue
        hits = [i for i, line in enumerate((ROOT / rel).read_text(errors="replace").splitlines(), 1)
                if pattern.search(line)]
        if hits:
            out.append(f"{rel}: lines {', '.join(map(str, hits[:12]))}{' ...' if len(hits) > 12 else ''}")
    return out


if __name__ == "__main__":
    sys.exit(main())

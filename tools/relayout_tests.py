#!/usr/bin/env python3
"""Issue 47 item 5: lay tests/ out as the package is, as one mechanical step.

    python tools/relayout_tests.py             # on a clean checkout: moves, rewrites, stages (git add); commits nothing
    python tools/relayout_tests.py --dry-run   # says what it would move and which files it would change
    python tools/relayout_tests.py --table     # prints where each test file goes
    python tools/relayout_tests.py --verify    # also collects the suite before and after (pytest --collect-only)
                                               # and fails unless the same tests are collected

Each tests/test_*.py moves into the folder of the package layer it mainly exercises (LAYOUT below:
tests/base/, tests/storage/, tests/core/, tests/scheduler/, tests/machinery/<part>/,
tests/formats/<format>/, tests/ops/<operation>/, tests/cli/), or, for what is no package module, of
the part of the repository it checks (tests/docs/, tests/bench/, tests/fuzz/, tests/imports/ for
what a command imports, tests/conformance/ beside the catalogue). A test file that no row names
goes by RULES, the first pattern its name matches; a file in neither stops the run with its name
(add a row). The shared helpers (conftest.py, storage_suite.py, fuzz_lib.py, library_reference.py,
...), tests/conformance/, tests/data/ and tests/fuzz_corpus/ stay where they are.

What it does, in order:
1. checks the tree: a git work tree without staged or unstaged changes to tracked files (--force
   skips), every top-level tests/test_*.py placed, the test files' names unique under tests/ after
   the move (pytest imports a test file by its own name: no __init__.py under tests/);
2. rewrites, in each moved file, the paths it computes from its own place, which were tests/:
   `Path(__file__).parent` (or `.resolve().parent`, `.parent.parent`, `.parents[N]`) gets as many
   more levels as the file moves down, and `os.path.dirname(os.path.abspath(__file__))` (or of
   `__file__`) as many more `os.path.dirname(...)`; so `ROOT`, `HERE / "data"` and the like still
   name the repository and tests/. Any other use of `__file__` (a script running itself, a message
   naming the file) is left as it is, and listed;
3. rewrites, in every tracked text file (the tests, conftest's SPREAD_FILES, Makefile, pyproject.toml,
   .ci/, docs/, README, bench/, fuzz/, fixtures/'s scripts, ckpt_tool/'s comments), every path
   `tests/test_x.py` of a moved file (with `::test` node ids) to its new path; and docs/architecture.md's
   line for tests/ says how tests/ is laid out;
4. `git mv`s the files and stages what it changed (`git add` of those paths only).

What keeps working without a rewrite: `from conftest import ...` (pytest puts tests/, the folder of the
rootdir conftest, on sys.path) and the helpers beside it (`import fuzz_lib`, `from storage_suite import`);
a test file importing another's helpers (`from test_reshard import _restore`), because conftest puts
every folder under tests/ that holds test files on sys.path; the Makefile's lanes (`pytest` finds
tests under testpaths = ["tests"] at any depth, and the markers are the files' own).

Run it after tools/relayout.py (the package's re-layout), whose templates are written for the flat
tests/ and the old depth. Idempotent: a second run finds nothing to move and nothing to rewrite.
Nothing here imports ckpt_tool or the tests.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = "tests"

# folder under tests/ -> the test files it holds (without .py). Each folder is named after the
# package folder it mirrors (docs/architecture.md's tree), or after the part of the repository its
# tests check. A file's row is the module it mainly exercises, from its docstring and imports.
LAYOUT: dict[str, tuple[str, ...]] = {
    # base/: errors, text, names, checksum, directio, pagecache, bufferpool, distributed, ...
    "base": ("test_bufferpool", "test_checksum", "test_directio", "test_pagecache", "test_key_space",
             "test_launchers"),
    # storage/: local and object stores, containment, the OCDBT database reader
    "storage": ("test_storage", "test_storage_backends", "test_storage_faults", "test_local_listing",
                "test_ocdbt_bulk", "test_ocdbt_local", "test_s3", "test_remote_errors", "test_remote_latency",
                "test_remote_memory", "test_remote_ranges", "test_remote_upload_checksums", "test_hub_cache"),
    # core/: the contract, the model, blocks, casting, filters, unstack
    "core": ("test_blocks", "test_convert_dtype", "test_filters", "test_unstack", "test_format_contract"),
    # scheduler/: the one read scheduler and the memory bound it keeps
    "scheduler": ("test_scheduler", "test_scheduler_small", "test_scheduler_zarr3", "test_memory_bound"),
    # machinery/: the shared format machinery
    "machinery/arrays": ("test_zarr_plain", "test_orbax_stored_chunks"),
    "machinery/dcp": ("test_dcp_fast_parse",),
    "machinery/torch_save": ("test_safe_pickle", "test_pickle_graphs", "test_pickle_memory",
                             "test_torch_load_agreement", "test_torch_views"),
    # formats/: the registry, and each format package
    "formats": ("test_registry", "test_mixed_folders"),
    "formats/orbax": ("test_orbax_reader", "test_orbax_writer", "test_orbax_schema", "test_orbax_items",
                      "test_orbax_versions", "test_orbax_direct", "test_orbax_zarr_metadata",
                      "test_validate_orbax", "test_remote_orbax_direct"),
    "formats/dcp": ("test_dcp_reader", "test_dcp_writer", "test_dcp_variants", "test_dcp_contract",
                    "test_dcp_entry_bounds", "test_validate_dcp"),
    "formats/safetensors": ("test_safetensors_reader", "test_safetensors_s3", "test_safetensors_scalars",
                            "test_safetensors_validate", "test_safetensors_writer"),
    "formats/torch_save": ("test_torch_save",),
    "formats/msgpack": ("test_legacy_jax", "test_legacy_scalars", "test_msgpack_agreement"),
    "formats/deepspeed": ("test_deepspeed", "test_deepspeed_fp16", "test_deepspeed_hf", "test_deepspeed_pipe_moe",
                          "test_deepspeed_universal", "test_deepspeed_weights"),
    "formats/megatron": ("test_megatron", "test_megatron_distopt", "test_megatron_legacy_tp"),
    # ops/: one folder per operation (the engine and what convert uses; the destination's life; ...)
    "ops/convert": ("test_convert", "test_engine_split", "test_source_completeness", "test_exports_asked",
                    "test_hf_export", "test_orbax_stored_copy", "test_disk_full", "test_nontensor_items"),
    "ops/destination": ("test_output_safety", "test_overwrite_foreign", "test_remote_commit"),
    "ops/diff": ("test_diff", "test_diff_cast", "test_diff_keys"),
    "ops/reshard": ("test_reshard", "test_reshard_host_arrays", "test_topology", "test_multihost_gcs"),
    "ops/runs": ("test_runs", "test_run_roots_default", "test_step_option", "test_root_findings",
                 "test_resume_rules"),
    "ops/validate": ("test_findings_once", "test_findings_grouping"),
    "ops/inspect": ("test_per_leaf_cost",),
    "ops/manifest": ("test_manifest",),
    # cli/: the commands as a user runs them, whole processes across commands; supervise (the console
    # script's parent process on the jax.distributed route)
    "cli": ("test_cli_contract", "test_cli_exit", "test_cli_inspect", "test_cli_polish", "test_error_messages",
            "test_text_safety", "test_ls_latest_cli", "test_bounds_round3", "test_trust_round3",
            "test_small_things", "test_supervise"),
    # not a package folder: what each command and layer imports, the docs, the benches, the fuzzer,
    # the library-reference helpers the conformance catalogue uses
    "imports": ("test_import_layers", "test_read_loads_no_writer", "test_startup_imports"),
    "docs": ("test_docs_examples", "test_docs_pages"),
    "bench": ("test_bench_probes", "test_bench_summary", "test_scale_bench", "test_tpu_host_bench"),
    "fuzz": ("test_fuzz",),
    "conformance": ("test_library_reference",),
}

# a test file no row of LAYOUT names (added after the table was written): the first pattern its name
# matches gives its folder
RULES: tuple[tuple[str, str], ...] = (
    (r"^test_(orbax|validate_orbax)", "formats/orbax"),
    (r"^test_(dcp|validate_dcp)", "formats/dcp"),
    (r"^test_safetensors", "formats/safetensors"),
    (r"^test_deepspeed", "formats/deepspeed"),
    (r"^test_megatron", "formats/megatron"),
    (r"^test_(msgpack|legacy_)", "formats/msgpack"),
    (r"^test_torch_save", "formats/torch_save"),
    (r"^test_(safe_pickle|pickle_|torch_)", "machinery/torch_save"),
    (r"^test_(storage|remote_|s3|gcs|ocdbt_)", "storage"),
    (r"^test_scheduler", "scheduler"),
    (r"^test_convert", "ops/convert"),
    (r"^test_diff", "ops/diff"),
    (r"^test_reshard", "ops/reshard"),
    (r"^test_(runs|run_roots|step)", "ops/runs"),
    (r"^test_cli_", "cli"),
    (r"^test_docs", "docs"),
    (r"(^test_bench_|_bench$)", "bench"),
)

SKIP = ("tests/fuzz_corpus/", "tools/relayout_tests.py")


def git(*args: str) -> str:
    r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"git {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def folder_of(name: str) -> str | None:
    """The folder under tests/ a test file (its name without .py) goes to: its LAYOUT row, else RULES."""
    for folder, names in LAYOUT.items():
        if name in names:
            return folder
    for pattern, folder in RULES:
        if re.search(pattern, name):
            return folder
    return None


def plan() -> dict[str, str]:
    """{tests/test_x.py: tests/<folder>/test_x.py} for every tracked top-level test file."""
    tracked = git("ls-files", "--", TESTS).splitlines()
    top = sorted(p for p in tracked if re.fullmatch(rf"{TESTS}/test_[A-Za-z0-9_]+\.py", p))
    moves, unplaced = {}, []
    for rel in top:
        name = rel.removeprefix(f"{TESTS}/").removesuffix(".py")
        folder = folder_of(name)
        if folder is None:
            unplaced.append(rel)
        else:
            moves[rel] = f"{TESTS}/{folder}/{name}.py"
    if unplaced:
        sys.exit("no folder for " + ", ".join(unplaced) + ": add each to LAYOUT in tools/relayout_tests.py")
    # pytest imports a test file by its own name (prepend import mode, no __init__.py), and conftest puts
    # every folder holding test files on sys.path: the modules in tests/ and in those folders keep
    # unique names
    after = [moves.get(p, p) for p in tracked if p.endswith(".py") and not p.startswith(SKIP)]
    folders = {TESTS} | {p.rsplit("/", 1)[0] for p in after if p.rsplit("/", 1)[-1].startswith("test_")}
    seen: dict[str, str] = {}
    for rel in after:
        if rel.rsplit("/", 1)[0] in folders:
            stem = rel.rsplit("/", 1)[-1]
            if stem in seen:
                sys.exit(f"two modules named {stem} after the move: {seen[stem]} and {rel}")
            seen[stem] = rel
    return moves


def table_rows() -> list[str]:
    """The table, with what RULES adds and the rows that name no file (both worth a look)."""
    tracked = set(git("ls-files", "--", TESTS).splitlines())
    moved = plan() if any(re.fullmatch(rf"{TESTS}/test_\w+\.py", p) for p in tracked) else {}
    rows = []
    for folder, names in LAYOUT.items():
        for name in names:
            there = f"{TESTS}/{name}.py" in tracked or f"{TESTS}/{folder}/{name}.py" in tracked
            rows.append(f"{TESTS}/{folder + '/':22s} {name}.py" + ("" if there else "   (no such file)"))
    for old, new in moved.items():
        name = old.rsplit("/", 1)[-1].removesuffix(".py")
        if not any(name in names for names in LAYOUT.values()):
            rows.append(f"{new.rsplit('/', 1)[0] + '/':28s} {name}.py   (by RULES)")
    return rows


# --- step 2: paths a moved file computes from its own place ------------------------------------------------

# Path(__file__)[.resolve()] followed by .parent... or .parents[N]; os.path.dirname(<abspath of> __file__)
_OWN_DIR = re.compile(r"Path\(__file__\)(?P<resolve>\.resolve\(\))?(?:(?P<hops>(?:\.parent)+)(?![\w\[])|\.parents\[(?P<n>\d+)\])"
                      r"|os\.path\.dirname\((?:os\.path\.(?:abs|real)path\(__file__\)|__file__)\)")


def rewrite_own_paths(text: str, down: int) -> tuple[str, list[str]]:
    """`text` (a file moved `down` levels below tests/) with its __file__-relative directories kept, in
    one pass (so that no form is moved twice); the lines whose other uses of __file__ were left as they are."""
    def own_dir(m: re.Match) -> str:
        if m.group(0).startswith("os.path"):
            return "os.path.dirname(" * down + m.group(0) + ")" * down
        up = m.group("hops").count(".parent") - 1 if m.group("hops") else int(m.group("n"))
        return f"Path(__file__){m.group('resolve') or ''}.parents[{up + down}]"

    text = _OWN_DIR.sub(own_dir, text)
    kept = re.compile(r"Path\(__file__\)(\.resolve\(\))?\.parents\[\d+\]|(os\.path\.dirname\()+"
                      r"(os\.path\.(abs|real)path\(__file__\)|__file__)\)+")
    left = [line.strip() for line in text.splitlines() if re.search(r"(?<![\w.])__file__", kept.sub("", line))]
    return text, left


# --- step 3: paths naming a moved test file, anywhere ------------------------------------------------------

def rewrite_test_paths(text: str, moves: dict[str, str]) -> str:
    names = "|".join(sorted((re.escape(old.removeprefix(f"{TESTS}/")) for old in moves), key=len, reverse=True))
    if not names:
        return text
    pattern = re.compile(rf"(?<![\w.-]){TESTS}/({names})(?![\w])")
    return pattern.sub(lambda m: moves[f"{TESTS}/{m.group(1)}"], text)


# docs/architecture.md's line for tests/ in its tree of the repository, and what it says after the move
ARCHITECTURE = "docs/architecture.md"
TESTS_LINE = """tests/                the test suite (`make test`, `make check`); tests/conformance/ checks every format against
                      its library
"""
TESTS_LINE_AFTER = """tests/                the test suite (`make test`, `make check`), laid out as ckpt_tool/ is: base/, storage/,
                      core/, scheduler/, machinery/<part>/, formats/<format>/, ops/<operation>/, cli/ (and docs/,
                      bench/, fuzz/, imports/); conftest.py and the shared helpers sit at its top;
                      tests/conformance/ checks every format against its library
"""


def text_files() -> list[str]:
    return [p for p in git("ls-files").splitlines() if not p.startswith(SKIP) and (ROOT / p).is_file()]


# --- --verify: the same tests collected before and after ---------------------------------------------------

def collected() -> list[str]:
    python = ROOT / ".venv" / "bin" / "python"
    r = subprocess.run([str(python if python.exists() else sys.executable), "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:xdist", "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True)
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    if r.returncode != 0 or not ids:
        sys.exit(f"pytest --collect-only failed (exit {r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-2000:]}")
    return ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="say what would move and change; change nothing")
    ap.add_argument("--table", action="store_true", help="print where each test file goes")
    ap.add_argument("--verify", action="store_true", help="collect the suite before and after; the same tests")
    ap.add_argument("--force", action="store_true", help="run on a tree with uncommitted changes to tracked files")
    args = ap.parse_args()

    if args.table:
        print("\n".join(table_rows()))
        return
    if not args.force and not args.dry_run and git("status", "--porcelain", "--untracked-files=no").strip():
        sys.exit("the tree has uncommitted changes to tracked files: commit or stash them first (or --force)")
    moves = plan()
    if not moves:
        print("nothing to move: tests/ is laid out already")
        return
    before = collected() if args.verify else []

    changed: dict[str, str] = {}
    left: dict[str, list[str]] = {}
    for rel in text_files():
        try:
            text = (ROOT / rel).read_text()
        except UnicodeDecodeError:
            continue
        new = rewrite_test_paths(text, moves)
        if rel == ARCHITECTURE:
            if TESTS_LINE not in new:
                print(f"{ARCHITECTURE}: its tree's tests/ line is not the one expected: say there by hand that "
                      "tests/ is laid out as ckpt_tool/ is")
            new = new.replace(TESTS_LINE, TESTS_LINE_AFTER)
        if rel in moves:
            down = moves[rel].count("/") - rel.count("/")
            new, kept = rewrite_own_paths(new, down)
            if kept:
                left[rel] = kept
        if new != text:
            changed[rel] = new

    for old, new in moves.items():
        print(f"{'would move' if args.dry_run else 'move'} {old} -> {new}")
    for rel in sorted(changed):
        print(f"{'would rewrite' if args.dry_run else 'rewrite'} {moves.get(rel, rel)}")
    for rel, lines in left.items():
        for line in lines:
            print(f"left as is in {moves[rel]}: {line}")
    if args.dry_run:
        return

    for rel, text in changed.items():
        (ROOT / rel).write_text(text)
    for old, new in moves.items():
        (ROOT / new).parent.mkdir(parents=True, exist_ok=True)
        git("mv", old, new)
    git("add", "--", *sorted({moves.get(rel, rel) for rel in changed} | set(moves.values())))

    if args.verify:
        after = collected()
        rename = {old: new for old, new in moves.items()}
        expected = sorted(rename.get(i.split("::", 1)[0], i.split("::", 1)[0]) + "::" + i.split("::", 1)[1]
                          if "::" in i else i for i in before)
        if sorted(after) != expected:
            lost = sorted(set(expected) - set(after))
            new = sorted(set(after) - set(expected))
            sys.exit(f"collected {len(after)} tests after, {len(before)} before; not collected now: {lost[:20]}; "
                     f"new: {new[:20]}")
        print(f"collected the same {len(after)} tests before and after")

    print(f"\nmoved {len(moves)} test files, rewrote {len(changed)} files (staged, not committed). Check:\n"
          "  git diff --cached --stat\n"
          "  .venv/bin/python -m pytest --collect-only -q | tail -1     # the same count as before\n"
          "  .venv/bin/python -m pytest -q -p no:xdist tests/imports tests/docs tests/conformance/test_conformance_catalogue.py\n"
          "  make check")


if __name__ == "__main__":
    main()

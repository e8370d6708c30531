"""The README and docs/ are kept true by running them.

Every ```console block in README.md and docs/**/*.md is a session: each `$ ckpt ...` line runs (in this
process, through the CLI's own error handling, from the repository root, on the committed fixtures),
`$ echo $?` prints the previous command's exit code, `$ ckpt ... > FILE` writes stdout to FILE, and
any other `$ ...` line runs in bash. What each
printed (stdout and stderr, in the order written) must equal the lines below it after a small
normalisation, the same on both sides (NORMALISE):

- the temporary directory: each block writes under /tmp/ckpt-docs, which the test points at a path of
  its own that does not exist yet, as /tmp/ckpt-docs does not in a fresh shell (a block that writes
  there makes it: `mkdir -p`, or a command that creates its destination), so a block pasted as
  written runs; the README's blocks also run top to bottom sharing one such folder;
- durations ("in 0.2 s") and byte rates ("(16.5 KiB/s)"), which vary from run to run;
- `ckpt ls`'s modification times, which are the checkout's;
- a line holding only `...` stands for any number of lines (the rest of a long listing).

The README's ```python block runs too. So a changed output, option or message fails here. After an intended change, rewrite the blocks that
no longer match with `python tests/docs/test_docs_examples.py --update [FILE...]` and read the diff.

Beside the examples: every file, test and module the docs cite exists, every command and every
registered format has its page, the README's formats table and validate's finding-code table are the
registry's, every option a synopsis line uses is the command's, and `ckpt --help` names every format.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
TMP = "/tmp/ckpt-docs"  # where examples write; a fresh directory per block under test

# (pattern, replacement), applied to expected and actual output alike
NORMALISE = [
    (re.compile(r"\b\d+(?:\.\d+)? s\b"), "N s"),  # durations: "in 0.2 s"
    (re.compile(r"\b\d+(?:\.\d+)? (?:[KMGT]i)?B/s\b"), "N B/s"),  # byte rates
    (re.compile(r"\b\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\b(?! UTC)"), "YYYY-MM-DD hh:mm:ss"),  # ls's mtimes
]
ELLIPSIS = "..."


@dataclass
class Command:
    line: int  # 1-based, in its file
    text: str  # without the "$ " prompt; continuation lines joined
    expected: list[str] = field(default_factory=list)


@dataclass
class Block:
    path: Path
    line: int
    commands: list[Command]

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def console_blocks(path: Path) -> list[Block]:
    """The ```console blocks of a Markdown file, each as its commands and their expected lines."""
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```console":
            i += 1
            continue
        start, i = i + 1, i + 1
        commands: list[Command] = []
        while i < len(lines) and lines[i].strip() != "```":
            line = lines[i]
            if line.startswith("$ "):
                text, first = line[2:], i
                while text.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text[:-1] + " " + lines[i].strip()
                commands.append(Command(first + 1, text.strip()))
            elif commands:
                commands[-1].expected.append(line)
            else:
                raise AssertionError(f"{path.relative_to(ROOT)}:{i + 1}: a console block starts with a `$ ` line")
            i += 1
        blocks.append(Block(path, start, commands))
        i += 1
    return blocks


def normalise(lines: list[str], tmp: str) -> list[str]:
    out = []
    for line in lines:
        line = line.rstrip().replace(tmp, TMP)
        for pattern, replacement in NORMALISE:
            line = pattern.sub(replacement, line)
        out.append(line)
    while out and not out[-1]:
        out.pop()
    return out


def matches(expected: list[str], actual: list[str]) -> bool:
    """Whether `actual` is `expected`, a line of "..." standing for any number of lines."""
    if not expected:
        return not actual
    if expected[0] == ELLIPSIS:
        return any(matches(expected[1:], actual[k:]) for k in range(len(actual) + 1))
    return bool(actual) and expected[0] == actual[0] and matches(expected[1:], actual[1:])


def run_ckpt_inprocess(args: list[str], err: bool = False) -> tuple[int, Any]:
    """`ckpt ARGS` through the CLI's error handling; stdout and stderr as one stream, as a terminal shows
    them (with `err`: the pair (stdout, stderr), for a redirected stdout)."""
    from ckpt_tool.cli.main import _run

    out = io.StringIO()
    errors = io.StringIO() if err else out
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(errors):
        code = _run(args)
    return code, ((out.getvalue(), errors.getvalue()) if err else out.getvalue())


def run_block(block: Block, tmp: str) -> list[tuple[Command, list[str]]]:
    """Each command of the block with what it printed (raw), run in order from the repository root."""
    results = []
    code = 0
    env = {k: v for k, v in os.environ.items() if k != "CKPT_DEBUG"}
    for command in block.commands:
        text = command.text.replace(TMP, tmp)
        if text == "echo $?":
            output = f"{code}\n"
        elif text.startswith("ckpt "):
            args = shlex.split(text)[1:]
            if len(args) > 2 and args[-2] == ">":  # `ckpt inspect X --json > FILE`: stdout (only) to a file
                code, output = run_ckpt_inprocess(args[:-2], err=True)
                Path(args[-1] if os.path.isabs(args[-1]) else ROOT / args[-1]).write_text(output[0])
                output = output[1]
            else:
                code, output = run_ckpt_inprocess(args)
        else:
            done = subprocess.run(["bash", "-c", text], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=120)
            code, output = done.returncode, done.stdout
        results.append((command, output.splitlines()))
    return results


def _fresh_tmp(base: Path) -> str:
    """Where this run's /tmp/ckpt-docs is: a path that does not exist yet, as /tmp/ckpt-docs does not in
    a fresh shell, so that an example which writes there makes the folder itself (`mkdir -p`, or a
    command that creates its destination) and runs as written when pasted."""
    tmp = base / "ckpt-docs"
    shutil.rmtree(tmp, ignore_errors=True)
    base.mkdir(parents=True, exist_ok=True)
    return str(tmp)


BLOCKS = [block for page in PAGES for block in console_blocks(page)]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_console_example(block, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("CKPT_DEBUG", raising=False)
    tmp = _fresh_tmp(tmp_path)
    failures = []
    for command, output in run_block(block, tmp):
        expected = normalise(command.expected, tmp)
        actual = normalise(output, tmp)
        if not matches(expected, actual):
            failures.append(f"{block.path.relative_to(ROOT)}:{command.line}: $ {command.text}\n"
                            "--- expected\n" + "\n".join(expected) + "\n--- got\n" + "\n".join(actual))
    assert not failures, ("\n\n".join(failures) + "\n\n(after an intended change: "
                          "python tests/docs/test_docs_examples.py --update " + str(block.path.relative_to(ROOT)) + ")")


def test_readme_examples_run_top_to_bottom_in_one_shell(tmp_path, monkeypatch):
    """A reader pastes the README's examples one after another into one fresh shell: every block in
    order, sharing one /tmp/ckpt-docs that does not exist at the start. Each prints what it shows."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("CKPT_DEBUG", raising=False)
    tmp = _fresh_tmp(tmp_path)
    failures = []
    for block in console_blocks(ROOT / "README.md"):
        for command, output in run_block(block, tmp):
            if not matches(normalise(command.expected, tmp), normalise(output, tmp)):
                failures.append(f"README.md:{command.line}: $ {command.text}\n" + "\n".join(output))
    assert not failures, "\n\n".join(failures)


def test_there_are_examples_on_every_command_page():
    for page in sorted((DOCS / "commands").glob("*.md")):
        assert console_blocks(page), f"{page.relative_to(ROOT)} has no ```console example"
    assert len(console_blocks(ROOT / "README.md")) >= 5


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", path.read_text(), flags=re.S | re.M)


def test_readme_python_example_runs(monkeypatch):
    """The README's Python example runs as written, from the repository root."""
    monkeypatch.chdir(ROOT)
    blocks = python_blocks(ROOT / "README.md")
    assert blocks
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})


# -- what the docs cite exists -------------------------------------------------------------------------

# a repository path in prose or code: ckpt_tool/..., tests/..., fixtures/..., bench/..., fuzz/..., docs/...
CITED_PATH = re.compile(r"(?<![\w./<-])((?:ckpt_tool|tests|fixtures|bench|fuzz|docs)/[\w./-]*[\w/])")
CITED_MODULE = re.compile(r"(?<![\w./-])(ckpt_tool(?:\.\w+)+)")
GENERATED = ("bench/out/",)  # written by `make bench` (git-ignored): cited, never committed
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _resolves(dotted: str) -> bool:
    """Whether a dotted name is a module, or a name defined in one (ckpt_tool.latest, ckpt_tool.formats.REGISTRY)."""
    import importlib

    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for name in parts[k:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def _page_text(page: Path) -> str:
    return page.read_text()


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_cited_paths_modules_and_links_exist(page):
    text = _page_text(page)
    missing = []
    for match in CITED_PATH.finditer(text):
        cited = match.group(1).rstrip(".")
        if not cited.startswith(GENERATED) and not (ROOT / cited).exists():
            missing.append(cited)
    for match in CITED_MODULE.finditer(text):
        module = match.group(1)
        if not _resolves(module):
            missing.append(module)
    for match in LINK.finditer(text):
        target = match.group(1)
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (page.parent / target).exists():
            missing.append(f"link {target}")
    assert not missing, f"{page.relative_to(ROOT)} cites what is not there: {sorted(set(missing))}"


def test_every_command_and_format_has_a_page():
    from ckpt_tool import formats
    from ckpt_tool.cli.main import COMMANDS

    for name in COMMANDS:
        assert (DOCS / "commands" / f"{name}.md").exists(), f"docs/commands/{name}.md: `ckpt {name}` has no page"
    for info in formats.registered():
        assert (DOCS / "formats" / f"{info.name}.md").exists(), f"docs/formats/{info.name}.md: no page"
    pages = {p.stem for p in (DOCS / "commands").glob("*.md")} | {p.stem for p in (DOCS / "formats").glob("*.md")}
    known = set(COMMANDS) | set(formats.REGISTRY)
    assert pages <= known, f"pages for no command or format: {sorted(pages - known)}"
    index = (DOCS / "README.md").read_text()
    for name in COMMANDS:
        assert f"(commands/{name}.md)" in index, name
    for name in formats.REGISTRY:
        assert f"(formats/{name}.md)" in index, name


# -- tables made from the registries --------------------------------------------------------------------

def formats_table() -> str:
    """The README's formats table, from formats.REGISTRY (in the order lists show them)."""
    from ckpt_tool import formats

    rows = ["| format | reads | `convert --to` | `reshard` writes | one file by its path |",
            "|---|---|---|---|---|"]
    for f in formats.shown():
        single = ", ".join(f"`{s}`" for s in f.file_suffixes) if f.single_file else "no"
        if f.single_file == "any":
            single += " (or any local file, by its bytes)"
        elif f.single_file == "unclaimed":
            single += " (or any local file no other format names, by its bytes)"
        rows.append(f"| [{f.title}](docs/formats/{f.name}.md) | {f.reads or f.title} | "
                    f"{'`' + f.name + '`' if f.can_write else 'no'} | {'yes' if f.can_reshard else 'no'} | {single} |")
    return "\n".join(rows)


def codes_table() -> str:
    """validate's finding codes (docs/commands/validate.md), from findings.CODES."""
    from ckpt_tool.base.findings import CODES

    return "\n".join(["| code | meaning |", "|---|---|", *(f"| `{c}` | {m} |" for c, m in CODES.items())])


TABLES = {  # (page, marker name) -> generator
    ("README.md", "formats"): formats_table,
    ("docs/commands/validate.md", "codes"): codes_table,
}


def _between(text: str, name: str) -> tuple[int, int]:
    start_marker, end_marker = f"<!-- {name} table: generated", f"<!-- end {name} table -->"
    start = text.index(start_marker)
    start = text.index("\n", start) + 1
    return start, text.index(end_marker)


@pytest.mark.parametrize("page,name", list(TABLES))
def test_generated_tables_are_the_registrys(page, name):
    text = (ROOT / page).read_text()
    start, end = _between(text, name)
    assert text[start:end].strip() == TABLES[(page, name)]().strip(), (
        f"{page}: the {name} table is not the registry's: python tests/docs/test_docs_examples.py --update-tables")


# -- help texts and synopses ----------------------------------------------------------------------------

def _help(*args: str) -> str:
    code, output = run_ckpt_inprocess([*args, "--help"])
    assert code == 0, output
    return " ".join(output.split())


def test_top_help_names_every_registered_format():
    from ckpt_tool import formats

    text = _help()
    for f in formats.registered():
        assert " ".join((f.reads or f.title).split()) in text, f.name
    assert formats.joined(formats.writable_labels()) in text


@pytest.mark.parametrize("command", ["inspect", "validate", "diff", "convert", "reshard", "manifest"])
def test_command_help_names_every_format_it_reads(command):
    from ckpt_tool import formats

    text = _help(command)
    for f in formats.shown():
        assert f.label in text, (command, f.label)


SYNOPSIS = re.compile(r"^\s*(?:\$ )?ckpt (\w+)(?: (write|verify))?\b(.*)$")


def test_synopsis_options_are_the_commands():
    """Each `ckpt CMD ... --opt` line of a ```sh block uses only options CMD has (its --help lists them)."""
    from ckpt_tool.cli.main import COMMANDS

    helps: dict[tuple[str, ...], str] = {}
    bad = []
    for page in PAGES:
        in_sh = False
        for n, line in enumerate(_page_text(page).splitlines(), 1):
            if line.strip().startswith("```"):
                in_sh = line.strip() in ("```sh", "```console")
                continue
            match = SYNOPSIS.match(line) if in_sh else None
            if not match or match.group(1) not in COMMANDS:
                continue
            key = tuple(x for x in match.groups()[:2] if x)
            if key not in helps:
                helps[key] = _help(*key)
            code = match.group(3).split("#", 1)[0]
            for option in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", code):
                if option not in helps[key]:
                    bad.append(f"{page.relative_to(ROOT)}:{n}: ckpt {' '.join(key)} has no {option}")
    assert not bad, "\n".join(bad)


# -- updating the docs after an intended change ----------------------------------------------------------

def _update_examples(pages: list[Path]) -> None:
    import tempfile

    for page in pages:
        lines = page.read_text().splitlines()
        replacements: list[tuple[int, int, list[str]]] = []  # (first expected line, end, new lines), 0-based
        for block in console_blocks(page):
            with tempfile.TemporaryDirectory() as base:
                tmp = _fresh_tmp(Path(base))
                for command, output in run_block(block, tmp):
                    expected, actual = normalise(command.expected, tmp), normalise(output, tmp)
                    if matches(expected, actual):
                        continue
                    first = command.line  # the line after the command (continuations included)
                    while lines[first - 1].endswith("\\"):
                        first += 1
                    end = first + len(command.expected)
                    shown = [line.rstrip().replace(tmp, TMP) for line in output]
                    replacements.append((first, end, shown))
                    print(f"{page.relative_to(ROOT)}:{command.line}: $ {command.text}: updated")
        for first, end, new in sorted(replacements, reverse=True):
            lines[first:end] = new
        page.write_text("\n".join(lines) + "\n")


def _update_tables() -> None:
    for (page, name), make in TABLES.items():
        path = ROOT / page
        text = path.read_text()
        start, end = _between(text, name)
        path.write_text(text[:start] + make() + "\n" + text[end:])


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    argv = sys.argv[1:]
    if argv[:1] == ["--update-tables"]:
        _update_tables()
    elif argv[:1] == ["--update"]:
        _update_tables()
        _update_examples([Path(p).resolve() for p in argv[1:]] or PAGES)
    else:
        sys.exit("usage: python tests/docs/test_docs_examples.py --update [FILE...] | --update-tables")

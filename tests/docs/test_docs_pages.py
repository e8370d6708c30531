"""Reference pages state; they do not narrate (issue 47).

A command page (docs/commands/*.md) and the README say what a command does and what it is held to: a
target in a sentence or a small table, and a link to the latest run in docs/benchmarks.md. The runs
themselves (tables of rounds, medians, load averages, the commit each ran at) live in
docs/benchmarks.md and bench/README.md, one section per bench, newest run first. These tests fail when
a commit hash or a run log creeps back into a reference page.

A commit hash is a word of 7-40 hex digits (a letter and a digit among them) that `git cat-file`
resolves to a commit of this repository, anywhere on the page; where git cannot say (no repository, a
shallow clone), such a word in prose beside a run's words ("commit", "measured", "median", ...). A
run log is a line of the page's prose, or of a ```text block, with a round, a median, a best-of or a
load average in it. ```console blocks are ckpt's own output (checked by tests/docs/test_docs_examples.py)
and are not searched for run logs: ckpt prints sha256 prefixes and temporary names, never a run.

A page in OPTION_PAGES names every option its command's --help lists (convert.md's grouped table).
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "commands").glob("*.md"))]

# a standalone word of hex digits (not part of a path, a file name or a longer word)
HEXWORD = re.compile(r"(?<![\w./-])([0-9a-f]{7,40})(?![\w/-])")
# what a paragraph about a measured run says beside the commit it ran at
RUN_WORDS = re.compile(r"\b(?:commits?|measured|medians?|rounds?|runs?|ran|bench|benchmarks?|at)\b", re.I)
# what a line of a run log says
RUN_LOG = [
    (re.compile(r"\(round \d+\)", re.I), "a bench round"),
    (re.compile(r"\bmedians?\b", re.I), "a median"),
    (re.compile(r"\b(?:\d+|two|three|four|five|six|ten) (?:interleaved )?rounds\b", re.I), "rounds of a run"),
    (re.compile(r"\bbest of \d+\b", re.I), "a best-of run"),
    (re.compile(r"\bload average\b", re.I), "a machine's load average"),
    (re.compile(r"^\|.*\bround\b.*\|\s*$", re.I), "a table of rounds"),
]


def hash_like(word: str) -> bool:
    return bool(re.search(r"[a-f]", word)) and bool(re.search(r"\d", word))


def commits(words: set[str]) -> set[str]:
    """The words that name a commit of this repository (none where git cannot say)."""
    words = sorted(words)
    if not words:
        return set()
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "cat-file", "--batch-check"], text=True,
                              input="".join(f"{w}^{{commit}}\n" for w in words), capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    if done.returncode != 0:
        return set()
    answers = done.stdout.splitlines()
    # one answer per word, in order: "<sha> commit <size>", "<word>^{commit} missing" or "... ambiguous"
    return {w for w, a in zip(words, answers) if a.split()[1:2] == ["commit"]}


def parts(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(prose lines, lines of ```text and other non-console fenced blocks), each with its 1-based number.
    ```console blocks are left out: they are ckpt's output, tested by running it."""
    prose: list[tuple[int, str]] = []
    fenced: list[tuple[int, str]] = []
    fence: str | None = None
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else (stripped[3:].strip() or "text")
            continue
        if fence is None:
            prose.append((n, line))
        elif fence != "console":
            fenced.append((n, line))
    return prose, fenced


def paragraphs(lines: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    out: list[list[tuple[int, str]]] = [[]]
    for n, line in lines:
        if line.strip():
            out[-1].append((n, line))
        elif out[-1]:
            out.append([])
    return [p for p in out if p]


def problems(text: str) -> list[str]:
    """Each commit hash and run-log line of a reference page's text, as 'line N: what (the text)'."""
    found: list[str] = []
    words = {m.group(1) for m in HEXWORD.finditer(text) if hash_like(m.group(1))}
    named = commits(words)
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        for m in HEXWORD.finditer(line):
            if m.group(1) in named:
                found.append(f"line {n}: commit {m.group(1)} ({line.strip()[:100]})")
    prose, fenced = parts(text)
    for para in paragraphs(prose):
        joined = " ".join(line for _, line in para)
        if not RUN_WORDS.search(joined):
            continue
        for n, line in para:
            for m in HEXWORD.finditer(line):
                if hash_like(m.group(1)) and m.group(1) not in named:
                    found.append(f"line {n}: a hash-like {m.group(1)} beside a run's words ({line.strip()[:100]})")
    for n, line in prose + fenced:
        for pattern, what in RUN_LOG:
            if pattern.search(line):
                found.append(f"line {n}: {what} ({line.strip()[:100]})")
                break
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_reference_page_holds_no_commit_hash_or_run_log(page):
    found = problems(page.read_text())
    assert not found, (f"{page.relative_to(ROOT)} narrates a run; move it to docs/benchmarks.md (its date, "
                       "machine, command and commit) and state the target here, with a link:\n  " + "\n  ".join(found))


def _head() -> str | None:
    """HEAD's hash, as short as a page would write it (7 digits) yet hash-like: a short hash of
    digits only (5981486) is no word the check takes for a hash, so it is lengthened."""
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], text=True, capture_output=True)
    full = done.stdout.strip() if done.returncode == 0 else ""
    return next((full[:n] for n in range(7, len(full) + 1) if hash_like(full[:n])), None)


def test_a_planted_run_log_is_found():
    """The check finds what issue 47 moved out: a commit hash, a hash beside a run's words, a table of
    rounds and medians; and leaves alone what a page legitimately shows."""
    head = _head()
    if head:
        assert any(f"commit {head}" in p for p in problems(f"The layout ratio came down at `{head}`.\n"))
        # a commit in a code block or a table is one too
        assert problems(f"| {head} | a change | 2.96 s |\n")
    # without git: a hash-like word beside a run's words
    assert problems("That run was at commit 0a1b2c3: all three targets met.\n")
    assert problems("```text\nconvert orbax -> DCP (round 2)     3.95    2.31    0.58  ok\n```\n")
    assert problems("each ratio is between medians of 5 interleaved rounds\n")
    assert problems("Speed (bench/runs_bench.py, whole processes, best of 5):\n")
    # what is not a run log: ckpt's own output, digests in examples, float rounding, plain words
    assert not problems("```console\n$ ckpt validate x\n  error digest-mismatch: sha256 31c705e3b96cd647... differs\n```\n")
    assert not problems('```json\n{"files": {"_METADATA": "fb9d6fd8..."}}\n```\n')
    assert not problems("a cast rounds a normal value to the nearest bfloat16; see docs/benchmarks.md\n")
    assert not problems("a temporary .model.ckpt-tmp-cc767581 left by a killed write\n")


# pages that name every option their command's --help lists (convert.md's options table, issue 47)
OPTION_PAGES = {"convert": ("convert",)}


def _options(*command: str) -> set[str]:
    import contextlib
    import io

    from ckpt_tool.cli.main import _run

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        assert _run([*command, "--help"]) == 0, out.getvalue()
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", out.getvalue())) - {"--help"}


@pytest.mark.parametrize("page", sorted(OPTION_PAGES))
def test_page_names_every_option_of_its_command(page):
    text = (ROOT / "docs" / "commands" / f"{page}.md").read_text()
    missing = sorted(o for o in _options(*OPTION_PAGES[page]) if o not in text)
    assert not missing, f"docs/commands/{page}.md does not say what these options of `ckpt {page}` do: {missing}"

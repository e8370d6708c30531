"""The one renderer: rich on a terminal, plain text when piped, JSON on --json.

Commands hand it finished content (header rows, trees of labelled nodes,
lines, JSON objects); it decides how that looks. Labels use rich markup; in
plain mode the markup is stripped so scripts and logs get stable text.
Every text it shows goes through text.printable: names, paths and reasons
come from the input, and a newline, a terminal escape or a lone surrogate in
them is shown as an escape, never acted on or failing the write. JSON is
written ASCII-only (json.dumps escapes those itself).
"""
from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..base.text import printable

# rich is imported when something is rendered on a terminal: `--json` runs (CI scripts, the
# inspect benchmark) and output into a pipe (plain text: esc and plain below, rich's markup
# rules without rich) do not pay for it (~0.1 s on a TPU host, issue 46)

# rich.markup's own patterns: a tag ([bold], [/], [link=...]) and an escaped one
_TAG = re.compile(r"((\\*)\[([a-z#/@][^[]*?)])")
_TAG_TO_ESCAPE = re.compile(r"(\\*)(\[[a-z#/@][^[]*?])")


@dataclass
class Node:
    """One line of a rendered tree and the lines under it."""

    label: str  # rich markup
    children: list["Node"] = field(default_factory=list)


def human_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def plural(n: int, word: str, many: str | None = None, *, short: bool = False) -> str:
    """"1 array", "3 arrays", "1,024 leaves": a count and its noun, which agree (`many`: an irregular plural).

    Every count phrase a command shows is made here, so that none says "1 arrays". `short`: the
    count as human_count gives it ("1.23M params", "1 param").
    """
    number = human_count(n) if short else f"{n:,}"
    return f"{number} {word if n == 1 else (many or word + 's')}"


def human_count(n: int) -> str:
    """"975", "1.23M": a count in at most four digits and a unit (K, M, B, T)."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def count_and_exact(n: int) -> str:
    """"1.23M (1,234,567)"; "975" alone where the short form is the exact count already."""
    short = human_count(n)
    return short if short == str(n) else f"{short} ({n:,})"


def human_rate(nbytes: int, seconds: float) -> str:
    """"1.2 GiB/s"; 0 B/s for a run too short to time."""
    return f"{human_bytes(nbytes / seconds if seconds else 0)}/s"


def process_note(index: int, count: int) -> str:
    """" (process I of N)" in a multi-process run, else nothing."""
    return f" (process {index} of {count})" if count > 1 else ""


def esc(text: Any) -> str:
    """Escape user data (keys, paths) before putting it into markup (rich.markup.escape's rule)."""
    markup = _TAG_TO_ESCAPE.sub(_double_backslashes, str(text))
    if markup.endswith("\\") and not markup.endswith("\\\\"):
        return markup + "\\"
    return markup


def _double_backslashes(match: re.Match[str]) -> str:
    backslashes, tag = match.groups()
    return f"{backslashes}{backslashes}\\{tag}"


def plain(markup: str) -> str:
    """The text of `markup` without its tags, as rich renders it (Text.from_markup(...).plain, emoji
    codes left as they are): tags dropped, an escaped tag and `\\[` shown as text."""
    if "[" not in markup:
        return markup
    out = []
    position = 0
    for match in _TAG.finditer(markup):
        full, escapes, _tag = match.groups()
        start, end = match.span()
        if start > position:
            out.append(markup[position:start].replace("\\[", "["))
        position = end
        if escapes:
            backslashes, escaped = divmod(len(escapes), 2)
            if backslashes:
                out.append("\\" * backslashes)
            if escaped:
                out.append(full[len(escapes):].replace("\\[", "["))
    if position < len(markup):
        out.append(markup[position:].replace("\\[", "["))
    return "".join(out)


class Output:
    """Where a command's results go."""

    def __init__(self, *, json_mode: bool = False, stream: Any = None) -> None:
        self.json_mode = json_mode
        self.stream = stream or sys.stdout
        self.is_terminal = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._console: Any = None
        self._gone = False

    def write(self, text: str) -> None:
        """Plain text to the stream; a reader that went away (`| head`) ends the output quietly."""
        if not self._gone:
            self._guard(lambda: self.stream.write(text))

    def _guard(self, op: Any) -> None:
        try:
            op()
        except BrokenPipeError:
            # as the Python docs advise: point stdout at devnull so that the
            # flush at exit does not fail again, and stop writing
            self._gone = True
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self.stream.fileno())
            except (OSError, ValueError, AttributeError):
                pass

    @property
    def console(self) -> Any:
        if self._console is None:
            from rich.console import Console

            # plain mode: no colour, no box drawing, no wrapping of long lines;
            # on a terminal, NO_COLOR (no-color.org) still turns colour off
            self._console = Console(
                file=self.stream,
                highlight=False,
                soft_wrap=not self.is_terminal,
                force_terminal=self.is_terminal,
                no_color=True if not self.is_terminal else None,
            )
        return self._console

    def text_line(self, text: str) -> None:
        """One line of plain text (no markup), escaped as every shown text is."""
        self.write(printable(text) + "\n")

    def json(self, obj: Any, compact: Callable[[], str] | None = None) -> None:
        """`obj` as JSON. `compact`: what gives its compact text (json.dumps(obj, default=str)),
        faster than json.dumps (inspect's leaves); `obj` may then be what gives obj, made only on
        a terminal."""
        if compact is not None and not self.is_terminal:
            self.write(compact() + "\n")
            self._guard(self.stream.flush)
            return
        if compact is not None and callable(obj):
            obj = obj()
        # indented for a person; compact in a pipe, where the pure-Python
        # indenting encoder would cost more than reading the metadata. ASCII
        # (json.dumps' default): a lone surrogate in a name stays the escape
        # \udc80, which a UTF-8 stream can write and json.loads gives back
        text = json.dumps(obj, indent=2 if self.is_terminal else None, default=str, ensure_ascii=True)
        self.write(text + "\n")
        self._guard(self.stream.flush)

    def line(self, markup: str = "") -> None:
        if self.is_terminal:
            self.console.print(_text(markup))
        else:
            self.write(plain(printable(markup)) + "\n")

    def lines(self, markups: Iterable[str]) -> None:
        for m in markups:
            self.line(m)

    def header(self, title: str, rows: list[tuple[str, str]]) -> None:
        if self.is_terminal:
            from rich.table import Table
            from rich.text import Text

            grid = Table.grid(padding=(0, 2))
            grid.add_column(style="bold")
            grid.add_column()
            for k, v in rows:
                grid.add_row(Text(printable(k)), _text(v))
            self.console.print(_text(f"[bold]{title}[/bold]"))
            self.console.print(grid)
        else:
            self.line(title)
            width = max((len(printable(k)) for k, _ in rows), default=0)
            for k, v in rows:
                self.line(f"  {esc(printable(k).ljust(width))}  {v}")

    def tree(self, root: Node) -> None:
        if self.is_terminal:
            from rich.tree import Tree

            tree = Tree(_text(root.label), guide_style="dim")
            self._fill(tree, root.children)
            self.console.print(tree)
        else:
            self.line(root.label)
            self._plain(root.children, "  ")

    def _fill(self, parent: Any, children: list[Node]) -> None:
        for child in children:
            branch = parent.add(_text(child.label))
            self._fill(branch, child.children)

    def _plain(self, children: list[Node], indent: str) -> None:
        for child in children:
            self.line(indent + child.label)
            self._plain(child.children, indent + "  ")


def _text(markup: str) -> Any:
    """A rich Text of `markup` with the input's unsafe characters escaped (text.printable).

    Escaped after esc(): an escape ends in a letter or hex digit, so it never
    makes a backslash that turns a following '[' into markup or out of it.
    """
    from rich.text import Text

    # (no emoji codes: a key named "a:cross_mark:" is shown as it is, as plain() shows it)
    return Text.from_markup(printable(markup), emoji=False)

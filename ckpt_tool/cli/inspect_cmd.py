"""`ckpt inspect PATH`: what is in a checkpoint, from metadata alone."""
from __future__ import annotations

import datetime as _dt
from typing import Any, Iterator

import click

from .. import formats
from ..base.errors import short_repr
from ..ops.inspect import InspectResult, inspect_checkpoint
from ..core.model import ArrayLeaf, Key, Leaf, ValueLeaf
from ..base.names import escape_key
from . import opened as opened_step
from ..base.text import printable
from .helptext import formats_read
from .options import weights_option
from .render import Node, Output, count_and_exact, esc, human_bytes, plural


# the formats it reads come from the registry (helptext), so that the list cannot go stale
@click.command("inspect", help=(
    f"Show the tree of leaves in the checkpoint at PATH ({formats_read()}, detected; a directory or file, "
    "or a file://, gs://, s3:// or memory:// URL): dtype, shape, size, chunking and the sharding recorded at "
    "save time. Reads metadata only; needs neither jax nor torch."))
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (the documented contract).")
@click.option("--flat", is_flag=True, help="One line per leaf instead of a tree.")
@click.option("--filter", "pattern", metavar="GLOB", help="Only leaves whose '/'-joined keys or dotted names match, e.g. 'params/**/kernel' or 'model.layers.0.*'; matching no leaf is an error.")
@click.option("--depth", type=click.IntRange(min=1), help="Collapse the tree below this depth.")
@click.option("--step", help="Run root (any framework `ckpt ls` lists): a step number, a step's name or 'latest' (Orbax: latest committed by default).")
@click.option("--values", is_flag=True, help="Decode scalars, strings and non-tensor items (never array data).")
@weights_option
def inspect_command(
    path: str, as_json: bool, flat: bool, pattern: str | None, depth: int | None, step: str | None, values: bool,
    weights: str | None,
) -> None:
    with formats.read_options(weights=weights):
        result = inspect_checkpoint(path, step=step, pattern=pattern, values=values)
    out = Output(json_mode=as_json)
    if as_json:
        # the --json contract (docs/commands/): "ok" as the exit status says; "opened": the run root's step opened
        opened = opened_step.first_json()
        out.json(lambda: {"ok": True, **result.to_json(), "opened": opened},
                 compact=lambda: result.to_json_text({"ok": True}, {"opened": opened}))
        return
    out.header(_title(result), _header_rows(result))
    if flat:
        out.lines(_flat_lines(result))
    else:
        out.line("")
        out.tree(_tree(result, depth))


def _title(result: InspectResult) -> str:
    ck = result.checkpoint
    return f"{esc(ck.path)}"


def _layout_text(ck: Any) -> str:
    from ..formats import layout_text

    return layout_text(ck)  # the format's own words for its layout


def _header_rows(result: InspectResult) -> list[tuple[str, str]]:
    ck = result.checkpoint
    s = result.summary
    rows = [("format", esc(_layout_text(ck)))]
    opened = opened_step.take()
    if opened:  # a run root: its steps in the states `ckpt ls` names (runs.OpenedStep.steps)
        steps = ", ".join(
            (esc(st["name"]) if st["status"] == "committed" else f"[yellow]{esc(st['name'])} ({st['status']})[/yellow]")
            for st in opened[0].steps
        )
        rows.append(("steps", steps))
        # which step, and why that one (the newest complete, the pointer's, --step)
        rows.append(("opened", f"{esc(opened[0].name)} ({esc(opened[0].why())})"))
    elif ck.steps:
        steps = ", ".join(
            (f"{st.step}" if st.committed else f"[yellow]{esc(st.name)} (incomplete)[/yellow]") for st in ck.steps
        )
        rows.append(("steps", steps))
        rows.append(("showing", f"step {ck.step}"))
    if ck.status == "incomplete":
        lost = sum(len(m.leaves) for m in ck.missing)
        unreadable = sum(m.unreadable for m in ck.missing)
        gone = len(ck.missing) - unreadable
        why = ([f"{plural(gone, 'data file')} missing or cut short"] if gone else []) + (
            [f"{plural(unreadable, 'data file')} unreadable"] if unreadable else [])
        status = (f"[bold red]incomplete[/bold red]: {', '.join(why)}"
                  + (f" ({plural(lost, 'leaf', 'leaves')} stored there cannot be read)" if lost else ""))
    else:
        status = "[green]committed[/green]" if ck.committed else "[bold red]UNCOMMITTED / incomplete save[/bold red]"
    rows.append(("status", status))
    for m in ck.missing:
        shown = ", ".join(m.leaves[:3]) + (", ..." if len(m.leaves) > 3 else "")
        rows.append(("unreadable" if m.unreadable else "missing",
                     f"[red]{esc(m.file)}[/red]: {esc(m.reason)}" + (f"; holds {esc(shown)}" if shown else "")))
    if ck.saved_at:
        when = _dt.datetime.fromtimestamp(ck.saved_at, tz=_dt.timezone.utc)
        rows.append(("saved", when.strftime("%Y-%m-%d %H:%M:%S UTC")))
    rows.append((
        "leaves",
        f"{s['leaves']:,} ({plural(s['arrays'], 'array')}, {plural(s['values'], 'value')})",
    ))
    rows.append(("parameters", count_and_exact(s['parameters'])))
    rows.append(("size", f"{human_bytes(s['bytes'])} ({s['bytes']:,} bytes) in {plural(s['chunks'], 'chunk')}"))
    for dtype, t in result.by_dtype.items():
        rows.append((f"  {dtype}", f"{plural(t.leaves, 'array')}, {plural(t.parameters, 'param', short=True)}, {human_bytes(t.bytes)}"))
    for note in ck.notes:
        rows.append(("note", f"[yellow]{esc(note)}[/yellow]"))
    return rows


def _leaf_text(leaf: Leaf, result: InspectResult) -> str:
    if isinstance(leaf, ArrayLeaf):
        shape = ", ".join(str(d) for d in leaf.shape)
        parts = [f"[cyan]{leaf.dtype}[{shape}][/cyan]", human_bytes(leaf.nbytes)]
        if leaf.chunk_shape is not None and leaf.chunk_count > 1:
            chunk = ", ".join(str(d) for d in leaf.chunk_shape)
            parts.append(f"chunks ({chunk}) x{leaf.chunk_count}")
        elif leaf.chunk_count > 1:
            parts.append(f"{leaf.chunk_count} chunks")
        if leaf.sharding is not None and leaf.sharding.kind != "chunks":
            parts.append(f"[magenta]{esc(leaf.sharding.describe())}[/magenta]")
        return "  ".join(parts)
    assert isinstance(leaf, ValueLeaf)
    text = f"[green]{esc(leaf.value_type)}[/green]"
    if leaf.dtype and leaf.dtype != "string":
        text += f" {leaf.dtype}"
    if result.values is not None and leaf.path in result.values:
        text += f" = {esc(short_repr(result.values[leaf.path], 80))}"
    elif leaf.path in result.value_errors:
        text += f" [red](cannot decode: {esc(result.value_errors[leaf.path])})[/red]"
    return text


def _flat_lines(result: InspectResult) -> list[str]:
    # in the tree's order (each key sorted as the tree sorts it), whatever order the format stores
    # its leaves in (DCP's .metadata and torch.save's pickle: the state dict's insertion order)
    leaves = sorted(result.leaves, key=lambda leaf: [_order(k) for k in leaf.keys])
    # the column as shown: a name's escapes (\n, \x1b) are wider than the characters they stand for
    shown = [printable(leaf.path) for leaf in leaves]
    width = max(map(len, shown), default=0)
    return [f"{esc(path.ljust(width))}  {_leaf_text(leaf, result)}" for path, leaf in zip(shown, leaves)]


class _TreeNode:
    """One key of the tree view: the leaves with these keys, and the subtree below it (a key may
    be both: the safetensors tensors `a` and `a.b` are the leaf `a` and the leaf `a/b`)."""

    __slots__ = ("key", "leaves", "children")

    def __init__(self, key: Key) -> None:
        self.key = key
        self.leaves: list[Leaf] = []
        self.children: dict[str, _TreeNode] = {}


def _tree(result: InspectResult, depth: int | None) -> Node:
    # keyed by each key's escaped text (names.escape_key), the one spelling --filter reads too
    root = _TreeNode("")
    for leaf in result.leaves:
        node = root
        for k in leaf.keys[:-1]:
            node = node.children.setdefault(escape_key(k), _TreeNode(k))
        last: Key = leaf.keys[-1] if leaf.keys else "(root)"
        label = escape_key(last) if leaf.keys else "(root)"
        node.children.setdefault(label, _TreeNode(last)).leaves.append(leaf)

    def build(tree: dict[str, _TreeNode], level: int) -> list[Node]:
        nodes = []
        for label, child in sorted(tree.items(), key=lambda kv: _order(kv[1].key)):
            for leaf in child.leaves:
                nodes.append(Node(f"{esc(label)}  {_leaf_text(leaf, result)}"))
            if not child.children:
                continue
            bold = f"[bold]{esc(label)}[/bold]"
            if depth is not None and level >= depth:
                leaves = list(_iter_leaves(child.children))
                nbytes = sum(leaf.nbytes for leaf in leaves if isinstance(leaf, ArrayLeaf))
                nodes.append(Node(f"{bold}  [dim]... {plural(len(leaves), 'leaf', 'leaves')}, {human_bytes(nbytes)}[/dim]"))
            else:
                nodes.append(Node(bold, build(child.children, level + 1)))
        return nodes

    s = result.summary
    return Node(f"[bold]{plural(s['leaves'], 'leaf', 'leaves')}[/bold]", build(root.children, 1))


def _order(key: Key) -> Any:
    """Where a key sorts among its siblings: indices first, by number (a name of digits too: the
    `10` of `model.layers.10` after its `2`), then names."""
    if isinstance(key, int):
        return (0, key, "")
    if key.isascii() and key.isdigit():
        return (0, int(key), key)
    return (1, 0, key)


def _iter_leaves(tree: dict[str, _TreeNode]) -> Iterator[Leaf]:
    for node in tree.values():
        yield from node.leaves
        yield from _iter_leaves(node.children)

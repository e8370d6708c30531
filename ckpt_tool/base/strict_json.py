"""Strict JSON for the index and header files of checkpoints: what a loose reader would accept
and a careful one refuse (NaN, a key given twice) is refused here, with the file named."""
from __future__ import annotations

import json
from typing import Any


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(data: bytes | str) -> Any:
    """json.loads, where a document nested past Python's recursion limit (json's C parser recurses
    once per level: 100 KB of '[' is enough) is a ValueError like any other malformed JSON, so that
    every reader's `except ValueError` answers it with its one line instead of an internal error."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply to be read") from None


def parse_json(raw: bytes, what: str) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity, no duplicate keys, bounded nesting."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError(f"{what} nests too deeply") from None
    except ValueError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None

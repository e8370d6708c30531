"""Orbax / JAX checkpoints (OCDBT or per-array, zarr v2 or v3, CheckpointManager roots).

reader.py reads them from metadata alone (no jax); schema.py checks the JSON
files orbax writes against its own dataclasses; write.py writes them (convert,
reshard); checks.py is validate's shallow checks. The package's interface is
the registry's: NAME, detect, read.
"""
from __future__ import annotations

from typing import Any

# recorded_tuples is the reader's: reading Orbax (convert FROM it too) loads no writer module
from .reader import NAME, detect, read, recorded_tuples

__all__ = ["NAME", "detect", "read", "recorded_tuples", "layout_text"]


def layout_text(ck: Any) -> str:
    """inspect's "format" row: "Orbax, OCDBT + zarr2, items: ..."."""
    lay = ck.layout
    parts = []
    if lay.get("storage") == "ocdbt":
        parts.append("OCDBT" + (" (unmerged)" if lay.get("ocdbt") == "unmerged" else ""))
    elif lay.get("storage"):
        parts.append("per-array directories")
    if lay.get("zarr"):
        parts.append(f"zarr{lay['zarr']}")
    text = "Orbax, " + " + ".join(parts) if parts else "Orbax"
    if lay.get("processes", 1) > 1:
        n = lay["processes"]
        text += f", {n:,} process{'es' if n != 1 else ''}"
    if lay.get("items"):
        text += ", items: " + ", ".join(lay["items"])
    if lay.get("tree", "").startswith("msgpack"):
        text += ", msgpack tree (orbax <= 0.4)"
    return text


from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:  # the type checker holds the package, its checks.py and write.py to the format contract (core/contract.py)
    from ...core import contract as _contract
    from . import checks as _checks
    from . import write as _write
    from .. import orbax as _package

    _conforms: _contract.FormatModule = _package
    _checks_conform: _contract.FormatChecksModule = _checks
    _write_conforms: _contract.FormatWriteModule = _write

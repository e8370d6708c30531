"""torch.distributed.checkpoint (DCP) directories: `.metadata` and `__<rank>_<n>.distcp` files.

reader.py reads them without torch (the allow-list unpickler of ckpt_tool.torchsave
for `.metadata`, byte-range reads of each chunk's torch.save archive);
transforms.py decodes entries saved through `_extensions` (zstd);
write.py writes them (convert); checks.py is validate's shallow and deep
checks. The package's interface is the registry's: NAME, detect, read.
"""
from __future__ import annotations

from typing import Any

from .reader import NAME, detect, read

__all__ = ["NAME", "detect", "read", "layout_text"]


def layout_text(ck: Any) -> str:
    """inspect's "format" row: "torch.distributed.checkpoint, 4 files, 4 ranks"."""
    lay = ck.layout
    text = "torch.distributed.checkpoint"
    if lay.get("files") is not None:
        text += f", {lay['files']} file{'s' if lay['files'] != 1 else ''}"
    if lay.get("ranks"):
        text += f", {lay['ranks']} rank{'s' if lay['ranks'] != 1 else ''}"
    return text


from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:  # the type checker holds the package, its checks.py and write.py to the format contract (formats/contract.py)
    from .. import contract as _contract
    from . import checks as _checks
    from . import write as _write
    from .. import dcp as _package

    _conforms: _contract.FormatModule = _package
    _checks_conform: _contract.FormatChecksModule = _checks
    _write_conforms: _contract.FormatWriteModule = _write

"""torch.distributed.checkpoint (DCP)'s entry in the format registry: ckpt_tool.formats reads this file on its own (this
package is not imported for it), so it imports nothing but the registry's names."""
from __future__ import annotations

from .. import VALUE_KINDS, FormatInfo

PACKAGE = __name__.rsplit(".", 1)[0]  # this package (FormatInfo.package: imported when asked something)

FORMATS = [
    FormatInfo(
        "dcp", "torch.distributed.checkpoint (DCP)", PACKAGE, can_write=True, value_kinds=VALUE_KINDS,
        claims=(".metadata", "*.distcp"), short="DCP", listed=1, claims_flat=True, detection=40,
    ),
]

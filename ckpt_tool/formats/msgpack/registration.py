"""Flax / T5X msgpack's entry in the format registry: ckpt_tool.formats reads this file on its own (this
package is not imported for it), so it imports nothing but the registry's names."""
from __future__ import annotations

from .. import VALUE_KINDS, ZARR_ARRAY_FILES, FormatInfo

PACKAGE = __name__.rsplit(".", 1)[0]  # this package (FormatInfo.package: imported when asked something)

FORMATS = [
    # before orbax: an orbax <= 0.4 save has OCDBT files but no _METADATA
    FormatInfo(
        "msgpack", "Flax / T5X msgpack", PACKAGE, can_write=False, value_kinds=VALUE_KINDS,
        claims=("checkpoint", "checkpoint_*"), reads="Flax msgpack and T5X checkpoints",
        claims_mark_checkpoint=False, single_file="any", file_suffixes=(".msgpack",), families=("flax", "t5x"), listed=3,
        detection=20,
        # a Flax state file by its suffix; orbax <= 0.4 beside its `checkpoint` file: _sharding and the
        # OCDBT database (or zarr arrays)
        parts=("*.msgpack", "_sharding", "manifest.ocdbt", "d", "ocdbt.process_*"), part_dirs=ZARR_ARRAY_FILES,
        run_roots=("flax", "t5x"),  # their checkpoint_N step names and temporary names (run_roots.py)
    ),
]

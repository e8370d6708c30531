"""Orbax's entry in the format registry: ckpt_tool.formats reads this file on its own (this
package is not imported for it), so it imports nothing but the registry's names."""
from __future__ import annotations

from .. import VALUE_KINDS, ZARR_ARRAY_FILES, FormatInfo

PACKAGE = __name__.rsplit(".", 1)[0]  # this package (FormatInfo.package: imported when asked something)

FORMATS = [
    FormatInfo(
        "orbax", "Orbax", PACKAGE, can_write=True, value_kinds=VALUE_KINDS,
        claims=("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt", "_sharding", "commit_success.txt"),
        reads="Orbax / JAX (OCDBT or per-array, zarr v2 or v3, CheckpointManager roots)",
        can_reshard=True, listed=0, options=("zarr3",), claims_flat=True, compresses=True, writes_chunk_blocks=True, detection=30,
        # (orbax's file names: OCDBT data and per-process databases, items, a manager's metadata,
        # saves in progress and TensorStore's locks, 0.5's msgpack tree `checkpoint`)
        parts=("d", "ocdbt.process_*", "array_metadatas", "_strings.json", "_ROOT_METADATA", "descriptor",
               "metadata", "metrics", "orbax.checkpoint", "*.orbax-checkpoint-tmp*", "*.__lock", "checkpoint"),
        # an array's zarr directory; an item of another handler (JsonCheckpointHandler's `metadata`)
        part_dirs=(*ZARR_ARRAY_FILES, "metadata", "commit_success.txt"),
        # items (`default/`, `state/`, any name) and a CheckpointManager root's steps are orbax checkpoints
        part_checkpoints=("*",),
        run_roots=("orbax",),  # a CheckpointManager root's commit rules are the reader's (run_roots.py)
    ),
]

"""Megatron-Core's entry in the format registry: ckpt_tool.formats reads this file on its own (this
package is not imported for it), so it imports nothing but the registry's names."""
from __future__ import annotations

from .. import VALUE_KINDS, ZARR_ARRAY_FILES, FormatInfo

PACKAGE = __name__.rsplit(".", 1)[0]  # this package (FormatInfo.package: imported when asked something)

FORMATS = [
    # detected first: a Megatron save is a DCP checkpoint (or zarr arrays) plus metadata.json and common.pt
    FormatInfo(
        "megatron", "Megatron-Core", PACKAGE, can_write=False, value_kinds=VALUE_KINDS,
        claims=("metadata.json", "common.pt", "latest_checkpointed_iteration.txt"), claims_flat=True,
        reads="Megatron-Core / NeMo 2 saves (torch_dist, zarr) and Megatron-LM run roots (also legacy mp_rank_*)",
        listed=5, detection=10,
        # the DCP files of torch_dist, integrity.json, NeMo 2's weights/ + context/, legacy mp_rank_*
        parts=(".metadata", "*.distcp", "integrity.json", "weights", "context", "mp_rank_*"),
        part_dirs=(*ZARR_ARRAY_FILES, "shard_*.pt"),  # the zarr backend: a directory per key
        # a Megatron-LM run's steps, when they are Megatron saves (not a user's folder named so)
        part_checkpoints=("iter_*", "release"),
        run_roots=("megatron", "nemo2"),  # the tracker, iter_N/ and NeMo 2's weights/ + context/ (run_roots.py)
    ),
]

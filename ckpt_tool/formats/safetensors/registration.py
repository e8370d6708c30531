"""safetensors's entry in the format registry: ckpt_tool.formats reads this file on its own (this
package is not imported for it), so it imports nothing but the registry's names."""
from __future__ import annotations

from .. import HF_MODEL_FILES, HF_TRAINER_FILES, FormatInfo

PACKAGE = __name__.rsplit(".", 1)[0]  # this package (FormatInfo.package: imported when asked something)

FORMATS = [
    FormatInfo(
        "safetensors", "safetensors", PACKAGE, can_write=True,
        value_kinds=frozenset({"array", "scalar"}), claims=("*.safetensors.index.json", "*.safetensors"),
        reads="safetensors (one file, or a sharded Hugging Face save with its index)", single_file="claimed", file_suffixes=(".safetensors",), listed=2,
        options=("max_shard_size", "like"), claims_flat=True, detection=50,
        parts=(*HF_MODEL_FILES, *HF_TRAINER_FILES), model_marks=("*.safetensors.index.json", "config.json"),
        # torch's HuggingFaceStorageWriter: the per-rank files under `sharded/`, consolidated beside it
        part_checkpoints=("sharded",),
    ),
]

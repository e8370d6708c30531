"""Hugging Face's index of a sharded checkpoint (transformers' `model.safetensors.index.json` and
`pytorch_model.bin.index.json`: `weight_map`, tensor -> the shard file beside it holding it, and
`metadata.total_size`), read one way for both formats whose sets have one (safetensors, torch.save).

Format machinery several format packages share (as torch_save/, dcp/ beside it): it names no format and
reads through the Storage it is handed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..base.errors import CorruptMetadataError
from ..base.strict_json import parse_json

if TYPE_CHECKING:
    from ..storage import Storage

# an index over this is no index transformers wrote (a 1T-parameter model's is a few tens of MB)
MAX_INDEX_BYTES = 100_000_000


def read_index(storage: Storage, name: str, *, suffix: str = "") -> tuple[dict[str, str], Any]:
    """(weight_map, metadata.total_size as the file has it, None where absent) of the index file
    `name` in `storage`. Every weight_map value must name a file beside the index (no path), ending
    in `suffix` where given (".safetensors"); anything else is a CorruptMetadataError naming it."""
    where = f"{storage.url}/{name}"
    size = storage.size(name)
    if size > MAX_INDEX_BYTES:
        raise CorruptMetadataError(f"{size} bytes, over the {MAX_INDEX_BYTES}-byte limit", where)
    try:
        doc = parse_json(storage.read(name), "index")
    except ValueError as exc:
        raise CorruptMetadataError(str(exc), where) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        raise CorruptMetadataError("no weight_map object", where)
    weight_map = doc["weight_map"]
    what = f"a {suffix} file" if suffix else "a file"
    for k, v in weight_map.items():
        if not isinstance(v, str) or not v.endswith(suffix) or "/" in v or "\\" in v or v in ("", ".", ".."):
            raise CorruptMetadataError(f"weight_map[{k!r}] = {str(v)[:60]!r} is not {what} beside it", where)
    meta = doc.get("metadata")
    return weight_map, meta.get("total_size") if isinstance(meta, dict) else None

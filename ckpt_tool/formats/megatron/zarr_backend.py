"""Megatron-Core's zarr backend (`metadata.json` `"sharded_backend": "zarr"`, megatron-core <= 0.13).

What `dist_checkpointing.save(..., sharded_strategy=('zarr', 1))` writes
(megatron/core/dist_checkpointing/strategies/zarr.py and common.py, 0.13):

  * one zarr v2 array directory per ShardedTensor key, `<save>/<key>/`: `.zarray` (zarr 2.x
    writes it, uncompressed, no filters, C order, chunks = the tensor-parallel block,
    `global_shape // axis_fragmentations`) and its chunk files `0.0.0`, `1.0.0`, ...; the
    array is the LOGICAL tensor (flattened ranges are written into it by coordinate), so it
    is read as it is;
  * bfloat16: numpy has none, so megatron creates the array with the 2-byte void dtype and
    then rewrites `.zarray` replacing `"<V2"` by `"bfloat16"` (zarr.py:185-188). That is
    tensorstore's zarr driver's own name for bfloat16, so the array opens there as it is:
    the arrays are read through the Orbax package's zarr machinery (tensorstore, the
    same `ZarrRegionReader` T5X's arrays use);
  * ShardedObjects: the zarr strategy cannot save them, so the common strategy writes each
    as `<save>/<key>/shard_<offset>_<shape>.pt`, `torch.save` of the bare object (common.py
    52-58; not wrapped in a list as torch_dist's bytes items are): read through the
    torch.save package with Megatron's data classes admitted (pickled.ALLOW), one value
    under its unique key `<key>/shard_<offset>_<shape>`, as megatron's load returns it;
  * `common.pt` as in torch_dist (common.common_leaves).

A key is any sub-directory holding `.zarray` (megatron's loader: zarr.py:330-332); a
sub-directory of `shard_*.pt` files is a ShardedObject key; `<key>.sync` directories are
the ProcessSynchronizer's locks of flattened-range writes (noted, not read).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ...base.errors import CkptError, NotFoundError
from ...base.findings import Findings
from ...core.model import ArrayLeaf, Checkpoint, Leaf, RegularGrid, ValueLeaf
from ...storage import Storage
from . import pickled
from .common import common_leaves, split_name
from .detection import NAME

ZARRAY = ".zarray"
SYNC_SUFFIX = ".sync"
OBJECT_FILE = re.compile(r"^shard_[0-9.]+_[0-9.-]+\.pt$")
CHUNK_FILE = re.compile(r"^\d+(?:[./]\d+)*$")  # zarr v2 chunk keys ('.' or '/' separated)


@dataclass
class Listing:
    """What one save directory holds, from one (recursive) listing."""

    arrays: dict[str, set[str]] = field(default_factory=dict)  # key -> its stored keys (.zarray, chunks)
    objects: list[str] = field(default_factory=list)  # `<key>/shard_*.pt` files
    sync: list[str] = field(default_factory=list)  # `<key>.sync` lock directories
    other: list[str] = field(default_factory=list)  # sub-directories that are neither
    headless: list[str] = field(default_factory=list)  # chunk files without their .zarray


def listing(storage: Storage) -> Listing:
    """The save's arrays, object files and other sub-directories (one listing of the whole directory)."""
    by_dir: dict[str, list[str]] = {}
    for key in storage.list():
        if "/" in key:
            top, rest = key.split("/", 1)
            by_dir.setdefault(top, []).append(rest)
    out = Listing()
    for top, rests in sorted(by_dir.items()):
        if ZARRAY in rests:
            out.arrays[top] = {f"{top}/{r}" for r in rests}
        elif top.endswith(SYNC_SUFFIX):
            out.sync.append(top)
        elif any(OBJECT_FILE.match(r) for r in rests):
            out.objects.extend(f"{top}/{r}" for r in sorted(rests) if OBJECT_FILE.match(r))
        elif all(CHUNK_FILE.match(r) for r in rests):
            out.headless.append(top)  # an array whose .zarray was lost
        elif not top.startswith("."):
            out.other.append(top)
    return out


def object_name(path: str) -> str:
    """`<key>/shard_0_2.pt` -> its ShardedObject's unique key `<key>/shard_0_2`."""
    return path[: -len(".pt")]


def object_loader(storage: Storage, path: str) -> Callable[[], Any]:
    """The object a `shard_*.pt` file holds (its tensors read as arrays), Megatron's stand-ins as plain data."""

    def load() -> Any:
        from ...machinery.torch_save import reading as ts

        archive = ts.Archive(storage, path, pickled.ALLOW)
        return pickled.plain(ts.value_loader(archive, archive.obj)())

    return load


def array_leaf(storage: Storage, name: str, zmeta: Any, source: Any) -> ArrayLeaf:
    """One key's zarr array, opened by tensorstore on first read (the Orbax package's reader)."""
    from ...machinery.arrays.reading import ZarrRegionReader, parse_zarr_metadata
    where = f"{storage.url}/{name}/{ZARRAY}"
    shape, dtype, chunk_shape, info = parse_zarr_metadata(zmeta, False, where)
    reader = ZarrRegionReader(source, name, False, zmeta)
    return ArrayLeaf(keys=split_name(name), name=name, shape=shape, dtype=dtype, layout=RegularGrid(chunk_shape),
                     reader=reader, extra={"stored": "zarr v2 array directory", **info})


def read_arrays(storage: Storage, found: Listing) -> tuple[list[Leaf], dict[str, Any]]:
    """The tensors (every `.zarray` read at once) and the ShardedObjects; (leaves, zmeta by key)."""
    from ...machinery.arrays import schema
    from ...machinery.arrays.reading import ArraySource
    source = ArraySource(storage, None)
    names = sorted(found.arrays)
    raw = storage.start_reads(f"{n}/{ZARRAY}" for n in names).result()
    leaves: list[Leaf] = []
    metas: dict[str, Any] = {}
    for name in names:
        data = raw.get(f"{name}/{ZARRAY}")
        where = f"{storage.url}/{name}/{ZARRAY}"
        if data is None:
            raise NotFoundError(f"{ZARRAY} listed but not readable", where)
        zmeta = schema.load_json(data, where)  # bounded size and nesting: a SchemaError, never a RecursionError
        metas[name] = zmeta
        leaves.append(array_leaf(storage, name, zmeta, source))
    for path in found.objects:
        unique = object_name(path)
        leaves.append(ValueLeaf(keys=split_name(unique), name=unique, value_type="object",
                                loader=object_loader(storage, path), extra={"file": path}))
    return leaves, metas


def read(storage: Storage) -> Checkpoint:
    """One zarr-backend save directory (metadata.json already read: the caller's)."""

    found = listing(storage)
    leaves, _ = read_arrays(storage, found)
    common = common_leaves(storage, {leaf.keys for leaf in leaves})
    notes = []
    if any(leaf.name.startswith("decoder.layers.") and isinstance(leaf, ArrayLeaf) for leaf in leaves):
        notes.append("layers are stacked: decoder.layers.* hold every layer on axis 0 "
                     "(convert --unstack 'decoder/layers/{i}/**' gives one tensor per layer)")
    if found.sync:
        notes.append(f"{len(found.sync)} <key>.sync directories: zarr ProcessSynchronizer locks of "
                     "flattened-range writes (not data)")
    if found.headless:
        notes.append(f"chunk files without a .zarray (arrays Megatron's loader cannot see): "
                     f"{', '.join(found.headless[:5])}" + (" ..." if len(found.headless) > 5 else ""))
    if found.other:
        notes.append(f"sub-directories that are neither a zarr array nor ShardedObject files (not read): "
                     f"{', '.join(found.other[:5])}" + (" ..." if len(found.other) > 5 else ""))
    layout = {"arrays": len(found.arrays), "objects": len(found.objects)}
    return Checkpoint(path=storage.url, format=NAME, layout=layout, leaves=leaves + common, notes=notes)


# ---------------------------------------------------------------------------
# validate
# ---------------------------------------------------------------------------
def check(storage: Storage, findings: Findings, leaf_path: Callable[[str], str]) -> None:
    """Every array: a `.zarray` tensorstore opens (bad-array-metadata), every chunk of its grid stored
    (missing-chunk), each uncompressed chunk file exactly one chunk long (empty-chunk, bad-chunk);
    every ShardedObject file a torch.save archive torch would load (the torch.save checks)."""
    from ...machinery.arrays import checks as ac
    from ...machinery.arrays import schema
    from ...machinery.arrays.reading import parse_zarr_metadata
    from ...machinery.torch_save import checks as ts_checks
    from ...base import dtypes

    found = listing(storage)
    names = sorted(found.arrays)
    raw = storage.start_reads(f"{n}/{ZARRAY}" for n in names).result()
    for name in names:
        leaf = leaf_path(name)
        findings.count("arrays")
        file = f"{name}/{ZARRAY}"
        try:
            data = raw.get(file)
            if data is None:
                raise CkptError(f"{ZARRAY} listed but unreadable")
            zmeta = schema.load_json(data, file)
            shape, dtype, chunk_shape, info = parse_zarr_metadata(zmeta, False, file)
        except CkptError as exc:
            findings.error("bad-array-metadata", f"unreadable {ZARRAY}: {getattr(exc, 'message', exc)}",
                           leaf=leaf, file=file)
            continue
        keys = found.arrays[name]
        # megatron writes fill_value null and every chunk (write_empty_chunks=True): a lost chunk is damage
        ac.check_chunks(name, leaf, shape, chunk_shape, False, zmeta, keys, False, findings, "")
        raw_size = None
        if info.get("compressor") is None and not zmeta.get("filters"):
            import math

            raw_size = math.prod(chunk_shape) * dtypes.get(dtype).itemsize
        ac.check_empty_chunk_files(storage, name, leaf, keys, ZARRAY, findings, "", raw_size=raw_size)
    for path in found.objects:
        findings.count("objects")
        ts_checks.check_file(storage, path, findings, allow=pickled.ALLOW)
    for top in found.headless:
        findings.error("missing-metadata", f"{ZARRAY} missing (chunks are present): Megatron's loader does not "
                       "see this key", leaf=leaf_path(top), file=f"{top}/{ZARRAY}")
    for top in found.other:
        findings.warning("stray-file", "a sub-directory with neither .zarray nor shard_*.pt files: "
                         "Megatron's loader ignores it", file=f"{top}/")


def check_deep(storage: Storage, ckpt: Any, findings: Findings, skip_leaves: set[str]) -> None:
    """--deep beyond the arrays (the engine read every chunk): every ShardedObject and common.pt value decoded."""
    values = [leaf for leaf in ckpt.leaves if isinstance(leaf, ValueLeaf) and leaf.path not in skip_leaves]
    for leaf in values:
        try:
            leaf.load()
        except CkptError as exc:
            findings.error("bad-chunk", f"value does not decode: {exc.message}", leaf=leaf.path,
                           file=leaf.extra.get("file"))
    if values:
        findings.count("values_read", len(values))

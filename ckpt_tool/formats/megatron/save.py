"""One Megatron-Core `dist_checkpointing` save directory (reader.py's module docstring says what it
holds): metadata.json, then the torch_dist backend (the DCP files, read by the shared DCP
machinery, with Megatron's keys and reformulated tensors) or the zarr one (zarr_backend.py), and
common.pt's values at the top of the tree. NeMo 2's weights/ is one such save (nemo.py).
"""
from __future__ import annotations

from typing import Any, Callable

from ...base import strict_json
from ...base.errors import CkptError, CorruptMetadataError, IncompleteCheckpointError
from ...core.model import ArrayLeaf, Checkpoint, Key, Leaf, ValueLeaf
from ...storage import Storage
from . import pickled, reformulated
from .common import SHARD_SUFFIX, common_leaves, plain_loader, split_name
from .detection import COMMON_FILE, CONFIG_FILE, NAME


BACKENDS = ("torch_dist", "zarr")


MAX_CONFIG_BYTES = 1 << 20


# files Megatron-Bridge / NeMo put beside a save: listed as notes, never read as the checkpoint
BESIDE = ("run_config.yaml", "train_state.pt", "tokenizer")


def read_config(storage: Storage) -> dict[str, Any]:
    """metadata.json, checked as megatron's CheckpointingConfig(**json) would take it."""
    where = f"{storage.url}/{CONFIG_FILE}"
    size = storage.size(CONFIG_FILE)
    if size > MAX_CONFIG_BYTES:
        raise CorruptMetadataError(f"{size} bytes: not a Megatron metadata.json", where)
    try:
        doc = strict_json.loads(storage.read(CONFIG_FILE))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptMetadataError(f"not valid JSON ({str(exc)[:80]})", where) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("sharded_backend"), str):
        raise CorruptMetadataError("no sharded_backend: not a Megatron dist_checkpointing metadata.json", where)
    return doc


def backend_of(storage: Storage, *, quiet: bool = False) -> str | None:
    try:
        return str(read_config(storage)["sharded_backend"])
    except CkptError:
        if quiet:
            return None
        raise


def _with_keys(leaf: Leaf, keys: tuple[Key, ...]) -> Leaf:
    leaf.keys = keys
    return leaf


def _shard_value(load: Callable[[], Any]) -> Callable[[], Any]:
    """A ShardedObject's bytes item holds `[data]` (torch.save of a list of its local shards, here
    the one its unique key names): its value is `data`, as megatron's load returns it."""

    def value() -> Any:
        v = load()
        return v[0] if isinstance(v, list) and len(v) == 1 else v

    return value


def read_save(storage: Storage) -> Checkpoint:
    """One dist_checkpointing save directory."""
    dirs, files = storage.listdir()
    if CONFIG_FILE not in files:
        what = [f for f in files if f in (".metadata", COMMON_FILE) or f.endswith(".distcp")] + \
               [d for d in dirs if not d.startswith(".")][:3]
        raise IncompleteCheckpointError(
            "no metadata.json: an interrupted Megatron save (metadata.json is written last, by rank 0)"
            + (f"; present: {', '.join(what[:6])}" if what else ""), storage.url)
    config = read_config(storage)
    backend = config["sharded_backend"]
    if backend == "torch_dist":
        ck = _torch_dist(storage)
    elif backend == "zarr":
        from . import zarr_backend

        ck = zarr_backend.read(storage)
    else:
        raise CorruptMetadataError(f"sharded_backend {backend!r} is not one Megatron-Core writes ({', '.join(BACKENDS)})",
                                   f"{storage.url}/{CONFIG_FILE}")
    ck.layout["backend"] = backend
    ck.layout["config"] = config
    beside = sorted(n for n in [*files, *dirs] if n in BESIDE)
    if beside:
        ck.notes.append(f"beside the save (Megatron-Bridge / NeMo, not read as tensors): {', '.join(beside)}")
    from . import integrity

    if integrity.FILE in files:
        ck.notes.append(integrity.note(storage))
    return ck


def _torch_dist(storage: Storage) -> Checkpoint:
    from ...machinery.dcp import reader as dcp

    ck, md = dcp.read_with_metadata(storage, fmt=NAME, allow=pickled.ALLOW)
    mcore = getattr(md, "mcore_data", None) or md.unknown.get("mcore_data") or {}
    if not isinstance(mcore, dict):
        raise CorruptMetadataError("mcore_data is not a mapping", f"{storage.url}/.metadata")
    leaves: list[Leaf] = []
    reformulated_n = 0
    for leaf in ck.leaves:
        keys = split_name(leaf.name)
        info = mcore.get(leaf.name)
        if isinstance(leaf, ArrayLeaf) and isinstance(info, dict) and reformulated.ORIG_SHAPE in info:
            leaves.append(reformulated.logical_leaf(leaf, keys, info[reformulated.ORIG_SHAPE],
                                                    f"{storage.url}/.metadata [{leaf.name}]"))
            reformulated_n += 1
            continue
        if isinstance(leaf, ValueLeaf) and leaf.loader is not None:
            load = _shard_value(leaf.loader) if SHARD_SUFFIX.match(leaf.name) else leaf.loader
            leaf.loader = plain_loader(load)
            leaf.value_type = "object"
        leaves.append(_with_keys(leaf, keys))
    common = common_leaves(storage, {leaf.keys for leaf in leaves})
    ck.leaves = leaves + common
    ck.format = NAME
    notes = ck.notes
    if reformulated_n:
        notes.append(f"{reformulated_n} tensors stored as flattened ranges (the distributed optimizer's "
                     "fully_sharded_model_space): shown and read as their logical shapes")
    if any(leaf.name.startswith("decoder.layers.") and isinstance(leaf, ArrayLeaf) for leaf in leaves):
        notes.append("layers are stacked: decoder.layers.* hold every layer on axis 0 "
                     "(convert --unstack 'decoder/layers/{i}/**' gives one tensor per layer)")
    sharding = _sharding_type(common)
    if sharding == "dp_reshardable":
        notes.append("optimizer state is dp_reshardable: flat per-bucket buffers (the checkpoint does not record "
                     "which parameter holds which range; convert them as they are)")
    iteration = next((leaf for leaf in common if leaf.keys == ("iteration",)), None)
    if iteration is not None and isinstance(iteration, ValueLeaf):
        try:
            value = iteration.load()
            ck.step = value if type(value) is int else None
        except CkptError:
            pass
    return ck


def _sharding_type(common: list[Leaf]) -> str | None:
    for leaf in common:
        if leaf.keys[-1:] == ("param_state_sharding_type",) and isinstance(leaf, ValueLeaf):
            try:
                value = leaf.load()
            except CkptError:
                return None
            return value if isinstance(value, str) else None
    return None

"""Megatron-Core `dist_checkpointing` saves and Megatron-LM run roots, read without torch or Megatron.

A save (`dist_checkpointing.save`, what Megatron-LM's `save_checkpoint` calls with the default
`--ckpt-format torch_dist`) is a directory holding:

  * `metadata.json`: `{"sharded_backend": "torch_dist" | "zarr", "sharded_backend_version": 1,
    "common_backend": "torch", ...}`, written LAST by rank 0 (serialization.py): a directory
    without it is an interrupted save;
  * `common.pt`: torch.save of everything that is not sharded (Megatron-LM: `args`, an
    argparse.Namespace; `iteration`, `checkpoint_version`, the LR scheduler's state,
    `content_metadata`; the optimizer's param_groups);
  * torch_dist: a torch DCP checkpoint (`.metadata` + `__R_N.distcp`) of the sharded tensors,
    under their LOGICAL keys: `decoder.layers.mlp.linear_fc1.weight` holds every layer stacked
    on axis 0 (`convert --unstack 'decoder/layers/{i}/**'` splits them), chunks are the
    tensor-parallel pieces, non-tensors (`_extra_state`, `rng_state`) are ShardedObjects stored
    as DCP bytes items under `<key>/shard_<offset>_<shape>`.

The DCP part is read by the DCP package (its `.metadata` pickles torch's SavePlan and, in
0.13-0.15, Megatron's MCoreSavePlan/MCoreMetadata: admitted by name as data, pickled.py), then:
keys are the dotted names split at their dots (a ShardedObject's `/shard_...` suffix is one
key); tensors megatron stored nd-reformulated (the distributed optimizer's flattened ranges,
`mcore_data`) are shown and read as their logical tensors (reformulated.py); `common.pt` is read
through the torch.save package and its values sit at the top of the tree, as megatron's load
returns them.

A run root (Megatron-LM `--save` directory) holds `iter_NNNNNNN/` step directories (or
`release/`) and `latest_checkpointed_iteration.txt`, the iteration of the last complete save,
written after it (checkpointing.py). `--step N` opens `iter_N`; without it, the tracker's.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable

from ...errors import CkptError, CorruptMetadataError, IncompleteCheckpointError, NotFoundError, UsageError
from ...model import ArrayLeaf, Checkpoint, Key, Leaf, StepInfo, ValueLeaf
from ...storage import Storage
from ...text import is_ascii_number
from . import pickled, reformulated

# detection (detection.py, which the registry imports without this module) and the names it looks for
from .detection import COMMON_FILE, CONFIG_FILE, LEGACY_RANK_DIR, NAME, STEP_DIR, TRACKER_FILE  # noqa: F401

RELEASE_DIR = "release"
BACKENDS = ("torch_dist", "zarr")
MAX_CONFIG_BYTES = 1 << 20
MAX_TRACKER_BYTES = 1 << 10
# files Megatron-Bridge / NeMo put beside a save: listed as notes, never read as the checkpoint
BESIDE = ("run_config.yaml", "train_state.pt", "tokenizer")


# ---------------------------------------------------------------------------
# metadata.json
# ---------------------------------------------------------------------------
def read_config(storage: Storage) -> dict[str, Any]:
    """metadata.json, checked as megatron's CheckpointingConfig(**json) would take it."""
    where = f"{storage.url}/{CONFIG_FILE}"
    size = storage.size(CONFIG_FILE)
    if size > MAX_CONFIG_BYTES:
        raise CorruptMetadataError(f"{size} bytes: not a Megatron metadata.json", where)
    try:
        doc = json.loads(storage.read(CONFIG_FILE))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptMetadataError(f"not valid JSON ({str(exc)[:80]})", where) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("sharded_backend"), str):
        raise CorruptMetadataError("no sharded_backend: not a Megatron dist_checkpointing metadata.json", where)
    return doc


def detect(storage: Storage) -> bool:
    """A save (metadata.json naming a sharded backend), or a run root (the tracker, or iter_N/ directories)."""
    dirs, files = storage.listdir()
    if CONFIG_FILE in files:
        if COMMON_FILE in files:
            return True  # (a damaged metadata.json beside common.pt is still a Megatron save, reported as such)
        if backend_of(storage, quiet=True) is not None:
            return True
    if COMMON_FILE in files and ".metadata" in files:
        return True  # a save whose metadata.json was never written: interrupted
    if TRACKER_FILE in files:
        return True
    if any(LEGACY_RANK_DIR.match(d) for d in dirs):
        return True  # a legacy (--ckpt-format torch) step directory
    if "weights" in dirs and "context" in dirs:
        from . import nemo

        if nemo.is_nemo(storage, dirs):
            return True  # a NeMo 2 checkpoint
    return any(STEP_DIR.match(d) for d in dirs)


def backend_of(storage: Storage, *, quiet: bool = False) -> str | None:
    try:
        return str(read_config(storage)["sharded_backend"])
    except CkptError:
        if quiet:
            return None
        raise


# ---------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------
_SHARD_SUFFIX = re.compile(r"^(?P<key>.+)/(?P<shard>shard_[0-9.]+_[0-9.-]+)$")


def split_name(name: str) -> tuple[Key, ...]:
    """A Megatron key as a key path: split at dots outside parentheses (the distributed optimizer's
    `dtype_(torch.bfloat16, torch.float32)` stays one key), a ShardedObject's shard suffix one key."""
    m = _SHARD_SUFFIX.match(name)
    head, tail = (m.group("key"), (m.group("shard"),)) if m else (name, ())
    parts, depth, cur = [], 0, []
    for ch in head:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        if ch == "." and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return tuple(parts) + tail


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


def _plain_loader(load: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: pickled.plain(load())


# ---------------------------------------------------------------------------
# One save
# ---------------------------------------------------------------------------
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
    from ..dcp import reader as dcp

    ck, md = dcp.read_with_metadata(storage, allow=pickled.ALLOW)
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
            load = _shard_value(leaf.loader) if _SHARD_SUFFIX.match(leaf.name) else leaf.loader
            leaf.loader = _plain_loader(load)
            leaf.value_type = "object"
        leaves.append(_with_keys(leaf, keys))
    common = _common_leaves(storage, {leaf.keys for leaf in leaves})
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


def _common_leaves(storage: Storage, taken: set[tuple[Key, ...]]) -> list[Leaf]:
    """common.pt's leaves at the top of the tree (under `common/` only where a key is taken)."""
    if not storage.exists(COMMON_FILE):
        raise IncompleteCheckpointError(f"no {COMMON_FILE} (rank 0 writes it with every save)", storage.url)
    from ...torchsave import reading as ts

    tree = ts.file_tree(ts.Archive(storage, COMMON_FILE, pickled.ALLOW))
    if tree.paths == [()] and tree.values[0] in ({}, None):
        return []  # an empty common state (dist_checkpointing.save of sharded tensors only)
    leaves = ts.leaves_of(tree)
    clash = any(leaf.keys in taken or any(leaf.keys[:n] in taken for n in range(1, len(leaf.keys)))
                for leaf in leaves)
    if clash:
        leaves = ts.leaves_of(tree, ("common",))
    for leaf in leaves:
        leaf.extra["file"] = COMMON_FILE
        if isinstance(leaf, ValueLeaf) and leaf.loader is not None:
            leaf.loader = _plain_loader(leaf.loader)
            if leaf.value_type == "object":
                leaf.extra["pickled"] = True
    return leaves


def _sharding_type(common: list[Leaf]) -> str | None:
    for leaf in common:
        if leaf.keys[-1:] == ("param_state_sharding_type",) and isinstance(leaf, ValueLeaf):
            try:
                value = leaf.load()
            except CkptError:
                return None
            return value if isinstance(value, str) else None
    return None


# ---------------------------------------------------------------------------
# Run roots
# ---------------------------------------------------------------------------
def read_tracker(storage: Storage) -> str | None:
    """The step directory latest_checkpointed_iteration.txt names (`iter_N` or `release`), or None if absent."""
    _, files = storage.listdir()
    if TRACKER_FILE not in files:
        return None
    where = f"{storage.url}/{TRACKER_FILE}"
    if storage.size(TRACKER_FILE) > MAX_TRACKER_BYTES:
        raise CorruptMetadataError("not an iteration number", where)
    text = storage.read(TRACKER_FILE).decode("utf-8", "replace").strip()
    if text == "release":
        return RELEASE_DIR
    if not is_ascii_number(text):
        raise CorruptMetadataError(f"{text[:40]!r} is not an iteration number (or 'release')", where)
    return step_dir(int(text))


def step_dir(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _steps(storage: Storage, tracker: str | None) -> list[StepInfo]:
    dirs, _ = storage.listdir()
    tracked = STEP_DIR.match(tracker) if tracker else None
    tracked_n = int(tracked.group(1)) if tracked else None
    out = []
    for d in sorted(dirs, key=lambda d: (int(m.group(1)) if (m := STEP_DIR.match(d)) else -1, d)):
        m = STEP_DIR.match(d)
        if not m and d != RELEASE_DIR:
            continue
        n = int(m.group(1)) if m else 0
        child = storage.child(d)
        _, files = child.listdir()
        reason = None
        if CONFIG_FILE not in files and not any(LEGACY_RANK_DIR.match(x) for x in child.listdir()[0]):
            reason = "no metadata.json: an interrupted save"
        elif tracked_n is not None and n > tracked_n:
            reason = f"newer than {TRACKER_FILE} ({tracked_n}): its save may not have finished"
        out.append(StepInfo(d, n, reason is None, reason))
    return out


def read(storage: Storage, *, step: str | int | None = None) -> Checkpoint:
    dirs, files = storage.listdir()
    from . import nemo

    if CONFIG_FILE not in files and nemo.is_nemo(storage, dirs):
        if step not in (None, "latest"):
            raise UsageError(f"--step {step} given, but this is one NeMo checkpoint, not a run directory", storage.url)
        return nemo.read(storage)
    if CONFIG_FILE in files or COMMON_FILE in files:
        if step not in (None, "latest"):
            raise UsageError(f"--step {step} given, but this is one Megatron save, not a run directory", storage.url)
        return read_save(storage)
    if any(LEGACY_RANK_DIR.match(d) for d in dirs):
        if step not in (None, "latest"):
            raise UsageError(f"--step {step} given, but this is one Megatron save, not a run directory", storage.url)
        from . import legacy

        return legacy.read(storage)
    tracker = read_tracker(storage)
    steps = _steps(storage, tracker)
    name = _chosen(storage, step, tracker, steps)
    ck = read(storage.child(name))
    ck.steps = steps
    m = STEP_DIR.match(name)
    ck.step = int(m.group(1)) if m else 0
    info = next((s for s in steps if s.name == name), None)
    if info is not None and not info.committed:
        ck.committed = False
        ck.notes.insert(0, f"{name}: {info.reason}")
    ck.notes.append(f"run root: {len(steps)} step directories; {TRACKER_FILE} says "
                    + (tracker or "nothing (absent)"))
    return ck


def _chosen(storage: Storage, step: str | int | None, tracker: str | None, steps: list[StepInfo]) -> str:
    if step in (None, "latest"):
        if tracker is not None:
            if tracker not in {s.name for s in steps}:
                raise NotFoundError(f"{TRACKER_FILE} names {tracker}, which does not exist", storage.url)
            return tracker
        done = [s for s in steps if s.committed]
        if not done:
            raise NotFoundError(f"no complete step directory (and no {TRACKER_FILE})", storage.url)
        return done[-1].name
    text = str(step)
    if text == RELEASE_DIR or STEP_DIR.match(text):
        name = text
    elif is_ascii_number(text):
        name = step_dir(int(text))
    else:
        raise UsageError(f"--step {text!r}: an iteration number, iter_NNNNNNN, 'release' or 'latest'")
    if name not in {s.name for s in steps}:
        have = ", ".join(s.name for s in steps[-5:]) or "none"
        raise NotFoundError(f"no step directory {name} (there are: {have})", storage.url)
    return name


def layout_text(ck: Checkpoint) -> str:
    """inspect's "format" row: "Megatron-Core torch_dist (DCP, 4 files)"."""
    lay = ck.layout
    if lay.get("rank_files") is not None:  # legacy.read's
        return f"Megatron-LM --ckpt-format torch ({lay['ranks']} rank directories, {lay['rank_files']} files)"
    text = f"Megatron-Core {lay.get('backend', 'dist_checkpointing')}"
    if lay.get("nemo"):  # nemo.read's
        text = f"NeMo 2 (weights/: {text}"
        text += f" (DCP, {lay['files']} files)" if lay.get("files") else ""
        return text + ", context/)"
    if lay.get("files"):
        text += f" (DCP, {lay['files']} files" + (f", {lay['ranks']} ranks)" if lay.get("ranks") else ")")
    elif lay.get("arrays") is not None:
        text += f" ({lay['arrays']} zarr v2 arrays, {lay.get('objects', 0)} object files)"
    return text

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

A save is read by save.py. The DCP part is read by the shared DCP machinery (its `.metadata` pickles torch's SavePlan and, in
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

from ...base.errors import CorruptMetadataError, NotFoundError, UsageError
from ...core.model import Checkpoint, StepInfo
from ...storage import Storage
from ...base.text import is_ascii_number
# (read_config: checks.py asks it here too)
from .save import backend_of, read_config, read_save  # noqa: F401

# detection (detection.py, which the registry imports without this module) and the names it looks for
from .detection import COMMON_FILE, CONFIG_FILE, LEGACY_RANK_DIR, NAME, STEP_DIR, TRACKER_FILE  # noqa: F401

RELEASE_DIR = "release"
MAX_TRACKER_BYTES = 1 << 10


# ---------------------------------------------------------------------------
# metadata.json
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# One save
# ---------------------------------------------------------------------------


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

"""torch.save archives, read without torch: one file, a directory of them, a Hugging Face sharded set.

torch.save (zip format, torch >= 1.6) writes a zip of `<stem>/data.pkl` (the
pickled object; each tensor is `_rebuild_tensor_v2(storage, offset, size,
stride, ...)` over a persistent-id storage) and `<stem>/data/<key>` (each
storage's raw bytes, STORED, 64-byte aligned). ckpt_tool/machinery/torch_save/ parses the
zip the way torch's reader does and unpickles `data.pkl` through the
allow-list, so nothing in the file runs; this module turns the object into
leaves (ckpt_tool/machinery/torch_save/reading.py, which DeepSpeed and Megatron use too):

  * a dict is a subtree (str and int keys; a dotted str key is split at its
    dots, so that `pytorch_model.bin`'s "model.layers.0.mlp.up_proj.weight"
    has the same key path as the same tensor in `model.safetensors`; a file
    whose keys would collide once split keeps them whole);
  * a list or tuple holding a tensor is a subtree by index; one holding none
    is one value (as DCP keeps it: one non-tensor item);
  * a tensor is an ArrayLeaf whose reader reads the byte span of its view
    (storage offset and strides applied): views of one storage, tied weights
    (two keys on one tensor) and transposed tensors all read right, and a
    region reads only the bytes it needs;
  * anything else (numbers, strings, None, empty containers) is a ValueLeaf.

What a directory holds is decided by its files: `*.bin.index.json` (transformers'
`pytorch_model.bin.index.json`: `weight_map` tensor -> shard file) names the set;
without one, `name-0000K-of-0000N.bin` shards are one set, and other torch.save
files are one subtree each (keyed by the file's stem), a lone file the whole
tree. Opening reads each file's zip directory (its last bytes) and `data.pkl`
(its first): two small reads per file. A tensor's claim on its storage is
checked against the zip's central directory before anything is read; its data
offset (behind the member's local header) is found on its first read.

The pre-1.6 format (a bare pickle stream, also what `_use_new_zipfile_serialization
=False` writes) is refused by name: its tensors are not addressable by byte range.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ...base.errors import CorruptMetadataError, NotFoundError, UnreadableFileError, UsageError
from ...core.model import Checkpoint, Leaf, MissingData
from ...storage import Storage
from ...machinery import hf_index
from ...machinery.torch_save import object_tree
# one file's reading is the shared torch.save machinery's (DeepSpeed and Megatron read with it too)
from ...machinery.torch_save.reading import (  # noqa: F401 - Archive, TensorReader: this package's names too
    LEGACY_MAGIC, ZIP_MAGIC, Archive, FileTree, TensorReader, dotted, file_tree, head_bytes, is_torch_file, leaves_of,
    repeating_view_notes,
)

NAME = "torch"
SUFFIXES = (".bin", ".pt", ".pth")
INDEX_SUFFIX = ".bin.index.json"  # transformers' WEIGHTS_INDEX_NAME, pytorch_model.bin.index.json
SHARD_FILE = re.compile(r"^(?P<stem>.+)-(?P<k>\d{5})-of-(?P<n>\d{5})\.bin$")
HF_WEIGHTS = "pytorch_model.bin"  # transformers' WEIGHTS_NAME
# at most this many candidate files have their first bytes read by detect()
_SNIFF_LIMIT = 16


def named_by_transformers(name: str) -> bool:
    """`pytorch_model.bin` or a `-0000K-of-0000N.bin` shard: a torch.save file by its name alone
    (so that a damaged one is reported as such, not as an unknown file)."""
    return name == HF_WEIGHTS or bool(SHARD_FILE.match(name))


def _is_torch_file(storage: Storage, name: str) -> bool:
    return named_by_transformers(name) or is_torch_file(head_bytes(storage, name))


def detect(storage: Storage) -> bool:
    """A directory with a `*.bin.index.json`, or top-level `.bin`/`.pt`/`.pth` files that are torch.save archives."""
    _, files = storage.listdir()
    if any(f.endswith(INDEX_SUFFIX) for f in files):
        return True
    candidates = [f for f in files if f.endswith(SUFFIXES)][:_SNIFF_LIMIT]
    return any(_is_torch_file(storage, f) for f in candidates)


def split_local_file(url: str) -> tuple[str, str] | None:
    """(directory, file name) when `url` names one torch.save file: a local file by its first
    bytes (whatever its name: `.pt`, `.bin`, `.ckpt`, ...), a remote one by its suffix. (The
    registry asks only about names no other format claims: its single_file "unclaimed".)"""
    path = url[len("file://"):] if url.startswith("file://") else url
    if "://" in url and not url.startswith("file://"):
        parent, _, name = url.rstrip("/").rpartition("/")
        if not name.endswith(SUFFIXES) or parent.endswith(":/"):
            return None
        return parent, name
    local = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(local):
        return None
    try:
        with open(local, "rb") as fh:
            head = fh.read(16)
    except OSError:
        return None
    name = os.path.basename(local)
    if head.startswith(LEGACY_MAGIC) or (head.startswith(ZIP_MAGIC) and _holds_data_pkl(local, name)):
        return os.path.dirname(local), name
    return None


def _holds_data_pkl(path: str, name: str) -> bool:
    """A zip file torch.save wrote (a `data.pkl` member), not a numpy .npz or any other zip; a zip
    too damaged to list is torch's when its name says so (its damage is then reported as such)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as zf:
            return any(n == "data.pkl" or n.endswith("/data.pkl") for n in zf.namelist())
    except (OSError, zipfile.BadZipFile, ValueError, EOFError, NotImplementedError):
        # (NotImplementedError: a "version needed to extract" zipfile does not know; miniz ignores it)
        return name.endswith(SUFFIXES)


# ---------------------------------------------------------------------------
# A directory: which files, and how their trees combine
# ---------------------------------------------------------------------------
@dataclass
class Layout:
    files: list[str]  # the torch.save files read, in order
    index_file: str | None
    weight_map: dict[str, str] | None
    sharded: bool  # the files' trees are merged (an index, or -0000K-of-0000N shards)
    missing: list[str]  # files the index names that are not there
    ignored: list[str]  # other files beside them
    stray: list[str]  # torch files the index does not name


def scan(storage: Storage) -> Layout:
    _, files = storage.listdir()
    indexes = sorted(f for f in files if f.endswith(INDEX_SUFFIX))
    top = set(files)
    if indexes:
        if len(indexes) > 1:
            raise CorruptMetadataError(
                f"{len(indexes)} index files ({', '.join(indexes)}): open a directory holding one set", storage.url,
            )
        weight_map, _ = hf_index.read_index(storage, indexes[0])  # (the one reader of Hugging Face's index)
        named = sorted(set(weight_map.values()))
        present = [f for f in named if f in top]
        stray = sorted(f for f in files if f.endswith(SUFFIXES) and f not in set(named)
                       and SHARD_FILE.match(f))
        ignored = sorted(f for f in files if f not in set(named) and f != indexes[0] and f not in set(stray))
        return Layout(present, indexes[0], weight_map, True, [f for f in named if f not in top], ignored, stray)
    heads = {f: head_bytes(storage, f) for f in files if f.endswith(SUFFIXES)}
    torch_files = [f for f, head in heads.items() if named_by_transformers(f) or is_torch_file(head)]
    if torch_files:
        # an empty `.pt` beside torch.save files is one whose save was killed before its first
        # byte (a rank's shard): torch.load fails on it (EOFError), so it is read, and fails, here
        # too, never passed over as a file of something else
        torch_files += [f for f, head in heads.items() if not head and f not in torch_files]
    torch_files.sort()
    ignored = sorted(f for f in files if f not in set(torch_files))
    shards = [f for f in torch_files if SHARD_FILE.match(f)]
    sharded = bool(shards) and len(shards) == len(torch_files)
    missing: list[str] = []
    if sharded:
        m = SHARD_FILE.match(shards[0])
        assert m is not None
        stem, n = m.group("stem"), int(m.group("n"))
        missing = [f"{stem}-{k:05d}-of-{n:05d}.bin" for k in range(1, n + 1)
                   if f"{stem}-{k:05d}-of-{n:05d}.bin" not in top]
    return Layout(torch_files, None, None, sharded, missing, ignored, [])


def _stem(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def read(storage: Storage, *, step: str | int | None = None) -> Checkpoint:
    """A directory of torch.save files (see the module docstring); no tensor data is read."""
    if step not in (None, "latest"):
        raise UsageError(f"--step {step} given, but a directory of torch.save files has no steps", storage.url)
    layout = scan(storage)
    if not layout.files and not layout.missing:
        raise CorruptMetadataError("no torch.save files here", storage.url)
    archives = []
    unreadable: dict[str, str] = {}
    for name in layout.files:
        try:
            archives.append(Archive(storage, name))
        except UnreadableFileError as exc:
            if not layout.sharded:
                raise  # a file of its own (no set to be incomplete): its error is the answer
            # a shard that is there but cannot be read (its permissions): the set is incomplete, as
            # for a missing shard, and the other shards' tensors are listed
            unreadable[name] = exc.message
    trees = [file_tree(a) for a in archives]
    notes: list[str] = []
    leaves: list[Leaf] = []
    if layout.sharded or len(trees) == 1:
        for tree in trees:
            leaves.extend(leaves_of(tree))
        leaves = _merged(leaves, storage, layout, notes)
    else:
        stems = [_stem(t.archive.name) for t in trees]
        for tree, stem in zip(trees, stems):
            key = stem if stems.count(stem) == 1 else tree.archive.name
            leaves.extend(leaves_of(tree, (key,)))
        notes.append(f"{len(trees)} torch.save files, each a subtree by its name: {', '.join(layout.files[:6])}"
                     + (" ..." if len(layout.files) > 6 else ""))
    missing = [MissingData(name, f"does not exist (named in {layout.index_file})" if layout.index_file
                           else "does not exist (the other shards of its set are here)",
                           [t for t, f in (layout.weight_map or {}).items() if f == name])
               for name in layout.missing]
    missing += [MissingData(name, why, [t for t, f in (layout.weight_map or {}).items() if f == name], True)
                for name, why in unreadable.items()]
    notes.extend(_notes(trees, layout))
    return Checkpoint(
        path=storage.url, format=NAME,
        layout={"files": len(layout.files), "index": layout.index_file, "sharded": layout.sharded,
                "ignored": layout.ignored,
                # a directory of one torch.save file (beside notes, a config): its name, as a file's
                **({"file": layout.files[0]} if len(layout.files) == 1 else {})},
        leaves=leaves, committed=True, saved_at=None, notes=notes, missing=missing,
    )


def _merged(leaves: list[Leaf], storage: Storage, layout: Layout, notes: list[str]) -> list[Leaf]:
    """A sharded set's leaves: one per name (a name in two files is an error), checked against the index."""
    by_name: dict[str, Leaf] = {}
    for leaf in leaves:
        if leaf.name in by_name:
            first, second = by_name[leaf.name].extra.get("file"), leaf.extra.get("file")
            raise CorruptMetadataError(f"{leaf.name!r} is stored in both {first} and {second}", storage.url)
        by_name[leaf.name] = leaf
    if layout.weight_map is None:
        return leaves
    out = []
    for leaf in leaves:
        want = layout.weight_map.get(leaf.name)
        if want is None:
            notes.append(f"{leaf.name}: stored in {leaf.extra.get('file')} but not in {layout.index_file}")
        elif want != leaf.extra.get("file"):
            raise CorruptMetadataError(
                f"{layout.index_file} places {leaf.name!r} in {want}, but it is stored in {leaf.extra.get('file')}",
                storage.url,
            )
        out.append(leaf)
    present = set(layout.files)
    for tname, fname in layout.weight_map.items():
        if fname in present and tname not in by_name:
            notes.append(f"{tname}: {layout.index_file} places it in {fname}, which does not hold it")
    return out


def _notes(trees: list[FileTree], layout: Layout) -> list[str]:
    notes: list[str] = []
    for tree in trees:
        notes.extend(repeating_view_notes(tree.paths, tree.values))
        for names in tree.shared.values():
            if len(set(names)) > 1:
                shown = sorted(set(names))
                notes.append(f"one storage, {len(shown)} tensors ({tree.archive.name}): " + ", ".join(shown[:4])
                             + (" ..." if len(shown) > 4 else ""))
        refs = [(dotted(path), dotted(value.first) or "the top-level object")
                 for path, value in zip(tree.paths, tree.values) if isinstance(value, object_tree.Reference)]
        if refs:
            notes.append(f"{len(refs)} path{'s' if len(refs) != 1 else ''} to an object shown at another ({tree.archive.name}; "
                         "torch.load gives one object at both): " + ", ".join(f"{a} is {b}" for a, b in refs[:4])
                         + (" ..." if len(refs) > 4 else ""))
    if layout.stray:
        notes.append(f"not in {layout.index_file} (not read): {', '.join(layout.stray[:5])}"
                     + (" ..." if len(layout.stray) > 5 else ""))
    if layout.ignored:
        notes.append(f"other files (ignored): {', '.join(layout.ignored[:8])}" + (" ..." if len(layout.ignored) > 8 else ""))
    return notes


def read_file(storage: Storage, name: str) -> Checkpoint:
    """One torch.save file `name` inside `storage`."""
    if not storage.exists(name):
        raise NotFoundError("no such file", f"{storage.url}/{name}")
    archive = Archive(storage, name)
    tree = file_tree(archive)
    layout = Layout([name], None, None, False, [], [], [])
    return Checkpoint(
        path=f"{storage.url}/{name}", format=NAME,
        layout={"files": 1, "file": name, "index": None, "sharded": False, "ignored": []},
        leaves=leaves_of(tree), committed=True, saved_at=None, notes=_notes([tree], layout),
    )


def layout_text(ck: Checkpoint) -> str:
    """inspect's "format" row: "torch.save (3 files, pytorch_model.bin.index.json)", "torch.save
    (model.pt)" for one file (given by its path, or alone in its directory)."""
    lay = ck.layout
    what = lay["file"] if lay.get("file") else f"{lay.get('files', 0)} file{'s' if lay.get('files') != 1 else ''}"
    return f"torch.save ({what}" + (f", {lay['index']})" if lay.get("index") else ")")


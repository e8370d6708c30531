"""What a directory that no reader claims holds, said in one line.

The registry's last word when detection fails: checkpoints one level down
(a directory of step directories: name them and say how to pick one), or
files ckpt recognises but does not read (naming their format, by name or by
their first bytes), or just the first few names. A local path naming one
file gets the same care (refuse_file): a file inside a checkpoint names the
directory to open, any other file says what it is (a torch.save archive,
a gzip file, ...).

The registry (formats/__init__) asks this module and hands it its table (the
formats in detection order): nothing here imports the registry or a format.
"""
from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Sequence

from ..base.errors import CkptError, UnknownFormatError
from ..storage import Storage
from ..base.text import joined

if TYPE_CHECKING:
    from . import FormatInfo

_MAX_SUBDIRS = 64
_STEPISH = re.compile(r"^(?:.*\D)?(\d+)$")

# file names of formats ckpt does not read, by the way their writers name them
_OTHER_FORMATS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\.index$|\.data-\d+-of-\d+$"), "TensorFlow checkpoint files"),
    (re.compile(r"\.(pt|pth|bin)$"), "torch.save files"),
    (re.compile(r"\.safetensors$"), "safetensors files"),
    (re.compile(r"\.(npz|npy)$"), "numpy files"),
    (re.compile(r"\.(h5|hdf5|keras)$"), "HDF5 / Keras files"),
    (re.compile(r"\.(msgpack|mpk)$"), "msgpack files"),
]


def describe(storage: Storage, formats: Sequence[FormatInfo]) -> str:
    """The one line for a directory no format claims (`formats`: the registry's, in detection order)."""
    dirs, files = storage.listdir()
    found = []
    for d in dirs[:_MAX_SUBDIRS]:
        try:
            sub = storage.child(d)
            for info in formats:
                if info.module().detect(sub):
                    found.append((d, info.name))
                    break
        except CkptError:
            continue
    if found:
        steps = [(d, f) for d, f in found if _STEPISH.match(d)]
        listed = ", ".join(f"{d}/ ({f})" for d, f in found[:6]) + (", ..." if len(found) > 6 else "")
        example = f"{storage.url}/{found[-1][0]}"
        if steps and len(steps) == len(found):
            return (
                f"a directory of {len(found)} step directories, not one checkpoint: {listed}; "
                f"open one, e.g. ckpt inspect {example}"
            )
        if len(found) == 1:
            return f"a directory holding one checkpoint, not one itself: {listed}; open it: ckpt inspect {example}"
        return f"a directory of {len(found)} checkpoints, not one: {listed}; open one, e.g. ckpt inspect {example}"
    for d, title, n in run_roots_below(storage, dirs, formats):
        # a training run's experiment directory (NeMo's, above its checkpoints/): the run root in it
        there = f"{storage.url.rstrip('/')}/{d}"
        return (f"a directory holding a run root, not a checkpoint itself: {d}/ ({title}, {n} step{'s' * (n != 1)}); "
                f"try {there} (ckpt ls {there} lists its steps)")
    kinds = sorted({kind for f in files for rx, kind in _OTHER_FORMATS if rx.search(f)} | _sniffed_kinds(storage, files))
    if kinds:
        names = ", ".join(sorted(files)[:5])
        found_kinds = kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " and " + kinds[-1]
        return f"not a checkpoint format ckpt reads: found {found_kinds} ({names})"
    seen = ", ".join(sorted(files)[:5]) or ("only directories: " + ", ".join(dirs[:5]) if dirs else "nothing")
    read = _titles(formats, "or")
    return f"not {_article(read)} {read} checkpoint (found {seen})"


def run_roots_below(storage: Storage, dirs: list[str], formats: Sequence[FormatInfo]) -> list[tuple[str, str, int]]:
    """(name, framework title, step count) of the one sub-directory, when it is a run root (the
    run layouts' table: formats/roots.py): a training run's experiment directory (NeMo's, above
    its checkpoints/). Only where there is one sub-directory: it costs a recursive listing of it,
    and this is asked on error paths a listing of many steps may take (a step that reads as no
    checkpoint)."""
    if len(dirs) != 1:
        return []
    from . import roots

    found = []
    for d in dirs:
        try:
            hit = roots.identify(roots.RootListing.of(storage.child(d), formats))
        except CkptError:
            continue
        if hit is not None:
            found.append((d, hit[0].title, len(hit[1])))
    return found


def _titles(formats: Sequence[FormatInfo], conjunction: str) -> str:
    """"Orbax, ... or Flax / T5X msgpack": the formats' titles in the order lists show them."""
    return joined([f.title for f in sorted(formats, key=lambda f: f.listed)], conjunction)


def _article(text: str) -> str:
    return "an" if text[:1] in "AEIOU" else "a"


_MAX_SNIFFED = 16  # files of an unknown directory whose first bytes are looked at


def _sniffed_kinds(storage: Storage, files: list[str]) -> set[str]:
    """Kinds of a local directory's files that their names do not tell (a few files' first bytes)."""
    if storage.local_root is None:
        return set()  # on object stores a read per file is a request: names only
    unnamed = [f for f in sorted(files) if not any(rx.search(f) for rx, _ in _OTHER_FORMATS)]
    kinds = set()
    for f in unnamed[:_MAX_SNIFFED]:
        kind = sniff_local(os.path.join(storage.local_root, f))
        if kind is not None:
            kinds.add(kind[1])
    return kinds


# -- one file given where a checkpoint directory was expected ----------------------

def _marks_checkpoint(name: str, formats: Sequence[FormatInfo]) -> bool:
    """Whether a top-level name makes its directory a checkpoint of some format (the registry's
    claims): a file given beside one is looked for there (a listing of the directory, never a walk)."""
    return any(info.claims_mark_checkpoint and info.claimed(name) for info in formats)


# what to do with a file of a kind that holds a checkpoint some other way
_HINTS = {
    "gzip files": "; decompress it first (a .tar.gz holds a directory: extract it and open that)",
    "zstd files": "; decompress it first",
    "xz files": "; decompress it first",
    "bzip2 files": "; decompress it first",
    "tar archives": "; extract it and open the directory",
}
_PROCESS_DB = re.compile(r"^ocdbt\.process_\d+$")
_PARENTS = 4  # how far up a file inside a checkpoint may sit (root/step/item/d/<file>)
_MAX_LISTED = 10_000

# torch.save's legacy (pre-1.6) format: a pickle starting with this magic number
_TORCH_LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"
# the last 8 bytes of a TensorFlow checkpoint's .index (a LevelDB-format table)
_LEVELDB_TABLE_MAGIC = b"\x57\xfb\x80\x8b\x24\x75\x47\xdb"


def sniff(head: bytes, tail: bytes = b"", name: str = "") -> tuple[str, str] | None:
    """What a file is by its first bytes (and last 8, and name where bytes cannot tell):
    (one file's description, a group of them), or None when nothing here knows it.

    Zip archives are told apart by their members elsewhere (see _zip_kind).
    """
    if head.startswith(_TORCH_LEGACY_MAGIC):
        return "a legacy torch.save file (pickle format, before torch 1.6)", "torch.save files"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "a Python pickle", "pickle files"
    if head.startswith(b"\x93NUMPY"):
        return "a numpy .npy array", "numpy files"
    if head.startswith(b"\x89HDF\r\n\x1a\n"):
        return "an HDF5 file (Keras .h5 / h5py)", "HDF5 / Keras files"
    if head.startswith(b"\x1f\x8b"):
        return "a gzip-compressed file", "gzip files"
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        return "a zstd-compressed file", "zstd files"
    if head.startswith(b"\xfd7zXZ\x00"):
        return "an xz-compressed file", "xz files"
    if head.startswith(b"BZh") and head[3:4].isdigit():
        return "a bzip2-compressed file", "bzip2 files"
    if head[257:262] == b"ustar":
        return "a tar archive", "tar archives"
    if head.startswith(b"GGUF"):
        return "a GGUF model file (llama.cpp)", "GGUF files"
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "a zip archive", "zip archives"
    if head.startswith(b"model_checkpoint_path:"):
        return "a TensorFlow checkpoint state file", "TensorFlow checkpoint files"
    if tail == _LEVELDB_TABLE_MAGIC and name.endswith(".index"):
        return "a TensorFlow checkpoint index (tf.train.Checkpoint)", "TensorFlow checkpoint files"
    if re.search(r"\.data-\d+-of-\d+$", name):
        return "a TensorFlow checkpoint data file", "TensorFlow checkpoint files"
    return None


def _zip_kind(path: str) -> tuple[str, str] | None:
    """A zip file by its members: a torch.save archive, a numpy .npz, a Keras archive."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return None
    if any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
        return "a torch.save archive (.pt / .bin: a zip holding data.pkl)", "torch.save files"
    if names and all(n.endswith(".npy") for n in names):
        return "a numpy .npz archive", "numpy files"
    if "config.json" in names and any(n.endswith(".weights.h5") for n in names):
        return "a Keras .keras archive", "HDF5 / Keras files"
    return None


def sniff_local(path: str) -> tuple[str, str] | None:
    """What the local file at `path` is (see sniff), or None."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(512)
            size = fh.seek(0, 2)
            tail = b""
            if size >= 8:
                fh.seek(size - 8)
                tail = fh.read(8)
    except OSError:
        return None
    kind = sniff(head, tail, os.path.basename(path))
    if kind is not None and kind[1] == "zip archives":
        return _zip_kind(path) or kind
    return kind


def _checkpoint_around(path: str, formats: Sequence[FormatInfo]) -> tuple[str, FormatInfo] | None:
    """(directory, format) of the checkpoint a local file sits in, up to _PARENTS levels up, or None."""
    shown = os.path.dirname(os.path.normpath(path))
    for _ in range(_PARENTS):
        directory = shown or "."
        try:
            with os.scandir(directory) as it:
                names = [e.name for _, e in zip(range(_MAX_LISTED), it)]
        except OSError:
            return None
        # a process's own OCDBT database is part of the checkpoint above it, not one to open
        if any(_marks_checkpoint(n, formats) for n in names) and not _PROCESS_DB.match(os.path.basename(os.path.abspath(directory))):
            try:
                storage = Storage.open(directory)
                for info in formats:
                    if info.module().detect(storage):
                        return directory, info
            except CkptError:
                pass
        parent = os.path.dirname(directory)
        if not shown or parent == directory:
            return None
        shown = parent
    return None


def refuse_file(url: str, formats: Sequence[FormatInfo], command: str = "inspect") -> None:
    """Raise the one line for a local path naming a file that no reader opens as a checkpoint
    (`formats`: the registry's, in detection order).

    A file inside a checkpoint (`.metadata`, `_CHECKPOINT_METADATA`, an index,
    a data file) names the directory to open; any other file says what it is
    by its bytes (a torch.save archive, gzip, HDF5, ...). Directories, remote
    URLs and missing paths pass through to the storage layer's own errors.
    """
    from ..storage import local_path

    path = local_path(url)
    if path is None or not os.path.isfile(path):
        return
    try:  # a file no reader could sniff because it cannot be read at all: say that, not what it is not
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)))
    except OSError as exc:
        from ..storage.local import errno_error

        raise errno_error(exc.errno, exc.strerror or str(exc), "cannot read", url) from None
    shown = url[len("file://"):] if url.startswith("file://") else url
    around = _checkpoint_around(shown if not url.startswith("file://") else path, formats)
    if around is not None:
        directory, info = around
        label = info.title
        raise UnknownFormatError(
            f"is a file inside {_article(label)} {label} checkpoint; open its directory: ckpt {command} {directory}", url,
        )
    kind = sniff_local(path)
    if kind is not None:
        hint = _HINTS.get(kind[1], "")
        raise UnknownFormatError(f"is {kind[0]}: not a format ckpt reads (it reads {_titles(formats, 'and')} checkpoints){hint}", url)

"""Shallow checks of msgpack-tree checkpoints (Flax legacy, orbax <= 0.4, T5X).

The msgpack document is scanned (bounded; no array data read), then each
array it places elsewhere is checked where it lives: its zarr metadata, its
chunk grid against the stored keys (per-array directories or the OCDBT
database), its recorded sharding. Inline arrays are checked by size: the
payload must be shape x itemsize bytes. Every problem is a Finding.
"""
from __future__ import annotations

from typing import Any

from ...base import strict_json
from ...base.errors import CkptError, UsageError
from ...base.findings import Findings
from ...core.model import ValueLeaf
from . import scan as ms
from . import reader as mt
from ...storage import Storage
from ...machinery.arrays import checks as ac


def check_path(storage: Storage, findings: Findings, *, step: str | int | None = None, only: str | None = None) -> str:
    """Validate a file, an item / step directory, or every step of a root; the family found."""
    if only is not None:
        return _check_file(storage, only, findings, where="")
    dirs, files = storage.listdir()
    if mt._is_item(storage, files):
        return _check_item(storage, storage.url.rstrip("/").rsplit("/", 1)[-1], findings, where="")
    steps, loose = mt._entries(storage, dirs, files)
    if not steps:
        if len(loose) == 1:
            return _check_file(storage, loose[0], findings, where="")
        findings.error("no-steps", f"{len(loose)} msgpack files and no steps: validate one file", file=".")
        return "flax"
    chosen = steps
    if step not in (None, "all"):
        try:
            chosen = [mt._choose(storage, steps, step)]
        except UsageError:
            raise
        except CkptError as exc:
            findings.error("no-steps", exc.message, file=".")
            return "flax"
    family = "flax"
    committed_any = False
    for entry in chosen:
        if not entry.committed:
            # like orbax's tmp steps: harmless beside complete ones, an error when asked for
            report = findings.error if len(chosen) == 1 and step not in (None, "all") else findings.warning
            report("uncommitted-save", f"{entry.reason}; the library will not restore it", file=entry.name + ("/" if entry.is_dir else ""))
            continue
        committed_any = True
        if not entry.is_dir:
            family = _check_file(storage, entry.name, findings, where="")
            continue
        for item in entry.items:
            rel = f"{entry.name}/{item}" if item else entry.name
            family = _check_item(storage.child(rel), item or entry.name, findings, where=rel + "/")
        for item in entry.json_items:
            try:
                # its leaves, as inspect lists them (each a value)
                findings.count("values", len(mt.json_leaves(storage.child(f"{entry.name}/{item}"), "metadata", (item,), item)))
            except (ValueError, CkptError) as exc:
                findings.error("bad-metadata", f"JSON item unreadable: {getattr(exc, 'message', exc)}", file=f"{entry.name}/{item}/metadata")
    if not committed_any:
        findings.error("no-steps", "no complete step in this directory", file=".")
    return family


def _scan(storage: Storage, key: str, findings: Findings, where: str) -> ms.Node | None:
    try:
        return ms.scan_tree(storage, key)
    except ms.TruncatedMsgpack as exc:
        findings.error("truncated-file", exc.message, file=where + key)
    except CkptError as exc:
        findings.error("bad-metadata", f"unreadable msgpack: {exc.message}", file=where + key)
    return None


def _build(storage: Storage, key: str, tree: ms.Node, findings: Findings, where: str) -> mt._Builder | None:
    builder = mt._Builder(storage, key)
    try:
        builder.walk(tree, ())
    except CkptError as exc:
        findings.error("bad-metadata", exc.message, file=where + key)
        return None
    for leaf in builder.leaves:
        if leaf is None:
            continue
        # counted as inspect counts the leaves (an array stored outside the file: _check_arrays)
        findings.count("values" if isinstance(leaf, ValueLeaf) else "arrays")
        error = leaf.extra.get("payload_error")
        if error:
            findings.error("bad-chunk", error + "; flax cannot restore it", leaf=leaf.path, file=where + key)
        if isinstance(leaf, ValueLeaf) and leaf.value_type.startswith("msgpack-ext-"):
            # not one of flax's ext types (ndarray, native complex, numpy scalar) nor orbax's
            # tuple: orbax's msgpack_restore refuses the file, flax's gives an opaque
            # msgpack.ExtType in the array's place, and ckpt cannot read or convert it
            findings.error("bad-metadata", f"stored as msgpack ext type {leaf.value_type[len('msgpack-ext-'):]}, "
                           "which no flax or orbax writer uses: orbax refuses the file and flax restores "
                           "no array there", leaf=leaf.path, file=where + key)
    return builder


def _check_file(storage: Storage, key: str, findings: Findings, *, where: str) -> str:
    findings.count("files")
    tree = _scan(storage, key, findings, where)
    if tree is None:
        return "flax"
    builder = _build(storage, key, tree, findings, where)
    if builder is not None and (builder.placeholders or builder.specs):
        findings.error("bad-metadata", "a Flax msgpack file refers to arrays stored elsewhere", file=where + key)
    return "flax"


def _check_item(storage: Storage, name: str, findings: Findings, *, where: str) -> str:
    findings.count("steps")
    if mt.is_tmp(name):
        findings.error("uncommitted-save", "temporary directory name: the save never finished", file=where or name)
    tree = _scan(storage, mt.TREE_FILE, findings, where)
    if tree is None:
        return "orbax"
    tree, version = mt.t5x_state(tree)
    builder = _build(storage, mt.TREE_FILE, tree, findings, where)
    if builder is None:
        return "orbax" if version is None else "t5x"
    dirs, files = storage.listdir()
    family = "t5x" if version is not None or builder.specs else "orbax"
    arrays: list[tuple[str, str, dict[str, Any] | None]]  # (leaf, array directory, tensorstore spec)
    if builder.specs:
        arrays = []
        for _, keys, spec in builder.specs:
            leaf = "/".join(str(k) for k in keys)
            try:
                arrays.append((leaf, mt.spec_path(spec, leaf), spec))
            except CkptError as exc:
                findings.error("bad-metadata", exc.message, leaf=leaf, file=where + mt.TREE_FILE)
        _check_arrays(storage, arrays, set(storage.list()), False, files, {}, findings, where)
    if builder.placeholders:
        # (OCDBT data files without their manifest: the manifest is what is lost, not each array;
        # an array named `d` is a zarr directory of its own)
        use_ocdbt = mt.ROOT_MANIFEST in files or ("d" in dirs and not storage.exists("d/.zarray"))
        lost = ac.LostKeys()
        stored = ac.check_ocdbt(storage, "", findings, where=where, lost=lost) if use_ocdbt else set(storage.list())
        try:
            shardings = mt.read_shardings(storage, files)
        except CkptError as exc:
            findings.error("bad-metadata", exc.message, file=where + mt.SHARDING)
            shardings = {}
        arrays = [("/".join(str(k) for k in keys_), pname, None) for _, keys_, pname in builder.placeholders]
        _check_arrays(storage, arrays, stored, use_ocdbt, files, shardings, findings, where, lost=lost,
                      jax_arrays=mt._sharding_names(storage, files))
    if version is not None and not any(k[:1] == ("version",) for k in _tree_keys(builder)):
        findings.count("values")  # T5X's version beside the state: a leaf of inspect's (msgpack reader)
    return family


def _tree_keys(builder: mt._Builder) -> list[tuple[Any, ...]]:
    """The keys of every leaf of the tree built (placeholders and specs included)."""
    return [tuple(leaf.keys) for leaf in builder.leaves if leaf is not None] + \
        [tuple(keys) for _, keys, _ in builder.placeholders] + [tuple(keys) for _, keys, _ in builder.specs]


def _check_arrays(
    storage: Storage, arrays: list[tuple[str, str, dict[str, Any] | None]], keys: set[str], use_ocdbt: bool,
    files: list[str], shardings: dict[str, Any], findings: Findings, where: str, *, lost: ac.LostKeys | None = None,
    jax_arrays: set[str] | None = None,
) -> None:
    """Each external array: stored, readable zarr metadata agreeing with the tree, every chunk present
    (`lost`: the arrays a lost OCDBT data file takes, named once by that file's finding)."""
    present = [name for _, name, _ in arrays if f"{name}/.zarray" in keys]
    texts = ac.read_array_metadata(storage, use_ocdbt, files, [], present, ".zarray")
    for leaf, name, spec in arrays:
        findings.count("values" if _python_scalar(texts.get(name), name, jax_arrays) else "arrays")
        lost_in = lost.file_of(name) if lost else None
        if lost_in is not None:
            findings.file_problem("lost-process-data", "OCDBT data file lost", file=lost_in, leaf=leaf)
            if f"{name}/.zarray" not in keys:
                continue
        if f"{name}/.zarray" not in keys:
            if any(k.startswith(name + "/") for k in keys):
                findings.error("missing-metadata", ".zarray missing (chunks are present)", leaf=leaf, file=f"{where}{name}/.zarray")
            else:
                findings.error("leaf-missing", f"in '{mt.TREE_FILE}' but not stored: restore will fail", leaf=leaf, file=f"{where}{name}/")
            continue
        try:
            text = texts.get(name)
            if text is None:
                raise CkptError(".zarray listed but unreadable")
            zmeta = strict_json.loads(text)
            shape, dtype, chunk_shape, _ = mt.parse_zarr_metadata(zmeta, False, f"{where}{name}/.zarray")
        except (ValueError, CkptError) as exc:
            findings.error("bad-array-metadata", f"unreadable .zarray: {getattr(exc, 'message', exc)}", leaf=leaf, file=f"{where}{name}/.zarray")
            continue
        if spec is not None:
            spec_metadata = spec.get("metadata")
            declared = spec_metadata if isinstance(spec_metadata, dict) else {}
            if "shape" in declared and list(declared["shape"]) != list(shape):
                findings.error("bad-array-metadata", f"the spec's shape {declared['shape']} disagrees with .zarray {list(shape)}", leaf=leaf, file=f"{where}{name}/.zarray")
            if spec.get("dtype") not in (None, dtype):
                findings.error("bad-array-metadata", f"the spec's dtype {spec.get('dtype')!r} disagrees with .zarray ({dtype})", leaf=leaf, file=f"{where}{name}/.zarray")
        if name in shardings:
            ac.check_sharding(shardings[name], shape, findings, leaf, where + mt.SHARDING)
        if lost_in is not None:
            continue  # its chunks are said lost already
        # no store_array_data_equal_to_fill_value in these versions: a lost chunk restores as zeros
        ac.check_chunks(name, leaf, shape, chunk_shape, False, zmeta, keys, True, findings, where)
        if not use_ocdbt:
            ac.check_empty_chunk_files(storage, name, leaf, keys, ".zarray", findings, where)
    referenced = {name for _, name, _ in arrays}
    stored = {k.split("/", 1)[0] for k in keys if k.endswith("/.zarray")}
    for name in sorted(stored - referenced):
        findings.warning("leaf-missing", f"array stored but not in '{mt.TREE_FILE}': the library will ignore it", file=f"{where}{name}/")


def _python_scalar(text: bytes | str | None, name: str, jax_arrays: set[str] | None) -> bool:
    """Whether the placeholder `name` is a Python number orbax <= 0.4 saved as a 0-d array, which
    inspect lists as a value (the msgpack reader's resolve_placeholders rule; `jax_arrays`: the
    names `_sharding` lists, None without it: then every placeholder is an array)."""
    if text is None or jax_arrays is None or name in jax_arrays:
        return False
    try:
        shape, dtype, _, _ = mt.parse_zarr_metadata(strict_json.loads(text), False, name)
    except (ValueError, CkptError):
        return False  # reported below as unreadable
    return shape == () and dtype in mt._PYTHON_NUMBER_DTYPES


def check_single_file(storage: Storage, name: str, findings: Findings) -> str:
    """`ckpt validate FILE` for one Flax msgpack file `name` in `storage`: the family found (validate
    reports it, and --deep reads what these checks found readable)."""
    if name == mt.TREE_FILE and mt._is_item(storage, storage.listdir()[1]):
        # the `checkpoint` file of an orbax <= 0.4 item or a T5X step: checked with the arrays beside it
        return _check_item(storage, storage.url.rstrip("/").rsplit("/", 1)[-1], findings, where="")
    return _check_file(storage, name, findings, where="")

"""Shallow checks of an Orbax checkpoint: metadata, key listings and file sizes only.

Every problem becomes a Finding; nothing here raises on damage it can
describe. Array chunks are never read (that is --deep, in deep.py).
"""
from __future__ import annotations

import math
from typing import Any

from ...base import dtypes
from ...base.errors import CkptError, UsageError
from ...base.findings import Findings
from ...core.model import keys_path
from . import reader as ob
from ...machinery.arrays import checks as ac
from ...machinery.arrays import schema
from ...storage import Storage

ROOT_METADATA = "_ROOT_METADATA"


def check_path(storage: Storage, findings: Findings, *, step: str | int | None = None, only: str | None = None) -> None:
    """Validate a single step, or every step of a CheckpointManager root (`only`: unused, no single files)."""
    check_opened(storage, findings, {}, step=step, only=only)


def check_opened(storage: Storage, findings: Findings, parsed: dict[str, Any], *, step: str | int | None = None,
                 only: str | None = None) -> None:
    """check_path of a checkpoint the reader opened in this run: `parsed` (Checkpoint.parsed) holds
    what it parsed of each step's _CHECKPOINT_METADATA and each item's _METADATA, _sharding and
    arrays' zarr metadata (ob.ItemParse), which are not read again (each record is taken out of it
    once used); the rest is read as check_path reads it, and the findings are the same."""
    dirs, files = storage.listdir()
    if ob._looks_like_step(storage, dirs, files):
        name = storage.url.rstrip("/").rsplit("/", 1)[-1]
        check_step(storage, name, dirs, files, findings, where="", parsed=parsed)
        return
    steps = [d for d in dirs if ob.step_number(d) is not None]
    if "metadata" in dirs and storage.exists(f"metadata/{ROOT_METADATA}"):
        # CheckpointManager's own record of the root (orbax reads it for metadata())
        try:
            schema.parse_root_metadata(ob.read_json(storage, f"metadata/{ROOT_METADATA}"), f"metadata/{ROOT_METADATA}")
        except CkptError as exc:
            findings.error("bad-metadata", f"unreadable: {exc.message}", file=f"metadata/{ROOT_METADATA}")
    if step not in (None, "all"):
        if step == "latest":
            infos = sorted((ob._step_status(storage, d) for d in steps), key=lambda s: s.step or -1)
            committed = [s.name for s in infos if s.committed]
            steps = committed[-1:]
        else:
            try:
                want = int(step)
            except (TypeError, ValueError):
                raise UsageError(f"--step must be an integer, 'latest' or 'all', got {step!r}") from None
            steps = [d for d in steps if ob.step_number(d) == want]
        if not steps:
            findings.error("no-steps", f"no step {step} in this CheckpointManager root", file=".")
            return
    committed_any = False
    for d in sorted(steps, key=lambda d: (ob.step_number(d) or -1, d)):
        sub = storage.child(d)
        sub_dirs, sub_files = sub.listdir()
        if ob.is_tmp_name(d):
            # orbax ignores these beside committed steps; an error only when it is the step asked
            # for (not a leftover beside a finished save of the same number: orbax <= 0.9 named
            # each try anew, `2.orbax-checkpoint-tmp-<timestamp>`, and all_steps() lists `2`)
            asked = step not in (None, "all") and all(ob.is_tmp_name(x) for x in steps)
            report = findings.error if asked else findings.warning
            report("uncommitted-save", "interrupted save left a temporary step directory; orbax will not restore it", file=d + "/")
            continue
        ok = check_step(sub, d, sub_dirs, sub_files, findings, where=d + "/", parsed=parsed)
        committed_any = committed_any or ok
    # only where every step was looked at: one step asked for (--step N) and not committed already
    # has its own error (uncommitted-save, bad-metadata), and says nothing of the root's other steps
    if not committed_any and step in (None, "all"):
        findings.error("no-steps", "no committed step in this CheckpointManager root", file=".")


def check_step(
    storage: Storage, name: str, dirs: list[str], files: list[str], findings: Findings, *, where: str,
    parsed: dict[str, Any] | None = None,
) -> bool:
    """Check one step directory; True when it is committed. `parsed`: as check_opened's."""
    parsed = parsed or {}
    findings.count("steps")
    key = ob.parsed_key(storage, ob.CHECKPOINT_METADATA)
    meta = parsed.pop(key) if key in parsed else ob.read_step_metadata(storage, files)
    status = ob.commit_status(storage, name, files, meta)
    if isinstance(meta, CkptError):
        findings.error("bad-metadata", f"unreadable: {meta.message}", file=where + ob.CHECKPOINT_METADATA)
    elif meta is not None and not isinstance(meta, dict):
        findings.error("bad-metadata", "not a JSON object", file=where + ob.CHECKPOINT_METADATA)
    elif not status.committed:
        # each orbax version's own commit record is missing (see ob.commit_status)
        ending = "the save never finished" if ob.is_tmp_name(name) else "the save never committed"
        findings.error("uncommitted-save", f"{status.detail}: {ending}", file=where + status.file if status.file else where or name)
    if status.needs_marker:
        findings.warning(
            "no-commit-marker",
            f"committed (commit_timestamp_nsecs), but orbax restores from gs:// only with {ob.COMMIT_MARKER}; "
            "a save copied here from another filesystem needs it added",
            file=where + ob.COMMIT_MARKER,
        )
    committed = status.committed

    if ob.TREE_METADATA in files or ob.ROOT_MANIFEST in files or any(ob._PROCESS_DB.match(d) for d in dirs):
        check_item(storage, findings, where=where, parsed=parsed)
    else:
        found = ob.step_items(storage, dirs, meta)
        tmp_items = [d for d in dirs if ob.is_tmp_name(d)]
        for d in tmp_items:
            findings.error("uncommitted-save", "item directory with a temporary name: the save never finished", file=f"{where}{d}/")
        if not found and not tmp_items:
            findings.error("missing-metadata", f"no {ob.TREE_METADATA} and no items in this step", file=where or ".")
        for item in found:
            sub = storage.child(item.name)
            if item.kind == "json":
                _check_json_item(sub, item, findings, where=f"{where}{item.name}/")
            elif item.kind == "pytree" or item.handler_name in ob.PYTREE_HANDLERS:
                # a pytree handler's item without _METADATA: check_item says orbax cannot restore it
                check_item(sub, findings, where=f"{where}{item.name}/", parsed=parsed)
            elif not ob.is_tmp_name(item.name):
                # orbax restores it with its own handler; ckpt cannot say whether it would
                # (named by inspect's note; counted here, so that OK never claims it)
                findings.count("unchecked_items")
    return committed


def _check_json_item(storage: Storage, item: ob.StepItem, findings: Findings, *, where: str) -> None:
    """An item of orbax's JSON handlers: its file present and JSON (what the handler's load needs)."""
    findings.count("json_items")
    if item.file is None:
        findings.error(
            "missing-metadata",
            f"a JSON item ({item.handler_name}) with none of the files its handler loads ({', '.join(item.files)})",
            file=where,
        )
        return
    try:
        # its leaves, as inspect lists them (each a value)
        findings.count("values", len(ob.json_leaves(storage, item.file, (), item.name)))
    except CkptError as exc:
        findings.error("bad-metadata", f"JSON item unreadable: {exc.message}", file=where + item.file)


def check_item(storage: Storage, findings: Findings, *, where: str, parsed: dict[str, Any] | None = None) -> None:
    """Check one pytree item: tree metadata, arrays, chunks, OCDBT files, sharding. `parsed`: as
    check_opened's (the reader's parse of this item, where it opened it: ob.ItemParse)."""
    dirs, files = storage.listdir()
    if ob.TREE_METADATA not in files:
        findings.error("missing-metadata", f"no {ob.TREE_METADATA}: orbax cannot restore this item", file=where + ob.TREE_METADATA)
        return
    # (taken out of the checkpoint's records: what it holds is not needed after this)
    opened: ob.ItemParse | None = (parsed or {}).pop(ob.parsed_key(storage, ob.TREE_METADATA), None)
    try:
        tree = opened.tree if opened is not None else ob.parse_tree(ob.read_json(storage, ob.TREE_METADATA),
                                                                    where + ob.TREE_METADATA)
    except CkptError as exc:
        findings.error("bad-metadata", f"unreadable tree metadata: {exc.message}", file=where + ob.TREE_METADATA)
        return
    entries = tree.entries
    # counted as inspect counts the leaves: a scalar is a value there, though stored as a zarr array
    arrays = sum(v.value_type in ob.ZARR_TYPES and v.value_type != "scalar" for _, v in entries)
    findings.count("arrays", arrays)
    if len(entries) > arrays:
        findings.count("values", len(entries) - arrays)
    zarr3 = tree.use_zarr3
    process_dbs = sorted(d for d in dirs if ob._PROCESS_DB.match(d))
    use_ocdbt = tree.use_ocdbt if tree.use_ocdbt is not None else (ob.ROOT_MANIFEST in files or bool(process_dbs))
    fills_zeros = tree.store_array_data_equal_to_fill_value is None

    # 1. where arrays live, and every OCDBT data file that is referenced
    keys: set[str] = set()
    stored = [0]  # bytes of the OCDBT files the databases refer to (the most any array can hold)
    lost = ac.LostKeys()  # the arrays a lost OCDBT data file takes with it: named by its finding
    if use_ocdbt:
        databases: list[str]
        if ob.ROOT_MANIFEST in files:
            databases = [""]
        elif process_dbs:
            # an error, not a warning: validate's OK means orbax loads it, and
            # orbax's restore reads only the merged root
            findings.error(
                "unmerged-ocdbt",
                f"no root {ob.ROOT_MANIFEST}: {len(process_dbs)} per-process database(s) were never merged; "
                "orbax 0.12's restore reads only the merged root and fails on this "
                "(ckpt still reads the per-process data: `ckpt convert` makes a merged copy)",
                file=where + ob.ROOT_MANIFEST,
            )
            databases = process_dbs
        else:
            findings.error("lost-process-data", f"OCDBT item without {ob.ROOT_MANIFEST} or ocdbt.process_N/", file=where or ".")
            return
        for db in databases:
            keys |= ac.check_ocdbt(storage, db, findings, where=where, stored=stored, lost=lost)
        if databases == [""]:
            # per-process databases beside the merged root must be intact too
            for db in process_dbs:
                ac.check_ocdbt(storage, db, findings, where=where, list_keys=False)
    else:
        keys = set(storage.list())

    # 2. every leaf in the tree: metadata, shape agreement, chunk grid
    meta_key = "zarr.json" if zarr3 else ".zarray"
    declared = _array_metadatas(storage, files, dirs, findings, where)
    shardings: dict[str, Any] = {}
    bad_shardings: set[str] = set()
    if ob.SHARDING in files:
        bad: list[tuple[str, schema.SchemaError]] = []
        try:
            if opened is not None and opened.shardings is not None:
                shardings = opened.shardings  # (the reader's parse had no bad entry, or it would have raised)
            else:
                infos = schema.parse_sharding_file(ob.read_json(storage, ob.SHARDING), where + ob.SHARDING, bad)
                shardings = {n: ob.sharding_model(i) for n, i in infos.items()}
        except CkptError as exc:
            findings.error("bad-metadata", exc.message, file=where + ob.SHARDING)
            files = [f for f in files if f != ob.SHARDING]  # reported once, not once per array
        bad_shardings = {name for name, _ in bad}
        leaf_of = {ob._param_name(ks): keys_path(ks) for ks, _ in entries} if bad else {}
        for name, error in bad:
            # orbax's restore fails on this entry (its from_serialized_string raises)
            findings.error("bad-sharding", error.message, leaf=leaf_of.get(name, name), file=where + ob.SHARDING)
    elif any(v.value_type == "jax.Array" for _, v in entries):
        # orbax's restore without a target takes each jax.Array's sharding from this file
        n = sum(v.value_type == "jax.Array" for _, v in entries)
        findings.error(
            "bad-sharding",
            f"no {ob.SHARDING}: orbax's restore without target shardings fails for the {n} jax.Array leaves "
            "(restore them with target shardings, or as numpy arrays)",
            file=where + ob.SHARDING,
        )
    # every stored .zarray / zarr.json, read concurrently (one by one costs ~2 ms each)
    wanted = [
        ob._param_name(k) for k, v in entries
        if v.value_type in ob.ZARR_TYPES and f"{ob._param_name(k)}/{meta_key}" in keys
    ]
    # (those the reader parsed already are not read again)
    known = opened.zarr if opened is not None and opened.zarr is not None else {}
    unknown = [n for n in wanted if n not in known]
    zarr_texts = ac.read_array_metadata(storage, use_ocdbt, files, process_dbs, unknown, meta_key) if unknown else {}
    parsed_texts: dict[bytes, Any] = {}
    array_names = set()
    strings_leaves: list[tuple[str, str]] = []
    for leaf_keys, vmeta in entries:
        vt = vmeta.value_type
        name = ob._param_name(leaf_keys)
        leaf_path = keys_path(leaf_keys)
        if vt == "string":
            strings_leaves.append((name, leaf_path))
        if vt not in ob.ZARR_TYPES:
            continue
        array_names.add(name)
        lost_in = lost.file_of(name) if lost else None
        if lost_in is not None:
            # the lost file's one finding names this leaf (its index node or chunk values are gone)
            findings.file_problem("lost-process-data", "OCDBT data file lost", file=lost_in, leaf=leaf_path)
        if f"{name}/{meta_key}" not in keys:
            if lost_in is not None:
                continue
            has_chunks = any(k.startswith(name + "/") for k in keys)
            if has_chunks:
                findings.error("missing-metadata", f"{meta_key} missing (chunks are present)", leaf=leaf_path, file=f"{where}{name}/{meta_key}")
            else:
                findings.error("leaf-missing", f"in {ob.TREE_METADATA} but not stored: restore will fail", leaf=leaf_path, file=f"{where}{name}/")
            continue
        try:
            found = known.get(name)
            if found is None:
                text = zarr_texts.get(name)
                if text is None:
                    raise CkptError(f"{meta_key} listed but unreadable")
                if text not in parsed_texts:  # arrays of one shape and dtype share their metadata text
                    # the file named in a message is the first array's; the text is the same
                    zmeta_ = schema.load_json(text, f"{where}{name}/{meta_key}")
                    parsed_texts[text] = (zmeta_, ob.parse_zarr_metadata(zmeta_, zarr3, f"{where}{name}/{meta_key}"))
                found = parsed_texts[text]
            zmeta, (shape, _dtype, chunk_shape, _info) = found
        except CkptError as exc:
            message = exc.message if isinstance(exc, schema.SchemaError) else f"unreadable {meta_key}: {exc.message}"
            findings.error("bad-array-metadata", message, leaf=leaf_path, file=f"{where}{name}/{meta_key}")
            continue
        write_shape = vmeta.write_shape
        why = schema.shape_disagreement(shape, write_shape)
        if not why and vt == "jax.Array" and any(c > max(n, 1) for c, n in zip(chunk_shape, shape)):
            # each chunk of a jax.Array is (a part of) one device's shard, never
            # larger than the array (a zero-length dimension has chunks of 1):
            # a shrunken or zeroed dimension, which orbax would restore silently
            why = f"its chunks {list(chunk_shape)} are larger than the array"
        if why:
            findings.error(
                "bad-array-metadata", f"{meta_key} shape {list(shape)} disagrees with {ob.TREE_METADATA}: {why}",
                leaf=leaf_path, file=f"{where}{name}/{meta_key}",
            )
            continue
        if write_shape is not None and list(write_shape) != list(chunk_shape):
            findings.error(
                "bad-array-metadata",
                f"{meta_key} chunks {list(chunk_shape)} disagree with {ob.TREE_METADATA} write_shape {list(write_shape)}",
                leaf=leaf_path, file=f"{where}{name}/{meta_key}",
            )
        if name in declared:
            d_write, d_chunk = declared[name]
            why = schema.shape_disagreement(shape, d_write)
            if why:
                findings.error(
                    "bad-array-metadata", f"{meta_key} shape {list(shape)} disagrees with array_metadatas: {why}",
                    leaf=leaf_path, file=f"{where}{name}/{meta_key}",
                )
                continue
            if write_shape is not None and d_write is not None and list(write_shape) != list(d_write):
                findings.error(
                    "bad-array-metadata",
                    f"array_metadatas write_shape {list(d_write)} disagrees with {ob.TREE_METADATA} write_shape {list(write_shape)}",
                    leaf=leaf_path, file=f"{where}{name}/{meta_key}",
                )
            if d_chunk is not None and list(d_chunk) != list(chunk_shape):
                findings.error(
                    "bad-array-metadata",
                    f"{meta_key} chunks {list(chunk_shape)} disagree with array_metadatas chunk_shape {list(d_chunk)}",
                    leaf=leaf_path, file=f"{where}{name}/{meta_key}",
                )
        if name in shardings:
            ac.check_sharding(shardings[name], shape, findings, leaf_path, where + ob.SHARDING)
        elif ob.SHARDING in files and vt == "jax.Array" and name not in bad_shardings:
            # orbax reads each jax.Array's sharding from this file (a JSON pointer to its entry)
            findings.error("bad-sharding", f"no entry in {ob.SHARDING}: orbax cannot restore this array without a target sharding",
                           leaf=leaf_path, file=where + ob.SHARDING)
        # what the array's chunks hold on disk bounds what they can decode to
        if use_ocdbt:
            have = stored[0]
        else:
            # zarr v2 without compressor or filters stores every chunk whole and raw
            raw = (not zarr3 and isinstance(zmeta, dict) and zmeta.get("compressor") is None
                   and not zmeta.get("filters") and _dtype is not None)
            raw_size = math.prod(chunk_shape) * dtypes.get(_dtype).itemsize if raw else None
            have = ac.check_empty_chunk_files(storage, name, leaf_path, keys, meta_key, findings, where, raw_size=raw_size)
        if not ac.size_plausible(shape, _dtype, have, findings, leaf_path, f"{where}{name}/{meta_key}"):
            continue
        if lost_in is not None:
            continue  # its chunks are said lost already (a lost index node does not list them)
        ac.check_chunks(name, leaf_path, shape, chunk_shape, zarr3, zmeta, keys, fills_zeros, findings, where)

    if strings_leaves:
        _check_strings(storage, files, strings_leaves, findings, where)

    # 3. stored arrays nobody declared
    stored_arrays = {k.split("/", 1)[0] for k in keys if k.endswith("/" + meta_key)}
    for name in sorted(stored_arrays - array_names):
        findings.warning("leaf-missing", f"array stored but not in {ob.TREE_METADATA}: orbax will ignore it", file=f"{where}{name}/")
    for name in sorted(set(shardings) - array_names):
        findings.warning("bad-sharding", f"{ob.SHARDING} names an array that is not in the tree", leaf=name, file=where + ob.SHARDING)


def _array_metadatas(storage: Storage, files: list[str], dirs: list[str], findings: Findings, where: str) -> dict[str, tuple[Any, Any]]:
    out: dict[str, tuple[Any, Any]] = {}
    if "array_metadatas" not in dirs:
        return out
    for key in storage.list("array_metadatas"):
        try:
            out.update(schema.parse_array_metadatas(ob.read_json(storage, key), where + key))
        except CkptError as exc:
            findings.error("bad-metadata", f"unreadable array metadata: {exc.message}", file=where + key)
    return out


def _check_strings(storage: Storage, files: list[str], leaves: list[tuple[str, str]], findings: Findings, where: str) -> None:
    """String leaves live in `_strings.json`: present, of strings, naming every one."""
    file = where + ob.STRINGS
    if ob.STRINGS not in files:
        for _name, leaf in leaves:
            findings.error("leaf-missing", f"a string leaf, but there is no {ob.STRINGS}", leaf=leaf, file=file)
        return
    try:
        values = schema.parse_strings(ob.read_json(storage, ob.STRINGS), file)
    except CkptError as exc:
        findings.error("bad-metadata", exc.message, file=file)
        return
    for name, leaf in leaves:
        if name not in values:
            findings.error("leaf-missing", f"string leaf not in {ob.STRINGS}", leaf=leaf, file=file)



"""The Orbax half of the validation contract, with orbax itself as the oracle.

A seeded corpus of mutants of every Orbax JSON metadata file (built from the
committed fixtures, copied to tmp): for each one `ckpt validate --deep` must
answer with findings, never an internal error, and wherever it says OK,
orbax's own restore with no target (PyTreeCheckpointer on 8 CPU devices, in
one subprocess: this file run as a script) must succeed with the values ckpt
reads. The cases the adversarial run of issue 14 found are explicit tests.
"""
from __future__ import annotations

import base64
import copy
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import pytest
import tensorstore as ts

import ckpt_tool
from ckpt_tool.base.errors import CkptError
from ckpt_tool.base.findings import MAX_PER_LEAF, Findings
from ckpt_tool.machinery.arrays import schema
from ckpt_tool.ops.validate import validate_checkpoint
from conftest import FIXTURES

SEED = int(os.environ.get("CKPT_SCHEMA_SEED", "14"))
PER_KIND = int(os.environ.get("CKPT_SCHEMA_PER_KIND", "24"))  # mutants sampled per (fixture, file); the named cases come on top
KERNEL = "params.dense.kernel"
KERNEL_B64 = base64.urlsafe_b64encode(KERNEL.encode()).decode()

# (fixture, file, where it is stored): "file" = a file in the checkpoint
# directory, "ocdbt" = a key inside the item's OCDBT database
KINDS = [
    ("orbax_plain_zarr2", "_CHECKPOINT_METADATA", "file"),
    ("orbax_plain_zarr2", "_METADATA", "file"),
    ("orbax_plain_zarr2", "_sharding", "file"),
    ("orbax_plain_zarr2", "array_metadatas/process_0", "file"),
    ("orbax_plain_zarr2", f"{KERNEL}/.zarray", "file"),
    ("orbax_plain_zarr2", "_strings.json", "file"),
    ("orbax_ocdbt_zarr2", f"{KERNEL}/.zarray", "ocdbt"),
    ("orbax_ocdbt_zarr2", "_sharding", "file"),
    ("orbax_ocdbt_zarr3", f"{KERNEL}/zarr.json", "ocdbt"),
    ("orbax_ocdbt_zarr3", "_METADATA", "file"),
]
# kinds checked for internal errors only (no single-item restore to compare with)
VALIDATE_ONLY = [
    ("orbax_manager", "metadata/_ROOT_METADATA", "file"),
    ("orbax_manager", "1/config/metadata", "file"),
    ("orbax_manager", "1/_CHECKPOINT_METADATA", "file"),
]
WRONG_VALUES: list[Any] = ["x", -1, 0, 2**64, None, [], {}, True, 1.5, [[[[]]]], "NaN"]


# -- the mutants ---------------------------------------------------------------


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        out.append(prefix + (k,))
        out += _paths(v, prefix + (k,))
    return out


def _parent(doc: Any, path: tuple) -> Any:
    for k in path[:-1]:
        doc = doc[k]
    return doc


def _mutations(doc: Any) -> list[tuple]:
    out = []
    for p in _paths(doc):
        parent = _parent(doc, p)
        if isinstance(parent, dict):
            out.append(("delete", p))
            out.append(("rename", p, p[-1][:-1] + p[-1][-1:] * 2 if p[-1] else "_"))
        for w in WRONG_VALUES:
            out.append(("set", p, w))
        value = parent[p[-1]]
        # plausible damage of the right type: the kind a validator is most likely to wave through
        if isinstance(value, int) and not isinstance(value, bool):
            out += [("set", p, value + 1), ("set", p, value * 2), ("set", p, value - 1)]
        elif isinstance(value, list) and value:
            out += [("set", p, value[:-1]), ("set", p, value + value[-1:])]
        elif isinstance(value, bool):
            out.append(("set", p, not value))
    return out


def _apply(doc: Any, m: tuple) -> Any:
    doc = copy.deepcopy(doc)
    parent = _parent(doc, m[1])
    key = m[1][-1]
    if m[0] == "delete":
        del parent[key]
    elif m[0] == "rename":
        parent[m[2]] = parent.pop(key)
    else:
        parent[key] = m[2]
    return doc


def _load(fixture: str, rel: str, stored: str) -> Any:
    if stored == "ocdbt":
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{FIXTURES / fixture}/"}).result()
        data = kv.read(rel).result().value
    else:
        data = (FIXTURES / fixture / rel).read_bytes()
    doc = json.loads(data)
    if rel.endswith("_sharding"):
        # the values are JSON strings: mutate what they hold (one entry, the kernel's)
        doc[KERNEL_B64] = json.loads(doc[KERNEL_B64])
    return doc


def _dump(rel: str, doc: Any) -> bytes:
    if rel.endswith("_sharding") and isinstance(doc, dict) and isinstance(doc.get(KERNEL_B64), dict):
        doc = dict(doc, **{KERNEL_B64: json.dumps(doc[KERNEL_B64])})
    return json.dumps(doc).encode()


def _write(path: Path, rel: str, stored: str, data: bytes) -> None:
    if stored == "ocdbt":
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
        kv.write(rel, data).result()
    else:
        (path / rel).write_bytes(data)


def _make(tmp: Path, fixture: str, rel: str, stored: str, data: bytes, tag: str) -> Path:
    path = tmp / f"{fixture}-{tag}"
    shutil.copytree(FIXTURES / fixture, path, symlinks=True)
    _write(path, rel, stored, data)
    return path


def corpus(tmp: Path, kinds: list[tuple[str, str, str]]) -> list[tuple[Path, str]]:
    """(mutant directory, what was changed), a seeded sample per kind."""
    rng = random.Random(SEED)
    out = []
    for fixture, rel, stored in kinds:
        doc = _load(fixture, rel, stored)
        muts = _mutations(doc)
        for i, m in enumerate(rng.sample(muts, min(PER_KIND, len(muts)))):
            path = _make(tmp, fixture, rel, stored, _dump(rel, _apply(doc, m)), f"{rel.replace('/', '_')}-{i}")
            out.append((path, f"{fixture}/{rel}: {m[0]} {m[1]!r}{' = ' + repr(m[2]) if len(m) > 2 else ''}"))
        # the whole file: a byte order mark before it, and the file gone
        path = _make(tmp, fixture, rel, stored, b"\xef\xbb\xbf" + _dump(rel, doc), f"{rel.replace('/', '_')}-bom")
        out.append((path, f"{fixture}/{rel}: a UTF-8 BOM"))
        if stored == "file":
            path = tmp / f"{fixture}-{rel.replace('/', '_')}-removed"
            shutil.copytree(FIXTURES / fixture, path, symlinks=True)
            (path / rel).unlink()
            out.append((path, f"{fixture}/{rel}: removed"))
    return out


# -- ckpt and the oracle ---------------------------------------------------------------


def _validate(path: Path):
    """validate --deep through the Python API: any exception but a finding is an internal error."""
    return validate_checkpoint(str(path), deep=True)


def _inspect(path: Path) -> None:
    """What inspect reads (metadata only): a CkptError (one line) or a checkpoint, nothing else."""
    try:
        ckpt_tool.open(str(path))
    except CkptError:
        pass


def _oracle(paths: list[Path]) -> list[dict]:
    """orbax's restore vs ckpt's values for each path, in one subprocess (jax on 8 CPU devices)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("CKPT_DEBUG", None)
    r = subprocess.run(
        [sys.executable, __file__, *map(str, paths)], capture_output=True, text=True, env=env, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


# -- the contract ---------------------------------------------------------------------


def _restorable_on_8_devices(path) -> bool:
    """Whether every recorded mesh uses device ids 0..7 only: a restore without
    target shardings needs the saving topology, and the oracle has 8 CPU devices
    (a mutant with other ids is valid, just not restorable here)."""
    ck = ckpt_tool.open(str(path))
    return all(
        set(leaf.sharding.device_ids) <= set(range(8))
        for leaf in ck.arrays() if leaf.sharding is not None and leaf.sharding.device_ids
    )


@pytest.mark.slow
def test_mutants_never_internal_error_and_ok_means_orbax_restores(tmp_path):
    mutants = corpus(tmp_path, KINDS)
    passed = []
    for path, what in mutants:
        report = _validate(path)  # raises on an internal error: the test fails naming it
        assert report.format == "orbax", what
        _inspect(path)
        if report.ok() and _restorable_on_8_devices(path):
            passed.append((path, what))
    rejected = len(mutants) - len(passed)
    assert rejected > len(mutants) // 3, "the corpus should hold mostly damaged files"
    results = _oracle([p for p, _ in passed])
    assert len(results) == len(passed)
    bad = [
        f"{what}: {res['lib_error'] or res['ckpt_error'] or res['mismatch']}"
        for (path, what), res in zip(passed, results)
        if res["lib_error"] or res["ckpt_error"] or res["mismatch"]
    ]
    print(f"{len(mutants)} mutants, {len(passed)} validate OK and were restored by orbax")
    assert not bad, f"{len(bad)} of {len(passed)} mutants validate OK but orbax or ckpt disagree:\n" + "\n".join(bad)


@pytest.mark.slow
def test_validate_only_mutants_never_internal_error(tmp_path):
    for path, what in corpus(tmp_path, VALIDATE_ONLY):
        validate_checkpoint(str(path), deep=True)  # no exception: findings only
        _inspect(path)


# -- the named cases of issue 14 -------------------------------------------------------


def _mutate_file(copy_fixture, fixture: str, rel: str, change, stored: str = "file") -> Path:
    path = copy_fixture(fixture)
    doc = _load(fixture, rel, stored)
    change(doc)
    _write(path, rel, stored, _dump(rel, doc))
    return path


def _errors(path: Path) -> list[tuple[str, str | None, str | None, str]]:
    report = validate_checkpoint(str(path), deep=True)
    return [(f.code, f.leaf, f.file, f.message) for f in report.findings if f.severity == "error"]


def test_partition_spec_typo_in_sharding(copy_fixture):
    def change(doc):
        doc[KERNEL_B64]["parttition_spec"] = doc[KERNEL_B64].pop("partition_spec")

    errs = _errors(_mutate_file(copy_fixture, "orbax_plain_zarr2", "_sharding", change))
    assert [(c, leaf, f) for c, leaf, f, _ in errs] == [("bad-sharding", "params/dense/kernel", "_sharding")]
    assert "lacks partition_spec" in errs[0][3] and KERNEL in errs[0][3]


def test_zarr_format_minus_one(copy_fixture):
    path = _mutate_file(copy_fixture, "orbax_ocdbt_zarr2", f"{KERNEL}/.zarray", lambda d: d.update(zarr_format=-1), "ocdbt")
    [(code, leaf, file, msg)] = _errors(path)
    assert (code, leaf, file) == ("bad-array-metadata", "params/dense/kernel", f"{KERNEL}/.zarray")
    assert "zarr_format: must be 2, got -1" in msg


def test_unknown_key_type(copy_fixture):
    def change(doc):
        doc["tree_metadata"]["('params', 'dense', 'kernel')"]["key_metadata"][0]["key_type"] = 7

    [(code, _leaf, file, msg)] = _errors(_mutate_file(copy_fixture, "orbax_ocdbt_zarr2", "_METADATA", change))
    assert (code, file) == ("bad-metadata", "_METADATA")
    assert "key_type 7 is not a KeyType" in msg and "('params', 'dense', 'kernel')" in msg


def test_chunk_shape_missing_from_array_metadatas(copy_fixture):
    def change(doc):
        del doc["array_metadatas"][0]["array_metadata"]["chunk_shape"]

    [(code, _leaf, file, msg)] = _errors(_mutate_file(copy_fixture, "orbax_ocdbt_zarr2", "array_metadatas/process_0", change))
    assert (code, file) == ("bad-metadata", "array_metadatas/process_0")
    assert "lacks chunk_shape" in msg


def test_zero_dimension_that_disagrees(copy_fixture):
    # orbax restores this silently as a (16, 0) array
    path = _mutate_file(copy_fixture, "orbax_plain_zarr2", f"{KERNEL}/.zarray", lambda d: d.update(shape=[16, 0]))
    [(code, leaf, file, msg)] = _errors(path)
    assert (code, leaf, file) == ("bad-array-metadata", "params/dense/kernel", f"{KERNEL}/.zarray")
    assert "dimension 1" in msg and "write_shape" not in msg or "disagrees" in msg


def test_zero_dimension_without_write_shape(copy_fixture, tmp_path):
    # orbax 0.9 wrote no write_shape and no array_metadatas: the zero-size jax.Array itself gives it away
    src = FIXTURES / "orbax_v0_9" / "standard"
    path = tmp_path / "standard"
    shutil.copytree(src, path)
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
    zmeta = json.loads(kv.read("layers.0/.zarray").result().value)
    zmeta["shape"][-1] = 0
    kv.write("layers.0/.zarray", json.dumps(zmeta)).result()
    errs = _errors(path)
    assert [(c, leaf) for c, leaf, _, _ in errs] == [("bad-array-metadata", "layers/0")], errs
    assert "larger than the array" in errs[0][3]


def test_no_sharding_file_for_jax_arrays(copy_fixture):
    # orbax: "Sharding of jax.Array cannot be None" on a restore without target shardings
    path = copy_fixture("orbax_plain_zarr2")
    (path / "_sharding").unlink()
    assert [(c, f) for c, _, f, _ in _errors(path)] == [("bad-sharding", "_sharding")]


def test_byte_order_mark_is_refused(copy_fixture):
    path = copy_fixture("orbax_ocdbt_zarr2")
    p = path / "array_metadatas" / "process_0"
    p.write_bytes(b"\xef\xbb\xbf" + p.read_bytes())
    [(code, _leaf, file, msg)] = _errors(path)
    assert (code, file) == ("bad-metadata", "array_metadatas/process_0") and "byte order mark" in msg


def test_deep_nesting_is_a_finding(copy_fixture):
    path = copy_fixture("orbax_plain_zarr2")
    (path / "_METADATA").write_text("[" * 100_000 + "]" * 100_000)
    [(code, _leaf, file, msg)] = _errors(path)
    assert (code, file) == ("bad-metadata", "_METADATA") and "nested" in msg


def test_wrong_typed_dimension_separator(copy_fixture):
    path = _mutate_file(copy_fixture, "orbax_plain_zarr2", f"{KERNEL}/.zarray", lambda d: d.update(dimension_separator=[1]))
    [(code, _leaf, _file, msg)] = _errors(path)
    assert code == "bad-array-metadata" and "dimension_separator" in msg


@pytest.mark.parametrize("stamp", [2**70, -5, "soon", 1.5e30])
def test_commit_timestamp_out_of_range_or_wrong_type(copy_fixture, stamp):
    path = _mutate_file(copy_fixture, "orbax_plain_zarr2", "_CHECKPOINT_METADATA", lambda d: d.update(commit_timestamp_nsecs=stamp))
    errs = _errors(path)
    assert [(c, f) for c, _, f, _ in errs] == [("bad-metadata", "_CHECKPOINT_METADATA")]
    assert "commit_timestamp_nsecs" in errs[0][3]


@pytest.mark.parametrize("mesh", [7, {"id": "x"}, [[{"id": 0}], [{"id": 1}, {"id": 2}]], [[0, 1]], "mesh"])
def test_wrong_sharding_mesh(copy_fixture, mesh):
    path = _mutate_file(copy_fixture, "orbax_plain_zarr2", "_sharding", lambda d: d[KERNEL_B64]["device_mesh"].update(mesh=mesh))
    errs = _errors(path)
    assert errs and all(c == "bad-sharding" and leaf == "params/dense/kernel" for c, leaf, _, _ in errs), errs


def test_huge_claimed_shape_refused_before_allocating(copy_fixture):
    path = _mutate_file(copy_fixture, "orbax_plain_zarr2", f"{KERNEL}/.zarray",
                        lambda d: d.update(shape=[2**62, 2**62], chunks=[4, 4]))
    errs = _errors(path)
    assert len(errs) <= 3 and errs[0][0] == "bad-array-metadata" and "elements" in errs[0][3], errs


@pytest.mark.parametrize("fixture,stored", [("orbax_plain_zarr2", "file"), ("orbax_ocdbt_zarr2", "ocdbt")])
def test_8tb_claim_is_refused_at_shallow_validate_and_deep_stays_bounded(copy_fixture, fixture, stored):
    import time

    # 2^21 x 2^20 float32 = 8 TiB (in 2^17 chunks of 64 MiB) in a checkpoint of a few KB
    path = _mutate_file(copy_fixture, fixture, f"{KERNEL}/.zarray",
                        lambda d: d.update(shape=[2**21, 2**20], chunks=[2**12, 2**12]), stored)
    shallow = [(f.code, f.leaf) for f in validate_checkpoint(str(path)).findings if f.severity == "error"]
    assert ("bad-array-metadata", "params/dense/kernel") in shallow
    t0 = time.monotonic()
    deep = validate_checkpoint(str(path), deep=True)
    assert time.monotonic() - t0 < 10
    kernel = [f for f in deep.findings if f.leaf == "params/dense/kernel"]
    assert len(kernel) <= 3 and any("claims" in f.message for f in kernel), kernel


def test_chunk_grid_past_any_writer_is_refused_by_every_command(copy_fixture, capsys):
    from ckpt_tool.cli.main import _run

    # 2^37 chunks of 4x4: convert would otherwise walk the grid for minutes
    path = _mutate_file(copy_fixture, "orbax_plain_zarr2", f"{KERNEL}/.zarray", lambda d: d.update(shape=[2**21, 2**20], chunks=[4, 4]))
    for argv in (["inspect", str(path)], ["convert", str(path), str(path) + "-out", "--to", "dcp"]):
        assert _run(argv) == 1
        err = capsys.readouterr().err.strip()
        assert "137,438,953,472 chunks" in err and ".zarray" in err and len(err.splitlines()) == 1, err
    assert [c for c, _, _, _ in _errors(path)] == ["bad-array-metadata"]


def test_cli_lines_name_file_and_field(copy_fixture, capsys):
    from ckpt_tool.cli.main import _run

    path = _mutate_file(copy_fixture, "orbax_ocdbt_zarr2", f"{KERNEL}/.zarray", lambda d: d.update(order="Z"), "ocdbt")
    for argv in (["inspect", str(path)], ["validate", "--deep", str(path)], ["convert", str(path), str(path) + "-out", "--to", "dcp"]):
        code = _run(argv)
        err = capsys.readouterr().err
        assert code == 1, (argv, err)
        assert "internal error" not in err and "Traceback" not in err
    # inspect's one line names the file and the field
    _run(["inspect", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ".zarray" in err[0] and "order" in err[0], err
    assert not os.path.exists(str(path) + "-out")


# -- the bounded JSON reader and the finding cap --------------------------------------


def test_load_json_bounds():
    assert schema.json_depth(b'{"a": "[[[[", "b": [[1]]}') == 3
    with pytest.raises(schema.SchemaError, match="nested"):
        schema.load_json(b"[" * 200 + b"]" * 200, "f")
    with pytest.raises(schema.SchemaError, match="more than"):
        schema.load_json(b"[" + b"1," * 100 + b"1]", "f", max_bytes=50)
    with pytest.raises(schema.SchemaError, match="invalid JSON"):
        schema.load_json(b"{", "f")


def _depth_by_hand(text: str) -> int:
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def test_json_depth_skips_brackets_in_strings_whatever_their_escapes():
    """json_depth (C passes over the bytes, no numpy) against a scan by hand, on JSON texts whose
    strings hold brackets, quotes and runs of backslashes."""
    rng = random.Random(46)
    pieces = ["[", "]", "{", "}", '"', "\\", "a", "\\\\", '\\"']

    def value(level: int):
        kind = rng.randrange(4 if level < 6 else 1)
        if kind == 0:
            return "".join(rng.choice(pieces) for _ in range(rng.randrange(8)))
        if kind == 1:
            return [value(level + 1) for _ in range(rng.randrange(3))]
        if kind == 2:
            return {f"k{i}": value(level + 1) for i in range(rng.randrange(3))}
        return rng.randrange(100)

    for _ in range(3000):
        text = json.dumps(value(0))
        assert schema.json_depth(text.encode()) == _depth_by_hand(text), text


def test_findings_capped_per_leaf_and_counted():
    f = Findings()
    for i in range(MAX_PER_LEAF + 129_876):
        f.error("missing-chunk", f"chunk {i}", leaf="w")
    f.error("missing-chunk", "other leaf", leaf="b")
    f.error("bad-chunk", "another code", leaf="w")
    assert len(f.items) == MAX_PER_LEAF + 3
    summary = f.items[MAX_PER_LEAF]
    assert summary.code == "missing-chunk" and summary.leaf == "w" and "and 129,876 more" in summary.message


# -- the oracle worker: `python tests/formats/orbax/test_orbax_schema.py PATH...` ------------------------


def _same(a: Any, b: Any) -> bool:
    import numpy as np

    if isinstance(a, (str, bytes)) or isinstance(b, (str, bytes)):
        return type(a) is type(b) and a == b
    x, y = np.asarray(a), np.asarray(b)
    if x.shape != y.shape:
        return False
    if x.dtype == y.dtype:
        return x.tobytes() == y.tobytes()  # bit-exact, NaN-safe
    return bool(np.array_equal(x.astype("float64"), y.astype("float64"), equal_nan=True))


def _worker(paths: list[str]) -> None:
    import logging

    import jax

    jax.config.update("jax_enable_x64", True)  # int64 leaves restore as int64, as ckpt reads them
    import numpy as np
    import orbax.checkpoint as ocp

    import ckpt_tool
    from library_reference import _flatten

    logging.disable(logging.CRITICAL)
    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter must not corrupt the answers
    for path in paths:
        res: dict[str, Any] = {"lib_error": None, "ckpt_error": None, "mismatch": None}
        lib = ours = None
        try:
            with ocp.PyTreeCheckpointer() as ckptr:
                lib = {k: (np.asarray(v) if hasattr(v, "addressable_shards") else v)
                       for k, v in _flatten(ckptr.restore(os.path.abspath(path))).items()}
        except BaseException as exc:  # noqa: BLE001 - orbax's rejection is the answer
            res["lib_error"] = f"orbax: {type(exc).__name__}: {str(exc)[:300]}"
        try:
            ours = {tuple(leaf.keys): leaf.read() if leaf.kind == "array" else leaf.load()
                    for leaf in ckpt_tool.open(path).leaves}
        except BaseException as exc:  # noqa: BLE001
            res["ckpt_error"] = f"ckpt: {type(exc).__name__}: {str(exc)[:300]}"
        if lib is not None and ours is not None:
            if set(lib) != set(ours):
                res["mismatch"] = f"key sets differ: {sorted(map(str, set(lib) ^ set(ours)))[:4]}"
            else:
                for k in lib:
                    if not _same(lib[k], ours[k]):
                        res["mismatch"] = f"{k}: orbax {getattr(lib[k], 'shape', lib[k])!r} != ckpt {getattr(ours[k], 'shape', ours[k])!r}"
                        break
        out.write(json.dumps(res) + "\n")
        out.flush()


if __name__ == "__main__":
    _worker(sys.argv[1:])

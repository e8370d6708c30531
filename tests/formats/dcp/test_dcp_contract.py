"""The DCP half of the validation contract, with torch as the oracle.

Whatever `ckpt validate` (shallow or --deep) passes, torch must load:
`dcp_to_torch_save` + `torch.load(weights_only=True)` succeed and hold the
values ckpt reads (and `dcp.load` into a state dict shaped like ckpt's reads
agrees). Checked on a seeded mutant corpus built from the committed DCP
fixtures (copied to tmp; the fixtures are never touched):

  * bit flips in every zip structure torch's reader parses in the .distcp
    archives (local headers, central directory, zip64 end records, end of
    central directory, data descriptors) and in the small records it reads
    (data.pkl, version, byteorder, .storage_alignment, .format_version,
    .data/serialization_id), tensor and non-tensor items alike;
  * truncated data files, and bit flips anywhere in data files and `.metadata`;
  * structured `.metadata` mutations: the genuine pickle is loaded with
    torch, one field is changed, and it is pickled again.

For every mutant neither validate gives an internal error, and where one
exits 0 torch loads it with ckpt's values. The named cases of issue 14 are
explicit tests: a `.metadata` of None (also `--format github`), zero-length
entries, the 12-byte memo bomb, and the 2**62 x 2**62 / 8 TB shape claims.
"""
from __future__ import annotations

import copy
import io
import os
import pickle
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402 - a BaseException

from ckpt_tool.base.errors import CkptError  # noqa: E402
from ckpt_tool.ops.validate import validate_checkpoint  # noqa: E402

HERE = Path(__file__).resolve().parents[2]
FIXTURES = HERE.parent / "fixtures"
sys.path.insert(0, str(HERE))
from library_reference import _dcp_keymap, _tensor_to_numpy  # noqa: E402

CKPT = [sys.executable, "-m", "ckpt_tool"]
SEED = 1414
# the fixtures the corpus is built from: the first two in full, the newer
# ones (views, kept duplicates, zstd) with a sample of their mutants
FULL = ("dcp_single", "dcp_multirank")
SAMPLED = ("dcp_conj", "dcp_dups", "dcp_zstd", "dcp_fsdp2_adam")


# ---------------------------------------------------------------------------
# the oracle
# ---------------------------------------------------------------------------
def torch_values(path: Path) -> dict[tuple, Any]:
    """{key path: value} as torch gives them: dcp_to_torch_save, then torch.load(weights_only=True)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)  # only mutants ckpt passed get here: its allow-list read this pickle
    out_file = path.parent / f"{path.name}.pt"
    try:
        dcp_to_torch_save(os.fspath(path), os.fspath(out_file))
        sd = torch.load(out_file, weights_only=True)
    finally:
        out_file.unlink(missing_ok=True)
    out = {}
    for fqn, kp in _dcp_keymap(md).items():
        obj = sd[fqn] if kp == (fqn,) and fqn in sd else _follow(sd, kp)
        out[fqn] = _tensor_to_numpy(obj) if isinstance(obj, torch.Tensor) else obj
    return out


def _follow(obj: Any, keys: tuple) -> Any:
    for k in keys:
        obj = obj[k]
    return obj


def dcp_load_values(path: Path, ours: dict[tuple, Any]) -> dict[tuple, Any]:
    """`dcp.load` into a flat state dict shaped like ckpt's reads (tensors preallocated, values as placeholders)."""
    import torch.distributed.checkpoint as dcp

    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    sd: dict[str, Any] = {}
    for fqn, item in md.state_dict_metadata.items():
        sd[fqn] = torch.empty(tuple(item.size), dtype=item.properties.dtype) if hasattr(item, "chunks") else None
    dcp.load(sd, storage_reader=dcp.FileSystemReader(os.fspath(path)), planner=dcp.DefaultLoadPlanner(
        flatten_state_dict=False, flatten_sharded_tensors=False))
    return {fqn: (_tensor_to_numpy(v) if isinstance(v, torch.Tensor) else v) for fqn, v in sd.items()}


def ckpt_values(path: Path) -> dict[tuple, Any]:
    import ckpt_tool

    from ckpt_tool.core.model import ArrayLeaf

    out = {}
    for leaf in ckpt_tool.open(os.fspath(path)).leaves:
        out[leaf.name] = leaf.read() if isinstance(leaf, ArrayLeaf) else leaf.load()
    return out


def same(a: Any, b: Any) -> bool:
    """Equal values; arrays bit for bit (NaN-safe), with their shape and dtype."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        x, y = np.asarray(a), np.asarray(b)
        return x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes()
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def run_validate(path: Path, deep: bool) -> tuple[bool, list[str]]:
    """(passed, error lines) from validate in-process; anything but a CkptError is an internal error."""
    try:
        report = validate_checkpoint(os.fspath(path), deep=deep, workers=2)
    except CkptError as exc:  # one line, exit 1 (e.g. the directory is no longer a checkpoint)
        return False, [str(exc)]
    errors = [f"{f.code}: {f.message}" for f in report.findings if f.severity == "error"]
    return not errors, errors


def check_contract(path: Path, label: str) -> str:
    """Validate both ways; where one passes, torch must load ckpt's values. Returns 'pass' or 'fail'."""
    shallow_ok, _ = run_validate(path, deep=False)
    deep_ok, deep_errors = run_validate(path, deep=True)
    assert not (deep_ok and not shallow_ok), f"{label}: --deep passed what shallow validate failed"
    if not deep_ok:
        return "fail"
    ours = ckpt_values(path)
    try:
        theirs = torch_values(path)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the point: torch refusing what validate passed
        pytest.fail(f"{label}: validate --deep passed but torch cannot load it: {type(exc).__name__}: {exc}")
    assert theirs.keys() == ours.keys(), f"{label}: key sets differ"
    for k in ours:
        assert same(theirs[k], ours[k]), f"{label}: {k}: torch {theirs[k]!r} != ckpt {ours[k]!r}"
    return "pass"


# ---------------------------------------------------------------------------
# the corpus
# ---------------------------------------------------------------------------
def copy_fixture(name: str, tmp: Path, label: str) -> Path:
    dst = tmp / label
    shutil.copytree(FIXTURES / name, dst)
    return dst


def _metadata(root: Path) -> Any:
    with open(root / ".metadata", "rb") as f:
        return pickle.load(f)  # a committed fixture written by torch


def zip_structure(archive: bytes) -> list[tuple[str, int, int]]:
    """(what, start, end) of every structure torch's reader parses in one torch.save archive."""
    out: list[tuple[str, int, int]] = []
    eocd = archive.rindex(b"PK\x05\x06")
    out.append(("eocd", eocd, eocd + 22))
    loc = archive.rfind(b"PK\x06\x07", 0, eocd)
    if loc >= 0:
        out.append(("zip64-locator", loc, loc + 20))
        rec = struct.unpack_from("<Q", archive, loc + 8)[0]
        out.append(("zip64-eocd", rec, rec + 56))
    zf = zipfile.ZipFile(io.BytesIO(archive))
    cd_offset = zf.start_dir
    pos = cd_offset
    for info in zf.infolist():
        name = info.filename.split("/", 1)[-1]
        n_len, e_len, c_len = struct.unpack_from("<HHH", archive, pos + 28)
        out.append((f"central[{name}]", pos, pos + 46 + n_len + e_len + c_len))
        pos += 46 + n_len + e_len + c_len
        h = info.header_offset
        ln, le = struct.unpack_from("<HH", archive, h + 26)
        out.append((f"local[{name}]", h, h + 30 + ln + le))
        data_start = h + 30 + ln + le
        if not name.startswith("data/"):
            out.append((f"record[{name}]", data_start, data_start + info.file_size))
        if info.flag_bits & 0x08:
            out.append((f"descriptor[{name}]", data_start + info.file_size, data_start + info.file_size + 16))
    return out


def flip(path: Path, pos: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ (1 << bit)]))


def archive_mutants(name: str, rng: random.Random, per_structure: int) -> list[tuple[str, Callable[[Path], None]]]:
    """Bit flips in the zip structures of every (untransformed) entry's archive, labelled."""
    root = FIXTURES / name
    md = _metadata(root)
    out = []
    for index, info in md.storage_data.items():
        if info.transform_descriptors:
            continue  # a zstd frame: its bytes are not the archive's
        with open(root / info.relative_path, "rb") as f:
            f.seek(info.offset)
            archive = f.read(info.length)
        kind = "tensor" if index.offset is not None else "bytes"
        for what, start, end in zip_structure(archive):
            for _ in range(per_structure):
                pos = info.offset + rng.randrange(start, end)
                bit = rng.randrange(8)
                label = f"{name}/{info.relative_path}@{pos}.{bit} {kind} {index.fqn} {what}"
                out.append((label, lambda p, f=info.relative_path, pos=pos, bit=bit: flip(p / f, pos, bit)))
    return out


def truncation_mutants(name: str, rng: random.Random, n: int) -> list[tuple[str, Callable[[Path], None]]]:
    out = []
    for data_file in sorted((FIXTURES / name).glob("*.distcp")):
        size = data_file.stat().st_size
        for cut in sorted({0, size - 1, *(rng.randrange(size) for _ in range(n))}):
            def mutate(p: Path, f=data_file.name, cut=cut) -> None:
                os.truncate(p / f, cut)
            out.append((f"{name}/{data_file.name} truncated to {cut}", mutate))
    return out


def anywhere_mutants(name: str, rng: random.Random, per_file: int) -> list[tuple[str, Callable[[Path], None]]]:
    """Bit flips at random places of every data file and of `.metadata` (pickle opcodes, strings, tensor bytes)."""
    out = []
    root = FIXTURES / name
    for f in [*sorted(root.glob("*.distcp")), root / ".metadata"]:
        size = f.stat().st_size
        for _ in range(per_file):
            pos, bit = rng.randrange(size), rng.randrange(8)
            out.append((f"{name}/{f.name}@{pos}.{bit} anywhere", lambda p, f=f.name, pos=pos, bit=bit: flip(p / f, pos, bit)))
    return out


def _write_metadata(root: Path, md: Any) -> None:
    with open(root / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _first(md: Any, kind: str) -> str:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    cls = TensorStorageMetadata if kind == "tensor" else BytesStorageMetadata
    return next(fqn for fqn, item in md.state_dict_metadata.items() if isinstance(item, cls))


def _entry_key(md: Any, fqn: str, chunk: int = 0) -> Any:
    item = md.state_dict_metadata[fqn]
    offset = item.chunks[chunk].offsets if hasattr(item, "chunks") else None
    return next(k for k in md.storage_data if k.fqn == fqn and (k.offset == offset))


def metadata_mutations() -> list[tuple[str, Callable[[Any], Any]]]:
    """(label, edit) pairs: each edit changes one field of a torch-loaded Metadata (or replaces it)."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, ChunkStorageMetadata, TensorProperties, TensorStorageMetadata,
    )

    def on_tensor(edit: Callable[[Any, str], None]) -> Callable[[Any], Any]:
        def run(md: Any) -> Any:
            edit(md, _first(md, "tensor"))
            return md
        return run

    def on_bytes(edit: Callable[[Any, str], None]) -> Callable[[Any], Any]:
        def run(md: Any) -> Any:
            edit(md, _first(md, "bytes"))
            return md
        return run

    def set_entry(fqn_kind: str, **fields: Any) -> Callable[[Any], Any]:
        def run(md: Any) -> Any:
            fqn = _first(md, fqn_kind)
            info = md.storage_data[_entry_key(md, fqn)]
            for k, v in fields.items():
                setattr(info, k, v(getattr(info, k)) if callable(v) else v)
            return md
        return run

    def set_attr(obj_of: Callable[[Any, str], Any], attr: str, value: Any) -> Callable[[Any, str], None]:
        def edit(md: Any, fqn: str) -> None:
            setattr(obj_of(md, fqn), attr, value)
        return edit

    item = lambda md, fqn: md.state_dict_metadata[fqn]  # noqa: E731
    chunk0 = lambda md, fqn: md.state_dict_metadata[fqn].chunks[0]  # noqa: E731
    props = lambda md, fqn: md.state_dict_metadata[fqn].properties  # noqa: E731

    def huge_shape(md: Any, fqn: str) -> None:
        it = md.state_dict_metadata[fqn]
        it.size = torch.Size([2**62, 2**62])
        it.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2**62, 2**62]))]
        key = _entry_key(md, fqn)
        info = md.storage_data.pop(key)
        from torch.distributed.checkpoint.metadata import MetadataIndex
        md.storage_data[MetadataIndex(fqn, torch.Size([0, 0]))] = info

    def eight_tb(md: Any, fqn: str) -> None:
        it = md.state_dict_metadata[fqn]
        n = len(it.size)
        big = [2**21] * n if n else []
        it.size = torch.Size(big)
        it.chunks = [ChunkStorageMetadata(torch.Size([0] * n), torch.Size(big))] if n else it.chunks[:1]
        key = _entry_key(md, fqn)
        info = md.storage_data.pop(key)
        from torch.distributed.checkpoint.metadata import MetadataIndex
        md.storage_data[MetadataIndex(fqn, torch.Size([0] * n))] = info

    def grow_chunk(md: Any, fqn: str) -> None:
        it = md.state_dict_metadata[fqn]
        c = it.chunks[0]
        if c.sizes:
            it.size = torch.Size([it.size[0] + 1, *it.size[1:]])
            c.sizes = torch.Size([c.sizes[0] + 1, *c.sizes[1:]])

    def drop_chunk(md: Any, fqn: str) -> None:
        md.state_dict_metadata[fqn].chunks = md.state_dict_metadata[fqn].chunks[1:]

    def to_bytes(md: Any, fqn: str) -> None:
        md.state_dict_metadata[fqn] = BytesStorageMetadata()

    def tuple_offset(md: Any, fqn: str) -> None:
        key = _entry_key(md, fqn)
        info = md.storage_data.pop(key)
        object.__setattr__(key, "offset", tuple(key.offset))  # hashes and compares as the Size did
        md.storage_data[key] = info

    def other_dtype(md: Any, fqn: str) -> None:
        p = md.state_dict_metadata[fqn].properties
        p.dtype = torch.float64 if p.dtype != torch.float64 else torch.float32

    def other_file(md: Any) -> Any:
        fqn = _first(md, "tensor")
        md.storage_data[_entry_key(md, fqn)].relative_path = "__9_9.distcp"
        return md

    return [
        ("metadata is None", lambda md: None),
        ("metadata is a dict", lambda md: {"state_dict_metadata": md.state_dict_metadata}),
        ("state_dict_metadata is a list", lambda md: (setattr(md, "state_dict_metadata", list(md.state_dict_metadata)), md)[1]),
        ("storage_data is None", lambda md: (setattr(md, "storage_data", None), md)[1]),
        ("storage_meta is an int", lambda md: (setattr(md, "storage_meta", 5), md)[1]),
        ("storage_meta is None", lambda md: (setattr(md, "storage_meta", None), md)[1]),
        ("version is an int", lambda md: (setattr(md, "version", 3), md)[1]),
        ("planner_data is a list", lambda md: (setattr(md, "planner_data", []), md)[1]),
        ("planner_data is None", lambda md: (setattr(md, "planner_data", None), md)[1]),
        ("tensor entry of length 0", set_entry("tensor", length=0)),
        ("bytes entry of length 0", set_entry("bytes", length=0)),
        ("tensor entry one byte short", set_entry("tensor", length=lambda n: n - 1)),
        ("tensor entry one byte later", set_entry("tensor", offset=lambda n: n + 1)),
        ("bytes entry one byte short", set_entry("bytes", length=lambda n: n - 1)),
        ("entry length a string", set_entry("tensor", length="12")),
        ("entry offset negative", set_entry("tensor", offset=-1)),
        ("entry transforms an int", set_entry("tensor", transform_descriptors=7)),
        ("entry in a missing file", other_file),
        ("tensor shape 2**62 x 2**62", on_tensor(huge_shape)),
        ("tensor claiming 8 TB", on_tensor(eight_tb)),
        ("chunk grown by a row", on_tensor(grow_chunk)),
        ("chunk dropped", on_tensor(drop_chunk)),
        ("chunk sizes a list", on_tensor(set_attr(chunk0, "sizes", [1]))),
        ("chunk offsets None", on_tensor(set_attr(chunk0, "offsets", None))),
        ("chunk is None", on_tensor(lambda md, fqn: md.state_dict_metadata[fqn].chunks.__setitem__(0, None))),
        ("tensor size a string", on_tensor(set_attr(item, "size", "8"))),
        ("tensor size negative", on_tensor(set_attr(item, "size", torch.Size([-1])))),
        ("chunks None", on_tensor(set_attr(item, "chunks", None))),
        ("properties None", on_tensor(set_attr(item, "properties", None))),
        ("dtype float64 <-> float32", on_tensor(other_dtype)),
        ("dtype None", on_tensor(set_attr(props, "dtype", None))),
        ("tensor recorded as bytes", on_tensor(to_bytes)),
        ("bytes recorded as tensor", on_bytes(lambda md, fqn: md.state_dict_metadata.__setitem__(
            fqn, TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([]), [
                ChunkStorageMetadata(torch.Size([]), torch.Size([]))])))),
        ("storage_data offset a plain tuple", on_tensor(tuple_offset)),
        ("storage_data entry removed", on_tensor(lambda md, fqn: md.storage_data.pop(_entry_key(md, fqn)))),
        ("sdm entry None", on_tensor(lambda md, fqn: md.state_dict_metadata.__setitem__(fqn, None))),
    ]


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------
def _corpus(rng: random.Random) -> list[tuple[str, str, Callable[[Path], None]]]:
    corpus: list[tuple[str, str, Callable[[Path], None]]] = []
    for name in FULL:
        corpus += [(name, label, m) for label, m in archive_mutants(name, rng, 1)]
        corpus += [(name, label, m) for label, m in truncation_mutants(name, rng, 2)]
        corpus += [(name, label, m) for label, m in anywhere_mutants(name, rng, 25)]
    for name in SAMPLED:
        sample = archive_mutants(name, rng, 1)
        corpus += [(name, label, m) for label, m in rng.sample(sample, min(12, len(sample)))]
    return corpus


@pytest.mark.slow
def test_archive_mutants_validate_only_what_torch_loads(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    corpus = _corpus(rng)
    # a fixed share of the corpus per run keeps the file under a minute and a
    # half; the seed makes it the same share each time
    corpus = rng.sample(corpus, min(len(corpus), 550))
    outcomes: dict[str, int] = {}
    for i, (name, label, mutate) in enumerate(corpus):
        root = copy_fixture(name, tmp_path, f"m{i}")
        mutate(root)
        outcome = check_contract(root, label)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        shutil.rmtree(root)
    # the corpus must exercise both sides of the contract
    assert outcomes.get("fail", 0) >= len(corpus) // 3, outcomes
    assert outcomes.get("pass", 0) >= 1, outcomes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dcp_single", "dcp_multirank"])
def test_metadata_mutants_validate_only_what_torch_loads(tmp_path: Path, name: str) -> None:
    failed = 0
    for i, (label, edit) in enumerate(metadata_mutations()):
        root = copy_fixture(name, tmp_path, f"md{i}")
        _write_metadata(root, edit(_metadata(root)))
        if check_contract(root, f"{name}: {label}") == "fail":
            failed += 1
        shutil.rmtree(root)
    assert failed >= len(metadata_mutations()) // 2


def test_unmutated_fixtures_pass_and_match_torch(tmp_path: Path) -> None:
    for name in (*FULL, *SAMPLED):
        root = copy_fixture(name, tmp_path, name)
        assert check_contract(root, name) == "pass", name
        ours = ckpt_values(root)
        loaded = dcp_load_values(root, ours)
        for k, v in ours.items():
            if isinstance(v, np.ndarray):
                assert same(loaded[k], v), f"{name}: dcp.load {k}"


# ---------------------------------------------------------------------------
# the named cases of issue 14
# ---------------------------------------------------------------------------
def _mutated(tmp: Path, label: str, name: str = "dcp_single") -> Path:
    root = copy_fixture(name, tmp, label.replace(" ", "_").replace("*", ""))
    _write_metadata(root, dict(metadata_mutations())[label](_metadata(root)))
    return root


def ckpt_cli(*args: str) -> tuple[int, str, str, int]:
    """(exit code, stdout, stderr, peak RSS in MB) of one `ckpt` run."""
    # the peak is the child's VmHWM, polled until it exits: getrusage/wait4
    # would also count the pytest process's pages the child had before exec
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([*CKPT, *args], stdout=out, stderr=err)
        peak_kb = 0
        deadline = time.monotonic() + 120
        while proc.poll() is None:
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
                peak_kb = max(peak_kb, int(status.split("VmHWM:")[1].split()[0]))
            except (OSError, IndexError, ValueError):
                pass  # exiting (a zombie has no memory map)
            if time.monotonic() > deadline:
                proc.kill()
            time.sleep(0.01)
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read().decode(), err.read().decode(), peak_kb // 1024


@pytest.mark.slow
def test_metadata_of_none_is_an_error_in_every_output_format(tmp_path: Path) -> None:
    root = _mutated(tmp_path, "metadata is None")
    code, out, err, _ = ckpt_cli("validate", os.fspath(root))
    assert code == 1 and "bad-metadata" in out and "found NoneType" in out, out + err
    code, out, err, _ = ckpt_cli("validate", "--format", "github", os.fspath(root))
    assert code == 1, out + err
    assert any(line.startswith("::error") and "bad-metadata" in line and "NoneType" in line for line in out.splitlines()), out
    code, out, err, _ = ckpt_cli("validate", "--deep", "--json", os.fspath(root))
    assert code == 1 and '"bad-metadata"' in out and "Traceback" not in err
    code, out, err, _ = ckpt_cli("inspect", os.fspath(root))
    assert code == 1 and len(err.strip().splitlines()) == 1 and "NoneType" in err, err


@pytest.mark.parametrize("kind", ["tensor", "bytes"])
def test_zero_length_entry_fails_shallow_validate(tmp_path: Path, kind: str) -> None:
    root = _mutated(tmp_path, f"{kind} entry of length 0")
    ok, errors = run_validate(root, deep=False)
    assert not ok and any(e.startswith("empty-chunk:") and "length 0" in e for e in errors), errors
    # and torch indeed cannot load it
    with pytest.raises((Exception, CheckpointException)):
        torch_values(root)


@pytest.mark.serial
def test_memo_bomb_is_refused_before_allocating(tmp_path: Path) -> None:
    root = copy_fixture("dcp_single", tmp_path, "bomb")
    bomb = b"\x80\x04N" + b"r" + (1 << 28).to_bytes(4, "little") + b"."  # LONG_BINPUT 2**28
    assert len(bomb) == 9
    (root / ".metadata").write_bytes(bomb)
    for args in (("validate", os.fspath(root)), ("validate", "--deep", os.fspath(root)), ("inspect", os.fspath(root))):
        t0 = time.monotonic()
        code, out, err, rss = ckpt_cli(*args)
        assert code == 1 and "memo index 268435456" in out + err, out + err
        assert "Traceback" not in err and "internal error" not in err
        assert rss < 500, f"{args}: peak RSS {rss} MB"
        assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("pickle_bytes, expect", [
    (b"\x80\x04Nr" + (1 << 28).to_bytes(4, "little") + b".", "memo index"),  # LONG_BINPUT
    (b"Np268435456\n.", "memo index"),  # protocol-0 PUT
    (b"\x80\x04Nj" + (1 << 28).to_bytes(4, "little") + b".", "Memo value not found"),  # LONG_BINGET: no allocation
    (b"\x80\x05\x96" + (1 << 62).to_bytes(8, "little") + b".", "truncated pickle"),  # BYTEARRAY8 claims 4 EiB
    (b"\x80\x04\x8e" + (1 << 40).to_bytes(8, "little") + b".", "truncated pickle"),  # BINBYTES8
    (b"\x80\x04\x8b" + (5000).to_bytes(4, "little") + b"\x01" * 5000 + b".", "5000-byte integer"),  # LONG4
    (b"\x80\x04" + b"(" * 1000 + b".", "MARKs nested"),
    (b"\x80\x04" + b"\x95" + (1 << 40).to_bytes(8, "little") + b"N.", "frame"),
    (b"\x80\x04" + b"N2" * (1 << 20) + b".", "stack entries"),  # DUP: a 2 MB pickle, a 1M-deep stack
])
def test_pickle_vm_limits(pickle_bytes: bytes, expect: str) -> None:
    from ckpt_tool.base.errors import CorruptMetadataError
    from ckpt_tool.machinery.torch_save import safe_pickle

    t0 = time.monotonic()
    with pytest.raises(CorruptMetadataError, match=expect):
        safe_pickle.load_metadata(pickle_bytes, "x/.metadata")
    with pytest.raises(CorruptMetadataError, match=expect):
        safe_pickle.load_payload(pickle_bytes, "x/data.pkl")
    assert time.monotonic() - t0 < 10


def test_pickle_vm_limits_leave_real_metadata_alone() -> None:
    from ckpt_tool.machinery.torch_save import safe_pickle

    for name in (*FULL, *SAMPLED):
        data = (FIXTURES / name / ".metadata").read_bytes()
        safe_pickle.check_limits(data, name)  # does not raise
        assert isinstance(safe_pickle.load_metadata(data, name), safe_pickle.Metadata)


@pytest.mark.serial
@pytest.mark.parametrize("label", ["tensor shape 2**62 x 2**62", "tensor claiming 8 TB"])
def test_shapes_claiming_more_than_is_stored(tmp_path: Path, label: str) -> None:
    import ckpt_tool

    root = _mutated(tmp_path, label)
    ok, errors = run_validate(root, deep=False)
    claims = [e for e in errors if "claims" in e]
    assert not ok and len(claims) == 1 and claims[0].startswith("bad-metadata:"), errors
    t0 = time.monotonic()
    ok, deep_errors = run_validate(root, deep=True)
    assert not ok and len(deep_errors) < 10, deep_errors  # bounded by stored bytes: no 130k findings
    assert time.monotonic() - t0 < 20
    # torch agrees that it cannot be loaded
    with pytest.raises((Exception, CheckpointException)):
        torch_values(root)
    # a region read is one clear error, before anything is allocated
    leaf = ckpt_tool.open(os.fspath(root))["model.embed.weight"]
    with pytest.raises(CkptError, match="claims|cover only"):
        leaf.read((slice(0, 2), slice(0, 2)))
    with pytest.raises(CkptError, match="claims|cover only"):
        leaf.read()
    code, out, err, rss = ckpt_cli("validate", "--deep", os.fspath(root))
    assert code == 1 and "Traceback" not in err and "internal error" not in err and rss < 500
    # the commands that plan work from shapes refuse the claim first (convert planned 8 TB of output chunks)
    for args in (["convert", os.fspath(root), os.fspath(tmp_path / "out"), "--to", "orbax"],
                 ["reshard", os.fspath(root), os.fspath(tmp_path / "out"), "--mesh", "data=1", "--devices", "1"],
                 ["diff", os.fspath(root), os.fspath(root), "--values"]):
        t0 = time.monotonic()
        code, out, err, rss = ckpt_cli(*args)
        assert code == 1 and time.monotonic() - t0 < 30 and rss < 500, (args, code, out, err)
        assert "Traceback" not in err and "internal error" not in err, err
        assert "claims" in out + err and not (tmp_path / "out").exists(), (args, out, err)


@pytest.mark.parametrize("label", ["tensor entry one byte later", "bytes entry one byte short"])
def test_entries_reaching_into_a_neighbour_fail_shallow_validate(tmp_path: Path, label: str) -> None:
    root = _mutated(tmp_path, label, "dcp_multirank")
    ok, errors = run_validate(root, deep=False)
    if label == "bytes entry one byte short":
        # a shorter entry overlaps nothing: its archive's end record is not at the entry's end
        assert not ok and any("does not hold one whole item" in e for e in errors), errors
        ok, errors = run_validate(root, deep=True)
        assert not ok, errors
    else:
        assert not ok and any("storage entries overlap" in e for e in errors), errors
    with pytest.raises((Exception, CheckpointException)):
        torch_values(root)


def test_a_storage_entry_pointing_into_the_metadata_file_fails_shallow_validate(tmp_path: Path) -> None:
    import pickle

    root = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp_multirank", root)
    md = pickle.loads((root / ".metadata").read_bytes())
    index = next(i for i in md.storage_data if i.fqn == "step")
    md.storage_data[index].relative_path = ".metadata"
    (root / ".metadata").write_bytes(pickle.dumps(md))
    ok, errors = run_validate(root, deep=False)
    assert not ok and any("points into .metadata itself" in e for e in errors), errors


def test_keys_planner_data_does_not_map_stay_flat_as_torch_loads_them(tmp_path: Path) -> None:
    # a save that did not flatten (planner_data {}): torch's loader keeps each fqn as one key
    import ckpt_tool

    root = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp_single", root)
    md = pickle.loads((root / ".metadata").read_bytes())
    md.planner_data = {}
    (root / ".metadata").write_bytes(pickle.dumps(md))
    ok, errors = run_validate(root, deep=True)
    assert ok, errors
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(os.fspath(root), os.fspath(tmp_path / "sd.pt"))
    theirs = set(torch.load(tmp_path / "sd.pt", weights_only=True))  # top-level keys: the fqns, flat
    ours = {leaf.keys for leaf in ckpt_tool.open(os.fspath(root)).leaves}
    assert ours == {(k,) for k in theirs}, (sorted(ours)[:3], sorted(theirs)[:3])

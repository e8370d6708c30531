"""`ckpt validate` on damaged safetensors: one case per rule, each caught with its code.

Every damaged file starts as a real one (safetensors.numpy.save_file,
transformers save_pretrained, torch's HuggingFaceStorageWriter) and is then
edited the way a broken copy, a bad writer or an attacker would.
"""
from __future__ import annotations

import json
import shutil
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import ckpt_tool
from ckpt_tool.ops.validate import validate_checkpoint
from conftest import FIXTURES, run_ckpt

pytest.importorskip("safetensors")
from safetensors.numpy import save_file  # noqa: E402


def _real(path: Path) -> Path:
    rng = np.random.default_rng(0)
    save_file({
        "a": rng.standard_normal((4, 3)).astype(np.float32),
        "b": np.arange(5, dtype=np.int64),
        "c": rng.standard_normal((2, 2)).astype(np.float16),
    }, str(path), metadata={"format": "pt"})
    return path


def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path: Path, header: dict | bytes, data: bytes) -> None:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


def _codes(path: Path) -> list[tuple[str, str]]:
    report = validate_checkpoint(str(path))
    return [(f.severity, f.code) for f in report.findings]


@pytest.fixture
def one(tmp_path) -> Path:
    d = tmp_path / "ck"
    d.mkdir()
    _real(d / "model.safetensors")
    return d


def test_real_file_is_clean(one):
    assert _codes(one) == []


def _edit(one: Path, fn) -> Path:  # noqa: ANN001
    f = one / "model.safetensors"
    header, data = _split(f)
    out = fn(header, data)
    _write(f, *out) if out else None
    return one


CASES = {
    "unknown dtype": (lambda h, d: (h | {"a": h["a"] | {"dtype": "F33"}}, d), "bad-metadata", "unknown safetensors dtype"),
    "packed dtype": (lambda h, d: (h | {"a": h["a"] | {"dtype": "F4"}}, d), "bad-metadata", "sub-byte"),
    "offsets reversed": (lambda h, d: (h | {"b": h["b"] | {"data_offsets": h["b"]["data_offsets"][::-1]}}, d), "bad-metadata", "end before"),
    "size mismatch": (lambda h, d: (h | {"a": h["a"] | {"shape": [4, 4]}}, d), "bad-metadata", "needs"),
    "overlap": (lambda h, d: (h | {"c": h["c"] | {"data_offsets": [h["c"]["data_offsets"][0] - 4, h["c"]["data_offsets"][1] - 4]}}, d), "bad-metadata", "overlap"),
    "out of bounds": (lambda h, d: (h, d[:-6]), "truncated-file", "truncated"),
    "trailing bytes": (lambda h, d: (h, d + b"\0" * 16), "bad-metadata", "after the last tensor"),
    "huge shape": (lambda h, d: (h | {"a": h["a"] | {"shape": [2**40, 2**20]}}, d), "bad-metadata", "needs"),
    "negative dim": (lambda h, d: (h | {"a": h["a"] | {"shape": [-4, 3]}}, d), "bad-metadata", "non-negative"),
    "float offset": (lambda h, d: (h | {"a": h["a"] | {"data_offsets": [0.0, 48]}}, d), "bad-metadata", "begin, end"),
    "extra field": (lambda h, d: (h | {"a": h["a"] | {"x": 1}}, d), "bad-metadata", "exactly"),
    "metadata not strings": (lambda h, d: (h | {"__metadata__": {"format": 1}}, d), "bad-metadata", "__metadata__"),
    "not json": (lambda h, d: (b"{" + b"x" * 40, d), "bad-metadata", "not valid JSON"),
    "duplicate name": (lambda h, d: (json.dumps(h)[:-1].encode() + b', "a": ' + json.dumps(h["a"]).encode() + b"}", d), "bad-metadata", "duplicate"),
    "not an object": (lambda h, d: (b"[1, 2]  ", d), "bad-metadata", "start with"),
    "deep nesting": (lambda h, d: (b'{"a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", d), "bad-metadata", "nests too deeply"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_header(one, case):
    fn, code, text = CASES[case]
    _edit(one, fn)
    report = validate_checkpoint(str(one))
    hits = [f for f in report.findings if f.code == code and f.severity == "error"]
    assert hits, report.findings
    assert any(text in f.message for f in hits), [f.message for f in hits]
    assert all(f.file == "model.safetensors" for f in hits)
    # inspect refuses it in one line, exit 1, no traceback
    res = run_ckpt("inspect", str(one))
    assert res.returncode == 1 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr


def _set_length(path: Path, n: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[:8] = struct.pack("<Q", n)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("n,code,text", [
    (2**60, "bad-metadata", "over the 100000000-byte limit"),
    (100_000_001, "bad-metadata", "limit"),
    (10_000, "truncated-file", "runs past the end"),
])
def test_header_length_refused_without_allocating(one, n, code, text):
    f = one / "model.safetensors"
    _set_length(f, n)
    tracemalloc.start()
    try:
        report = validate_checkpoint(str(one))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [(x.code, text in x.message) for x in report.findings] == [(code, True)]
    assert peak < 8 * 2**20


def test_short_file(one):
    (one / "model.safetensors").write_bytes(b"\1\2\3")
    assert _codes(one) == [("error", "truncated-file")]
    (one / "model.safetensors").write_bytes(b"")
    assert _codes(one) == [("error", "empty-file")]


def test_deep_nesting_small_memory(one):
    f = one / "model.safetensors"
    _write(f, b"[" * 1_000_000, b"")
    tracemalloc.start()
    report = validate_checkpoint(str(one))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert [x.code for x in report.findings] == ["bad-metadata"]
    assert peak < 32 * 2**20  # the header (1 MB) and its text, never a parse tree


# -- sets of files -------------------------------------------------------------------


@pytest.fixture
def sharded(tmp_path) -> Path:
    d = tmp_path / "sharded"
    shutil.copytree(FIXTURES / "safetensors_llama_sharded", d)
    return d


def _index(d: Path) -> dict:
    return json.loads((d / "model.safetensors.index.json").read_text())


def _save_index(d: Path, doc: dict) -> None:
    (d / "model.safetensors.index.json").write_text(json.dumps(doc))


def test_sharded_clean(sharded):
    assert _codes(sharded) == []


def test_index_names_missing_file(sharded):
    doc = _index(sharded)
    victim = sorted(set(doc["weight_map"].values()))[1]
    (sharded / victim).unlink()
    report = validate_checkpoint(str(sharded))
    assert [(f.code, f.file) for f in report.findings if f.severity == "error"] == [("missing-file", victim)]
    # inspect still opens the rest and says what is missing (incomplete, not committed)
    ck = ckpt_tool.open(str(sharded))
    assert ck.status == "incomplete" and [m.file for m in ck.missing] == [victim]


def test_index_names_missing_tensor(sharded):
    doc = _index(sharded)
    doc["weight_map"]["model.layers.9.ghost.weight"] = sorted(set(doc["weight_map"].values()))[0]
    _save_index(sharded, doc)
    report = validate_checkpoint(str(sharded))
    assert [(f.severity, f.code, f.leaf) for f in report.findings] == [
        ("error", "leaf-missing", "model.layers.9.ghost.weight")
    ]


def test_tensor_not_in_index(sharded):
    doc = _index(sharded)
    gone = "model.norm.weight"
    del doc["weight_map"][gone]
    doc["metadata"]["total_size"] -= 16 * 4
    _save_index(sharded, doc)
    assert [(f.severity, f.code, f.leaf) for f in validate_checkpoint(str(sharded)).findings] == [
        ("warning", "leaf-missing", gone)
    ]


def test_total_size_disagrees(sharded):
    doc = _index(sharded)
    doc["metadata"]["total_size"] += 4
    _save_index(sharded, doc)
    assert _codes(sharded) == [("warning", "bad-metadata")]


def test_tensor_in_two_files(sharded):
    doc = _index(sharded)
    files = sorted(set(doc["weight_map"].values()))
    name = next(k for k, v in doc["weight_map"].items() if v == files[0])
    # a second file that holds that tensor too (written by safetensors itself)
    from safetensors.numpy import load_file  # float32 model: numpy holds it

    arrays = load_file(str(sharded / files[1]))
    arrays[name] = load_file(str(sharded / files[0]))[name]
    save_file(arrays, str(sharded / files[1]), metadata={"format": "pt"})
    report = validate_checkpoint(str(sharded))
    assert [(f.code, f.leaf) for f in report.findings] == [("chunk-overlap", name)]


def test_stray_shard(sharded):
    _real(sharded / "model-00009-of-00009.safetensors")
    assert [(f.severity, f.code, f.file) for f in validate_checkpoint(str(sharded)).findings] == [
        ("warning", "stray-file", "model-00009-of-00009.safetensors")
    ]


def test_sharded_without_index(sharded):
    (sharded / "model.safetensors.index.json").unlink()
    files = sorted(sharded.glob("model-*.safetensors"))
    files[-1].unlink()
    found = [(f.code, f.file) for f in validate_checkpoint(str(sharded)).findings]
    assert ("missing-metadata", "model.safetensors.index.json") in found
    assert ("missing-file", files[-1].name) in found


def test_index_not_json(sharded):
    (sharded / "model.safetensors.index.json").write_text("{nope")
    assert ("error", "bad-metadata") in _codes(sharded)
    res = run_ckpt("inspect", str(sharded))
    assert res.returncode == 1 and "index" in res.stderr and "Traceback" not in res.stderr


def test_index_path_escape(sharded):
    doc = _index(sharded)
    doc["weight_map"]["model.norm.weight"] = "../x.safetensors"
    _save_index(sharded, doc)
    assert ("error", "bad-metadata") in _codes(sharded)


# -- torch DCP HF pieces -------------------------------------------------------------------


def _dcp_copy(tmp_path) -> Path:
    d = tmp_path / "dcp"
    shutil.copytree(FIXTURES / "safetensors_dcp_distributed", d)
    return d


def _set_offsets(path: Path, name: str, offsets: list[int]) -> None:
    header, data = _split(path)
    info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    info[name]["saved_offsets"] = offsets
    header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)
    _write(path, header, data)


def test_dcp_pieces_clean():
    assert _codes(FIXTURES / "safetensors_dcp_distributed") == []


def test_dcp_pieces_overlap(tmp_path):
    d = _dcp_copy(tmp_path)
    # rank 2's rows of the embedding moved onto rank 1's (offset 8 -> 4)
    _set_offsets(d / "shard-00002-model-00001-of-00001.safetensors", "model.embed_tokens.weight", [4, 0])
    report = validate_checkpoint(str(d))
    assert [(f.code, f.leaf) for f in report.findings] == [("chunk-overlap", "model.embed_tokens.weight")]


def test_dcp_pieces_gap(tmp_path):
    d = _dcp_copy(tmp_path)
    _set_offsets(d / "shard-00002-model-00001-of-00001.safetensors", "model.embed_tokens.weight", [10, 0])
    report = validate_checkpoint(str(d))
    assert [(f.code, f.leaf) for f in report.findings] == [("coverage-gap", "model.embed_tokens.weight")]
    res = run_ckpt("inspect", str(d))
    assert res.returncode == 1 and "cover" in res.stderr


@pytest.mark.slow
def test_validate_cli_json_and_exit(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    f = _real(d / "model.safetensors")
    _set_length(f, 2**60)
    res = run_ckpt("validate", str(d), "--json")
    assert res.returncode == 1
    doc = json.loads(res.stdout)
    assert doc["format"] == "safetensors" and doc["findings"][0]["code"] == "bad-metadata"
    res = run_ckpt("validate", str(f))
    assert res.returncode == 1 and "bad-metadata" in res.stdout

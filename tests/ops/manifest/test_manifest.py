"""Integrity manifests (issue 22 item 4): `ckpt manifest write|verify` and validate's manifest checks.

The point: Orbax zarr chunks and safetensors files carry no checksum, so `validate --deep` says OK
on a flipped bit that still decodes; with a manifest it names the file (and, with --tensors, the
tensor). The libraries' own loaders (orbax, torch.distributed.checkpoint, safetensors) load the
checkpoints with ckpt's manifest in place.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from conftest import fixture_path, moto_s3_serving, run_ckpt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(fixture_path(name), dst, symlinks=True)
    return dst


def _json(result) -> dict:  # noqa: ANN001
    assert result.stderr == "", result.stderr
    doc = json.loads(result.stdout)
    doc["returncode"] = result.returncode
    return doc


def _codes(doc: dict, severity: str = "error") -> list[tuple[str, str | None, str | None]]:
    return [(f["code"], f["leaf"], f["file"]) for f in doc["findings"] if f["severity"] == severity]


def _flip(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def _tree_digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------------------------
# a flipped bit: found with a manifest, invisible without one (Orbax, safetensors); DCP
# --------------------------------------------------------------------------------------------

def test_orbax_zarr_chunk_flipped_bit(tmp_path, ckpt):
    path = _copy("orbax_plain_zarr2", tmp_path)
    chunk = path / "params.dense.kernel" / "0.0"  # zstd level 1 of 64 random bytes: a raw block, no checksum
    manifest_less = tmp_path / "manifest_less"
    shutil.copytree(path, manifest_less)
    assert ckpt("manifest", "write", path, "--tensors").returncode == 0
    _flip(chunk, 36)
    _flip(manifest_less / "params.dense.kernel" / "0.0", 36)

    today = _json(ckpt("validate", "--deep", "--strict", "--json", manifest_less))
    assert today["returncode"] == 0 and today["findings"] == []  # what --deep proves without a manifest: decodes

    # a new process: this one's tensorstore cache still holds the chunk as --tensors decoded it
    doc = _json(run_ckpt("validate", "--deep", "--json", str(path)))
    assert doc["returncode"] == 1
    assert _codes(doc) == [("digest-mismatch", None, "params.dense.kernel/0.0"),
                           ("digest-mismatch", "params/dense/kernel", None)]
    assert doc["checked"]["tensor_digests_verified"] == 16
    # shallow validate reads no data: the size is the same, so it cannot tell
    assert ckpt("validate", "--strict", path).returncode == 0
    verify = _json(ckpt("manifest", "verify", "--json", path))
    assert verify["returncode"] == 1 and ("digest-mismatch", None, "params.dense.kernel/0.0") in _codes(verify)


def _safetensors_data_start(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return 8 + n, json.loads(raw[8 : 8 + n])


def test_safetensors_tensor_flipped_bit(tmp_path, ckpt):
    src = tmp_path / "st"
    src.mkdir()
    shutil.copy(fixture_path("safetensors_numpy") / "model.safetensors", src / "model.safetensors")
    bare = tmp_path / "bare.safetensors"
    shutil.copy(src / "model.safetensors", bare)
    file = src / "model.safetensors"
    w = _json(ckpt("manifest", "write", "--tensors", "--json", file))
    assert w["manifest"].endswith("/st/model.safetensors.integrity.json") and w["files"] == 1 and w["tensors"] == 19
    start, header = _safetensors_data_start(file)
    offset = start + header["float.f32"]["data_offsets"][0]  # the lowest mantissa bit of its first element
    _flip(file, offset)
    _flip(bare, offset)

    today = _json(ckpt("validate", "--deep", "--strict", "--json", bare))
    assert today["returncode"] == 0 and today["findings"] == []

    doc = _json(run_ckpt("validate", "--deep", "--json", str(file)))
    assert _codes(doc) == [("digest-mismatch", None, "model.safetensors"), ("digest-mismatch", "float/f32", None)]
    # the directory holding the file validates as before: the manifest beside the file is not its
    assert ckpt("validate", "--strict", src).returncode == 0


def _tensor_bytes_offset(path: Path) -> int:
    """Where the largest tensor's stored bytes are in the DCP data file (found by its values)."""
    import torch
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(path)).read_metadata()
    sizes = {k: v.size for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    name = max(sizes, key=lambda k: sizes[k].numel())
    state = {name: torch.empty(sizes[name], dtype=md.state_dict_metadata[name].properties.dtype)}
    dcp.load(state, checkpoint_id=str(path))
    offset = (path / "__0_0.distcp").read_bytes().find(state[name].contiguous().numpy().tobytes())
    assert offset > 0
    return offset


def test_dcp_chunk_flipped_bit(tmp_path, ckpt):
    path = _copy("dcp_single", tmp_path)
    assert ckpt("manifest", "write", path).returncode == 0
    data = path / "__0_0.distcp"
    _flip(data, _tensor_bytes_offset(path) + 8)
    doc = _json(run_ckpt("validate", "--deep", "--json", str(path)))
    assert ("digest-mismatch", None, "__0_0.distcp") in _codes(doc)
    # DCP's chunks are torch.save archives with a CRC-32 per record: --deep finds this one without a
    # manifest too (a bad-chunk naming the tensor)
    assert any(c == "bad-chunk" and leaf for c, leaf, _ in _codes(doc))


def test_dcp_flipped_bit_outside_the_crc(tmp_path, ckpt):
    """A byte of an archive's zip header padding: no CRC covers it (torch loads the chunk, --deep says
    OK), the manifest still finds the file changed."""
    path = _copy("dcp_single", tmp_path)
    assert ckpt("manifest", "write", path).returncode == 0
    data = path / "__0_0.distcp"
    raw = data.read_bytes()
    _flip(data, raw.index(b"ZZZZ"), bit=3)
    doc = _json(run_ckpt("validate", "--deep", "--json", str(path)))
    assert _codes(doc) == [("digest-mismatch", None, "__0_0.distcp")]
    (path / "integrity.json").unlink()
    assert run_ckpt("validate", "--deep", "--strict", str(path)).returncode == 0


# --------------------------------------------------------------------------------------------
# shallow: names and sizes; files the manifest does not name; the manifest itself damaged
# --------------------------------------------------------------------------------------------

@pytest.fixture
def orbax_with_manifest(tmp_path, ckpt):
    path = _copy("orbax_ocdbt_zarr2", tmp_path)
    r = ckpt("manifest", "write", path)
    assert r.returncode == 0, r.stderr
    return path


def test_a_good_checkpoint_with_its_manifest(orbax_with_manifest, ckpt):
    doc = _json(ckpt("validate", "--strict", "--deep", "--json", orbax_with_manifest))
    assert doc["returncode"] == 0 and doc["findings"] == []
    n = len([p for p in orbax_with_manifest.rglob("*") if p.is_file()]) - 1
    assert doc["checked"]["manifest_files"] == n and doc["checked"]["sha256_verified"] == n
    manifest = json.loads((orbax_with_manifest / "integrity.json").read_text())
    assert manifest["algorithm"] == "sha256" and len(manifest["files"]) == n
    for name, digest in manifest["files"].items():  # hashlib's digest of each whole file, as Megatron writes
        assert hashlib.sha256((orbax_with_manifest / name).read_bytes()).hexdigest() == digest
        assert manifest["ckpt"]["sizes"][name] == (orbax_with_manifest / name).stat().st_size


def test_missing_file(orbax_with_manifest, ckpt):
    victim = next(p for p in sorted(orbax_with_manifest.rglob("*")) if p.is_file() and "/d/" in str(p))
    victim.unlink()
    rel = str(victim.relative_to(orbax_with_manifest))
    doc = _json(ckpt("validate", "--json", orbax_with_manifest))
    assert ("missing-file", None, rel) in _codes(doc)
    assert any(f["file"] == rel and "integrity.json" in f["message"] for f in doc["findings"])


def test_size_mismatch_found_shallow(orbax_with_manifest, ckpt):
    meta = orbax_with_manifest / "_CHECKPOINT_METADATA"
    meta.write_bytes(meta.read_bytes() + b" ")  # the same JSON, one byte longer
    doc = _json(ckpt("validate", "--json", orbax_with_manifest))
    assert _codes(doc) == [("size-mismatch", None, "_CHECKPOINT_METADATA")]
    deep = _json(ckpt("validate", "--deep", "--json", orbax_with_manifest))
    assert ("digest-mismatch", None, "_CHECKPOINT_METADATA") in _codes(deep)


def test_unlisted_file_is_a_warning(orbax_with_manifest, ckpt):
    (orbax_with_manifest / "notes.txt").write_text("added later")
    (orbax_with_manifest / "d" / "extra").write_bytes(b"x")
    doc = _json(ckpt("validate", "--json", orbax_with_manifest))
    assert doc["returncode"] == 0  # not protected by the manifest, but the checkpoint still loads
    assert _codes(doc, "warning") == [("unlisted-file", None, "d/extra"), ("unlisted-file", None, "notes.txt")]
    assert ckpt("validate", "--strict", orbax_with_manifest).returncode == 1


@pytest.mark.parametrize("text, says", [
    (b'{"algorithm": "sha256", "files": {', "invalid JSON"),
    (b"[]", "not a JSON object"),
    (b'{"algorithm": "md5", "files": {}}', "algorithm 'md5'"),
    (b'{"files": {"a": "XYZ"}}', "64 lowercase hex"),
    (b'{"files": {}, "ckpt": {"version": 1, "sizes": {"a": 1}}}', "which 'files' does not"),
    (b'{"files": {}, "ckpt": {"version": 99}}', "newer ckpt"),
    (b'{"files": {}, "ckpt": {"version": 1, "tensors": {"w": {"sha256": "0", "dtype": "f4", "shape": []}}}}',
     "64 lowercase hex"),
])
def test_malformed_manifest_is_one_line(orbax_with_manifest, ckpt, text, says):
    (orbax_with_manifest / "integrity.json").write_bytes(text)
    r = ckpt("manifest", "verify", orbax_with_manifest)
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and says in r.stderr and "Traceback" not in r.stderr
    doc = _json(ckpt("validate", "--json", orbax_with_manifest))
    assert [(c, f) for c, _, f in _codes(doc)] == [("bad-metadata", "integrity.json")]
    assert says in doc["findings"][0]["message"]


def test_malformed_manifest_whole_process_no_traceback(orbax_with_manifest):
    (orbax_with_manifest / "integrity.json").write_bytes(b"{not json")
    r = run_ckpt("manifest", "verify", str(orbax_with_manifest))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_manifest_elsewhere(tmp_path, ckpt):
    path = _copy("dcp_single", tmp_path)
    kept = tmp_path / "kept" / "dcp_single.sha256.json"
    assert ckpt("manifest", "write", path, "--manifest", kept).returncode == 0
    assert not (path / "integrity.json").exists() and kept.exists()
    assert ckpt("manifest", "verify", path).returncode == 1  # no manifest in the checkpoint
    assert ckpt("manifest", "verify", path, "--manifest", kept).returncode == 0
    _flip(path / ".metadata", 40)
    doc = _json(ckpt("validate", "--deep", "--json", path, "--manifest", kept))
    assert ("digest-mismatch", None, ".metadata") in _codes(doc)
    missing = ckpt("validate", path, "--manifest", tmp_path / "nope.json")
    assert missing.returncode == 1 and "nope.json" in missing.stderr and len(missing.stderr.splitlines()) == 1


# --------------------------------------------------------------------------------------------
# writing: the source untouched, atomic, never over another writer's manifest without consent
# --------------------------------------------------------------------------------------------

def test_write_touches_nothing_else_and_leaves_no_temporary(tmp_path, ckpt):
    path = _copy("orbax_ocdbt_zarr2", tmp_path)
    before = _tree_digests(path)
    mtimes = {p: p.stat().st_mtime_ns for p in path.rglob("*")}
    assert ckpt("manifest", "write", path, "--tensors").returncode == 0
    after = _tree_digests(path)
    assert after.pop("integrity.json") and after == before
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items() if p.is_file())
    assert sorted(p.name for p in path.iterdir() if p.name.startswith(".")) == []
    # written again (ckpt's own manifest): replaced without asking
    again = _json(ckpt("manifest", "write", path, "--json"))
    assert again["replaced"] == "ckpt's manifest"


def test_never_over_another_writers_manifest_without_overwrite(tmp_path, ckpt):
    path = _copy("dcp_single", tmp_path)
    megatrons = {"algorithm": "sha256", "files": {n: hashlib.sha256((path / n).read_bytes()).hexdigest()
                                                  for n in (".metadata", "__0_0.distcp")}}
    (path / "integrity.json").write_text(json.dumps(megatrons, indent=2))
    r = ckpt("manifest", "write", path)
    assert r.returncode == 1 and "--overwrite" in r.stderr and "ckpt did not write" in r.stderr
    assert json.loads((path / "integrity.json").read_text()) == megatrons
    assert ckpt("manifest", "verify", path).returncode == 0  # checked as it is
    assert _json(ckpt("manifest", "write", path, "--overwrite", "--json"))["replaced"] == "another writer's manifest"
    (path / "integrity.json").write_text("not json")
    assert ckpt("manifest", "write", path).returncode == 1
    assert (path / "integrity.json").read_text() == "not json"


def test_not_a_checkpoint_is_refused(tmp_path, ckpt):
    (tmp_path / "some.txt").write_text("x")
    r = ckpt("manifest", "write", tmp_path)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "integrity.json").exists()


def test_tensors_refused_on_a_run_root(tmp_path, ckpt):
    root = _copy("orbax_manager", tmp_path)
    r = ckpt("manifest", "write", root, "--tensors")
    assert r.returncode == 2 and "write a manifest per step" in r.stderr
    assert not (root / "integrity.json").exists()


def test_memory_budget_bounds_the_buffers(tmp_path, ckpt):
    from ckpt_tool.machinery.integrity.hashing import block_bytes
    from ckpt_tool.storage import Storage

    assert block_bytes(Storage.open(str(fixture_path("dcp_single"))), 4 << 20, 4) == 1 << 20
    assert block_bytes(Storage.open(str(fixture_path("dcp_single"))), 1 << 20, 8) == 128 << 10
    path = _copy("dcp_single", tmp_path)
    assert ckpt("manifest", "write", path, "--memory", "4MiB", "--workers", "3", "--tensors").returncode == 0
    assert ckpt("manifest", "verify", path, "--memory", "4MiB").returncode == 0


# --------------------------------------------------------------------------------------------
# the manifest in place: ckpt's checks and the libraries' loaders do not mind it
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["orbax_ocdbt_zarr2", "orbax_plain_zarr2", "orbax_manager", "dcp_multirank",
                                  "safetensors_llama_sharded", "megatron_torch_dist_tp2", "flax_msgpack"])
def test_the_manifest_adds_no_finding(tmp_path, ckpt, name):
    """validate (shallow and --deep) says exactly what it said before the manifest was written: no
    format's checks take integrity.json for a stray or unexpected file."""
    path = _copy(name, tmp_path)
    before = [_json(ckpt("validate", "--json", *deep, path)) for deep in ((), ("--deep",))]
    assert ckpt("manifest", "write", path).returncode == 0
    after = [_json(ckpt("validate", "--json", *deep, path)) for deep in ((), ("--deep",))]
    for b, a in zip(before, after):
        assert a["findings"] == b["findings"] and a["returncode"] == b["returncode"]
        assert a["checked"]["manifest_files"] > 0
    assert after[1]["checked"]["sha256_verified"] == after[1]["checked"]["manifest_files"]


def test_orbax_restores_with_the_manifest_in_place(tmp_path, ckpt):
    from library_reference import orbax_values

    path = _copy("orbax_ocdbt_zarr2", tmp_path)
    assert ckpt("manifest", "write", path).returncode == 0
    got, expected = orbax_values(path), orbax_values(fixture_path("orbax_ocdbt_zarr2"))
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(value))


def test_orbax_checkpoint_manager_with_manifests_in_root_and_step(tmp_path, ckpt):
    from library_reference import orbax_manager_reference, orbax_values

    root = _copy("orbax_manager", tmp_path)
    expected = orbax_manager_reference(fixture_path("orbax_manager"))
    assert ckpt("manifest", "write", root / "2").returncode == 0
    assert ckpt("manifest", "write", root).returncode == 0
    assert orbax_manager_reference(root) == expected  # the same steps, latest, tmp dirs, root metadata
    got, want = orbax_values(root / "2"), orbax_values(fixture_path("orbax_manager") / "2")
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(value))
    assert ckpt("validate", "--deep", root).returncode == 0
    assert ckpt("validate", "--strict", root / "2").returncode == 0


def test_dcp_load_with_the_manifest_in_place(tmp_path, ckpt):
    import torch
    import torch.distributed.checkpoint as dcp

    path = _copy("dcp_single", tmp_path)
    assert ckpt("manifest", "write", path, "--tensors").returncode == 0
    md = dcp.FileSystemReader(str(path)).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
             if hasattr(v, "size")}
    dcp.load(state, checkpoint_id=str(path))
    ref = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(ref, checkpoint_id=str(fixture_path("dcp_single")))
    assert all(torch.equal(state[k], ref[k]) for k in state)
    # the per-tensor digests are those of the values torch loads (C order, little-endian bytes)
    tensors = json.loads((path / "integrity.json").read_text())["ckpt"]["tensors"]
    import ckpt_tool

    paths = {leaf.path: leaf for leaf in ckpt_tool.open(str(path)).arrays()}
    for fqn, value in state.items():
        leaf = next(p for p in paths if p.replace("/", ".") == fqn)
        raw = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()  # (bfloat16: no numpy dtype)
        assert tensors[leaf]["sha256"] == hashlib.sha256(raw).hexdigest()


def test_safetensors_loads_beside_its_manifest(tmp_path, ckpt):
    from safetensors.numpy import load_file

    path = _copy("safetensors_llama_sharded", tmp_path)
    assert ckpt("manifest", "write", path).returncode == 0
    file = path / "model-00001-of-00004.safetensors"
    ref = load_file(str(fixture_path("safetensors_llama_sharded") / file.name))
    got = load_file(str(file))
    assert ref.keys() == got.keys() and all(np.array_equal(ref[k], got[k]) for k in ref)


# --------------------------------------------------------------------------------------------
# Megatron's own integrity.json goes through the same core
# --------------------------------------------------------------------------------------------

def test_megatrons_manifest_through_the_shared_core(tmp_path, ckpt):
    save = _copy("megatron_torch_dist_tp2", tmp_path)
    (save / "_reference.json").unlink()
    files = {e.name: hashlib.sha256(e.read_bytes()).hexdigest() for e in sorted(save.iterdir()) if e.is_file()}
    (save / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": files}, indent=2))
    doc = _json(ckpt("manifest", "verify", "--json", save))
    assert doc["returncode"] == 0 and doc["checked"]["sha256_verified"] == len(files)
    _flip(save / "common.pt", 100)
    doc = _json(ckpt("validate", "--deep", "--json", save))
    assert ("digest-mismatch", None, "common.pt") in _codes(doc)


def test_megatron_reads_ckpts_manifest_keys(tmp_path, ckpt):
    """Megatron's verifier reads `algorithm` (default sha256) and `files` only: ckpt's section
    beside them, and every name relative to the save, as its os.path.join(dir, name) needs."""
    save = _copy("megatron_torch_dist_tp2", tmp_path)
    assert ckpt("manifest", "write", save).returncode == 0
    doc = json.loads((save / "integrity.json").read_text())
    assert doc.get("algorithm", "sha256") == "sha256"
    for name, digest in doc["files"].items():
        assert hashlib.sha256((save / name).read_bytes()).hexdigest() == digest
    assert set(doc) == {"algorithm", "files", "ckpt"}


# --------------------------------------------------------------------------------------------
# S3: the manifest written to and verified on a real S3-compatible server
# --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_manifest_on_s3(tmp_path):
    bucket = "ckpt-manifest"
    with moto_s3_serving(bucket, ["dcp_single", "orbax_plain_zarr2"]) as env:
        for name in ("dcp_single", "orbax_plain_zarr2"):
            url = f"s3://{bucket}/run/{name}"
            w = run_ckpt("manifest", "write", url, "--json", env=env)
            assert w.returncode == 0, w.stderr
            assert json.loads(w.stdout)["manifest"] == f"{url}/integrity.json"
            v = run_ckpt("validate", url, "--deep", "--strict", "--json", env=env)
            assert v.returncode == 0, v.stdout + v.stderr
            assert json.loads(v.stdout)["checked"]["sha256_verified"] == json.loads(w.stdout)["files"]
        # a changed object: the same size, other bytes
        import boto3

        s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
        key = "run/orbax_plain_zarr2/params.dense.kernel/0.0"
        data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        data[36] ^= 1
        s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))
        r = run_ckpt("manifest", "verify", f"s3://{bucket}/run/orbax_plain_zarr2", "--json", env=env)
        assert r.returncode == 1
        assert ("digest-mismatch", None, "params.dense.kernel/0.0") in _codes(json.loads(r.stdout))


# --------------------------------------------------------------------------------------------
# bench/manifest_bench.py's rows for run_all's table (its JSON trimmed from the 2026-12-02 run)
# --------------------------------------------------------------------------------------------

BENCH_DOC = {
    "bench": "manifest", "memory": "512MiB", "parallel": 2, "runs": 1, "ok": True,
    "checkpoints": {"orbax": {"path": "bench/out/orbax_2gib", "files": 14, "bytes": 1985069056}},
    "results": [
        {"name": "sha256sum-orbax", "format": "orbax", "role": "baseline", "command": "sha256sum x2 (orbax)",
         "ok": True, "error": None, "best_s": 29.3876, "peak_rss_kib": 33368, "check_errors": []},
        {"name": "write-orbax", "format": "orbax", "role": "write", "command": "ckpt manifest write (orbax)",
         "ok": True, "error": None, "best_s": 6.2441, "peak_rss_kib": 72520, "check_errors": []},
        {"name": "verify-orbax", "format": "orbax", "role": "verify", "command": "ckpt manifest verify (orbax)",
         "ok": False, "error": None, "best_s": None, "peak_rss_kib": None, "check_errors": ["manifest verify said ..."]},
    ],
    "ratios": [
        {"format": "orbax", "role": "write", "ckpt": "write-orbax", "baseline": "sha256sum-orbax",
         "speed_vs_sha256sum": 4.71, "target": 0.8, "met": True, "ckpt_peak_rss_kib": 72520,
         "memory_bytes": 536870912, "rss_within_memory": True},
        {"format": "orbax", "role": "verify", "ckpt": "verify-orbax", "baseline": "sha256sum-orbax",
         "speed_vs_sha256sum": None, "target": 0.8, "met": None, "ckpt_peak_rss_kib": None,
         "memory_bytes": 536870912, "rss_within_memory": None},
    ],
}


def test_bench_summary_rows():
    import importlib.util
    import sys

    bench = Path(__file__).resolve().parents[3] / "bench"
    sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location("manifest_bench", bench / "manifest_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    write, verify = mod.summary_rows(BENCH_DOC)
    assert write["bench"] == "manifest" and write["case"] == "write, 2 GiB orbax, warm cache"
    assert write["ratio"] == 0.21 and write["met"] is True and write["rss_mib"] == 71
    assert verify["met"] is None and verify["ratio"] is None and "manifest verify said" in verify["error"]


@pytest.mark.slow
def test_json_errors_of_the_subcommands(tmp_path):
    """With --json, a hard error is also one JSON object on stdout, as for every command."""
    r = run_ckpt("manifest", "verify", str(fixture_path("dcp_single")), "--json")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["error"]["code"] == "not-found" and "no integrity manifest" in doc["error"]["message"]
    r = run_ckpt("manifest", "write", str(tmp_path / "nope"), "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "not-found"
    r = run_ckpt("manifest", "write", str(tmp_path / "nope"))
    assert r.returncode == 1 and r.stdout == ""
    usage = run_ckpt("manifest", "write", str(tmp_path), "--workers", "0")
    assert usage.returncode == 2 and "Usage: ckpt manifest write" in usage.stderr


def test_a_killed_writes_temporary_is_ignored_then_removed(tmp_path, ckpt):
    """A write killed between its temporary and the rename leaves `.integrity-tmp-HOST-PID-*`: not a
    file of the checkpoint (no unlisted-file), and the next write on this host removes it."""
    from ckpt_tool.ops.manifest import _host

    path = _copy("dcp_single", tmp_path)
    assert ckpt("manifest", "write", path).returncode == 0
    dead = _exited_pid()  # (a pid just reaped: no process has it)
    leftover = path / f".integrity-tmp-{_host()}-{dead}-0badc0de"
    leftover.write_text("{")
    other_host = path / ".integrity-tmp-elsewhere-1-0badc0de"
    other_host.write_text("{")
    assert _json(ckpt("validate", "--strict", "--json", path))["findings"] == []
    assert ckpt("manifest", "write", path).returncode == 0
    assert not leftover.exists() and other_host.exists()


def _exited_pid() -> int:
    import subprocess

    p = subprocess.Popen(["true"])  # noqa: S607
    p.wait()
    return p.pid


def test_convert_refuses_a_source_that_differs_from_its_manifest(tmp_path, ckpt):
    src = _copy("dcp_single", tmp_path)
    assert ckpt("manifest", "write", src).returncode == 0
    with open(src / ".metadata", "ab") as f:
        f.write(b"x")
    r = ckpt("convert", src, tmp_path / "out", "--to", "safetensors")
    assert r.returncode == 1 and "size-mismatch: .metadata" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_an_explicit_manifest_inside_the_checkpoint_is_not_one_of_its_files(tmp_path, ckpt, monkeypatch):
    path = _copy("dcp_single", tmp_path)
    monkeypatch.chdir(tmp_path)  # relative paths: the same directory named two ways
    for _ in range(2):  # the second write finds the first's manifest there: not a file to hash
        assert ckpt("manifest", "write", "dcp_single", "--manifest", "dcp_single/sums/m.json").returncode == 0
    doc = json.loads((path / "sums" / "m.json").read_text())
    assert sorted(doc["files"]) == [".metadata", "__0_0.distcp"]
    verify = _json(ckpt("manifest", "verify", "--json", "--strict", "dcp_single", "--manifest", "dcp_single/sums/m.json"))
    assert verify["returncode"] == 0 and verify["findings"] == []

"""Checkpoints written by older orbax-checkpoint versions (0.5.0, 0.9.1, 0.11.20).

The fixtures and their `_reference.json` (what each version's own restore
returned, byte for byte) come from fixtures/gen_orbax_versions.py, which ran
each version in its own venv under build/. Here ckpt is compared with that
reference, with zarr-python (per-array directories) and, after conversion,
with torch and the current orbax. The commit rule of each version is checked
on damaged copies, on memory:// and on gs:// (a real GCS-API server on
127.0.0.1).
"""
from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

import ckpt_tool
from ckpt_tool.cli.main import cli
from ckpt_tool.storage import Storage
from ckpt_tool.ops.validate import validate_checkpoint

from conftest import FIXTURES, free_port, run_ckpt, wait_until_serving
from library_reference import dcp_values, orbax_values

FAMILIES = ["orbax_v0_5", "orbax_v0_9", "orbax_v0_11"]
SAVES = ["standard", "plain", "manager", "manager_plain"]
# the temporary name each version gives a step it is still writing (its
# atomicity.py / utils.py): 0.5 appends a timestamp, 0.9 a counter, 0.11 nothing
TMP_SUFFIX = {
    "orbax_v0_5": ".orbax-checkpoint-tmp-1796149675123456",
    "orbax_v0_9": ".orbax-checkpoint-tmp-3",
    "orbax_v0_11": ".orbax-checkpoint-tmp",
}
# versions that write _CHECKPOINT_METADATA (with the commit timestamp at commit)
WITH_STEP_METADATA = ["orbax_v0_9", "orbax_v0_11"]

runner = CliRunner()


def reference(family: str) -> dict:
    return json.loads((FIXTURES / family / "_reference.json").read_text())


def ref_leaves(family: str, save: str) -> list[dict]:
    """The leaves orbax restored: of the step, or of the latest step of a manager root."""
    s = reference(family)["saves"][save]
    if s["kind"] == "root":
        return s["steps"][str(s["latest_step"])]["leaves"]
    return s["leaves"]


def ref_array(leaf: dict) -> np.ndarray:
    dtype = np.dtype(getattr(ml_dtypes, leaf["dtype"], None) or leaf["dtype"])
    return np.frombuffer(base64.b64decode(leaf["data"]), dtype=dtype).reshape(leaf["shape"])


def ref_values(family: str, save: str) -> dict[tuple, object]:
    """{key path: numpy array, or the python value orbax restored for a scalar}."""
    out = {}
    for leaf in ref_leaves(family, save):
        is_scalar = leaf["data"] is None or leaf["type"] in ("int", "float")
        out[tuple(leaf["keys"])] = leaf["value"] if is_scalar else ref_array(leaf)
    return out


def cli_ok(*args: str) -> str:
    result = runner.invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    return type(a) is type(b) and a == b


def assert_values_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key in want:
        assert same(got[key], want[key]), (key, got[key], want[key])


# -- reading -------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("save", SAVES)
def test_inspect_agrees_with_the_writing_version(family, save):
    path = FIXTURES / family / save
    doc = json.loads(cli_ok("inspect", str(path), "--json", "--values"))
    assert doc["format"] == "orbax" and doc["committed"] is True
    got = {tuple(leaf["keys"]): leaf for leaf in doc["leaves"]}
    want = {tuple(leaf["keys"]): leaf for leaf in ref_leaves(family, save)}
    assert set(got) == set(want)
    for key, ref in want.items():
        leaf = got[key]
        if ref["data"] is not None and ref["type"] not in ("int", "float"):
            assert leaf["kind"] == "array", key
            assert (leaf["shape"], leaf["dtype"]) == (ref["shape"], ref["dtype"]), key
        else:
            assert leaf["kind"] == "value" and leaf["value"] == ref["value"], key
    s = reference(family)["saves"][save]
    if s["kind"] == "root":
        assert doc["step"] == s["latest_step"]
        assert [st["step"] for st in doc["steps"] if st["committed"]] == s["all_steps"]
    # the sharded kernel: 4x2 mesh, one chunk per device shard, as jax laid it out
    kernel = got[("params", "dense", "kernel")]
    assert kernel["sharding"]["mesh_shape"] == [4, 2] and kernel["sharding"]["partition_spec"] == ["data", "model"]
    assert kernel["chunk_shape"] == [2, 4] and kernel["chunks"] == 8


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("save", SAVES)
def test_region_reads_equal_what_orbax_restored(family, save):
    ck = ckpt_tool.open(str(FIXTURES / family / save))
    for key, want in ref_values(family, save).items():
        leaf = ck[list(key)]
        if not isinstance(want, np.ndarray):
            assert leaf.load() == want, key
            continue
        assert same(leaf[...], want), key
        if want.ndim == 2:
            # a region that crosses chunk boundaries
            assert same(leaf[1:3, 1:], want[1:3, 1:]), key
        if want.ndim == 1:
            assert same(leaf[1:3], want[1:3]), key


def _zarr_open(array_dir: Path, tmp_path: Path):
    """zarr-python's own reader; bfloat16 (a tensorstore dtype zarr-python lacks) as its uint16 bits."""
    import zarr

    meta = json.loads((array_dir / ".zarray").read_text())
    if meta["dtype"] != "bfloat16":
        return zarr.open_array(str(array_dir), mode="r"), None
    copy = tmp_path / array_dir.name
    shutil.copytree(array_dir, copy)
    meta["dtype"] = "<u2"
    (copy / ".zarray").write_text(json.dumps(meta))
    return zarr.open_array(str(copy), mode="r"), ml_dtypes.bfloat16


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("save", ["plain", "manager_plain"])
def test_per_array_directories_agree_with_zarr_python(family, save, tmp_path):
    doc = json.loads(cli_ok("inspect", str(FIXTURES / family / save), "--json"))
    want = ref_values(family, save)
    # a manager's latest step keeps its one item in default/
    path = FIXTURES / family / save / (f"{doc['step']}/default" if doc["step"] is not None else "")
    arrays = [leaf for leaf in doc["leaves"] if leaf["kind"] == "array"]
    assert len(arrays) == 6
    for leaf in arrays:
        z, view = _zarr_open(path / leaf["name"], tmp_path)
        values = z[...] if view is None else z[...].view(view)
        assert list(z.shape) == leaf["shape"] and list(z.chunks) == leaf["chunk_shape"], leaf["name"]
        assert values.dtype.name == leaf["dtype"], leaf["name"]
        assert same(values, want[tuple(leaf["keys"])]), leaf["name"]


# -- validate ------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("save", SAVES)
@pytest.mark.parametrize("deep", [[], ["--deep"]])
def test_validate_strict_passes(family, save, deep):
    out = json.loads(cli_ok("validate", str(FIXTURES / family / save), "--strict", "--json", *deep))
    assert out["ok"] is True and out["findings"] == []


@pytest.mark.parametrize("family", FAMILIES)
def test_commit_records_are_what_the_version_writes(family):
    """The reference records what each save left: ckpt must call every one committed."""
    saves = reference(family)["saves"]
    records = [saves["standard"]["commit"], saves["plain"]["commit"]]
    records += [s["commit"] for s in saves["manager"]["steps"].values()]
    has_meta = family in WITH_STEP_METADATA
    for r in records:
        assert r["checkpoint_metadata"] is has_meta and r["commit_timestamp"] is has_meta
        assert r["commit_success_txt"] is False  # on a local disk no version before 0.12.3 writes it


@pytest.mark.parametrize("family", WITH_STEP_METADATA)
def test_no_commit_timestamp_under_a_final_name_is_committed(family, copy_fixture):
    """No version decides by the timestamp (issue 18): a final name is the commit off gs://."""
    path = copy_fixture(f"{family}/standard")
    meta = json.loads((path / "_CHECKPOINT_METADATA").read_text())
    del meta["commit_timestamp_nsecs"]
    (path / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
    report = validate_checkpoint(str(path))
    assert report.findings == []
    assert ckpt_tool.open(str(path)).committed is True


@pytest.mark.parametrize("family", FAMILIES)
def test_tmp_directory_name_is_still_uncommitted(family, copy_fixture, tmp_path):
    src = copy_fixture(f"{family}/standard")
    dst = src.rename(tmp_path / ("7" + TMP_SUFFIX[family]))
    report = validate_checkpoint(str(dst))
    assert ("error", "uncommitted-save") in [(f.severity, f.code) for f in report.findings]
    assert ckpt_tool.open(str(dst)).committed is False


@pytest.mark.parametrize("family", FAMILIES)
def test_manager_step_left_unfinished(family, copy_fixture):
    """A step its version left unfinished (tmp name) is listed as uncommitted and never
    chosen as the latest; a final name without the commit timestamp is committed (issue 18)."""
    root = copy_fixture(f"{family}/manager")
    (root / "2").rename(root / ("2" + TMP_SUFFIX[family]))
    doc = json.loads(cli_ok("inspect", str(root), "--json"))
    assert doc["step"] == 1
    assert [(s["step"], s["committed"]) for s in doc["steps"]] == [(1, True), (2, False)]
    report = validate_checkpoint(str(root))
    assert report.ok() and not report.ok(strict=True)
    assert [(f.code, f.file) for f in report.findings] == [("uncommitted-save", "2" + TMP_SUFFIX[family] + "/")]
    if family in WITH_STEP_METADATA:
        (root / ("2" + TMP_SUFFIX[family])).rename(root / "2")
        meta_file = root / "1" / "_CHECKPOINT_METADATA"
        meta = json.loads(meta_file.read_text())
        meta.pop("commit_timestamp_nsecs")
        meta_file.write_text(json.dumps(meta))
        doc = json.loads(cli_ok("inspect", str(root), "--json", "--step", "latest"))
        assert doc["step"] == 2
        assert [(s["step"], s["committed"]) for s in doc["steps"]] == [(1, True), (2, True)]
        report = validate_checkpoint(str(root))
        assert report.findings == []


@pytest.mark.parametrize("family", WITH_STEP_METADATA)
def test_unreadable_step_metadata_is_reported_not_raised(family, copy_fixture):
    """A damaged _CHECKPOINT_METADATA makes that step uncommitted; the root still lists and reads."""
    root = copy_fixture(f"{family}/manager")
    meta_file = root / "2" / "_CHECKPOINT_METADATA"
    meta_file.write_bytes(meta_file.read_bytes()[:20])
    doc = json.loads(cli_ok("inspect", str(root), "--json"))
    assert doc["step"] == 1
    assert [(s["step"], s["committed"]) for s in doc["steps"]] == [(1, True), (2, False)]
    assert "_CHECKPOINT_METADATA is unreadable" in doc["steps"][1]["reason"]
    # validate of the root checks step 1 (what a resume opens) and warns about step 2; --step all
    # checks step 2 too
    report = validate_checkpoint(str(root))
    assert [(f.severity, f.code, f.file) for f in report.findings] == [("warning", "uncommitted-save", "2/")]
    assert "_CHECKPOINT_METADATA is unreadable" in report.findings[0].message
    report = validate_checkpoint(str(root), step="all")
    assert [(f.severity, f.code, f.file) for f in report.findings] == [("error", "bad-metadata", "2/_CHECKPOINT_METADATA")]


@pytest.mark.parametrize("family", FAMILIES)
def test_lost_chunk_is_still_caught(family, copy_fixture):
    """Damage is still found; before orbax 0.10 (no store_array_data_equal_to_fill_value) a restore fills zeros."""
    path = copy_fixture(f"{family}/plain")
    (path / "params.dense.kernel" / "1.1").unlink()
    report = validate_checkpoint(str(path))
    assert [(f.code, f.leaf, f.file) for f in report.findings] == [
        ("missing-chunk", "params/dense/kernel", "params.dense.kernel/1.1")
    ]
    silent_zeros = "zeros without an error" in report.findings[0].message
    assert silent_zeros is (family != "orbax_v0_11")


# -- memory:// and gs:// ---------------------------------------------------------


def _upload_memory(src: Path) -> str:
    url = f"memory://versions-{uuid.uuid4().hex}"
    storage = Storage.open(url)
    for p in sorted(src.rglob("*")):
        if p.is_file():
            storage.write(str(p.relative_to(src)), p.read_bytes())
    return url


@pytest.mark.parametrize("family", FAMILIES)
def test_memory_store_follows_the_local_rule(family):
    """Off gs:// no orbax version needs commit_success.txt: a memory:// copy is committed as saved."""
    url = _upload_memory(FIXTURES / family / "manager")
    report = validate_checkpoint(url, deep=True)
    assert report.findings == []
    ck = ckpt_tool.open(url)
    assert ck.committed and ck.step == 2
    if family in WITH_STEP_METADATA:
        step = Storage.open(url + "/2")
        meta = json.loads(step.read("_CHECKPOINT_METADATA"))
        meta["commit_timestamp_nsecs"] = None
        step.write("_CHECKPOINT_METADATA", json.dumps(meta).encode())
        # a final name is the commit off gs:// (issue 18: no version reads the timestamp)
        assert ckpt_tool.open(url).step == 2
        assert validate_checkpoint(url).findings == []


def _gcs_request(endpoint: str, path: str, data: bytes, content_type: str = "application/octet-stream") -> None:
    req = urllib.request.Request(f"{endpoint}{path}", data=data, method="POST", headers={"Content-Type": content_type})
    with urllib.request.urlopen(req, timeout=10):
        pass


@pytest.fixture(scope="module")
def gcs():
    """A GCS JSON-API server (gcp-storage-emulator) on 127.0.0.1, and the environment that points tensorstore at it.

    GOOGLE_AUTH_TOKEN_FOR_TESTING makes tensorstore skip its credential search
    (no request to a metadata server); GCE_METADATA_ROOT keeps any such probe on loopback.
    """
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(server, f"{endpoint}/storage/v1/b", "GCS emulator")
        env = {
            "TENSORSTORE_GCS_HTTP_URL": endpoint,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",
            "GCE_METADATA_ROOT": "127.0.0.1:9",
        }

        def upload(src: Path, *, marker: bool = False, drop_timestamp: bool = False) -> str:
            # one bucket per checkpoint: the emulator lists by prefix only and
            # ignores the key range tensorstore asks for, so nothing else may share it
            bucket = f"ckpt-{uuid.uuid4().hex[:16]}"
            _gcs_request(endpoint, "/storage/v1/b?project=test", json.dumps({"name": bucket}).encode(), "application/json")
            for p in sorted(src.rglob("*")):
                if p.is_file():
                    data = p.read_bytes()
                    if drop_timestamp and p.name == "_CHECKPOINT_METADATA":
                        meta = json.loads(data)
                        meta.pop("commit_timestamp_nsecs")
                        data = json.dumps(meta).encode()
                    query = urllib.parse.urlencode({"uploadType": "media", "name": f"ckpt/{p.relative_to(src)}"})
                    _gcs_request(endpoint, f"/upload/storage/v1/b/{bucket}/o?{query}", data)
            if marker:
                # what orbax writes last on gs://, for a single step
                query = urllib.parse.urlencode({"uploadType": "media", "name": "ckpt/commit_success.txt"})
                _gcs_request(endpoint, f"/upload/storage/v1/b/{bucket}/o?{query}", b"Checkpoint commit was successful")
            return f"gs://{bucket}/ckpt"

        yield env, upload
    finally:
        server.terminate()
        server.wait(timeout=10)


def _validate_gs(env: dict, url: str, *extra: str) -> tuple[int, dict]:
    r = run_ckpt("validate", url, "--json", *extra, env=env)
    assert r.stdout, r.stderr
    return r.returncode, json.loads(r.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("family", WITH_STEP_METADATA)
def test_gcs_copy_without_marker_is_committed_with_a_warning(gcs, family):
    """A 0.9 / 0.11 save copied to gs:// from a disk: committed by its timestamp; orbax needs the marker there."""
    env, upload = gcs
    url = upload(FIXTURES / family / "manager_plain")
    code, out = _validate_gs(env, url, "--deep", "--step", "all")  # every step's marker
    assert code == 0 and out["ok"] is True
    assert [(f["severity"], f["code"], f["file"]) for f in out["findings"]] == [
        ("warning", "no-commit-marker", "1/commit_success.txt"), ("warning", "no-commit-marker", "2/commit_success.txt"),
    ]
    code, out = _validate_gs(env, url)  # the step a resume opens
    assert code == 0 and [(f["code"], f["file"]) for f in out["findings"]] == [("no-commit-marker", "2/commit_success.txt")]
    r = run_ckpt("inspect", url, "--json", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["step"] == 2 and [s["committed"] for s in doc["steps"]] == [True, True]
    assert "commit_success.txt" in doc["notes"][0]
    local = json.loads(cli_ok("inspect", str(FIXTURES / family / "manager_plain"), "--json"))
    assert doc["leaves"] == local["leaves"] and local["notes"] == []


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_gcs_save_with_marker_passes_strict(gcs, family):
    """Written on gs:// by its version: every version puts commit_success.txt there."""
    env, upload = gcs
    url = upload(FIXTURES / family / "plain", marker=True)
    code, out = _validate_gs(env, url, "--strict")
    assert code == 0 and out["findings"] == [], out


@pytest.mark.slow
def test_gcs_rules_for_unfinished_saves(gcs):
    env, upload = gcs
    # orbax 0.5 on gs://: no step metadata, so the marker is the only commit record
    url = upload(FIXTURES / "orbax_v0_5" / "plain")
    code, out = _validate_gs(env, url)
    assert code == 1
    assert [(f["code"], f["file"]) for f in out["findings"]] == [("uncommitted-save", "commit_success.txt")]
    r = run_ckpt("inspect", url, "--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["committed"] is False
    # 0.9 on gs:// interrupted before its commit: no timestamp (and no marker)
    url = upload(FIXTURES / "orbax_v0_9" / "plain", drop_timestamp=True)
    code, out = _validate_gs(env, url)
    assert code == 1
    assert [(f["code"], f["file"]) for f in out["findings"]] == [("uncommitted-save", "_CHECKPOINT_METADATA")]


# -- convert -------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("save", SAVES)
def test_convert_to_dcp_loads_in_torch_with_identical_values(family, save, tmp_path):
    dst = tmp_path / "dcp"
    cli_ok("convert", str(FIXTURES / family / save), str(dst), "--to", "dcp", "--json")
    assert_values_equal(dcp_values(dst), ref_values(family, save))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("save", SAVES)
def test_convert_to_orbax_restores_in_current_orbax_with_identical_values(family, save, tmp_path):
    dst = tmp_path / "orbax"
    cli_ok("convert", str(FIXTURES / family / save), str(dst), "--to", "orbax", "--json")
    assert_values_equal(orbax_values(dst), ref_values(family, save))

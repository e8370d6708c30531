"""`ckpt validate` on good Orbax fixtures and on a corpus of damaged copies."""
from __future__ import annotations

import json
import re

import pytest
import tensorstore as ts
from click.testing import CliRunner

from ckpt_tool.cli.main import cli
from ckpt_tool.base.findings import CODES
from ckpt_tool.ops.validate import validate_checkpoint

from conftest import ORBAX_FIXTURES, ROOT, fixture_path


def codes(report, severity="error"):
    return [(f.code, f.leaf, f.file) for f in report.findings if f.severity == severity]


@pytest.mark.parametrize("name", ORBAX_FIXTURES)
@pytest.mark.parametrize("deep", [False, True])
def test_good_fixture_has_no_error(name, deep):
    report = validate_checkpoint(str(fixture_path(name)), deep=deep)
    assert report.format == "orbax"
    assert codes(report) == []
    assert report.ok()


def test_manager_tmp_step_is_a_warning_not_an_error():
    report = validate_checkpoint(str(fixture_path("orbax_manager")))
    assert report.ok() and not report.ok(strict=True)
    assert [(f.code, f.file) for f in report.findings] == [("uncommitted-save", "3.orbax-checkpoint-tmp/")]


def test_incomplete_step_validated_directly_is_an_error():
    report = validate_checkpoint(str(fixture_path("orbax_manager") / "3.orbax-checkpoint-tmp"))
    assert "uncommitted-save" in [c for c, _, _ in codes(report)]
    assert not report.ok()


def _ocdbt_delete(path, key):
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
    kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()


def test_lost_chunk_in_ocdbt(copy_fixture):
    path = copy_fixture("orbax_ocdbt_zarr2")
    _ocdbt_delete(path, "params.dense.kernel/1.1")
    report = validate_checkpoint(str(path))
    assert codes(report) == [("missing-chunk", "params/dense/kernel", "params.dense.kernel/1.1")]
    assert "[4:8, 4:8]" in report.findings[0].message


def test_lost_chunk_without_fill_flag_says_zeros(copy_fixture):
    path = copy_fixture("orbax_plain_zarr2")
    meta = json.loads((path / "_METADATA").read_text())
    meta.pop("store_array_data_equal_to_fill_value")
    (path / "_METADATA").write_text(json.dumps(meta))
    (path / "layers.0.w" / "0.0").unlink()
    report = validate_checkpoint(str(path))
    [f] = report.findings
    assert (f.code, f.leaf) == ("missing-chunk", "layers/0/w")
    assert "zeros without an error" in f.message


def test_lost_zarr3_chunk(copy_fixture):
    path = copy_fixture("orbax_ocdbt_zarr3")
    _ocdbt_delete(path, "params.dense.kernel/c/0/1")
    assert codes(validate_checkpoint(str(path))) == [("missing-chunk", "params/dense/kernel", "params.dense.kernel/c/0/1")]


def test_empty_chunk_file(copy_fixture):
    path = copy_fixture("orbax_plain_zarr2")
    (path / "params.dense.bias" / "0").write_bytes(b"")
    assert ("empty-chunk", "params/dense/bias", "params.dense.bias/0") in codes(validate_checkpoint(str(path)))


def test_lost_ocdbt_data_file(copy_fixture):
    path = copy_fixture("orbax_two_process")
    lost = next((path / "ocdbt.process_1" / "d").iterdir())
    lost.unlink()
    report = validate_checkpoint(str(path))
    assert ("lost-process-data", None, f"ocdbt.process_1/d/{lost.name}") in codes(report)


def test_truncated_ocdbt_data_file(copy_fixture):
    path = copy_fixture("orbax_ocdbt_zarr2")
    data = next((path / "d").iterdir())
    data.write_bytes(data.read_bytes()[:10])
    report = validate_checkpoint(str(path))
    assert [c for c, _, _ in codes(report)][:1] == ["lost-process-data"]
    assert "needs" in report.findings[0].message


def test_unmerged_ocdbt_is_an_error_but_still_reads(copy_fixture, tmp_path):
    # orbax's restore reads only the merged root: validate must not say OK (the
    # validation contract), but the per-process data is still read and converts
    path = copy_fixture("orbax_two_process")
    (path / "manifest.ocdbt").unlink()
    report = validate_checkpoint(str(path), deep=True)
    assert codes(report) == [("unmerged-ocdbt", None, "manifest.ocdbt")]
    assert not report.ok(False)
    from ckpt_tool.ops.engine import ConvertOptions, convert

    convert(str(path), str(tmp_path / "merged"), ConvertOptions(to="orbax"))
    assert validate_checkpoint(str(tmp_path / "merged"), deep=True).ok(True)


def test_no_commit_timestamp_under_a_final_name_is_committed(copy_fixture, tmp_path):
    # orbax decides by the directory name (issue 18): a null timestamp under the
    # final name is a committed step; under a tmp name the save never finished
    path = copy_fixture("orbax_ocdbt_zarr2")
    meta = json.loads((path / "_CHECKPOINT_METADATA").read_text())
    meta["commit_timestamp_nsecs"] = None
    (path / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
    assert codes(validate_checkpoint(str(path))) == []
    tmp = path.rename(tmp_path / "4.orbax-checkpoint-tmp")
    assert ("uncommitted-save", None, "4.orbax-checkpoint-tmp") in codes(validate_checkpoint(str(tmp)))


def test_tmp_directory_name(copy_fixture, tmp_path):
    src = copy_fixture("orbax_ocdbt_zarr2")
    dst = src.rename(tmp_path / "7.orbax-checkpoint-tmp")
    assert "uncommitted-save" in [c for c, _, _ in codes(validate_checkpoint(str(dst)))]


def test_zarray_shape_disagrees_with_metadata(copy_fixture):
    path = copy_fixture("orbax_plain_zarr2")
    zpath = path / "params.dense.kernel" / ".zarray"
    z = json.loads(zpath.read_text())
    z["chunks"] = [z["chunks"][0] * 2, z["chunks"][1]]
    zpath.write_text(json.dumps(z))
    found = codes(validate_checkpoint(str(path)))
    assert ("bad-array-metadata", "params/dense/kernel", "params.dense.kernel/.zarray") in found


def test_unreadable_zarray(copy_fixture):
    path = copy_fixture("orbax_plain_zarr2")
    (path / "params.proj" / ".zarray").write_text("{oops")
    assert ("bad-array-metadata", "params/proj", "params.proj/.zarray") in codes(validate_checkpoint(str(path)))


def test_leaf_missing(copy_fixture):
    import shutil

    path = copy_fixture("orbax_plain_zarr2")
    shutil.rmtree(path / "params.conv")
    assert ("leaf-missing", "params/conv", "params.conv/") in codes(validate_checkpoint(str(path)))


def test_sharding_inconsistent(copy_fixture):
    import base64

    path = copy_fixture("orbax_ocdbt_zarr2")
    sh = json.loads((path / "_sharding").read_text())
    key = base64.urlsafe_b64encode(b"params.dense.kernel").decode()
    entry = json.loads(sh[key])
    entry["shape"] = [3, 2]  # 6 devices declared, 8 listed; 16 rows not divisible by 3
    sh[key] = json.dumps(entry)
    (path / "_sharding").write_text(json.dumps(sh))
    found = [c for c, leaf, _ in codes(validate_checkpoint(str(path))) if leaf == "params.dense.kernel" or leaf == "params/dense/kernel"]
    assert found.count("bad-sharding") >= 2


def test_flipped_bytes_caught_by_deep_only(copy_fixture):
    path = copy_fixture("orbax_plain_zarr2")
    chunk = path / "params.embed.table" / "0.0"
    data = bytearray(chunk.read_bytes())
    for i in range(4, min(len(data), 40)):
        data[i] ^= 0xFF
    chunk.write_bytes(bytes(data))
    assert validate_checkpoint(str(path)).ok()
    deep = validate_checkpoint(str(path), deep=True)
    assert [(c, leaf) for c, leaf, _ in codes(deep)] == [("bad-chunk", "params/embed/table")]


def test_cli_exit_codes_and_formats(copy_fixture):
    runner = CliRunner()
    good = runner.invoke(cli, ["validate", str(fixture_path("orbax_ocdbt_zarr2"))])
    assert good.exit_code == 0 and "OK: 0 errors" in good.output
    path = copy_fixture("orbax_plain_zarr2")
    (path / "params.dense.kernel" / "1.1").unlink()
    bad = runner.invoke(cli, ["validate", str(path)])
    assert bad.exit_code == 1 and "FAILED: 1 error" in bad.output and "missing-chunk" in bad.output
    gh = runner.invoke(cli, ["validate", str(path), "--format", "github"])
    assert gh.exit_code == 1
    assert re.search(r"^::error title=ckpt validate::missing-chunk \[params/dense/kernel\]", gh.output, re.M)
    doc = json.loads(runner.invoke(cli, ["validate", str(path), "--json"]).output)
    assert doc["ok"] is False and doc["format"] == "orbax"
    assert doc["findings"][0] == {
        "severity": "error", "code": "missing-chunk", "leaf": "params/dense/kernel",
        "file": "params.dense.kernel/1.1", "message": doc["findings"][0]["message"],
    }
    strict = runner.invoke(cli, ["validate", str(fixture_path("orbax_manager")), "--strict"])
    assert strict.exit_code == 1
    assert runner.invoke(cli, ["validate"]).exit_code == 2


def test_every_code_is_documented():
    page = (ROOT / "docs" / "commands" / "validate.md").read_text()
    for code in CODES:
        assert f"`{code}`" in page, code


def test_stored_bytes_count_the_values_a_merged_root_keeps_in_process_databases(tmp_path):
    # a merged root points at values with a base path ("value:ocdbt.process_0/:d/<file>:<off>:<len>");
    # missing them made a real 2 GiB single-chunk save claim "only 247 bytes are stored" (a false alarm)
    import numpy as np
    import orbax.checkpoint as ocp

    from ckpt_tool.base.findings import Findings
    from ckpt_tool.storage import Storage
    from ckpt_tool.machinery.arrays.checks import check_ocdbt

    path = tmp_path / "save"
    with ocp.StandardCheckpointer() as ckptr:  # a 64 KiB chunk: stored out of line, in the process database
        ckptr.save(str(path), {"w": np.random.default_rng(0).random((128, 128), dtype=np.float32)})
    stored = [0]
    check_ocdbt(Storage.open(str(path)), "", Findings(), where="", stored=stored)
    assert stored[0] >= 128 * 128 * 4 // 2, stored[0]  # random floats hardly compress
    assert validate_checkpoint(str(path), deep=True).ok(True)

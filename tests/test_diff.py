"""`ckpt diff`: identical copies compare equal; one altered chunk is named exactly."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import tensorstore as ts
from click.testing import CliRunner

import ckpt_tool
from ckpt_tool.cli.main import cli
from ckpt_tool.diff import diff_checkpoints

from conftest import ALL_FIXTURES, fixture_path


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_copy_has_no_difference(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(fixture_path(name), dst)
    result = CliRunner().invoke(cli, ["diff", str(fixture_path(name)), str(dst), "--values", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["same"] and doc["compared"] > 0


def test_one_altered_chunk_is_named(copy_fixture):
    path = copy_fixture("orbax_ocdbt_zarr2")
    arr = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{path}/", "path": "layers.1.w/"}}).result()
    arr[2, 3] = np.float32(arr[2, 3].read().result()) + np.float32(0.5)
    runner = CliRunner()
    result = runner.invoke(cli, ["diff", str(fixture_path("orbax_ocdbt_zarr2")), str(path), "--values", "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.output)
    assert [(d["path"], d["kind"], d["mismatched"]) for d in doc["differences"]] == [("layers/1/w", "values", 1)]
    assert doc["differences"][0]["max_abs"] == pytest.approx(0.5, abs=1e-5)
    # within tolerance: same
    ok = runner.invoke(cli, ["diff", str(fixture_path("orbax_ocdbt_zarr2")), str(path), "--values", "--atol", "0.6"])
    assert ok.exit_code == 0, ok.output
    # structure only: same
    assert runner.invoke(cli, ["diff", str(fixture_path("orbax_ocdbt_zarr2")), str(path)]).exit_code == 0


def test_structure_differences_and_rename():
    a = ckpt_tool.open(str(fixture_path("orbax_ocdbt_zarr2")))
    b = ckpt_tool.open(str(fixture_path("orbax_ocdbt_zarr3")))
    report = diff_checkpoints(a, b)
    assert [(d.path, d.kind) for d in report.differences] == [("name", "only_b")]
    renamed = diff_checkpoints(a, b, rename=[r"^params/=weights/"])
    kinds = {d.kind for d in renamed.differences}
    assert kinds == {"only_a", "only_b"}
    assert any(d.path.startswith("weights/") for d in renamed.differences)


def test_bad_rename_is_usage_error():
    r = CliRunner().invoke(cli, ["diff", str(fixture_path("orbax_ocdbt_zarr2")), str(fixture_path("orbax_ocdbt_zarr2")), "--rename", "noequals"])
    assert r.exit_code != 0

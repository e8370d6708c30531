"""`ckpt convert`: round trips on every fixture, checked in the real libraries and with ckpt diff."""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import ckpt_tool
from ckpt_tool.cli.main import cli
from ckpt_tool.ops.diff import diff_checkpoints
from ckpt_tool.ops.validate import validate_checkpoint

from conftest import DCP_FIXTURES, ORBAX_FIXTURES, ROOT, fixture_info, fixture_path, run_ckpt, run_two_processes
from library_reference import dcp_values, orbax_values

runner = CliRunner()


def convert(*args: str) -> dict:
    result = runner.invoke(cli, ["convert", *args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _src(name: str) -> tuple[str, list[str]]:
    """A fixture path and the extra args that pick a step of a manager root."""
    if fixture_info(name).get("kind") == "manager":
        return str(fixture_path(name)), ["--step", "2"]
    return str(fixture_path(name)), []


def _flatten_lists(values: dict) -> dict:
    """DCP keeps a list of plain values as one item (as torch does); Orbax has one leaf per element."""
    out = {}
    for key, value in values.items():
        if isinstance(value, (list, tuple)) and value and not isinstance(value[0], np.ndarray):
            for i, v in enumerate(value):
                out[key + (i,)] = v
        else:
            out[key] = value
    return out


def _equal(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("name", ORBAX_FIXTURES)
def test_orbax_to_dcp_loads_in_torch_with_exact_values(name, tmp_path):
    src, extra = _src(name)
    dst = tmp_path / "out_dcp"
    summary = convert(src, str(dst), "--to", "dcp", *extra)
    assert summary["target_format"] == "dcp" and summary["arrays"] > 0
    ours = ckpt_tool.open(src, step=2 if extra else None)
    expected = {tuple(l.keys): (l.read() if l.kind == "array" else l.load()) for l in ours.leaves}
    got = _flatten_lists(dcp_values(dst))
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert _equal(np.asarray(got[key]) if isinstance(value, np.ndarray) else got[key], value), key
    assert validate_checkpoint(str(dst), deep=True).ok()


def test_orbax_to_dcp_loads_with_dcp_load(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    dst = tmp_path / "out"
    convert(str(fixture_path("orbax_ocdbt_zarr2")), str(dst), "--to", "dcp")
    src = ckpt_tool.open(str(fixture_path("orbax_ocdbt_zarr2")))
    state: dict = {}
    for leaf in src.arrays():
        node = state
        for k in leaf.keys[:-1]:
            node = node.setdefault(k, {})
        node[leaf.keys[-1]] = torch.zeros(leaf.shape, dtype=getattr(torch, leaf.dtype))
    dcp.load(state, checkpoint_id=str(dst))
    for leaf in src.arrays():
        node = state
        for k in leaf.keys:
            node = node[k]
        want = leaf.read()
        got = node.view(torch.uint8).numpy().tobytes() if node.dim() else node.reshape(1).view(torch.uint8).numpy().tobytes()
        assert got == want.tobytes(), leaf.path


@pytest.mark.parametrize("name", DCP_FIXTURES)
def test_dcp_to_orbax_restores_in_orbax_with_exact_values(name, tmp_path):
    dst = tmp_path / "out_orbax"
    summary = convert(str(fixture_path(name)), str(dst), "--to", "orbax", "--skip-unsupported")
    skipped = {s["leaf"] for s in summary["skipped"]}
    src = ckpt_tool.open(str(fixture_path(name)))
    got = orbax_values(dst)
    expected = {}
    for leaf in src.leaves:
        if leaf.kind == "array":
            expected[tuple(leaf.keys)] = leaf.read()
        else:  # a list of plain values becomes one Orbax leaf per element
            expected.update(_flatten_lists({tuple(leaf.keys): leaf.load()}))
    expected = {k: v for k, v in expected.items() if "/".join(map(str, k)) not in skipped}
    assert set(got) == set(expected)
    for key, want in expected.items():
        assert _equal(np.asarray(got[key]) if isinstance(want, np.ndarray) else got[key], want), key
    assert validate_checkpoint(str(dst), deep=True).ok()


@pytest.mark.parametrize("name", ORBAX_FIXTURES)
def test_round_trip_orbax_dcp_orbax(name, tmp_path):
    src, extra = _src(name)
    mid, back = tmp_path / "mid", tmp_path / "back"
    convert(src, str(mid), "--to", "dcp", *extra)
    convert(str(mid), str(back), "--to", "orbax")
    a = ckpt_tool.open(src, step=2 if extra else None)
    b = ckpt_tool.open(str(back))
    report = diff_checkpoints(a, b, values=True)
    assert report.same, [d.to_json() for d in report.differences]


@pytest.mark.parametrize("name", DCP_FIXTURES)
def test_round_trip_dcp_orbax_dcp(name, tmp_path):
    mid, back = tmp_path / "mid", tmp_path / "back"
    summary = convert(str(fixture_path(name)), str(mid), "--to", "orbax", "--skip-unsupported")
    convert(str(mid), str(back), "--to", "dcp")
    report = diff_checkpoints(ckpt_tool.open(str(fixture_path(name))), ckpt_tool.open(str(back)), values=True)
    skipped = {s["leaf"] for s in summary["skipped"]}
    assert [(d.path, d.kind) for d in report.differences] == [(p, "only_a") for p in sorted(skipped)]


def test_select_exclude_rename_and_dtype(tmp_path):
    dst = tmp_path / "out"
    summary = convert(
        str(fixture_path("orbax_ocdbt_zarr2")), str(dst), "--to", "dcp",
        "--select", "params/**", "--exclude", "params/embed/**", "--rename", "^params/=model/", "--dtype", "bfloat16",
    )
    ck = ckpt_tool.open(str(dst))
    assert all(l.path.startswith("model/") for l in ck.leaves)
    assert not any("embed" in l.path for l in ck.leaves)
    src = ckpt_tool.open(str(fixture_path("orbax_ocdbt_zarr2")))
    kernel = src["params/dense/kernel"].read()
    assert ck["model/dense/kernel"].dtype == "bfloat16"
    np.testing.assert_array_equal(ck["model/dense/kernel"].read(), kernel.astype(ck["model/dense/kernel"].read().dtype))
    assert "model/dense/kernel" in summary["cast"]


def test_no_silent_cast_without_dtype(tmp_path):
    dst = tmp_path / "out"
    convert(str(fixture_path("orbax_ocdbt_zarr2")), str(dst), "--to", "dcp")
    src = ckpt_tool.open(str(fixture_path("orbax_ocdbt_zarr2")))
    out = ckpt_tool.open(str(dst))
    assert {l.path: l.dtype for l in src.arrays()} == {l.path: l.dtype for l in out.arrays()}


def test_chunk_mb_caps_chunks(tmp_path):
    dst = tmp_path / "out"
    convert(str(fixture_path("orbax_ocdbt_zarr2")), str(dst), "--to", "dcp", "--chunk-mb", "0.00003")
    cap = int(0.00003 * 2**20)  # 31 bytes
    split = 0
    for leaf in ckpt_tool.open(str(dst)).arrays():
        itemsize = leaf.nbytes // max(1, leaf.size)
        for chunk in leaf.layout.chunks:
            assert int(np.prod(chunk.sizes)) * itemsize <= max(cap, itemsize)
        split += len(leaf.layout.chunks)
    assert split > sum(l.chunk_count for l in ckpt_tool.open(str(fixture_path("orbax_ocdbt_zarr2"))).arrays())


@pytest.mark.slow
def test_existing_destination_refused_and_overwrite(tmp_path):
    # (an empty directory made first is written into: tests/cli/test_small_things.py)
    dst = tmp_path / "out"
    r = run_ckpt("convert", str(fixture_path("dcp_single")), str(dst), "--to", "orbax", "--skip-unsupported")
    assert r.returncode == 0, r.stderr
    r = run_ckpt("convert", str(fixture_path("dcp_single")), str(dst), "--to", "orbax", "--skip-unsupported")
    assert r.returncode == 1 and "destination exists" in r.stderr
    r = run_ckpt("convert", str(fixture_path("dcp_single")), str(dst), "--to", "orbax", "--skip-unsupported", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert validate_checkpoint(str(dst)).ok()


@pytest.mark.slow
def test_unsupported_value_is_clear_error_and_no_dst(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "src"
    dcp.save({"w": torch.ones(3), "blob": b"\x00\x01raw bytes"}, checkpoint_id=str(src))
    tmp_path = tmp_path / "work"
    tmp_path.mkdir()
    dst = tmp_path / "out"
    r = run_ckpt("convert", str(src), str(dst), "--to", "orbax")
    assert r.returncode == 1
    [line] = r.stderr.strip().splitlines()
    assert "--skip-unsupported" in line
    assert not dst.exists()
    assert not [p for p in tmp_path.iterdir()]  # no temporary directory left behind


@pytest.mark.slow
def test_destination_inside_source_refused(tmp_path, copy_fixture):
    src = copy_fixture("orbax_ocdbt_zarr2")
    r = run_ckpt("convert", str(src), str(src / "inner"), "--to", "dcp")
    assert r.returncode == 1 and "source" in r.stderr


def _tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def big_orbax(tmp_path_factory):
    """A ~48 MB Orbax checkpoint (real orbax) so that a convert takes long enough to kill."""
    out = tmp_path_factory.mktemp("big") / "ckpt"
    code = f"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import numpy as np, orbax.checkpoint as ocp
rng = np.random.default_rng(0)
tree = {{"layers": {{str(i): rng.standard_normal((512, 1024), dtype=np.float32) for i in range(24)}}}}
ck = ocp.StandardCheckpointer(); ck.save({str(out)!r}, tree); ck.wait_until_finished()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("to", ["dcp", "orbax"])
def test_sigkill_leaves_no_complete_output_and_source_untouched(big_orbax, tmp_path, to):
    before = _tree_hash(big_orbax)
    rng = random.Random(1234)
    src = str(big_orbax)
    if to == "orbax":  # orbax -> orbax is not a conversion: go through a DCP copy
        dcp_copy = tmp_path / "dcp_src"
        assert run_ckpt("convert", src, str(dcp_copy), "--to", "dcp").returncode == 0
        src = str(dcp_copy)
        before = _tree_hash(dcp_copy)
    for attempt in range(3):
        dst = tmp_path / f"dst{attempt}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckpt_tool", "convert", src, str(dst), "--to", to, "--chunk-mb", "0.5", "--workers", "2"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        time.sleep(rng.uniform(0.3, 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if dst.exists():
            # the rename happened: then the output must be complete and exact
            assert validate_checkpoint(str(dst), deep=True).ok()
        # whatever the kill left beside DST is not a checkpoint
        for p in tmp_path.iterdir():
            if p.name.startswith(f".dst{attempt}"):
                try:
                    complete = validate_checkpoint(str(p)).ok()
                except ckpt_tool.CkptError:  # nothing there yet that looks like a checkpoint
                    complete = False
                assert not complete, p
    assert _tree_hash(Path(src)) == before




@pytest.mark.slow
@pytest.mark.parametrize("to,name", [("dcp", "orbax_two_process"), ("orbax", "dcp_multirank")])
def test_two_process_convert(tmp_path, to, name):
    dst = tmp_path / "out"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    extra = ["--skip-unsupported"] if to == "orbax" else []
    outs = run_two_processes(
        [sys.executable, "-m", "ckpt_tool", "convert", str(fixture_path(name)), str(dst), "--to", to, *extra, "--json"],
        env,
    )
    summaries = [json.loads(out) for out, _ in outs]
    assert {s["process_index"] for s in summaries} == {0, 1}
    assert sum(s["chunks"] for s in summaries) > 0 and all(s["chunks"] > 0 for s in summaries)
    src = ckpt_tool.open(str(fixture_path(name)))
    if to == "dcp":
        report = diff_checkpoints(src, ckpt_tool.open(str(dst)), values=True)
        assert report.same, [d.to_json() for d in report.differences]
        assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in dst.iterdir()}
        got = dcp_values(dst)
        for leaf in src.arrays():
            assert np.asarray(got[tuple(leaf.keys)]).tobytes() == leaf.read().tobytes()
    else:
        assert (dst / "ocdbt.process_0").is_dir() and (dst / "ocdbt.process_1").is_dir()
        got = orbax_values(dst)
        expected = {}
        for leaf in src.leaves:
            if leaf.kind == "array":
                expected[tuple(leaf.keys)] = leaf.read()
            else:
                expected.update(_flatten_lists({tuple(leaf.keys): leaf.load()}))
        assert set(got) == set(expected)
        for key, want in expected.items():
            assert _equal(np.asarray(got[key]) if isinstance(want, np.ndarray) else got[key], want), key


@pytest.mark.slow
@pytest.mark.parametrize("to", ["orbax", "dcp"])
def test_damaged_source_fails_in_one_line_and_leaves_nothing(tmp_path, copy_fixture, to):
    """A read failure midway (a truncated data file) aborts the writer and removes its output."""
    src = copy_fixture("dcp_multirank")
    data = src / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    work = tmp_path / "work"
    work.mkdir()
    for _ in range(3):  # the failure lands at a different point of the writes each time
        r = run_ckpt("convert", str(src), str(work / "out"), "--to", to, "--skip-unsupported")
        assert r.returncode == 1
        [line] = r.stderr.strip().splitlines()
        assert "__1_0.distcp" in line and "truncated" in line
        assert list(work.iterdir()) == []  # no DST, no temporary directory


def test_text_summary(tmp_path):
    """Without --json, one summary line: what went where, how much and how fast."""
    src, dst = str(fixture_path("dcp_single")), tmp_path / "out"
    r = runner.invoke(cli, ["convert", src, str(dst), "--to", "orbax"])
    assert r.exit_code == 0, r.output
    summary = [line for line in r.output.splitlines() if line.startswith("converted ")]
    assert len(summary) == 1, r.output
    assert f"(dcp) -> {dst} (orbax): 13 arrays, 12 values, 13 chunks" in summary[0]
    assert summary[0].endswith("/s)") and "(process" not in summary[0]

"""One finding per damaged file, with the leaves it affects (issue 30, item 5).

A file's own problem (cut short, unreadable, missing) hurts every item stored
in it alike: `validate --deep` says so once for the file, the text line
counting the leaves, `--json` listing them, instead of a raw library message
per chunk. An unreadable file is `unreadable-file`, not `missing-file`.
Checkpoints are written by the real libraries; which leaves a damaged file
hurts is asked of tensorstore (orbax's reader) and torch's own metadata.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ckpt_tool
from conftest import FIXTURES, unreadable

CODE_ROOT = Path(ckpt_tool.__file__).resolve().parent.parent


def ckpt(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CKPT_DEBUG"}
    return subprocess.run([*prefix, sys.executable, "-m", "ckpt_tool", *args], capture_output=True, text=True,
                          env=env, cwd=CODE_ROOT, timeout=300)


@pytest.fixture(scope="module")
def orbax_sharded(tmp_path_factory) -> tuple[Path, str]:
    """Real orbax: three 256x256 float32 arrays, each sharded over 8 devices (24 chunks), OCDBT; and
    the name of a data file that holds chunks of at least two of them.

    Which data files orbax's concurrent writes fill depends on timing: on a loaded machine one save
    put each array in a file of its own. The property tested (one damaged file shared by several
    leaves is one finding naming them) needs a shared file, so the save is repeated until it has one.
    Which leaves a file holds is found by tensorstore failing to read them once it is cut short.
    """
    base = tmp_path_factory.mktemp("orbax")
    for attempt in range(6):
        out = base / f"ckpt{attempt}"
        code = f"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import numpy as np, jax, orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()).reshape(8), ("x",))
rng = np.random.default_rng(0)
tree = {{"layers": {{str(i): jax.device_put(rng.standard_normal((256, 256), dtype=np.float32),
                                           NamedSharding(mesh, P("x"))) for i in range(3)}}}}
ck = ocp.StandardCheckpointer(); ck.save({str(out)!r}, tree); ck.wait_until_finished()
"""
        subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
        name, hurt = _most_shared_data_file(out, base / f"trials{attempt}")
        if hurt >= 2:
            return out, name
    pytest.fail("six orbax saves each put every array in a data file of its own")


def _most_shared_data_file(ckpt_dir: Path, scratch: Path) -> tuple[str, int]:
    """The data file whose truncation leaves the most arrays unreadable to tensorstore, and how many."""
    best, most = "", 0
    for data in sorted((ckpt_dir / "ocdbt.process_0" / "d").iterdir()):
        trial = scratch / data.name
        shutil.copytree(ckpt_dir, trial)
        os.truncate(trial / "ocdbt.process_0" / "d" / data.name, 1000)
        hurt = len(_unreadable_in_tensorstore(trial))
        shutil.rmtree(trial)
        if hurt > most:
            best, most = data.name, hurt
    return best, most


def _unreadable_in_tensorstore(ckpt_dir: Path) -> set[str]:
    """The leaves tensorstore (what orbax restores through) fails to read, by their ckpt path."""
    import tensorstore as ts

    failed = set()
    for i in range(3):
        spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{ckpt_dir}/",
                                              "path": f"layers.{i}/"}}
        try:
            ts.open(spec, open=True).result().read().result()
        except Exception:
            failed.add(f"layers/{i}")
    return failed


def _errors(findings: list[dict]) -> list[dict]:
    return [f for f in findings if f["severity"] == "error"]


@pytest.mark.slow
def test_truncated_orbax_data_file_is_one_finding_with_its_leaves(orbax_sharded, tmp_path):
    source, shared = orbax_sharded
    ckpt_dir = tmp_path / "ckpt"
    shutil.copytree(source, ckpt_dir)
    data = ckpt_dir / "ocdbt.process_0" / "d" / shared
    os.truncate(data, 1000)
    hurt = _unreadable_in_tensorstore(ckpt_dir)
    assert hurt  # the damage is real: tensorstore cannot read those arrays

    r = ckpt("validate", "--deep", "--json", str(ckpt_dir))
    assert r.returncode == 1, r.stderr
    errors = _errors(json.loads(r.stdout)["findings"])
    rel = str(data.relative_to(ckpt_dir))
    assert len(errors) == 1, errors  # was: one per chunk (16), each with tensorstore's raw text
    (finding,) = errors
    assert finding["file"] == rel and finding["code"] in ("lost-process-data", "truncated-file")
    assert set(finding["leaves"]) == hurt and finding["count"] == len(hurt)
    assert "OUT_OF_RANGE" not in finding["message"]

    text = ckpt("validate", "--deep", str(ckpt_dir))
    lines = [line for line in text.stdout.splitlines() if line.strip().startswith("error ")]
    assert len(lines) == 1, text.stdout
    assert f"({len(hurt)} leaves affected: " in lines[0] and lines[0].endswith(rel)


@pytest.mark.slow
def test_unreadable_orbax_data_file_is_one_unreadable_file_finding(orbax_sharded, tmp_path):
    source, shared = orbax_sharded
    ckpt_dir = tmp_path / "ckpt"
    shutil.copytree(source, ckpt_dir)
    data = ckpt_dir / "ocdbt.process_0" / "d" / shared
    with unreadable(data) as prefix:
        r = ckpt("validate", "--deep", "--json", str(ckpt_dir), prefix=prefix)
    assert r.returncode == 1, r.stderr
    errors = _errors(json.loads(r.stdout)["findings"])
    assert len(errors) == 1, errors
    (finding,) = errors
    assert finding["code"] == "unreadable-file" and finding["file"] == str(data.relative_to(ckpt_dir))
    assert "Permission denied" in finding["message"] and "PERMISSION_DENIED" not in finding["message"]
    # the chunks in that file are those of the arrays the truncation test finds hurt: all but one
    assert finding["count"] == len(finding["leaves"]) >= 2


def _leaves_in(ckpt_dir: Path, file: str) -> set[str]:
    """The fqns torch's .metadata stores in `file` (read with torch's own classes)."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(ckpt_dir)).read_metadata()
    return {index.fqn for index, info in meta.storage_data.items() if info.relative_path == file}


@pytest.mark.slow
def test_unreadable_distcp_is_one_unreadable_file_finding_with_every_leaf(tmp_path):
    ckpt_dir = tmp_path / "dcp"
    shutil.copytree(FIXTURES / "dcp_single", ckpt_dir)
    with unreadable(ckpt_dir / "__0_0.distcp") as prefix:
        r = ckpt("validate", "--deep", "--json", str(ckpt_dir), prefix=prefix)
        text = ckpt("validate", "--deep", str(ckpt_dir), prefix=prefix)
    assert r.returncode == 1, r.stderr
    errors = _errors(json.loads(r.stdout)["findings"])
    assert len(errors) == 1, errors  # was: the file's finding and one more per leaf (48 lines)
    (finding,) = errors
    assert finding["code"] == "unreadable-file" and finding["file"] == "__0_0.distcp"
    assert finding["count"] == len(finding["leaves"]) == len(_leaves_in(ckpt_dir, "__0_0.distcp"))
    lines = [line for line in text.stdout.splitlines() if line.strip().startswith("error ")]
    assert len(lines) == 1 and "leaves affected" in lines[0], text.stdout


def test_unreadable_file_is_not_called_missing_in_process(tmp_path):
    """The error the storage layer raises for a file that is there but refused (EACCES from the
    OS, for an unprivileged process) is its own class; validate's shallow DCP check says
    unreadable-file. Run in a child without the read override, as above."""
    ckpt_dir = tmp_path / "dcp"
    shutil.copytree(FIXTURES / "dcp_multirank", ckpt_dir)
    code = f"""
from ckpt_tool.storage import Storage
from ckpt_tool.base.errors import UnreadableFileError
try:
    Storage.open({str(ckpt_dir)!r}).read_range("__1_0.distcp", 0, 8)
except UnreadableFileError as exc:
    print("unreadable:", exc.message)
"""
    with unreadable(ckpt_dir / "__1_0.distcp") as prefix:
        r = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, cwd=CODE_ROOT,
                           timeout=120)
    assert r.stdout.strip() == "unreadable: cannot read: Permission denied", (r.stdout, r.stderr)


def test_truncated_distcp_items_are_one_finding(tmp_path):
    ckpt_dir = tmp_path / "dcp"
    shutil.copytree(FIXTURES / "dcp_multirank", ckpt_dir)
    os.truncate(ckpt_dir / "__0_0.distcp", 3000)
    r = ckpt("validate", "--deep", "--json", str(ckpt_dir))
    assert r.returncode == 1, r.stderr
    errors = _errors(json.loads(r.stdout)["findings"])
    assert [(f["code"], f["file"]) for f in errors] == [("truncated-file", "__0_0.distcp")], errors
    assert errors[0]["count"] == len(errors[0]["leaves"]) >= 1


def test_findings_group_by_file_and_keep_other_findings():
    """The collector: a file's problem once, its leaves counted; a chunk's own damage stays its own."""
    from ckpt_tool.base.findings import Findings

    f = Findings()
    f.error("unreadable-file", "data file cannot be read (Permission denied)", file="a.bin")
    for leaf in ("x", "y", "x"):
        f.error("bad-chunk", "chunk [0:2] does not decode: cannot read: Permission denied", leaf=leaf, file="a.bin")
    f.file_problem("truncated-file", "truncated: it has 10 bytes", file="b.bin", leaf="z")
    f.file_problem("truncated-file", "truncated: it has 10 bytes", file="b.bin", leaf="w")
    f.error("bad-chunk", "zstd frame is damaged", leaf="v", file="b.bin")  # not the truncation's doing
    got = [x.to_json() for x in f.items]
    assert got[0]["code"] == "unreadable-file" and got[0]["leaves"] == ["x", "y"] and got[0]["count"] == 2
    assert got[0]["message"] == "data file cannot be read (Permission denied) (2 leaves affected: x, y)"
    assert got[1]["leaves"] == ["z", "w"] and got[1]["leaf"] is None
    assert got[2]["code"] == "bad-chunk" and got[2]["leaf"] == "v"
    assert len(got) == 3
    # a finding about no file in particular keeps its plain form in JSON
    assert "leaves" not in got[2]
    pickle.dumps(f.items)  # findings stay plain data

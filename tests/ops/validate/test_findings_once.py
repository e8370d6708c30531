"""Findings that name the cause once (issue 45, items 2-4).

- A lost OCDBT data file is one finding naming the file and the leaves it takes, whatever the
  file holds: the merged index's B-tree nodes (the root `d/` of an Orbax or Flax save), a
  process's chunk values, or a node deep in a many-level tree; never a `leaf-missing` per leaf.
- A Hugging Face download that huggingface_hub did not finish is said as such, and a correct
  index.json is not blamed (`bad-metadata ... total_size`) for the shards that are not there.
- inspect opens each local data file (no read) and says `incomplete: N data file unreadable`.

Every checkpoint is written by the real library (orbax, tensorstore, huggingface_hub) or is a
committed library-written fixture copied and damaged; which leaves a lost file takes is asked of
tensorstore, the library orbax restores through.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpt_tool.cli.main import cli

from conftest import FIXTURES, hub_download_env, unreadable


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _errors(output: str) -> list[dict]:
    return [f for f in json.loads(output)["findings"] if f["severity"] == "error"]


def _unreadable_arrays(base: Path, names: list[str], db: str = "") -> set[str]:
    """The arrays tensorstore fails to read (zarr over OCDBT, as orbax restores them), by stored name."""
    import tensorstore as ts

    failed = set()
    for name in names:
        spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{base}/{db}", "path": f"{name}/"}}
        try:
            ts.open(spec, open=True).result().read().result()
        except Exception:  # (tensorstore raises ValueError and others, with its status text)
            failed.add(name)
    return failed


# -- item 2: a lost OCDBT data file is one finding, for every kind of file ----------------------

def test_lost_merged_index_file_is_one_finding_naming_every_leaf(tmp_path):
    """The root `d/` file of a merged Orbax save holds the B-tree index of every array: cut short,
    it takes all of them. Was: 1 lost-process-data and a leaf-missing per leaf (20 errors here)."""
    root = tmp_path / "orbax"
    shutil.copytree(FIXTURES / "orbax_ocdbt_zarr2", root)
    (index,) = (root / "d").iterdir()
    os.truncate(index, 100)
    # every leaf orbax stores as a zarr array (all but strings), from the tree orbax wrote
    tree = json.loads((root / "_METADATA").read_text())["tree_metadata"]
    keys = [[k["key"] for k in v["key_metadata"]] for v in tree.values()
            if v["value_metadata"]["value_type"] != "string"]
    assert len(keys) == 19
    assert _unreadable_arrays(root, [".".join(k) for k in keys]) == {".".join(k) for k in keys}  # the damage is real

    r = invoke("validate", str(root), "--json")
    assert r.exit_code == 1
    (finding,) = _errors(r.output)
    assert (finding["code"], finding["file"]) == ("lost-process-data", f"d/{index.name}")
    assert sorted(finding["leaves"]) == sorted("/".join(k) for k in keys) and finding["count"] == len(keys)

    text = invoke("validate", str(root)).output
    lines = [line for line in text.splitlines() if line.strip().startswith("error ")]
    assert len(lines) == 1 and f"({len(keys)} leaves affected: " in lines[0], text
    assert "leaf-missing" not in text


def test_lost_flax_data_file_names_its_leaves_without_deep(tmp_path):
    """A Flax save through orbax <= 0.4 (msgpack tree, OCDBT arrays): the same shape, from the
    shallow check (was: the file's finding alone; the leaves it takes only with --deep)."""
    root = tmp_path / "flax"
    shutil.copytree(FIXTURES / "flax_orbax", root)
    step = root / "checkpoint_2"
    data = max((step / "d").iterdir(), key=lambda p: p.stat().st_size)  # the one holding array values
    os.truncate(data, 50)
    # (the two arrays stored in OCDBT; the other leaves are inline in the msgpack tree)
    assert _unreadable_arrays(step, ["opt.mu", "params.dense.kernel"]) == {"opt.mu", "params.dense.kernel"}

    r = invoke("validate", str(root), "--json")
    assert r.exit_code == 1
    (finding,) = _errors(r.output)
    assert finding["file"] == f"checkpoint_2/d/{data.name}"
    assert sorted(finding["leaves"]) == ["opt/mu", "params/dense/kernel"]


@pytest.mark.slow
def test_lost_process_value_file_names_its_leaves_without_deep(tmp_path):
    """An Orbax save whose arrays are stored out of line in `ocdbt.process_0/d/`: the shallow
    check names the leaves whose values lie in the cut bytes (was: only `validate --deep`)."""
    out = tmp_path / "orbax"
    code = f"""
import numpy as np, orbax.checkpoint as ocp
rng = np.random.default_rng(0)
tree = {{"a": rng.standard_normal((64, 64), dtype=np.float32), "b": rng.standard_normal((32, 64), dtype=np.float32),
         "c": np.arange(8, dtype=np.int32)}}
ck = ocp.StandardCheckpointer(); ck.save({str(out)!r}, tree); ck.wait_until_finished()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, capture_output=True,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    files = sorted((out / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)
    data = files[-1]  # the largest: the arrays' chunks (the others hold B-tree nodes)
    os.truncate(data, data.stat().st_size // 2)
    hurt = _unreadable_arrays(out, ["a", "b", "c"])
    assert hurt  # the damage is real

    r = invoke("validate", str(out), "--json")
    assert r.exit_code == 1
    (finding,) = _errors(r.output)
    assert finding["file"] == f"ocdbt.process_0/d/{data.name}"
    assert set(finding["leaves"]) == hurt


@pytest.mark.slow
def test_lost_node_of_a_many_level_tree_takes_exactly_the_arrays_under_it(tmp_path):
    """An OCDBT database of many versions and a 3-level B-tree, written by tensorstore (orbax's
    writer) with small nodes: each data file in turn cut short. The lost file's finding takes the
    arrays tensorstore can no longer read, no more and no fewer, and the other arrays stay listed.
    (Was: the walk followed the version tree instead of the newest root, and most damage passed.)"""
    import tensorstore as ts

    from ckpt_tool.machinery.arrays import checks as ac
    from ckpt_tool.base.findings import Findings
    from ckpt_tool.storage import Storage

    src = tmp_path / "db"
    base = {"driver": "ocdbt", "base": f"file://{src}/",
            "config": {"max_decoded_node_bytes": 300, "max_inline_value_bytes": 64}}
    names = [f"arr{i:02d}" for i in range(12)]
    for i, name in enumerate(names):
        a = ts.open({"driver": "zarr", "kvstore": {**base, "path": f"{name}/"}}, create=True, dtype=ts.float32,
                    shape=[64], chunk_layout=ts.ChunkLayout(chunk_shape=[16])).result()
        a.write(list(range(i, i + 64))).result()
    manifest = ts.ocdbt.dump(ts.KvStore.open(f"file://{src}/").result()).result()
    assert manifest["versions"][-1]["root_height"] >= 2 and manifest["version_tree_nodes"]

    damaged = tmp_path / "damaged"
    checked = 0
    for data in sorted((src / "d").iterdir()):
        shutil.rmtree(damaged, ignore_errors=True)
        shutil.copytree(src, damaged)
        os.truncate(damaged / "d" / data.name, 20)
        hurt = _unreadable_arrays(damaged, names)
        findings, lost = Findings(), ac.LostKeys()
        keys = ac.check_ocdbt(Storage.open(str(damaged)), "", findings, where="", lost=lost)
        if not hurt:
            continue  # an older version's node: no reader of the newest version needs it
        checked += 1
        assert [(f.code, f.file) for f in findings.errors] == [("lost-process-data", f"d/{data.name}")]
        assert {n for n in names if lost.file_of(n) == f"d/{data.name}"} == hurt, data.name
        assert {n for n in names if f"{n}/.zarray" in keys} >= set(names) - hurt
    assert checked >= 10


# -- item 3: a Hugging Face download that stopped -----------------------------------------------

def _hf_download(hub: dict, local_dir: Path, files: list[str], tmp_path: Path, *, kill_at_partial: bool) -> None:
    """hf_hub_download(local_dir=...) of `files` in turn, in a child process; killed (SIGKILL) once
    huggingface_hub's partial file appears, when asked to."""
    import time

    code = ("import sys\nfrom huggingface_hub import hf_hub_download\n"
            "for f in sys.argv[3:]:\n    hf_hub_download('me/tiny', f, local_dir=sys.argv[2], endpoint=sys.argv[1])\n")
    env = hub_download_env(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", code, hub["url"], str(local_dir), *files], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if not kill_at_partial:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
        return
    deadline = time.monotonic() + 120
    # the stalled file's transfer has begun (its partial file is open before the GET is sent);
    # other files' partial files come and go before it
    while not hub["stalled"].is_set():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1].decode()
        time.sleep(0.05)
    time.sleep(0.2)
    proc.kill()
    proc.wait()


@pytest.mark.slow
def test_partial_hf_download_is_said_and_the_index_is_not_blamed(fake_hub, tmp_path):
    """transformers' sharded Llama (4 shards) fetched by huggingface_hub into a local directory, the
    process killed while shard 2 was coming: shards 2-4 are not there, shard 2's partial file is."""
    src = FIXTURES / "safetensors_llama_sharded"
    fake_hub["src"], fake_hub["stall"] = src, "model-00002-of-00004.safetensors"
    local = tmp_path / "llama"
    files = ["config.json", "model.safetensors.index.json"] + [f"model-0000{k}-of-00004.safetensors" for k in range(1, 5)]
    _hf_download(fake_hub, local, files, tmp_path, kill_at_partial=True)
    (partial,) = (local / ".cache" / "huggingface" / "download").glob("*.incomplete")
    partial_rel = str(partial.relative_to(local))
    assert not (local / "model-00002-of-00004.safetensors").exists()

    r = invoke("validate", str(local), "--json")
    assert r.exit_code == 1
    findings = json.loads(r.output)["findings"]
    # the missing shards are the errors; the index's total_size is right, and not blamed for them
    assert [(f["code"], f["file"]) for f in findings if f["severity"] == "error"] == [
        ("missing-file", f"model-0000{k}-of-00004.safetensors") for k in (2, 3, 4)]
    assert not [f for f in findings if f["code"] == "bad-metadata"], findings
    (download,) = [f for f in findings if f["code"] == "unfinished-download"]
    assert download["severity"] == "warning" and download["file"] == partial_rel
    assert "download of model-00002-of-00004.safetensors did not finish" in download["message"]

    doc = json.loads(invoke("inspect", str(local), "--json").output)
    assert doc["status"] == "incomplete"
    assert [n for n in doc["notes"] if "huggingface_hub" in n] == [
        f"huggingface_hub's download of model-00002-of-00004.safetensors did not finish "
        f"({partial.stat().st_size:,} bytes so far): download it again ({partial_rel})"]

    # downloaded again, to the end: the checkpoint is whole; the old partial file is only a leftover
    _hf_download(fake_hub, local, files, tmp_path, kill_at_partial=False)
    r = invoke("validate", str(local), "--json")
    assert r.exit_code == 0, r.output
    (left,) = json.loads(r.output)["findings"]
    assert left["code"] == "unfinished-download" and "downloaded again since" in left["message"]


def test_total_size_is_not_blamed_for_a_deleted_shard(tmp_path):
    """No download at all: a shard deleted from transformers' sharded save. The missing file is the
    finding; index.json's total_size, which is right, is not (was: a bad-metadata warning)."""
    local = tmp_path / "llama"
    shutil.copytree(FIXTURES / "safetensors_llama_sharded", local)
    (local / "model-00003-of-00004.safetensors").unlink()
    r = invoke("validate", str(local), "--json")
    findings = json.loads(r.output)["findings"]
    assert [(f["code"], f["file"]) for f in findings] == [("missing-file", "model-00003-of-00004.safetensors")]


# -- item 4: inspect opens each data file (no read) ----------------------------------------------

def _ckpt(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CKPT_DEBUG"}
    return subprocess.run([*prefix, sys.executable, "-m", "ckpt_tool", *args], capture_output=True, text=True,
                          env=env, cwd=Path(__file__).resolve().parents[3], timeout=300)


def _leaves_in(ckpt_dir: Path, file: str) -> set[str]:
    """The fqns torch's own .metadata reader places in `file`."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(ckpt_dir)).read_metadata()
    return {index.fqn for index, info in meta.storage_data.items() if info.relative_path == file}


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["dcp_multirank", "megatron_torch_dist_tp2"])
def test_unreadable_data_file_makes_inspect_say_incomplete(tmp_path, fixture):
    """A mode-000 `.distcp` (torch DCP; Megatron-Core's torch_dist saves through it): inspect said
    `committed` while validate said unreadable-file. It opens each data file (reading nothing)."""
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / fixture, root)
    with unreadable(root / "__0_0.distcp") as prefix:  # (the prefix: root reads a mode-000 file otherwise)
        text = _ckpt("inspect", str(root), prefix=prefix)
        doc = _ckpt("inspect", "--json", str(root), prefix=prefix)
        valid = _ckpt("validate", "--json", str(root), prefix=prefix)
    assert text.returncode == 0, text.stderr  # as for a missing file: inspect describes what is there
    (status,) = [line for line in text.stdout.splitlines() if line.strip().startswith("status")]
    assert "incomplete: 1 data file unreadable (" in status, text.stdout
    (row,) = [line for line in text.stdout.splitlines() if line.strip().startswith("unreadable")]
    assert "__0_0.distcp: cannot read: Permission denied" in row
    got = json.loads(doc.stdout)
    assert got["status"] == "incomplete"
    (missing,) = got["missing"]
    assert missing["unreadable"] is True and missing["reason"] == "cannot read: Permission denied"
    assert missing["leaves"]
    if fixture == "dcp_multirank":  # (Megatron's .metadata pickles Megatron's classes: not for torch alone)
        assert set(missing["leaves"]) == _leaves_in(root, "__0_0.distcp")
    # validate names the same file, for the same reason
    (finding,) = _errors(valid.stdout)
    assert finding["code"] == "unreadable-file" and finding["file"].endswith("__0_0.distcp")


def test_inspect_of_a_readable_checkpoint_stays_committed_and_reads_no_data_file(tmp_path, monkeypatch):
    """The check is an open and a close: inspect of a whole DCP save reads no byte of a data file."""
    from ckpt_tool.storage import local as localfs

    reads: list[str] = []
    real = localfs.read_all
    monkeypatch.setattr(localfs, "read_all", lambda fd: reads.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    real_pread = localfs.pread
    monkeypatch.setattr(localfs, "pread", lambda fd, *a: reads.append(os.readlink(f"/proc/self/fd/{fd}"))
                        or real_pread(fd, *a))
    real_into = localfs.pread_into
    monkeypatch.setattr(localfs, "pread_into", lambda fd, *a: reads.append(os.readlink(f"/proc/self/fd/{fd}"))
                        or real_into(fd, *a))
    r = invoke("inspect", "--json", str(FIXTURES / "dcp_multirank"))
    assert any(p.endswith("/.metadata") for p in reads)  # (the reads are seen)
    assert json.loads(r.output)["status"] == "committed"
    assert not [p for p in reads if p.endswith(".distcp")], reads


@pytest.mark.slow
@pytest.mark.parametrize("fixture, data", [
    ("orbax_ocdbt_zarr2", "d/"),  # the merged index
    ("flax_orbax", "checkpoint_2/d/9f8b4bd658c5b7edb223114aad5b4c9a"),  # orbax <= 0.4: index and values
])
def test_unreadable_ocdbt_file_is_one_unreadable_file_finding_with_its_leaves(tmp_path, fixture, data):
    """The same shape for a file that is there but cannot be read (mode 000): one unreadable-file
    finding naming it and the leaves it takes (was: for the merged index, 'unreadable B-tree node',
    'cannot list the database' and a leaf-missing per leaf; the shallow check opened no data file)."""
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / fixture, root)
    target = root / data
    if target.is_dir():
        (target,) = target.iterdir()
    with unreadable(target) as prefix:
        r = _ckpt("validate", "--json", str(root), prefix=prefix)
    assert r.returncode == 1, r.stderr
    (finding,) = _errors(r.stdout)
    assert finding["code"] == "unreadable-file" and finding["file"] == str(target.relative_to(root))
    assert finding["message"].startswith("OCDBT data file cannot be read (Permission denied)")
    assert finding["count"] == len(finding["leaves"]) == (19 if fixture == "orbax_ocdbt_zarr2" else 2)


def test_truncated_safetensors_shard_names_every_tensor_it_takes(tmp_path):
    """A shard of transformers' sharded save cut short: the safetensors library loads none of its
    tensors (its header no longer covers the file), so the file's one finding names all of them
    (was: only the last tensor, as if the others were whole)."""
    from safetensors import SafetensorError, safe_open

    local = tmp_path / "llama"
    shutil.copytree(FIXTURES / "safetensors_llama_sharded", local)
    shard = local / "model-00001-of-00004.safetensors"
    with safe_open(str(shard), "np") as f:
        held = sorted(f.keys())
    os.truncate(shard, shard.stat().st_size - 1500)  # the tail: the last tensors' bytes, not the first's
    with pytest.raises(SafetensorError):
        safe_open(str(shard), "np")

    r = invoke("validate", str(local), "--json")
    assert r.exit_code == 1
    (finding,) = _errors(r.output)
    assert (finding["code"], finding["file"], finding["leaf"]) == ("truncated-file", shard.name, None)
    assert sorted(finding["leaves"]) == held and len(held) > 1


@pytest.mark.parametrize("fixture, index", [("safetensors_llama_sharded", "model.safetensors.index.json"),
                                            ("torch_hf_bin_sharded", "pytorch_model.bin.index.json")])
def test_lost_shard_names_the_tensors_the_index_places_in_it(tmp_path, fixture, index):
    """transformers' sharded saves (safetensors and .bin): a shard deleted and another cut short are
    a finding each, naming the file and the tensors index.json places there, which no loader gets
    (was: the file alone, no tensor named)."""
    local = tmp_path / "model"
    shutil.copytree(FIXTURES / fixture, local)
    weight_map = json.loads((local / index).read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    (local / shards[1]).unlink()
    os.truncate(local / shards[0], 3000)
    r = invoke("validate", str(local), "--json")
    assert r.exit_code == 1
    by_file = {f["file"]: f for f in _errors(r.output)}
    assert set(by_file) == {shards[0], shards[1]}
    assert by_file[shards[1]]["code"] == "missing-file"
    assert by_file[shards[0]]["code"] == "truncated-file"
    for shard in shards[:2]:
        assert sorted(by_file[shard]["leaves"]) == sorted(t for t, f in weight_map.items() if f == shard)


@pytest.mark.slow
@pytest.mark.parametrize("fixture, index", [("safetensors_llama_sharded", "model.safetensors.index.json"),
                                            ("torch_hf_bin_sharded", "pytorch_model.bin.index.json")])
def test_unreadable_shard_makes_inspect_say_incomplete(tmp_path, fixture, index):
    """A mode-000 shard of transformers' sharded save: inspect said `cannot read` and stopped (exit 1,
    no listing); it is a set with one data file unreadable, as one with a shard missing is."""
    local = tmp_path / "model"
    shutil.copytree(FIXTURES / fixture, local)
    weight_map = json.loads((local / index).read_text())["weight_map"]
    shard = local / sorted(set(weight_map.values()))[1]
    with unreadable(shard) as prefix:
        r = _ckpt("inspect", "--json", str(local), prefix=prefix)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["status"] == "incomplete"
    (missing,) = doc["missing"]
    assert (missing["file"], missing["unreadable"]) == (shard.name, True)
    assert sorted(missing["leaves"]) == sorted(t for t, f in weight_map.items() if f == shard.name)
    assert {leaf["name"] for leaf in doc["leaves"]} == {t for t, f in weight_map.items() if f != shard.name}


@pytest.mark.parametrize("fixture, manifest, damage, count", [
    ("orbax_ocdbt_zarr2", "manifest.ocdbt", "truncate", 19),  # orbax 0.12's merged root
    ("flax_orbax", "checkpoint_2/manifest.ocdbt", "delete", 2),  # orbax <= 0.4 under Flax
])
def test_lost_ocdbt_manifest_is_one_finding_naming_every_leaf(tmp_path, fixture, manifest, damage, count):
    """The manifest is a file kind too: without it no key of the database can be found, so it takes
    every array stored there, in one finding (was: its finding and a leaf-missing per array, or for a
    deleted Flax manifest a leaf-missing per array alone)."""
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / fixture, root)
    if damage == "truncate":
        os.truncate(root / manifest, 50)
    else:
        (root / manifest).unlink()
    r = invoke("validate", str(root), "--json")
    assert r.exit_code == 1
    (finding,) = _errors(r.output)
    assert (finding["code"], finding["file"]) == ("lost-process-data", manifest)
    assert finding["count"] == len(finding["leaves"]) == count
    if damage == "truncate":  # in its own words, not tensorstore's DATA_LOSS text
        size = (FIXTURES / fixture / manifest).stat().st_size
        assert finding["message"].startswith(f"manifest.ocdbt is cut short: it has 50 of the {size} bytes its header gives")


def test_the_open_check_costs_an_object_store_no_request():
    """On an object store the listing and a size are what is known without a read: the open check
    asks nothing more (a key that is not there is not even looked up)."""
    from ckpt_tool.storage import Storage

    store = Storage.open("memory://findings-once/")
    store.write("a.distcp", b"x" * 10)
    store.check_readable("a.distcp")
    store.check_readable("not-there.distcp")  # (a request would say NOT_FOUND)

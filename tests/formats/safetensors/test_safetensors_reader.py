"""The safetensors reader against files the real writers wrote, read back with the libraries' own readers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ckpt_tool
from conftest import FIXTURES, ROOT, peak_rss_mib, run_ckpt

sys.path.insert(0, str(FIXTURES))
import gen_safetensors  # noqa: E402

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def _library_values(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of every .safetensors file under `path`, through safetensors' own reader."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:  # numpy cannot hold bf16 / fp8 in safe_open
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def _torch_bits(t) -> bytes:  # noqa: ANN001
    import torch

    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("st")
    paths = {
        "sharded": base / "sharded",
        "bf16": base / "bf16",
        "numpy": base / "np.safetensors",
    }
    gen_safetensors.write_llama(str(paths["sharded"]), max_shard_size="8KB")
    gen_safetensors.write_llama(str(paths["bf16"]), dtype="bfloat16")
    gen_safetensors.write_numpy(str(paths["numpy"]))
    return paths


@pytest.mark.parametrize("which", ["sharded", "bf16", "numpy"])
def test_values_match_safe_open(written, which):
    path = written[which]
    ck = ckpt_tool.open(str(path))
    assert ck.format == "safetensors"
    want = _library_values(path)
    assert sorted(leaf.name for leaf in ck.arrays()) == sorted(want)
    for leaf in ck.arrays():
        ref = want[leaf.name]
        assert leaf.shape == tuple(ref.shape), leaf.name
        assert _bits(leaf.read()) == _torch_bits(ref), leaf.name


def test_numpy_dtypes_and_metadata(written):
    path = written["numpy"]
    ck = ckpt_tool.open(str(path))
    src = gen_safetensors.numpy_arrays()
    for name, arr in src.items():
        leaf = ck[name]
        assert leaf.dtype == arr.dtype.name, name
        got = leaf.read()
        assert got.dtype == arr.dtype and _bits(got) == _bits(arr), name
    assert ck.layout["metadata"] == {"np.safetensors": {"format": "np", "note": "every dtype"}}
    assert any("__metadata__" in n and "note=every dtype" in n for n in ck.notes)
    res = run_ckpt("inspect", str(path), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["format"] == "safetensors" and doc["layout"]["metadata"]["np.safetensors"]["note"] == "every dtype"


def test_sharded_index_and_notes(written):
    path = written["sharded"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    ck = ckpt_tool.open(str(path))
    assert {leaf.name for leaf in ck.arrays()} == set(index["weight_map"])
    assert ck.layout["index"] == "model.safetensors.index.json"
    assert ck.layout["files"] == len(set(index["weight_map"].values())) > 2
    assert any("config.json" in n and "ignored" in n for n in ck.notes)
    leaf = ck["model.layers.1.mlp.down_proj.weight"]
    assert leaf.keys == ("model", "layers", "1", "mlp", "down_proj", "weight")
    assert leaf.extra["file"] == index["weight_map"][leaf.name]


def test_single_file_url(written):
    f = written["bf16"] / "model.safetensors"
    a = ckpt_tool.open(str(f))
    b = ckpt_tool.open(str(written["bf16"]))
    assert a.path.endswith("model.safetensors")
    assert [x.name for x in a.arrays()] == [x.name for x in b.arrays()]
    assert all(x.dtype == "bfloat16" for x in a.arrays())
    res = run_ckpt("validate", str(f))
    assert res.returncode == 0, res.stdout + res.stderr


def test_regions_read_only_their_rows(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    big = rng.standard_normal((64, 32, 3)).astype(np.float32)
    last = rng.standard_normal((4,)).astype(np.float32)
    f = tmp_path / "model.safetensors"
    save_file({"big": big, "z_last": last}, str(f))
    ck = ckpt_tool.open(str(tmp_path))
    leaf = ck["big"]
    np.testing.assert_array_equal(leaf[5:9], big[5:9])
    np.testing.assert_array_equal(leaf[3:60, 7:9, 1:2], big[3:60, 7:9, 1:2])  # narrow: row by row
    np.testing.assert_array_equal(leaf[10:20, 4:28], big[10:20, 4:28])  # wide: rows then cut
    np.testing.assert_array_equal(leaf[:, :, 2], big[:, :, 2])
    # cut the file after row 19 (already opened): rows before it still read, later ones fail
    start = leaf.extra["byte_offset"]
    row = 32 * 3 * 4
    with open(f, "r+b") as fh:
        fh.truncate(start + 20 * row)
    np.testing.assert_array_equal(leaf[0:20], big[0:20])
    with pytest.raises(ckpt_tool.CkptError, match="truncated"):
        leaf[19:21]


def _dcp_full() -> dict:
    """The full tensors of the committed DCP HF fixtures, loaded by torch's own HF reader."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    path = FIXTURES / "safetensors_dcp_consolidated"
    shapes = _library_values(path)
    sd = {k: torch.zeros_like(v) for k, v in shapes.items()}
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(str(path / "sharded")))
    return sd


@pytest.mark.parametrize("name", ["safetensors_dcp_distributed", "safetensors_dcp_consolidated"])
def test_dcp_hf_layout(name):
    full = _dcp_full()
    ck = ckpt_tool.open(str(FIXTURES / name))
    assert sorted(x.name for x in ck.arrays()) == sorted(full)
    for leaf in ck.arrays():
        ref = full[leaf.name]
        assert leaf.shape == tuple(ref.shape)
        assert _bits(leaf.read()) == _torch_bits(ref), leaf.name
        if leaf.shape and leaf.shape[0] > 2:
            assert _bits(leaf[1:3]) == _torch_bits(ref[1:3]), leaf.name
    if name.endswith("distributed"):
        assert ck.layout["dcp"] == "save_distributed" and ck.layout["ranks"] == 2
        assert ck["model.layers.0.mlp.up_proj.weight"].chunk_count == 2  # Shard(1): two column pieces
        assert any("save_distributed" in n for n in ck.notes)
    else:
        assert any(n.startswith("sharded/") for n in ck.notes)


def test_dcp_hf_rank0(tmp_path):
    """HuggingFaceStorageWriter without save_distributed: the full tensors, an index, zero offsets."""
    out = tmp_path / "rank0"
    gen_safetensors.write_dcp_rank0(str(out))
    want = gen_safetensors.dcp_rank0_state()
    for path in (out, FIXTURES / "safetensors_dcp_rank0"):
        ck = ckpt_tool.open(str(path))
        assert ck.layout["index"] == "model.safetensors.index.json" and ck.layout["dcp"] == "rank0"
        assert sorted(x.name for x in ck.arrays()) == sorted(want)
        for leaf in ck.arrays():
            assert _bits(leaf.read()) == _torch_bits(want[leaf.name])
        assert run_ckpt("validate", str(path)).returncode == 0


@pytest.mark.slow
def test_dcp_hf_distributed_written_now(tmp_path):
    """The same through a fresh HuggingFaceStorageWriter run (the writer in this venv)."""
    out = tmp_path / "dist"
    gen_safetensors.write_dcp_hf(str(out), "distributed")
    a = ckpt_tool.open(str(out))
    b = ckpt_tool.open(str(FIXTURES / "safetensors_dcp_distributed"))
    for leaf in a.arrays():
        assert _bits(leaf.read()) == _bits(b[leaf.name].read())


def test_inspect_and_validate_import_no_torch_jax_safetensors():
    code = (
        "import sys, ckpt_tool\n"
        "from ckpt_tool.ops.validate import validate_checkpoint\n"
        f"ck = ckpt_tool.open({str(FIXTURES / 'safetensors_dcp_distributed')!r}); [l.read() for l in ck.arrays()]\n"
        f"assert validate_checkpoint({str(FIXTURES / 'safetensors_llama_sharded')!r}, deep=True).ok()\n"
        "bad = [m for m in ('torch', 'jax', 'safetensors', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr


def test_diff_across_formats_same_file(written):
    res = run_ckpt("diff", str(written["bf16"]), str(written["bf16"] / "model.safetensors"), "--values")
    assert res.returncode == 0, res.stdout + res.stderr


def test_float8_e8m0_as_safe_open_reads_it(tmp_path):
    """F8_E8M0 (MX scales), newer than safetensors.numpy: a hand-made file, read as safe_open reads it."""
    import struct

    import ml_dtypes

    arr = np.array([[1, 2], [4, 0.5], [2**-20, 2**30]], dtype=ml_dtypes.float8_e8m0fnu)
    header = json.dumps({"x": {"dtype": "F8_E8M0", "shape": [3, 2], "data_offsets": [0, 6]}}).encode()
    header += b" " * (-len(header) % 8)
    f = tmp_path / "scales.safetensors"
    f.write_bytes(struct.pack("<Q", len(header)) + header + arr.tobytes())
    with safe_open(str(f), framework="pt") as h:
        ref = h.get_tensor("x")
    leaf = ckpt_tool.open(str(f))["x"]
    assert leaf.dtype == "float8_e8m0fnu"
    assert _bits(leaf.read()) == _torch_bits(ref) == arr.tobytes()


@pytest.mark.serial
def test_a_tensor_larger_than_memory_streams_in_bands(tmp_path):
    """A 48 MiB tensor under --memory 16MiB: validate --deep, diff --values and convert read it in bands
    by byte range (before, --deep reported it as a chunk that 'does not decode', a false alarm), and
    stay far below the tensor's size."""
    from safetensors.numpy import save_file

    big = np.random.default_rng(0).standard_normal((3072, 4096), dtype=np.float32)
    for name, value in (("a", big), ("b", big), ("tiny_a", big[:4, :4]), ("tiny_b", big[:4, :4])):
        save_file({"big": np.ascontiguousarray(value)}, str(tmp_path / f"{name}.safetensors"))

    def commands(a: str, b: str) -> dict[str, list]:
        return {"validate": ["validate", "--deep", "--strict", "--memory", "16MiB", tmp_path / f"{a}.safetensors"],
                "diff": ["diff", "--values", "--memory", "16MiB", tmp_path / f"{a}.safetensors",
                         tmp_path / f"{b}.safetensors"],
                "convert": ["convert", tmp_path / f"{a}.safetensors", tmp_path / f"out_{a}", "--to", "dcp",
                            "--memory", "16MiB"]}

    # each command on the 48 MiB tensor against the same on a 4x4 one: only what grows with the data
    large, tiny = commands("a", "b"), commands("tiny_a", "tiny_b")
    grew = {c: peak_rss_mib(*large[c]) - peak_rss_mib(*tiny[c]) for c in large}
    assert all(mib < 40 for mib in grew.values()), grew

"""`ckpt convert --to safetensors` and safetensors input to the other writers, checked with the real readers."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from click.testing import CliRunner

import ckpt_tool
from ckpt_tool.cli.main import cli
from conftest import FIXTURES, fixture_path, run_ckpt, run_two_processes

pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402

ORBAX = fixture_path("orbax_ocdbt_zarr2")
DCP = fixture_path("dcp_multirank")
LLAMA = FIXTURES / "safetensors_llama_sharded"


def convert(src: Path | str, dst: Path, *args: str) -> dict:
    """In-process (CliRunner): a fresh interpreter per conversion would double this file's time."""
    res = CliRunner().invoke(cli, ["convert", str(src), str(dst), *args, "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def _bits(a) -> bytes:  # noqa: ANN001
    if hasattr(a, "numpy"):  # a torch tensor (bf16 / fp8 have no numpy view)
        import torch

        a = a.contiguous().reshape(-1)
        return a.view(torch.uint8).numpy().tobytes() if a.numel() else b""
    return np.ascontiguousarray(a).tobytes()


def _safe_open_all(path: Path) -> dict:
    out = {}
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            assert h.metadata()["format"] == "pt"
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


@pytest.mark.parametrize("src", [ORBAX, DCP, LLAMA, FIXTURES / "safetensors_dcp_distributed"], ids=lambda p: p.name)
def test_output_reads_in_safe_open(tmp_path, src):
    dst = tmp_path / "out"
    summary = convert(src, dst, "--to", "safetensors", "--skip-unsupported")
    assert summary["target_format"] == "safetensors"
    got = _safe_open_all(dst)
    source = ckpt_tool.open(str(src))
    arrays = source.arrays()
    # numbers are 0-d tensors too (test_safetensors_scalars.py); other values are skipped
    numbers = [".".join(map(str, leaf.keys)) for leaf in source.leaves if leaf.kind == "value" and _is_number(leaf)]
    assert sorted(got) == sorted([leaf.name if src.name.startswith("safetensors") else ".".join(map(str, leaf.keys))
                                  for leaf in arrays] + numbers)
    for leaf in arrays:
        name = ".".join(map(str, leaf.keys)) if not src.name.startswith("safetensors") else leaf.name
        assert tuple(got[name].shape) == leaf.shape
        assert _bits(got[name]) == _bits(leaf.read()), name
    assert (dst / "model.safetensors").exists() and not (dst / "model.safetensors.index.json").exists()
    assert run_ckpt("validate", "--deep", str(dst)).returncode == 0


def _is_number(leaf) -> bool:  # noqa: ANN001
    from ckpt_tool.formats.safetensors.write import scalar_tensor

    return scalar_tensor(leaf.load()) is not None


def test_sharded_output_named_and_indexed_as_transformers(tmp_path):
    dst = tmp_path / "out"
    convert(LLAMA, dst, "--to", "safetensors", "--max-shard-size", "6KB")
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 2 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    # (and the model's config beside them: a Hugging Face source brings its companion files, ops/hf_export.py)
    companions = [f for f in ("config.json", "generation_config.json") if (Path(LLAMA) / f).exists()]
    assert sorted(p.name for p in dst.iterdir()) == sorted(files + ["model.safetensors.index.json"] + companions)
    got = _safe_open_all(dst)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    assert index["metadata"]["total_parameters"] == sum(t.numel() for t in got.values())
    assert (dst / "model.safetensors.index.json").read_text() == json.dumps(index, indent=2, sort_keys=True) + "\n"
    for f in files:  # every file within the limit unless it holds one tensor bigger than it
        with safe_open(str(dst / f), framework="np") as h:
            data = sum(h.get_slice(k).get_shape() and int(np.prod(h.get_slice(k).get_shape())) * 4 for k in h.keys())
            assert data <= 6000 or len(list(h.keys())) == 1


@pytest.mark.parametrize("via", ["dcp", "orbax", "safetensors"])
def test_from_pretrained_loads_bit_identical(tmp_path, via):
    """transformers' own loader on our output: no missing, unexpected or mismatched keys, same bits."""
    import torch
    from transformers import LlamaForCausalLM

    src = LLAMA
    if via != "safetensors":
        mid = tmp_path / via
        convert(LLAMA, mid, "--to", via)
        src = mid
    dst = tmp_path / "hf"
    convert(src, dst, "--to", "safetensors", "--max-shard-size", "10KB")
    shutil.copy(LLAMA / "config.json", dst / "config.json")
    model, info = LlamaForCausalLM.from_pretrained(str(dst), output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    ref = _safe_open_all(LLAMA)
    state = model.state_dict()
    for name, tensor in ref.items():
        assert torch.equal(state[name].view(torch.uint8) if False else state[name], tensor), name
        assert _bits(state[name]) == _bits(tensor), name


def test_bf16_single_file_from_pretrained(tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    src = FIXTURES / "safetensors_llama_bf16"
    mid = tmp_path / "orbax"
    convert(src / "model.safetensors", mid, "--to", "orbax")
    dst = tmp_path / "hf"
    convert(mid, dst, "--to", "safetensors")
    assert sorted(p.name for p in dst.iterdir()) == ["model.safetensors"]
    shutil.copy(src / "config.json", dst / "config.json")
    model, info = LlamaForCausalLM.from_pretrained(str(dst), output_loading_info=True, dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ref = _safe_open_all(src)
    for name, tensor in ref.items():
        assert model.state_dict()[name].dtype == torch.bfloat16
        assert _bits(model.state_dict()[name]) == _bits(tensor), name


@pytest.mark.parametrize("src,to", [(ORBAX, "orbax"), (DCP, "dcp")], ids=["orbax", "dcp"])
def test_round_trip_identical(tmp_path, src, to):
    st = tmp_path / "st"
    convert(src, st, "--to", "safetensors", "--skip-unsupported", "--max-shard-size", "1KB")
    back = tmp_path / "back"
    convert(st, back, "--to", to)
    # strings and other values have no place in safetensors: compare the arrays and numbers
    source = ckpt_tool.open(str(src))
    arrays = [leaf.path for leaf in source.leaves if leaf.kind == "array" or _is_number(leaf)]
    res = run_ckpt("diff", str(src), str(back), "--values", "--json")
    doc = json.loads(res.stdout)
    left = [d for d in doc["differences"] if not (d["kind"] == "only_a" and d["path"] not in arrays)]
    assert left == [], left
    assert doc["compared"] == len(arrays)


def test_dcp_reads_our_output_with_torch_hf_reader(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    dst = tmp_path / "out"
    convert(FIXTURES / "safetensors_dcp_distributed", dst, "--to", "safetensors")
    ref = _safe_open_all(dst)
    sd = {k: torch.zeros_like(v) for k, v in ref.items()}
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(str(dst)))
    src = ckpt_tool.open(str(FIXTURES / "safetensors_dcp_distributed"))
    for leaf in src.arrays():
        assert _bits(sd[leaf.name]) == _bits(leaf.read())


@pytest.mark.slow
def test_reshard_accepts_safetensors(tmp_path):
    dst = tmp_path / "resharded"
    res = run_ckpt("reshard", str(LLAMA), str(dst), "--mesh", "data=2", "--devices", "2", "--fsdp", "data")
    assert res.returncode == 0, res.stdout + res.stderr
    res = run_ckpt("diff", str(LLAMA), str(dst), "--values")
    assert res.returncode == 0, res.stdout + res.stderr


def test_failure_leaves_no_output(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(DCP, src)
    data = sorted(src.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:200])  # the .metadata still opens; the chunks do not
    dst = tmp_path / "out"
    res = run_ckpt("convert", str(src), str(dst), "--to", "safetensors", "--skip-unsupported")
    assert res.returncode == 1 and "Traceback" not in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_values_refused_without_skip(tmp_path):
    # numbers are 0-d tensors now (test_safetensors_scalars.py); DCP's str and tuple items are not
    res = run_ckpt("convert", str(DCP), str(tmp_path / "o"), "--to", "safetensors")
    assert res.returncode == 1 and "tensors and numbers only" in res.stderr and "--skip-unsupported" in res.stderr


@pytest.mark.parametrize("args", [["--max-shard-size", "5XB"], ["--max-shard-size", "0"]])
def test_bad_max_shard_size(tmp_path, args):
    res = run_ckpt("convert", str(LLAMA), str(tmp_path / "o"), "--to", "safetensors", *args)
    assert res.returncode == 2 and "--max-shard-size" in res.stderr and not (tmp_path / "o").exists()  # a usage error


def test_max_shard_size_only_for_safetensors(tmp_path):
    res = run_ckpt("convert", str(LLAMA), str(tmp_path / "o"), "--to", "dcp", "--max-shard-size", "1GB")
    assert res.returncode == 2


def test_rename_gives_the_names(tmp_path):
    dst = tmp_path / "out"
    convert(ORBAX, dst, "--to", "safetensors", "--select", "params/**", "--rename", "^params/=model/")
    got = _safe_open_all(dst)
    assert "model.dense.kernel" in got and not any(k.startswith("params.") for k in got)


@pytest.mark.slow
def test_two_processes_write_their_own_files(tmp_path):
    dst = tmp_path / "out"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    outs = run_two_processes(
        [sys.executable, "-m", "ckpt_tool", "convert", str(LLAMA), str(dst), "--to", "safetensors",
         "--max-shard-size", "6KB", "--json"],
        env,
    )
    summaries = [json.loads(out) for out, _ in outs]
    assert all(s["chunks"] > 0 for s in summaries)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    got = _safe_open_all(dst)
    assert sorted(got) == sorted(index["weight_map"])
    ref = _safe_open_all(LLAMA)
    for k, v in ref.items():
        assert _bits(got[k]) == _bits(v)


def test_large_unaligned_ranges(tmp_path):
    """Ranges big enough for O_DIRECT, at offsets off the 4 KiB grid: every byte lands, nothing is padded over."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(3)
    arrays = {
        "a.small": rng.standard_normal(3).astype(np.float32),  # shifts everything after it off the grid
        "b.big": rng.standard_normal((333, 1001)).astype(np.float32),  # ~1.3 MB
        "c.tail": rng.standard_normal((7, 5)).astype(np.float16),
        "d.big2": rng.standard_normal((257, 1023)).astype(np.float64),
    }
    src = tmp_path / "src"
    src.mkdir()
    save_file(arrays, str(src / "model.safetensors"))
    dst = tmp_path / "out"
    convert(src, dst, "--to", "safetensors", "--chunk-mb", "0.3")
    got = _safe_open_all(dst)
    for k, v in arrays.items():
        assert _bits(got[k]) == v.tobytes(), k
    data = sum(v.nbytes for v in arrays.values())
    raw = (dst / "model.safetensors").read_bytes()
    assert len(raw) == 8 + int.from_bytes(raw[:8], "little") + data  # nothing past the last tensor

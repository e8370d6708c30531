"""torch.save files: what is truly specific to the format beside the conformance suite
(tests/conformance/: inspect/values against torch.load, validate, convert both ways, damage, fuzz smoke).

Here: the legacy format and hostile pickles refused by name, a zip that is not torch's left alone,
views / tied storages / strides read as torch.load gives them, the tree rule (dotted names split
unless they collide), directories of several files, sets with a shard missing, a name in two shards,
the CRC-32 of storages no read covers whole, streaming a tensor larger than --memory, and that
inspect and validate import no torch."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, peak_rss_mib

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
ROOT = Path(__file__).resolve().parents[3]


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "CKPT_DEBUG"} | (env or {})
    return subprocess.run([sys.executable, "-m", "ckpt_tool", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=environ, timeout=300)


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.slow
def test_legacy_format_is_refused_by_name(tmp_path):
    import torch

    torch.save({"w": torch.arange(4.0)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    r = run("inspect", tmp_path / "old.pt")
    assert r.returncode == 1
    assert "legacy format" in one_line(r) and "_use_new_zipfile_serialization=False" in r.stderr
    r = run("validate", "--json", tmp_path / "old.pt")
    [finding] = json.loads(r.stdout)["findings"]
    assert r.returncode == 1 and finding["code"] == "bad-metadata" and "legacy format" in finding["message"]
    # the committed one, and a directory holding one
    r = run("inspect", FIXTURES / "torch_legacy")
    assert r.returncode == 1 and "legacy format" in one_line(r)


def test_a_hostile_pickle_is_refused_naming_the_global_and_runs_nothing(tmp_path):
    import torch

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"w": torch.ones(2), "x": Evil()}, tmp_path / "evil.pt")
    r = run("inspect", tmp_path / "evil.pt")
    assert r.returncode == 1 and "refused to unpickle global posix.system" in one_line(r)
    r = run("validate", "--json", tmp_path / "evil.pt")
    assert r.returncode == 1
    codes = {f["code"] for f in json.loads(r.stdout)["findings"]}
    assert codes == {"unsafe-pickle"}
    assert not marker.exists()


@pytest.mark.slow
def test_a_file_without_suffix_is_known_by_its_bytes_and_other_zips_are_not(tmp_path):
    import torch

    torch.save({"a.b": torch.ones(3)}, tmp_path / "weights")
    r = run("inspect", "--json", tmp_path / "weights")
    assert r.returncode == 0, r.stderr
    assert [leaf["name"] for leaf in json.loads(r.stdout)["leaves"]] == ["a.b"]
    np.savez(tmp_path / "arrays.npz", x=np.ones(2))
    r = run("inspect", tmp_path / "arrays.npz")
    assert r.returncode == 1 and "numpy .npz archive" in one_line(r)
    # a DCP data file starts with a torch.save archive, but it is DCP's: it names its directory
    r = run("inspect", FIXTURES / "dcp_single" / "__0_0.distcp")
    assert r.returncode == 1 and "is a file inside a torch.distributed.checkpoint (DCP) checkpoint" in one_line(r)


def _torch_values(path: Path) -> dict:
    import torch

    out = {}

    def walk(o, keys):  # noqa: ANN001
        if isinstance(o, dict) and o:
            for k, v in o.items():
                walk(v, keys + (k,))
        elif isinstance(o, (list, tuple)) and o and any(isinstance(v, torch.Tensor) for v in o):
            for i, v in enumerate(o):
                walk(v, keys + (i,))
        elif isinstance(o, torch.Tensor):
            t = o.detach().contiguous()
            out[".".join(map(str, keys))] = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()

    walk(torch.load(path, weights_only=True), ())
    return out


def test_views_tied_and_strided_tensors_read_what_torch_load_gives():
    import ckpt_tool

    path = FIXTURES / "torch_state" / "state.pt"
    ck = ckpt_tool.open(str(path))
    want = _torch_values(path)
    leaves = {leaf.name: leaf for leaf in ck.arrays()}
    assert set(want) == set(leaves)
    for name, value in want.items():
        got = leaves[name].read()
        assert got.shape == value.shape and got.tobytes() == np.ascontiguousarray(value).tobytes(), name
    # regions of views read right too, and only their own bytes
    transposed = leaves["model.transposed"]
    assert transposed.extra["stride"] == [1, 8]
    np.testing.assert_array_equal(transposed[2:5, 1:4], want["model.transposed"][2:5, 1:4])
    rows = leaves["model.rows"]
    assert rows.extra["storage_offset"] == 16 and rows.extra["storage"] == leaves["model.col"].extra["storage"]
    assert leaves["model.lm_head.weight"].extra["shares_storage_with"] == ["model.embed.weight"]
    assert any("model.embed.weight, model.lm_head.weight" in n for n in ck.notes)
    np.testing.assert_array_equal(leaves["model.expanded"].read(), want["model.expanded"])


def test_tree_rule_dotted_names_split_unless_they_collide(tmp_path):
    import torch

    import ckpt_tool

    torch.save({"model.layers.0.w": torch.ones(2), "opt": {"state": {0: {"m": torch.zeros(2)}}, "lr": [0.1, 0.2]}},
               tmp_path / "a.pt")
    ck = ckpt_tool.open(str(tmp_path / "a.pt"))
    assert sorted(leaf.keys for leaf in ck.leaves) == sorted([
        ("model", "layers", "0", "w"), ("opt", "state", 0, "m"), ("opt", "lr")])
    assert ck["opt/lr"].load() == [0.1, 0.2]  # a list without tensors is one value
    # "a" is a tensor and "a.b" another: split, one would be the other's parent: the keys stay whole
    torch.save({"a": torch.ones(1), "a.b": torch.ones(1)}, tmp_path / "b.pt")
    ck = ckpt_tool.open(str(tmp_path / "b.pt"))
    assert sorted(leaf.keys for leaf in ck.leaves) == [("a",), ("a.b",)]


def test_a_bin_and_its_safetensors_twin_diff_the_same(tmp_path):
    r = run("convert", FIXTURES / "torch_hf_bin_sharded", tmp_path / "st", "--to", "safetensors")
    assert r.returncode == 0, r.stderr
    assert "model.safetensors" in os.listdir(tmp_path / "st")
    r = run("diff", "--values", FIXTURES / "torch_hf_bin_sharded" / "pytorch_model-00001-of-00003.bin",
            tmp_path / "st", "--filter", "model/embed_tokens/**")
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_directory_of_unrelated_files_keys_each_by_its_stem(tmp_path):
    import torch

    import ckpt_tool

    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    torch.save({"step": 7, "m": torch.zeros(3)}, tmp_path / "optimizer.pt")
    (tmp_path / "notes.txt").write_text("x")
    ck = ckpt_tool.open(str(tmp_path))
    assert sorted(leaf.path for leaf in ck.leaves) == ["model/w", "optimizer/m", "optimizer/step"]
    assert any("other files (ignored): notes.txt" in n for n in ck.notes)


def test_safetensors_beside_a_bin_is_read_as_safetensors(tmp_path):
    shutil.copytree(FIXTURES / "safetensors_llama_bf16", tmp_path / "hf")
    shutil.copy(FIXTURES / "torch_hf_bin_single" / "pytorch_model.bin", tmp_path / "hf")
    r = run("inspect", "--json", tmp_path / "hf")
    assert r.returncode == 0 and json.loads(r.stdout)["format"] == "safetensors"


def _set_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "set"
    shutil.copytree(FIXTURES / "torch_hf_bin_sharded", dst)
    return dst


@pytest.mark.slow
def test_a_set_with_a_shard_missing_is_incomplete_and_not_converted(tmp_path):
    d = _set_copy(tmp_path)
    (d / "pytorch_model-00003-of-00003.bin").unlink()
    r = run("inspect", "--json", d)
    assert r.returncode == 0
    doc = json.loads(r.stdout)
    assert doc["status"] == "incomplete"
    assert doc["missing"][0]["file"] == "pytorch_model-00003-of-00003.bin" and doc["missing"][0]["leaves"]
    r = run("convert", d, tmp_path / "out", "--to", "safetensors")
    assert r.returncode == 1 and "pytorch_model-00003-of-00003.bin" in one_line(r)
    assert not (tmp_path / "out").exists()
    # without the index too: the set's own names say a shard is missing
    (d / "pytorch_model.bin.index.json").unlink()
    r = run("validate", "--json", d)
    assert r.returncode == 1
    assert [(f["code"], f["file"]) for f in json.loads(r.stdout)["findings"]] == [
        ("missing-file", "pytorch_model-00003-of-00003.bin")]


def test_a_name_in_two_shards_is_an_error(tmp_path):
    import torch

    d = tmp_path / "dup"
    d.mkdir()
    torch.save({"w": torch.ones(2)}, d / "m-00001-of-00002.bin")
    torch.save({"w": torch.zeros(2)}, d / "m-00002-of-00002.bin")
    r = run("inspect", d)
    assert r.returncode == 1 and "'w' is stored in both m-00001-of-00002.bin and m-00002-of-00002.bin" in one_line(r)
    r = run("validate", "--json", d)
    assert {f["code"] for f in json.loads(r.stdout)["findings"]} == {"chunk-overlap"}


def _flip_in_member(path: Path, member_suffix: str, at: int = 0) -> None:
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(member_suffix))
    data = bytearray(path.read_bytes())
    name_len, extra_len = int.from_bytes(data[info.header_offset + 26: info.header_offset + 28], "little"), \
        int.from_bytes(data[info.header_offset + 28: info.header_offset + 30], "little")
    data[info.header_offset + 30 + name_len + extra_len + at] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_deep_finds_a_flipped_bit_in_bytes_no_view_reads(tmp_path):
    """`rows`, `col` and `transposed` are views of one storage; a bit flipped in a part of it that
    no view reads is still found by --deep (the member's CRC-32), and only there."""
    import torch

    base = torch.arange(16, dtype=torch.float32)
    torch.save({"head": base[:4]}, tmp_path / "v.pt")  # the storage holds 16 floats, the tensor 4
    with zipfile.ZipFile(tmp_path / "v.pt") as zf:
        key = next(i.filename for i in zf.infolist() if "/data/" in i.filename).rsplit("/", 1)[1]
    _flip_in_member(tmp_path / "v.pt", f"/data/{key}", at=60)  # in float 15: outside the view
    assert run("validate", "--strict", tmp_path / "v.pt").returncode == 0
    r = run("validate", "--deep", "--json", tmp_path / "v.pt")
    assert r.returncode == 1
    [finding] = json.loads(r.stdout)["findings"]
    assert finding["code"] == "bad-chunk" and "CRC-32" in finding["message"]


@pytest.mark.serial
def test_a_tensor_larger_than_memory_streams_in_bands(tmp_path):
    """A 48 MiB tensor converted and deep-validated under --memory 16MiB: the peak stays far below
    the tensor (the scheduler reads it in bands by byte range)."""
    import torch

    torch.manual_seed(0)
    torch.save({"big": torch.randn(3 * 1024, 4096), "small": torch.ones(3)}, tmp_path / "big.pt")
    torch.save({"big": torch.randn(4, 4), "small": torch.ones(3)}, tmp_path / "tiny.pt")

    def commands(name: str) -> dict[str, list]:
        return {"convert": ["convert", tmp_path / f"{name}.pt", tmp_path / f"out_{name}", "--to", "safetensors",
                            "--memory", "16MiB"],
                "validate": ["validate", "--deep", "--memory", "16MiB", tmp_path / f"{name}.pt"]}

    # each command on the 48 MiB tensor against the same on a 4x4 one (what both import is in both):
    # within the 16 MiB budget + the band the scheduler holds past it, far below the tensor
    large, tiny = commands("big"), commands("tiny")
    grew = {c: peak_rss_mib(*large[c]) - peak_rss_mib(*tiny[c]) for c in large}
    assert all(mib < 40 for mib in grew.values()), grew
    r = run("diff", "--values", tmp_path / "big.pt", tmp_path / "out_big")
    assert r.returncode == 0, r.stdout + r.stderr


def test_inspect_and_validate_import_no_torch():
    code = (
        "import sys\nfrom ckpt_tool.cli.main import main\n"
        "for args in (['inspect', sys.argv[1]], ['validate', '--deep', sys.argv[1]], ['inspect', sys.argv[2]]):\n"
        "    try:\n        main(args)\n    except SystemExit as e:\n        assert e.code == 0, (args, e.code)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'jax', 'transformers', 'safetensors')]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(FIXTURES / "torch_hf_bin_sharded"),
                        str(FIXTURES / "torch_state" / "state.pt")], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0, r.stderr


def test_deep_does_not_read_a_tensor_the_shallow_checks_found_unreadable(tmp_path):
    # found by fuzzing: a tensor whose claim the shallow checks refuse (here torch.save's own output,
    # 2**62 elements over a 1-element storage) was named by its dotted name, not by its leaf path
    # ('layer/huge'), so --deep did not skip it and split the claim into 32 MB blocks forever
    import torch

    torch.save({"w": torch.ones(3), "layer.huge": torch.ones(1).expand(2**31, 2**31)}, tmp_path / "big.pt")
    r = subprocess.run([sys.executable, "-m", "ckpt_tool", "validate", "--deep", "--json", str(tmp_path / "big.pt")],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 1, r.stderr
    [finding] = json.loads(r.stdout)["findings"]
    assert (finding["code"], finding["leaf"]) == ("bad-metadata", "layer/huge")
    assert "implausibly large" in finding["message"]


def test_a_storage_member_with_another_compression_method_fails_shallow_validate(tmp_path):
    # found by fuzzing: the central directory's method of a storage member changed (93, not a method
    # miniz knows): torch.load fails, ckpt's shallow validate passed it (only a read refused it)
    import torch

    import fuzz_lib

    torch.save({"a": torch.arange(6.0), "b": torch.ones(2)}, tmp_path / "m.pt")
    data = (tmp_path / "m.pt").read_bytes()
    member = fuzz_lib.parse_torch_zip(data).member("data/0")
    (tmp_path / "m.pt").write_bytes(fuzz_lib._patch(data, member.central_at + 10, 2, 93))
    with pytest.raises(RuntimeError, match="unsupported method"):
        torch.load(tmp_path / "m.pt", weights_only=True)
    r = run("validate", "--json", tmp_path / "m.pt")
    assert r.returncode == 1
    [finding] = json.loads(r.stdout)["findings"]
    assert finding["code"] == "bad-metadata" and finding["leaf"] == "a"
    assert "compressed (method 93)" in finding["message"]


def test_a_file_whose_zip_version_python_does_not_know_is_read_by_its_path(tmp_path):
    # found by fuzzing: 'version needed to extract' 6.4 in data.pkl's central entry (miniz ignores
    # it; torch.load reads the file): Python's zipfile, asked whether the file holds a data.pkl,
    # raised NotImplementedError, an internal error for inspect / validate of the file by its path
    import torch

    import fuzz_lib

    torch.save({"a": torch.arange(6.0)}, tmp_path / "m.pt")
    data = (tmp_path / "m.pt").read_bytes()
    member = fuzz_lib.parse_torch_zip(data).member("data.pkl")
    (tmp_path / "m.pt").write_bytes(fuzz_lib._patch(data, member.central_at + 6, 2, 64))
    assert torch.load(tmp_path / "m.pt", weights_only=True)["a"].tolist() == [0, 1, 2, 3, 4, 5]
    for args in (["inspect", "--json"], ["validate", "--deep"]):
        r = run(*args, tmp_path / "m.pt")
        assert r.returncode == 0, r.stderr

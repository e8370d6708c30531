"""torch.save views whose logical size is far above their stored bytes (issue 29).

torch.save writes a view as its storage plus (offset, size, stride): `expand` (stride 0) and
`as_strided` with strides below the contiguous ones (overlapping elements) are tiny on disk and
huge logically, and many views may share one storage (tied weights). Cost must follow the stored
bytes: validate --deep checks the values such a view draws from, once, never its logical size;
a read takes a view's values from its storage read once. Every file here is written by torch, and
every value is compared with what torch.load gives.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
ROOT = Path(__file__).resolve().parents[3]


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "CKPT_DEBUG"}
    return subprocess.run([sys.executable, "-m", "ckpt_tool", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=environ, timeout=timeout)


def _tib_expand(path: Path) -> None:
    import torch

    # 1.5 KB on disk, 2**38 float32 elements (1 TiB) logically
    torch.save({"w": torch.zeros(1, 1).expand(2**20, 2**18)}, path)


def _counting_reads(archive) -> list[int]:  # noqa: ANN001 - reader.Archive
    """Bytes of every read the archive makes of its file from now on (instrumentation only:
    the reads still go to the real file)."""
    sizes: list[int] = []
    fetch, fetch_into = archive.fetch, archive.fetch_into

    def counted_fetch(start: int, end: int) -> bytes:
        sizes.append(end - start)
        return fetch(start, end)

    def counted_fetch_into(start: int, buffer) -> None:  # noqa: ANN001
        sizes.append(len(buffer))
        fetch_into(start, buffer)

    archive.fetch, archive.fetch_into = counted_fetch, counted_fetch_into
    return sizes


def test_validate_deep_of_a_tib_expand_reads_its_stored_bytes_in_seconds(tmp_path):
    import torch

    path = tmp_path / "expand.pt"
    _tib_expand(path)
    assert path.stat().st_size < 4096
    # torch loads it (so validate must say OK), as a view of one stored element
    loaded = torch.load(path, weights_only=True)["w"]
    assert tuple(loaded.shape) == (2**20, 2**18) and loaded.stride() == (0, 0)
    started = time.monotonic()
    # (before issue 29 this read the 1 TiB view: about 35 minutes)
    r = run("validate", "--deep", "--json", path, timeout=60)
    seconds = time.monotonic() - started
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] and not report["findings"], report
    assert report["checked"]["bytes_read"] == 4
    assert seconds < 30
    # inspect still shows the logical tensor
    r = run("inspect", "--json", path)
    shown = json.loads(r.stdout)
    [leaf] = shown["leaves"]
    assert leaf["shape"] == [2**20, 2**18] and leaf["nbytes"] == 2**40
    # and says that it is a view of 4 stored bytes
    assert "w: a view of 4 stored bytes (stride 0), 1,099,511,627,776 bytes logically" in shown["notes"]


def test_validate_deep_reports_a_damaged_storage_under_a_stride0_view(tmp_path):
    import torch

    path = tmp_path / "expand.pt"
    torch.save({"w": torch.tensor([1.5, 2.5]).expand(2**20, 2**16, 2)}, path)  # 1 TiB logical
    data = bytearray(path.read_bytes())
    stored = np.array([1.5, 2.5], dtype="<f4").tobytes()
    at = data.index(stored)
    data[at] ^= 0x01  # one bit of the stored values (the member's CRC-32 no longer matches)
    path.write_bytes(bytes(data))
    r = run("validate", "--deep", "--json", path, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    findings = json.loads(r.stdout)["findings"]
    assert any(f["code"] == "bad-chunk" and f["leaf"] == "w" and "CRC-32" in f["message"] for f in findings), findings
    # the file cut inside the storage: found by the shallow checks, still in seconds
    cut = tmp_path / "cut.pt"
    cut.write_bytes(bytes(data[: at + 4]))
    r = run("validate", "--deep", "--json", cut, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert any(f["code"] == "truncated-file" for f in json.loads(r.stdout)["findings"])


def _views(tmp_path: Path) -> Path:
    import torch

    torch.manual_seed(0)
    base = torch.randn(4096)
    big = torch.randn(1 << 20)  # 4 MiB
    state = {
        "expand_row": torch.arange(6, dtype=torch.float32).reshape(1, 6).expand(300, 6),
        "expand_inner": torch.randn(5, 1, 3).expand(5, 70, 3),
        "expand_bf16": torch.randn(7).to(torch.bfloat16).expand(40, 7),
        "overlap": torch.as_strided(base, (2000, 300), (1, 1)),
        "overlap_2": torch.as_strided(base, (100, 50), (2, 3), 7),
        "tied": base,
        "tied_rows": base.view(64, 64),
        "tied_t": base.view(64, 64).t(),
        # a view at a large offset into a large storage, repeated
        "far_expand": big[(1 << 20) - 8:].expand(3000, 8),
        "far_rows": big.view(1024, 1024)[1000:],
        "int_expand": torch.tensor([3, -4], dtype=torch.int64).expand(9, 2),
    }
    path = tmp_path / "views.pt"
    torch.save(state, path)
    return path


def test_views_read_what_torch_load_gives(tmp_path):
    import torch

    import ckpt_tool

    path = _views(tmp_path)
    want = torch.load(path, weights_only=True)
    ck = ckpt_tool.open(str(path))
    leaves = {leaf.name: leaf for leaf in ck.arrays()}
    assert set(leaves) == set(want)
    for name, tensor in want.items():
        t = tensor.contiguous()
        expected = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
        got = leaves[name].read()
        assert got.shape == expected.shape and got.tobytes() == expected.tobytes(), name
        # and a region inside it
        region = tuple(slice(n // 3, max(n // 3 + 1, 2 * n // 3)) for n in t.shape)
        assert leaves[name].read(region).tobytes() == np.ascontiguousarray(expected[region]).tobytes(), name


def test_a_repeating_view_read_in_bands_reads_its_storage_once(tmp_path):
    import torch

    import ckpt_tool

    path = tmp_path / "rows.pt"
    row = torch.randn(1 << 20)  # 4 MiB stored
    torch.save({"e": row.expand(16, row.numel())}, path)  # 64 MiB logical
    ck = ckpt_tool.open(str(path))
    [leaf] = ck.arrays()
    reads = _counting_reads(leaf.reader._archive)
    expected = row.numpy()
    for i in range(16):  # a band of rows at a time, as the scheduler streams it
        band = leaf.read((slice(i, i + 1), slice(0, row.numel())))
        assert band.tobytes() == expected.tobytes()
    # before issue 29 every band read the stored row again: 16 x 4 MiB
    assert sum(reads) <= (1 << 22) + (64 << 10), reads


def test_tied_views_read_their_storage_once(tmp_path):
    import torch

    import ckpt_tool

    path = tmp_path / "tied.pt"
    base = torch.randn(1 << 18)  # 1 MiB
    torch.save({"flat": base, "rows": base.view(512, 512), "cols": base.view(512, 512).t(),
                "half": base[: 1 << 17]}, path)
    want = torch.load(path, weights_only=True)
    ck = ckpt_tool.open(str(path))
    leaves = ck.arrays()
    reads = _counting_reads(leaves[0].reader._archive)
    for leaf in leaves:
        assert leaf.read().tobytes() == want[leaf.name].contiguous().numpy().tobytes(), leaf.name
    assert sum(reads) <= (1 << 20) + (64 << 10), reads  # one read of the storage, not one per view


def test_non_finite_counts_of_views_are_torch_counts(tmp_path):
    import torch

    path = tmp_path / "nan.pt"
    row = torch.tensor([1.0, float("nan"), float("inf"), 2.0])
    base = torch.tensor([0.0, float("nan"), 1.0, 2.0, 3.0])
    torch.save({"e": row.expand(1000, 4), "o": torch.as_strided(base, (3, 3), (1, 1))}, path)
    want = torch.load(path, weights_only=True)
    r = run("validate", "--deep", "--json", path)
    assert r.returncode == 0, r.stdout + r.stderr
    found = {f["leaf"]: f["message"] for f in json.loads(r.stdout)["findings"] if f["code"] == "non-finite"}
    e = want["e"]
    # an expand: its logical counts, as torch counts them
    assert found["e"] == f"{int(torch.isnan(e).sum())} NaN and {int(torch.isinf(e).sum())} Inf values"
    # overlapping strides repeat values unevenly: the stored values it spans are counted
    assert found["o"] == "1 NaN and 0 Inf among the 5 stored values it spans"


@pytest.mark.slow
def test_convert_of_an_expanded_tensor_equals_torch_values(tmp_path):
    import torch
    from safetensors.numpy import load_file

    path = tmp_path / "mid.pt"
    # 64 MiB logical from 16 stored bytes, plus an overlapping view and a tied pair
    base = torch.randn(1000)
    torch.save({"w": torch.arange(4.0).expand(2**12, 2**10, 4), "o": torch.as_strided(base, (500, 400), (1, 1)),
                "t": base, "t2": base.view(10, 100)}, path)
    want = torch.load(path, weights_only=True)
    out = tmp_path / "out"
    started = time.monotonic()
    r = run("convert", "--to", "safetensors", "--memory", "32MiB", path, out)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - started < 120
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    assert set(got) == set(want)
    for name, tensor in want.items():
        np.testing.assert_array_equal(got[name], tensor.contiguous().numpy(), err_msg=name)

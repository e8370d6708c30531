"""The read scheduler (ckpt_tool/scheduler/): stored chunks larger than --memory.

The fixtures are written by real orbax (one device: each array one zarr
chunk, as orbax saves an unsharded array) and by torch.distributed.checkpoint
(a whole tensor per chunk), in a tmp dir. Their 24 MiB chunk is three times
a --memory of 8 MiB, so it is decoded as a stream (zstd, read in byte-range
windows). Every command's output is compared with the libraries' own
readers; the storage read log shows each stored chunk fetched once; the
peak RSS of a streamed convert stays below what one whole decode would take.
"""
from __future__ import annotations

import json
import math
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import ckpt_tool
from ckpt_tool.cli.main import cli
from ckpt_tool.core.codecs import window_bytes
from ckpt_tool.base.errors import CkptError
from ckpt_tool.formats import open_checkpoint
from ckpt_tool.scheduler import Scheduler, Want, parse_memory
from ckpt_tool.storage import ReadLog

from conftest import ROOT
from library_reference import dcp_values, orbax_values

runner = CliRunner()
MEMORY = "8MiB"

GEN = r'''
import os, sys, json
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
import warnings; warnings.filterwarnings("ignore")
import numpy as np, jax, orbax.checkpoint as ocp, torch
import torch.distributed.checkpoint as dcp
out = sys.argv[1]
rng = np.random.default_rng(13)
big = rng.standard_normal((1536, 4096), dtype=np.float32)   # 24 MiB: one stored chunk
big[::7] = 0.0                                               # some rows compress well
odd = rng.standard_normal((301, 1003)).astype(np.float32)    # 1.2 MiB, odd sizes
small = np.arange(12, dtype=np.float32).reshape(3, 4)
tree = {"big": jax.device_put(big), "odd": jax.device_put(odd), "small": small}
ck = ocp.StandardCheckpointer(); ck.save(os.path.join(out, "ocdbt"), tree); ck.wait_until_finished()
plain = ocp.Checkpointer(ocp.StandardCheckpointHandler(use_ocdbt=False))
plain.save(os.path.join(out, "plain"), {"big": big, "odd": odd, "small": small})
state = {"big": torch.from_numpy(big.copy()), "odd": torch.from_numpy(odd.copy()), "small": torch.from_numpy(small.copy())}
dcp.save(state, checkpoint_id=os.path.join(out, "dcp"))
changed = big.copy(); changed[1000, 17] += 1.0
state["big"] = torch.from_numpy(changed)
dcp.save(state, checkpoint_id=os.path.join(out, "dcp_changed"))
# a 96 MiB chunk for the memory bound
huge = rng.standard_normal((4096, 6144), dtype=np.float32)
ck.save(os.path.join(out, "huge"), {"huge": huge}); ck.wait_until_finished()
# several such chunks, streamed at once by the workers
several = {f"w{i}": rng.standard_normal((2048, 6144), dtype=np.float32) for i in range(4)}
ck.save(os.path.join(out, "several"), several); ck.wait_until_finished()
'''


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sched")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-c", GEN, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _cli(*args: str) -> dict:
    res = runner.invoke(cli, [*args, "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def _same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        a, b = np.asarray(got[k]), np.asarray(want[k])
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), k


def _regions(shape, rows, cols=None):
    for r in range(0, shape[0], rows):
        for c in range(0, shape[1], cols or shape[1]):
            yield (slice(r, min(r + rows, shape[0])), slice(c, min(c + (cols or shape[1]), shape[1])))


# -- the scheduler itself -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ocdbt", "plain"])
def test_each_stored_chunk_fetched_once(ckpts, layout):
    log = ReadLog()
    ck = open_checkpoint(str(ckpts / layout), log=log)
    reference = orbax_values(ckpts / layout)
    big = ck["big"]
    got = {}

    def keep(key):
        def deliver(arrays):
            got[key] = arrays[0].copy()
            return arrays[0].nbytes
        return deliver

    # output regions: row blocks of one leaf, column blocks (they need every row) of the other
    wants = [Want([(big, reg)], keep(("big", reg[0].start, reg[1].start)), keeps=True) for reg in _regions(big.shape, 100)]
    odd = ck["odd"]
    wants += [Want([(odd, reg)], keep(("odd", reg[0].start, reg[1].start))) for reg in _regions(odd.shape, 64, 250)]
    sched = Scheduler(wants, memory=parse_memory(MEMORY), workers=2)
    sched.run()
    # decoded once each, the 24 MiB one as a stream
    assert dict(sched.stats.decodes) == {("big", 0): 1, ("odd", 0): 1}
    assert ("big", 0) in sched.stats.streamed
    # its compressed bytes fetched once: one read per window, no whole-value read
    key = "big/0.0"
    size = None
    for k, n in log.reads.items():
        if k.endswith(key):
            size = n
    assert size is not None, dict(log.reads)
    stored = _stored_size(ckpts / layout, layout)
    assert size == math.ceil(stored / window_bytes(parse_memory(MEMORY))), (size, stored)
    for (name, r, c), arr in got.items():
        want = np.asarray(reference[(name,)])[r : r + arr.shape[0], c : c + arr.shape[1]]
        assert arr.tobytes() == want.tobytes(), (name, r, c)
    assert len(got) == len(wants)


def _stored_size(path: Path, layout: str) -> int:
    if layout == "plain":
        return (path / "big" / "0.0").stat().st_size
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": str(path) + "/"}}).result()
    return len(kv.read("big/0.0").result().value)


@pytest.mark.slow
def test_passes_when_the_regions_of_a_streamed_chunk_do_not_fit(ckpts):
    """Columns of a chunk streamed by rows each need every row: they are served in passes."""
    ck = ckpt_tool.open(str(ckpts / "ocdbt"))
    big = ck["big"]
    seen = []
    wants = [Want([(big, reg)], lambda a, reg=reg: seen.append((reg, a[0].sum(dtype=np.float64))) or 0)
             for reg in _regions(big.shape, big.shape[0], 512)]  # 8 columns of 3 MiB
    sched = Scheduler(wants, memory=parse_memory(MEMORY), workers=2)
    sched.run()
    assert len(seen) == 8
    assert sched.stats.decodes[("big", 0)] == sched.stats.passes > 1
    # the budget held: assembly buffers, bands and windows within 8 MiB
    assert sched.stats.peak_bytes <= parse_memory(MEMORY)
    full = big.read()
    for reg, total in seen:
        assert total == full[reg].sum(dtype=np.float64)


def test_a_chunk_over_an_eighth_of_the_budget_is_streamed_first(ckpts):
    """`big` (24 MiB, 48 MiB to decode whole) fits a 64 MiB budget, but would hold three quarters of
    it while one thread decodes it: it is streamed instead (planning.streams_by_choice), decoded
    once, started before the others, and reported as not decoded whole (so a format's verifier
    checks it, as for a chunk over the budget). At 256 MiB it is an eighth at most: decoded whole."""
    ck = ckpt_tool.open(str(ckpts / "ocdbt"))
    reference = orbax_values(ckpts / "ocdbt")
    for memory, streamed in (("64MiB", True), ("256MiB", False)):
        got: dict[str, np.ndarray] = {}
        wants = [Want([(ck[name], tuple(slice(0, n) for n in ck[name].shape))],
                      lambda a, name=name: got.__setitem__(name, a[0].copy()) or 0, keeps=True)
                 for name in ("small", "odd", "big")]  # `big` last in the consumers' order
        sched = Scheduler(wants, memory=parse_memory(memory), workers=2)
        sched.run()
        assert (("big", 0) in sched.stats.streamed) is streamed, memory
        assert sched.stats.decodes[("big", 0)] == 1 and set(sched.stats.decodes.values()) == {1}
        assert sched.decodes_whole(ck["big"], 0) is not streamed
        first = sched.plan.units[0]
        assert (first.streamed and first.lc.leaf.path == "big") is streamed, memory
        _same({(k,): v for k, v in got.items()}, reference)


def test_default_memory_follows_the_copy_workers():
    from ckpt_tool.scheduler import default_memory

    MiB = 2**20
    gib = 1024 * MiB
    assert default_memory(workers=4, machine=24 * gib) == 512 * MiB  # 2 cores: as before
    assert default_memory(workers=1, machine=24 * gib) == 512 * MiB  # never below
    assert default_memory(workers=13, machine=40 * gib) == 13 * 128 * MiB  # a 13-core TPU VM
    assert default_memory(workers=16, machine=40 * gib) == 2 * gib
    assert default_memory(workers=64, machine=512 * gib) == 2 * gib  # at most 2 GiB
    assert default_memory(workers=16, machine=8 * gib) == gib  # at most an eighth of the machine
    assert default_memory(workers=16, machine=2 * gib) == 512 * MiB  # ... but never below 512 MiB
    assert default_memory(workers=16, machine=0) == 2 * gib  # the machine's memory unknown
    from ckpt_tool.scheduler.admission import machine_memory

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < machine_memory() <= physical  # the RAM, or a lower cgroup limit


def test_parse_memory():
    assert parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("512MB") == 512 * 10**6
    assert parse_memory("2G") == 2 * 2**30
    with pytest.raises(CkptError, match="--memory"):
        parse_memory("lots")
    with pytest.raises(CkptError, match="at least"):
        parse_memory("1KiB")


# -- the commands ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ocdbt", "plain"])
def test_convert_to_dcp_exact(ckpts, tmp_path, layout):
    dst = tmp_path / "out"
    summary = _cli("convert", str(ckpts / layout), str(dst), "--to", "dcp", "--memory", MEMORY)
    assert summary["bytes"] == sum(np.asarray(v).nbytes for v in orbax_values(ckpts / layout).values())
    _same(dcp_values(dst), orbax_values(ckpts / layout))


def test_dcp_whole_tensor_chunk_to_orbax_exact(ckpts, tmp_path):
    dst = tmp_path / "out"
    _cli("convert", str(ckpts / "dcp"), str(dst), "--to", "orbax", "--memory", MEMORY)
    _same(orbax_values(dst), dcp_values(ckpts / "dcp"))


class _BytesRead:
    """Bytes read per key through the Storage layer (the real reads, counted on the way)."""

    def __init__(self, monkeypatch) -> None:
        from ckpt_tool.storage import Storage

        self.bytes: dict[str, int] = {}
        read_range, read_range_into = Storage.read_range, Storage.read_range_into

        def counted_range(storage, key, start, end):
            self.bytes[key] = self.bytes.get(key, 0) + end - start
            return read_range(storage, key, start, end)

        def counted_into(storage, key, start, buffer):
            self.bytes[key] = self.bytes.get(key, 0) + memoryview(buffer).nbytes
            return read_range_into(storage, key, start, buffer)

        monkeypatch.setattr(Storage, "read_range", counted_range)
        monkeypatch.setattr(Storage, "read_range_into", counted_into)

    def distcp(self) -> int:
        return sum(n for k, n in self.bytes.items() if k.endswith(".distcp"))


def _distcp_size(path: Path) -> int:
    """The .distcp bytes, plus the small reads of zip records (locating a payload, checking an entry's end)."""
    return sum(f.stat().st_size for f in path.glob("*.distcp")) + 2**20


def test_dcp_chunk_over_the_budget_is_read_once_by_deep_validate(ckpts, monkeypatch):
    """--deep reads a DCP chunk larger than --memory in bands; its CRC-32 is put
    together from the bands, not checked by reading the chunk a second time."""
    counted = _BytesRead(monkeypatch)
    doc = _cli("validate", str(ckpts / "dcp"), "--deep", "--memory", MEMORY)
    assert doc["ok"], doc
    assert 24 * 2**20 < counted.distcp() <= _distcp_size(ckpts / "dcp"), counted.bytes


# 8 MiB: the 24 MiB chunk is over the budget; 64 MiB: it fits, and is streamed by choice (an eighth)
@pytest.mark.parametrize("memory", [MEMORY, "64MiB"])
def test_dcp_chunk_over_the_budget_with_a_flipped_bit_fails_its_crc(ckpts, tmp_path, monkeypatch, memory):
    bad = tmp_path / "dcp"
    shutil.copytree(ckpts / "dcp", bad)
    (data,) = [f for f in bad.glob("*.distcp") if f.stat().st_size > 24 * 2**20]
    with open(data, "r+b") as f:  # inside the 24 MiB tensor's bytes, far from its zip records
        f.seek(f.seek(0, os.SEEK_END) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    counted = _BytesRead(monkeypatch)
    res = runner.invoke(cli, ["validate", str(bad), "--deep", "--memory", memory, "--json"])
    assert res.exit_code == 1, res.output
    (problem,) = [f for f in json.loads(res.output)["findings"] if f["severity"] == "error"]
    assert problem["code"] == "bad-chunk" and "CRC-32" in problem["message"] and problem["leaf"] == "big"
    assert counted.distcp() <= _distcp_size(bad)
    # convert refuses it too, in one line, leaving no output
    proc = subprocess.run([sys.executable, "-m", "ckpt_tool", "convert", str(bad), str(tmp_path / "out"), "--to",
                           "orbax", "--memory", memory], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "CRC-32" in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == ["dcp"]


def test_dcp_chunk_served_in_passes_is_read_once(ckpts, tmp_path, monkeypatch):
    """A DCP chunk is read by byte ranges: when its output regions are served in
    several passes (a budget smaller than their assembly buffers), each pass
    reads its own bands, not the chunk from its first row again."""
    counted = _BytesRead(monkeypatch)
    dst = tmp_path / "out"
    _cli("convert", str(ckpts / "dcp"), str(dst), "--to", "orbax", "--memory", "16MiB")
    assert counted.distcp() <= _distcp_size(ckpts / "dcp"), counted.bytes
    _same(orbax_values(dst), dcp_values(ckpts / "dcp"))


@pytest.mark.slow
def test_reshard_exact(ckpts, tmp_path):
    from test_reshard import _restore

    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([["big", [None, "model"]], [".*", []]]))
    dst = tmp_path / "out"
    plan = _cli("reshard", str(ckpts / "ocdbt"), str(dst), "--mesh", "data=2,model=4", "--devices", "8",
                "--rules", str(rules), "--memory", MEMORY, "--dry-run")
    big = next(lp for lp in plan["leaves"] if lp["leaf"] == "big")
    assert big["source_chunks"] == 1 and big["streamed_chunks"] == 1 and plan["memory"] == 8 * 2**20
    assert plan["processes"][0]["bytes_read"] == sum(
        np.asarray(v).nbytes for v in orbax_values(ckpts / "ocdbt").values())  # each source chunk once
    _cli("reshard", str(ckpts / "ocdbt"), str(dst), "--mesh", "data=2,model=4", "--devices", "8",
         "--rules", str(rules), "--memory", MEMORY)
    (result,) = _restore([{"dst": str(dst), "src": str(ckpts / "ocdbt"), "modes": ["target"]}])
    assert result["shards"] > 0


def test_validate_deep(ckpts):
    for name in ("ocdbt", "plain", "dcp"):
        res = runner.invoke(cli, ["validate", str(ckpts / name), "--deep", "--memory", MEMORY, "--json"])
        assert res.exit_code == 0, res.output
        doc = json.loads(res.output)
        assert doc["ok"], doc
        # each stored chunk read once (not once per 32 MiB block, as before)
        assert doc["checked"]["chunks_read"] == 3, doc["checked"]


def test_diff_values(ckpts):
    res = runner.invoke(cli, ["diff", str(ckpts / "ocdbt"), str(ckpts / "dcp"), "--values", "--memory", MEMORY, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["same"]
    res = runner.invoke(cli, ["diff", str(ckpts / "plain"), str(ckpts / "dcp_changed"), "--values", "--memory", MEMORY, "--json"])
    assert res.exit_code == 1, res.output
    (d,) = json.loads(res.output)["differences"]
    assert d["path"] == "big" and d["mismatched"] == 1 and d["max_abs"] == pytest.approx(1.0, abs=1e-3)


def test_streamed_chunk_goes_to_dcp_band_by_band_without_a_copy(ckpts, tmp_path, monkeypatch):
    """Converting to DCP, a stored chunk too large to decode whole is split into pieces of one
    band each, so every decoded band is handed to the writer as it is: the executor makes no
    buffer of its own (no assembly, no copy) for any of its pieces. The values are torch's."""
    from ckpt_tool.scheduler import band_bytes, execution

    made: list[tuple[int, ...]] = []
    pool = execution.POOL

    class Recording:
        def empty(self, shape, dtype):
            made.append(tuple(shape))
            return pool.empty(shape, dtype)

    monkeypatch.setattr(execution, "POOL", Recording())
    # 32 MiB: `big` (24 MiB, 48 MiB to decode whole) is streamed in 2 MiB bands, where the
    # largest output chunk the budget allows (engine.output_chunk_limit) is 4 MiB
    memory = "32MiB"
    _cli("convert", str(ckpts / "ocdbt"), str(tmp_path / "o"), "--to", "dcp", "--memory", memory)
    rows = band_bytes(parse_memory(memory)) // (4096 * 4)
    assert all(shape[1:] != (4096,) for shape in made), made  # nothing made for `big`'s pieces
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(tmp_path / "o")).read_metadata().state_dict_metadata["big"]
    sizes = sorted({tuple(c.sizes)[0] for c in meta.chunks})
    assert len(meta.chunks) == -(-1536 // rows) and sizes[-1] == rows, sizes
    _same(dcp_values(tmp_path / "o"), orbax_values(ckpts / "ocdbt"))


@pytest.mark.slow
def test_unstreamable_codec_names_the_memory_needed(ckpts, tmp_path):
    """A chunk too large for the budget whose codec has no streaming decoder (blosc): one line, exit 1."""
    import tensorstore as ts

    src = tmp_path / "blosc"
    shutil.copytree(ckpts / "plain", src)
    data = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(src / "big") + "/"}}).result().read().result()
    shutil.rmtree(src / "big")
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(src / "big") + "/"},
            "metadata": {"shape": list(data.shape), "chunks": list(data.shape), "dtype": "<f4",
                         "compressor": {"id": "blosc", "cname": "lz4", "clevel": 5, "shuffle": 1}}}
    ts.open(spec, create=True).result().write(data).result()
    res = subprocess.run([sys.executable, "-m", "ckpt_tool", "convert", str(src), str(tmp_path / "o"), "--to", "dcp",
                          "--memory", MEMORY], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--memory" in lines[0] and "blosc" in lines[0], res.stderr
    assert not (tmp_path / "o").exists()
    # with that budget it converts
    need = lines[0].split("--memory ")[1].split()[0]
    _cli("convert", str(src), str(tmp_path / "o"), "--to", "dcp", "--memory", need)
    _same(dcp_values(tmp_path / "o"), orbax_values(ckpts / "plain"))


def _peak_rss_kib(*args: str) -> int:
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, proc.stderr.read().decode()[-2000:]
    return usage.ru_maxrss


@pytest.mark.serial
def test_streamed_convert_memory_is_bounded(ckpts, tmp_path):
    """A 96 MiB stored chunk with --memory 16MiB: RSS grows by far less than one whole decode (192 MiB)."""
    base = _peak_rss_kib("inspect", str(ckpts / "huge"))
    peak = _peak_rss_kib("convert", str(ckpts / "huge"), str(tmp_path / "o"), "--to", "dcp", "--memory", "16MiB")
    assert (peak - base) * 1024 < 64 * 2**20, (peak, base)


@pytest.mark.serial
@pytest.mark.parametrize("command", ["validate", "reshard", "convert"])
def test_several_streamed_chunks_stay_within_the_budget(ckpts, tmp_path, command):
    """Four 48 MiB stored chunks with --memory 16MiB, streamed by 4 workers at once: what each
    stream holds (bands, assembly buffers, compressed windows) and what the Orbax writer holds
    (its window and the encoded copy) are counted in the budget, so RSS grows by about the
    budget over what the process holds anyway (an inspect of the same checkpoint)."""
    src = str(ckpts / "several")
    base = _peak_rss_kib("inspect", src)
    args = {
        "validate": ["validate", src, "--deep"],
        "reshard": ["reshard", src, str(tmp_path / "r"), "--mesh", "data=2,model=4", "--devices", "8"],
        "convert": ["convert", src, str(tmp_path / "d"), "--to", "dcp"],
    }[command]
    peak = _peak_rss_kib(*args, "--memory", "16MiB", "--workers", "4")
    assert (peak - base) * 1024 < 16 * 2**20 + 32 * 2**20, (peak, base)

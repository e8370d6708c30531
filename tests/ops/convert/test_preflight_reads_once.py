"""The preflight checks the checkpoint convert, reshard and diff opened, not its path again (issue 47
item 2): the source's metadata files are read once per run.

convert, reshard and diff open the source (formats.open_checkpoint), then run validate's shallow
checks on it before anything is written. Those checks start from the Storage the reader read
through and what it parsed (validate.validate_opened), so no metadata file of the source is read a
second time; what the checks alone read (a listing, an OCDBT B-tree walk, array_metadatas/) is
read once too. Counted here on the committed fixtures (written by orbax and torch), through every
Storage of the process, in one run each of the CLI.
"""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from conftest import fixture_path

from ckpt_tool.storage import Storage

# the metadata files each format's reader parses (an array's zarr metadata: every array's)
ORBAX_METADATA = ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "/zarr.json", "/.zarray")
DCP_METADATA = (".metadata",)


@pytest.fixture
def source_reads(monkeypatch):
    """Every read of a whole value (Storage.read, and reads started together: start_reads, read_many),
    as the URL of the value read, counted across every Storage of this process."""
    seen: Counter[str] = Counter()
    real_read, real_start = Storage._read, Storage.start_reads

    def _read(self, key, byte_range):  # noqa: ANN001, ANN202 - Storage._read's own
        if byte_range is None:
            seen[f"{self.url}/{key}"] += 1
        return real_read(self, key, byte_range)

    def start_reads(self, keys):  # noqa: ANN001, ANN202 - Storage.start_reads's own
        keys = list(keys)
        seen.update(f"{self.url}/{k}" for k in keys)
        return real_start(self, keys)

    monkeypatch.setattr(Storage, "_read", _read)
    monkeypatch.setattr(Storage, "start_reads", start_reads)
    return seen


def _metadata_reads(seen: Counter[str], source: Path, names: tuple[str, ...]) -> dict[str, int]:
    root = os.path.realpath(source)
    # (an OCDBT database's values are read through a view named `<directory> (ocdbt)`)
    return {url: n for url, n in seen.items()
            if os.path.realpath(url.replace(" (ocdbt)/", "/")).startswith(root + os.sep) and url.endswith(names)}


def _read_once(seen: Counter[str], source: Path, names: tuple[str, ...], at_least: int) -> None:
    reads = _metadata_reads(seen, source, names)
    assert len(reads) >= at_least, reads  # (the counter sees the source's metadata being read at all)
    twice = {url: n for url, n in reads.items() if n != 1}
    assert not twice, f"metadata of the source read more than once: {twice}"


def test_convert_of_an_orbax_step_reads_its_metadata_once(ckpt, source_reads, tmp_path):
    src = fixture_path("orbax_ocdbt_zarr3")
    r = ckpt("convert", str(src), str(tmp_path / "out"), "--to", "safetensors", "--skip-unsupported")
    assert r.returncode == 0, r.stderr
    # _CHECKPOINT_METADATA, _METADATA, _sharding and the zarr.json of each of its arrays
    _read_once(source_reads, src, ORBAX_METADATA, at_least=4)


def test_reshard_of_an_orbax_step_reads_its_metadata_once(ckpt, source_reads, tmp_path):
    src = fixture_path("orbax_ocdbt_zarr3")
    r = ckpt("reshard", str(src), str(tmp_path / "out"), "--mesh", "data=2", "--devices", "2")
    assert r.returncode == 0, r.stderr
    _read_once(source_reads, src, ORBAX_METADATA, at_least=4)


def test_reshard_of_an_orbax_manager_root_reads_no_metadata_beyond_its_open(ckpt, source_reads, tmp_path):
    """A CheckpointManager root: opening it reads a step's _CHECKPOINT_METADATA more than once (the
    run root's commit rule, the reader's list of steps, the step read); the preflight and the plan
    that follow read nothing of it again."""
    from ckpt_tool import formats

    src = fixture_path("orbax_manager")
    formats.open_checkpoint(str(src))
    opening = _metadata_reads(source_reads, src, ORBAX_METADATA)
    assert any(url.endswith("/2/state/_METADATA") for url in opening), opening  # step 2, the newest committed
    source_reads.clear()
    r = ckpt("reshard", str(src), str(tmp_path / "out"), "--mesh", "data=2", "--devices", "2")
    assert r.returncode == 0, r.stderr
    run = _metadata_reads(source_reads, src, ORBAX_METADATA)
    # each file as often as the open alone reads it; what only the checks read (the root's
    # metadata/_ROOT_METADATA), once
    again = {url: n for url, n in run.items() if n > opening.get(url, 1)}
    assert not again, f"read again after the open: {again}"
    assert set(opening) <= set(run)


@pytest.mark.parametrize("to", ["orbax", "safetensors"])
def test_convert_of_a_dcp_checkpoint_reads_its_metadata_once(ckpt, source_reads, tmp_path, to):
    src = fixture_path("dcp_multirank")
    r = ckpt("convert", str(src), str(tmp_path / "out"), "--to", to, "--skip-unsupported")
    assert r.returncode == 0, r.stderr
    _read_once(source_reads, src, DCP_METADATA, at_least=1)


def test_the_preflight_still_refuses_what_it_refused(ckpt, copy_fixture, tmp_path):
    """From the checkpoint opened, the refusal is the one line it was (a rank's data file lost)."""
    src = copy_fixture("dcp_multirank")
    (src / "__1_0.distcp").unlink()
    r = ckpt("convert", str(src), str(tmp_path / "out"), "--to", "orbax", "--skip-unsupported")
    assert r.returncode == 1
    assert r.stderr == (f"ckpt: error: {src}: the source is incomplete: missing-file: __1_0.distcp: data file is "
                        f"missing; run `ckpt validate {src}` for every finding\n")

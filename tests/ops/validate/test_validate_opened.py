"""validate_opened, the preflight's validate of a checkpoint opened already (convert, reshard, diff),
finds exactly what validate of its path finds: on every fixture of the catalogue's sample and on a
damaged copy of each damage case that still opens (one that does not open is validated by its path
by open_source's fallback, as before). It starts from the Storage the reader read through and what
the reader parsed (Checkpoint.storage, Checkpoint.parsed) and never falls back to the path here."""
from __future__ import annotations

import pytest

import catalogue as C
from conftest import SAMPLE_FIXTURES, fixture_path

from ckpt_tool import formats
from ckpt_tool.base.errors import CkptError
from ckpt_tool.ops import validate as V

DAMAGE = C.damage_cases()


def _same_findings(path: str, step: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        ck = formats.open_checkpoint(path, step=step, keep_parsed=True)
    except CkptError:
        return  # nothing opened: open_source's fallback validates the path (unchanged)
    assert ck.storage is not None
    chosen = ck.step if ck.steps else None  # (the preflight's: the step opened)
    with monkeypatch.context() as m:
        def by_path(*args: object, **kwargs: object) -> None:
            raise AssertionError(f"validate_opened validated {path} by its path")

        m.setattr(V, "validate_checkpoint", by_path)
        opened = V.validate_opened(ck, step=chosen).to_json()
    # what the preflight ran before: validate of the path the checkpoint names, at the step opened
    assert opened == V.validate_checkpoint(ck.path, step=chosen).to_json()


@pytest.mark.parametrize("name", SAMPLE_FIXTURES)
def test_a_fixture_opened_validates_as_its_path(name, monkeypatch):
    _same_findings(str(fixture_path(name)), None, monkeypatch)


@pytest.mark.parametrize("file", ["safetensors_numpy/model.safetensors", "flax_msgpack/checkpoint_2"])
def test_a_one_file_checkpoint_opened_validates_as_its_path(file, monkeypatch):
    """(checked through the Storage of its directory that the reader opened)"""
    _same_findings(str(fixture_path(file)), None, monkeypatch)


@pytest.mark.parametrize("damage", DAMAGE, ids=[d.id for d in DAMAGE])
def test_a_damaged_copy_opened_validates_as_its_path(damage, tmp_path, monkeypatch):
    path, _ = C.damaged_copy(damage, tmp_path)
    _same_findings(str(path), damage.step, monkeypatch)


def test_a_checkpoint_made_without_a_storage_is_validated_by_its_path():
    ck = formats.open_checkpoint(str(fixture_path("dcp_single")))
    ck.storage = None
    assert V.validate_opened(ck).to_json() == V.validate_checkpoint(str(fixture_path("dcp_single"))).to_json()


def test_what_the_reader_parsed_is_kept_only_for_the_checks():
    """An open that is not validated next (inspect, the library's open) keeps nothing of the parse;
    the preflight's checks take out what they use, so that it is not held while the copy runs."""
    src = str(fixture_path("orbax_ocdbt_zarr3"))
    assert formats.open_checkpoint(src).parsed == {}
    ck = formats.open_checkpoint(src, keep_parsed=True)
    assert {k.rsplit("/", 1)[1] for k in ck.parsed} >= {"_METADATA", "_CHECKPOINT_METADATA"}
    V.validate_opened(ck)
    # (what convert's planner asks later of an Orbax source, its recorded tuples, stays)
    assert {k.rsplit("/", 1)[1] for k in ck.parsed} == {"value_metadata_tree"}

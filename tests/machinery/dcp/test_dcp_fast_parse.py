"""The DCP reader's fast parse of a well-formed `.metadata`, and its reuse by validate.

The fast parse must give exactly what the careful walk gives on every real
`.metadata`, and hand anything it does not vouch for to the careful walk (so
that errors stay word for word). validate builds its walk from the reader's
parse when the file is well formed, and a command that opens a checkpoint and
validates it (convert's preflight) unpickles `.metadata` once.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ckpt_tool.base.errors import CkptError
from ckpt_tool.machinery.dcp import checks as dcp_checks
from ckpt_tool.machinery.dcp import reader as dcp_reader
from ckpt_tool.storage import Storage
from ckpt_tool.machinery.torch_save import safe_pickle
from ckpt_tool.machinery.torch_save.safe_pickle import Size
from ckpt_tool.ops.validate import validate_checkpoint

from conftest import fixture_path

# every DCP fixture torch wrote (one rank, several, threads, zstd, replicated duplicates, FSDP2, ...)
ALL_DCP = sorted(p.parent.name for p in fixture_path("dcp_single").parent.glob("dcp_*/.metadata"))
_FIELDS = ("shape", "dtype", "chunks", "entries", "requires_grad", "duplicates", "layout")


def _metadata(path: Path):
    return safe_pickle.load_metadata((path / ".metadata").read_bytes(), str(path))


@pytest.mark.parametrize("name", ALL_DCP)
def test_fast_parse_equals_the_careful_walk(name):
    md = _metadata(fixture_path(name))
    fast = dcp_reader._parse_fast(md)
    careful = dcp_reader._parse_careful(md, name)
    assert fast is not None, "a real .metadata must take the fast parse"
    assert list(fast.items) == list(careful.items)
    for fqn, item in careful.items.items():
        got = fast.items[fqn]
        assert type(got) is type(item)
        if isinstance(item, dcp_reader._BytesItem):
            assert got.entry == item.entry
            continue
        assert {f: getattr(got, f) for f in _FIELDS} == {f: getattr(item, f) for f in _FIELDS}, fqn
        assert type(got.shape) is tuple and all(type(c.offsets) is tuple for c in got.chunks)
    assert list(fast.storage.items()) == list(careful.storage.items())
    assert fast.keys == {fqn: careful.keys_for(fqn) for fqn in careful.items}
    needed: dict[str, int] = {}
    for e in careful.storage.values():
        needed[e.relative_path] = max(needed.get(e.relative_path, 0), e.offset + e.length)
    assert fast.needed == needed
    assert {t for tr in fast.transforms for t in tr} == {t for e in careful.storage.values() for t in e.transforms}


def _first_tensor(md):
    return next(item for item in md.state_dict_metadata.values() if isinstance(item, safe_pickle.TensorStorageMetadata))


def _bool_offsets(md):
    chunk = _first_tensor(md).chunks[0]
    chunk.offsets = Size(bool(n) for n in chunk.offsets)  # equal to the ints, but not ints


def _negative_dim(md):
    item = _first_tensor(md)
    item.size = Size((-1,) + tuple(item.size)[1:])


def _lost_entry(md):
    index = next(iter(md.storage_data))
    del md.storage_data[index]


def _entry_listed_twice(md):
    index, info = next(iter(md.storage_data.items()))
    twin = safe_pickle.MetadataIndex.__new__(safe_pickle.MetadataIndex)
    twin.__setstate__({"fqn": index.fqn, "offset": index.offset, "index": None})
    md.storage_data[twin] = info


def _list_shape(md):
    item = _first_tensor(md)
    item.size = list(item.size)


@pytest.mark.parametrize("damage", [_bool_offsets, _negative_dim, _lost_entry, _entry_listed_twice, _list_shape])
def test_what_the_fast_parse_does_not_vouch_for_goes_the_careful_way(damage):
    md = _metadata(fixture_path("dcp_multirank"))
    damage(md)
    assert dcp_reader._parse_fast(md) is None
    try:
        expected = dcp_reader._parse_careful(md, "x")
    except CkptError as exc:
        with pytest.raises(type(exc)) as got:
            dcp_reader._parse_metadata(md, "x")
        assert str(got.value) == str(exc)
    else:  # accepted by the careful walk (a list for a shape, an entry listed twice): the same result
        parsed = dcp_reader._parse_metadata(md, "x")
        assert list(parsed.storage.items()) == list(expected.storage.items())
        assert list(parsed.items) == list(expected.items)


def _report(path: str) -> dict:
    return validate_checkpoint(path).to_json()


@pytest.mark.parametrize("name", ["dcp_multirank", "dcp_dups", "dcp_dups_replicated", "dcp_zstd"])
def test_validate_from_the_parse_equals_the_lenient_walk(name, tmp_path, monkeypatch):
    src = tmp_path / name
    shutil.copytree(fixture_path(name), src)
    # damage that leaves .metadata well formed: a data file cut short
    data = sorted(src.glob("*.distcp"), key=lambda p: p.stat().st_size)[-1]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    for path in (str(fixture_path(name)), str(src)):
        dcp_reader._LAST_PARSED = None
        fast = _report(path)
        monkeypatch.setattr(dcp_reader, "parse_well_formed", lambda md, key=None: None)
        dcp_reader._LAST_PARSED = None
        lenient = _report(path)
        monkeypatch.undo()
        assert fast == lenient
    assert not fast["ok"]


def test_open_then_validate_unpickles_metadata_once(monkeypatch):
    # (the reader reads torch's own .metadata with metadata_scan, the checks with the unpickler:
    # either counts as reading it)
    from ckpt_tool.machinery.dcp import metadata_scan

    calls = []
    for module, name in ((safe_pickle, "load_metadata"), (metadata_scan, "scan")):
        def counting(*args, _real=getattr(module, name), **kwargs):
            calls.append(1)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
    dcp_reader._LAST_PARSED = None
    path = str(fixture_path("dcp_multirank"))
    dcp_reader.read(Storage.open(path), fmt="dcp")
    report = validate_checkpoint(path)
    assert len(calls) == 1 and report.ok()
    # other bytes are parsed afresh
    validate_checkpoint(str(fixture_path("dcp_single")))
    assert len(calls) == 2


@pytest.mark.parametrize("name", ALL_DCP)
def test_zip_tail_check_vouches_only_for_what_the_full_check_passes(name):
    """validate's in-place check of an entry's last 98 bytes says "sound" only where _zip_problem finds
    nothing; an offset or length moved by a few bytes is left to _zip_problem (which names it)."""
    path = fixture_path(name)
    storage = Storage.open(str(path))
    parsed = dcp_reader._parse_careful(_metadata(path), name)
    entries = [e for e in parsed.storage.values() if not e.transforms][:50]
    if not entries:
        pytest.skip("every entry is zstd-compressed")
    vouched = damaged = 0
    for entry in entries:
        for shift, grow in ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1), (4, -4)):
            moved = entry._replace(offset=max(0, entry.offset + shift), length=max(0, entry.length + grow))
            size = (path / moved.relative_path).stat().st_size
            if moved.offset + moved.length > size:
                continue
            a, b = dcp_checks._first_range(moved)
            data = storage.read_range(moved.relative_path, a, b)
            full = dcp_checks._zip_problem(dcp_checks._EntryBytes(storage, moved, 64, (a - moved.offset, data)))
            damaged += full is not None
            if dcp_checks._zip_tail_sound(data, 0, moved.length):
                vouched += 1
                assert full is None, (moved, full)
            elif (shift, grow) == (0, 0):
                assert full is None  # (not vouched for: a layout the in-place check leaves to _zip_problem)
    assert vouched >= len(entries)  # every untouched torch.save entry is vouched for in place
    assert damaged  # (the moved ones exercise the refusals)


# planner_tree_problem: which paths it walks (exact str and int keys) and when it looks at list indices
@pytest.mark.parametrize("planner_data, expected", [
    # an int only as a path's first key: no container holds two kinds of keys, no list has a gap
    ({"0.w": (0, "w"), "1.w": (1, "w")}, None),
    ({"l.0": ("l", 0), "l.1": ("l", 1), "w": ("w",)}, None),
    # a list index and a dict key in one container
    ({"m.0": ("m", 0), "m.x": ("m", "x")}, "m.x"),
    # a list without its element 0
    ({"l.1": ("l", 1), "w": ("w",)}, "l.1"),
    # a path that is also another's container
    ({"m.w": ("m", "w"), "m.w.x": ("m", "w", "x")}, "m.w.x"),
    # keys of other types (a bool, a str subclass) make no path of keys here: planner_path_problem's to report
    ({"m.0": ("m", True), "m.x": ("m", "x")}, None),
    ({"m.0": ("m", type("S", (str,), {})("0")), "m.0.x": ("m", "0", "x")}, None),
])
def test_planner_tree_problem_walks_exact_key_paths(planner_data, expected):
    found = dcp_reader.planner_tree_problem(planner_data, list(planner_data))
    assert (found[0] if found else None) == expected

"""The catalogue is complete: every registered format has fixtures, every fixture directory is
catalogued, every catalogued format is registered; and a format dropped in at runtime (a
throwaway package registered in ckpt_tool.formats.REGISTRY, with a fixture) is picked up by
these checks and passes the suite's properties."""
from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import pytest

import catalogue as C
import references as R
from rows import Library
from toy import TOY, passes_the_suite, safetensors_as_toy


def test_every_registered_format_has_fixtures():
    assert not C.formats_without_fixtures(), "registered formats with no catalogue entry (add fixtures)"


def test_every_fixture_directory_is_catalogued():
    assert not C.uncatalogued(), "fixture directories in no catalogue entry (tests/conformance/catalogue.py)"


def test_every_catalogued_format_is_registered():
    assert not C.unregistered_entries()


def test_every_entry_exists_and_is_read_by_its_formats_package():
    for e in C.ENTRIES:
        assert e.full().exists(), e.id
        assert C.detected(e.full()) == e.format, e.id


def test_every_format_has_damage_cases():
    for f in C.registered():
        assert C.damage_cases([f]), f"{f.name}: no damage cases in catalogue.DAMAGE"


def test_writable_formats_have_a_library_loader():
    missing = [fmt for fmt in C.writable() if fmt not in C.LIBRARIES]
    assert not missing, f"formats that write but have no LIBRARY loader in their catalogue file: {missing}"


# --- a throwaway format ------------------------------------------------------------------------



def _toy_fixtures(root: Path) -> None:
    """fixtures/ as it is (linked), plus toyst_tiny/: a file the safetensors library wrote."""
    import numpy as np
    from safetensors.numpy import save_file

    root.mkdir()
    for d in C.fixture_dirs():
        (root / d).symlink_to(C.FIXTURES / d)
    (root / "toyst_tiny").mkdir()
    rng = np.random.default_rng(0)
    save_file({"w": rng.standard_normal((4, 3)).astype(np.float32), "b": np.arange(5, dtype=np.int64)},
              str(root / "toyst_tiny" / f"model.{TOY}"))


def _toy_values(path: Path, step=None) -> dict:  # noqa: ANN001
    """The safetensors library's own reader (safe_open) on the .toyst files."""
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(path).glob(f"*.{TOY}")):
        with safe_open(str(f), framework="np") as h:
            for k in h.keys():
                out[R.by_name(k)] = h.get_tensor(k)
    return out


def _toy_library_values(path: Path) -> dict:
    """The library loader of the toy as a target format (its catalogue LIBRARY row): safe_open over its
    files, through torch as the safetensors loader (numpy holds no bfloat16)."""
    from safetensors import safe_open

    out = {}
    for f in [path] if Path(path).is_file() else sorted(Path(path).glob(f"*.{TOY}")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[R.by_name(k)] = R.torch_to_numpy(h.get_tensor(k))
    return out


def _toy_reference(path: Path, step=None) -> dict:  # noqa: ANN001
    return {k: R.Ref("array", tuple(a.shape), a.dtype.name) for k, a in _toy_values(path).items()}


@pytest.fixture
def toy_registered(tmp_path, monkeypatch):
    """The throwaway format in the registry (first, so that it is asked before the others)."""
    from ckpt_tool import formats

    pkg = safetensors_as_toy(tmp_path / "pkg")
    monkeypatch.setattr(formats, "__path__", [*formats.__path__, str(pkg.parent)])
    safetensors = formats.REGISTRY["safetensors"]
    changes = {"name": TOY, "title": "Toy (safetensors bytes in .toyst files)", "short": "Toy",
               "reads": "Toy files", "package": f"{formats.__name__}.{TOY}", "can_write": True,
               "claims": (f"*.{TOY}",), "file_suffixes": (f".{TOY}",), "options": (), "can_reshard": False,
               "listed": len(formats.REGISTRY)}
    fields = {f.name for f in dataclasses.fields(safetensors)}
    info = dataclasses.replace(safetensors, **{k: v for k, v in changes.items() if k in fields})
    monkeypatch.setattr(formats, "REGISTRY", {TOY: info, **formats.REGISTRY})
    # its writer's output is read back by the library that reads its files
    monkeypatch.setitem(C.LIBRARIES, TOY, Library(_toy_library_values, named=True))
    # `convert --to`'s choices were read from the registry when the CLI was imported, which an
    # earlier test in this process may have done before the toy existed
    from ckpt_tool.cli import convert_cmd

    [to] = [p for p in convert_cmd.convert_command.params if p.name == "to"]
    monkeypatch.setattr(to.type, "choices", (*to.type.choices, TOY))
    yield info
    for name in [m for m in sys.modules if m.startswith(f"{formats.__name__}.{TOY}")]:
        del sys.modules[name]


def test_a_throwaway_format_is_picked_up(toy_registered, tmp_path):
    import test_conformance_convert as CONV
    import test_conformance_read as READ

    infos = C.registered()
    assert TOY in [f.name for f in infos]
    # it implements the format contract: the package, its write.py and checks.py have every
    # required member, and its writer and readers are the contract's
    from ckpt_tool.core import contract

    write, checks = toy_registered.writer_module().module, toy_registered.checks().module
    assert not contract.missing_members(toy_registered.reader_module().module, write, checks)
    assert issubclass(write.SafetensorsWriter, contract.CheckpointWriter)
    assert TOY in C.writable() and TOY in C.LIBRARIES
    # registered without fixtures: flagged
    assert C.formats_without_fixtures(infos) == [TOY]
    # its fixture dropped into fixtures/ without a catalogue line: flagged
    root = tmp_path / "fixtures"
    _toy_fixtures(root)
    assert C.uncatalogued(C.ENTRIES, root) == ["toyst_tiny"]
    # with its catalogue line (and damage rows): nothing flagged, and it is among the cases
    entries = [*C.ENTRIES, C.Entry("toyst_tiny", TOY, _toy_reference, values=_toy_values)]
    damage = [*C.DAMAGE,
              C.Damage(TOY, "truncated-file", "toyst_tiny", f"model.{TOY}", "truncate", "truncated-file"),
              C.Damage(TOY, "path-escape", "toyst_tiny", f"model.{TOY}", "symlink-out", "path-escape")]
    assert C.formats_without_fixtures(infos, entries) == []
    assert C.uncatalogued(entries, root) == []
    # a new member of a family directory is flagged too
    (root / "toyst_family" / "one").mkdir(parents=True)
    assert C.uncatalogued([*entries, C.Entry("toyst_family/zero", TOY, _toy_reference)], root) == ["toyst_family/one"]
    shutil.rmtree(root / "toyst_family")
    assert C.unregistered_entries(infos, entries) == []
    [toy] = [e for e in C.cases(infos, entries) if e.format == TOY]
    # ... and it passes the suite's properties, read through its own package
    conversions = passes_the_suite(toy, root, tmp_path, C.damage_cases([toy_registered], damage), entries)
    # the write side: other formats' checkpoints converted to it say the same, and the library
    # that reads its files reads what ckpt reads
    for source in ("orbax_ocdbt_zarr2", "dcp_single"):
        [e] = [e for e in C.ENTRIES if e.id == source]
        summary, dst = conversions.get(e, TOY)
        assert sorted(p.name for p in dst.iterdir()) == [f"model.{TOY}"]
        CONV.diff_says_same(e.full(), dst, summary, e)
        assert CONV.library_reads_what_ckpt_reads(TOY, dst) > 0
        READ.validate_passes(C.Entry(dst.name, TOY, _toy_reference), True, dst.parent)



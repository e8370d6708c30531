"""core/contract.py: each optional hook's default, and the real readers' declared hooks."""
from __future__ import annotations

import types

import numpy as np
import pytest

from conftest import FIXTURES

from ckpt_tool.core import contract


def _region(*shape: int) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def test_a_plain_function_reader_gets_every_default():
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    reader = contract.array_reader(lambda region: data[region])
    assert isinstance(reader, contract.ArrayReader)
    assert not reader.starts_reads and not reader.reads_byte_ranges
    assert reader.stored_chunk((0, 0)) is None and reader.stored_values() is None
    reader.start_open()  # nothing to open
    region = (slice(1, 3), slice(0, 2))
    assert np.array_equal(reader.start_read(region)(), data[region])
    out = np.empty((2, 2), dtype=np.float32)
    reader.start_read_into(region, out)()
    assert np.array_equal(out, data[region])
    assert contract.array_reader(reader) is reader  # an ArrayReader is its own


def test_an_array_reader_must_read_regions():
    class NoRead(contract.ArrayReader):
        __slots__ = ()

    with pytest.raises(TypeError):
        NoRead()  # type: ignore[abstract]


def test_readers_stay_slotted():
    class Small(contract.ArrayReader):
        __slots__ = ("x",)

        def __call__(self, region: tuple[slice, ...]) -> np.ndarray:
            return np.zeros(0)

    assert not hasattr(Small(), "__dict__")  # 10^5 leaves: no per-reader dict


def test_a_package_with_only_the_required_members():
    module = types.ModuleType("minimal")
    module.NAME = "minimal"
    module.detect = lambda storage: True
    module.read = lambda storage, step=None: None
    assert contract.missing_members(module) == []
    package = contract.ReaderModule(module)
    assert package.NAME == "minimal" and package.detect(None)
    assert package.split_file("/x/model.bin") is None
    ckpt = types.SimpleNamespace(format="minimal")
    assert package.layout_text(ckpt) == "minimal"  # type: ignore[arg-type]
    assert package.recorded_tuples(ckpt) == set()  # type: ignore[arg-type]
    checks = contract.ChecksModule(types.ModuleType("minimal.checks"))
    assert checks.manifest_covers("anything") and checks.check_single_file is None and checks.check_deep is None
    assert contract.WriterModule(types.ModuleType("minimal.write")).KEEPS_ANY_STR is False


def test_missing_members_names_them():
    write = types.ModuleType("w")
    write.TUPLES_AS_VALUES = True
    assert contract.missing_members(types.ModuleType("p"), write, types.ModuleType("c")) == [
        "NAME", "detect", "read", "write.make_writer", "write.keeps_source_chunks", "write.target_layout",
        "write.plan_value", "checks.check_path", "write.gathered_value",
    ]


def test_writer_defaults():
    class Writer(contract.CheckpointWriter):
        def begin(self, plan): ...  # noqa: ANN001, ANN201
        def write_array(self, target, chunk_index, region, data): ...  # noqa: ANN001, ANN201
        def write_value(self, target): ...  # noqa: ANN001, ANN201
        def finish_process(self): ...  # noqa: ANN201
        def commit(self): ...  # noqa: ANN201
        def abort(self): ...  # noqa: ANN201

    w = Writer()
    assert w.pending_bytes_limit == 0
    assert [n for n in range(7) if w.owns(n, 1, 3)] == [1, 4]


def test_the_real_readers_declare_their_hooks():
    """The scheduler's fast paths stay on: tensorstore reads start together (plain zarr), an OCDBT
    database's chunks are read by pread and decoded by ckpt, zarr chunks stream, byte-range readers
    read bands."""
    import ckpt_tool
    from ckpt_tool.machinery.arrays.reading import LocatedZarrRegionReader

    plain = [leaf for leaf in ckpt_tool.open(str(FIXTURES / "orbax_plain_zarr2")).leaves if leaf.kind == "array"]
    assert plain and all(contract.reader_of(leaf).starts_reads for leaf in plain)
    orbax = [leaf for leaf in ckpt_tool.open(str(FIXTURES / "orbax_ocdbt_zarr2")).leaves if leaf.kind == "array"]
    assert orbax and all(isinstance(contract.reader_of(leaf), LocatedZarrRegionReader) for leaf in orbax)
    grid = orbax[0].layout
    assert contract.reader_of(orbax[0]).stored_chunk((0,) * len(grid.chunk_shape)) is not None
    dcp = [leaf for leaf in ckpt_tool.open(str(FIXTURES / "dcp_single")).leaves if leaf.kind == "array"]
    assert dcp and all(contract.reader_of(leaf).reads_byte_ranges for leaf in dcp)
    assert not any(contract.reader_of(leaf).starts_reads for leaf in dcp)

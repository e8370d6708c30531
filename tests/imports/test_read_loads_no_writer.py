"""Reading a checkpoint loads no writer module (issue 47): inspect and validate (shallow and
--deep) of an Orbax checkpoint, and a convert FROM Orbax to DCP, import neither the Orbax writer
(its package's write.py and direct.py) nor the OCDBT writer (storage/ocdbt_writer.py, ocdbt_encode.py).
What the Orbax reader needs (recorded_tuples: the tuples a checkpoint records, which convert to DCP
asks the source for) lives on the reader side.

The modules are listed by a subprocess after the CLI's own path ran (conftest.modules_loaded_after, as
in tests/imports/test_startup_imports.py); the writer modules are named from the registry (every writing
format's write.py) plus the modules only a writer uses."""
from __future__ import annotations

import pytest

from conftest import fixture_path, modules_loaded_after as _loaded_after

from ckpt_tool import formats

ORBAX_PACKAGE = formats.get("orbax").package
DCP_PACKAGE = formats.get("dcp").package
# the modules only writing uses, below the formats' write.py: Orbax's direct chunk writer, the OCDBT
# database writer and its encoder, torch.save's pickle writer, and the write plan the engine hands a writer
WRITER_ONLY = (f"{ORBAX_PACKAGE}.direct", "ckpt_tool.storage.ocdbt_writer", "ckpt_tool.storage.ocdbt_encode",
               "ckpt_tool.machinery.torch_save.pickle_writer", "ckpt_tool.core.write_plan")
# the writer modules of the formats that write (formats/<name>/write.py), from the registry
WRITE_MODULES = tuple(sorted({f"{f.package}.write" for f in formats.registered() if f.can_write}))
# what writing Orbax loads, which a convert from Orbax to another format must not
ORBAX_WRITER = (f"{ORBAX_PACKAGE}.write", f"{ORBAX_PACKAGE}.direct", "ckpt_tool.storage.ocdbt_writer",
                "ckpt_tool.storage.ocdbt_encode")

ORBAX = ["orbax_manager", "orbax_ocdbt_zarr2", "orbax_plain_zarr2", "orbax_two_process"]


def test_the_writer_modules_are_real():
    # the names below must name modules that exist, or the checks would pass on a typo
    import importlib.util

    assert f"{ORBAX_PACKAGE}.write" in WRITE_MODULES and f"{DCP_PACKAGE}.write" in WRITE_MODULES
    for name in WRITE_MODULES + WRITER_ONLY:
        assert importlib.util.find_spec(name) is not None, name


@pytest.mark.parametrize("name", ORBAX)
@pytest.mark.parametrize("command", [["inspect"], ["inspect", "--json"], ["validate"], ["validate", "--deep"]])
def test_orbax_inspect_and_validate_load_no_writer(name, command):
    loaded = _loaded_after([command[0], str(fixture_path(name)), *command[1:]])
    assert f"{ORBAX_PACKAGE}.reader" in loaded  # (a real Orbax read)
    bad = [m for m in loaded if m in WRITE_MODULES or m in WRITER_ONLY]
    assert not bad, f"{' '.join(command)} of {name} loaded writer modules: {bad}"


@pytest.mark.parametrize("command", [["ls"], ["latest"], ["validate", "--step", "all"]])
def test_a_run_root_of_orbax_steps_loads_no_writer(command):
    loaded = _loaded_after([command[0], str(fixture_path("runs_orbax")), *command[1:]])
    assert f"{ORBAX_PACKAGE}.reader" in loaded
    bad = [m for m in loaded if m in WRITE_MODULES or m in WRITER_ONLY]
    assert not bad, f"{' '.join(command)} of an Orbax run root loaded writer modules: {bad}"


@pytest.mark.parametrize("name", ["orbax_manager", "orbax_ocdbt_zarr2", "orbax_plain_zarr2"])
def test_convert_from_orbax_to_dcp_loads_no_orbax_writer(name, tmp_path):
    dst = tmp_path / "dcp"
    loaded = _loaded_after(["convert", str(fixture_path(name)), str(dst), "--to", "dcp"])
    assert (dst / ".metadata").is_file()
    # (the convert asked the source for its recorded tuples, and wrote DCP)
    assert f"{ORBAX_PACKAGE}.reader" in loaded and f"{DCP_PACKAGE}.write" in loaded
    bad = [m for m in loaded if m in ORBAX_WRITER]
    assert not bad, f"convert {name} --to dcp loaded the Orbax writer: {bad}"

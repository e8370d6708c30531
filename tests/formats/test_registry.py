"""The format registry (issue 19): every format is one package, which declares itself in its
registration.py (issue 31), and nothing above formats/ names a format except through the registry."""
from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from conftest import ROOT, run_ckpt

from ckpt_tool import formats
from ckpt_tool.core import contract

PACKAGE = ROOT / "ckpt_tool"


def _names() -> set[str]:
    out = {"msgpack_tree"}  # the flat-module days' name
    for info in formats.registered():
        out.add(info.name)
        out.update(info.families)
    return out


def test_no_module_outside_formats_names_a_format():
    """String constants equal to a format's name appear only under formats/ (docstrings and help
    texts may mention formats in prose: they never equal a bare name)."""
    names = _names()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("formats/"):
            continue
        # the torch.save machinery's pickle tables and writers name torch *modules* (("torch", "Size"),
        # Global("torch", "float32")), which the torch.save format's registry name happens to spell;
        # no other literal there is a format. So does the console script's module, which asks
        # whether the distributed libraries' packages (jax, torch) are loaded without importing
        # base/distributed.py for their names
        allowed = {"torch"} if rel.startswith("machinery/torch_save/") or rel == "cli/main.py" else set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names - allowed:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not found, found


@pytest.mark.parametrize("info", formats.registered(), ids=lambda f: f.name)
def test_each_package_has_the_registry_interface(info):
    module = info.module()
    assert module.NAME == info.name
    assert callable(module.detect) and callable(module.read)
    assert info.value_kinds and info.value_kinds <= formats.VALUE_KINDS
    assert info.claims and info.title
    if info.single_file:
        assert callable(module.split_file) and callable(module.read_file)
    # the members core/contract.py requires of the package, its write.py and its checks.py
    write = info.writer_module() if info.can_write else None
    assert not contract.missing_members(info.reader_module().module, write.module if write else None,
                                        info.checks().module)
    assert callable(info.checks().module.check_path)
    if write is not None:
        for name in contract.WriterModule.REQUIRED[:-1]:
            assert callable(getattr(write.module, name)), name
        assert isinstance(write.module.TUPLES_AS_VALUES, bool)
        if write.TUPLES_AS_VALUES:
            assert callable(write.module.gathered_value)
        # its writer is one: the engine calls the contract's hooks on it, defaulted or its own
        writers = [v for v in vars(write.module).values()
                   if isinstance(v, type) and v.__module__ == write.module.__name__ and issubclass(v, contract.CheckpointWriter)]
        assert writers, f"{write.module.__name__}: no CheckpointWriter subclass"
    else:
        with pytest.raises(formats.UsageError):
            info.writer_module()


def test_the_registry_is_what_the_packages_declare(tmp_path):
    """REGISTRY is discovered: each package's registration.py, in detection order; a directory
    without one is no format, and a name declared twice is refused."""
    assert formats.discover(list(formats.__path__)) == formats.REGISTRY
    order = [f.detection for f in formats.registered()]
    assert order == sorted(order) and len(set(order)) == len(order)
    for info in formats.registered():
        directory = info.package[len(formats.__name__) + 1:].split(".")[0]
        assert (PACKAGE / "formats" / directory / formats.REGISTRATION).is_file(), info.name
    (tmp_path / "notes").mkdir()
    (tmp_path / "again").mkdir()
    source = (PACKAGE / "formats" / "dcp" / formats.REGISTRATION).read_text()
    (tmp_path / "again" / formats.REGISTRATION).write_text(source)
    with pytest.raises(RuntimeError, match="formats registered twice: dcp"):
        formats.discover([*formats.__path__, str(tmp_path)])


def test_lookups():
    assert [f.name for f in formats.registered()] == list(formats.REGISTRY)
    assert formats.writable() == [f.name for f in formats.shown() if f.can_write]
    for info in formats.registered():
        assert formats.get(info.name) is info and formats.for_checkpoint(info.name) is info
        for family in info.families:
            assert formats.for_checkpoint(family) is info
    with pytest.raises(formats.UsageError, match="unknown format 'zip'"):
        formats.get("zip")
    assert formats.reshard_format().can_write


def test_help_and_convert_choices_come_from_the_registry():
    r = run_ckpt("--help")
    assert r.returncode == 0
    shown = " ".join(r.stdout.split())  # (a line longer than 80 columns is wrapped)
    for info in formats.shown():
        assert (info.reads or info.title) in shown, info.name
    labels = formats.writable_labels()
    assert f"Writes {formats.joined(labels)} (convert)" in shown
    r = run_ckpt("convert", "a", "b", "--to", "zip")
    assert r.returncode == 2
    for name in formats.writable():
        assert name in r.stderr


def test_registry_imports_no_format_and_nothing_heavy():
    code = (
        "import sys, ckpt_tool.formats as f\n"
        "f.registered(); f.writable(); f.shown()\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('numpy', 'tensorstore', 'rich')"
        " or (m.startswith('ckpt_tool.formats.') and m != 'ckpt_tool.formats')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=ROOT)


def test_architecture_page_names_every_format_package():
    layout = (ROOT / "docs" / "architecture.md").read_text()
    for info in formats.registered():
        folder = info.package.rsplit(".", 1)[-1] + "/"
        assert f"    {folder}" in layout, folder
    assert "\n## Adding a format\n" in layout

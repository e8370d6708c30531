"""How a ckpt process ends: once a command has returned, the interpreter's teardown is skipped
where nothing is left to do (cli/main.py's _teardown_needless), and what the command printed
and wrote is whole all the same."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, fixture_path

from ckpt_tool.cli import main as cli_main


@pytest.mark.parametrize("command, loaded, debug, skipped", [
    ("inspect", (), "", True),
    ("validate", ("jax",), "", True),  # read-only: nothing to shut down with other processes
    ("convert", (), "", True),
    ("reshard", (), "", True),
    ("convert", ("jax",), "", False),  # jax.distributed shuts down at exit
    ("reshard", ("torch",), "", False),  # so does torch.distributed
    ("convert", (), "1", False),  # CKPT_DEBUG: the interpreter's own end, tracebacks included
    ("manifest", (), "", False),
    (None, (), "", False),
])
def test_teardown_is_skipped_only_where_nothing_is_left(monkeypatch, command, loaded, debug, skipped) -> None:
    for name in ("jax", "torch"):
        if name in loaded:
            monkeypatch.setitem(sys.modules, name, sys)  # (any module object: only its presence counts)
        else:
            monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setenv("CKPT_DEBUG", debug)
    assert cli_main._teardown_needless(command) is skipped


def test_a_convert_ends_with_its_output_and_its_line_whole(tmp_path) -> None:
    """Through a pipe (stdout block-buffered), the summary line still arrives, and the output the
    process left validates."""
    out = tmp_path / "st"
    r = subprocess.run([sys.executable, "-m", "ckpt_tool", "convert", str(fixture_path("orbax_ocdbt_zarr2")), str(out),
                        "--to", "safetensors"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().splitlines()[-1].startswith("converted "), r.stdout
    v = subprocess.run([sys.executable, "-m", "ckpt_tool", "validate", str(out)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert v.returncode == 0, v.stdout + v.stderr

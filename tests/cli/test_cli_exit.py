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
    ("manifest", (), "", True),  # every command, not only the streaming ones (issue 46)
    ("manifest", ("torch",), "", False),
    ("ls", ("jax",), "", True),
    (None, (), "", True),  # --help, --version, a usage error
    (None, ("jax",), "", False),
    ("latest", (), "1", False),
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


def test_the_distributed_packages_are_the_coordinators_libraries() -> None:
    """main.py names the packages itself (importing base/distributed.py would cost every start)."""
    from ckpt_tool.base.distributed import LIBRARIES

    assert set(cli_main.DISTRIBUTED_PACKAGES) == {library.partition(".")[0] for library in LIBRARIES}


_ENDS = """
import atexit, sys
atexit.register(lambda: sys.stderr.write("atexit ran\\n"))
from ckpt_tool.cli.main import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("argv, code, out", [
    (["--version"], 0, "ckpt, version "),
    (["--help"], 0, "Usage: ckpt "),
    (["nosuchcommand"], 2, ""),  # a usage error keeps its exit code
    (["inspect", str(fixture_path("dcp_single")), "--json"], 0, "{"),
    (["manifest", "verify", str(fixture_path("dcp_single"))], 1, ""),  # (no manifest there: exit 1)
])
def test_every_command_ends_without_atexit_work_and_its_output_whole(argv, code, out) -> None:
    """Through a pipe (stdout block-buffered): the output arrives whole, the exit code is the
    command's, and nothing runs after the command (no atexit work, no teardown)."""
    r = subprocess.run([sys.executable, "-c", _ENDS, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == code, (r.returncode, r.stderr)
    assert r.stdout.startswith(out), r.stdout[:200]
    assert "atexit ran" not in r.stderr, r.stderr
    if out == "{":
        import json

        assert json.loads(r.stdout)["format"] == "dcp"


def test_a_failed_flush_at_the_end_fails_the_process(monkeypatch) -> None:
    """os._exit skips the interpreter's own end, which exits 120 when the last flush of stdout fails
    (a full disk): the fast end says so in one line and exits 1, not 0."""
    class Full:
        def write(self, text: str) -> int:
            return len(text)

        def flush(self) -> None:
            raise OSError(28, "No space left on device")

    class Err:
        def __init__(self) -> None:
            self.text = ""

        def write(self, text: str) -> int:
            self.text += text
            return len(text)

        def flush(self) -> None:
            pass

    err = Err()
    monkeypatch.setattr(sys, "stdout", Full())
    monkeypatch.setattr(sys, "stderr", err)
    codes = []
    monkeypatch.setattr(cli_main.os, "_exit", codes.append)
    cli_main._finish(0, fast=True)
    assert codes == [1]
    assert err.text == "ckpt: error: cannot write the output: No space left on device\n"
    codes.clear()
    cli_main._finish(2, fast=True)  # an exit code already non-zero stays
    assert codes == [2]

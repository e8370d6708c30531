"""`ckpt ARGS...` run in this process through the CLI's own error handling (ckpt_tool.cli.main._run),
as tests/formats/msgpack/test_legacy_jax.py does: the exit code, stdout and stderr a user would see, without a
process start per run. Whole processes are used only where one matters (the fuzz smoke's signals)."""
from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    def json(self):  # noqa: ANN201
        return json.loads(self.stdout)

    @property
    def stderr_lines(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines() if ln.strip()]


def ckpt(*args: object) -> Result:
    from ckpt_tool.cli.main import _run

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = _run([str(a) for a in args])
    return Result(code, out.getvalue(), err.getvalue())

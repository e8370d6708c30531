"""Shared test fixtures: the committed checkpoints under fixtures/."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]
ORBAX_FIXTURES = [f["name"] for f in MANIFEST if f["format"] == "orbax"]
DCP_FIXTURES = [f["name"] for f in MANIFEST if f["format"] == "dcp"]
ALL_FIXTURES = [f["name"] for f in MANIFEST]


def fixture_info(name: str) -> dict:
    return next(f for f in MANIFEST if f["name"] == name)


def fixture_path(name: str) -> Path:
    return FIXTURES / name


@pytest.fixture
def copy_fixture(tmp_path):
    """A writable copy of a fixture, for tests that damage it."""

    def _copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(FIXTURES / name, dst, symlinks=True)
        return dst

    return _copy


def run_ckpt(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python -m ckpt_tool` as a whole process, as a user would."""
    full_env = dict(os.environ)
    full_env.pop("CKPT_DEBUG", None)
    if env:
        full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "ckpt_tool", *args],
        capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT,
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(argv: list[str], env: dict, timeout: float = 240) -> list[tuple[str, str]]:
    """Run `argv` + --coordinator/--num-processes 2/--process-id i as two processes;
    both must exit 0. Their (stdout, stderr), in process order."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [*argv, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    return outs


def mutate_bytes(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Fuzzing: apply (kind, position, byte) edits; kind 0 replaces, 1 inserts, 2 deletes."""
    out = bytearray(data)
    for kind, pos, byte in edits:
        if not out:
            break
        i = pos % len(out)
        if kind == 0:
            out[i] = byte
        elif kind == 1:
            out.insert(i, byte)
        else:
            del out[i]
    return bytes(out)

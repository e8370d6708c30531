"""Shared test fixtures: the committed checkpoints under fixtures/."""
from __future__ import annotations

import json
import os
import shutil
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

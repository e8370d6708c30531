"""Unpickling memory is bounded (issue 29 a): what the allow-list unpickler builds stays within the
memory budget plus a fixed allowance, or the pickle is refused in one line naming the file and the limit.

Each adversarial pickle is unpickled in a fresh process whose peak RSS is measured (VmHWM, reset just
before the load): the opcode patterns are sized to just under the limit (the largest the estimate admits,
which must then fit in it), and the stand-in copies (a torch.Size of a memoized tuple, a path joined from
memoized strings, ...) are repeated far past it (refused while loading, again within it).
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from ckpt_tool.base.errors import CorruptMetadataError
from ckpt_tool.machinery.torch_save import pickle_budget, safe_pickle

ROOT = Path(__file__).resolve().parents[3]
CKPT = [sys.executable, "-m", "ckpt_tool"]
MiB = 1 << 20
# the limit the subprocess runs under: a 64 MiB budget and no allowance (so that the patterns stay small)
LIMIT = 64 * MiB

# Builders, run in the subprocess: build(n) -> pickle bytes, n = the number of repeated units
_BUILDERS = r'''
P = b"\x80\x04"

def batches(unit, n, open_=b"](", close=b"e", per=1000):
    out = [P, open_[:1]]
    while n > 0:
        k = min(per, n)
        out += [open_[1:], unit * k, close]
        n -= k
    return b"".join(out) + b"."

def distinct(n, fmt):
    return b"".join(fmt(i) for i in range(n))

BUILD = {
    "empty_sets": lambda n: batches(b"\x8f", n),
    "empty_dicts": lambda n: batches(b"}", n),
    "empty_lists": lambda n: batches(b"]", n),
    "memoized_sets": lambda n: batches(b"\x8f\x94", n),
    "lists_of_none": lambda n: batches(b"]Na", n),
    "nested_tuples": lambda n: P + b"N" + b"\x85" * n + b".",
    "dict_items": lambda n: P + b"}" + b"".join(
        b"(" + distinct(min(500, n - i), lambda j, i=i: b"J" + (i + j + 1000).to_bytes(4, "little") + b"N") + b"u"
        for i in range(0, n, 500)) + b".",
    "ints": lambda n: P + b"]" + b"".join(
        b"(" + distinct(min(1000, n - i), lambda j, i=i: b"J" + (i + j + 1000).to_bytes(4, "little")) + b"e"
        for i in range(0, n, 1000)) + b".",
    "ucs4_strings": lambda n: batches(b"\x8c\xff" + b"a" * 251 + "\U0001F600".encode(), n, per=100),
}

# stand-ins asked to copy a memoized value again and again (runtime charges)
def size_copies(n):
    big = b"(" + b"K\x01" * 100_000 + b"t\x94"  # memo 0: a tuple of 100,000 ints (800 KB of references)
    size = b"\x8c\x05torch\x94\x8c\x04Size\x94\x93\x94"  # memo 3: torch.Size
    return P + big + size + b"](" + b"h\x03h\x00\x85R" * n + b"e."

def path_joins(n):
    text = b"\x8d" + (100_000).to_bytes(8, "little") + b"a" * 100_000 + b"\x94"  # memo 0: a 100 KB string
    parts = b"(" + b"h\x00" * 1000 + b"t\x94"  # memo 1: (that string,) * 1000
    cls = b"\x8c\x07pathlib\x94\x8c\tPosixPath\x94\x93\x94"  # memo 4
    return P + text + parts + cls + b"](" + b"h\x04h\x01R" * n + b"e."

def bytearray_copies(n):
    data = b"\x8e" + (8 << 20).to_bytes(8, "little") + b"\x00" * (8 << 20) + b"\x94"  # memo 0: 8 MB of bytes
    cls = b"\x8c\x08builtins\x94\x8c\tbytearray\x94\x93\x94"  # memo 3
    return P + data + cls + b"](" + b"h\x03h\x00\x85R" * n + b"e."

def set_copies(n):
    items = b"(" + distinct(100_000, lambda i: b"J" + (i + 1000).to_bytes(4, "little")) + b"l\x94"  # memo 0
    cls = b"\x8c\x08builtins\x94\x8c\x03set\x94\x93\x94"  # memo 3
    return P + items + cls + b"](" + b"h\x03h\x00\x85R" * n + b"e."

BUILD.update(size_copies=size_copies, path_joins=path_joins, bytearray_copies=bytearray_copies,
             set_copies=set_copies)
'''

_RUN = _BUILDERS + r'''
import json, sys
from ckpt_tool.machinery.torch_save import pickle_budget, safe_pickle
pickle_budget.PICKLE_ALLOWANCE = 0
safe_pickle.PICKLE_ALLOWANCE = 0
name, n, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = BUILD[name](n)
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
base = rss()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
error = None
with pickle_budget.memory_budget(limit):
    try:
        safe_pickle.load_metadata(data, "adversarial.pkl")
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
print(json.dumps({"bytes": len(data), "growth": hwm() - base, "error": error}))
'''


def _run(name: str, n: int, limit: int = LIMIT) -> dict:
    out = subprocess.run([sys.executable, "-c", _RUN, name, str(n), str(limit)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def _builders() -> dict:
    scope: dict = {}
    exec(_BUILDERS, scope)  # noqa: S102 - the builders above, shared with the subprocess
    return scope["BUILD"]


def _largest_admitted(build, limit: int) -> int:
    """The largest n whose pickle the estimate admits under `limit` (a binary search on the estimate)."""
    def admitted(n: int) -> bool:
        try:
            safe_pickle.check_limits(build(n), "x", limit=limit)
        except CorruptMetadataError:
            return False
        return True

    lo, hi = 1, 1
    while admitted(hi):
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 50):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if admitted(mid) else (lo, mid)
    return lo


_OPCODE_PATTERNS = ["empty_sets", "empty_dicts", "empty_lists", "memoized_sets", "lists_of_none",
                    "nested_tuples", "dict_items", "ints", "ucs4_strings"]


@pytest.mark.slow
@pytest.mark.parametrize("name", _OPCODE_PATTERNS)
def test_opcode_patterns_at_the_limit_stay_within_it(name):
    build = _builders()[name]
    n = _largest_admitted(build, LIMIT)
    at_limit = _run(name, n)
    assert at_limit["error"] is None, at_limit
    assert at_limit["growth"] <= LIMIT, at_limit  # what the estimate admits fits in the limit
    # ... and is not a token fraction of it (the estimate is not so loose as to refuse real files)
    assert at_limit["growth"] >= LIMIT // 20, at_limit
    over = _run(name, 2 * n)
    assert over["error"] and "more than the 64 MiB of memory allowed" in over["error"], over
    # refused before the unpickler built anything: what grew is the limits check's own (pickle_scan's pattern,
    # compiled once per process: ~25 MB)
    assert over["growth"] <= 32 * MiB, over


@pytest.mark.parametrize("name, n", [("size_copies", 2000), ("path_joins", 100), ("bytearray_copies", 200),
                                     ("set_copies", 200)])
def test_stand_in_copies_are_charged_before_they_allocate(name, n):
    # without the charges each of these takes 1.6 to 10 GB from a pickle of a few MB
    result = _run(name, n)
    assert result["error"] and result["error"].startswith("PickleMemoryError: adversarial.pkl: unpickling"), result
    assert result["growth"] <= LIMIT, result


def test_real_metadata_is_admitted_under_the_default_budget():
    from conftest import FIXTURES

    for name in ("dcp_fsdp2_adam", "megatron_torch_dist_fully_sharded"):
        data = (FIXTURES / name / ".metadata").read_bytes()
        assert safe_pickle.check_limits(data, name) < pickle_budget.memory_limit()


def test_default_budget_is_the_schedulers():
    from ckpt_tool.scheduler.admission import DEFAULT_MEMORY

    assert pickle_budget.DEFAULT_BUDGET == DEFAULT_MEMORY


def _torch_save_with_pickle(path: Path, data_pkl: bytes) -> None:
    """A torch.save archive (written by torch) whose data.pkl is replaced, its layout kept."""
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    with zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            data = data_pkl if info.filename.endswith("/data.pkl") else src.read(info.filename)
            dst.writestr(info.filename, data, compress_type=zipfile.ZIP_STORED)


@pytest.mark.slow
def test_validate_refuses_a_torch_save_whose_pickle_is_over_the_limit(tmp_path):
    # 8 MB of EMPTY_SET: ~2 GB to unpickle, over the default 512 MiB + 512 MiB
    path = tmp_path / "sets.pt"
    _torch_save_with_pickle(path, _builders()["empty_sets"](8 << 20))
    out = subprocess.run([*CKPT, "validate", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "unpickling it would take more" in line]
    assert len(lines) == 1 and "sets.pt" in lines[0] and "more than the 1,024 MiB of memory allowed" in lines[0], out.stdout

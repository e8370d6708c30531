#!/usr/bin/env python3
"""Benchmark the unpickler's memory bound (issue 29 a): `ckpt validate` of a torch.save archive whose
data.pkl is a pickle at the unpickler's size limit (MAX_PAYLOAD_PICKLE_BYTES, 256 MiB) made of the
opcode that costs the most memory per byte (EMPTY_SET, 1 byte -> a 224-byte set; appended to lists in
batches of 1,000 so every count limit holds).

    python bench/pickle_bench.py [--runs N] [--json]

Unbounded, unpickling it would take ~60 GB. ckpt must refuse it in one line, fast, with its peak RSS
within the bound: the data read (the pickle itself) + the pickle limit (--memory 512 MiB + the fixed
512 MiB allowance) + the process's own floor, measured as `ckpt validate` of the same archive with a
one-tensor data.pkl. Reported: the peak RSS, its ratio to the bound (target <= 1), and the time to the
refusal against the floor's run. The torch.save archive is written by torch, its data.pkl replaced.
Exit 0 when the refusal came as expected (target met or not); 1 otherwise.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

from cli_start_bench import ckpt_exe  # noqa: E402
from inspect_bench import _fmt_mib, run_once  # noqa: E402 - one way to time a child, shared by the benches


def _archive(path: str, data_pkl: bytes | None) -> None:
    """torch.save of one tensor, its data.pkl replaced (None: kept), members stored as torch writes them."""
    import torch

    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    with zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if data_pkl is not None and info.filename.endswith("/data.pkl"):
                data = data_pkl
            dst.writestr(info.filename, data, compress_type=zipfile.ZIP_STORED)


def _sets_pickle(size: int) -> bytes:
    """A protocol-4 pickle of exactly `size` bytes: a list filled with empty sets, ~1,000 per APPENDS."""
    head, batch, tail = b"\x80\x04]", b"(" + b"\x8f" * 1000 + b"e", b"."
    n, pad = divmod(size - len(head) - len(tail), len(batch))
    first = b"(" + b"\x8f" * (1000 + pad % 2) + b"e"  # (an odd byte left: one more set)
    body = head + first + batch * (n - 1) + b"N0" * (pad // 2) + tail  # (NONE, POP: nothing)
    assert len(body) == size
    return body


def measure(runs: int) -> dict:
    from ckpt_tool.machinery.torch_save import pickle_budget

    # safe_pickle.MAX_PAYLOAD_PICKLE_BYTES (safe_pickle imports numpy: this process stays small)
    size = 256 << 20
    limit = pickle_budget.memory_limit()
    exe = ckpt_exe()
    with tempfile.TemporaryDirectory() as tmp:
        floor_path, bomb_path = os.path.join(tmp, "floor.pt"), os.path.join(tmp, "sets.pt")
        # written by a child: a child's ru_maxrss starts at its parent's (fork), so this process stays small
        subprocess.run([sys.executable, os.path.abspath(__file__), "--make", floor_path, bomb_path, str(size)],
                       check=True, cwd=REPO)
        floor = [run_once([*exe, "validate", floor_path], True) for _ in range(runs)]
        bomb = [run_once([*exe, "validate", bomb_path], True) for _ in range(runs)]
    out = bomb[-1].get("stdout", "") + bomb[-1].get("stderr", "")
    refused = [line.strip() for line in out.splitlines() if "unpickling it would take more" in line]
    floor_kib = min(r["rss_kib"] for r in floor)
    bound_kib = floor_kib + (size + limit) // 1024
    peak_kib = max(r["rss_kib"] for r in bomb)
    return {
        "pickle_bytes": size, "limit_bytes": limit, "refusal_line": refused[0] if refused else None,
        "exit_codes": [r["rc"] for r in bomb], "floor_s": min(r["wall"] for r in floor),
        "refusal_s": min(r["wall"] for r in bomb), "floor_peak_rss_kib": floor_kib,
        "peak_rss_kib": peak_kib, "bound_kib": bound_kib, "ratio": peak_kib / bound_kib,
        "target": "peak RSS <= floor + pickle + limit", "met": peak_kib <= bound_kib,
        "ok": bool(refused) and all(r["rc"] == 1 for r in bomb),
    }


def print_table(doc: dict) -> None:
    print(f"pickle at the size limit ({doc['pickle_bytes'] >> 20} MiB of EMPTY_SET) through ckpt validate")
    print(f"  refusal: {doc['refusal_line']}")
    print(f"  time {doc['refusal_s']:.2f} s (validate of a one-tensor file: {doc['floor_s']:.2f} s)")
    print(f"  peak RSS {_fmt_mib(doc['peak_rss_kib'])}, bound {_fmt_mib(doc['bound_kib'])} "
          f"(floor {_fmt_mib(doc['floor_peak_rss_kib'])} + pickle + {doc['limit_bytes'] >> 20} MiB limit): "
          f"ratio {doc['ratio']:.2f} ({'met' if doc['met'] else 'MISSED'})")


def summary_rows(doc: dict) -> list[dict]:
    """This bench's row for run_all's overall table: the refusal's peak RSS against the bound."""
    return [{
        "bench": "pickle", "case": f"validate: {doc['pickle_bytes'] >> 20} MiB pickle of EMPTY_SET (refused)",
        "ckpt_s": doc["refusal_s"], "baseline": "validate of a one-tensor file", "baseline_s": doc["floor_s"],
        "ratio": doc["ratio"], "target": "peak RSS / (floor + pickle + limit) <= 1", "met": doc["met"],
        "rss_mib": round(doc["peak_rss_kib"] / 1024),
        "error": None if doc["ok"] else f"not refused as expected: exit {doc['exit_codes']}",
    }]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--make", nargs=3, help=argparse.SUPPRESS)  # FLOOR BOMB SIZE: write the two archives
    args, _ = ap.parse_known_args()  # run_all passes its other arguments through
    if args.make:
        _archive(args.make[0], None)
        _archive(args.make[1], _sets_pickle(int(args.make[2])))
        return 0
    doc = measure(max(1, args.runs))
    if args.json:
        print(json.dumps(doc))
    else:
        print_table(doc)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

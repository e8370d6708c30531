"""What this host's file system costs: the primitives ckpt's writers and readers use, timed.

    python bench/host_io_probe.py DIR [--gib 1]

Where convert or reshard is slower than `cp -r && sync` on some host, these
figures say which primitive is dear there: buffered pwrite from one thread or
eight, fsync of a dirty or a clean file, sync_file_range and fadvise (what
ckpt_tool/base/pagecache.py does every 64 MiB), os.sync, pread from the page
cache, and small files. On a sandboxed kernel (gVisor) some of these differ
from Linux by orders of magnitude: sync_file_range there syncs the whole
file, fadvise does nothing. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

BLOCK = 4 << 20


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return round(time.perf_counter() - t, 3)


def _write_file(path: str, nbytes: int, buf: memoryview, every: int = 0, hint: Callable[[int, int, int], None] | None = None) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = 0
        while off < nbytes:
            n = min(BLOCK, nbytes - off)
            os.pwrite(fd, buf[:n], off)
            off += n
            if hint is not None and every and off % every == 0:
                hint(fd, off - every, every)
    finally:
        os.close(fd)
    return nbytes


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_floor(src: str, dst: str) -> float:
    """Seconds for `cp -r SRC DST && sync`, what a copy made durable costs here (what has been
    written before is flushed first, untimed, so the `sync` waits for the copy alone)."""
    os.sync()
    t = time.perf_counter()
    subprocess.run(["cp", "-r", src, dst], check=True)
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - t


def read_file(path: str, buf: bytearray) -> int:
    """Read the whole file through `buf` (preadv, reused for every block); the bytes read."""
    fd = os.open(path, os.O_RDONLY)
    total = 0
    try:
        view = memoryview(buf)
        while True:
            n = os.preadv(fd, [view], total)
            if n <= 0:
                return total
            total += n
    finally:
        os.close(fd)


def _file_system(path: str) -> str:
    best = ""
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) > 2 and path.startswith(parts[1]) and len(parts[1]) >= len(best.split(" ")[0] if best else ""):
                    best = f"{parts[1]} {parts[2]} {parts[3]}"
    except OSError:
        pass
    return best


def probe(root: str, gib: float) -> dict[str, Any]:
    os.makedirs(root, exist_ok=True)
    total = int(gib * 2**30)
    files = 16
    per = total // files
    buf = memoryview(os.urandom(BLOCK))
    out: dict[str, Any] = {
        "python": platform.python_version(), "cpus": os.cpu_count(), "kernel": open("/proc/version").read().strip(),
        "mount": _file_system(os.path.realpath(root)), "bytes": total,
    }
    try:
        srf = ctypes.CDLL(None, use_errno=True).sync_file_range
        srf.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    except (OSError, AttributeError):
        srf = None

    def paths(tag: str) -> list[str]:
        return [os.path.join(root, f"{tag}_{i}") for i in range(files)]

    def run(tag: str, threads: int, hint: Callable[[int, int, int], None] | None = None) -> None:
        ps = paths(tag)
        os.sync()
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda p: _write_file(p, per, buf, 64 << 20, hint), ps))
        wrote = time.perf_counter() - t
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fsync_path, ps))
        out[tag] = {"write_s": round(wrote, 3), "fsync_s": round(time.perf_counter() - t - wrote, 3),
                    "total_s": round(time.perf_counter() - t, 3)}

    run("write_1_thread", 1)
    run("write_8_threads", 8)
    if srf is not None:
        run("write_8_threads_sync_file_range_write", 8, lambda fd, o, n: srf(fd, o, n, 2))
        run("write_8_threads_sync_file_range_wait", 8, lambda fd, o, n: srf(fd, o, n, 7))
    run("write_8_threads_fdatasync_each_64MiB", 8, lambda fd, o, n: os.fdatasync(fd))
    clean = paths("write_8_threads")[0]
    out["fsync_clean_file_s"] = _timed(lambda: [fsync_path(clean) for _ in range(100)]) / 100
    out["os_sync_nothing_dirty_s"] = _timed(os.sync)
    # page-cache reads of what was just written
    big = bytearray(per)
    ps = paths("write_8_threads")
    out["read_1_thread_s"] = _timed(lambda: [read_file(p, big) for p in ps])
    bufs = [bytearray(per) for _ in range(8)]
    lock = threading.Lock()
    free = list(bufs)

    def read_one(p: str) -> int:
        with lock:
            b = free.pop()
        try:
            return read_file(p, b)
        finally:
            with lock:
                free.append(b)

    with ThreadPoolExecutor(8) as pool:
        out["read_8_threads_s"] = _timed(lambda: list(pool.map(read_one, ps)))
    # cp of the written files, then sync
    src, dst = os.path.join(root, "cpsrc"), os.path.join(root, "cpdst")
    os.makedirs(src, exist_ok=True)
    for p in ps:
        os.replace(p, os.path.join(src, os.path.basename(p)))
    os.sync()
    t = time.perf_counter()
    import subprocess

    subprocess.run(["cp", "-r", src, dst], check=True)
    cp = time.perf_counter() - t
    os.sync()
    out["cp_r"] = {"cp_s": round(cp, 3), "sync_s": round(time.perf_counter() - t - cp, 3)}
    # small files: what an OCDBT or DCP output with many files pays
    small = os.path.join(root, "small")
    os.makedirs(small, exist_ok=True)
    kb = memoryview(os.urandom(64 << 10))

    def small_files(sync: bool) -> None:
        for i in range(500):
            p = os.path.join(small, f"{sync}_{i}")
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.pwrite(fd, kb, 0)
            if sync:
                os.fsync(fd)
            os.close(fd)

    # fresh memory against reused: each first touch of a page is a fault, which a sandboxed kernel
    # (gVisor) serves itself; what a decoder that allocates every chunk anew pays
    pattern = memoryview(os.urandom(256 << 20))

    def fresh() -> None:
        for _ in range(4):
            b = bytearray(256 << 20)
            b[:] = pattern
            del b

    reused = bytearray(256 << 20)

    def reuse() -> None:
        for _ in range(4):
            reused[:] = pattern

    out["fill_1GiB_fresh_memory_s"] = _timed(fresh)
    out["fill_1GiB_reused_memory_s"] = _timed(reuse)
    out["500_files_64KiB_s"] = _timed(lambda: small_files(False))
    out["500_files_64KiB_fsync_each_s"] = _timed(lambda: small_files(True))
    shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--gib", type=float, default=1.0)
    opts = parser.parse_args()
    print(json.dumps(probe(opts.dir, opts.gib), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

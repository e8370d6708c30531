"""How a writer should make many output files durable on this host: timed alternatives.

    python bench/write_pipeline_probe.py DIR [--gib 2] [--producers 8]

A conversion's copy threads fill data files while the disk takes them; each
file must be fsynced before the checkpoint is committed. Which way of doing
that finishes first depends on the host: on a TPU VM (gVisor over 9p) the data
reaches the disk only at fsync, so the fsyncs are the disk's work itself, and
how many run at once, and on how large files, decides the wall time. Each
variant writes the same bytes from `--producers` threads (one reused buffer
each, so only the file system is measured) and ends when everything is
durable:

- `closers=C file=S`: files of S MiB, each fsynced by one of C closer threads
  as soon as its producer is done with it (ckpt's FileCloser);
- `own-fsync file=S`: each producer fsyncs its own file before the next;
- `syncfs-at-end file=S`: no fsync per file, one syncfs of the directory's file system at the end;
- `direct file=S`: O_DIRECT writes (where the file system takes them), fsync per file by closers;
- `cp -r && sync` of the first variant's output, for scale.

Prints one JSON object: seconds per variant (best of --repeat) and GiB/s.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from host_io_probe import disk_floor, fsync_path  # (this folder: scripts run from bench/)

BLOCK = 8 << 20


def _syncfs(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), "syncfs failed")
    finally:
        os.close(fd)


def run_variant(out: str, total: int, producers: int, file_bytes: int, mode: str, closers: int) -> float:
    """Write `total` bytes as files of `file_bytes` from `producers` threads; seconds until durable."""
    os.makedirs(out)
    nfiles = -(-total // file_bytes)
    counter = iter(range(nfiles))
    lock = threading.Lock()
    pool = ThreadPoolExecutor(closers) if mode in ("closers", "direct") else None
    pending: list[Future[None]] = []
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    direct = mode == "direct" and hasattr(os, "O_DIRECT")

    def close(fd: int, sync: bool) -> None:
        try:
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def produce() -> None:
        buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT wants
        buf.write(os.urandom(4096) * (BLOCK // 4096))
        view = memoryview(buf)
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            path = os.path.join(out, f"f{i}")
            fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)  # type: ignore[attr-defined]
            n = min(file_bytes, total - i * file_bytes)
            off = 0
            try:
                while off < n:
                    k = min(BLOCK, n - off)
                    os.pwrite(fd, view[:k], off)
                    off += k
            except BaseException:
                os.close(fd)
                raise
            if pool is not None:
                with lock:
                    pending.append(pool.submit(close, fd, True))
            else:
                close(fd, mode == "own-fsync")

    errors: list[BaseException] = []

    def run_producer() -> None:
        try:
            produce()
        except BaseException as exc:  # noqa: BLE001 - raised again below, in the caller's thread
            errors.append(exc)

    t = time.perf_counter()
    threads = [threading.Thread(target=run_producer) for _ in range(producers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        if pool is not None:
            pool.shutdown(wait=True)  # every descriptor closed before the scratch is removed
        raise errors[0]
    for fut in pending:
        fut.result()
    if pool is not None:
        pool.shutdown()
    if mode == "syncfs-at-end":
        _syncfs(out)
    fsync_path(out)  # the directory: its entries are durable too
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--producers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    # whole 8 MiB blocks: O_DIRECT wants every write's length aligned
    total = max(1, round(args.gib * 2**30 / BLOCK)) * BLOCK
    os.makedirs(args.dir, exist_ok=True)
    variants: list[tuple[str, int, int]] = [
        ("closers", 32, 4), ("closers", 32, 8), ("closers", 32, 16), ("closers", 128, 8),
        ("closers", 512, 8), ("own-fsync", 32, 0), ("own-fsync", 128, 0), ("syncfs-at-end", 32, 0),
        ("direct", 32, 8),
    ]
    gib = total / 2**30
    results: dict[str, Any] = {"gib": gib, "producers": args.producers, "cpus": os.cpu_count()}
    for rep in range(args.repeat):
        for mode, mib, closers in variants if rep % 2 == 0 else variants[::-1]:
            key = f"{mode} file={mib}MiB" + (f" closers={closers}" if closers else "")
            out = os.path.join(args.dir, "v")
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            try:
                s = run_variant(out, total, args.producers, mib << 20, mode, max(closers, 1))
            except OSError as exc:
                results[key] = str(exc)
                continue
            prev = results.get(key)
            results[key] = round(min(s, prev) if isinstance(prev, float) else s, 3)
        src = os.path.join(args.dir, "v")
        dst = os.path.join(args.dir, "copy")
        shutil.rmtree(dst, ignore_errors=True)
        s = disk_floor(src, dst)
        prev = results.get("cp -r && sync")
        results["cp -r && sync"] = round(min(s, prev) if isinstance(prev, float) else s, 3)
        shutil.rmtree(dst, ignore_errors=True)
    shutil.rmtree(os.path.join(args.dir, "v"), ignore_errors=True)
    results["GiB/s"] = {k: round(gib / v, 2) for k, v in results.items() if isinstance(v, float) and k != "gib"}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""How fast this host reads (and rewrites) an Orbax OCDBT checkpoint, route by route.

    python bench/read_probe.py CHECKPOINT_DIR SCRATCH_DIR

Each route reads every stored chunk of the checkpoint; the figures (wall and
the process's CPU seconds) separate the file system from the decoding and
from tensorstore's scheduling:

- preadv of the database's data files, whole, from 1 and 8 threads (the floor);
- tensorstore's OCDBT kvstore, every chunk's stored bytes at once;
- zstandard decoding those bytes in 1 and in N threads;
- tensorstore's zarr driver reading every array at once (what orbax and ckpt do),
  with tensorstore's default context and with wider I/O and copy concurrency;
- tensorstore writing those arrays to a new OCDBT database with the source's codecs.

Prints one JSON object.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from host_io_probe import read_file  # (this folder: scripts run from bench/)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _measure(out: dict[str, Any], name: str, fn: Callable[[], Any]) -> Any:
    c, t = _cpu(), time.perf_counter()
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - a probe: record and go on
        out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        return None
    out[name] = {"wall_s": round(time.perf_counter() - t, 3), "cpu_s": round(_cpu() - c, 3)}
    return result


def _pread_all(path: str, bufsize: int = 8 << 20) -> int:
    return read_file(path, bytearray(bufsize))


def main(src: str, scratch: str) -> dict[str, Any]:
    import numpy as np
    import tensorstore as ts
    import zstandard

    out: dict[str, Any] = {"cpus": os.cpu_count(), "tensorstore": getattr(ts, "__version__", "?")}
    files = [os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs if os.sep + "d" in d[len(src):]]
    out["data_files"] = len(files)
    out["data_bytes"] = sum(os.path.getsize(f) for f in files)
    _measure(out, "pread_data_files_1_thread", lambda: [_pread_all(f) for f in files])
    with ThreadPoolExecutor(8) as pool:
        _measure(out, "pread_data_files_8_threads", lambda: list(pool.map(_pread_all, files)))

    base = {"driver": "file", "path": src.rstrip("/") + "/"}
    kv = ts.KvStore.open({"driver": "ocdbt", "base": base}).result()
    keys = kv.list().result()
    suffix = b"/zarr.json" if any(k.endswith(b"/zarr.json") for k in keys) else b"/.zarray"
    zarr = "zarr3" if suffix == b"/zarr.json" else "zarr"
    meta = {k[: -len(suffix)].decode(): json.loads(kv.read(k).result().value) for k in keys if k.endswith(suffix)}
    chunk_keys = [k for k in keys if not k.endswith((b".json", b".zarray", b".zattrs"))]
    out["arrays"], out["chunks"] = len(meta), len(chunk_keys)
    values = _measure(out, "ocdbt_kvstore_read_all_chunks", lambda: [f.result().value for f in [kv.read(k) for k in chunk_keys]])
    codecs = {json.dumps(m.get("codecs") or m.get("compressor")) for m in meta.values()}
    out["codecs"] = sorted(codecs)[:3]
    if values:
        out["stored_bytes"] = sum(len(v) for v in values)

        def decode(v: bytes) -> int:
            return len(zstandard.ZstdDecompressor().decompress(v, max_output_size=1 << 30))

        _measure(out, "zstd_decode_1_thread", lambda: [decode(v) for v in values])
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            _measure(out, "zstd_decode_all_threads", lambda: list(pool.map(decode, values)))
        level = 3
        for m in meta.values():
            level = (m.get("compressor") or {}).get("level", level)
            for c in m.get("codecs") or []:
                if c.get("name") == "zstd":
                    level = (c.get("configuration") or {}).get("level", level)
        raw = [zstandard.ZstdDecompressor().decompress(v, max_output_size=1 << 30) for v in values[:200]]

        def encode(b: bytes) -> int:
            return len(zstandard.ZstdCompressor(level=level).compress(b))

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            got = _measure(out, f"zstd_encode_level{level}_all_threads_first_200_chunks", lambda: list(pool.map(encode, raw)))
        out["first_200_chunks_bytes"] = sum(len(b) for b in raw)
        if got:
            out["first_200_chunks_encoded"] = sum(got)
    del values

    def read_arrays(context: dict[str, Any] | None) -> list[np.ndarray]:
        ctx = ts.Context(context or {})
        stores = [ts.open({"driver": zarr, "kvstore": {"driver": "ocdbt", "base": base, "path": name + "/"}}, context=ctx,
                          open=True).result() for name in meta]
        return [f.result() for f in [s.read() for s in stores]]

    arrays = _measure(out, "tensorstore_read_arrays_default_context", lambda: read_arrays(None))
    wide = {"file_io_concurrency": {"limit": 64}, "data_copy_concurrency": {"limit": (os.cpu_count() or 1) * 2}}
    _measure(out, "tensorstore_read_arrays_wide_context", lambda: read_arrays(wide))
    if arrays:
        dst = os.path.join(scratch, "rewrite")

        def write() -> None:
            ctx = ts.Context()
            futs = []
            for (name, m), arr in zip(meta.items(), arrays):
                spec = {"driver": zarr, "kvstore": {"driver": "ocdbt", "base": {"driver": "file", "path": dst + "/"}, "path": name + "/"},
                        "metadata": {k: v for k, v in m.items() if k not in ("attributes",)}, "create": True}
                store = ts.open(spec, context=ctx).result()
                futs.append(store.write(arr))
            for f in futs:
                f.result()

        _measure(out, "tensorstore_write_ocdbt_source_codecs", write)
        _measure(out, "os_sync_after_write", os.sync)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2]), indent=1))

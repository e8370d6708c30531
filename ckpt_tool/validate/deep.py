"""`validate --deep`: read and decode every chunk, in parallel, with bounded memory.

Works on the format-neutral model: each array leaf's stored chunks (a zarr
grid or a DCP chunk list) are read one region at a time through the
format's reader, which decodes them (zarr codecs through tensorstore; the
torch.save payload through the allow-list). At most `workers * 2` chunks are
in flight, so memory is bounded by a few chunks whatever the checkpoint size.
"""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .. import dtypes
from ..errors import CkptError
from ..findings import Findings, Progress
from ..model import ArrayLeaf, ChunkList, Region, RegularGrid


@dataclass
class _LeafStats:
    nan: int = 0
    inf: int = 0
    failed: bool = False


def chunk_regions(leaf: ArrayLeaf) -> Iterator[Region]:
    """The regions of a leaf's stored chunks."""
    if isinstance(leaf.layout, ChunkList):
        for chunk in leaf.layout.chunks:
            yield chunk.region
        return
    assert isinstance(leaf.layout, RegularGrid)
    if not leaf.shape:
        yield ()
        return
    grid = [range(-(-s // c)) if c else range(0) for s, c in zip(leaf.shape, leaf.layout.chunk_shape)]
    for idx in itertools.product(*grid):
        yield tuple(
            slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(idx, leaf.layout.chunk_shape, leaf.shape)
        )


def _relative(where: str | None, root: str) -> str | None:
    """Findings name files relative to the checkpoint, as the shallow checks do."""
    if where and where.startswith(root.rstrip("/") + "/"):
        return where[len(root.rstrip("/")) + 1 :]
    return where


def deep_check(
    path: str,
    fmt: str,
    findings: Findings,
    *,
    step: str | int | None = None,
    workers: int = 4,
    progress: Progress,
    skip_leaves: set[str] | None = None,
) -> None:
    from ..formats import open_checkpoint

    try:
        ckpt = open_checkpoint(path, step=None if step in (None, "all") else step)
    except CkptError as exc:
        if not findings.errors:  # otherwise the shallow checks already said why
            findings.error("bad-metadata", f"cannot open for --deep: {exc.message}", file=_relative(exc.where, path))
        return
    skip = skip_leaves or set()
    leaves = [leaf for leaf in ckpt.arrays() if leaf.path not in skip]
    tasks = [(leaf, region) for leaf in leaves for region in chunk_regions(leaf)]
    total_bytes = sum(leaf.nbytes for leaf in leaves)
    stats = {leaf.path: _LeafStats() for leaf in leaves}
    lock = threading.Lock()
    done_bytes = 0

    def run(leaf: ArrayLeaf, region: Region) -> int:
        want = tuple(r.stop - r.start for r in region)
        try:
            data = leaf.read(region)
        except CkptError as exc:
            with lock:
                stats[leaf.path].failed = True
            where = ", ".join(f"{r.start}:{r.stop}" for r in region)
            findings.error(
                "bad-chunk", f"chunk [{where}] does not decode: {exc.message}",
                leaf=leaf.path, file=_relative(exc.where, ckpt.path),
            )
            return 0
        if data.shape != want or data.dtype != dtypes.numpy_dtype(leaf.dtype):
            findings.error(
                "bad-chunk",
                f"chunk decoded to {data.dtype}{list(data.shape)}, metadata says {leaf.dtype}{list(want)}",
                leaf=leaf.path,
            )
        elif dtypes.get(leaf.dtype).is_float and data.size:
            as_float = data.astype(np.float32) if data.dtype.itemsize < 4 else data
            nan = int(np.isnan(as_float).sum())
            inf = int(np.isinf(as_float).sum())
            if nan or inf:
                with lock:
                    stats[leaf.path].nan += nan
                    stats[leaf.path].inf += inf
        return int(data.nbytes)

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ckpt-deep") as pool:
        pending: set[Future[int]] = set()
        it = iter(tasks)
        progress("read", 0, total_bytes)
        while True:
            while len(pending) < max(1, workers) * 2:
                task = next(it, None)
                if task is None:
                    break
                pending.add(pool.submit(run, *task))
            if not pending:
                break
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                done_bytes += fut.result()
            progress("read", done_bytes, total_bytes)

    findings.count("chunks_read", len(tasks))
    findings.count("bytes_read", done_bytes)
    for path_, st in stats.items():
        if st.nan or st.inf:
            findings.warning("non-finite", f"{st.nan} NaN and {st.inf} Inf values", leaf=path_)

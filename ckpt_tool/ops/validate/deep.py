"""`validate --deep`: read and decode every chunk, in parallel, with bounded memory.

Works on the format-neutral model: each array leaf's stored chunks (a zarr
grid or a DCP chunk list) are read through the format's reader, which
decodes them (zarr codecs through tensorstore; the torch.save payload
through the allow-list). The read scheduler (scheduler/) decodes each
stored chunk once, within the --memory budget (a chunk too large to decode
whole is decoded as a stream, in bands), and each block of it is checked
(shape, dtype, NaN/Inf) as it arrives.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

from ...base import dtypes
from ...base.errors import CkptError, NotFoundError, TruncatedFileError, UnreadableFileError
from ...base.findings import Findings, Progress
from ...core.contract import reader_of
from ...base.parallel import run_bounded
from ...core.model import ArrayLeaf, Checkpoint, Region, ValueLeaf, split_to_cap, stored_chunks
from ...scheduler import DEFAULT_MEMORY, Scheduler, Want


@dataclass
class _LeafStats:
    nan: int = 0
    inf: int = 0
    failed: bool = False


# chunks bigger than this are read in blocks, so that a whole-tensor DCP
# chunk of several GB never sits in memory at once
BLOCK_BYTES = 32 * 2**20


def chunk_regions(leaf: ArrayLeaf, block_bytes: int | None = None) -> Iterator[Region]:
    """The regions of a leaf's stored chunks, large ones split into blocks."""
    for _, region, _ in chunk_blocks(leaf, block_bytes):
        yield region


def chunk_blocks(leaf: ArrayLeaf, block_bytes: int | None = None) -> Iterator[tuple[int, Region, bool]]:
    """(chunk index, region, whether the chunk was split) for every block to read."""
    block_bytes = block_bytes or BLOCK_BYTES
    itemsize = dtypes.get(leaf.dtype).itemsize
    for i, chunk in enumerate(stored_chunks(leaf.shape, leaf.layout)):
        pieces = split_to_cap(chunk, itemsize, block_bytes)
        for piece in pieces:
            yield i, piece.region, len(pieces) > 1


# elements counted for NaN/Inf at a time: the masks (and a float32 copy of a
# narrower float) are temporaries outside the budget, so they stay small
_COUNT_ELEMENTS = 1 << 20


def _non_finite(data: np.ndarray) -> tuple[int, int]:
    """(NaN count, Inf count) of a float array, in slices (bounded temporaries)."""
    flat = data.reshape(-1)
    nan = inf = 0
    for start in range(0, flat.size, _COUNT_ELEMENTS):
        part = flat[start : start + _COUNT_ELEMENTS]
        if part.dtype.itemsize < 4:  # float16, bfloat16, float8: numpy's tests need a native float
            part = part.astype(np.float32)
        finite = np.isfinite(part)
        if finite.all():
            continue
        part_nan = int(np.isnan(part).sum())
        nan += part_nan
        inf += int(part.size - finite.sum()) - part_nan
    return nan, inf


def _region_bytes(leaf: ArrayLeaf, region: Region) -> int:
    n = dtypes.get(leaf.dtype).itemsize
    for r in region:
        n *= r.stop - r.start
    return n


def file_cause(exc: CkptError) -> tuple[str, str] | None:
    """(finding code, message) when a read failed because of its file as a whole (missing,
    unreadable, cut short), the same for every item stored there: validate says so once for the
    file, with the leaves it hurts; None for a failure of the item itself (bad bytes, a bad codec)."""
    if not exc.where:
        return None
    if isinstance(exc, UnreadableFileError):
        return "unreadable-file", exc.message
    if isinstance(exc, TruncatedFileError):
        return "truncated-file", exc.cause
    if isinstance(exc, NotFoundError):
        return "missing-file", "data file is missing"
    return None


def _relative(where: str | None, root: str) -> str | None:
    """Findings name files relative to the checkpoint, as the shallow checks do."""
    if where and where.startswith(root.rstrip("/") + "/"):
        return where[len(root.rstrip("/")) + 1 :]
    return where


def deep_check_steps(
    path: str,
    fmt: str,
    findings: Findings,
    *,
    step: str | int | None = None,
    workers: int = 4,
    progress: Progress,
    memory: int = DEFAULT_MEMORY,
) -> None:
    """--deep on what the shallow checks covered: a checkpoint, or each step of a root.

    On a CheckpointManager root (Orbax, Flax checkpoint_N, T5X) the default
    and `--step all` read every committed step, one after another (each
    within `memory`); `--step N` / `latest` read that one. Leaves the shallow
    checks already found broken (in that step) are not read again.
    """
    from ...formats import open_checkpoint

    try:
        first = open_checkpoint(path, step=None if step in (None, "all") else step)
    except CkptError as exc:
        if not findings.errors:  # otherwise the shallow checks already said why
            findings.error("bad-metadata", f"cannot open for --deep: {exc.message}", file=_relative(exc.where, path))
        return
    if not first.steps or step not in (None, "all"):
        deep_check(path, fmt, findings, step=step, workers=workers, progress=progress, memory=memory,
                   skip_leaves=_broken(findings, first), ckpt=first)
        if first.steps and first.leaves:  # the one step of a root that was asked for
            # (a killed save's temporary directory, --step N, holds no leaf: no step was read)
            findings.count("steps_deep_read")
        return
    numbers = sorted({s.step for s in first.steps if s.committed and s.step is not None})
    for i, number in enumerate(numbers):
        ckpt = first if number == first.step else None
        if ckpt is None:
            try:
                ckpt = open_checkpoint(path, step=number)
            except CkptError as exc:
                findings.error("bad-metadata", f"step {number}: cannot open for --deep: {exc.message}",
                               file=_relative(exc.where, path))
                continue
        label = f"step {number} ({i + 1} of {len(numbers)})"
        deep_check(path, fmt, findings, step=number, workers=workers, memory=memory,
                   progress=_labelled(progress, label),
                   skip_leaves=_broken(findings, ckpt), ckpt=ckpt)
        findings.count("steps_deep_read")


def _labelled(progress: Progress, label: str) -> Progress:
    """`progress` with each report's `what` replaced by `label` (a step's place among the steps)."""
    return lambda what, done, total: progress(label, done, total)


def _step_prefix(ckpt: Checkpoint) -> str:
    """Where a step's files are named from, relative to what validate was given: "3/" for a step
    directory, "checkpoint_3" for a Flax step file, "" for a lone checkpoint."""
    if not ckpt.steps:
        return ""
    if ckpt.layout.get("step_dir"):
        return f"{ckpt.layout['step_dir']}/"
    return str(ckpt.layout.get("step_file") or "")


def _broken(findings: Findings, ckpt: Checkpoint) -> set[str]:
    """Leaves the shallow checks reported with an error in this step (or in no file in particular)."""
    prefix = _step_prefix(ckpt)
    return {
        f.leaf for f in findings.errors
        if f.leaf and (not prefix or not f.file or f.file == prefix or f.file.startswith(prefix.rstrip("/") + "/"))
    }


def deep_check(
    path: str,
    fmt: str,
    findings: Findings,
    *,
    step: str | int | None = None,
    workers: int = 4,
    progress: Progress,
    skip_leaves: set[str] | None = None,
    memory: int = DEFAULT_MEMORY,
    ckpt: Checkpoint | None = None,
) -> None:
    """Read and check every chunk of one checkpoint (one step of a root; `ckpt`: already opened)."""
    from ...formats import open_checkpoint

    if ckpt is None:
        try:
            ckpt = open_checkpoint(path, step=None if step in (None, "all") else step)
        except CkptError as exc:
            if not findings.errors:  # otherwise the shallow checks already said why
                findings.error("bad-metadata", f"cannot open for --deep: {exc.message}", file=_relative(exc.where, path))
            return
    # a finding without a file of its own names the step it is in (a root holds several)
    step_file = _step_prefix(ckpt) or None
    skip = skip_leaves or set()
    viewed = [leaf for leaf in ckpt.arrays() if leaf.path not in skip]
    # a view that repeats stored elements (torch's expand, overlapping strides) is checked
    # through the values it draws from, read once for every view on them: its logical
    # size (a TiB from 4 stored bytes) is never read
    leaves: list[ArrayLeaf] = []
    views_of: dict[int, list[tuple[ArrayLeaf, int | None]]] = {}  # id(leaf read) -> (view, repeats)
    for leaf in viewed:
        stored = _stored_values(leaf)
        read, repeats = stored if stored is not None else (leaf, 1)
        if id(read) not in views_of:
            leaves.append(read)
            views_of[id(read)] = []
        views_of[id(read)].append((leaf, repeats))
    total_bytes = sum(leaf.nbytes for leaf in leaves)
    stats = {id(leaf): _LeafStats() for leaf in leaves}
    lock = threading.Lock()

    def check(leaf: ArrayLeaf, region: Region) -> Callable[[list[np.ndarray]], int]:
        def run(arrays: list[np.ndarray]) -> int:
            data = arrays[0]
            want = tuple(r.stop - r.start for r in region)
            if data.shape != want or data.dtype != dtypes.numpy_dtype(leaf.dtype):
                for view, _ in views_of[id(leaf)]:
                    findings.error(
                        "bad-chunk",
                        f"chunk decoded to {data.dtype}{list(data.shape)}, metadata says {leaf.dtype}{list(want)}",
                        leaf=view.path, file=step_file,
                    )
            elif dtypes.get(leaf.dtype).is_float and data.size:
                nan, inf = _non_finite(data)
                if nan or inf:
                    with lock:
                        stats[id(leaf)].nan += nan
                        stats[id(leaf)].inf += inf
            return int(data.nbytes)

        return run

    # blocks: what is checked at once (a whole-tensor chunk of several GB never sits in memory whole)
    block = min(BLOCK_BYTES, max(2**20, memory // 8))
    wants = [Want([(leaf, region)], check(leaf, region)) for leaf in leaves for _, region, _ in chunk_blocks(leaf, block)]
    scheduler = Scheduler(wants, memory=memory, workers=workers)

    def file_fault(exc: CkptError, paths: Iterable[str]) -> bool:
        """A failure that is its file's fault (missing, unreadable, cut short) joins the one
        finding for that file, for each leaf path given; False when it is the item's own."""
        cause = file_cause(exc)
        if cause is None:
            return False
        for path in paths:
            findings.file_problem(cause[0], cause[1], file=_relative(exc.where, ckpt.path) or ".", leaf=path)
        return True

    def failed(leaf: ArrayLeaf, index: int, exc: CkptError) -> None:
        with lock:
            stats[id(leaf)].failed = True
        if file_fault(exc, (view.path for view, _ in views_of[id(leaf)])):
            return
        region = stored_chunks(leaf.shape, leaf.layout)[index].region
        where = ", ".join(f"{r.start}:{r.stop}" for r in region)
        for view, repeats in views_of[id(leaf)]:
            what = f"chunk [{where}]" if view is leaf else "its stored values"
            findings.error(
                "bad-chunk", f"{what} do{'es' if view is leaf else ''} not decode: {exc.message}",
                leaf=view.path, file=_relative(exc.where, ckpt.path) or step_file,
            )

    progress("read", 0, total_bytes)
    done_bytes = scheduler.run(on_done=lambda n: progress("read", n, total_bytes), on_error=failed)

    # a chunk decoded as a stream (in bands) never passes through its checksum
    # whole: the format's verifier checks it (DCP: from the bands' CRC-32s
    # when they tiled the chunk's storage, else by streaming it once more)
    verify = [
        (leaf, index) for leaf in leaves if leaf.verifier is not None and not stats[id(leaf)].failed
        for index in range(len(stored_chunks(leaf.shape, leaf.layout))) if not scheduler.decodes_whole(leaf, index)
    ]

    def run_verifier(leaf: ArrayLeaf, index: int) -> int:
        verifier = leaf.verifier
        if verifier is None:  # (`verify` holds leaves with a verifier only)
            return 0
        try:
            verifier(index)
        except CkptError as exc:
            if not file_fault(exc, (view.path for view, _ in views_of[id(leaf)])):
                for view, _ in views_of[id(leaf)]:
                    findings.error("bad-chunk", f"chunk {index}: {exc.message}", leaf=view.path,
                                   file=_relative(exc.where, ckpt.path) or step_file)
        return 0

    if verify:
        run_bounded(verify, lambda task: run_verifier(*task), workers=workers, name="ckpt-verify")
    findings.count("chunks_read", scheduler.planned_chunks)
    from ...formats import for_checkpoint

    info = for_checkpoint(fmt)
    # a format's own checks of stored data beyond the chunks (DCP: every non-tensor item
    # decoded; copies of replicated duplicates that .metadata does not point at)
    check_deep = info.checks().check_deep if info is not None else None
    if check_deep is not None:
        from ...formats import split_file
        from ...storage import Storage

        single = split_file(ckpt.path)  # a checkpoint that is one file: its directory's storage
        check_deep(Storage.open(single[1][0] if single else ckpt.path), ckpt, findings, skip)
    else:
        # scalars, strings and JSON items are stored data too (an Orbax scalar is
        # a 0-d zarr chunk): decode each, as a restore would
        values = [leaf for leaf in ckpt.leaves if isinstance(leaf, ValueLeaf) and leaf.path not in skip]
        for value in values:
            try:
                value.load()
            except CkptError as exc:
                if not file_fault(exc, (value.path,)):
                    findings.error("bad-chunk", f"value does not decode: {exc.message}", leaf=value.path,
                                   file=_relative(exc.where, ckpt.path) or step_file)
        if values:
            findings.count("values_read", len(values))
    findings.count("bytes_read", done_bytes)
    for leaf in leaves:
        st = stats[id(leaf)]
        if not (st.nan or st.inf):
            continue
        for view, repeats in views_of[id(leaf)]:
            if repeats is not None:  # (an expand repeats every value it draws from the same number of times)
                message = f"{st.nan * repeats} NaN and {st.inf * repeats} Inf values"
            else:
                message = f"{st.nan} NaN and {st.inf} Inf among the {leaf.size} stored values it spans"
            findings.warning("non-finite", message, leaf=view.path, file=step_file)


def _stored_values(leaf: ArrayLeaf) -> tuple[ArrayLeaf, int | None] | None:
    """(the leaf of the values a view draws from, how many times it repeats each; None: unevenly)
    for a leaf whose reader says it repeats stored elements (`stored_values`); None for any other."""
    return reader_of(leaf).stored_values()

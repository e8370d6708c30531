"""convert: a checkpoint copied leaf by leaf into another format, all or nothing.

convert is "same layout, new format"; reshard is "new layout, same format" (it
hands convert a PlannedWrite). The parts live beside this module: the source is
checked whole first (ops/preflight.py), planned into a WritePlan (ops/planner.py), and
refused if its local file system cannot hold it (ops/free_space.py); `stream`
(ops/streaming.py) then reads each output chunk's region, casts it if asked and gives
it to the writer, or copies stored chunks as they are (ops/stored_copy.py).

Output is all or nothing: it is written under a temporary name beside the
destination (local paths) and renamed into place after the commit markers;
on object stores, where there is no rename, the commit markers written last
are what makes the output a checkpoint.
"""
from __future__ import annotations

import contextlib
import os  # noqa: F401 - tests patch engine.os (the output layer's os calls)
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..core import casting
from .. import formats
from ..base.errors import CkptError, NoSpaceError
from ..base.findings import Progress, no_progress
from ..scheduler import DEFAULT_MEMORY
from ..core.model import Checkpoint
from ..core.model import as_regular_grid, default_grid  # noqa: F401 - moved to model (the formats' target layouts use them)
from .destination import OutputDir  # noqa: F401 (OutputDir: API)
# (an object-store DST's owner record and commit rule; local ones pass through to ops/destination.py)
from .destination_remote import begin_output, confirm_output, discard_output, finalize_output, prepare_output
from ..storage import ReadLog, Storage
from ..core.contract import CheckpointWriter
from ..core.write_plan import WritePlan
# (moved out of this module; imported here by the names other modules and the docs use)
from .free_space import check_free_space, free_bytes, no_space_error, output_bytes  # noqa: F401
from .preflight import check_source_complete, open_source  # noqa: F401
from .stored_copy import StoredCopies, copies_stored, output_chunk_limit, plans_stored_copy  # noqa: F401
from .streaming import chunk_regions, stream  # noqa: F401 - convert calls stream by this module's name (benches patch it)
from .planner import (  # noqa: F401
    DEFAULT_CHUNK_MB, ConversionPlanner, ConvertOptions, Sources, kept_reason, plan_conversion,
)

if TYPE_CHECKING:  # the interface only: distributed is imported by the commands that join a run
    from ..base import distributed
    from ..core import optim_keys


@dataclass
class ConvertResult:
    """What a convert did: counts, bytes, time, and what it skipped, cast, kept and cleaned up."""

    source: str
    destination: str
    source_format: str
    target_format: str
    arrays: int = 0
    values: int = 0
    chunks: int = 0
    bytes: int = 0
    # bytes this process read of SRC's files (storage.ReadLog.bytes): about its share of the
    # chunks in a multi-process run, plus the metadata every process reads
    bytes_read: int = 0
    seconds: float = 0.0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    cast: list[str] = field(default_factory=list)
    dtype: str | None = None  # --dtype
    # (leaf, its dtype, why) for each array --dtype left as it is (core/casting.py's reasons)
    kept: list[tuple[str, str, str]] = field(default_factory=list)
    # (file, field, was): each dtype field of the model's config set to --dtype (ops/hf_export.py)
    config_dtype: list[tuple[str, str, str]] = field(default_factory=list)
    # (leaf, values): the finite values --dtype turned into inf/NaN, written under --allow-overflow
    overflowed: list[tuple[str, int]] = field(default_factory=list)
    overflow_line: str = ""  # casting.Overflow.phrase of them
    process_index: int = 0
    process_count: int = 1
    # what was done with temporary outputs of killed runs beside DST, one line each (ops/destination.py)
    cleanup: list[str] = field(default_factory=list)
    companions: list[str] = field(default_factory=list)  # a model's non-weight files copied beside it
    like_differences: list[str] = field(default_factory=list)  # written anyway (--force-like)
    optimizer_keys: list[optim_keys.Rekeyed] = field(default_factory=list)  # --optimizer-keys-like

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source, "destination": self.destination,
            "source_format": self.source_format, "target_format": self.target_format,
            "arrays": self.arrays, "values": self.values, "chunks": self.chunks, "bytes": self.bytes,
            "bytes_read": self.bytes_read, "seconds": round(self.seconds, 3),
            "skipped": [{"leaf": p, "reason": r} for p, r in self.skipped],
            "cast": self.cast, "dtype": self.dtype,
            "kept": [{"leaf": p, "dtype": d, "reason": r} for p, d, r in self.kept],
            "config_dtype": [{"file": f, "field": k, "was": w, "now": self.dtype} for f, k, w in self.config_dtype],
            "overflowed": [{"leaf": p, "values": n} for p, n in self.overflowed],
            "process_index": self.process_index, "process_count": self.process_count,
            "cleanup": self.cleanup, "companions": self.companions, "like_differences": self.like_differences,
            "optimizer_keys": [r.to_json() for r in self.optimizer_keys],
        }


# -- writing (ops/destination.py: the temporary directory beside DST, what --overwrite replaces) --


class Terminated(KeyboardInterrupt):
    """SIGTERM during a convert: unwound like Ctrl-C, so the output is discarded."""


@contextlib.contextmanager
def _terminate_unwinds() -> Iterator[None]:
    """While writing, SIGTERM raises Terminated in the main thread instead of killing the process
    outright (which would leave the temporary output behind). Only where nobody else handles SIGTERM."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except (ValueError, OSError):
        previous = None
    if previous is not signal.SIG_DFL:
        yield
        return

    terminating = False

    def handler(signum: int, frame: Any) -> None:
        nonlocal terminating
        if not terminating:  # a second SIGTERM must not cut the clean-up short
            terminating = True
            raise Terminated()

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _chunk_owner(writer: CheckpointWriter, planned: PlannedWrite | None, rank: int, size: int) -> Callable[[int], bool]:
    """Whether this process (`rank` of `size`) writes the n-th chunk: a plan made elsewhere (reshard)
    says its own split, or round robin; else the writer says (safetensors: the owner of its file)."""
    if planned is not None:
        chosen = planned.owns
        return (lambda n: chosen(n, rank)) if chosen is not None else (lambda n: n % size == rank)
    return lambda n: writer.owns(n, rank, size)


def make_writer(fmt: str, storage: Storage, *, zarr3: bool = False, max_shard_size: int | None = None,
                memory: int = DEFAULT_MEMORY) -> CheckpointWriter:
    """The writer of the registered format `fmt` (its write module's make_writer)."""
    info = formats.REGISTRY.get(fmt)
    if info is None or not info.can_write:
        raise CkptError(f"unknown target format {fmt!r}")
    return info.writer_module().make_writer(storage, zarr3=zarr3, max_shard_size=max_shard_size, memory=memory)


def _optimizer_keys_like(src: Checkpoint, reference: str) -> tuple[Checkpoint, list[optim_keys.Rekeyed]]:
    """The source with its optimizer state keyed as the one in `reference` (any checkpoint ckpt
    reads) is: by integer ids, as `torch.save(opt.state_dict())`, or by FQNs, as DCP's
    get_state_dict; the pairs come from the two param_groups (core/optim_keys.py). Only the reference's
    metadata and its param_groups values are read."""
    from ..core import optim_keys  # (here: only --optimizer-keys-like rekeys)

    try:
        ref = open_source(reference, step=None)
    except CkptError as exc:  # (the line says which path it is: the reference, not the source)
        named = CkptError(f"--optimizer-keys-like: {exc.message}", exc.where)
        named.code = exc.code
        raise named from None
    entries, done = optim_keys.rekey_like([(tuple(leaf.keys), leaf) for leaf in src.leaves],
                                          [(tuple(leaf.keys), leaf) for leaf in ref.leaves], src.path, reference)
    leaves = [optim_keys.with_keys(leaf, keys) for keys, leaf in entries]
    return replace(src, leaves=leaves), done


# -- convert ---------------------------------------------------------------------


@dataclass
class PlannedWrite:
    """A plan made by another command (reshard) for `convert` to write as it is.

    `owns(n, rank)` says whether process `rank` writes the n-th chunk of the
    plan (in stream()'s order); None splits the chunks round robin.
    """

    source: Checkpoint
    plan: WritePlan
    sources: Sources
    owns: Callable[[int, int], bool] | None = None
    log: ReadLog | None = None  # what counts the reads of `source` (its storage's), if any


class Coordinator:
    """A single-process run's coordinator (distributed.Coordinator: the interface): its barriers are no-ops."""

    process_index = 0
    process_count = 1

    def barrier(self, name: str) -> None:
        return None


def convert(
    source: str,
    destination: str,
    opts: ConvertOptions,
    *,
    progress: Progress = no_progress,
    coordinator: distributed.Coordinator | None = None,
    planned: PlannedWrite | None = None,
) -> ConvertResult:
    """Convert `source` into `destination` in format opts.to; all or nothing.

    `planned`: write that plan (made and checked by the caller, e.g. reshard)
    instead of planning a conversion; opts still give the output options.
    Pickles are unpickled within opts.memory (as validate's).
    """
    from ..machinery.torch_save.pickle_budget import memory_budget  # (here: most commands never unpickle)

    with memory_budget(opts.memory):
        return _convert(source, destination, opts, progress=progress, coordinator=coordinator, planned=planned)


def _convert(
    source: str,
    destination: str,
    opts: ConvertOptions,
    *,
    progress: Progress,
    coordinator: distributed.Coordinator | None,
    planned: PlannedWrite | None,
) -> ConvertResult:
    coord = coordinator or Coordinator()
    started = time.monotonic()
    log = ReadLog() if planned is None else planned.log
    job = _job(source, destination, opts, planned, log)
    plan = job.plan
    cast = [t.path for t in plan.arrays() if t.source_dtype]
    # the model's config names the dtype from_pretrained loads by default: the cast one, read and
    # checked before anything is written
    retyped: dict[str, bytes] = {}
    config_dtype: list[tuple[str, str, str]] = []
    if job.companions and cast and opts.dtype:
        from . import hf_export

        retyped, config_dtype = hf_export.retyped_configs(job.companions[0], job.companions[1], opts.dtype)
    plan.process_index, plan.process_count = coord.process_index, coord.process_count
    plan.info["destination"] = destination  # orbax names the final path in commit_success.txt
    # a destination too small for the output is refused before anything is created there
    check_free_space(destination, plan, opts.to)
    primary = coord.process_index == 0
    # the primary clears the leftovers of killed runs (or refuses: another run writes DST) and
    # creates the temporary output, its owner record first, before any process writes into it
    out = prepare_output(source, destination, overwrite=opts.overwrite, shared_name=coord.process_count > 1,
                         primary=primary, writes=opts.to)
    if primary:
        begin_output(out)
    coord.barrier("ckpt-convert-start")
    result = ConvertResult(source, destination, job.src.format, opts.to, skipped=job.skipped,
                           process_index=coord.process_index, process_count=coord.process_count)
    result.cast = cast
    if opts.dtype:
        result.dtype = opts.dtype
        result.kept = [(t.path, t.dtype, reason) for t in plan.arrays() if not t.source_dtype
                       for reason in [kept_reason(t, job.sources, opts.dtype)]]
        result.config_dtype = config_dtype
    result.cleanup = list(out.notes)
    result.companions = list(job.companions[1]) if job.companions else []
    result.like_differences = job.differences
    result.optimizer_keys = job.rekeyed
    # from the first byte written to the rename, any failure (a dead endpoint,
    # a full disk, Ctrl-C, SIGTERM) removes the temporary output
    with _terminate_unwinds():
        _write_output(out, job, opts, result, coord=coord, planned=planned, progress=progress, retyped=retyped)
    result.arrays = len(plan.arrays())
    result.values = len(plan.values())
    result.bytes_read = log.bytes if log is not None else 0
    result.seconds = time.monotonic() - started
    return result


@dataclass
class _Job:
    """What a convert writes: the source, the plan of it, and what goes beside the plan."""

    src: Checkpoint
    plan: WritePlan
    skipped: list[tuple[str, str]]
    sources: Sources
    companions: tuple[Storage, list[str]] | None = None  # the model's files (hf_export.model_files)
    differences: list[str] = field(default_factory=list)  # --force-like's
    rekeyed: list[optim_keys.Rekeyed] = field(default_factory=list)  # --optimizer-keys-like


def _job(source: str, destination: str, opts: ConvertOptions, planned: PlannedWrite | None,
         log: ReadLog | None) -> _Job:
    """The source opened and checked whole (the preflight), then planned; or the caller's plan."""
    if planned is not None:
        return _Job(planned.source, planned.plan, [], planned.sources)
    with formats.read_options(**opts.read_options):
        src = open_source(source, step=opts.step, log=log)
    if not src.committed:
        raise CkptError("the source is an uncommitted save; refusing to convert it", source)
    check_source_complete(src, source)
    rekeyed: list[optim_keys.Rekeyed] = []
    if opts.optimizer_keys_like is not None:
        src, rekeyed = _optimizer_keys_like(src, opts.optimizer_keys_like)
    plan, skipped, sources = plan_conversion(src, opts, destination)
    companions: tuple[Storage, list[str]] | None = None
    differences: list[str] = []
    if opts.like is not None or opts.force_like or opts.to in formats.taking("like"):
        from . import hf_export  # (a model's files beside the output: --like, or a target that takes them)

        companions, differences = hf_export.model_files(src, plan, skipped, opts)
    return _Job(src, plan, skipped, sources, companions, differences, rekeyed)


def _write_output(out: OutputDir, job: _Job, opts: ConvertOptions, result: ConvertResult, *,
                  coord: distributed.Coordinator | Coordinator, planned: PlannedWrite | None, progress: Progress,
                  retyped: dict[str, bytes]) -> None:
    """Write the plan into the temporary output `out` and commit it there (the primary, once every
    process has written its part); on any failure the temporary output is removed."""
    primary = coord.process_index == 0
    writer: CheckpointWriter | None = None
    try:
        writer = make_writer(opts.to, out.storage(), zarr3=opts.zarr3, max_shard_size=opts.max_shard_size,
                             memory=opts.memory)
        writer.begin(job.plan)
        _stream_plan(writer, job, opts, result, coord=coord, planned=planned, progress=progress)
        if primary:
            for value in job.plan.values():
                writer.write_value(value)
        writer.finish_process()
        coord.barrier("ckpt-convert-written")
        if primary:
            if job.companions:  # before the commit: the model's files are part of the output
                from . import hf_export

                hf_export.copy_companions(job.companions[0], job.companions[1], out.storage(), retyped)
            confirm_output(out)  # an object store: no other run took DST over meanwhile
            writer.commit()
            finalize_output(out, overwrite=opts.overwrite)
            # (finalize re-judges DST and may correct what it says it replaced)
            result.cleanup = list(out.notes)
        coord.barrier("ckpt-convert-done")
    except BaseException as exc:
        try:
            if writer is not None:
                writer.abort()
        finally:  # whatever abort does, an unfinished output never stays behind
            if primary or coord.process_count == 1:
                discard_output(out)
        out.name_destination(exc)  # DST in the message, not the hidden temporary directory
        if isinstance(exc, NoSpaceError):  # (the temporary output is gone: what is free now is DST's)
            raise no_space_error(result.destination, job.plan, opts.to) from None
        raise


def _stream_plan(writer: CheckpointWriter, job: _Job, opts: ConvertOptions, result: ConvertResult, *,
                 coord: distributed.Coordinator | Coordinator, planned: PlannedWrite | None,
                 progress: Progress) -> None:
    """Every chunk of the plan this process owns, into `writer` (stream); a --dtype cast whose
    values overflowed is refused once every leaf is cast, unless --allow-overflow."""
    # a writer whose files each belong to one process (safetensors) says who writes what
    owns = _chunk_owner(writer, planned, coord.process_index, coord.process_count)
    overflow = casting.Overflow()
    result.chunks, result.bytes = stream(
        job.plan, job.sources, writer, workers=opts.workers, progress=progress, memory=opts.memory, owns=owns,
        chunk_blocks=formats.REGISTRY[opts.to].writes_chunk_blocks, overflow=overflow,
    )
    if overflow and opts.dtype:
        # every leaf is cast before this is said, so that the line names them all; the
        # output is then discarded by the caller (an inf weight is a broken model)
        result.overflow_line = overflow.phrase(opts.dtype)
        result.overflowed = sorted(overflow.by_leaf.items())
        if not opts.allow_overflow:
            raise casting.CastOverflowError(f"--dtype {opts.dtype}: {result.overflow_line}; nothing was written "
                                            "(--allow-overflow writes it anyway)", result.source)

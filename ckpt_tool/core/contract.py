"""The format contract: everything a format package provides and everything ckpt asks of it.

This module is the reference for adding a format. A format is one package under
ckpt_tool/formats/ plus one FormatInfo line in formats.REGISTRY; the engine,
the scheduler, validate and the CLI reach it only through the interfaces here:

* the package itself (``formats/<name>/__init__.py``), the read side:
  FormatModule names what every package must define (NAME, detect, read);
  ReaderModule wraps a package and declares its optional hooks (split_file,
  read_file, layout_text, recorded_tuples), each with its default.
* the array readers a reader hands out (ArrayLeaf.reader): ArrayReader, an
  abstract base class whose optional hooks (start_open, start_read,
  start_read_into, stored_chunk, stored_values, reads_byte_ranges) default to
  what a plain region read can do. A plain function is a reader too
  (array_reader wraps it).
* the write side, for a format with ``can_write`` (``formats/<name>/write.py``):
  WriterModule wraps it and declares what the engine asks while planning a
  conversion (make_writer, keeps_source_chunks, target_layout, plan_value,
  TUPLES_AS_VALUES, gathered_value, KEEPS_ANY_STR); CheckpointWriter is the
  abstract base class of the writer objects make_writer returns (begin,
  write_array, write_value, finish_process, commit, abort; optional
  pending_bytes_limit and owns).
* validate's checks (``formats/<name>/checks.py``): ChecksModule wraps it
  (check_path; optional check_opened, manifest_covers, check_single_file, check_deep).
* a training framework's run-root rules that the package's reader knows
  (``formats/<name>/run_roots.py``, for the frameworks its FormatInfo.run_roots
  names): RunRules, asked by formats/roots.py's table (step_of, status_of;
  optional owns, confirm, read_pointer).

The wrappers are the only place a hook is looked up by name: a hook a package
does not define takes the default written beside its declaration, and callers
type against these classes. Conformance is declared and checked three ways:
readers and writers subclass the ABCs; each package's __init__ assigns itself,
its checks.py and write.py to FormatModule, FormatChecksModule and
FormatWriteModule under TYPE_CHECKING, so that mypy (`make typecheck`) checks
their signatures; tests/formats/test_registry.py checks every registered package
against `missing_members`, and the conformance suite
(tests/conformance/test_conformance_catalogue.py) drops in a throwaway format
and runs it through read, validate, convert, damage and fuzzing.

Adding a format: the package (NAME, detect, read; an ArrayReader per array
kind it reads; checks.py; write.py and a CheckpointWriter if it writes), the
TYPE_CHECKING declaration at the end of its __init__ (as every package has),
one FormatInfo in formats.REGISTRY, and its fixtures and catalogue rows
(tests/conformance/catalogue.py).

This module imports nothing heavy and names no format: `ckpt --help` imports
the registry, and the registry imports this.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol

from ..base.errors import CkptError

if TYPE_CHECKING:
    import numpy as np

    from ..base.findings import Findings
    from .model import ArrayLeaf, Checkpoint, ChunkLayout, Key, Region
    from ..storage import Storage
    from .write_plan import PlanContext, TargetArray, TargetValue, WritePlan


# -- the read side: the package ------------------------------------------------------------------


class FormatModule(Protocol):
    """What every format package defines at its top level (formats/<name>/__init__.py)."""

    #: the registry's name of the format (formats.REGISTRY's key)
    NAME: str

    def detect(self, storage: Storage) -> bool:
        """Whether the directory `storage` is a checkpoint of this format (the readers' own answer).

        Called in detection order (formats.REGISTRY) on every directory a command is given, and on
        its sub-directories when none claims it: it must be cheap (a listing, a small file) and
        never raise for a directory of another format."""
        ...

    def read(self, storage: Storage, *, step: str | int | None = None) -> Checkpoint:
        """The checkpoint in `storage`, from its metadata alone (array data is read on request
        through each ArrayLeaf's reader). `step` picks a step of a run root; the format's
        FormatInfo.read_options arrive as keyword arguments too."""
        ...


# the module-level names a package must define; the rest of its interface is optional (ReaderModule)
REQUIRED_MEMBERS = ("NAME", "detect", "read")


class ReaderModule:
    """A format's package seen through the contract: its required members and its optional hooks,
    each declared here with its default (FormatInfo.reader_module())."""

    __slots__ = ("module",)

    def __init__(self, module: ModuleType) -> None:
        self.module = module

    @property
    def NAME(self) -> str:  # noqa: N802 - the package's own name for it
        return str(self.module.NAME)

    def detect(self, storage: Storage) -> bool:
        """FormatModule.detect."""
        return bool(self.module.detect(storage))

    def read(self, storage: Storage, *, step: str | int | None = None, **options: str) -> Checkpoint:
        """FormatModule.read."""
        ckpt: Checkpoint = self.module.read(storage, step=step, **options)
        return ckpt

    def split_file(self, url: str) -> tuple[str, str] | None:
        """(directory, file name) when `url` names one file this format reads as a checkpoint; None otherwise.

        Asked by formats.split_file for a format whose FormatInfo.single_file is set (for "claimed",
        only of a file its `claims` match), before the URL is read as a directory. Default: None
        (a format whose checkpoints are directories)."""
        hook = getattr(self.module, "split_file", None)
        return hook(url) if hook is not None else None

    def read_file(self, storage: Storage, name: str) -> Checkpoint:
        """The checkpoint that is the one file `name` in `storage` (as split_file cut the URL).

        Called only after split_file answered: a format that defines split_file defines this."""
        ckpt: Checkpoint = self.module.read_file(storage, name)
        return ckpt

    def layout_text(self, ckpt: Checkpoint) -> str:
        """inspect's "format" row: the format and its layout in one line ("Orbax, OCDBT + zarr2").
        Default: Checkpoint.format."""
        hook = getattr(self.module, "layout_text", None)
        return str(hook(ckpt)) if hook is not None else ckpt.format

    def recorded_tuples(self, ckpt: Checkpoint) -> set[tuple[Key, ...]]:
        """The key paths of the sequence nodes the checkpoint records as tuples, not lists.

        Asked of the source format by convert: a writer that keeps a tuple as one value
        (WriterModule.TUPLES_AS_VALUES) gets these gathered back from their element leaves.
        Default: none (a format that records no tuples)."""
        hook = getattr(self.module, "recorded_tuples", None)
        return set(hook(ckpt)) if hook is not None else set()


# -- the read side: array readers ----------------------------------------------------------------


class ArrayReader(ABC):
    """Reads regions of one array leaf's stored data (ArrayLeaf.reader).

    A reader is called with a region (a tuple of slices, one per dimension, normalised: starts and
    stops within the shape, step 1) and returns that region as a numpy array of the region's shape,
    from any thread. The hooks below let the scheduler read better than region by region; each
    defaults to what a plain region read can do, and a reader overrides those its storage allows.
    One reader per array, 10^4-10^5 of them: subclasses keep `__slots__`.
    """

    __slots__ = ()

    #: any part of a stored chunk reads by byte ranges of its raw bytes (DCP, safetensors,
    #: torch.save): the scheduler streams a chunk too large for the memory budget band by band
    #: through plain region reads
    reads_byte_ranges: ClassVar[bool] = False
    #: start_read / start_read_into return before the data is there (tensorstore): the scheduler
    #: starts a group of small reads together and reads a chunk feeding several regions straight
    #: into their buffers; with False it reads region by region
    starts_reads: ClassVar[bool] = False

    @abstractmethod
    def __call__(self, region: Region) -> np.ndarray:
        """The region's data (of the region's shape)."""

    def start_open(self) -> None:
        """Start opening the array without waiting, before a group of reads (many small arrays'
        opens then overlap). Default: nothing (the first read opens it)."""

    def start_read(self, region: Region) -> Callable[[], np.ndarray]:
        """Start reading a region; the returned call waits for it and returns it.
        Default: the region is read now (see starts_reads)."""
        data = self(region)
        return lambda: data

    def start_read_into(self, region: Region, out: np.ndarray) -> Callable[[], None]:
        """Start reading a region into `out` (of the region's shape); the returned call waits.
        Default: the region is read now and copied."""
        out[...] = self(region)
        return lambda: None

    def stored_chunk(self, index: tuple[int, ...]) -> tuple[Storage, str, dict[str, Any], bool] | None:
        """Where the stored zarr chunk at grid position `index` lives: (storage, key, zarr metadata,
        zarr3), so that a chunk too large to decode whole under the memory budget is decoded as a
        stream (codecs.ChunkStream). Asked only of a leaf with a RegularGrid layout. Default: None
        (not a zarr chunk)."""
        return None

    def stored_encoding(self) -> Any:
        """How the stored chunks are encoded, as a value a writer compares with its own
        (CheckpointWriter.stored_encoding): equal ones mean a stored chunk is a valid chunk of the
        output byte for byte. Default: None (never copied as stored)."""
        return None

    def copy_stored(self, index: tuple[int, ...], write: Callable[[bytes], None], window: int) -> int:
        """Hand the stored bytes of the chunk at grid position `index` to `write`, in pieces of at
        most `window` bytes, checking that they decode to what the metadata claims (CkptError if
        not); returns how many. Asked only where stored_encoding() is not None."""
        raise CkptError("this array's chunks are not copied as they are stored")

    def stored_values(self) -> tuple[ArrayLeaf, int | None] | None:
        """For a view whose elements repeat stored ones (a torch expand / as_strided view): the leaf
        of the stored elements and how many of them it covers, which validate --deep checks in place
        of the view's. Default: None (the reader gives its stored elements as they are)."""
        return None


class _FunctionReader(ArrayReader):
    """A plain region-reading function as an ArrayReader with every hook defaulted."""

    __slots__ = ("_read",)

    def __init__(self, read: Callable[[Region], np.ndarray]) -> None:
        self._read = read

    def __call__(self, region: Region) -> np.ndarray:
        return self._read(region)


def array_reader(reader: ArrayReader | Callable[[Region], np.ndarray]) -> ArrayReader:
    """`reader` as an ArrayReader: itself, or a plain function (a test's lambda, unstack's
    projection) wrapped with every hook defaulted."""
    return reader if isinstance(reader, ArrayReader) else _FunctionReader(reader)


def reader_of(leaf: ArrayLeaf) -> ArrayReader:
    """The leaf's reader as an ArrayReader (a leaf without one reads through ArrayLeaf.read, which
    says it has none)."""
    return array_reader(leaf.reader if leaf.reader is not None else leaf.read)


# -- the write side ------------------------------------------------------------------------------


class CheckpointWriter(ABC):
    """Writes one checkpoint into a directory that does not exist yet (or is empty); writers never
    print, they write through a Storage.

    Call order: begin(plan) once; write_array(target, chunk_index, region, data) for every chunk of
    every array this process owns (see owns), from any thread; write_value(target) for every value,
    on the primary; then finish_process() on every process; and finally, on the primary only and
    after every process has finished (a barrier), commit(), which writes the metadata and commit
    markers last. abort() drops in-flight state after a failure (the caller removes the temporary
    directory).

    The region of write_array is one output chunk, or, for a format whose FormatInfo says
    writes_chunk_blocks, possibly a block of whole chunks of its RegularGrid (chunk_index: the
    block's first chunk; core/blocks.py): one write for many small chunks costs tensorstore far less.

    write_array takes the chunk's array over: the caller must not modify it afterwards, so that a
    writer may hold on to it until its write is committed instead of copying it (the Orbax writer
    does).
    """

    @abstractmethod
    def begin(self, plan: WritePlan) -> None:
        """Create the output's layout for `plan` (every target's shape, dtype and chunks)."""

    @abstractmethod
    def write_array(self, target: TargetArray, chunk_index: int, region: Region, data: np.ndarray) -> None:
        """Write output chunk `chunk_index` of `target` (its `region`, `data` of that shape), or the
        block of whole chunks starting there (writes_chunk_blocks)."""

    @abstractmethod
    def write_value(self, target: TargetValue) -> None:
        """Write one non-array leaf."""

    @abstractmethod
    def finish_process(self) -> None:
        """This process has written all it owns: flush and close what it holds."""

    @abstractmethod
    def commit(self) -> None:
        """On the primary, after every process finished: write the metadata and commit markers."""

    @abstractmethod
    def abort(self) -> None:
        """Drop in-flight state after a failure; never raises for state already gone."""

    def stored_encoding(self, target: TargetArray) -> Any:
        """How this writer stores `target`'s chunks, comparable with ArrayReader.stored_encoding:
        where the two are equal, write_stored takes a source chunk's stored bytes as they are.
        Asked after begin(). Default: None (every chunk comes through write_array)."""
        return None

    def write_stored(self, target: TargetArray, chunk_index: int, region: Region,
                     copy: Callable[[Callable[[bytes], None]], int]) -> None:
        """Write output chunk `chunk_index` (`region`, one whole chunk) as the stored bytes
        `copy(write)` hands over piece by piece (ArrayReader.copy_stored). Only where
        stored_encoding(target) is not None."""
        raise CkptError("this writer takes no stored chunks", target.path)

    @property
    def pending_bytes_limit(self) -> int:
        """Memory the writer holds besides the reader's (bytes handed to it and not yet written):
        convert reserves it from the memory budget before reading. Default: 0 (written when given)."""
        return 0

    def owns(self, n: int, rank: int, count: int) -> bool:
        """Whether process `rank` of `count` writes the n-th chunk of the plan (in engine.stream()'s
        order). Asked after begin(). Default: round robin; a writer whose files each belong to one
        process (safetensors) says its own."""
        return n % count == rank


class FormatWriteModule(Protocol):
    """What a format's write.py defines (a format with FormatInfo.can_write); WriterModule documents
    each member and gives the optional ones their defaults."""

    TUPLES_AS_VALUES: bool

    def make_writer(self, storage: Storage, *, zarr3: bool, max_shard_size: int | None,
                    memory: int) -> CheckpointWriter: ...

    def keeps_source_chunks(self, leaf: ArrayLeaf) -> bool: ...

    def target_layout(self, leaf: ArrayLeaf, itemsize: int, cap: int | None, cap_bytes: int) -> ChunkLayout: ...

    def plan_value(self, ctx: PlanContext, keys: tuple[Key, ...], name: str, value: Any, source_path: str) -> None: ...


class WriterModule:
    """A format's write module (formats/<name>/write.py) seen through the contract: what the engine
    asks while it plans and starts a conversion (FormatInfo.writer_module())."""

    __slots__ = ("module",)

    # the names a write module must define
    REQUIRED = ("make_writer", "keeps_source_chunks", "target_layout", "plan_value", "TUPLES_AS_VALUES")

    def __init__(self, module: ModuleType) -> None:
        self.module = module

    def make_writer(self, storage: Storage, *, zarr3: bool, max_shard_size: int | None,
                    memory: int) -> CheckpointWriter:
        """The writer of one output in `storage` (a temporary directory convert renames when done).
        Takes every writer option; a format uses those its FormatInfo.options name and ignores
        the rest."""
        writer: CheckpointWriter = self.module.make_writer(storage, zarr3=zarr3, max_shard_size=max_shard_size,
                                                           memory=memory)
        return writer

    def keeps_source_chunks(self, leaf: ArrayLeaf) -> bool:
        """Whether the format keeps a source array's chunks as they are (DCP's chunk lists, an
        Orbax grid): a chunk too big for the memory budget is then split to the budget, not to the
        default chunk size."""
        return bool(self.module.keeps_source_chunks(leaf))

    def target_layout(self, leaf: ArrayLeaf, itemsize: int, cap: int | None, cap_bytes: int) -> ChunkLayout:
        """The output chunks of an array (RegularGrid or ChunkList). `cap`: --chunk-mb or the memory
        budget's limit in bytes, None when neither applies; `cap_bytes`: the cap, or the default
        chunk size."""
        layout: ChunkLayout = self.module.target_layout(leaf, itemsize, cap, cap_bytes)
        return layout

    def plan_value(self, ctx: PlanContext, keys: tuple[Key, ...], name: str, value: Any, source_path: str) -> None:
        """What a loaded value leaf of the source becomes in this format, told to `ctx`: one value,
        a subtree of values and arrays, or a refusal (ctx.refuse)."""
        self.module.plan_value(ctx, keys, name, value, source_path)

    @property
    def TUPLES_AS_VALUES(self) -> bool:  # noqa: N802 - the module's own name for it
        """A tuple of the source is one value in this format (DCP's bytes item: torch's traversal
        stops at it), gathered from the source's element leaves by gathered_value; else its
        elements are leaves (and the tuple is recorded where the format can: Orbax)."""
        return bool(self.module.TUPLES_AS_VALUES)

    def gathered_value(self, value: Any, where: str) -> Any:
        """The value a gathered tuple is written as (required where TUPLES_AS_VALUES is true)."""
        return self.module.gathered_value(value, where)

    def stored_chunk_encoding(self, destination: str, target: TargetArray, zarr3: bool) -> Any:
        """How a writer to `destination` would store `target`'s chunks (its layout's grid) where it
        takes source chunks as they are stored (CheckpointWriter.write_stored), for planning:
        a source chunk of that encoding (ArrayReader.stored_encoding) is copied whole however
        large, not cut to fit the memory budget. Default: None (it takes none)."""
        hook = getattr(self.module, "stored_chunk_encoding", None)
        return None if hook is None else hook(destination, target, zarr3)

    @property
    def OUTPUT_ENTRIES(self) -> tuple[str, ...] | None:  # noqa: N802 - the module's own name for it
        """Name globs of the top-level entries (files and directories) a convert to this format
        creates in DST, its own temporary files included (DCP's `.ckpt-entries.N`): on an object
        store the owner record names them, and a later `--overwrite` removes exactly the keys
        under them. Default: None (the format's registry claims and parts)."""
        value = getattr(self.module, "OUTPUT_ENTRIES", None)
        return tuple(value) if value is not None else None

    @property
    def COMMIT_MARKERS(self) -> tuple[str, ...]:  # noqa: N802 - the module's own name for it
        """Name globs of the top-level files the writer's commit() writes last, whose presence
        makes the output a complete checkpoint for the format's loaders (Orbax's
        commit_success.txt): on an object store, which has no rename, they are the commit, and a
        save being removed loses them first. Default: none."""
        return tuple(getattr(self.module, "COMMIT_MARKERS", ()))

    @property
    def KEEPS_ANY_STR(self) -> bool:  # noqa: N802 - the module's own name for it
        """It stores any str as a name or string value, lone surrogates too (DCP's pickle). Default:
        False: a name or string that is not Unicode text is refused (it would be written as UTF-8)."""
        return bool(getattr(self.module, "KEEPS_ANY_STR", False))


# -- validate's checks ---------------------------------------------------------------------------


class FormatChecksModule(Protocol):
    """What a format's checks.py defines; ChecksModule documents it and defaults the optional hooks."""

    def check_path(self, storage: Storage, findings: Findings, *, step: str | int | None = None,
                   only: str | None = None) -> str | None: ...


class ChecksModule:
    """A format's checks module (formats/<name>/checks.py) seen through the contract: validate's
    questions to the format (FormatInfo.checks())."""

    __slots__ = ("module",)

    REQUIRED = ("check_path",)

    def __init__(self, module: ModuleType) -> None:
        self.module = module

    def check_path(self, storage: Storage, findings: Findings, *, step: str | int | None = None,
                   only: str | None = None, **options: str) -> str | None:
        """validate's shallow checks of the checkpoint in `storage` (metadata against the files,
        sizes, commit markers), reported to `findings`. `step`: as read's; `only`: the one file a
        single-file checkpoint is (split_file's name); `options`: the reader options given that the
        format takes (its FormatInfo.read_options, as read() gets them: the checks read what the
        reader would). May return the checkpoint's format family ("flax", "t5x") when it differs
        from the format's name."""
        family: str | None = self.module.check_path(storage, findings, step=step, only=only, **options)
        return family

    def check_opened(self, storage: Storage, findings: Findings, parsed: dict[str, Any], *,
                     step: str | int | None = None, only: str | None = None, **options: str) -> str | None:
        """check_path of a checkpoint its reader opened already in this run (convert's, reshard's and
        diff's preflight, through validate.validate_opened): `storage` is the one it was read through
        (its listing taken), `parsed` what the reader parsed of its metadata files (Checkpoint.parsed),
        which the checks take instead of reading and parsing those files again; what only the checks
        look at (listings, sizes, an OCDBT B-tree, files the reader leaves for later) they still read.
        The checks take each record they use out of `parsed` (its memory goes with the checks). The
        findings are check_path's, to the letter. Default: check_path (the metadata read again)."""
        hook = getattr(self.module, "check_opened", None)
        if hook is None or not parsed:
            return self.check_path(storage, findings, step=step, only=only, **options)
        family: str | None = hook(storage, findings, parsed, step=step, only=only, **options)
        return family

    def manifest_covers(self, name: str) -> bool:
        """For validate's manifest check: whether the top-level file `name` is one the format's own
        manifest (Megatron's integrity.json) must name; a file it does not cover is not reported
        unlisted. Default: every file."""
        hook = getattr(self.module, "manifest_covers", None)
        return bool(hook(name)) if hook is not None else True

    @property
    def check_single_file(self) -> Callable[[Storage, str, Findings], str] | None:
        """validate of a checkpoint that is one file, checked the format's own way (a Flax msgpack
        file): check_single_file(storage, name, findings) -> the family found; validate builds the
        report and --deep reads what these checks found readable. Default: None (the shallow
        checks with `only`, then the deep read)."""
        return getattr(self.module, "check_single_file", None)

    @property
    def check_deep(self) -> Callable[[Storage, Checkpoint, Findings, set[str]], None] | None:
        """The format's own checks of stored data beyond the chunks, after validate --deep read
        them: check_deep(storage, ckpt, findings, skip_leaves) (DCP: every non-tensor item decoded).
        Default: None."""
        return getattr(self.module, "check_deep", None)


# -- run roots: a training framework's rules that a format package knows -------------------------

# a step's status in its run root, by its writer's rule (formats/roots.py says what each means)
COMMITTED = "committed"
INCOMPLETE = "incomplete"
IN_PROGRESS = "in-progress"
STATUSES = (COMMITTED, INCOMPLETE, IN_PROGRESS)


@dataclass(frozen=True)
class Entry:
    """One top-level directory or file of a run root that a layout names as a step."""

    name: str
    is_dir: bool


@dataclass(frozen=True)
class StepStatus:
    status: str  # one of STATUSES
    reason: str | None = None  # why it is not committed


class RootView(Protocol):
    """What RunRules may ask of a run root's one listing (formats/roots.py's RootListing)."""

    @property
    def storage(self) -> Storage: ...
    @property
    def dirs(self) -> list[str]: ...
    @property
    def files(self) -> list[str]: ...

    def top(self, entry: str, sub: str = "") -> tuple[set[str], set[str]]:
        """(directories, files) directly inside `entry` (or inside `entry/sub`)."""
        ...

    def has(self, entry: str, rel: str) -> bool:
        """Whether the key `entry/rel` is in the listing."""
        ...


class RunRules(ABC):
    """One training framework's rules for the steps of its run roots, judged from one listing of
    the root: what formats/roots.py's table (RunLayout) asks for `ckpt ls`, `ckpt latest` and a run
    root's default step.

    Where a format package's reader already knows a framework's rules (the Orbax reader's commit
    rules, the Megatron reader's tracker, the DeepSpeed reader's `latest` tag, the msgpack reader's
    temporary names), the package holds them: its `run_roots.py` maps the framework's name
    (RunLayout.name) to a RunRules in `RULES`, and its FormatInfo.run_roots names those frameworks;
    roots.py reaches them through the registry's table, never by importing the package. A
    run_roots.py imports nothing heavy at module level: a root of another framework asks it too."""

    #: confirm() reads more than the listing (a step's metadata): the step opened by default is
    #: confirmed with it, so that it is the one the format's reader (and the library) would pick
    confirms: bool = False

    @abstractmethod
    def step_of(self, name: str) -> int | None:
        """The step number of an entry named `name` (of RunLayout's kind: a directory, or a file
        where the layout's steps are files), -1 for a save in progress of no step yet, or None: not
        one of this framework's entries."""

    def owns(self, listing: RootView, entry: Entry) -> bool:
        """Whether the entry is this framework's (its markers are there), where its name is not
        enough. Default: its name is."""
        return True

    @abstractmethod
    def status_of(self, listing: RootView, entry: Entry) -> StepStatus:
        """The entry's status from the listing alone."""

    def confirm(self, listing: RootView, entry: Entry) -> StepStatus:
        """The writer's whole commit rule on one step, reading what a listing cannot show (with
        `confirms`). Default: the listing's status."""
        return self.status_of(listing, entry)

    def read_pointer(self, listing: RootView) -> str:
        """The entry name the framework's pointer file (RunLayout.pointer, which is there) names;
        a CkptError when it does not read as one. Asked only of a layout with a pointer."""
        raise NotImplementedError(f"{type(self).__name__} reads no pointer file")


def run_rules(module: ModuleType, framework: str) -> RunRules:
    """The rules for `framework` in a package's run_roots.py (its RULES)."""
    rules = getattr(module, "RULES", {}).get(framework)
    if not isinstance(rules, RunRules):
        raise RuntimeError(f"{module.__name__}.RULES holds no RunRules for {framework!r}")
    return rules


def missing_members(package: ModuleType, write: ModuleType | None = None,
                    checks: ModuleType | None = None) -> list[str]:
    """The required members a format's modules lack ("write.plan_value"): empty when they conform."""
    missing = [name for name in REQUIRED_MEMBERS if not hasattr(package, name)]
    for prefix, module, required in (("write", write, WriterModule.REQUIRED), ("checks", checks, ChecksModule.REQUIRED)):
        if module is not None:
            missing += [f"{prefix}.{name}" for name in required if not hasattr(module, name)]
    if write is not None and getattr(write, "TUPLES_AS_VALUES", False) and not hasattr(write, "gathered_value"):
        missing.append("write.gathered_value")
    return missing

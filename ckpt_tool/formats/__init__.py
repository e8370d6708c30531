"""The format registry: what each format can do, and which package does it.

Each format is one package under formats/ (reader, writer, schema, shallow
checks) with the same interface, declared in one place: core/contract.py
(the package's NAME, detect, read and optional hooks; its array readers; its
`write.py` where the format has a writer; its `checks.py` for validate).

Adding a format means one package, which declares itself in its
`registration.py` (FORMATS: its FormatInfo; see discover below); nothing above
formats/ changes: the engine, validate and the CLI ask this module.
This module imports nothing heavy (no numpy, tensorstore or format package):
`ckpt --help` lists the formats from REGISTRY, and a format's package is
imported only when it is asked something (`ckpt inspect` on a DCP checkpoint
never loads the Orbax reader).
"""
from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from ..base.errors import CkptError, NoSpaceError, StorageUnavailableError, UnknownFormatError, UsageError
from ..base.names import OWNER_FILE, TMP_MARKER  # noqa: F401 - (formats.TMP_MARKER: output and validate ask the registry)
# (formats.read_options: the CLI sets the reader options around its call into the core)
from ..base.read_options import given_read_options, read_options  # noqa: F401
from ..base.text import joined

if TYPE_CHECKING:
    # (at run time the contract is imported when a package is asked something: `ckpt --help` never is)
    from ..core.contract import ChecksModule, FormatModule, ReaderModule, RunRules, WriterModule
    from ..core.model import Checkpoint
    from ..storage import ReadLog, Storage


# sub-directories looked into when a directory's contents are judged (as unknown.describe does)
_MAX_SUBDIRS = 64

# leaf kinds a format may hold (FormatInfo.value_kinds)
VALUE_KINDS = frozenset({"array", "scalar", "string", "object"})


@dataclass(frozen=True)
class FormatInfo:
    """One registered format: what it can do and where its package is."""

    name: str  # the registry's name: `convert --to NAME`, Checkpoint.format (but see families)
    title: str  # in help texts and messages: "torch.distributed.checkpoint (DCP)"
    package: str  # imported lazily by module()
    can_write: bool  # its package has write.py: `convert --to NAME`
    value_kinds: frozenset[str]  # leaf kinds it can hold: a subset of VALUE_KINDS
    claims: tuple[str, ...]  # top-level file / directory name globs that belong to it
    short: str = ""  # in short lists ("Convert to Orbax, DCP or safetensors"); default: title
    reads: str = ""  # `ckpt --help`'s line for it; default: title
    # a file named by `claims` marks its directory as a checkpoint of this format (a file
    # given on the command line beside one names that directory; unknown.refuse_file)
    claims_mark_checkpoint: bool = True
    # its detect() claims a directory without sub-directories only when a file there matches
    # `claims`: detection passes over such a directory where none does without importing the
    # package (a flat DCP directory never loads the Orbax reader to hear "no")
    claims_flat: bool = False
    # one file given by its path may be a checkpoint (split_file / read_file): "claimed" when
    # `claims` match its name, "any" for any local file (its reader looks at the first bytes),
    # "unclaimed" for any file no other format claims by name (a DCP `.distcp` starts with a
    # torch.save archive too, and is DCP's)
    single_file: str = ""
    file_suffixes: tuple[str, ...] = ()  # name endings of its one-file checkpoints (".safetensors")
    can_reshard: bool = False  # `ckpt reshard` writes it (laid out for a device mesh)
    families: tuple[str, ...] = ()  # other names its reader gives Checkpoint.format ("flax", "t5x")
    listed: int = 0  # its place in lists shown to people (help, messages)
    # its place in detection order (REGISTRY's): the first format, lowest here, whose detect() claims a
    # directory reads it; a format whose checkpoints hold another's files is asked before that one
    detection: int = 0
    install: str = ""  # extra package(s) its reader or writer needs, for a message when missing
    options: tuple[str, ...] = ()  # convert's writer options that apply to it ("zarr3", "max_shard_size")
    # the formats whose checkpoints its writer takes (empty: any); convert refuses any other source
    writes_from: tuple[str, ...] = ()
    # reader options it takes ("weights": which copy of the weights to give), passed to its read();
    # any other format refuses them by name (read_options below)
    read_options: tuple[str, ...] = ()
    # top-level names its checkpoints hold beside `claims` (data directories, pointers, what its
    # writer leaves): with `claims`, what `--overwrite` may replace (contents below); anything
    # else in the directory is someone else's and is never deleted
    parts: tuple[str, ...] = ()
    # a sub-directory holding a file of one of these names is part of its checkpoint (a
    # per-array zarr directory named after its parameter: no name glob can say that)
    part_dirs: tuple[str, ...] = ()
    # name globs of the sub-directories its checkpoints hold that are checkpoints of this format
    # themselves (Orbax's items and a CheckpointManager's steps, any name; DeepSpeed's tag
    # directories; torch's HF writer's `sharded/`): such a sub-directory is part of the checkpoint.
    # Nothing else is: a step or pointer that another framework names so (`step-1/`, `latest`,
    # `global_step_3/`) is not this format's to replace (contents below)
    part_checkpoints: tuple[str, ...] = ()
    # a single-file format: names that make its top-level files one model directory even beside
    # sub-directory checkpoints (a Hugging Face config.json, a shard index naming the files); without
    # one, loose files beside checkpoints are one more checkpoint among several (detect refuses)
    model_marks: tuple[str, ...] = ()
    # its writer compresses what it writes (Orbax: zstd): the output's size is not known before
    # writing, so convert's free-space check before writing leaves it to the write itself
    compresses: bool = False
    # its writer takes a block of whole chunks of a regular output grid as one region and cuts it
    # into its chunks itself, each stored as if written alone (Orbax: tensorstore): the engine
    # then hands it blocks, not chunk after chunk (ckpt_tool/core/blocks.py)
    writes_chunk_blocks: bool = False
    # the training frameworks (formats/roots.py's RunLayout names) whose run-root rules its package's
    # run_roots.py holds (RULES: a contract.RunRules each): roots.py asks them through rules_for
    run_roots: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return self.short or self.title

    def module(self) -> FormatModule:
        """The format's package (imported on first use)."""
        return cast("FormatModule", importlib.import_module(self.package))

    def reader_module(self) -> ReaderModule:
        """The format's package through the contract: its optional hooks defaulted."""
        from ..core.contract import ReaderModule

        return ReaderModule(importlib.import_module(self.package))

    def submodule(self, name: str) -> ModuleType:
        """One module of the package: "write", "checks", ..."""
        return importlib.import_module(f"{self.package}.{name}")

    def checks(self) -> ChecksModule:
        """validate's checks (checks.py): check_path(storage, findings, step=..., only=...), ..."""
        from ..core.contract import ChecksModule

        return ChecksModule(self.submodule("checks"))

    def writer_module(self) -> WriterModule:
        """The writer's module (write.py): make_writer, target_layout, plan_value, ..."""
        if not self.can_write:
            raise UsageError(f"ckpt does not write {self.title} checkpoints (it writes {joined(writable_labels())})")
        from ..core.contract import WriterModule

        return WriterModule(self.submodule("write"))

    def rules_for(self, framework: str) -> RunRules:
        """A framework's run-root rules that this package holds (run_roots.py; `framework` in run_roots)."""
        from ..core.contract import run_rules

        return run_rules(self.submodule("run_roots"), framework)

    def claimed(self, name: str) -> bool:
        """Whether a top-level file or directory `name` is one this format's checkpoints hold."""
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.claims)

    def part(self, name: str) -> bool:
        """Whether a top-level entry `name` belongs to this format's checkpoints by its name alone."""
        return self.claimed(name) or any(fnmatch.fnmatchcase(name, pattern) for pattern in self.parts)


# the files of a Hugging Face model directory beside its weights (transformers' and tokenizers'
# names, the model card): part of a safetensors / pytorch_model.bin checkpoint directory, and copied
# with it by convert (hf_export.COMPANIONS is this list)
HF_MODEL_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
    "tokenizer.model", "*.tiktoken", "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
    "processor_config.json", "video_preprocessor_config.json", "README.md", "LICENSE*", "NOTICE*",
)
# what the Hugging Face Trainer saves beside the model in a checkpoint-N/ directory
HF_TRAINER_FILES = ("optimizer.pt", "scheduler.pt", "rng_state*.pth", "trainer_state.json", "training_args.bin")
# per-array zarr directories (v2 and v3): an Orbax array, a T5X array, a Megatron zarr-backend key
ZARR_ARRAY_FILES = (".zarray", "zarr.json")

# the module a format package declares itself in (FORMATS: a list of FormatInfo)
REGISTRATION = "registration.py"


def _registration(directory: str, package: str) -> list[FormatInfo]:
    """The FORMATS a package's registration.py declares, read without importing the package: it is
    executed as a module of its own (relative imports reach this module), kept in no sys.modules."""
    spec = importlib.util.spec_from_file_location(f"{package}.registration", os.path.join(directory, REGISTRATION))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.FORMATS)


def discover(paths: list[str], prefix: str = __name__) -> dict[str, FormatInfo]:
    """Every format the packages under `paths` declare (each sub-directory with a registration.py,
    as package `prefix.<directory>`), in detection order."""
    found: list[FormatInfo] = []
    for path in paths:
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            if entry.is_dir() and os.path.isfile(os.path.join(entry.path, REGISTRATION)):
                found.extend(_registration(entry.path, f"{prefix}.{entry.name}"))
    names = [f.name for f in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RuntimeError(f"formats registered twice: {', '.join(twice)}")
    return {f.name: f for f in sorted(found, key=lambda f: (f.detection, f.name))}


# In detection order: the first format whose detect() claims a directory reads it.
REGISTRY: dict[str, FormatInfo] = discover(list(__path__))


def registered() -> list[FormatInfo]:
    """Every format, in detection order."""
    return list(REGISTRY.values())


def shown() -> list[FormatInfo]:
    """Every format, in the order lists shown to people name them."""
    return sorted(REGISTRY.values(), key=lambda f: f.listed)


def get(name: str) -> FormatInfo:
    """The format registered as `name` (a UsageError for any other name)."""
    info = REGISTRY.get(name)
    if info is None:
        raise UsageError(f"unknown format {name!r} (ckpt knows {joined([f.name for f in shown()])})")
    return info


def for_checkpoint(fmt: str) -> FormatInfo | None:
    """The format whose reader gives Checkpoint.format `fmt` (its name, or one of its families)."""
    info = REGISTRY.get(fmt)
    if info is not None:
        return info
    return next((f for f in REGISTRY.values() if fmt in f.families), None)


def writable() -> list[str]:
    """Names of the formats `convert --to` writes, in the order lists show them."""
    return [f.name for f in shown() if f.can_write]


def writable_labels() -> list[str]:
    return [f.label for f in shown() if f.can_write]


def names_single_file(name: str) -> bool:
    """Whether a file name is one a format's one-file checkpoints have (model.safetensors, state.msgpack)."""
    return any(name.endswith(f.file_suffixes) for f in REGISTRY.values() if f.file_suffixes)


def taking(option: str) -> list[str]:
    """Names of the writable formats a writer option applies to ("max_shard_size": safetensors)."""
    return [f.name for f in shown() if f.can_write and option in f.options]


def reading(option: str) -> list[str]:
    """Labels of the formats whose reader takes an option ("weights": DeepSpeed)."""
    return [f.label for f in shown() if option in f.read_options]


def _check_options(info: FormatInfo) -> dict[str, str]:
    """The reader options given, refused by name when the format does not take them."""
    given = given_read_options()
    for option in given:
        if option not in info.read_options:
            raise UsageError(f"--{option} applies to {joined(reading(option))} checkpoints; this is a {info.title} one")
    return given


def reshard_format() -> FormatInfo:
    """The format `ckpt reshard` writes."""
    return next(f for f in shown() if f.can_reshard)


def titles_joined(conjunction: str = "or") -> str:
    """"Orbax, torch.distributed.checkpoint (DCP), safetensors or Flax / T5X msgpack"."""
    return joined([f.title for f in shown()], conjunction)


# kept for callers of the flat-module days: format names in detection order
def _formats() -> tuple[str, ...]:
    return tuple(REGISTRY)


def format_module(name: str) -> FormatModule:
    return get(name).module()


def _claiming(storage: Storage) -> FormatInfo | None:
    """The first format (in detection order) whose detect() claims `storage`, or None."""
    flat_files: list[str] | None = None  # the files of a directory without sub-directories
    listed = False
    for info in registered():
        if info.claims_flat:
            if not listed:
                dirs, files = storage.listdir()  # (the listing is the Storage's, read once)
                flat_files, listed = (None if dirs else files), True
            if flat_files is not None and not any(info.claimed(f) for f in flat_files):
                continue  # its detect() would say no: its package stays unimported
        if info.module().detect(storage):
            return info
    return None


def _sub_checkpoints(storage: Storage, dirs: list[str]) -> list[tuple[str, FormatInfo]]:
    """The sub-directories (the first _MAX_SUBDIRS) that are checkpoints themselves, with their format."""
    found = []
    for d in dirs[:_MAX_SUBDIRS]:
        try:
            info = _claiming(storage.child(d))
        except CkptError:  # a sub-directory ckpt cannot look into is not a checkpoint it reads
            continue
        if info is not None:
            found.append((d, info))
    return found


def _loose_beside_checkpoints(info: FormatInfo, storage: Storage) -> str | None:
    """Why a directory a single-file format claims holds several checkpoints, not one; None if it does not.

    A single-file format claims a directory by its loose top-level files (a `state.pt`, a
    `.safetensors`). Beside sub-directories that are checkpoints themselves, those files are one
    checkpoint among several, not the directory's checkpoint: reading them alone would ignore the
    others in silence. A model directory (a Hugging Face config.json, a shard index: its format's
    model_marks) is one checkpoint whatever sub-directories it has (transformers loads its top files);
    sub-directories that are not checkpoints (logs/) change nothing.
    """
    if not info.single_file:
        return None
    dirs, files = storage.listdir()
    loose = sorted(f for f in files if info.claimed(f))
    if not dirs or not loose or any(fnmatch.fnmatchcase(f, m) for f in files for m in info.model_marks):
        return None
    subs = _sub_checkpoints(storage, dirs)
    if not subs:
        return None
    entries = [f"{f} ({info.name})" for f in loose] + [f"{d}/ ({sub.name})" for d, sub in subs]
    shown = ", ".join(entries[:6]) + (", ..." if len(entries) > 6 else "")
    example = f"{storage.url.rstrip('/')}/{subs[0][0]}"
    return f"a directory of {len(entries)} checkpoints, not one: {shown}; open one, e.g. ckpt inspect {example}"


def detect(storage: Storage) -> FormatModule:
    """The package of the first format (in detection order) whose detect() claims `storage`: the
    readers' own answer. Commands open a directory through detect_one, which also refuses loose
    files beside checkpoints."""
    info = _claiming(storage)
    if info is not None:
        _check_options(info)
        return info.module()
    from . import unknown  # (lazily, as below: roots, steps and unknown import the storage layer)

    # say what is there: checkpoints one level down (and how to pick one), or the files found
    raise UnknownFormatError(unknown.describe(storage, registered()), storage.url)


def detect_one(storage: Storage) -> FormatModule:
    """detect, for a directory a command reads as one checkpoint: loose files a single-file format
    claims beside sub-directories that are checkpoints are several checkpoints (UnknownFormatError
    naming them), not the loose file's alone."""
    module = detect(storage)
    several = _loose_beside_checkpoints(get(module.NAME), storage)
    if several is not None:
        raise UnknownFormatError(several, storage.url)
    return module


@dataclass(frozen=True)
class Contents:
    """What a directory that a format recognises holds, entry by entry (its top level): what
    belongs to the checkpoint (what `--overwrite` may replace) and what does not."""

    format: FormatInfo
    parts: tuple[str, ...]  # top-level entries of the checkpoint
    others: tuple[str, ...]  # top-level entries that are not (a user's notes.txt, logs/)
    steps: tuple[str, ...] = ()  # a run root holding several steps: their entries
    run: str = ""  # that run root's framework ("Orbax CheckpointManager")


def contents(storage: Storage, names: list[str] | None = None) -> Contents:
    """Which of a checkpoint directory's top-level entries belong to it, by the format that
    recognises it (UnknownFormatError where none does, as detect).

    An entry belongs to the checkpoint only when the format that recognised the directory says
    so: a name its checkpoints hold (the registry's `claims` and `parts`), a sub-directory holding
    a file named in its `part_dirs` (a per-array zarr directory), or one its `part_checkpoints`
    name that is a checkpoint of the same format (an Orbax item or step, a DeepSpeed tag, torch's
    `sharded/`). A name that a training framework's run root gives its steps or its pointer file
    (`step-1/`, `global_step_3/`, `release/`, a `latest` or `checkpoint_5` file) is not enough:
    beside a DCP checkpoint such an entry is the user's, and is never deleted. A run root of
    several steps that belong to it is said as such (`steps`), to be refused whole.
    `names`: the entries to judge (a local directory's own listing, which shows empty directories
    and links that a listing of files never does); by default the storage's listing.
    """
    from . import roots

    info = get(detect_one(storage).NAME)
    dirs, files = storage.listdir()
    file_set, dir_set = set(files), set(dirs)

    def belongs(name: str) -> bool:
        if info.part(name):
            return name in file_set or name in dir_set
        if name not in dir_set:
            return False
        try:
            sub = storage.child(name)
            if info.part_dirs and any(fnmatch.fnmatchcase(f, p) for f in sub.listdir()[1] for p in info.part_dirs):
                return True
            if not any(fnmatch.fnmatchcase(name, p) for p in info.part_checkpoints):
                return False
            return _claiming(sub) is info
        except CkptError:  # a sub-directory ckpt cannot look into is not one it may delete
            return False

    judged = sorted(set(names) if names is not None else file_set | dir_set)
    parts = tuple(n for n in judged if belongs(n))
    steps: tuple[str, ...] = ()
    run = ""
    found = roots.identify(roots.RootListing.of(storage, registered()))
    if found is not None:
        layout, entries = found
        # (an entry named like a step that is not the checkpoint's is one of `others`: said as such)
        ours = tuple(sorted(entry.name for entry, _ in entries if entry.name in parts))
        if len(ours) > 1:
            steps, run = ours, layout.title
    return Contents(info, parts, tuple(n for n in judged if n not in parts), steps, run)


def split_file(url: str) -> tuple[FormatInfo, tuple[str, str]] | None:
    """(format, (directory, file name)) when `url` names one file that a format reads as a checkpoint."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    for info in shown():
        if info.single_file == "unclaimed" and any(o is not info and o.claimed(name) for o in REGISTRY.values()):
            continue
        if info.single_file in ("any", "unclaimed") or (info.single_file == "claimed" and info.claimed(name)):
            parts = info.reader_module().split_file(url)
            if parts is not None:
                _check_options(info)
                return info, parts
    return None


def open_checkpoint(url: str, *, step: str | int | None = None, log: ReadLog | None = None,
                    keep_parsed: bool = False) -> Checkpoint:
    """Open the checkpoint at `url`, detecting its format; reads metadata only.

    On a run root of any framework `ckpt ls` lists, the run layouts' table picks the step
    (steps.resolve_step): `step` when given, else the step the framework resumes from (its pointer
    file's, or the newest complete one); the step opened is recorded for the CLI to say.
    `keep_parsed`: the caller validates it next (convert's, reshard's and diff's preflight): what
    the reader parsed of its metadata stays on it (Checkpoint.parsed) for validate_opened, which
    then reads none of it again; otherwise it is dropped (its Checkpoint.storage is kept)."""
    from ..storage import Storage, check_url
    from . import steps

    try:
        check_url(url)
        # one Storage (and so one LIST of the root) for the run-root look and the reader
        storage: Storage | None = Storage.open(url, log=log)
    except CkptError:
        storage = None  # _open_resolved says what is wrong with the URL
    resolved, step, opened = steps.resolve_step(url, step, registered(), storage)
    try:
        ckpt = _open_resolved(resolved, step=step, log=log, storage=storage if resolved == url else None)
    except (UsageError, StorageUnavailableError, NoSpaceError):
        raise
    except CkptError as exc:
        # the step a run root opens by default does not open: the error says which step that was
        # and the one before that does (the framework would fail there too; --step picks another)
        hint = opened.fallback() if opened is not None else None
        if hint is not None and "--step" not in exc.message:
            exc.message = f"{exc.message} ({hint})"
            exc.args = (f"{exc.where}: {exc.message}" if exc.where else exc.message,)
        raise
    if not keep_parsed:
        ckpt.parsed = {}
    return ckpt


def _open_resolved(url: str, *, step: str | int | None, log: ReadLog | None,
                   storage: Storage | None = None) -> Checkpoint:
    """open_checkpoint's reading, once a run root's step is chosen."""
    from ..storage import Storage, check_url

    check_url(url)  # before a file's URL is cut to its directory: the error names the URL whole
    single = split_file(url)  # one file (a .safetensors file, a Flax msgpack file), not a directory
    if single is not None:
        info, (directory, name) = single
        storage = Storage.open(directory, log=log)
        ckpt = info.reader_module().read_file(storage, name)
        # the path as the user typed it (a reader names the file by the directory it opened,
        # which may be absolute, or `./x` for a bare name), as a directory's is
        ckpt.path = url
        ckpt.storage = storage  # (its directory's: validate_opened checks the file through it)
        return ckpt
    from . import unknown

    unknown.refuse_file(url, registered())  # any other file: the checkpoint it sits in, or what it is
    storage = storage or Storage.open(url, log=log)
    ckpt = detect_one(storage).read(storage, step=step, **given_read_options())
    ckpt.storage = storage  # what validate's checks of it start from (validate_opened)
    if TMP_MARKER in storage.url.rstrip("/").rsplit("/", 1)[-1]:
        # the temporary directory of an interrupted `ckpt convert` / `reshard`
        ckpt.committed = False
        ckpt.notes.insert(0, "unfinished ckpt output (temporary directory of an interrupted convert or reshard)")
    elif storage.local_root is None and OWNER_FILE in storage.listdir()[1]:
        # an object store's output being written in place (ops/destination_remote.py): its owner record
        # is there until the commit markers are
        ckpt.committed = False
        ckpt.notes.insert(0, f"unfinished ckpt output (a convert or reshard to this object store that has not "
                             f"committed: its owner record {OWNER_FILE} is there)")
    from ..storage.hf_downloads import unfinished_downloads

    # a huggingface_hub download here that stopped: why shards are missing (from the listing made already)
    ckpt.notes.extend(f"{d.describe()} ({d.partial})" for d in unfinished_downloads(storage))
    return ckpt


def layout_text(ckpt: Checkpoint) -> str:
    """One line saying what the checkpoint's format and layout are (inspect's "format" row)."""
    info = for_checkpoint(ckpt.format)
    return info.reader_module().layout_text(ckpt) if info is not None else ckpt.format




def __getattr__(name: str) -> Any:
    if name == "FORMATS":  # the detection order, from REGISTRY (tests may replace REGISTRY)
        return _formats()
    raise AttributeError(name)

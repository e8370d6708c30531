"""The conformance suite's catalogue: every committed real-writer fixture, its format, and how to
ask the writing library what it holds; per format, how each damage class is made. It is the one
list of fixtures: the tests that run over a sample of them (conftest's SAMPLE_FIXTURES) take the
entries that carry facts (`sample()`).

Each format's rows live in its own file, tests/conformance/formats/<package>.py (rows.py says
what one holds), found by `load()`: this module names no format. The suite
(tests/conformance/test_conformance_*.py) is parameterised over `cases()`: every format the
registry (`ckpt_tool.formats.registered()`) lists, times every ENTRY of that format.
`test_conformance_catalogue.py` fails when a registered format has no entry, or when a directory
under fixtures/ is in no entry (nor in NOT_CHECKPOINTS): a format or fixture dropped in is picked
up, or flagged. Adding a format = its package (ckpt_tool/formats), its fixtures generator
(fixtures/gen_*.py) and its catalogue file here: its ENTRIES, its DAMAGE rows, and (if it writes)
its LIBRARY loader.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib.util
import os
import shutil
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterable

from conftest import FIXTURES
from rows import DAMAGE_CLASSES, Damage, Entry, FixtureSpec, Inside, Library

__all__ = ["DAMAGE_CLASSES", "Damage", "Entry", "FixtureSpec", "Inside", "Library"]

# --------------------------------------------------------------------------
# the registry (ckpt_tool.formats): the suite asks it which formats there are
# --------------------------------------------------------------------------


def registered() -> list:
    """The registry's FormatInfo list, in detection order."""
    from ckpt_tool import formats

    return list(formats.registered())


def writable() -> list[str]:
    """Names of the formats with a writer (`convert --to`)."""
    from ckpt_tool import formats

    return list(formats.writable())


def detected(path: Path) -> str:
    """The registered format whose package reads `path` (as ckpt_tool.open picks it)."""
    from ckpt_tool import formats
    from ckpt_tool.storage import Storage

    single = formats.split_file(str(path))
    if single is not None:
        return single[0].name
    module = formats.detect(Storage.open(str(path)))
    return next(f.name for f in registered() if module.__name__ == f.package or module.__name__.startswith(f.package + "."))


# --------------------------------------------------------------------------
# the formats' catalogue files: discovered, never listed
# --------------------------------------------------------------------------

FORMATS_DIR = Path(__file__).resolve().parent / "formats"


@dataclass(frozen=True)
class Catalogue:
    """The rows of every catalogue file found (rows.py: what each name holds)."""

    files: dict[str, Path]  # catalogue file's name (its format package's) -> path
    entries: list[Entry] = field(default_factory=list)
    damage: list[Damage] = field(default_factory=list)
    not_applicable: dict[str, dict[str, str]] = field(default_factory=dict)
    how: dict[str, Callable[[Path, Path], None]] = field(default_factory=dict)
    libraries: dict[str, Library] = field(default_factory=dict)
    inside: list[Inside] = field(default_factory=list)
    not_checkpoints: set[str] = field(default_factory=set)
    fuzz: list[FixtureSpec] = field(default_factory=list)
    fuzz_weights: dict[str, float] = field(default_factory=dict)


def format_files(dirs: Iterable[Path] = (FORMATS_DIR,)) -> list[Path]:
    """Every catalogue file under `dirs` (a name starting with _ is a helper, not a format's)."""
    return [p for d in dirs for p in sorted(Path(d).glob("*.py")) if not p.name.startswith("_")]


def _module(path: Path) -> ModuleType:
    """A catalogue file as a module (once per path: its loaders are compared by identity)."""
    digest = hashlib.sha1(str(path.resolve().parent).encode()).hexdigest()[:8]
    name = f"conformance_formats_{digest}.{path.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def load(dirs: Iterable[Path] = (FORMATS_DIR,)) -> Catalogue:
    """The catalogue made of every format's file under `dirs` (the suite's: formats/)."""
    files = format_files(dirs)
    cat = Catalogue({p.stem: p for p in files})
    for path in files:
        m = _module(path)
        cat.entries.extend(m.ENTRIES)
        cat.damage.extend(m.DAMAGE)
        cat.not_applicable.update(getattr(m, "NOT_APPLICABLE", {}))
        cat.how.update(getattr(m, "HOW", {}))
        cat.libraries.update(getattr(m, "LIBRARY", {}))
        cat.inside.extend(getattr(m, "INSIDE", []))
        cat.not_checkpoints.update(getattr(m, "NOT_CHECKPOINTS", set()))
        cat.fuzz.extend(getattr(m, "FUZZ", []))
        cat.fuzz_weights.update(getattr(m, "FUZZ_WEIGHT", {}))
    return cat


CATALOGUE = load()

# --------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------

ENTRIES: list[Entry] = CATALOGUE.entries

# run roots of several steps (fixtures/gen_runs.py), torn newest steps included: tests/ops/runs/test_runs.py checks
# ls / latest / diff --step-a on each against the writing framework's own step rules; their steps are
# checkpoints of formats the entries cover
RUN_ROOTS = {"runs_hf_trainer", "runs_nemo2", "runs_orbax", "runs_torchtitan", "runs_verl"}
# directories under fixtures/ that are not checkpoints (a format's references, files it refuses; run roots)
NOT_CHECKPOINTS = CATALOGUE.not_checkpoints | RUN_ROOTS


def sample(entries: Iterable[Entry] = ()) -> dict[str, dict]:
    """{fixture: its facts, with its name and format}: the fixtures whose entry has facts (Entry.facts),
    each once (a manager's steps share its facts), in catalogue order. The tests that run over a sample
    of the fixtures (conftest's SAMPLE_FIXTURES, ORBAX_FIXTURES, DCP_FIXTURES, fixture_info) read this."""
    out: dict[str, dict] = {}
    for e in entries or ENTRIES:
        if e.facts and e.top not in out:
            out[e.top] = {"name": e.top, "format": e.format, **e.facts}
    return out


def fixture_dirs(root: Path = FIXTURES) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def uncatalogued(entries: Iterable[Entry] = (), root: Path = FIXTURES,
                 not_checkpoints: Iterable[str] = NOT_CHECKPOINTS) -> list[str]:
    """Fixture directories no entry covers (a new fixture nobody wired in); in a family directory
    that is no checkpoint itself (orbax_v0_5/: one save per sub-directory), each member too."""
    entries = list(entries or ENTRIES)
    out = []
    for d in fixture_dirs(root):
        if d in set(not_checkpoints):
            continue
        paths = [e.path for e in entries if e.top == d]
        if not paths:
            out.append(d)
        elif d not in paths:  # a family: every member (not _reference.json and the like) is an entry
            for child in sorted((root / d).iterdir()):
                rel = f"{d}/{child.name}"
                if not child.name.startswith(("_", ".")) and not any(p == rel or p.startswith(rel + "/")
                                                                      for p in paths):
                    out.append(rel)
    return out


def formats_without_fixtures(infos: Iterable = (), entries: Iterable[Entry] = ()) -> list[str]:
    """Registered formats no entry exercises (a new format without fixtures)."""
    have = {e.format for e in (entries or ENTRIES)}
    return [f.name for f in (infos or registered()) if f.name not in have]


def unregistered_entries(infos: Iterable = (), entries: Iterable[Entry] = ()) -> list[str]:
    """Entries whose format the registry does not know (a format renamed or dropped)."""
    names = {f.name for f in (infos or registered())}
    return [e.id for e in (entries or ENTRIES) if e.format not in names]


def cases(infos: Iterable = (), entries: Iterable[Entry] = ()) -> list[Entry]:
    """Every (registered format x its entries): what the properties are parameterised over."""
    names = [f.name for f in (infos or registered())]
    return [e for n in names for e in (entries or ENTRIES) if e.format == n]


def takes(target: str, source_format: str) -> bool:
    """Whether `target`'s writer takes a checkpoint of `source_format` (the registry's writes_from)."""
    from ckpt_tool import formats

    allowed = formats.get(target).writes_from
    return not allowed or source_format in allowed


def refusals(e: Entry) -> dict[str, str]:
    """{target: a part of its one-line refusal} for the targets that must refuse entry e: its own
    refused_by, and the writers that take checkpoints of other formats only."""
    out = dict(e.refused_by)
    for to in writable():
        if not takes(to, e.format):
            out.setdefault(to, "checkpoints only")
    return out


def converts_exactly(e: Entry, to: str) -> bool:
    """Whether converting e to `to` keeps its tree and values (so `diff` says same). A writer that
    takes certain formats only writes their checkpoints as that format's own tool does:
    DeepSpeed's ds_to_universal changes what it writes (a tied name's 16-bit module weights,
    buffers cast to float32), which its own tests check file for file (tests/formats/deepspeed/test_deepspeed_universal.py)."""
    from ckpt_tool import formats

    return not formats.get(to).writes_from


# --------------------------------------------------------------------------
# a checkpoint ckpt wrote, through the target format's own library
# --------------------------------------------------------------------------

# a writable format -> its library's loader (the format's catalogue file's LIBRARY)
LIBRARIES: dict[str, Library] = CATALOGUE.libraries


def library(fmt: str) -> Library:
    """The library loader of the writable format `fmt` (KeyError naming it when it has none)."""
    if fmt not in LIBRARIES:
        raise KeyError(f"no library loader for {fmt!r}")
    return LIBRARIES[fmt]


# --------------------------------------------------------------------------
# damage: per format, the file each damage class hits, and the finding code it must give
# --------------------------------------------------------------------------


def _truncate(p: Path, work: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _empty(p: Path, work: Path) -> None:
    p.write_bytes(b"")


def _grow(p: Path, work: Path) -> None:
    with open(p, "ab") as f:
        f.write(b"\0" * 64)


def _garbage(p: Path, work: Path) -> None:
    p.write_bytes(b"\x00garbage{not metadata")


def _symlink_out(p: Path, work: Path) -> None:
    """The file becomes a link to a same-content copy OUTSIDE the checkpoint."""
    outside = work / f"outside-{p.name}"
    shutil.copyfile(p, outside)
    p.unlink()
    p.symlink_to(outside)


def _flip_storage(p: Path, work: Path) -> None:
    """torch.save: one bit flipped inside the last storage member's data (its CRC-32 no longer matches)."""
    import zipfile

    with zipfile.ZipFile(p) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename and i.file_size), key=lambda i: i.header_offset)
    data = bytearray(p.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    data[info.header_offset + 30 + name_len + extra_len] ^= 0x01
    p.write_bytes(bytes(data))


# the damage operators every format's rows may name; a format's own (a safetensors header's
# length, a DCP storage entry's path) come from its catalogue file's HOW
HOW: dict[str, Callable[[Path, Path], None]] = {
    "flip-storage": _flip_storage,
    "remove": lambda p, work: p.unlink(),
    "truncate": _truncate,
    "empty": _empty,
    "grow": _grow,
    "garbage": _garbage,
    "symlink-out": _symlink_out,
    **CATALOGUE.how,
}

DAMAGE: list[Damage] = CATALOGUE.damage

# {format: {damage class: why it cannot happen}} for classes a format cannot suffer
NOT_APPLICABLE: dict[str, dict[str, str]] = CATALOGUE.not_applicable


def damage_cases(infos: Iterable = (), damage: Iterable[Damage] = ()) -> list[Damage]:
    names = [f.name for f in (infos or registered())]
    return [d for n in names for d in (damage or DAMAGE) if d.format == n]


def damaged_copy(d: Damage, work: Path, root: Path = FIXTURES, how: dict[str, Callable[[Path, Path], None]] | None = None
                 ) -> tuple[Path, str]:
    """A copy of d's fixture under work/ with d applied; (checkpoint path, damaged file's relative path)."""
    src = root / d.fixture
    dst = work / "ckpt" / Path(d.fixture).name
    shutil.copytree(src, dst, symlinks=True)
    [target] = sorted(glob.glob(os.path.join(dst, d.target)))[:1]
    (how or HOW)[d.how](Path(target), work)
    return dst, os.path.relpath(target, dst)


def with_entries(entries: list[Entry], **changes) -> list[Entry]:  # noqa: ANN003
    return [dataclasses.replace(e, **changes) for e in entries]


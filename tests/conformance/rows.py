"""The kinds of row a format's catalogue file (tests/conformance/formats/<package>.py) holds.

A format's file is discovered by catalogue.py (every `*.py` under formats/): the suite, the error
message tests and the fuzzing suite read its rows from there, and nothing else in tests/ lists them.
Its module-level names, all optional but ENTRIES and DAMAGE:

  ENTRIES: list[Entry]           its committed fixtures and the writing library's view of each (the
                                 one list of fixtures: conftest's SAMPLE_FIXTURES are read from it)
  DAMAGE: list[Damage]           per damage class, the file it hits and the finding it must give
  NOT_APPLICABLE: {format: {damage class: why}}   classes its checkpoints cannot suffer
  HOW: {name: damage function}   damage operators its rows name that only its files take
  LIBRARY: {format: Library}     a format with a writer: its library's loader (the oracle of convert)
  INSIDE: list[Inside]           files inside its fixtures: opening one names the directory to open
  NOT_CHECKPOINTS: set[str]      its directories under fixtures/ that are no checkpoint
  FUZZ: list[FixtureSpec]        the fixtures the fuzzing suite mutates, with their oracle
  FUZZ_WEIGHT: {format: share}   share of a long fuzzing run's mutants (fuzz/run_fuzz.py)

This module imports nothing of the suite, so that a format's file may import it and references.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from conftest import FIXTURES


@dataclass(frozen=True)
class Entry:
    path: str  # under fixtures/ (a directory, a step of a root, or one file)
    format: str  # the registry name of the format that reads it
    reference: Callable[[Path, str | None], dict]  # the writing library's view (references.py)
    values: Callable[[Path, str | None], dict] | None = None  # ... and its values
    step: str | None = None  # --step, for a root with several steps
    str_keys: bool = False  # compare key paths as strings (flax's restore of an orbax save)
    # targets that must refuse it (an array dtype the target has no equivalent for): {target: message part}
    refused_by: tuple[tuple[str, str], ...] = ()
    # the library restores no leaf for None and empty containers (jax's tree flattening): ckpt's
    # leaves holding one are not compared
    drops_empty: bool = False
    # what its writer made, for the tests that run over a sample of the catalogue (conftest's
    # SAMPLE_FIXTURES: the fixtures whose entry has facts): the writing call, the layout, the
    # process count, a manager's steps and item directories, a DCP save's data files
    facts: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @property
    def id(self) -> str:
        return f"{self.path}@{self.step}" if self.step else self.path

    @property
    def top(self) -> str:
        """The directory directly under fixtures/ it belongs to."""
        return self.path.split("/")[0]

    def library_values(self) -> Callable[[Path, str | None], dict] | None:
        return self.values

    def full(self, root: Path = FIXTURES) -> Path:
        return root / self.path


DAMAGE_CLASSES = ("missing-file", "truncated-file", "wrong-size", "garbage-metadata", "path-escape")


@dataclass(frozen=True)
class Damage:
    format: str
    cls: str  # one of DAMAGE_CLASSES
    fixture: str  # an entry path
    target: str  # glob (under the fixture) of the file damaged
    how: str  # a key of catalogue.HOW (or of the format file's HOW)
    code: str  # the finding code validate must report
    deep: bool = False  # only --deep reads the damaged bytes
    step: str | None = None

    @property
    def id(self) -> str:
        return f"{self.format}-{self.cls}-{self.fixture}:{self.how}"


@dataclass(frozen=True)
class Library:
    """A writable format's own library, reading a checkpoint ckpt wrote: {key: value}."""

    load: Callable[[Path], dict]
    named: bool = False  # keys are by_name(leaf name), not key paths
    drops_empty: bool = False  # it restores no leaf for None / empty containers (see Entry)


@dataclass(frozen=True)
class Inside:
    """A file inside a fixture (`path`): inspect / validate of it name `directory` to open instead."""

    path: str
    directory: str
    format: str  # the registry name of the format whose checkpoint `directory` is


@dataclass(frozen=True)
class FixtureSpec:
    """A fixture the fuzzing suite (tests/fuzz_lib.py) makes mutants of."""

    name: str
    format: str  # the registry's name
    oracle: str | None  # the oracle worker's format (tests/fuzz_oracle.py), None when no library reader is available
    mode: str = ""  # oracle mode ("numpy": orbax restore as host arrays)
    entry: str = ""  # the file inside the fixture given to ckpt (default: the fixture directory)



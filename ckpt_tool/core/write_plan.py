"""What a format writer receives: the plan of targets, and the engine's planning context.

The streaming engine (ops/engine.py) turns a source Checkpoint into a WritePlan:
target leaves with their final shape, dtype and chunk layout. A writer
creates the output from the plan, accepts regions in any order from several
threads, and finishes by writing the format's metadata and commit markers
last. Writers never print; they write through a Storage. The interface every
writer and write module implements is core/contract.py's (CheckpointWriter,
WriterModule).
"""
from __future__ import annotations

from dataclasses import dataclass, field
import math
from typing import Any, Iterator, Protocol, Union

import numpy as np

from .model import ChunkLayout, Key, Region, Sharding
from ..base.names import join_keys


@dataclass
class TargetArray:
    """One array of the output: its key path and name, shape, dtype, chunk layout and sharding."""

    keys: tuple[Key, ...]
    name: str  # the target format's flat name (Orbax param name / DCP fqn)
    shape: tuple[int, ...]
    dtype: str  # canonical dtype name
    layout: ChunkLayout  # RegularGrid or ChunkList of the output chunks
    sharding: Sharding | None = None  # recorded in the output when the format keeps it
    source_dtype: str | None = None  # set when --dtype casts this leaf

    kind = "array"

    @property
    def path(self) -> str:
        return join_keys(self.keys)


@dataclass
class TargetValue:
    """One non-array leaf of the output, written as it is."""

    keys: tuple[Key, ...]
    name: str
    # a simple Python value (int, float, str, bool, None, list, tuple, dict) or a
    # numpy scalar; for DCP ("object") it may hold numpy arrays: tensors inside
    # one bytes item, as torch saves a tuple of tensors
    value: Any
    value_type: str = "scalar"  # "scalar" | "string" | "object"

    kind = "value"

    @property
    def path(self) -> str:
        return join_keys(self.keys)


Target = Union[TargetArray, TargetValue]


@dataclass
class WritePlan:
    """Everything a writer is handed: the targets in order, and the facts it may record."""

    targets: list[Target]
    # facts the writer may record (source path and format, mesh for _sharding, ...)
    info: dict[str, Any] = field(default_factory=dict)
    process_index: int = 0  # this process's rank among the writing processes
    process_count: int = 1
    # key paths of the sequence nodes that are tuples, not lists (the targets
    # below them have int keys); Orbax records them, DCP's values hold them
    tuples: set[tuple[Key, ...]] = field(default_factory=set)

    def arrays(self) -> list[TargetArray]:
        return [t for t in self.targets if isinstance(t, TargetArray)]

    def values(self) -> list[TargetValue]:
        return [t for t in self.targets if isinstance(t, TargetValue)]


class PlanContext(Protocol):
    """What a format's `plan_value` gets from the engine while it plans a conversion.

    The engine loads each value leaf of the source and asks the target
    format's write module what it becomes there: one value, a subtree of
    values and arrays (Orbax flattens containers), or nothing (refused: an
    error, or skipped with --skip-unsupported).
    """

    # key paths of the sequence nodes that are tuples (WritePlan.tuples)
    tuples: set[tuple[Key, ...]]

    def claim(self, keys: tuple[Key, ...], source_path: str) -> str:
        """Reserve the target name of `keys` (two leaves mapping to one name are refused); the name."""
        ...

    def add_value(self, target: TargetValue) -> None: ...

    def add_array(self, keys: tuple[Key, ...], name: str, arr: np.ndarray) -> None:
        """An array held inside a value (a tensor of a tuple torch saved as one item): an array leaf."""
        ...

    def refuse(self, where: str, reason: str) -> None:
        """The format cannot hold this value: an error, or left out under --skip-unsupported."""
        ...


def byte_runs(shape: tuple[int, ...], region: Region, itemsize: int) -> Iterator[tuple[int, int]]:
    """(byte offset in the tensor, length) of the contiguous runs of `region`, in C order.

    A region of whole rows (what the engine plans for safetensors and DeepSpeed's universal files)
    is one run: writers that place a tensor's bytes at fixed offsets write a region with one
    write per run.
    """
    if not shape:
        yield 0, itemsize
        return
    sizes = tuple(r.stop - r.start for r in region)
    if not math.prod(sizes):
        return
    strides = [itemsize] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    k = len(shape) - 1  # dims after k are whole; dim k is a contiguous range
    while k > 0 and region[k].start == 0 and region[k].stop == shape[k]:
        k -= 1
    length = sizes[k] * strides[k]
    outer = [range(r.start, r.stop) for r in region[:k]]

    def walk(d: int, base: int) -> Iterator[tuple[int, int]]:
        if d == k:
            yield base + region[k].start * strides[k], length
            return
        for i in outer[d]:
            yield from walk(d + 1, base + i * strides[d])

    yield from walk(0, 0)

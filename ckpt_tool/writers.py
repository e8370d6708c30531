"""What a format writer receives, and the interface every writer implements.

The streaming engine (engine.py) turns a source Checkpoint into a WritePlan:
target leaves with their final shape, dtype and chunk layout. A writer
creates the output from the plan, accepts regions in any order from several
threads, and finishes by writing the format's metadata and commit markers
last. Writers never print; they write through a Storage.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import math
from typing import Any, Iterator, Protocol, Union

import numpy as np

from .model import ChunkLayout, Key, Region, Sharding


@dataclass
class TargetArray:
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
        return "/".join(str(k) for k in self.keys)


@dataclass
class TargetValue:
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
        return "/".join(str(k) for k in self.keys)


Target = Union[TargetArray, TargetValue]


@dataclass
class WritePlan:
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


class CheckpointWriter(Protocol):
    """Writes one checkpoint into a directory that does not exist yet (or is empty).

    Call order: begin(plan) once; write_array(target, chunk_index, region,
    data) for every chunk of every array this process owns, from any thread;
    write_value(target) for every value this process owns; then
    finish_process() on every process; and finally, on the primary only and
    after every process has finished (a barrier), commit(). abort() drops
    in-flight state after a failure (the caller removes the temporary
    directory).

    The region of write_array is one output chunk, or, for a format whose
    FormatInfo says writes_chunk_blocks, possibly a block of whole chunks of
    its RegularGrid (chunk_index: the block's first chunk; blocks.py).

    write_array takes the chunk's array over: the caller must not modify it
    afterwards, so that a writer may hold on to it until its write is
    committed instead of copying it (the Orbax writer does).
    """

    def begin(self, plan: WritePlan) -> None: ...

    def write_array(self, target: TargetArray, chunk_index: int, region: Region, data: np.ndarray) -> None: ...

    def write_value(self, target: TargetValue) -> None: ...

    def finish_process(self) -> None: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


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


# A format's write module (formats/<format>/write.py) provides, for the engine:
#   make_writer(storage, *, zarr3, max_shard_size, memory) -> CheckpointWriter
#   keeps_source_chunks(leaf) -> bool: whether it keeps a source's chunks as they are (so a
#       chunk too big for the memory budget is split to the budget, not to the default size)
#   target_layout(leaf, itemsize, cap, cap_bytes) -> ChunkLayout: the output chunks of an array
#       (cap: --chunk-mb or the memory budget's limit in bytes, None when neither applies;
#       cap_bytes: the cap, or the default chunk size)
#   plan_value(ctx: PlanContext, keys, name, value, source_path) -> None: a loaded value leaf
#   TUPLES_AS_VALUES: a tuple of the source is one value there (DCP's bytes item), gathered
#       from the source's element leaves by gathered_value(value, where) -> value
#   KEEPS_ANY_STR (optional, default False): it stores any str as a name or string value, lone
#       surrogates too (DCP's pickle); else one that is not Unicode text is refused (written as UTF-8)


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

    def walk(d: int, base: int):  # noqa: ANN202
        if d == k:
            yield base + region[k].start * strides[k], length
            return
        for i in outer[d]:
            yield from walk(d + 1, base + i * strides[d])

    yield from walk(0, 0)

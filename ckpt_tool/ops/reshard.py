"""`ckpt reshard`: lay a checkpoint out for a new device mesh, as storage work.

A reshard is "new layout, same format": every array gets a partition spec
on the new mesh (its recorded one where that still fits, else a rule, else
replicated), and the output's chunk grid is what orbax itself would write
for that layout, so a restore on the new mesh reads exactly one chunk per
device and `_sharding` names the new mesh. No array ever goes to a device:
the plan is arithmetic on shapes, and the bytes are streamed region by
region through convert's engine (engine.convert with a PlannedWrite), which
already gives bounded memory, parallel I/O, progress, multi-host barriers
and all-or-nothing output.

Chunk grid. orbax 0.12 (serialization/replica_slices.py) writes a shard
held by R > 1 devices "replica-parallel": the shard is split into R equal
slices along its FIRST dimension divisible by R and replica r writes slice
r; with no divisible dimension replica 0 writes the whole shard. The zarr
chunk is that write shape, cut further (subchunking.choose_chunk_shape)
only when one write exceeds the OCDBT target data file size (2 GiB; 400 MiB
on gs://). We compute the same shapes, and give each chunk to the process
that owns the device orbax would have had write it.

The devices laid out for: `--devices N` (ids 0..N-1, none need exist),
`--topology NAME` (a named TPU slice, in jax's mesh order), else this
host's accelerators as ops/topology.py learns them without opening them (a
held TPU stays untouched), else jax's own devices, which on a CPU-only
machine open in milliseconds. jax is otherwise imported only through
base/distributed.py, for multi-host barriers.
"""
from __future__ import annotations

import functools
import math
import re
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..base import dtypes, strict_json
from .. import formats
from ..base.parallel import copy_workers
from .engine import (
    Coordinator, ConvertOptions, PlannedWrite, check_source_complete, chunk_regions, convert, open_source, output_chunk_limit,
    plan_conversion, plans_stored_copy,
)
from ..base.errors import CkptError, UsageError
from ..base.findings import Progress, no_progress
from ..core.model import ArrayLeaf, Checkpoint, ChunkList, Region, RegularGrid, Sharding
from ..scheduler import DEFAULT_MEMORY, LeafChunks, decoded_cost
from ..storage import ReadLog
from ..base.names import key_text
from ..base.text import is_ascii_number
from ..core.contract import WriterModule
from ..core.write_plan import Target, TargetArray, WritePlan

if TYPE_CHECKING:  # the interface only: distributed is imported by the commands that join a run
    from ..base import distributed
    from .topology import Topology

# orbax's tensorstore_utils: OCDBT data files (and so single chunks) stay below these
_TARGET_DATA_FILE_SIZE = 2**31
_GCS_TARGET_DATA_FILE_SIZE = 400 * 2**20

# The most devices a mesh may have. Every output array's `_sharding` lists each device id (orbax's
# device_mesh), so the plan and the metadata grow with the device count: --devices 1000000000 on a
# 3 KB checkpoint once spent 8 GB on ids before failing. 2**20 is far above any job jax runs (the
# largest TPU pods are thousands of chips), and a mesh of that many still plans in well under a second.
MAX_MESH_DEVICES = 2**20

# a partition spec as planned here: one entry per dimension, each the tuple of
# mesh axes that dimension is split over (empty: not split)
Spec = tuple[tuple[str, ...], ...]


@dataclass
class ReshardOptions:
    """What `ckpt reshard` was asked: the mesh, how arrays are laid out on it, and how to write."""

    mesh: str  # "data=2,model=4"
    devices: int | None = None  # plan for N devices (ids 0..N-1) instead of this job's
    topology: str | None = None  # plan for a named TPU slice (v5e:2x4, v5litepod-8) instead of this job's
    rules: str | list[Any] | None = None  # a TOML/JSON file, or the parsed list of [regex, spec]
    fsdp: str | None = None  # shard each array's largest divisible free dimension over this axis
    zarr3: bool = False
    workers: int = field(default_factory=copy_workers)
    overwrite: bool = False
    step: str | int | None = None
    skip_unsupported: bool = False
    # plan for this many processes without a coordinator (dry runs for a pod)
    process_count: int | None = None
    memory: int = DEFAULT_MEMORY  # --memory: the read scheduler's budget
    # leaves to keep / drop: globs over '/'-joined keys or dotted names, as convert's (ckpt_tool/core/filters.py)
    select: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    # host numpy leaves (saved as np.ndarray, with no sharding) laid out on the mesh as jax arrays,
    # by the same rules as recorded arrays (--rules, then --fsdp, else replicated); by default they
    # stay host arrays, copied as they are
    host_arrays_to_mesh: bool = False


# -- the mesh ------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceMesh:
    """The new mesh: axes, and its devices in flattened (row-major) order."""

    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    device_ids: tuple[int, ...]
    processes: tuple[int, ...]  # the process owning each device, same order
    origin: str  # "jax" (this job's devices), "host" (this host's, seen without jax), "--devices" or "--topology"
    platform: str | None = None
    source: str | None = None  # where the devices were learned and what was assumed (topology.Topology.describe)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def process_count(self) -> int:
        return max(self.processes) + 1 if self.processes else 1

    def axis_size(self, axis: str) -> int:
        return self.shape[self.axis_names.index(axis)]

    def describe(self) -> str:
        return ",".join(f"{a}={s}" for a, s in zip(self.axis_names, self.shape))

    def to_json(self) -> dict[str, Any]:
        return {
            "axis_names": list(self.axis_names), "shape": list(self.shape), "devices": self.size,
            "device_ids": list(self.device_ids), "processes": self.process_count,
            "origin": self.origin, "platform": self.platform, "source": self.source,
        }


def parse_mesh(text: str) -> list[tuple[str, int]]:
    """'data=2,model=4' -> [('data', 2), ('model', 4)]."""
    axes: list[tuple[str, int]] = []
    for part in (p.strip() for p in text.split(",")):
        name, eq, size = part.partition("=")
        name = name.strip()
        if not eq or not name or not is_ascii_number(size.strip()):
            raise UsageError(f"--mesh wants NAME=SIZE[,NAME=SIZE...], e.g. data=2,model=4; got {text!r}")
        if int(size) < 1:
            raise UsageError(f"--mesh: axis {name!r} has size {size}; sizes are at least 1")
        if name in (a for a, _ in axes):
            raise UsageError(f"--mesh: axis {name!r} is named twice")
        axes.append((name, int(size)))
    total = math.prod(s for _, s in axes)
    if total > MAX_MESH_DEVICES:
        # refused before anything per device is built: the ids alone would outgrow any memory bound
        raise UsageError(f"--mesh {text} has {total:,} devices, over ckpt's limit of {MAX_MESH_DEVICES:,} "
                         "(every array's _sharding lists each device id)")
    return axes


def mesh_for_devices(axes: Sequence[tuple[str, int]], devices: int, process_count: int = 1) -> DeviceMesh:
    """A mesh over `devices` hypothetical devices (ids 0..N-1), process-major:
    process p owns devices [p*N/P, (p+1)*N/P) of the flattened mesh."""
    names, shape = tuple(a for a, _ in axes), tuple(s for _, s in axes)
    if devices > MAX_MESH_DEVICES:
        raise UsageError(f"--devices {devices:,} is over ckpt's limit of {MAX_MESH_DEVICES:,} devices "
                         "(every array's _sharding lists each device id)")
    if math.prod(shape) != devices:
        raise UsageError(f"--mesh {_fmt_axes(axes)} has {math.prod(shape)} devices but --devices is {devices}")
    if devices % process_count:
        raise UsageError(f"--devices {devices} cannot be split evenly over {process_count} processes")
    per = devices // process_count
    return DeviceMesh(names, shape, tuple(range(devices)), tuple(i // per for i in range(devices)), "--devices")


# what to say wherever this machine's devices cannot be learned
_OTHER_LAYOUT = "pass --devices N (ids 0..N-1) or --topology NAME (a TPU slice, e.g. v5e:2x4) to lay out without them"


def mesh_for_topology(axes: Sequence[tuple[str, int]], topo: Topology, process_count: int = 1) -> DeviceMesh:
    """A mesh over `topo`'s devices in jax's mesh order; each device's writer is its host's
    process when this run has one process per host, else the devices are split process-major."""
    names, shape = tuple(a for a, _ in axes), tuple(s for _, s in axes)
    size, ids, hosts = topo.size, topo.device_ids, topo.processes
    if topo.platform == "gpu" and process_count > 1:
        # every process of a GPU job sees its own GPUs; jax numbers them process by process
        size *= process_count
        ids, hosts = tuple(range(size)), tuple(i // topo.size for i in range(size))
    want = math.prod(shape)
    if want != size:
        what = f"{size} device{'s' * (size != 1)}" if size != topo.size else topo.describe()
        raise UsageError(f"--mesh {_fmt_axes(axes)} needs {want} devices but this job has {what}; "
                         f"pass --devices {want} or --topology NAME to lay out for another topology")
    order = topo.mesh_order(shape) if size == topo.size else list(range(size))
    if process_count == max(hosts) + 1:
        processes = tuple(hosts[i] for i in order)
    else:
        if size % process_count:
            raise UsageError(f"{size} devices cannot be split evenly over {process_count} processes")
        per = size // process_count
        processes = tuple(i // per for i in range(size))
    origin = "--topology" if topo.source.startswith("--topology") else "host"
    return DeviceMesh(names, shape, tuple(ids[i] for i in order), processes, origin, topo.platform, topo.describe())


def _backend_failure(exc: BaseException) -> str:
    """The backend's complaint, one line, without its advice to delete a lock another job holds."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r'\s*Run "\$ sudo rm [^"]*"\.?', "", text).strip()


def mesh_from_jax(axes: Sequence[tuple[str, int]]) -> DeviceMesh:
    """A mesh over this job's jax devices (all processes' devices in a multi-host run)."""
    try:
        import jax
    except ImportError:
        raise CkptError(f"laying out for this machine's devices needs jax (pip install jax); or {_OTHER_LAYOUT}") from None
    names, shape = tuple(a for a, _ in axes), tuple(s for _, s in axes)
    try:
        devices = jax.devices()
    except Exception as exc:  # noqa: BLE001 - jax raises RuntimeError/JaxRuntimeError for a held or absent chip
        raise CkptError(f"jax cannot open this machine's devices ({_backend_failure(exc)}); {_OTHER_LAYOUT}") from None
    want = math.prod(shape)
    if want != len(devices):
        platform = devices[0].platform if devices else "none"
        raise UsageError(
            f"--mesh {_fmt_axes(axes)} needs {want} devices but jax sees {len(devices)} {platform} "
            f"device{'s' * (len(devices) != 1)} here; "
            f"pass --devices {want} to lay out for another topology"
        )
    try:
        # jax's own device order for the mesh (topology-aware on TPU/GPU)
        ordered = list(jax.make_mesh(shape, names, devices=devices).devices.flat)
    except Exception:  # noqa: BLE001 - a shape the physical topology cannot take: plain order
        ordered = list(devices)
    return DeviceMesh(
        names, shape, tuple(int(d.id) for d in ordered), tuple(int(d.process_index) for d in ordered),
        "jax", devices[0].platform,
    )


def _fmt_axes(axes: Sequence[tuple[str, int]]) -> str:
    return ",".join(f"{a}={s}" for a, s in axes)


@functools.lru_cache(maxsize=1024)
def _device_groups(mesh: DeviceMesh, spec: Spec) -> dict[tuple[int, ...], list[int]]:
    """Shard grid position -> the flat indices of the devices holding that shard.

    As jax's NamedSharding: a dimension split over axes (a, b) takes shard
    coord[a] * size[b] + coord[b]; a device's replica id is its rank among
    the devices holding the same shard, in flattened mesh order.
    """
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    groups: dict[tuple[int, ...], list[int]] = {}
    for flat in range(mesh.size):
        coord: dict[str, int] = {}
        rest = flat
        for name, size in reversed(list(zip(mesh.axis_names, mesh.shape))):
            coord[name] = rest % size
            rest //= size
        pos = []
        for axes in spec:
            i = 0
            for a in axes:
                i = i * sizes[a] + coord[a]
            pos.append(i)
        groups.setdefault(tuple(pos), []).append(flat)
    return groups


# -- partition specs ---------------------------------------------------------------


def _entry_axes(entry: Any, what: str) -> tuple[str, ...]:
    """One partition spec entry -> its axes: None / "" -> (), "a" -> (a,), [a, b] -> (a, b)."""
    if entry is None or entry == "":
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, (list, tuple)) and all(isinstance(a, str) and a for a in entry):
        return tuple(entry)
    raise CkptError(f"{what}: partition spec entry {entry!r} is not null, an axis name or a list of axis names")


def spec_to_json(spec: Spec) -> list[Any]:
    """The recorded form (orbax's tuple(PartitionSpec)): None / "a" / ["a", "b"], trailing Nones dropped."""
    out: list[Any] = [None if not e else e[0] if len(e) == 1 else list(e) for e in spec]
    while out and out[-1] is None:
        out.pop()
    return out


def format_spec(spec: Spec | None) -> str:
    if spec is None:
        return "-"
    parts = []
    for e in spec_to_json(spec):
        if e is None:
            parts.append("None")
        elif isinstance(e, list):
            parts.append("(" + ", ".join(repr(a) for a in e) + ")")
        else:
            parts.append(repr(e))
    return "P(" + ", ".join(parts) + ")"


def _fmt_axes_entry(axes: tuple[str, ...]) -> str:
    return f"axis {axes[0]!r}" if len(axes) == 1 else "axes (" + ", ".join(repr(a) for a in axes) + ")"


@dataclass(frozen=True)
class Rule:
    """One --rules entry: leaves whose name matches `regex` get the partition `spec`."""

    pattern: str
    regex: re.Pattern[str]
    spec: tuple[tuple[str, ...], ...]
    index: int  # position in the rules list (first match wins)

    def describe(self) -> str:
        return f"rule {self.index} {self.pattern!r}"


def parse_rules(obj: Any, where: str = "--rules") -> list[Rule]:
    """An ordered list of [regex, partition spec]; also {"rules": [...]} (the TOML form)."""
    if isinstance(obj, dict):
        if set(obj) != {"rules"}:
            raise UsageError("a rules table holds one key, 'rules' (a list of [regex, partition spec])", where)
        obj = obj["rules"]
    if not isinstance(obj, list):
        raise UsageError("rules must be a list of [regex, partition spec] pairs", where)
    rules = []
    for i, item in enumerate(obj):
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], (list, tuple))):
            raise UsageError(f"rule {i} is {item!r}; each rule is [regex, partition spec list]", where)
        try:
            rx = re.compile(item[0])
        except re.error as exc:
            raise UsageError(f"rule {i}: bad regex {item[0]!r}: {exc}", where) from None
        try:
            spec = tuple(_entry_axes(e, f"rule {i} {item[0]!r}") for e in item[1])
        except CkptError as exc:  # the same check reads recorded specs, where it is the checkpoint's problem
            raise UsageError(exc.message, where) from None
        rules.append(Rule(item[0], rx, spec, i))
    return rules


def load_rules(path: str) -> list[Rule]:
    """Rules from a JSON or TOML file (by suffix; JSON first when the suffix says neither)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise UsageError(f"cannot read the rules file: {exc.strerror}", path) from None
    text = raw.decode("utf-8", "replace")
    if not path.endswith(".toml"):
        try:
            return parse_rules(strict_json.loads(text), path)
        except ValueError as exc:  # (JSONDecodeError, or nested past the recursion limit)
            if path.endswith(".json"):
                raise UsageError(f"not valid JSON: {exc}", path) from None
    try:
        import tomllib  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise UsageError("TOML rules need Python 3.11+ or `pip install tomli`; or write them as JSON", path) from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"neither JSON nor TOML: {exc}", path) from None
    except RecursionError:  # tomllib recurses per nested array or inline table
        raise UsageError("neither JSON nor TOML: nested too deeply to be read", path) from None
    return parse_rules(doc, path)


def _spec_problem(spec: Spec, shape: tuple[int, ...], mesh: DeviceMesh) -> str | None:
    """Why `spec` cannot lay out an array of `shape` on `mesh`, naming dimension and axis; or None."""
    if len(spec) > len(shape):
        return f"dimension {len(shape)}: the array has rank {len(shape)} but the spec has {len(spec)} entries"
    used: dict[str, int] = {}
    for d, axes in enumerate(spec):
        for a in axes:
            if a not in mesh.axis_names:
                return f"dimension {d}: axis {a!r} is not in the mesh ({', '.join(mesh.axis_names)})"
            if a in used:
                return f"dimension {d}: axis {a!r} is already used by dimension {used[a]}"
            used[a] = d
        n = math.prod(mesh.axis_size(a) for a in axes)
        if axes and shape[d] % n:
            return f"dimension {d} (size {shape[d]}) is not divisible by {_fmt_axes_entry(axes)} (size {n})"
    return None


# -- the plan ---------------------------------------------------------------------------


@dataclass
class LeafPlan:
    """One array of the output: where its layout came from and what it is."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    placement: str  # "mesh" (a jax.Array on the new mesh) or "host" (a numpy leaf, copied as it is)
    old: str  # the recorded layout, described
    old_spec: Spec | None
    new_spec: Spec | None
    # "recorded", "rule N 'regex'", "no recorded spec", "host array" (kept one, or laid out on the
    # mesh by --host-arrays-to-mesh with no rule), each with " + --fsdp AXIS" where that split it
    origin: str
    shard_shape: tuple[int, ...] | None = None
    chunk_shape: tuple[int, ...] = ()
    chunks: int = 0
    replicas: int = 1
    split_dim: int | None = None  # replica-parallel split dimension
    # the source's stored chunks this process's outputs read (each decoded once), the
    # largest one's decoded bytes, and how many are too large to decode whole (streamed)
    source_chunks: int = 0
    source_chunk_bytes: int = 0
    streamed_chunks: int = 0
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def itemsize(self) -> int:
        return dtypes.get(self.dtype).itemsize

    @property
    def shard_bytes(self) -> int:
        return math.prod(self.shard_shape) * self.itemsize if self.shard_shape is not None else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "leaf": self.path, "shape": list(self.shape), "dtype": self.dtype, "placement": self.placement,
            "old": self.old,
            "old_spec": spec_to_json(self.old_spec) if self.old_spec is not None else None,
            "new_spec": spec_to_json(self.new_spec) if self.new_spec is not None else None,
            "origin": self.origin,
            "shard_shape": list(self.shard_shape) if self.shard_shape is not None else None,
            "chunk_shape": list(self.chunk_shape), "chunks": self.chunks, "replicas": self.replicas,
            "split_dim": self.split_dim, "shard_bytes": self.shard_bytes,
            "source_chunks": self.source_chunks, "source_chunk_bytes": self.source_chunk_bytes,
            "streamed_chunks": self.streamed_chunks,
            "notes": self.notes, "error": self.error,
        }


@dataclass
class ProcessLoad:
    """One process's share of a reshard: the chunks it writes and the bytes it reads and writes."""

    chunks: int = 0
    # decoded bytes of the source chunks its output chunks touch, each chunk counted once
    # (the read scheduler decodes each stored chunk once for all the outputs it feeds)
    bytes_read: int = 0
    bytes_written: int = 0
    source_chunks: int = 0

    def add(self, chunks: int, bytes_written: int, source_chunks: int, bytes_read: int) -> None:
        self.chunks += chunks
        self.bytes_written += bytes_written
        self.source_chunks += source_chunks
        self.bytes_read += bytes_read

    def to_json(self) -> dict[str, int]:
        return {"chunks": self.chunks, "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "source_chunks": self.source_chunks}


@dataclass
class ReshardPlan:
    """Every leaf's new layout on the mesh, the values copied as they are, and what the run will hold."""

    source: str
    destination: str
    source_format: str
    mesh: DeviceMesh
    process_count: int
    leaves: list[LeafPlan]
    values: list[str]
    skipped: list[tuple[str, str]]
    processes: list[ProcessLoad]
    checkpoint: Checkpoint = field(repr=False)
    write_plan: WritePlan = field(repr=False)
    sources: dict[tuple[str, ...], ArrayLeaf] = field(repr=False)
    owners: list[int] = field(repr=False)  # the writing process of each chunk, in stream() order
    memory: int = DEFAULT_MEMORY  # the read scheduler's budget
    log: ReadLog | None = field(default=None, repr=False)  # counts what this process reads of the source

    @property
    def errors(self) -> list[LeafPlan]:
        return [leaf for leaf in self.leaves if leaf.error]

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def device_bytes(self) -> int:
        """Bytes every device holds after a restore on the new mesh (each holds one shard of each array)."""
        return sum(leaf.shard_bytes for leaf in self.leaves if leaf.placement == "mesh" and not leaf.error)

    @property
    def host_arrays(self) -> list[LeafPlan]:
        """The leaves that stay host numpy arrays: orbax restores them as np.ndarray, on no device."""
        return [leaf for leaf in self.leaves if leaf.placement == "host"]

    @property
    def host_bytes(self) -> int:
        return sum(math.prod(leaf.shape) * leaf.itemsize for leaf in self.host_arrays)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source, "destination": self.destination, "source_format": self.source_format,
            "mesh": self.mesh.to_json(), "process_count": self.process_count,
            "ok": self.ok,
            "leaves": [leaf.to_json() for leaf in self.leaves],
            "values": self.values,
            "skipped": [{"leaf": p, "reason": r} for p, r in self.skipped],
            "processes": [dict(process=i, **p.to_json()) for i, p in enumerate(self.processes)],
            "device_bytes": self.device_bytes, "host_bytes": self.host_bytes,
            "memory": self.memory,
            "errors": [{"leaf": leaf.path, "message": leaf.error} for leaf in self.errors],
        }


def _old_layout(leaf: ArrayLeaf) -> tuple[str, Spec | None]:
    sh = leaf.sharding
    if sh is not None and sh.kind == "named":
        spec = tuple(_entry_axes(e, leaf.path) for e in (sh.partition_spec or ()))
        return sh.describe(), spec
    if sh is not None:
        return sh.describe(), None
    return "host array" if leaf.extra.get("value_type") == "np.ndarray" else "no recorded sharding", None


def _default_spec(leaf: ArrayLeaf, old_spec: Spec | None, mesh: DeviceMesh, notes: list[str]) -> Spec:
    """The recorded spec, each dimension kept where its axes exist in the new mesh and divide it."""
    rank = len(leaf.shape)
    if old_spec is None:
        return ((),) * rank
    out: list[tuple[str, ...]] = []
    used: set[str] = set()
    for d in range(rank):
        axes = old_spec[d] if d < len(old_spec) else ()
        missing = [a for a in axes if a not in mesh.axis_names]
        if missing:
            notes.append(f"dimension {d}: axis {missing[0]!r} is not in the new mesh: replicated")
            axes = ()
        elif any(a in used for a in axes):
            notes.append(f"dimension {d}: axis {next(a for a in axes if a in used)!r} is used twice: replicated")
            axes = ()
        elif axes:
            n = math.prod(mesh.axis_size(a) for a in axes)
            if leaf.shape[d] % n:
                notes.append(f"dimension {d} (size {leaf.shape[d]}) is not divisible by {_fmt_axes_entry(axes)} "
                             f"(size {n}): replicated")
                axes = ()
        used.update(axes)
        out.append(axes)
    return tuple(out)


def _apply_fsdp(shape: tuple[int, ...], spec: Spec, axis: str, mesh: DeviceMesh, notes: list[str]) -> Spec:
    """Split the largest unsplit dimension divisible by the axis size (first on ties) over `axis`."""
    if not shape or any(axis in axes for axes in spec):
        return spec
    n = mesh.axis_size(axis)
    free = [d for d, axes in enumerate(spec) if not axes and shape[d] > 0 and shape[d] % n == 0]
    if not free:
        notes.append(f"--fsdp: no free dimension divisible by {axis!r} (size {n}): replicated over it")
        return spec
    best = max(free, key=lambda d: (shape[d], -d))
    return tuple((axis,) if d == best else axes for d, axes in enumerate(spec))


def _divisors(n: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return sorted(set(small + [n // i for i in small]))


def subchunk_shape(global_shape: Sequence[int], write_shape: Sequence[int], itemsize: int,
                   target_bytes: int | None) -> tuple[int, ...]:
    """orbax's subchunking.choose_chunk_shape without shard_axes: step the largest
    already-split dimension down through its divisors until a chunk fits
    `target_bytes` (then the whole dimensions too)."""
    write = tuple(max(1, int(d)) for d in write_shape)
    if target_bytes is None:
        return write
    rank = len(write)
    split = [int(g) != w for g, w in zip(global_shape, write)]
    factors = [_divisors(s) for s in write]
    total = math.prod(write)
    target = max(1, target_bytes // itemsize)
    while total > target:
        dim, size = -1, 1
        for i in range(rank):
            if split[i] and factors[i][-1] > size:
                dim, size = i, factors[i][-1]
        if size > 1:
            cur = factors[dim].pop()
            total = total // cur * factors[dim][-1]
            split[dim] = True
        else:
            split = [True] * rank  # start splitting the dimensions that were whole
    return tuple(f[-1] for f in factors)


def _layout(lp: LeafPlan, mesh: DeviceMesh, target_file_size: int, memory: int = DEFAULT_MEMORY,
            copied: Callable[[tuple[int, ...]], bool] | None = None) -> None:
    """Shard shape, replica-parallel write shape and chunk shape, as orbax 0.12 picks them."""
    spec = lp.new_spec
    assert spec is not None
    shard = tuple(s // math.prod(mesh.axis_size(a) for a in axes) for s, axes in zip(lp.shape, spec))
    replicas = mesh.size // max(1, math.prod(math.prod(mesh.axis_size(a) for a in axes) for axes in spec))
    write = list(shard)
    split_dim = None
    if replicas > 1 and math.prod(shard) > 0:
        split_dim = next((d for d, s in enumerate(shard) if s % replicas == 0), None)
        if split_dim is not None:
            write[split_dim] //= replicas
    lp.shard_shape, lp.replicas, lp.split_dim = shard, replicas, split_dim
    nbytes = math.prod(write) * lp.itemsize
    lp.chunk_shape = subchunk_shape(lp.shape, write, lp.itemsize, target_file_size if nbytes > target_file_size else None)
    # an output chunk is assembled and encoded whole: one the memory budget cannot hold is
    # cut further, the way orbax cuts one above its target file size
    limit = output_chunk_limit(memory)
    if math.prod(lp.chunk_shape) * lp.itemsize > limit and copied is not None and copied(lp.chunk_shape):
        # ...unless the source's chunks are these, stored as the output stores them: each is
        # copied as it is stored, a window at a time (engine.stream), never assembled
        lp.notes.append(f"chunk {list(lp.chunk_shape)} copied as it is stored, not cut to fit --memory "
                        f"({limit // 2**20} MiB per assembled output chunk)")
    elif math.prod(lp.chunk_shape) * lp.itemsize > limit:
        capped = subchunk_shape(lp.shape, lp.chunk_shape, lp.itemsize, limit)
        lp.notes.append(f"chunk {list(lp.chunk_shape)} cut to {list(capped)} to fit --memory "
                        f"({limit // 2**20} MiB per output chunk)")
        lp.chunk_shape = capped


def _copied_as_stored(writer: WriterModule, destination: str, target: TargetArray, leaf: ArrayLeaf,
                      zarr3: bool) -> Callable[[tuple[int, ...]], bool]:
    """A test of a chunk shape: whether an output grid of that shape would take `leaf`'s stored
    chunks as they are (stored_copy.plans_stored_copy). (stored_copy.copies_stored asks the same of a
    writer at run time.)"""
    return lambda chunk_shape: plans_stored_copy(
        writer, destination, replace(target, layout=RegularGrid(tuple(chunk_shape))), leaf, zarr3)


def _owners(lp: LeafPlan, target: TargetArray, mesh: DeviceMesh) -> list[int]:
    """The process writing each chunk: the owner of the device orbax would have had write it."""
    assert lp.new_spec is not None and lp.shard_shape is not None
    groups = _device_groups(mesh, lp.new_spec)
    shard = lp.shard_shape
    out = []
    for _, region in chunk_regions(target):
        starts = [r.start for r in region]
        pos = tuple(o // s if s else 0 for o, s in zip(starts, shard))
        replica = 0
        if lp.split_dim is not None:
            d = lp.split_dim
            replica = (starts[d] % shard[d]) // (shard[d] // lp.replicas)
        out.append(mesh.processes[groups[pos][replica]])
    return out


def resolve_mesh(opts: ReshardOptions, process_count: int) -> DeviceMesh:
    axes = parse_mesh(opts.mesh)
    if opts.devices is not None:
        if opts.topology is not None:
            raise UsageError("--devices and --topology both say which devices to lay out for; pass one")
        return mesh_for_devices(axes, opts.devices, process_count)
    # a named slice, else this host's accelerators seen without opening them (a held chip stays untouched);
    # imported here, by the plan, as the reader's modules are: what the command imports before its
    # plan is what both convert and reshard import (their process overheads compare alike)
    from .topology import host_topology, named_topology

    topo = named_topology(opts.topology) if opts.topology is not None else host_topology()
    if topo is not None:
        return mesh_for_topology(axes, topo, process_count)
    mesh = mesh_from_jax(axes)
    if mesh.process_count > process_count:
        raise CkptError(
            f"jax's devices belong to {mesh.process_count} processes but this run has {process_count}; "
            "pass the same --coordinator/--num-processes/--process-id on every host"
        )
    return mesh


def plan_reshard(
    source: str | Checkpoint,
    destination: str,
    opts: ReshardOptions,
    *,
    coordinator: distributed.Coordinator | None = None,
) -> ReshardPlan:
    """The new layout of every leaf, checked, with the chunk grid and the writer of each chunk.

    Reads metadata (and scalar/string values) only. Spec problems do not
    raise here: they are in `plan.errors`, so a dry run can list them all.
    Pickles are unpickled within opts.memory (as validate's).
    """
    from ..machinery.torch_save.pickle_budget import memory_budget  # (here: most checkpoints hold no pickle)

    with memory_budget(opts.memory):
        return _plan_reshard(source, destination, opts, coordinator=coordinator)


def _plan_reshard(
    source: str | Checkpoint,
    destination: str,
    opts: ReshardOptions,
    *,
    coordinator: distributed.Coordinator | None,
) -> ReshardPlan:
    coord = coordinator or Coordinator()
    process_count = max(coord.process_count, opts.process_count or 1)
    mesh = resolve_mesh(opts, process_count)
    if opts.fsdp is not None and opts.fsdp not in mesh.axis_names:
        raise UsageError(f"--fsdp: axis {opts.fsdp!r} is not in the mesh ({', '.join(mesh.axis_names)})")
    rules: list[Rule] = []
    if isinstance(opts.rules, str):
        rules = load_rules(opts.rules)
    elif opts.rules is not None:
        rules = parse_rules(opts.rules)

    log = None if isinstance(source, Checkpoint) else ReadLog()
    src = source if isinstance(source, Checkpoint) else open_source(source, opts.step, log=log)
    if not src.committed:
        raise CkptError("the source is an uncommitted save; refusing to reshard it", src.path)
    # before its values are read for the plan (as convert does; a planned write is not checked again)
    check_source_complete(src, source if isinstance(source, str) else None)
    # the same leaves, names, values and skips as `convert --to orbax`; only the arrays' layout changes
    base, skipped, sources = plan_conversion(src, ConvertOptions(
        to=formats.reshard_format().name, zarr3=opts.zarr3, skip_unsupported=opts.skip_unsupported, step=opts.step, memory=opts.memory,
        select=list(opts.select), exclude=list(opts.exclude),
    ))
    target_file_size = _GCS_TARGET_DATA_FILE_SIZE if destination.startswith("gs://") else _TARGET_DATA_FILE_SIZE
    writer = formats.reshard_format().writer_module()

    leaves: list[LeafPlan] = []
    targets: list[Target] = []
    for target in base.targets:
        if not isinstance(target, TargetArray):
            targets.append(target)
            continue
        leaf = sources[key_text(target.keys)]
        old, old_spec = _old_layout(leaf)
        host = leaf.extra.get("value_type") == "np.ndarray"
        if host and not opts.host_arrays_to_mesh:
            # a host numpy leaf was never on a mesh: copied as it is, restored as numpy
            lp = LeafPlan(target.path, target.shape, target.dtype, "host", old, None, None, "host array")
            assert isinstance(target.layout, RegularGrid)
            lp.chunk_shape = target.layout.chunk_shape
            leaves.append(lp)
            targets.append(target)
            continue
        lp = LeafPlan(target.path, target.shape, target.dtype, "mesh", old, old_spec, None, "")
        rule = next((r for r in rules if r.regex.search(target.path)), None)
        if rule is not None:
            lp.origin = rule.describe()
            problem = _spec_problem(rule.spec, target.shape, mesh)
            if problem:
                lp.error = f"{rule.describe()} gives {format_spec(rule.spec)}: {problem}"
                leaves.append(lp)
                continue
            lp.new_spec = rule.spec + ((),) * (len(target.shape) - len(rule.spec))
        else:
            lp.origin = "recorded" if old_spec is not None else "host array" if host else "no recorded spec"
            lp.new_spec = _default_spec(leaf, old_spec, mesh, lp.notes)
            if opts.fsdp is not None:
                spec = _apply_fsdp(target.shape, lp.new_spec, opts.fsdp, mesh, lp.notes)
                if spec != lp.new_spec:
                    lp.origin += f" + --fsdp {opts.fsdp}"
                    lp.new_spec = spec
            if old_spec is None and target.shape and not any(lp.new_spec):
                lp.notes.insert(0, f"{'host array' if host else 'no recorded partition spec'}: replicated")
        _layout(lp, mesh, target_file_size, opts.memory, _copied_as_stored(writer, destination, target, leaf, opts.zarr3))
        leaves.append(lp)
        sharding = Sharding(
            "named", mesh_shape=mesh.shape, axis_names=mesh.axis_names,
            partition_spec=tuple(tuple(e) if isinstance(e, list) else e for e in spec_to_json(lp.new_spec)),
            device_ids=mesh.device_ids,
        )
        targets.append(replace(target, layout=RegularGrid(lp.chunk_shape), sharding=sharding))

    _check_sharding_size(mesh, sum(lp.placement == "mesh" and not lp.error for lp in leaves))
    plan = WritePlan(targets, info=dict(base.info, mesh=mesh.to_json()), tuples=base.tuples)
    by_path = {lp.path: lp for lp in leaves}
    owners: list[int] = []
    loads = [ProcessLoad() for _ in range(process_count)]
    # leaves with a spec problem are not in the write plan: the loads cover the others
    for target in plan.arrays():
        lp = by_path[target.path]
        lp.chunks = target.layout.count(target.shape)
        itemsize = lp.itemsize
        lc = LeafChunks(sources[key_text(target.keys)])
        touched: list[set[int]] = [set() for _ in range(process_count)]
        elements: int = math.prod(target.shape)
        if process_count == 1 and elements:
            # one process writes every chunk, and the chunks tile the array: its load is the whole
            # leaf, read from every stored chunk the array overlaps. Taken chunk by chunk, a layout
            # for 256 devices (40,000 chunks) was a quarter of a second of planning
            mine = [0] * lp.chunks
            touched[0].update(lc.overlapping(tuple(slice(0, n) for n in target.shape)))
            loads[0].add(lp.chunks, elements * itemsize, len(touched[0]),
                         sum(math.prod(lc.chunks[ci].sizes) for ci in touched[0]) * lc.itemsize)
        else:
            if lp.placement == "mesh":
                mine = _owners(lp, target, mesh)
            else:  # host arrays have no devices: round robin, as convert splits them
                mine = [(len(owners) + i) % process_count for i in range(lp.chunks)]
            for (_, region), owner in zip(chunk_regions(target), mine):
                new = [ci for ci in lc.overlapping(region) if ci not in touched[owner]]
                touched[owner].update(new)
                loads[owner].add(1, math.prod(r.stop - r.start for r in region) * itemsize, len(new),
                                 sum(math.prod(lc.chunks[ci].sizes) for ci in new) * lc.itemsize)
        used = set().union(*touched)
        sizes = [math.prod(lc.chunks[ci].sizes) * lc.itemsize for ci in used]
        lp.source_chunks = len(used)
        lp.source_chunk_bytes = max(sizes, default=0)
        lp.streamed_chunks = sum(1 for n in sizes if decoded_cost(n) > opts.memory)
        owners.extend(mine)
    values = [t.path for t in plan.values()]
    return ReshardPlan(
        str(source if isinstance(source, str) else src.path), destination, src.format, mesh, process_count,
        leaves, values, skipped, loads, src, plan, sources, owners, opts.memory, log,
    )


def _check_sharding_size(mesh: DeviceMesh, arrays: int) -> None:
    """Refuse a layout whose `_sharding` would outgrow what a reader accepts of a metadata file: it
    lists every device id once per array on the mesh, as a JSON string (`{\\"id\\": 7}, `, 12 bytes
    and the digits each). A million devices over 15 arrays wrote 282 MB that no reader would open."""
    if not arrays:
        return
    from ..machinery.arrays.schema import MAX_JSON_BYTES  # (the metadata parser's bound, with the reader's modules)

    per_array = sum(len(str(i)) for i in mesh.device_ids) + 12 * mesh.size
    if arrays * per_array > MAX_JSON_BYTES:
        raise CkptError(
            f"{arrays} arrays on a mesh of {mesh.size:,} devices make a _sharding of about {arrays * per_array:,} bytes "
            f"(each array lists every device id), over the {MAX_JSON_BYTES:,} a metadata file may have; "
            "lay out for fewer devices, or fewer arrays (--select/--exclude)")


# -- running it ---------------------------------------------------------------------------


@dataclass
class ReshardResult:
    """What a reshard wrote: its plan, chunks and bytes, time, and the leftovers it removed."""

    plan: ReshardPlan
    chunks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    process_index: int = 0
    process_count: int = 1
    cleanup: list[str] = field(default_factory=list)  # leftovers of killed runs beside DST (ops/destination.py)
    bytes_read: int = 0  # what this process read of the source's files (engine.ConvertResult.bytes_read)

    def to_json(self) -> dict[str, Any]:
        p = self.plan
        return {
            "source": p.source, "destination": p.destination, "source_format": p.source_format,
            "target_format": formats.reshard_format().name, "mesh": p.mesh.to_json(),
            "arrays": len(p.leaves), "values": len(p.values),
            "chunks": self.chunks, "bytes": self.bytes, "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 3), "device_bytes": p.device_bytes,
            # leaves written as host numpy arrays (restored as np.ndarray, on no device)
            "host_arrays": [lp.path for lp in p.host_arrays], "host_bytes": p.host_bytes,
            "notes": [{"leaf": lp.path, "note": n} for lp in p.leaves for n in lp.notes],
            "skipped": [{"leaf": path, "reason": r} for path, r in p.skipped],
            "process_index": self.process_index, "process_count": self.process_count,
            "cleanup": self.cleanup,
        }


def check_plan(plan: ReshardPlan) -> None:
    """Raise on the first spec problem (one line: leaf, dimension, axis)."""
    errors = plan.errors
    if errors:
        more = f" (and {len(errors) - 1} more; --dry-run lists them)" if len(errors) > 1 else ""
        raise CkptError(f"{errors[0].error}{more}", errors[0].path)


def reshard(
    source: str,
    destination: str,
    opts: ReshardOptions,
    *,
    progress: Progress = no_progress,
    coordinator: distributed.Coordinator | None = None,
) -> ReshardResult:
    """Write `source` laid out for the new mesh into `destination` (Orbax); all or nothing.

    Every spec is checked before the destination is touched. Each process
    writes the chunks of its own devices (ocdbt.process_<i>); the primary
    merges and writes the metadata after a barrier (engine.convert).
    """
    coord = coordinator or Coordinator()
    # the summary's time spans the plan too (opening the source, its preflight check, every leaf's
    # spec), as convert's does: what is left of the process is its start and end
    started = time.monotonic()
    plan = plan_reshard(source, destination, opts, coordinator=coord)
    planned = time.monotonic() - started
    check_plan(plan)
    owners = plan.owners
    result = convert(
        source, destination,
        ConvertOptions(to=formats.reshard_format().name, zarr3=opts.zarr3, workers=opts.workers, overwrite=opts.overwrite, step=opts.step,
                       memory=opts.memory),
        progress=progress, coordinator=coord,
        planned=PlannedWrite(plan.checkpoint, plan.write_plan, plan.sources, owns=lambda n, rank: owners[n] == rank,
                             log=plan.log),
    )
    return ReshardResult(plan, result.chunks, result.bytes, planned + result.seconds, result.process_index, result.process_count,
                         cleanup=result.cleanup, bytes_read=result.bytes_read)

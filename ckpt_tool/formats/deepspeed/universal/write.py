"""A DeepSpeed ZeRO checkpoint converted to a universal checkpoint: what DeepSpeed 0.19's
`ds_to_universal` writes, file for file and byte for byte, streamed, with no temporary directory.

ds_to_universal (deepspeed/checkpoint/ds_to_universal.py) first torch.saves every rank's slice of
every parameter's fp32 weights and Adam moments as a file of its own in `OUT/tmp/` (the
"fragments"; a 7B model's filled a 3.5 TB disk, Megatron-DeepSpeed #343), then loads them back,
concatenates and torch.saves each parameter whole. Here each parameter's tensors are streamed by
the engine (the ZeRO reader assembles them from the ranks' partitions by byte range, band by
band, within --memory) straight to their place in their final torch.save file: the file's layout
is fixed up front from the tensor's size (torch_save.archive.StreamedArchive), each band is
written at its offset as it arrives, and the zip records around the data (which carry its CRC-32,
put together from the bands') are written last. Nothing passes through a temporary file.

`convert ZERO_CKPT DST --to deepspeed-universal` writes DST as a root DeepSpeed loads with
`engine.load_checkpoint(DST, load_universal=True)`:

    DST/latest_universal      "<tag>_universal" (no newline), as ds_to_universal writes it
    DST/<tag>_universal/      what ds_to_universal writes to its --output_folder:

stages 1 and 2 (its `zero_stage <= 2` path):
  * `zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt` per trained parameter: torch.save of
    {"cat_dim": 0, "param": the tensor, of the parameter's shape}, the tensor a new contiguous
    one (torch.cat's) whose requires_grad is the ranks' flat tensors'; `step.pt`: the step
    tensor of the group as the first rank holding part of the parameter saved it;
  * `zero/<name>/fp32.pt` for every other entry of the module state (frozen parameters, buffers,
    tied names): {"param": tensor.float()}, which is the module's tensor itself when it is
    float32 (a view: torch.save writes its whole storage, which for DeepSpeed's flattened
    parameters is the whole group's buffer) and a new float32 tensor otherwise;
  * `zero/optimizer_state.pt`: rank 0's ZeRO optimizer state dict as DeepSpeedCheckpoint loads
    it (partition_count set to the DP degree per group, group_paddings zeroed), without
    base_optimizer_state, param_slice_mappings and single_partition_of_fp32_groups, plus the
    base optimizer's param_groups; re-saved as torch.save would (torch_save.resave);
  * the `mp_rank_00_model_states.pt` file, copied.

stage 3 (its other path):
  * `zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt` per parameter of the recorded shapes: the bare
    tensor, flat (numel,);
  * `zero/optimizer_state.pt`: rank 0's whole ZeRO optimizer state dict plus `param_groups` (the
    same list as its optimizer_state_dict's: one object, pickled once);
  * every `*model_states.pt` file, copied.

As with ds_to_universal's --inject_missing_state, a checkpoint whose model states record no
`universal_checkpoint_info` converts as one that records only its version; one whose info names
merge patterns (vocabulary padding, averaged, replicated or row-parallel parameters,
sub-parameters, affine maps) is refused by name: their rules change the files, and are not
written yet. The output is
the whole checkpoint: --select/--exclude/--rename/--unstack/--dtype are refused.
"""
from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from ....base import dtypes
from ....base.checksum import CrcTiling, crc32
from ....base.errors import CkptError, CorruptMetadataError, IncompleteCheckpointError, UnsupportedLeafError, UsageError
from ....core.model import ChunkList, Key, Region, RegularGrid, default_grid, stored_chunks
from ....storage import LocalFileWriter, Storage
from ....machinery.torch_save import resave
from ....machinery.torch_save.archive import StreamedArchive, tensor_reduce
from ....machinery.torch_save.pickle_writer import dumps
from ....machinery.torch_save.safe_pickle import TensorRef
from ....core.contract import CheckpointWriter
from ....core.write_plan import PlanContext, TargetArray, TargetValue, WritePlan, byte_runs
from ....machinery.torch_save import reading as ts
from .. import reader as ds
from . import reader as u

OUT_SUFFIX = "_universal"  # ds_to_universal's documented output folder: <tag>_universal
CAT_DIM = "cat_dim"  # DeepSpeed's checkpoint.constants
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
# the universal_checkpoint_info entries whose rules change what ds_to_universal writes (TP merges,
# vocabulary padding stripped, averaged or replicated slices, sub-parameters, affine maps)
MERGE_RULES = ("vocabulary_parameter_patterns", "parameter_to_average_patterns",
               "parameter_with_row_parallelism_patterns", "tp_replicated_parameter_patterns",
               "parameter_with_2_sub_params_cat_dim_0", "parameter_with_sub_params", "affine_map",
               "autotp_unsupported_parameter_patterns")
STATES = ("fp32", "exp_avg", "exp_avg_sq")  # what ds_to_universal extracts (a KeyError there without them)
# the ZeRO optimizer state's per-rank entries ds_to_universal leaves out of optimizer_state.pt (stages 1/2)
SHARDED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")
_COPY_BYTES = 8 << 20  # copies and casts go through a buffer this big


class UniversalWriteError(CkptError):
    """The source or the plan cannot be written as a universal checkpoint."""


# ---------------------------------------------------------------------------
# the output files
# ---------------------------------------------------------------------------
@dataclass
class _FromPlan:
    """A storage whose bytes are a plan target's (written by write_array)."""

    keys: tuple[Key, ...]
    nbytes: int


@dataclass
class _Copy:
    """A storage copied whole from a storage member of a source archive."""

    archive: ts.Archive
    key: str
    nbytes: int


@dataclass
class _Cast:
    """A module tensor cast to float32 (`tensor.float()`), written in storage order."""

    archive: ts.Archive
    ref: TensorRef
    order: tuple[int, ...]  # the dimensions from outermost to innermost in storage
    nbytes: int


Source = Union[_FromPlan, _Copy, _Cast]


@dataclass
class _File:
    """One torch.save file of the output."""

    path: str  # relative to the output root
    archive: StreamedArchive
    sources: list[Source]
    tiles: list[CrcTiling] = field(default_factory=list)
    crcs: list[int | None] = field(default_factory=list)
    remaining: int = 0  # bytes of plan data not written yet
    local: LocalFileWriter | None = None
    data: bytearray | None = None  # non-local storage: the whole file, written once complete
    done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def _archive_name(path: str) -> str:
    """torch.save names its records after the file's stem (`fp32.pt` -> `fp32/data.pkl`)."""
    return os.path.splitext(os.path.basename(path))[0]


def _safe_name(name: str, where: str) -> str:
    """A parameter name as a directory name (ds_to_universal joins it to the path as it is)."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise CorruptMetadataError(f"parameter name {name!r} cannot be a directory name", where)
    return name


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    return ts.contiguous(shape, stride)


def _dense_order(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...] | None:
    """The dimensions in storage order when the view is dense and non-overlapping (torch's
    preserve_format then keeps its strides for `.float()`), else None."""
    dims = sorted((d for d in range(len(shape))), key=lambda d: (-stride[d], -shape[d]))
    expected = 1
    for d in reversed(dims):
        if shape[d] > 1 and stride[d] != expected:
            return None
        expected *= shape[d]
    return tuple(dims)


# ---------------------------------------------------------------------------
# what each file holds, from the source
# ---------------------------------------------------------------------------
class _Plan:
    """The files of the universal checkpoint of one ZeRO step (see the module docstring)."""

    def __init__(self, step: ds.Step, root: str) -> None:
        self.step = step
        self.root = root
        self.files: list[_File] = []
        self.copies: list[tuple[ts.Archive, str]] = []  # model-states files copied whole: (archive, output path)
        self.by_keys: dict[tuple[Key, ...], _File] = {}

    def add(self, path: str, pickle_bytes: bytes, sources: list[Source]) -> _File:
        archive = StreamedArchive(pickle_bytes, [s.nbytes for s in sources], _archive_name(path))
        f = _File(f"{self.root}/{path}", archive, sources)
        f.tiles = [CrcTiling(0, s.nbytes) for s in sources]
        f.crcs = [None if s.nbytes else 0 for s in sources]
        f.remaining = sum(s.nbytes for s in sources if isinstance(s, _FromPlan))
        self.files.append(f)
        for s in sources:
            if isinstance(s, _FromPlan):
                self.by_keys[s.keys] = f
        return f


def _graph(archive: ts.Archive) -> Any:
    return resave.load(archive.zip.pickle_bytes(), archive.where)


def _flat_requires_grad(step: ds.Step, g: int, pick: Any, ranks: list[int]) -> bool:
    """requires_grad of torch.cat over the ranks' slices: any of the flat tensors' it slices."""
    out = False
    for r in ranks:
        o = step.optims.get(r)
        ref = pick(o, g) if o is not None else None
        out = out or bool(isinstance(ref, TensorRef) and ref.requires_grad)
    return out


def plan_files(step: ds.Step, leaves: dict[str, Any], root: str) -> _Plan:
    """Every output file of a ZeRO step: the universal checkpoint ds_to_universal writes."""
    where = step.model_archives[0].where
    info = step.states.get(UNIVERSAL_CHECKPOINT_INFO)
    rules = sorted(k for k in MERGE_RULES if isinstance(info, dict) and info.get(k))
    if rules:
        raise UniversalWriteError(f"the model states record {UNIVERSAL_CHECKPOINT_INFO} with {', '.join(rules[:3])}: "
                                  "ds_to_universal's merge rules for them are not written by ckpt yet", where)
    if any("elastic_step" in o.base for o in step.optims.values()):
        raise UniversalWriteError("an elastic ZeRO checkpoint (per-group optimizer state lists): ds_to_universal "
                                  "reads the rigid layout", where)
    plan = _Plan(step, root)
    trained: set[str] = set()
    groups = [[name for name, _ in group] for group in step.shapes]
    shapes = {name: shape for group in step.shapes for name, shape in group}
    for g, names in enumerate(groups):
        for name in names:
            _safe_name(name, where)
            pieces = step.mapping.pieces.get(name, [])
            ranks = sorted({p.rank for p in pieces}) if step.stage != 3 else sorted(step.optims)
            if step.stage != 3 and not pieces:
                continue  # no rank holds an element of it: ds_to_universal writes it from the module
            trained.add(name)
            first = step.optims[ranks[0]]
            state = ds._group_state(first, g)
            missing = [k for k in STATES[1:] if not isinstance(state.get(k), TensorRef)]
            if missing:
                raise UniversalWriteError(f"the optimizer state of {name}'s group has no {' or '.join(missing)}: "
                                          "a universal checkpoint holds Adam's exp_avg and exp_avg_sq", first.archive.where)
            for key in STATES:
                keys = leaves[name] if key == "fp32" else (ds.OPTIMIZER_KEY, "state", name, key)
                pick = (lambda o, gg: o.flats[gg] if gg < len(o.flats) else None) if key == "fp32" else \
                    (lambda o, gg, key=key: ds._state_ref(o, gg, key))
                dtype = dtypes.get(ds._flat_dtype(step, g) if key == "fp32" else state[key].dtype)
                requires_grad = _flat_requires_grad(step, g, pick, ranks)
                numel = math.prod(shapes[name])
                if step.stage == 3:
                    body: Any = tensor_reduce(dtype, (numel,), "0", requires_grad=requires_grad)
                else:
                    body = {CAT_DIM: 0, u.PARAM_KEY: tensor_reduce(dtype, tuple(shapes[name]), "0",
                                                                  requires_grad=requires_grad)}
                plan.add(f"{u.ZERO}/{name}/{key}.pt", dumps(body, 2), [_FromPlan(tuple(keys), numel * dtype.itemsize)])
            if step.stage != 3 and "step" in state:
                _add_step(plan, step, name, ranks[0], g)
    if step.stage != 3:
        _add_module_entries(plan, step, trained)
    _add_optimizer_state(plan, step)
    if step.stage == 3:
        for r, archive in sorted(step.model_archives.items()):
            plan.copies.append((archive, f"{root}/{archive.name}"))
    else:
        plan.copies.append((step.model_archives[0], f"{root}/{step.model_archives[0].name}"))
    return plan


def _add_step(plan: _Plan, step: ds.Step, name: str, rank: int, g: int) -> None:
    """`step.pt`: the step of the group as torch.load gave it from that rank's file, saved again."""
    o = step.optims[rank]
    graph = _graph(o.archive)
    try:
        # ds_to_universal: base_optimizer_state["state"][group]["step"]
        value = graph["optimizer_state_dict"]["base_optimizer_state"]["state"][g]["step"]
    except (KeyError, TypeError, IndexError):
        raise CorruptMetadataError(f"no step for the group of {name}", o.archive.where) from None
    pickle_bytes, storages = resave.emit(value)
    plan.add(f"{u.ZERO}/{name}/step.pt", pickle_bytes, [_Copy(o.archive, s.key, s.nbytes) for s in storages])


def _add_module_entries(plan: _Plan, step: ds.Step, trained: set[str]) -> None:
    """ds_to_universal's last pass (stages 1/2): `{"param": tensor.float()}` for each module entry
    that has no fp32.pt yet."""
    archive = step.model_archives[0]
    graph = _graph(archive)
    module = graph.get("module") if isinstance(graph, dict) else None
    if module is None:
        return  # (ds_to_universal: pipeline checkpoints store no module here)
    if not isinstance(module, dict):
        raise CorruptMetadataError("the module state is not a dict", archive.where)
    for name, tensor in module.items():
        if name in trained:
            continue
        _safe_name(str(name), archive.where)
        if not isinstance(tensor, resave.SavedTensor):
            raise UniversalWriteError(f"module entry {name!r} is {type(tensor).__name__}, not a tensor "
                                      "(ds_to_universal calls .float() on each)", archive.where)
        if tensor.dtype == "float32":
            body, storages = resave.emit({u.PARAM_KEY: tensor})
            plan.add(f"{u.ZERO}/{name}/fp32.pt", body, [_Copy(archive, s.key, s.nbytes) for s in storages])
            continue
        # .float() keeps a dense tensor's layout (preserve_format); anything else becomes contiguous
        natural = tuple(range(len(tensor.size)))
        order = natural if _contiguous(tensor.size, tensor.stride) else _dense_order(tensor.size, tensor.stride) or natural
        stride = None if order == natural else _strides_for(tensor.size, order)
        numel = math.prod(tensor.size)
        ref = TensorRef(_storage_ref(tensor), tensor.dtype, tensor.storage_offset, tensor.size, tensor.stride,
                        tensor.requires_grad)
        reduce = tensor_reduce(dtypes.get("float32"), tuple(tensor.size), "0", stride=stride,
                               requires_grad=tensor.requires_grad)
        plan.add(f"{u.ZERO}/{name}/fp32.pt", dumps({u.PARAM_KEY: reduce}, 2),
                 [_Cast(archive, ref, order, numel * 4)])


def _strides_for(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a dense tensor laid out in storage in `order` (outermost first), as torch sets them."""
    strides = [0] * len(shape)
    acc = 1
    for d in reversed(order):
        strides[d] = acc
        acc *= max(shape[d], 1)
    return tuple(strides)


def _storage_ref(tensor: resave.SavedTensor) -> Any:
    from ....machinery.torch_save.safe_pickle import StorageRef

    s = tensor.storage
    return StorageRef(s.key, s.dtype if s.typed else None, "cpu", s.numel)


def _add_optimizer_state(plan: _Plan, step: ds.Step) -> None:
    """`zero/optimizer_state.pt` from rank 0's optimizer-states file, as ds_to_universal makes it."""
    o = step.optims[min(step.optims)]
    graph = _graph(o.archive)
    osd = graph.get("optimizer_state_dict") if isinstance(graph, dict) else None
    if not isinstance(osd, dict):
        raise CorruptMetadataError("no optimizer_state_dict", o.archive.where)
    try:
        if step.stage == 3:
            out = osd
            out["param_groups"] = osd["optimizer_state_dict"]["param_groups"]
        else:
            # DeepSpeedCheckpoint.get_zero_checkpoint_state: partition_count per group set to the DP
            # degree, group_paddings cleared (each a new list), when they are there
            if osd.get("partition_count"):
                osd["partition_count"] = [step.world] * len(osd["partition_count"])
            if osd.get("group_paddings"):
                osd["group_paddings"] = [0] * len(osd["group_paddings"])
            out = {k: v for k, v in osd.items() if k not in SHARDED}
            out["param_groups"] = osd["base_optimizer_state"]["param_groups"]
    except (KeyError, TypeError):
        raise CorruptMetadataError("the optimizer state has no param_groups where DeepSpeed keeps them",
                                   o.archive.where) from None
    body, storages = resave.emit(out)
    plan.add(f"{u.ZERO}/{u.OPTIMIZER_STATE}", body, [_Copy(o.archive, s.key, s.nbytes) for s in storages])


# ---------------------------------------------------------------------------
# the writer
# ---------------------------------------------------------------------------
class UniversalWriter(CheckpointWriter):
    """Writes a DeepSpeed universal checkpoint (see the module docstring; writers.CheckpointWriter)."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._plan: _Plan | None = None
        self._targets: dict[tuple[Key, ...], TargetArray] = {}
        self._tag = ""
        self._state = "new"
        self._lock = threading.Lock()

    # -- protocol ----------------------------------------------------------------
    def begin(self, plan: WritePlan) -> None:
        if self._state != "new":
            raise UniversalWriteError("begin() called twice")
        if plan.process_count != 1:
            raise UsageError("a universal checkpoint is written by one process")
        step, tag = _open_source(plan)
        leaves, _ = ds.step_leaves(step)
        _check_plan(plan, leaves, step.storage.url)
        keys_of = {leaf.name: tuple(leaf.keys) for leaf in leaves}
        self._tag = tag + OUT_SUFFIX
        self._plan = plan_files(step, keys_of, self._tag)
        self._targets = {tuple(t.keys): t for t in plan.arrays()}
        for f in self._plan.files:
            for s in f.sources:
                if isinstance(s, _FromPlan):
                    t = self._targets.get(s.keys)
                    if t is None or math.prod(t.shape) * dtypes.get(t.dtype).itemsize != s.nbytes:
                        raise UniversalWriteError(f"{'/'.join(map(str, s.keys))}: the plan does not hold it as "
                                                  "the universal file needs it", step.storage.url)
        self._state = "writing"

    def write_array(self, target: TargetArray, chunk_index: int, region: Region, data: np.ndarray) -> None:
        if self._state != "writing":
            raise UniversalWriteError(f"writer is {self._state}")
        assert self._plan is not None
        f = self._plan.by_keys.get(tuple(target.keys))
        if f is None:
            raise UniversalWriteError("write_array for an array no universal file takes", target.path)
        index = next(i for i, s in enumerate(f.sources) if isinstance(s, _FromPlan) and s.keys == tuple(target.keys))
        dt = dtypes.get(target.dtype)
        arr = np.ascontiguousarray(data)
        if arr.dtype != dt.numpy or tuple(arr.shape) != tuple(r.stop - r.start for r in region):
            raise UniversalWriteError(f"chunk data is {arr.dtype}{list(arr.shape)}, expected {dt.name}", target.path)
        if arr.dtype.byteorder == ">":
            arr = arr.byteswap().view(arr.dtype.newbyteorder("<"))
        flat = arr.reshape(-1).view(np.uint8)
        base = f.archive.offsets[index]
        pos = 0
        self._open(f)
        for offset, length in byte_runs(tuple(target.shape), region, dt.itemsize):
            piece = flat[pos: pos + length]
            self._put(f, base + offset, piece)
            crc = crc32(piece)
            with f.lock:
                whole = f.tiles[index].add(offset, offset + length, crc)
                if whole is not None:
                    f.crcs[index] = whole
            pos += length
        with f.lock:
            f.remaining -= pos
            if f.remaining < 0:
                raise UniversalWriteError(f"more bytes written than {f.path} holds (a chunk written twice?)", target.path)
            complete = f.remaining == 0 and all(c is not None for c in f.crcs)
        if complete:
            self._finish_file(f)

    def write_value(self, target: TargetValue) -> None:
        # values are in the files copied or re-saved from the source (model states, optimizer_state.pt)
        if self._state != "writing":
            raise UniversalWriteError(f"writer is {self._state}")

    def finish_process(self) -> None:
        if self._state != "writing":
            raise UniversalWriteError(f"writer is {self._state}")
        assert self._plan is not None
        for f in self._plan.files:
            if any(isinstance(s, _FromPlan) for s in f.sources):
                if not f.done and not f.remaining and all(c is not None for c in f.crcs):
                    self._open(f)  # a file of empty tensors: no chunk ever came
                    self._finish_file(f)
                continue
            self._open(f)
            for i, s in enumerate(f.sources):
                f.crcs[i] = self._copy_source(f, i, s)
            self._finish_file(f)
        for archive, path in self._plan.copies:
            self._copy_file(archive, path)
        unfinished = [f.path for f in self._plan.files if not f.done]
        if unfinished:
            raise IncompleteCheckpointError(f"{unfinished[0]} was not written whole"
                                            + (f" (and {len(unfinished) - 1} more)" if len(unfinished) > 1 else ""),
                                            self._storage.url)
        self._state = "finished"

    def commit(self) -> None:
        if self._state != "finished":
            raise UniversalWriteError(f"writer is {self._state}, expected finished")
        # last: what names the step to DeepSpeed's load (ds_to_universal writes it without a newline)
        self._storage.write(u.LATEST, self._tag.encode("utf-8"))
        self._state = "committed"

    def abort(self) -> None:
        files = self._plan.files if self._plan is not None else []
        for f in files:
            if f.local is not None:
                f.local.discard()
            f.data = None
        self._state = "aborted"

    # -- files ---------------------------------------------------------------------
    def _open(self, f: _File) -> None:
        with f.lock:
            if f.local is not None or f.data is not None:
                return
            local = self._storage.create_local_file(f.path)
            if local is None:
                f.data = bytearray(f.archive.length)
            else:
                f.local = local

    def _put(self, f: _File, offset: int, view: np.ndarray | bytes) -> None:
        if f.local is not None:
            f.local.write_span(offset, view)
        else:
            assert f.data is not None
            mv = (view.data if isinstance(view, np.ndarray) else memoryview(view)).cast("B")
            f.data[offset: offset + mv.nbytes] = mv

    def _finish_file(self, f: _File) -> None:
        with f.lock:
            if f.done:
                return
            f.done = True
        for offset, data in f.archive.records([c or 0 for c in f.crcs]):
            self._put(f, offset, data)
        if f.local is not None:
            f.local.close()
        elif f.data is not None:
            whole, f.data = f.data, None
            self._storage.write(f.path, whole)

    def _copy_source(self, f: _File, index: int, s: Source) -> int:
        """Write a storage that comes from the source's files; its CRC-32."""
        base = f.archive.offsets[index]
        crc = 0
        if isinstance(s, _Copy):
            member = s.archive.member(s.key)
            if member.data_length != s.nbytes:
                raise CorruptMetadataError(f"storage {s.key} holds {member.data_length} bytes, its pickle says {s.nbytes}",
                                           s.archive.where)
            buf = np.empty(min(_COPY_BYTES, max(s.nbytes, 1)), dtype=np.uint8)
            at = 0
            while at < s.nbytes:
                n = min(len(buf), s.nbytes - at)
                view = buf[:n]
                s.archive.fetch_into(member.data_offset + at, view)
                crc = crc32(view, crc)
                self._put(f, base + at, view)
                at += n
            if member.data_crc and crc != member.data_crc:
                raise CorruptMetadataError(f"storage {s.key}: tensor data fails its CRC-32 check", s.archive.where)
            return crc
        assert isinstance(s, _Cast)
        reader = ts.TensorReader(s.archive, s.ref, s.ref.storage.key)
        shape = tuple(s.ref.size)
        if not shape or s.order == tuple(range(len(shape))):
            # contiguous: bands of whole rows, each one run
            grid = default_grid(shape, 4, _COPY_BYTES) if shape else ()
            at = 0
            for c in stored_chunks(shape, RegularGrid(grid)) if shape else [None]:
                region = c.region if c is not None else ()
                out = np.ascontiguousarray(reader(region).astype(np.float32)).reshape(-1).view(np.uint8)
                crc = crc32(out, crc)
                self._put(f, base + at, out)
                at += out.nbytes
            return crc
        # dense but permuted: the tensor whole, in its storage order
        full = reader(tuple(slice(0, n) for n in shape)).astype(np.float32)
        out = np.ascontiguousarray(np.transpose(full, s.order)).reshape(-1).view(np.uint8)
        self._put(f, base, out)
        return crc32(out)

    def _copy_file(self, archive: ts.Archive, path: str) -> None:
        """A model-states file copied byte for byte (ds_to_universal's shutil.copy2)."""
        size = archive.size
        local = self._storage.create_local_file(path)
        if local is None:
            self._storage.write(path, archive.fetch(0, size))
            return
        try:
            buf = np.empty(min(_COPY_BYTES, max(size, 1)), dtype=np.uint8)
            at = 0
            while at < size:
                n = min(len(buf), size - at)
                archive.fetch_into(at, buf[:n])
                local.write_at(at, [buf[:n]], padded=False)
                at += n
            local.close()
        except BaseException:
            local.discard()
            raise


def _open_source(plan: WritePlan) -> tuple[ds.Step, str]:
    """The ZeRO step the plan was made from (the writer copies and re-saves some of its files)."""
    source = plan.info.get("source")
    layout = plan.info.get("source_layout") or {}
    if not source or plan.info.get("source_format") != ds.NAME:
        raise UniversalWriteError("a universal checkpoint is written from a DeepSpeed ZeRO checkpoint")
    if layout.get("weights", "fp32") != "fp32":
        raise UniversalWriteError("--weights module: a universal checkpoint holds the fp32 master weights, as "
                                  "ds_to_universal writes them (convert without --weights)")
    storage = Storage.open(str(source))
    step_dir = layout.get("step_dir")
    step = ds.open_step(storage.child(step_dir) if step_dir else storage)
    if step.files.layers or step.files.experts:
        raise UniversalWriteError("a pipeline-parallel or MoE ZeRO checkpoint: ds_to_universal's layout for their "
                                  "stages and experts is not written yet (ckpt reads and converts them to the other "
                                  "formats)")
    if step.missing_files:
        raise IncompleteCheckpointError(f"{step.missing_files[0]} does not exist", step.storage.url)
    tag = str(layout.get("tag") or step.storage.url.rstrip("/").rsplit("/", 1)[-1])
    return step, tag


def _check_plan(plan: WritePlan, leaves: list[Any], where: str) -> None:
    """The plan is the source's whole tree, unchanged: the universal files are the checkpoint's."""
    cast = [t.path for t in plan.arrays() if t.source_dtype]
    if cast:
        raise UniversalWriteError("--dtype: a universal checkpoint keeps the fp32 master weights and Adam moments as "
                                  "DeepSpeed saved them", where)
    want = [tuple(leaf.keys) for leaf in leaves]
    have = [tuple(t.keys) for t in plan.targets]
    missing, extra = [k for k in want if k not in set(have)], [k for k in have if k not in set(want)]
    if missing or extra:
        what = "/".join(map(str, (missing or extra)[0]))
        raise UnsupportedLeafError(
            "a universal checkpoint holds the whole ZeRO checkpoint as ds_to_universal writes it: --select, "
            f"--exclude, --rename and --unstack cannot {'leave out' if missing else 'add'} {what}"
            + (f" (and {len(missing or extra) - 1} more)" if len(missing or extra) > 1 else ""), where)


# -- what the engine asks the format (core/write_plan.py) ---------------------------------------

TUPLES_AS_VALUES = False
# what a convert writes at DST's top level: the pointer, written last (what DeepSpeed's load reads
# first: on an object store the commit), and the step directory it names ("<tag>_universal")
OUTPUT_ENTRIES = (u.LATEST, "*_universal")
COMMIT_MARKERS = (u.LATEST,)


def make_writer(storage: Storage, **_: Any) -> UniversalWriter:
    return UniversalWriter(storage)


def keeps_source_chunks(leaf: Any) -> bool:
    return False


def streamed(leaf: Any) -> bool:
    """Whether a leaf's data goes to a universal file through the engine: a trained parameter's fp32
    weights and its per-element optimizer state (the rest is copied or re-saved from the source)."""
    extra = getattr(leaf, "extra", {}) or {}
    kind = extra.get("kind")
    return (kind == "parameter" and "tied_to" not in extra) or (kind == "optimizer state" and "files" in extra)


def target_layout(leaf: Any, itemsize: int, cap: int | None, cap_bytes: int) -> RegularGrid | ChunkList:
    """Bands of whole rows (each one byte range of its file); no chunk at all for a leaf the
    universal files take from the source's own files (buffers, frozen and tied names, the step)."""
    if not streamed(leaf):
        return ChunkList(())
    return RegularGrid(default_grid(tuple(leaf.shape), itemsize, cap_bytes))


def plan_value(ctx: PlanContext, keys: tuple[Key, ...], name: str, value: Any, source_path: str) -> None:
    """A value of the source: written as the source's files hold it (copied or re-saved)."""
    ctx.add_value(TargetValue(keys, name, None, "object"))

"""DeepSpeed ZeRO checkpoints, consolidated as zero_to_fp32 does, read without DeepSpeed or torch.

What `engine.save_checkpoint(save_dir)` writes (DeepSpeed 0.19, runtime/engine.py):

    save_dir/latest                     the tag, e.g. "global_step2" (written last, by global rank 0)
    save_dir/global_step2/              one directory per tag
      mp_rank_00_model_states.pt        stages 1/2: the module's state dict ("module", in the training
                                        dtype), "buffer_names", "param_shapes" (per optimizer group, an
                                        ordered {name: torch.Size} of the trained parameters), "shared_params"
                                        ({tied name: the name holding the data}), "frozen_param_shapes" /
                                        "frozen_param_fragments" (stage >= 2: parameters the optimizer does not
                                        own, whole), lr_scheduler, global_steps, ds_config, ..., client state
      zero_pp_rank_{r}_mp_rank_00_model_states.pt
                                        stage 3, one per data-parallel rank: the same, but "module" holds
                                        empty placeholders and each rank's frozen_param_fragments its partition
      [bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt
                                        one per data-parallel rank: {"optimizer_state_dict": ..., "ds_config",
                                        "ds_version"} (the bf16_ prefix when bf16 training; fp32 and fp16
                                        training have none, fp16's holds a DynamicLossScaler)
    save_dir/zero_to_fp32.py, zero_to_torch.py   the recovery scripts (not read)

The optimizer-states file (runtime/zero/stage_1_and_2.py and stage3.py, `state_dict`) holds the
fp32 master weights as flat partitions and the base optimizer's state for them:

  * stages 1 and 2 (DeepSpeedZeroOptimizer): per parameter group, the trained parameters (in
    `param_shapes` order: DeepSpeed's round-robin order, which is the flat order) are flattened
    into one vector, each parameter followed by `param_alignment_paddings[g][i]` zeros (0 unless
    parameter alignment is on), and the vector padded at its end to a multiple of 2 x DP degree
    (`nccl_start_alignment_factor` x DP); it is cut into DP equal partitions of P elements, rank r
    owning [r*P, (r+1)*P). `single_partition_of_fp32_groups[g]` is rank r's partition WITHOUT the
    end padding (`group_paddings[g]` elements, so only the last ranks' are shorter; torch.save
    keeps the whole storage: the tensor is a view of its first P - padding elements). The base
    optimizer (torch Adam) steps one flat tensor per group: its `state[i]` (i from
    `param_groups[g]["params"]`) holds exp_avg / exp_avg_sq of P elements, laid out as the
    partition, and the group's 0-d `step`. `zero_stage`, `partition_count` (per group),
    `param_slice_mappings` (per group, each parameter's {start, numel} in this rank's partition),
    and the loss scaler (a `LossScaler` object) complete it. DeepSpeed classes in these pickles
    (LossScaler, ZeroStageEnum, fragment_address) are admitted by name as data
    (ckpt_tool/machinery/torch_save/safe_pickle.py), never imported.
  * stage 3 (DeepSpeedZeroOptimizer_Stage3): every parameter is partitioned on its own: padded to
    a multiple of DP, rank r holds its elements [r*n, (r+1)*n) with n = ceil(numel / DP).
    `fp32_flat_groups[g]` is rank r's partitions of the parameters of sub-group g, back to back,
    in `param_shapes` order; all ranks' groups have equal lengths. The base optimizer's state
    (`optimizer_state_dict`) has one flat entry per sub-group, laid out the same way.

zero_to_fp32's `get_fp32_state_dict_from_zero_checkpoint` (utils/zero_to_fp32.py) loads every
rank's partitions into memory at once and concatenates them. Here each parameter is a leaf of
its full shape whose reader (FlatReader) knows its pieces (layout.py: which rank's flat tensor
holds which run of its elements) and reads, for any region, only the bytes of those runs: a
region of rows is a few contiguous byte ranges, one per rank it spans. The scheduler reads big
parameters band by band within --memory (`reads_byte_ranges`). Only the zip directories and
pickles of the files are read to open a checkpoint.

The consolidated tree, as zero_to_fp32 orders it: the buffers (floating ones as float32, as
zero_to_fp32 casts them), the frozen parameters (stage >= 2, as stored), the trained parameters
(their fp32 master weights), then each tied name (`shared_params`) as another leaf on the same
data. Keys are the names split at their dots (`layers.0.up.weight` -> layers/0/up/weight), names
are zero_to_fp32's. Beside them:

  * `optimizer/state/<name>/<key>`: the base optimizer's per-element state (every flat tensor of
    the partition's length, as DeepSpeed's own `safe_get_full_optimizer_state` takes them:
    exp_avg, exp_avg_sq) as the parameter's logical tensors, assembled like the weights, and its
    group's other entries (`step`, a 0-d tensor);
  * `optimizer/param_groups`: the groups' hyper-parameters, each group's `params` naming its
    parameters (as torch's get_optimizer_state_dict does) rather than DeepSpeed's flat index;
  * `optimizer/loss_scaler`, `dynamic_loss_scale`, `overflow`, `clip_grad`: rank 0's ZeRO
    optimizer entries that are the run's (OPTIMIZER_GLOBALS), as values;
  * `engine/...`: everything else the model-states file records (global_steps, global_samples,
    lr_scheduler, ds_config, ds_version, the parallel degrees, client state), as values.

`--weights module` (read(weights="module"), a reader option the registry declares): the model part
is the module state dict of mp_rank_00_model_states.pt instead (stages 1/2: the training-dtype
weights, whole); stage 3 saves 0-element placeholders there and is refused. A pipeline step's
module is its layer files (pipeline.py), an MoE step's experts are in the expert files (moe.py).

Pipeline-parallel steps (`layer_XX-...-model_states.pt` files, one mp_rank per stage) are opened
stage by stage by pipeline.py (opening.open_leaves dispatches); MoE expert groups (`"moe": True` in the
param groups, partitioned over the expert data-parallel ranks) are laid out by moe.py (open_step
calls it). Not read yet (refused by name): several tensor-parallel ranks (mp_rank_01... without
layer files, layer_XX-model_01-...), MoE without ZeRO (expp_rank_X_... optimizer files), stage-3
checkpoints of the AutoEP partition-native format (sub-groups partitioned over expert replica
groups, `ds_zero_partition_groups`). zero_to_fp32 reads none of these either.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ...core.contract import ArrayReader
from ...base import dtypes
from ...base.errors import CkptError, CorruptMetadataError, NotFoundError, UsageError, short_repr
from ...core.model import ArrayLeaf, Checkpoint, Key, Leaf, Region, StepInfo, ValueLeaf
from ...storage import Storage
from ...machinery.torch_save import safe_pickle
from ...machinery.torch_save.safe_pickle import Size, TensorRef
from ...base.text import is_ascii_number
from ...machinery.torch_save import reading as ts
from . import layout as L
from . import moe
from .layout import array_leaf as _array

NAME = "deepspeed"
LATEST = "latest"
STEP_DIR = re.compile(r"^global_step(\d+)$")
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(?P<dp>\d+)_)?mp_rank_(?P<mp>\d+)_model_states\.pt$")
OPTIM_FILE = re.compile(r"^(?P<bf16>bf16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
# pipeline parallel: one file per layer (PipelineModule.ckpt_layer_path; "-model_YY" with a model axis)
PIPE_FILE = re.compile(r"^layer_(?P<layer>\d+)-(?:model_(?P<tp>\d+)-)?model_states\.pt$")
# MoE: one file per expert (engine._get_expert_ckpt_name); without ZeRO, expp_rank_X optimizer files
EXPERT_FILE = re.compile(r"^(?:layer_(?P<layer>\d+)_)?expert_(?P<expert>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
EXPP_FILE = re.compile(r"^expp_rank_\d+_mp_rank_\d+_optim_states\.pt$")
MAX_LATEST_BYTES = 4096
# keys of the model-states file that the consolidation consumes (not shown as engine state)
CONSUMED = ("module", "buffer_names", "param_shapes", "shared_params", "frozen_param_shapes",
            "frozen_param_fragments", "optimizer")
OPTIMIZER_KEY = "optimizer"
# the ZeRO optimizer-state entries shown as optimizer/<key> (the others are per-rank layout, or the header's)
OPTIMIZER_GLOBALS = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad")
ENGINE_KEY = "engine"
# at most this many sub-directories are listed to find the steps of a root
_MAX_STEP_DIRS = 256


# ---------------------------------------------------------------------------
# Detection: a step directory, or a root holding `latest` / global_stepN step directories
# ---------------------------------------------------------------------------
def is_step_listing(files: list[str]) -> bool:
    """Model states and ZeRO optimizer states side by side (a listing, nothing read)."""
    return any(MODEL_FILE.match(f) for f in files) and any(OPTIM_FILE.match(f) for f in files)


def _step_candidates(storage: Storage, dirs: list[str], files: list[str]) -> list[str]:
    named = [d for d in dirs if STEP_DIR.match(d)]
    tag = _latest_tag(storage) if LATEST in files else None
    if tag is not None and tag in dirs and tag not in named:
        named.append(tag)
    return named


def detect(storage: Storage) -> bool:
    dirs, files = storage.listdir()
    if is_step_listing(files):
        return True
    if LATEST not in files and not any(STEP_DIR.match(d) for d in dirs):
        return False
    for d in sorted(_step_candidates(storage, dirs, files), key=_step_order)[-4:]:
        try:
            if is_step_listing(storage.child(d).listdir()[1]):
                return True
        except CkptError:
            continue
    return False


def _step_order(name: str) -> tuple[int, str]:
    m = STEP_DIR.match(name)
    return (int(m.group(1)), name) if m else (-1, name)


def _latest_tag(storage: Storage) -> str | None:
    """`latest`'s tag, or None when it does not read as one (validate says why: latest_problem)."""
    tag, problem = read_latest(storage)
    return None if problem else tag


def read_latest(storage: Storage) -> tuple[str | None, str | None]:
    """(tag, None) or (None, what is wrong with `latest`): DeepSpeed writes the tag alone
    (load_checkpoint strips it); a tag is a directory name beside it."""
    return read_tag(storage, LATEST, "DeepSpeed writes the tag alone")


def read_tag(storage: Storage, name: str, writes: str) -> tuple[str | None, str | None]:
    """(tag, None) or (None, what is wrong) for a tag file `name` (`latest`, `latest_universal`):
    a directory name beside it, stripped as DeepSpeed's engine strips it; `writes` says what its
    writer puts there, for the message about an oversized one."""
    try:
        size = storage.size(name)
        if size > MAX_LATEST_BYTES:
            return None, f"{size} bytes: not a tag ({writes})"
        raw = storage.read(name)
    except NotFoundError:
        return None, "does not exist"
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, "not UTF-8 text: not a tag"
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag or any(ord(c) < 32 for c in tag):
        return None, f"{tag[:60]!r} is not a tag (a directory name)"
    return tag, None


# ---------------------------------------------------------------------------
# The files of one step directory
# ---------------------------------------------------------------------------
@dataclass
class StepFiles:
    model: dict[int, str]  # dp rank -> model-states file (stages 1/2: only rank 0's, as "mp_rank_00_...")
    optim: dict[int, str]  # dp rank -> optimizer-states file
    bf16_prefix: bool
    other: list[str]  # files not read
    refused: list[str]  # files of layouts not read yet (model parallel without pipeline, expp_rank files)
    mp: int = 0  # the model-parallel rank (pipeline stage) `model` and `optim` are of
    # every model-parallel rank's files: mp -> (model, optim) as above (pipeline stages: pipeline.py)
    stages: dict[int, tuple[dict[int, str], dict[int, str]]] = field(default_factory=dict)
    layers: dict[int, str] = field(default_factory=dict)  # pipeline layer index -> its file
    experts: dict[tuple[int, int], str] = field(default_factory=dict)  # (MoE layer, expert) -> its file

    def all_files(self) -> list[str]:
        """Every file of the checkpoint ckpt reads (each stage's, each layer's and expert's)."""
        out = [f for model, optim in self.stages.values() for f in (*model.values(), *optim.values())]
        return out + list(self.layers.values()) + list(self.experts.values())


def scan_step(storage: Storage, mp: int = 0) -> StepFiles:
    _, files = storage.listdir()
    stages: dict[int, tuple[dict[int, str], dict[int, str]]] = {}
    other: list[str] = []
    refused: list[str] = []
    layers: dict[int, str] = {}
    experts: dict[tuple[int, int], str] = {}
    bf16 = False
    for f in sorted(files):
        m, o, p, e = MODEL_FILE.match(f), OPTIM_FILE.match(f), PIPE_FILE.match(f), EXPERT_FILE.match(f)
        if m:
            stages.setdefault(int(m.group("mp")), ({}, {}))[0][int(m.group("dp")) if m.group("dp") is not None
                                                             else -1] = f
        elif o:
            stages.setdefault(int(o.group("mp")), ({}, {}))[1][int(o.group("dp"))] = f
            bf16 = bf16 or bool(o.group("bf16"))
        elif p and int(p.group("tp") or 0) == 0:
            layers[int(p.group("layer"))] = f
        elif e and int(e.group("mp")) == 0 and e.group("layer") is not None:
            experts[(int(e.group("layer")), int(e.group("expert")))] = f
        elif p or e or EXPP_FILE.match(f):
            refused.append(f)
        else:
            other.append(f)
    if not layers:  # several model-parallel ranks without pipeline layer files: tensor parallel
        refused.extend(f for r, (model, optim) in sorted(stages.items()) if r != 0
                       for f in (*model.values(), *optim.values()))
        stages = {r: v for r, v in stages.items() if r == 0}
    model, optim = stages.get(mp, ({}, {}))
    return StepFiles(model, optim, bf16, other, sorted(refused), mp, stages, layers, experts)


def _refusal(files: StepFiles, where: str) -> CkptError | None:
    if not files.refused:
        return None
    shown = ", ".join(files.refused[:3]) + (" ..." if len(files.refused) > 3 else "")
    if any(PIPE_FILE.match(f) for f in files.refused):
        what = "a pipeline-parallel checkpoint with tensor parallelism (layer_XX-model_YY-model_states.pt, YY > 0)"
    elif any(EXPP_FILE.match(f) for f in files.refused):
        what = "MoE expert optimizer states of training without ZeRO (expp_rank_X_mp_rank_YY_optim_states.pt)"
    elif any(EXPERT_FILE.match(f) for f in files.refused):
        what = "a checkpoint with MoE expert files of an old or model-parallel layout"
    else:
        what = "a checkpoint of several model-parallel ranks"
    return CorruptMetadataError(f"{what}: ckpt reads ZeRO checkpoints of one tensor-parallel rank (pipeline "
                                f"stages and MoE experts included) so far ({shown})", where)


# ---------------------------------------------------------------------------
# Reading parameters from pieces of flat tensors
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """A piece of a parameter and the flat tensor (in one archive) holding it."""

    archive: ts.Archive | None  # None: its file is missing
    ref: TensorRef | None
    piece: L.Piece
    file: str


class CrcBook:
    """The CRC-32 of each flat storage member, put together from the runs the readers read.

    torch.load checks every member's CRC-32; the runs of one member are read apart (by several
    parameters, in bands), so their CRC-32s are tiled (checksum.CrcTiling) into the member's and
    checked once they cover it. The elements no parameter reads (DeepSpeed's padding: a group's
    end, a stage-3 partition's tail) are read once, when the member is first met, and tiled in
    too; a member with more than _MAX_GAPS such runs is left to --deep (check_deep streams it).
    """

    _MAX_GAPS = 64

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._runs: dict[tuple[int, str], list[tuple[int, int]]] = {}  # (archive, key) -> element runs read
        self._archives: dict[int, ts.Archive] = {}
        self._tiles: dict[tuple[int, str], Any] = {}
        self._done: set[tuple[int, str]] = set()

    def expect(self, archive: ts.Archive, ref: TensorRef, start: int, count: int) -> None:
        """A reader will read elements [start, start + count) of `ref` (in the storage: plus its offset)."""
        first = ref.storage_offset + start
        self._runs.setdefault((id(archive), ref.storage.key), []).append((first, first + count))
        self._archives[id(archive)] = archive

    def forget(self, archive: ts.Archive, ref: TensorRef, start: int, count: int) -> None:
        """A reader made but not given (a pipeline stage's copy of a tied parameter): its run is then
        read as a gap, so the member's CRC-32 is still put together."""
        first = ref.storage_offset + start
        runs = self._runs.get((id(archive), ref.storage.key), [])
        if (first, first + count) in runs:
            runs.remove((first, first + count))

    def seen(self, archive: ts.Archive, ref: TensorRef, begin: int, end: int, crc: int) -> None:
        """Bytes [begin, end) of the archive, of `ref`'s storage member, were read; their CRC-32."""
        key = (id(archive), ref.storage.key)
        with self._lock:
            if key in self._done:
                return
            tiles = self._tiles.get(key)
        if tiles is None:
            tiles = self._start(archive, ref, key)
            if tiles is None:
                return
        with self._lock:
            if key in self._done:
                return
            whole = tiles.add(begin, end, crc)
            if whole is None:
                return
            self._done.add(key)
            member = archive.member(ref.storage.key)
        if whole != member.data_crc:
            raise CorruptMetadataError(f"storage {ref.storage.key}: tensor data fails its CRC-32 check", archive.where)
        with archive._lock:  # (--deep then does not stream it again)
            archive.crc_checked.add(ref.storage.key)

    def _start(self, archive: ts.Archive, ref: TensorRef, key: tuple[int, str]) -> Any:
        from ...base.checksum import CrcTiling, crc32

        member = archive.member(ref.storage.key)
        itemsize = dtypes.get(ref.dtype).itemsize
        if not member.data_crc or member.data_length % itemsize:
            with self._lock:
                self._done.add(key)
            return None
        gaps, at = [], 0
        for lo, hi in sorted(self._runs.get(key, [])):
            if lo > at:
                gaps.append((at, lo))
            at = max(at, hi)
        if at < member.data_length // itemsize:
            gaps.append((at, member.data_length // itemsize))
        if len(gaps) > self._MAX_GAPS:
            with self._lock:
                self._done.add(key)
            return None
        tiles = CrcTiling(member.data_offset, member.data_offset + member.data_length)
        for lo, hi in gaps:
            begin, end = member.data_offset + lo * itemsize, member.data_offset + hi * itemsize
            tiles.add(begin, end, crc32(archive.fetch(begin, end)))
        with self._lock:
            return self._tiles.setdefault(key, tiles)


class FlatReader(ArrayReader):
    """Reads a region of a parameter assembled from runs of flat 1-d tensors in several archives.

    For a region, the span of the parameter's elements from its first to its last element (C
    order) is read piece by piece: each piece overlapping it is one byte range of one rank's
    partition, read straight into the span's buffer; the region is then cut out of the span. A
    band of whole rows (what the scheduler streams) is its own span, so nothing else is read.
    """

    reads_byte_ranges = True

    def __init__(self, name: str, shape: tuple[int, ...], dtype: str, sources: list[Source],
                 book: CrcBook | None = None) -> None:
        self._name = name
        self._shape = shape
        self._stored = dtype
        self._sources = sorted(sources, key=lambda s: s.piece.at)
        self._strides = _c_strides(shape)
        self._book = book
        if book is not None:
            for src in self._sources:
                if src.archive is not None and src.ref is not None:
                    book.expect(src.archive, src.ref, src.piece.start, src.piece.count)

    def __call__(self, region: Region) -> np.ndarray:
        out_shape = tuple(r.stop - r.start for r in region)
        dtype = dtypes.numpy_dtype(self._stored)
        if any(n == 0 for n in out_shape):
            return np.empty(out_shape, dtype=dtype)
        first = sum(r.start * s for r, s in zip(region, self._strides))
        last = sum((r.stop - 1) * s for r, s in zip(region, self._strides))
        span = np.empty(last + 1 - first, dtype=dtype)
        covered = 0
        for src in self._sources:
            p = src.piece
            lo, hi = max(first, p.at), min(last + 1, p.at + p.count)
            if lo >= hi:
                continue
            self._read_run(src, p.start + (lo - p.at), span[lo - first: hi - first])
            covered += hi - lo
        if covered != span.size:
            raise CorruptMetadataError(f"{self._name}: the partitions hold {covered} of the {span.size} elements "
                                       "asked for", None)
        if span.size == math.prod(out_shape):
            out = span.reshape(out_shape)
        else:
            view = np.lib.stride_tricks.as_strided(
                span.view(np.dtype(f"V{dtype.itemsize}")), shape=out_shape,
                strides=tuple(s * dtype.itemsize for s in self._strides), writeable=False)
            out = np.array(view, copy=True).view(dtype)
        return out

    def _read_run(self, src: Source, start: int, into: np.ndarray) -> None:
        if src.archive is None or src.ref is None:
            raise NotFoundError(f"{self._name}: its elements on this rank are in {src.file}, which does not exist",
                                None)
        payload = src.archive.payload(src.ref)  # the tensor's claim on its storage checked there
        if payload.shape != (payload.shape[0],) or payload.stride[0] != 1:
            raise CorruptMetadataError(f"a flat partition of shape {list(payload.shape)} and stride "
                                       f"{list(payload.stride)}: DeepSpeed's are 1-d", src.archive.where)
        if start + into.size > payload.shape[0]:
            raise CorruptMetadataError(f"{self._name}: elements [{start}, {start + into.size}) of a flat partition "
                                       f"of {payload.shape[0]}", src.archive.where)
        offset = payload.data_offset + (payload.storage_offset + start) * payload.itemsize
        raw = into.view(np.uint8)
        src.archive.fetch_into(offset, raw)
        if self._book is not None and payload.data_crc:
            from ...base.checksum import crc32

            self._book.seen(src.archive, src.ref, offset, offset + raw.size, crc32(raw))
        if payload.big_endian and into.dtype.itemsize > 1:
            into[...] = into.byteswap()

    def verify(self, index: int) -> None:
        """validate --deep: the CRC-32 of every storage member this parameter is read from."""
        for src in self._sources:
            if src.archive is not None and src.ref is not None:
                src.archive.verify_member(src.ref.storage.key)

    @property
    def files(self) -> list[str]:
        return sorted({s.file for s in self._sources})


class CastReader(ArrayReader):
    """A tensor of one archive read by byte range (TensorReader), cast as zero_to_fp32 casts it."""

    reads_byte_ranges = True

    def __init__(self, inner: ts.TensorReader, cast: str) -> None:
        self._inner = inner
        self._cast = cast

    def __call__(self, region: Region) -> np.ndarray:
        return self._inner(region).astype(dtypes.numpy_dtype(self._cast))

    def verify(self, index: int) -> None:
        self._inner.verify(index)


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    n = 1
    for d in reversed(shape):
        out.append(n)
        n *= d
    return tuple(reversed(out))


# ---------------------------------------------------------------------------
# The recorded structures, checked as they are taken
# ---------------------------------------------------------------------------
def _dict(value: Any, what: str, where: str) -> dict:
    if not isinstance(value, dict):
        raise CorruptMetadataError(f"{what} is {type(value).__name__}, not a dict", where)
    return value


def _shape(value: Any, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, (Size, tuple, list)) or not all(type(d) is int and d >= 0 for d in value):
        raise CorruptMetadataError(f"{what}: shape {short_repr(value)} is not a tuple of sizes", where)
    return tuple(value)


def _param_shapes(states: dict, where: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    shapes = states.get("param_shapes")
    if not isinstance(shapes, list) or not shapes:
        raise CorruptMetadataError("no param_shapes (not a ZeRO model-states file)", where)
    out = []
    for g, group in enumerate(shapes):
        group = _dict(group, f"param_shapes[{g}]", where)
        out.append([(str(k), _shape(v, f"param_shapes[{g}][{k!r}]", where)) for k, v in group.items()])
    return out


def _tensor_list(value: Any, what: str, where: str) -> list[TensorRef]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, TensorRef) for t in value):
        raise CorruptMetadataError(f"{what} is not a list of tensors", where)
    for i, t in enumerate(value):
        if len(t.size) != 1:
            raise CorruptMetadataError(f"{what}[{i}] has shape {list(t.size)}: DeepSpeed's flat partitions are 1-d",
                                       where)
    return list(value)


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, (list, tuple)) and all(type(v) is int for v in value):
        return list(value)
    return None


@dataclass
class RankOptim:
    """One optimizer-states file: its archive and what the consolidation takes from it."""

    archive: ts.Archive
    stage: int
    flats: list[TensorRef]  # the fp32 partitions, one per group
    partition_count: int
    group_paddings: list[int] | None
    param_paddings: list[list[int]] | None
    base: dict  # the base optimizer's state_dict: {"state": {i: {...}}, "param_groups": [...]}
    loss_scaler: Any = None


def parse_optim(archive: ts.Archive) -> RankOptim:
    where = archive.where
    top = _dict(archive.obj, "the file's object", where)
    osd = _dict(top.get("optimizer_state_dict"), "optimizer_state_dict", where)
    stage = osd.get("zero_stage")
    if stage is None:
        raise CorruptMetadataError(
            "no zero_stage in optimizer_state_dict: not a ZeRO optimizer's (DeepSpeed's BF16_Optimizer, used for bf16 "
            "at stage 1 with fp32 gradient accumulation, writes this; zero_to_fp32 refuses it too)", where)
    if type(stage) not in (int, safe_pickle.DSZeroStage) or not 1 <= int(stage) <= 3:
        raise CorruptMetadataError(f"zero_stage {short_repr(stage)} is not 1, 2 or 3", where)
    stage = int(stage)
    count = osd.get("partition_count")
    counts = [count] if type(count) is int else _int_list(count)
    if not counts or any(c < 1 for c in counts):
        raise CorruptMetadataError(f"partition_count {short_repr(count)} is not a DP degree", where)
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    flats = _tensor_list(osd.get(key), key, where)
    base_key = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"
    base = osd.get(base_key)
    if isinstance(base, list):  # elastic checkpoint: per group its state, the step beside it
        base = {"state": {g: s for g, s in enumerate(base)}, "param_groups": [], "elastic_step":
                osd.get("base_optimizer_state_step")}
    base = _dict(base, base_key, where)
    paddings = osd.get("param_alignment_paddings")
    param_paddings = [p for p in (_int_list(x) for x in paddings)] if isinstance(paddings, list) else None
    if param_paddings is not None and any(p is None for p in param_paddings):
        raise CorruptMetadataError("param_alignment_paddings is not a list of int lists", where)
    return RankOptim(archive, stage, flats, max(counts), _int_list(osd.get("group_paddings")),
                     param_paddings, base, osd.get("loss_scaler"))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# One step directory as a checkpoint
# ---------------------------------------------------------------------------
@dataclass
class Step:
    """Everything read to open one step: the files, the parsed records, the mapping."""

    storage: Storage
    files: StepFiles
    states: dict  # rank 0's model states
    model_archives: dict[int, ts.Archive]
    optims: dict[int, RankOptim]
    stage: int
    world: int
    shapes: list[list[tuple[str, tuple[int, ...]]]]
    mapping: L.Mapping
    missing_files: list[str]  # rank files (names) that do not exist
    book: CrcBook  # the flat members' CRC-32s, from the runs read


def open_step(storage: Storage, *, strict_files: bool = False, files: StepFiles | None = None) -> Step:
    """Open a step directory: the model-states file(s) and every optimizer-states file (their zip
    directories and pickles; no tensor data). A rank's missing file is recorded, not an error.
    `files`: those of one model-parallel rank (a pipeline stage: pipeline.py), by default rank 0's."""
    files = files if files is not None else scan_step(storage)
    mp = files.mp
    refusal = _refusal(files, storage.url)
    if refusal is not None:
        raise refusal
    if not files.optim:
        raise CorruptMetadataError("no *_optim_states.pt files: not a ZeRO checkpoint", storage.url)
    optims: dict[int, RankOptim] = {r: parse_optim(ts.Archive(storage, f)) for r, f in sorted(files.optim.items())}
    first = next(iter(optims.values()))
    stage, world = first.stage, first.partition_count
    for r, o in optims.items():
        if o.stage != stage or o.partition_count != world:
            raise CorruptMetadataError(f"zero_stage {o.stage} / partition_count {o.partition_count}, but rank "
                                       f"{min(optims)}'s file says {stage} / {world}", o.archive.where)
    stray = sorted(r for r in optims if r >= world)
    if stray:
        raise CorruptMetadataError(f"optimizer states of rank {stray[0]}, but the DP degree (partition_count) is "
                                   f"{world}", storage.url)
    if stage == 3:
        for r, o in optims.items():
            _check_zero3_partition_groups(o, r, world)
    prefix = "bf16_" if files.bf16_prefix else ""
    missing = [f"{prefix}zero_pp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt" for r in range(world) if r not in optims]
    model_archives: dict[int, ts.Archive] = {}
    if stage == 3:
        names = {r: f for r, f in files.model.items() if r >= 0}
        if 0 not in names:
            raise NotFoundError(f"{_model_name(0, mp)} does not exist (stage 3 keeps the "
                                "parameter shapes there)", storage.url)
        model_archives = {r: ts.Archive(storage, f) for r, f in sorted(names.items()) if r < world}
        missing += [_model_name(r, mp) for r in range(world) if r not in model_archives]
    else:
        if -1 not in files.model:
            raise NotFoundError(f"mp_rank_{mp:02d}_model_states.pt does not exist (it keeps the parameter shapes)",
                                storage.url)
        model_archives = {0: ts.Archive(storage, files.model[-1])}
    states = _dict(model_archives[0].obj, "the model-states object", model_archives[0].where)
    shapes = _param_shapes(states, model_archives[0].where)
    sizes = [[(n, math.prod(s)) for n, s in group] for group in shapes]
    lengths, paddings = _lengths(optims, world, stage, sizes)
    if stage == 3:
        mapping = L.zero3([p for group in sizes for p in group], lengths)
    else:
        mapping = L.zero12(sizes, lengths, paddings, first.param_paddings)
    step = Step(storage, files, states, model_archives, optims, stage, world, shapes, mapping, missing, CrcBook())
    if stage != 3 and moe.has_expert_groups(step):
        moe.apply(step)  # expert groups: partitioned over the expert data-parallel ranks, experts renumbered
    return step


def _check_zero3_partition_groups(o: RankOptim, rank: int, world: int) -> None:
    """Stage 3 with AutoEP records, per sub-group, the ranks it is partitioned over
    (`ds_zero_partition_groups`): an expert sub-group is split over its expert replica group, not
    over every DP rank, so layout.zero3's rule (each parameter over all `world` ranks, rank r its
    r-th piece) would read it wrong. Refused, as zero_to_fp32 refuses it; a record that only
    restates the rule (every sub-group over all ranks, this file's rank) reads as usual."""
    osd = o.archive.obj.get("optimizer_state_dict") if isinstance(o.archive.obj, dict) else None
    groups = osd.get("ds_zero_partition_groups") if isinstance(osd, dict) else None
    if groups is None:
        return
    other = [g for g, entry in enumerate(groups if isinstance(groups, list) else [None])
             if not isinstance(entry, dict) or entry.get("partition_count") != world
             or entry.get("partition_rank") != rank]
    if other:
        raise CorruptMetadataError(
            f"ds_zero_partition_groups: sub-group {other[0]} is partitioned over other ranks than the {world} "
            "data-parallel ranks (AutoEP's ZeRO-3 partition-native layout): ckpt does not read it yet "
            "(zero_to_fp32 refuses it too)", o.archive.where)


def _lengths(optims: dict[int, RankOptim], world: int, stage: int,
             sizes: list[list[tuple[str, int]]]) -> tuple[list[list[int]], list[list[int]] | None]:
    """Each rank's flat partition lengths (a missing rank's as DeepSpeed would have written them,
    from the present ranks: its pieces are then named, and reported missing) and group paddings."""
    present = {r: [t.size[0] for t in o.flats] for r, o in optims.items()}
    pads = {r: p for r, o in optims.items() if (p := o.group_paddings) is not None and len(p) == len(present[r])}
    have_pads = len(pads) == len(optims)  # every rank's paddings, one per group
    lengths: list[list[int]] = []
    paddings: list[list[int]] = []
    some = next(iter(present))
    for r in range(world):
        if r in present:
            lengths.append(present[r])
            paddings.append(pads[r] if have_pads else [0] * len(present[r]))
        elif stage == 3:
            lengths.append(list(present[some]))
            paddings.append([0] * len(present[some]))
        else:
            # P per group, from a present rank; the missing rank's stored part ends where the groups' data does
            parts = [n + (pads[some][g] if have_pads else 0) for g, n in enumerate(present[some])]
            used = [sum(n for _, n in sizes[g]) if g < len(sizes) else 0 for g in range(len(parts))]
            stored = [max(0, min(p, used[g] - r * p)) for g, p in enumerate(parts)]
            lengths.append(stored)
            paddings.append([p - s for p, s in zip(parts, stored)])
    return lengths, (paddings if have_pads else None)


def _sources(step: Step, pieces: list[L.Piece], pick: Callable[[RankOptim, int], TensorRef | None]) -> list[Source]:
    out = []
    for p in pieces:
        o = step.optims.get(p.rank)
        ref = pick(o, p.group) if o is not None else None
        out.append(Source(o.archive if o is not None else None, ref, p,
                          o.archive.name if o is not None else _optim_name(step, p.rank)))
    return out


def _optim_name(step: Step, rank: int) -> str:
    prefix = "bf16_" if step.files.bf16_prefix else ""
    return f"{prefix}zero_pp_rank_{rank}_mp_rank_{step.files.mp:02d}_optim_states.pt"


def _model_name(rank: int, mp: int = 0) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_{mp:02d}_model_states.pt"


def _group_flats(o: RankOptim) -> list[list[Any]]:
    """Per parameter group of the base optimizer, the positions (0, 1, ...: the order of
    single_partition_of_fp32_groups / fp32_flat_groups, and of param_shapes) of the flat tensors
    it steps. Stages 1/2 give each group one flat tensor; stage 3 gives each group one per
    sub-group (sub_group_size cuts a group into several), appended to it in sub-group order
    (stage3.py, _set_fp32_optimizer_param_groups), so flat tensor g is the g-th of all the
    groups' `params` lists taken in order; torch numbers its state the same way."""
    groups = o.base.get("param_groups")
    out: list[list[Any]] = []
    at = 0
    for group in groups if isinstance(groups, list) else []:
        params = group.get("params") if isinstance(group, dict) else None
        n = len(params) if isinstance(params, list) else 0
        out.append(list(range(at, at + n)))
        at += n
    return out


def _group_state(o: RankOptim, g: int) -> dict:
    """The base optimizer's state for flat tensor g (the g-th entry of its param_groups' `params`,
    taken in order: at stage 3 a group lists one flat tensor per sub-group, so a group's index is
    not the flat tensor's; ds_to_universal reads `state[g]`, which torch numbered so)."""
    groups = o.base.get("param_groups")
    index: Any = g
    if isinstance(groups, list):
        params = [p for group in groups if isinstance(group, dict) and isinstance(group.get("params"), list)
                  for p in group["params"]]
        if g < len(params):
            index = params[g]
    state = o.base.get("state")
    entry = state.get(index) if isinstance(state, dict) else None
    return entry if isinstance(entry, dict) else {}


def _flat_length(step: Step, g: int) -> int:
    """A group's full partition length (P, or a stage-3 group's length): what a per-element
    optimizer state tensor is as long as (DeepSpeed's own test: value.shape == partition.shape)."""
    o = step.optims[min(step.optims)]
    n = o.flats[g].size[0] if g < len(o.flats) else -1
    if step.stage != 3 and o.group_paddings is not None and g < len(o.group_paddings):
        n += o.group_paddings[g]
    return n


def _split(name: str) -> tuple[Key, ...]:
    return tuple(name.split("."))


WEIGHTS = ("fp32", "module")


def _module_leaves(step: Step) -> list[tuple[str, ArrayLeaf]]:
    """--weights module: the module's state dict as mp_rank_00_model_states.pt holds it (stages 1/2:
    every parameter whole in the training dtype, the buffers, each tied name on its own entry), in
    its order. At stage 3 DeepSpeed saves only empty placeholders of the parameters there (each
    rank's "module"): the training-dtype weights were never written, so they are refused."""
    archive0 = step.model_archives[0]
    if step.stage == 3:
        raise UsageError("--weights module: a ZeRO-3 checkpoint's model-states files hold empty placeholders of the "
                         "parameters (DeepSpeed saves them partitioned, as fp32 master weights only): use --weights "
                         "fp32", archive0.where)
    module = step.states.get("module")
    if not isinstance(module, dict) or not module:
        raise CorruptMetadataError("--weights module: the model-states file holds no module state dict", archive0.where)
    out = []
    for name, ref in module.items():
        if isinstance(name, str) and isinstance(ref, TensorRef):
            reader = ts.TensorReader(archive0, ref, name)
            out.append((name, _array((), name, tuple(ref.size), ref.dtype, reader,
                                     {"file": archive0.name, "kind": "module"}, archive0.zip.claim_problem(ref))))
    return out + moe.expert_module_leaves(step)  # MoE: the experts' weights are in the expert files


def step_leaves(step: Step, weights: str = "fp32") -> tuple[list[Leaf], list[str]]:
    """The consolidated tree (see the module docstring) and notes; `weights` "module": the model
    part is the module's state dict as the model-states file holds it (_module_leaves)."""
    if weights not in WEIGHTS:
        raise UsageError(f"--weights {weights}: fp32 or module")
    if weights == "module":
        return _tree(step, _module_leaves(step), _trained_names(step),
                     [f"weights: the module's, as {step.model_archives[0].name} holds them (--weights module), "
                      "not the fp32 master weights"])
    states = step.states
    where = step.model_archives[0].where
    archive0 = step.model_archives[0]
    module = states.get("module")
    module = module if isinstance(module, dict) else {}
    notes: list[str] = []
    model: list[tuple[str, ArrayLeaf]] = []  # (name, leaf) in zero_to_fp32's order; keys set below

    # buffers, in the module's order (zero_to_fp32: {k: v for k, v in module.items() if k in buffer_names})
    buffer_names = states.get("buffer_names")
    buffer_names = [b for b in buffer_names if isinstance(b, str)] if isinstance(buffer_names, list) else []
    for name, ref in module.items():
        if name in buffer_names and isinstance(ref, TensorRef):
            floating = dtypes.get(ref.dtype).is_float
            inner = ts.TensorReader(archive0, ref, name)
            cast = "float32" if floating and ref.dtype != "float32" else None
            reader = CastReader(inner, cast) if cast else inner
            model.append((name, _array((), name, tuple(ref.size), cast or ref.dtype, reader,
                                       {"file": archive0.name, "kind": "buffer"},
                                       archive0.zip.claim_problem(ref))))

    # frozen parameters (stage >= 2): whole in the model states (stage 2), or partitioned (stage 3)
    frozen_shapes = states.get("frozen_param_shapes")
    if isinstance(frozen_shapes, dict) and frozen_shapes:
        fragments = states.get("frozen_param_fragments")
        fragments = fragments if isinstance(fragments, dict) else {}
        for name, shp in frozen_shapes.items():
            shape = _shape(shp, f"frozen_param_shapes[{name!r}]", where)
            leaf = _frozen_leaf(step, str(name), shape, fragments)
            if leaf is not None:
                model.append((str(name), leaf))

    # trained parameters: their fp32 master weights, from the flat partitions
    trained: list[str] = []
    for g, group in enumerate(step.shapes):
        for name, shape in group:
            pieces = step.mapping.pieces.get(name, [])
            flat_dtype = _flat_dtype(step, g)
            srcs = _sources(step, pieces, lambda o, gg: o.flats[gg] if gg < len(o.flats) else None)
            flat = FlatReader(name, shape, flat_dtype, srcs, step.book)
            extra = {"kind": "parameter", "group": g, "files": flat.files, "pieces": len(pieces)}
            model.append((name, _array((), name, shape, flat_dtype, flat, extra, _pieces_problem(step, name))))
            trained.append(name)

    # tied names: another leaf on the same data (zero_to_fp32: `if pair[1] in state_dict`)
    shared = states.get("shared_params")
    by_name = dict(model)
    if isinstance(shared, dict):
        for alias, target in shared.items():
            if isinstance(alias, str) and target in by_name:
                src = by_name[target]
                extra = dict(src.extra, tied_to=target)
                model.append((alias, _array((), alias, src.shape, src.dtype, src.reader, extra, src.unreadable)))
                notes.append(f"tied: {alias} is {target} (shared_params)")

    leaves, notes = _tree(step, model, trained, notes)

    # the module's parameters zero_to_fp32 does not give (frozen at stage 1: DeepSpeed keeps no fp32 copy)
    given = {leaf.name for leaf in leaves}
    left = [n for n, ref in module.items() if n not in given and n not in buffer_names and isinstance(ref, TensorRef)]
    if left:
        notes.append(f"in the module state but not consolidated (no fp32 copy saved; zero_to_fp32 leaves them out "
                     f"too): {', '.join(left[:6])}" + (" ..." if len(left) > 6 else ""))
    return leaves, notes


def _trained_names(step: Step) -> list[str]:
    return [name for group in step.shapes for name, _ in group]


def _tree(step: Step, model: list[tuple[str, ArrayLeaf]], trained: list[str],
          notes: list[str]) -> tuple[list[Leaf], list[str]]:
    """The model's leaves keyed by their names split at dots, then the optimizer's and the engine's."""
    where = step.model_archives[0].where
    leaves: list[Leaf] = []
    names = [n for n, _ in model]
    split = ts.split_keys([(n,) for n in names] + [(OPTIMIZER_KEY, "x"), (ENGINE_KEY, "x")])
    for (name, leaf), keys in zip(model, split[: len(model)] if split is not None else [(n,) for n in names]):
        leaf.keys = keys
        leaves.append(leaf)
    if split is None:
        notes.append("parameter names kept whole as keys (split at their dots they would collide)")
    if any(leaf.keys[0] in (OPTIMIZER_KEY, ENGINE_KEY) for leaf in leaves):
        raise CorruptMetadataError(f"a parameter named {OPTIMIZER_KEY!r} or {ENGINE_KEY!r} (ckpt keeps the "
                                   "optimizer state and the engine's state under those keys)", where)
    leaves.extend(_optimizer_leaves(step, trained))
    leaves.extend(_engine_leaves(step))
    return leaves, notes


def _flat_dtype(step: Step, g: int) -> str:
    o = step.optims[min(step.optims)]
    return o.flats[g].dtype if g < len(o.flats) else "float32"


def _pieces_problem(step: Step, name: str) -> str | None:
    pieces = step.mapping.pieces.get(name)
    if pieces is None:
        return "not in the flat partitions"
    numel = step.mapping.numel.get(name, 0)
    if sum(p.count for p in pieces) != numel:
        return f"the partitions hold {sum(p.count for p in pieces)} of its {numel} elements"
    for p in pieces:
        o = step.optims.get(p.rank)
        if o is None:
            continue
        if p.group >= len(o.flats):
            return f"rank {p.rank} has no flat partition for group {p.group}"
        problem = o.archive.zip.claim_problem(o.flats[p.group])
        if problem is not None:
            return problem
    return None


def _frozen_leaf(step: Step, name: str, shape: tuple[int, ...], fragments: dict) -> ArrayLeaf | None:
    numel = math.prod(shape)
    if step.stage != 3:
        ref = fragments.get(name)
        if not isinstance(ref, TensorRef):
            return None  # zero_to_fp32 would fail on it: validate says so
        archive = step.model_archives[0]
        reader = ts.TensorReader(archive, ref, name)
        return _array((), name, tuple(ref.size), ref.dtype, reader, {"file": archive.name, "kind": "frozen"},
                      archive.zip.claim_problem(ref))
    refs: dict[int, TensorRef] = {}
    for r, archive in step.model_archives.items():
        frag = archive.obj.get("frozen_param_fragments") if isinstance(archive.obj, dict) else None
        ref = frag.get(name) if isinstance(frag, dict) else None
        if isinstance(ref, TensorRef) and len(ref.size) == 1:
            refs[r] = ref
    if not refs:
        return None
    part = math.ceil(numel / step.world)
    lengths = [refs[r].size[0] if r in refs else part for r in range(step.world)]
    pieces, problem = L.frozen3(numel, lengths)
    dtype = next(iter(refs.values())).dtype
    srcs = [Source(step.model_archives.get(p.rank), refs.get(p.rank), p,
                   step.model_archives[p.rank].name if p.rank in step.model_archives else _model_name(p.rank, step.files.mp))
            for p in pieces]
    flat = FlatReader(name, shape, dtype, srcs, step.book)
    return _array((), name, shape, dtype, flat, {"kind": "frozen", "files": flat.files}, problem)


def _optimizer_leaves(step: Step, trained: list[str]) -> list[Leaf]:
    """optimizer/state/<name>/<key> per trained parameter, optimizer/param_groups."""
    o0 = step.optims[min(step.optims)]
    out: list[Leaf] = []
    for name in trained:
        g = step.mapping.group_of.get(name, 0)
        numel = step.mapping.numel.get(name, 0)
        shape = next((s for group in step.shapes for n, s in group if n == name), (numel,))
        pieces = step.mapping.pieces.get(name, [])
        state0 = _group_state(o0, g)
        flat_len = _flat_length(step, g)
        for key, value in state0.items():
            if not isinstance(key, str):
                continue
            keys = (OPTIMIZER_KEY, "state", name, key)
            lname = f"{OPTIMIZER_KEY}.state.{name}.{key}"
            if isinstance(value, TensorRef) and len(value.size) == 1 and value.size[0] == flat_len:
                # per-element state, laid out as the partition: each rank's own tensor of this key
                srcs = _sources(step, pieces, functools.partial(_state_ref, key=key))
                flat = FlatReader(lname, shape, value.dtype, srcs, step.book)
                problem = next((f"rank {s.piece.rank} has no {key} for group {g}" for s in srcs
                                if s.archive is not None and s.ref is None), None)
                out.append(_array(keys, lname, shape, value.dtype, flat,
                                  {"kind": "optimizer state", "group": g, "files": flat.files}, problem))
            elif isinstance(value, TensorRef):
                reader = ts.TensorReader(o0.archive, value, lname)
                out.append(_array(keys, lname, tuple(value.size), value.dtype, reader,
                                  {"kind": "optimizer state", "group": g, "file": o0.archive.name},
                                  o0.archive.zip.claim_problem(value)))
            else:
                out.append(_value(keys, lname, value, o0.archive))
    groups = o0.base.get("param_groups")
    if isinstance(groups, list) and groups:
        # a group's parameters: those of each flat tensor it steps (stage 3: each of its sub-groups)
        named = [[n for f in flats if f < len(step.shapes) for n, _ in step.shapes[f]] for flats in _group_flats(o0)]

        def load(groups: list = groups) -> Any:
            value = safe_pickle.finalize(groups, o0.archive.where)
            out = []
            for g, group in enumerate(value):
                if isinstance(group, dict) and g < len(named):
                    group = dict(group, params=list(named[g]))
                out.append(group)
            return out

        out.append(ValueLeaf(keys=(OPTIMIZER_KEY, "param_groups"), name=f"{OPTIMIZER_KEY}.param_groups",
                             value_type="object", loader=load, extra={"file": o0.archive.name}))
    # the ZeRO optimizer's state that is the run's, not a rank's (what ds_to_universal keeps in
    # zero/optimizer_state.pt): the loss scaler (fp16: DynamicLossScaler) and its flags, from rank 0
    osd = o0.archive.obj.get("optimizer_state_dict") if isinstance(o0.archive.obj, dict) else None
    for key in OPTIMIZER_GLOBALS:
        if isinstance(osd, dict) and key in osd:
            out.append(_value((OPTIMIZER_KEY, key), f"{OPTIMIZER_KEY}.{key}", osd[key], o0.archive))
    return out


def _state_ref(o: RankOptim, g: int, key: str) -> TensorRef | None:
    ref = _group_state(o, g).get(key)
    return ref if isinstance(ref, TensorRef) and len(ref.size) == 1 else None


def _value(keys: tuple[Key, ...], name: str, value: Any, archive: ts.Archive) -> ValueLeaf:
    return ValueLeaf(keys=keys, name=name, value_type=ts.value_type(value), dtype=ts.SCALAR_DTYPES.get(type(value)),
                     loader=ts.value_loader(archive, value), extra={"file": archive.name})


def _engine_leaves(step: Step) -> list[Leaf]:
    """engine/...: the rest of rank 0's model-states file (global_steps, lr_scheduler, ds_config, client state)."""
    states = step.states
    rest = {k: v for k, v in states.items() if k not in CONSUMED}
    pairs = [(path, v) for path, v in ts.walk(rest) if path]
    tree = ts.FileTree(step.model_archives[0], [p for p, _ in pairs], [v for _, v in pairs])
    return ts.leaves_of(tree, (ENGINE_KEY,))


# ---------------------------------------------------------------------------
# A root (latest + step directories) or one step directory
# ---------------------------------------------------------------------------
def list_steps(storage: Storage) -> tuple[list[StepInfo], str | None, str | None]:
    """A root's steps (sub-directories holding a step's files), `latest`'s tag and what is wrong with it."""
    dirs, files = storage.listdir()
    tag, problem = read_latest(storage) if LATEST in files else (None, None)
    candidates = [d for d in dirs if STEP_DIR.match(d)]
    if tag is not None and tag in dirs and tag not in candidates:
        candidates.append(tag)
    steps = []
    for d in sorted(candidates, key=_step_order)[-_MAX_STEP_DIRS:]:
        try:
            listing = storage.child(d).listdir()[1]
        except CkptError:
            continue
        if is_step_listing(listing) or d == tag:
            m = STEP_DIR.match(d)
            complete = is_step_listing(listing)
            steps.append(StepInfo(d, int(m.group(1)) if m else None, complete,
                                  None if complete else "no model or optimizer states files"))
    return steps, tag, problem


def pick_step(storage: Storage, step: str | int | None) -> tuple[str, list[StepInfo], str | None]:
    """(step directory name, the root's steps, latest's tag) for --step (None / 'latest': `latest`'s tag)."""
    steps, tag, problem = list_steps(storage)
    name = choose_step(storage, step, steps, tag, problem, LATEST,
                       lambda text: [f"global_step{text}"] if is_ascii_number(text) else [text],
                       "no global_stepN directories and no latest file", complete_only=False)
    return name, steps, tag


def choose_step(storage: Storage, step: str | int | None, steps: list[StepInfo], tag: str | None,
                problem: str | None, latest: str, candidates: Callable[[str], list[str]], none: str,
                *, complete_only: bool) -> str:
    """The step directory --step names in a root (ZeRO `latest` or universal `latest_universal`):
    None / 'latest': the tag file's (without one, the highest step; `complete_only`: the highest
    complete one); a number or a directory name: the first of `candidates(text)` present."""
    names = [s.name for s in steps]
    if step in (None, "latest"):
        if tag is None:
            if problem is not None and problem != "does not exist":
                raise CorruptMetadataError(f"{latest}: {problem}", f"{storage.url}/{latest}")
            pool = [s.name for s in steps if s.committed or not complete_only]
            if not pool:
                raise NotFoundError(none, storage.url)
            return pool[-1]  # no tag file: the highest step (as people pick it)
        if tag not in names:
            raise NotFoundError(f"{latest} names {tag!r}, which is not a step directory here"
                                + (f" (there are: {', '.join(names[-4:])})" if names else ""), f"{storage.url}/{latest}")
        return tag
    if step == "all":
        raise UsageError("--step all: inspect and convert read one step (validate reads every step by default)")
    wanted = candidates(str(step))
    for name in wanted:
        if name in names:
            return name
    raise UsageError(f"--step {step}: no step directory {wanted[0]!r} here"
                     + (f" (there are: {', '.join(names[-6:])})" if names else ""), storage.url)


def layout_text(ck: Checkpoint) -> str:
    """inspect's "format" row: "DeepSpeed ZeRO-3 (global_step2, 2 data-parallel ranks, bf16 training)"."""
    lay = ck.layout
    extra = ""
    if (lay.get("pp") or 1) > 1:
        extra += f", {lay['pp']} pipeline stages"
    if lay.get("experts"):
        extra += f", {lay['experts']} MoE experts"
    return (f"DeepSpeed ZeRO-{lay.get('stage')} ({lay.get('tag')}, {lay.get('dp')} data-parallel rank"
            f"{'s' if lay.get('dp') != 1 else ''}{extra}, {lay.get('precision')} training)")

"""The tensor-parallel merge of a legacy Megatron-LM save's model tensors, as Megatron merges them.

A legacy save (`--ckpt-format torch`) holds, per tensor-parallel rank, the module's flat state dict
of that rank's slices; which axis a tensor is split on is not in the file (only the optimizer's
master params carry `partition_dim`, by position, not by name). Megatron's own merge is its
`sharded_state_dict()` (megatron/core, core_v0.16.1), decided by the module that owns the tensor,
and its layer names are fixed by those modules:

  * column-parallel linears (`linear_qkv`, `linear_fc1`, `output_layer`) and the vocab-parallel
    `embedding.word_embeddings`: axis 0, rank r's rows at r x its rows (the embeddings and output
    layer hold the padded vocabulary: Megatron pads to a multiple of make_vocab_size_divisible_by x TP);
  * `linear_qkv` with grouped-query attention: each rank holds whole query groups
    ([q heads, k, v] per group, groups in order), so axis 0 in rank order is Megatron's layout too;
  * a gated MLP (`--swiglu`, gated_linear_unit): each rank's `linear_fc1` weight and bias are
    [gate_r; up_r], and the whole tensor is [gate_0 .. gate_{T-1}; up_0 .. up_{T-1}]
    (transformer/mlp.py apply_swiglu_sharded_factory), not the ranks concatenated;
  * row-parallel linears (`linear_proj`, `linear_fc2`): weights on axis 1, biases replicated;
  * layer norms (also Transformer Engine's fused `layer_norm_weight` / `_bias`) and the
    position embeddings: replicated, rank 0's copy (megatron keeps replica 0).

A tensor whose name is none of these (routed MoE experts, whose files number experts per expert
rank and may use another TP size; MLA projections; a custom spec) is not merged: it stays under
each rank's directory, and a note names it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...core.contract import ArrayReader
from ...base.errors import CorruptMetadataError
from ...core.model import ArrayLeaf, Chunk, ChunkList, Key, Leaf, Region

# (pattern on the dotted name under `model`, how it is split); first match wins
_AXIS0, _AXIS1, _REPLICATED, _FC1 = "axis 0", "axis 1", "replicated", "fc1"
_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), kind) for p, kind in (
    (r"(^|\.)experts\.", ""),  # routed experts: not merged (see the module docstring)
    (r"(^|\.)embedding\.word_embeddings\.weight$", _AXIS0),
    (r"(^|\.)embedding\.position_embeddings\.weight$", _REPLICATED),
    (r"(^|\.)output_layer\.(weight|bias)$", _AXIS0),
    (r"\.linear_(qkv|fc1)\.layer_norm_(weight|bias)$", _REPLICATED),
    (r"\.linear_qkv\.(weight|bias)$", _AXIS0),
    (r"\.linear_fc1\.(weight|bias)$", _FC1),
    (r"\.linear_(proj|fc2)\.weight$", _AXIS1),
    (r"\.linear_(proj|fc2)\.bias$", _REPLICATED),
    (r"(^|\.)(\w*layernorm|q_layernorm|k_layernorm)\.(weight|bias)$", _REPLICATED),
))


@dataclass(frozen=True)
class Piece:
    """Where a part of one rank's tensor lands in the merged tensor: rank `rank`'s rows
    [src_start, src_start + count) of axis `axis` go to [dst_start, dst_start + count)."""

    rank: int
    axis: int
    src_start: int
    dst_start: int
    count: int


def split_kind(name: str, gated: bool | None) -> str | None:
    """How Megatron splits the model tensor `name` over TP ranks: 'axis 0', 'axis 1', 'replicated',
    'gated' (linear_fc1 of a gated MLP), or None where it cannot be told (unknown module, or a
    linear_fc1 of a run whose args do not say whether the MLP is gated)."""
    for pattern, kind in _RULES:
        if pattern.search(name):
            if kind == _FC1:
                return None if gated is None else ("gated" if gated else _AXIS0)
            return kind or None
    return None


def gated_mlp(args: Any) -> bool | None:
    """Whether the run's MLP is gated (Megatron-LM's --swiglu sets gated_linear_unit), from its args."""
    fields = getattr(args, "fields", args)
    if not isinstance(fields, dict):
        return None
    values = [fields.get(k) for k in ("swiglu", "gated_linear_unit") if k in fields]
    if any(v is True for v in values):
        return True
    return False if values and all(v is False or v is None for v in values) else None


def pieces(kind: str, shape: tuple[int, ...], ranks: int) -> tuple[tuple[int, ...], list[Piece]]:
    """The merged shape and where each rank's tensor (all of `shape`) goes in it."""
    if kind == _REPLICATED:
        return shape, [Piece(0, 0, 0, 0, shape[0] if shape else 1)]
    axis = 1 if kind == _AXIS1 else 0
    if len(shape) <= axis:
        raise ValueError(f"split on axis {axis} but has {len(shape)} dimensions")
    n = shape[axis]
    merged = shape[:axis] + (n * ranks,) + shape[axis + 1:]
    if kind != "gated":
        return merged, [Piece(r, axis, 0, r * n, n) for r in range(ranks)]
    if n % 2:
        raise ValueError(f"a gated linear_fc1 holds [gate; up] halves, but has {n} rows")
    half = n // 2
    gate = [Piece(r, 0, 0, r * half, half) for r in range(ranks)]
    up = [Piece(r, 0, half, ranks * half + r * half, half) for r in range(ranks)]
    return merged, gate + up


class MergedReader(ArrayReader):
    """Reads a region of a merged tensor from the ranks' tensors, each overlapping piece by its own
    region read (the torch.save reader reads it by byte ranges): nothing whole is held."""

    reads_byte_ranges = True

    def __init__(self, name: str, shape: tuple[int, ...], dtype: np.dtype, parts: list[Piece],
                 readers: list[Callable[[Region], np.ndarray]], verifiers: list[Callable[[int], None] | None]) -> None:
        self._name = name
        self._shape = shape
        self._dtype = dtype
        self._parts = parts
        self._readers = readers
        self._verifiers = verifiers

    def __call__(self, region: Region) -> np.ndarray:
        out = np.empty(tuple(r.stop - r.start for r in region), dtype=self._dtype)
        if not self._shape:  # a replicated scalar
            return self._readers[0](region)
        covered = 0
        for p in self._parts:
            lo, hi = max(region[p.axis].start, p.dst_start), min(region[p.axis].stop, p.dst_start + p.count)
            if lo >= hi:
                continue
            src = list(region)
            src[p.axis] = slice(p.src_start + lo - p.dst_start, p.src_start + hi - p.dst_start)
            dst = [slice(None)] * len(region)
            dst[p.axis] = slice(lo - region[p.axis].start, hi - region[p.axis].start)
            out[tuple(dst)] = self._readers[p.rank](tuple(src))
            covered += hi - lo
        if covered != out.shape[self._parts[0].axis]:
            raise CorruptMetadataError(f"{self._name}: the ranks' slices cover {covered} of the "
                                       f"{out.shape[self._parts[0].axis]} rows asked for", None)
        return out

    def verify(self, index: int) -> None:
        """validate --deep: the storage of every rank's slice (each a torch.save member with its CRC-32)."""
        for verify in {id(v): v for v in self._verifiers if v is not None}.values():
            verify(index)


def merge(by_rank: list[dict[tuple[Key, ...], ArrayLeaf]], gated: bool | None) -> tuple[list[Leaf], list[str]]:
    """The merged model tensors under ("model", ...), from each TP rank's model tensors by their keys
    under `model` (ranks in TP order); and the dotted names left per rank (how they split is not known).

    A tensor a rank lacks, or holds in another shape or dtype, is a save Megatron's strict load of
    one model refuses: CorruptMetadataError naming it."""
    from ...base import dtypes

    ranks = len(by_rank)
    merged: list[Leaf] = []
    unknown: list[str] = []
    for r, leaves in enumerate(by_rank[1:], 1):
        stray = next((k for k in leaves if k not in by_rank[0]), None)
        if stray is not None:
            raise CorruptMetadataError(f"model tensor {'.'.join(str(k) for k in stray)} is in mp_rank_{r:02d} but "
                                       "not in mp_rank_00 (each rank's model has the same tensors)", None)
    for keys, first in by_rank[0].items():
        name = ".".join(str(k) for k in keys)
        for r, leaves in enumerate(by_rank[1:], 1):
            other = leaves.get(keys)
            if other is None:
                raise CorruptMetadataError(f"model tensor {name} is in mp_rank_00 but not in mp_rank_{r:02d} "
                                           "(each rank's model has the same tensors)", None)
            if (other.shape, other.dtype) != (first.shape, first.dtype):
                raise CorruptMetadataError(
                    f"model tensor {name}: mp_rank_{r:02d} holds {other.dtype}{list(other.shape)}, mp_rank_00 "
                    f"{first.dtype}{list(first.shape)} (each rank's slice has the same shape)", None)
        kind = split_kind(name, gated)
        if kind is None:
            unknown.append(name)
            continue
        try:
            shape, parts = pieces(kind, tuple(first.shape), ranks)
        except ValueError as exc:
            raise CorruptMetadataError(f"model tensor {name} ({kind}): {exc}", None) from None
        sources = [leaves[keys] for leaves in by_rank]
        chunks = tuple(Chunk(tuple(p.dst_start if d == p.axis else 0 for d in range(len(shape))),
                             tuple(p.count if d == p.axis else n for d, n in enumerate(shape)))
                       for p in parts) if shape else (Chunk((), ()),)
        reader = MergedReader(name, shape, dtypes.numpy_dtype(first.dtype), parts,
                              [s.reader for s in sources], [s.verifier for s in sources])  # type: ignore[misc]
        unreadable = next((s.unreadable for s in sources if s.unreadable), None)
        extra = {"file": first.extra.get("file"), "tp_merged": {"split": kind, "ranks": ranks},
                 "files": [s.extra.get("file") for s in sources]}
        merged.append(ArrayLeaf(keys=("model",) + keys, name="model." + name, shape=shape, dtype=first.dtype,
                                layout=ChunkList(chunks), reader=reader, verifier=reader.verify, extra=extra,
                                unreadable=unreadable))
    return merged, unknown

"""DeepSpeed MoE checkpoints (deepspeed.moe.layer.MoE under ZeRO stages 1/2): the expert groups.

What DeepSpeed 0.19 writes (runtime/engine.py `_save_moe_checkpoint`, `_get_expert_ckpt_name`):

    layer_{L}_expert_{E}_mp_rank_00_model_states.pt   one per MoE layer L and GLOBAL expert E: that
                                        expert's module weights ({full module name: tensor}, the
                                        `deepspeed_experts.N` of the name renumbered to the global E =
                                        ep_rank x num_local_experts + local id), written by each
                                        expert-parallel rank's expert data-parallel rank 0
    mp_rank_00_model_states.pt          the module WITHOUT the experts, `num_experts` (per MoE
                                        layer), and param_shapes: rank 0's optimizer groups, its
                                        experts by their LOCAL numbers
    zero_pp_rank_{d}_mp_rank_00_optim_states.pt   per data-parallel rank d, as without MoE

(`expp_rank_{X}_mp_rank_00_optim_states.pt` is written only without ZeRO: refused by name.)
The optimizer's groups are split by DeepSpeed's split_params_into_different_moe_groups_for_optimizer:
an expert group has `"moe": True` (and `"name": "ep_size_K"`) in its param_groups entry. ZeRO
partitions an expert group over the EXPERT data-parallel ranks only (`partition_count[g]` = DP /
ep_size): with ep_size 1 that is every rank, the ordinary layout; with ep_size K > 1, the ranks
of expert-parallel rank e = d mod K (groups.py `_get_expert_parallel_ranks`: consecutive ranks form
an expert-parallel group, strided ones an expert data-parallel group; DeepSpeed's
`use_data_before_expert_parallelism` config swaps that and is refused) hold, as a flat vector partitioned
among them, the group's parameters of THEIR experts: the names of param_shapes[g] with the local
expert ids renumbered by e. Each expert is then a parameter of its own, by the name DeepSpeed's
module state_dict and the expert files give it (`moe.deepspeed_moe.experts.deepspeed_experts.3.up.weight`).
"""
from __future__ import annotations

import re
from typing import Any

from ...base.errors import CorruptMetadataError
from ...base.findings import Findings
from ...machinery.torch_save.safe_pickle import TensorRef
from . import layout as L

EXPERT_NAME = re.compile(r"^(?P<head>.*\.deepspeed_experts\.)(?P<id>\d+)(?P<tail>\..*)$")


def _groups_of(step: Any) -> list[dict]:
    o0 = step.optims[min(step.optims)]
    groups = o0.base.get("param_groups")
    return groups if isinstance(groups, list) else []


def _counts(o: Any) -> list[int] | None:
    osd = o.archive.obj.get("optimizer_state_dict") if isinstance(o.archive.obj, dict) else None
    count = osd.get("partition_count") if isinstance(osd, dict) else None
    if isinstance(count, (list, tuple)) and all(type(c) is int and c > 0 for c in count):
        return list(count)
    return None


def has_expert_groups(step: Any) -> bool:
    """An optimizer group DeepSpeed marked as an MoE group (`"moe": True`)."""
    return any(isinstance(g, dict) and g.get("moe") is True for g in _groups_of(step))


def expert_count(step: Any) -> int:
    """The experts of every MoE layer (`num_experts` in the model states), 0 without MoE."""
    n = step.states.get("num_experts") if isinstance(step.states, dict) else None
    if isinstance(n, list) and n and all(type(x) is int and x > 0 for x in n):
        return sum(n)
    return 0


def apply(step: Any) -> None:
    """Rebuild the step's mapping (and the expert groups' names) for expert groups partitioned
    over fewer ranks than the DP degree. The ordinary groups are laid out as before."""
    where = step.model_archives[0].where
    o0 = step.optims[min(step.optims)]
    counts = _counts(o0)
    groups = _groups_of(step)
    if counts is None or len(counts) != len(step.shapes):
        raise CorruptMetadataError(f"partition_count {counts} does not name one DP degree per optimizer group "
                                   f"({len(step.shapes)} groups)", o0.archive.where)
    config = step.states.get("ds_config")
    if isinstance(config, dict) and config.get("use_data_before_expert_parallelism"):
        raise CorruptMetadataError("ds_config use_data_before_expert_parallelism: an expert-parallel rank layout "
                                   "ckpt does not read yet", where)
    world = step.world
    local_ids = _local_experts(step.shapes)
    mapping = L.Mapping()
    shapes: list[list[tuple[str, tuple[int, ...]]]] = []
    for g, params in enumerate(step.shapes):
        count = counts[g]
        is_moe = g < len(groups) and isinstance(groups[g], dict) and groups[g].get("moe") is True
        if world % count:
            raise CorruptMetadataError(f"group {g}: partition_count {count} does not divide the DP degree {world}",
                                       o0.archive.where)
        ep = world // count if is_moe else 1
        if not is_moe and count != world:
            mapping.problems.append(f"group {g}: partitioned over {count} ranks but the DP degree is {world} "
                                    "(not an MoE group)")
        group_shapes: list[tuple[str, tuple[int, ...]]] = []
        for e in range(ep):
            ranks = [e + k * ep for k in range(count)]
            named = [(_global(n, e, local_ids, where) if ep > 1 else n, s) for n, s in params]
            sizes = [(n, _numel(s)) for n, s in named]
            lengths, pads = _group_lengths(step, g, ranks, sum(n for _, n in sizes))
            sub = L.zero12([sizes], [[n] for n in lengths], [[p] for p in pads] if pads is not None else None,
                           [step.optims[min(step.optims)].param_paddings[g]]
                           if o0.param_paddings is not None and g < len(o0.param_paddings) else None)
            for name, pieces in sub.pieces.items():
                mapping.pieces[name] = [L.Piece(ranks[p.rank], g, p.start, p.count, p.at) for p in pieces]
                mapping.group_of[name] = g
                mapping.numel[name] = sub.numel[name]
            label = f"group {g}" + (f" (expert-parallel rank {e}: DP ranks {ranks})" if ep > 1 else "")
            mapping.problems.extend(label + p.removeprefix("group 0") for p in sub.problems)
            group_shapes.extend(named)
        shapes.append(group_shapes)
    step.shapes = shapes
    step.mapping = mapping


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _local_experts(shapes: list[list[tuple[str, tuple[int, ...]]]]) -> dict[str, int]:
    """Per MoE layer (the name up to `deepspeed_experts.`), how many local experts rank 0 has."""
    ids: dict[str, set[int]] = {}
    for group in shapes:
        for name, _ in group:
            m = EXPERT_NAME.match(name)
            if m:
                ids.setdefault(m.group("head"), set()).add(int(m.group("id")))
    return {head: len(found) for head, found in ids.items()}


def _global(name: str, ep_rank: int, local: dict[str, int], where: str) -> str:
    m = EXPERT_NAME.match(name)
    if m is None:
        raise CorruptMetadataError(f"{name} is in an MoE optimizer group but is not an expert's parameter "
                                   "(...deepspeed_experts.N...)", where)
    return f"{m.group('head')}{ep_rank * local[m.group('head')] + int(m.group('id'))}{m.group('tail')}"


def _group_lengths(step: Any, g: int, ranks: list[int], used: int) -> tuple[list[int], list[int] | None]:
    """The stored partition lengths of group g on `ranks` (one expert data-parallel group) and
    their end paddings; a missing rank's as DeepSpeed would have written them."""
    present = {r: step.optims[r] for r in ranks if r in step.optims}
    if not present:
        # no rank of this expert-parallel rank is here: its partitions as rank 0's group (same experts' shapes)
        some = step.optims[min(step.optims)]
        part = some.flats[g].size[0] + (some.group_paddings[g] if some.group_paddings else 0) \
            if g < len(some.flats) else used
    else:
        some = next(iter(present.values()))
        part = some.flats[g].size[0] + (some.group_paddings[g] if some.group_paddings else 0) \
            if g < len(some.flats) else used
    lengths, pads = [], []
    have_pads = all(o.group_paddings is not None for o in step.optims.values())
    for k, r in enumerate(ranks):
        o = present.get(r)
        if o is not None and g < len(o.flats):
            lengths.append(o.flats[g].size[0])
            pads.append(o.group_paddings[g] if have_pads and o.group_paddings and g < len(o.group_paddings) else 0)
        else:
            stored = max(0, min(part, used - k * part))
            lengths.append(stored)
            pads.append(part - stored)
    return lengths, pads if have_pads else None


# ---------------------------------------------------------------------------
# The expert files (module weights of each expert): expected, and what they hold
# ---------------------------------------------------------------------------
def expected_files(step: Any) -> dict[tuple[int, int], str]:
    """(MoE layer, global expert) -> the file DeepSpeed writes for it, from `num_experts`."""
    n = step.states.get("num_experts") if isinstance(step.states, dict) else None
    if not isinstance(n, list) or not has_expert_groups(step) and not step.files.experts:
        return {}
    return {(layer, e): f"layer_{layer}_expert_{e}_mp_rank_{step.files.mp:02d}_model_states.pt"
            for layer, count in enumerate(n) if type(count) is int for e in range(count)}


def expert_module_leaves(step: Any) -> list[tuple[str, Any]]:
    """--weights module: each expert file's tensors as stored (the training dtype), by their names
    (the module state dict of mp_rank_00 holds no expert: DeepSpeed saves them apart)."""
    from ...machinery.torch_save import reading as ts

    out = []
    for _, fname in sorted(step.files.experts.items()):
        archive = ts.Archive(step.storage, fname)
        obj = archive.obj if isinstance(archive.obj, dict) else {}
        for name, ref in obj.items():
            if isinstance(name, str) and isinstance(ref, TensorRef):
                out.append((name, L.array_leaf((), name, tuple(ref.size), ref.dtype, ts.TensorReader(archive, ref, name),
                                            {"file": fname, "kind": "module"}, archive.zip.claim_problem(ref))))
    return out


def missing_files(step: Any) -> list[str]:
    present = set(step.files.experts.values())
    return [f for f in expected_files(step).values() if f not in present]


def check_expert_files(step: Any, leaves: list, findings: Findings, prefix: str) -> None:
    """Each expert file's tensors: names of that expert's parameters, of their recorded shapes
    (DeepSpeed's load_state_dict takes them by name into the module)."""
    from ...machinery.torch_save import reading as ts

    shapes = {name: shape for group in step.shapes for name, shape in group}
    for (layer, expert), fname in sorted(step.files.experts.items()):
        try:
            archive = ts.Archive(step.storage, fname)
        except Exception:  # noqa: BLE001 - its damage was reported when it was opened
            continue
        obj = archive.obj
        if not isinstance(obj, dict):
            findings.error("bad-metadata", f"holds {type(obj).__name__}, not an expert's state dict", file=prefix + fname)
            continue
        for key, ref in obj.items():
            m = EXPERT_NAME.match(str(key))
            if m is None or int(m.group("id")) != expert:
                findings.error("bad-metadata", f"{key!r} is not a parameter of expert {expert}", file=prefix + fname)
            elif not isinstance(ref, TensorRef):
                findings.error("bad-metadata", f"{key}: not a tensor", file=prefix + fname)
            elif key in shapes and tuple(ref.size) != tuple(shapes[key]):
                findings.error("bad-metadata", f"{key}: shape {list(ref.size)}, but the optimizer records "
                               f"{list(shapes[key])}", file=prefix + fname)
            elif key not in shapes:
                findings.error("bad-metadata", f"{key}: no such trained parameter in param_shapes",
                               file=prefix + fname)

"""Legacy Megatron-LM saves (`--ckpt-format torch`): one torch.save file per model-parallel rank.

Megatron-LM's `save_checkpoint` with `--ckpt-format torch` (megatron/training/checkpointing.py,
core_v0.16.1: get_checkpoint_name 162-200, generate_state_dict 877-952) writes, in a step
directory `iter_NNNNNNN/` (or `release/`) of the run root with its tracker:

  * `mp_rank_{tp:02d}/model_optim_rng.pt`; with pipeline parallelism `mp_rank_{tp:02d}_{pp:03d}`,
    with expert parallelism `_{ep:03d}` appended (so `mp_rank_00_001` is a pipeline OR an
    expert rank: the run's `args` in the file say which);
  * `distrib_optim.pt` beside it with `--use-distributed-optimizer` (the optimizer's parameter
    state, gathered per model-parallel rank);
  * each file is `torch.save` of `{args, checkpoint_version, iteration, model, optimizer,
    opt_param_scheduler, rng_state, num_floating_point_operations_so_far}`: `model` is the
    module's flat state dict of that rank's tensor-parallel slices (per-layer keys, no renames),
    `optimizer` torch's Adam state by integer id plus `fp32_from_fp16_params`, the fp32 master
    params, pickled with Megatron's tensor-parallel attributes (`_rebuild_from_type_v2` with
    `{'tensor_model_parallel', 'partition_dim', 'partition_stride', 'is_qkv', ...}`).

Each rank's tree is read through the torch.save package (the allow-list unpickler with
Megatron's data classes, pickled.ALLOW) and shown under the rank's directory name
(`mp_rank_00/optimizer/...`, `mp_rank_00/args`), as it is. Where the ranks are tensor-parallel only
(`mp_rank_XX`), the model's tensors are shown once, merged over the ranks under `model/`
(`model/decoder/layers/0/mlp/linear_fc1/weight`) the way Megatron's sharded_state_dict merges them
(tp_merge.py: the split per module name, a gated MLP's [gate; up] halves); which axis a model tensor
is split on is not in the file (the master params' `partition_dim` is, and is kept in each leaf's
extra as `tensor_parallel`). Pipeline and expert grids keep every rank's model as it is.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ...base.errors import CkptError, CorruptMetadataError, PathEscapeError
from ...base.findings import Findings
from ...core.model import ArrayLeaf, Checkpoint, Key, Leaf, ValueLeaf
from ...storage import Storage
from . import pickled
from .common import split_name
from .detection import NAME

RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
BACKEND = "torch"  # the Checkpoint's layout["backend"]: Megatron-LM's --ckpt-format name
MODEL_FILE = "model_optim_rng.pt"
OPTIM_FILE = "distrib_optim.pt"
# the attributes Megatron's tensor-parallel layers set on a parameter (tensor_parallel/layers.py
# set_tensor_model_parallel_attributes), pickled with the fp32 master params
TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "is_qkv", "expert_tp",
                 "allreduce", "sequence_parallel", "shared", "is_embedding_or_output_parameter")
_MAX_NAMED = 8


@dataclass
class Rank:
    """One rank directory: its name, its grid coordinates as named, the files it holds."""

    name: str
    coords: tuple[int, ...]  # (tp,), (tp, pp or ep), (tp, pp, ep)
    files: list[str] = field(default_factory=list)


def rank_dirs(dirs: list[str]) -> list[str]:
    return [d for d in dirs if RANK_DIR.match(d)]


def is_legacy_step(dirs: list[str]) -> bool:
    return bool(rank_dirs(dirs))


def ranks(storage: Storage) -> list[Rank]:
    """The rank directories of a step directory, sorted by their coordinates."""
    by_name: dict[str, Rank] = {}
    for key in storage.list():
        top, _, rest = key.partition("/")
        m = RANK_DIR.match(top)
        if not m or not rest:
            continue
        rank = by_name.get(top)
        if rank is None:
            rank = by_name[top] = Rank(top, tuple(int(g) for g in m.groups() if g is not None))
        if "/" not in rest:
            rank.files.append(rest)
    return sorted(by_name.values(), key=lambda r: (len(r.coords), r.coords))


def axes_of(width: int, sizes: dict[str, int] | None) -> tuple[str, ...]:
    """What the numbers of an `mp_rank_*` name are: tp, then pp and/or ep. Two numbers are
    (tp, pp) unless the run's args say expert but not pipeline parallelism."""
    if width == 1:
        return ("tp",)
    if width == 3:
        return ("tp", "pp", "ep")
    if sizes and sizes.get("pp", 1) <= 1 and sizes.get("ep", 1) > 1:
        return ("tp", "ep")
    return ("tp", "pp")


def missing_ranks(present: list[Rank], sizes: dict[str, int] | None) -> tuple[list[str], str | None]:
    """Rank directories the grid needs but the step lacks: every coordinate below the run's
    tp/pp/ep size from its args where recorded, else below the largest present on that axis;
    and why the names cannot be a grid (mixed widths), if so."""
    widths = {len(r.coords) for r in present}
    if len(widths) > 1:
        return [], f"rank directories of different forms ({', '.join(sorted({r.name for r in present})[:4])})"
    if not present:
        return [], None
    width = widths.pop()
    axes = axes_of(width, sizes)
    extent = [max(r.coords[i] for r in present) + 1 for i in range(width)]
    for i, axis in enumerate(axes):
        if sizes and axis in sizes:
            extent[i] = sizes[axis]
    have = {r.coords for r in present}
    import itertools

    missing = [_rank_name(c) for c in itertools.product(*(range(n) for n in extent)) if c not in have]
    return missing, None


def _rank_name(coords: tuple[int, ...]) -> str:
    return f"mp_rank_{coords[0]:02d}" + "".join(f"_{c:03d}" for c in coords[1:])


def parallel_sizes(args: Any) -> dict[str, int] | None:
    """tp / pp / ep sizes from the run's args (a Namespace stand-in or its plain dict), if recorded."""
    fields = getattr(args, "fields", args)
    if not isinstance(fields, dict):
        return None
    out = {}
    for axis, name in (("tp", "tensor_model_parallel_size"), ("pp", "pipeline_model_parallel_size"),
                       ("ep", "expert_model_parallel_size")):
        value = fields.get(name)
        if type(value) is int and value > 0:
            out[axis] = value
    return out or None


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------
def _key_text(key: Any) -> Any:
    return key if type(key) in (str, int) else pickled._key_text(key)


def _with_plain_keys(obj: Any) -> Any:
    """The object with dict keys that are neither str nor int spelled as Megatron spells them
    (distrib_optim.pt keys buffers by (param dtype, grad dtype)), so its tree is walked by key.
    Each dict is copied once (by identity): a dict the pickle shares stays one dict, and one
    holding itself stays a cycle (the walk then shows it once, later paths as references)."""
    copies: dict[int, Any] = {}

    def copy(d: Any, depth: int) -> Any:
        if not isinstance(d, dict) or depth > 64:
            return d
        if id(d) in copies:
            return copies[id(d)]
        keys = list(d) if all(type(k) in (str, int) for k in d) else [_key_text(k) for k in d]
        if len(set(keys)) != len(keys):
            copies[id(d)] = d
            return d
        out = copies[id(d)] = {}
        for k, v in zip(keys, list(d.values())):
            out[k] = copy(v, depth + 1)
        return out

    return copy(obj, 0)


def _tp_attributes(archive: Any) -> dict[tuple[Key, ...], dict[str, Any]]:
    """The tensor-parallel attributes pickled with each tensor, by its key path in the file.

    The allow-list unpickler builds plain tensors from `_rebuild_from_type_v2` and drops the
    Python attributes; this second pass over the same `data.pkl` (only when it names that
    rebuild) records them. A pickle the first pass accepted; any failure here only loses notes."""
    from ...machinery.torch_save import safe_pickle
    from ...machinery.torch_save import reading as ts

    try:
        data = archive.zip._member_bytes("data.pkl")
    except CkptError:
        return {}
    if b"_rebuild_from_type_v2" not in data:
        return {}
    recorded: dict[int, dict[str, Any]] = {}
    base = safe_pickle.ALLOWED[("torch._tensor", "_rebuild_from_type_v2")]

    def rebuild(func: Any, new_type: Any, args: Any, state: Any) -> Any:
        tensor = base(func, new_type, args, state)
        if isinstance(state, dict):
            kept = {k: v for k, v in state.items() if k in TP_ATTRIBUTES and type(v) in (bool, int, str)}
            if kept:
                recorded[id(tensor)] = kept
        return tensor

    recorder = safe_pickle._Fn(rebuild)

    class Recorder(safe_pickle.SafeUnpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):
                return recorder
            return super().find_class(module, name)

    try:
        safe_pickle.check_limits(data, archive.where)
        obj = Recorder(data, archive.where, payload=True, extra=pickled.ALLOW).load()
    except Exception:  # noqa: BLE001 - the first pass read this pickle; attributes are extra
        return {}
    return {path: recorded[id(v)] for path, v in ts.walk(_with_plain_keys(obj)) if id(v) in recorded}


def file_leaves(storage: Storage, name: str, prefix: tuple[Key, ...]) -> tuple[list[Leaf], Any]:
    """One rank file's leaves under `prefix`, Megatron's stand-ins as plain data; (leaves, its args)."""
    from ...machinery.torch_save.safe_pickle import TensorRef
    from ...machinery.torch_save import reading as ts

    archive = ts.Archive(storage, name, pickled.ALLOW)
    obj = _with_plain_keys(archive.obj)
    pairs = list(ts.walk(obj))
    tree = ts.FileTree(archive, [p for p, _ in pairs], [v for _, v in pairs])
    for path, value in pairs:
        if isinstance(value, TensorRef):
            tree.shared.setdefault(value.storage.key, []).append(".".join(str(k) for k in path))
    leaves = ts.leaves_of(tree, prefix)
    attrs = _tp_attributes(archive)
    for path, leaf in zip(tree.paths, leaves):
        if leaf.keys != prefix + path:
            # the torch.save reader split dotted keys at every dot; a buffer key spelled like
            # "(torch.bfloat16, torch.float32)" stays one key, as in Megatron's own key names
            leaf.keys = prefix + tuple(p for k in path for p in (_split(k) if isinstance(k, str) else (k,)))
        leaf.extra["file"] = name
        if isinstance(leaf, ArrayLeaf) and path in attrs:
            leaf.extra["tensor_parallel"] = attrs[path]
        if isinstance(leaf, ValueLeaf) and leaf.loader is not None:
            leaf.loader = _plain(leaf.loader)
    args = obj.get("args") if isinstance(obj, dict) else None
    return leaves, args


def _split(key: str) -> tuple[Key, ...]:
    """A dotted key split at its dots outside parentheses."""
    return split_name(key) if "(" in key else tuple(key.split("."))


def _plain(load: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: pickled.plain(load())


def read(storage: Storage) -> Checkpoint:
    """A step directory of rank directories: every rank's files, each under its rank's name."""
    present = ranks(storage)
    leaves: list[Leaf] = []
    sizes = None
    first_args = None
    files = 0
    for rank in present:
        if MODEL_FILE not in rank.files:
            raise CorruptMetadataError(f"{rank.name}/ holds no {MODEL_FILE} (Megatron's load fails on it)",
                                       f"{storage.url}/{rank.name}")
        rank_leaves, args = file_leaves(storage, f"{rank.name}/{MODEL_FILE}", (rank.name,))
        leaves += rank_leaves
        files += 1
        if first_args is None:
            first_args = args
        sizes = sizes or parallel_sizes(args)
        if OPTIM_FILE in rank.files:
            leaves += file_leaves(storage, f"{rank.name}/{OPTIM_FILE}", (rank.name, "distrib_optim"))[0]
            files += 1
    missing, odd = missing_ranks(present, sizes)
    if odd:
        raise CorruptMetadataError(odd, storage.url)
    if missing:
        raise CorruptMetadataError(
            f"rank directories missing: {', '.join(missing[:_MAX_NAMED])}" + (" ..." if len(missing) > _MAX_NAMED else "")
            + f" (the step has {', '.join(r.name for r in present[:4])}{' ...' if len(present) > 4 else ''})",
            storage.url)
    axes = axes_of(len(present[0].coords), sizes) if present else ()
    grid = " x ".join(f"{a} {max(r.coords[i] for r in present) + 1}" for i, a in enumerate(axes))
    if axes == ("tp",):
        leaves, merge_notes = _merge_model(leaves, len(present), first_args, storage.url)
        notes = [f"legacy Megatron-LM save (--ckpt-format torch): {len(present)} rank directories ({grid}); "
                 "the model's tensors merged over the tensor-parallel ranks under model/, as Megatron's "
                 "sharded_state_dict merges them; everything else (optimizer, rng_state, args, ...) each "
                 "rank's as it is, under its directory", *merge_notes]
    else:
        notes = [f"legacy Megatron-LM save (--ckpt-format torch): {len(present)} rank directories ({grid}), "
                 "each rank's state dict as it is: model tensors are that rank's slices (ckpt merges "
                 "tensor-parallel ranks only where there is no pipeline or expert axis; convert writes the "
                 "ranks as they are)"]
    tp = [leaf for leaf in leaves if isinstance(leaf, ArrayLeaf) and "tensor_parallel" in leaf.extra]
    if tp:
        dims: dict[str, int] = {}
        for leaf in tp:
            a = leaf.extra["tensor_parallel"]
            what = f"partition_dim {a['partition_dim']}" if a.get("tensor_model_parallel") and "partition_dim" in a \
                else "not tensor-parallel"
            dims[what] = dims.get(what, 0) + 1
        notes.append(f"{len(tp)} tensors (the fp32 master params) carry Megatron's tensor-parallel attributes: "
                     + ", ".join(f"{n} {w}" for w, n in sorted(dims.items()))
                     + " (in each leaf's extra as tensor_parallel; the model tensors record none)")
    layout = {"backend": BACKEND, "ranks": len(present), "rank_files": files}
    return Checkpoint(path=storage.url, format=NAME, layout=layout, leaves=leaves, notes=notes)


def _merge_model(leaves: list[Leaf], ranks: int, args: Any, where: str) -> tuple[list[Leaf], list[str]]:
    """The ranks' model tensors replaced by their tensor-parallel merge (tp_merge: Megatron's own
    layout per module, the gated linear_fc1 from the run's args); tensors whose split is not known
    stay per rank. The ranks are mp_rank_00 .. in order (missing ones were refused before)."""
    from . import tp_merge

    model: list[dict[tuple[Key, ...], ArrayLeaf]] = [{} for _ in range(ranks)]
    rank_index: dict[str, int] = {}
    for leaf in leaves:
        if isinstance(leaf, ArrayLeaf) and len(leaf.keys) > 2 and leaf.keys[1] == "model":
            index = rank_index.setdefault(str(leaf.keys[0]), len(rank_index))
            model[index][leaf.keys[2:]] = leaf
    try:
        merged, unknown = tp_merge.merge(model, tp_merge.gated_mlp(args))
    except CorruptMetadataError as exc:
        raise CorruptMetadataError(exc.message, where) from None
    if not merged:
        return leaves, []
    done = {leaf.keys for leaf in merged}  # ("model", ...): a rank's model leaf without its rank
    kept = [leaf for leaf in leaves if not (isinstance(leaf, ArrayLeaf) and leaf.keys[1:] in done)]
    notes = [f"{len(merged)} model tensors merged over {ranks} tensor-parallel ranks"
             + (" (linear_fc1 of the gated MLP: every rank's gate half, then every rank's up half)"
                if tp_merge.gated_mlp(args) else "")]
    if unknown:
        notes.append(f"{len(unknown)} model tensors not merged (how Megatron splits them is not known here), "
                     f"left under each rank's directory: {', '.join(unknown[:_MAX_NAMED])}"
                     + (" ..." if len(unknown) > _MAX_NAMED else ""))
    return merged + kept, notes


# ---------------------------------------------------------------------------
# validate
# ---------------------------------------------------------------------------
class _LeafPrefix:
    """Findings of one rank file's torch.save checks, its leaves named under the rank's directory."""

    def __init__(self, findings: Any, prefix: str) -> None:
        self._findings = findings
        self._prefix = prefix

    def _leaf(self, leaf: str | None) -> str | None:
        return f"{self._prefix}/{leaf}" if leaf else leaf

    def error(self, code: str, message: str, *, leaf: str | None = None, file: str | None = None) -> None:
        self._findings.error(code, message, leaf=self._leaf(leaf), file=file)

    def warning(self, code: str, message: str, *, leaf: str | None = None, file: str | None = None) -> None:
        self._findings.warning(code, message, leaf=self._leaf(leaf), file=file)

    def count(self, what: str, n: int = 1) -> None:
        self._findings.count(what, n)

    @property
    def errors(self) -> list[Any]:
        return self._findings.errors


def check(storage: Storage, findings: Findings) -> None:
    """Every rank directory the grid needs (missing-file), each rank's model_optim_rng.pt (and
    distrib_optim.pt: required when the run's args say --use-distributed-optimizer) as torch
    would load it, with Megatron's data classes admitted."""
    from ...machinery.torch_save import checks as ts_checks

    present = ranks(storage)
    sizes = None
    distributed = False
    for rank in present:
        findings.count("ranks")
        if MODEL_FILE not in rank.files:
            findings.error("missing-file", "Megatron's load reads this rank's state from it",
                           file=f"{rank.name}/{MODEL_FILE}")
            continue
        try:
            tree = ts_checks.check_file(storage, f"{rank.name}/{MODEL_FILE}", _LeafPrefix(findings, rank.name),
                                        allow=pickled.ALLOW)
        except PathEscapeError:
            raise
        if tree is not None and sizes is None:
            args = next((v for p, v in zip(tree.paths, tree.values) if p == ("args",)), None)
            sizes = parallel_sizes(args)
            fields = getattr(args, "fields", None) or {}
            distributed = fields.get("use_distributed_optimizer") is True
        if OPTIM_FILE in rank.files:
            ts_checks.check_file(storage, f"{rank.name}/{OPTIM_FILE}",
                                 _LeafPrefix(findings, f"{rank.name}/distrib_optim"), allow=pickled.ALLOW)
    if distributed:
        for rank in present:
            if MODEL_FILE in rank.files and OPTIM_FILE not in rank.files:
                findings.error("missing-file", "the run used --use-distributed-optimizer: Megatron's load reads "
                               "the optimizer state from it", file=f"{rank.name}/{OPTIM_FILE}")
    missing, odd = missing_ranks(present, sizes)
    if odd:
        findings.error("bad-metadata", odd, file=".")
    axes = axes_of(len(present[0].coords), sizes) if present else ()
    known = sizes if sizes and not odd else {}
    for rank in present if known else ():
        beyond = [f"{a} {c} of {known[a]}" for a, c in zip(axes, rank.coords) if a in known and c >= known[a]]
        if beyond:
            findings.warning("stray-file", f"beyond the run's parallel sizes ({', '.join(beyond)}): "
                             "Megatron's load never reads it", file=f"{rank.name}/")
    for name in missing[:_MAX_NAMED * 4]:
        coords = RANK_DIR.match(name).groups()  # type: ignore[union-attr]
        where = ", ".join(f"{a} {int(c)}" for a, c in zip(axes, [c for c in coords if c is not None]))
        findings.error("missing-file", f"rank directory missing ({where}): Megatron's load of that rank fails",
                       file=f"{name}/{MODEL_FILE}")
    if len(missing) > _MAX_NAMED * 4:
        findings.error("missing-file", f"... and {len(missing) - _MAX_NAMED * 4} more rank directories missing",
                       file=".")


def check_deep(storage: Storage, ckpt: Any, findings: Findings, skip_leaves: set[str]) -> None:
    """--deep beyond the tensors (the engine read each, checking its storage's CRC-32): every value decoded."""
    values = [leaf for leaf in ckpt.leaves if isinstance(leaf, ValueLeaf) and leaf.path not in skip_leaves]
    for leaf in values:
        try:
            leaf.load()
        except CkptError as exc:
            findings.error("bad-chunk", f"value does not decode: {exc.message}", leaf=leaf.path,
                           file=leaf.extra.get("file"))
    if values:
        findings.count("values_read", len(values))

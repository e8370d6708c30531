"""DeepSpeed universal checkpoints, read without DeepSpeed or torch.

What DeepSpeed 0.19's `ds_to_universal --input_folder run/global_stepN --output_folder OUT` writes
(deepspeed/checkpoint/ds_to_universal.py), and what ckpt's `convert --to deepspeed-universal`
writes the same way (write.py):

    ROOT/latest_universal          the step directory's name ("global_step2_universal"), no newline
    ROOT/<tag>/                    OUT
      mp_rank_00_model_states.pt   the ZeRO checkpoint's model-states file(s), copied as they are
                                   (stage 3: zero_pp_rank_R_mp_rank_00_model_states.pt per rank)
      zero/optimizer_state.pt      the optimizer's global state: rank 0's ZeRO optimizer state dict
                                   without its per-rank partitions (stages 1/2; stage 3 keeps them),
                                   plus `param_groups` (what DeepSpeed's universal load reads: loss
                                   scaler, step at stage 3, the groups' hyper-parameters)
      zero/<param>/fp32.pt         per trained parameter, its fp32 master weights whole:
      zero/<param>/exp_avg.pt        stages 1/2: {"cat_dim": 0, "param": tensor of the parameter's
      zero/<param>/exp_avg_sq.pt     shape}; stage 3: the bare tensor, flat (numel,)
      zero/<param>/step.pt         stages 1/2: the group's Adam step (a 0-d tensor)
      zero/<name>/fp32.pt          stages 1/2: every other module entry (frozen parameters, buffers,
                                   tied names) as {"param": its module tensor cast to float32}

DeepSpeed's `load_checkpoint(ROOT, load_universal=True)` reads `latest_universal`, the model
states, `zero/optimizer_state.pt` and, for each parameter it trains, every `zero/<name>/*.pt`.

The tree ckpt gives (like the ZeRO reader's, so the same names convert the same way):

  * each `zero/<name>/fp32.pt`'s tensor at the name split at its dots (`layers/0/up/weight`), in
    the model's order (the recorded shapes', then the module's); a stage-3 file's flat tensor is
    given the shape the model-states file records for it (the same bytes, in C order); the file's
    other entries (`cat_dim`) are facts of the leaf (`extra`), not leaves;
  * every other `zero/<name>/<key>.pt` at `optimizer/state/<name>/<key>` (exp_avg, exp_avg_sq as
    the parameter's logical tensors, step);
  * `zero/optimizer_state.pt`'s entries under `optimizer/` (`optimizer/param_groups`,
    `optimizer/loss_scaler`, `optimizer/zero_stage` as the stage number, ...; at stage 3 rank 0's
    flat partitions and Adam state as they are);
  * `engine/...`: the rest of rank 0's model-states file, as the ZeRO reader gives it.

A ZeRO root that also holds `latest_universal` (ds_to_universal's output written beside the
steps) reads as the ZeRO checkpoint; give the universal step directory to read that one.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from ....base.errors import CkptError, CorruptMetadataError, NotFoundError, UnknownFormatError, UsageError, short_repr
from ....core.model import ArrayLeaf, Checkpoint, Key, Leaf, MissingData, RegularGrid, StepInfo, ValueLeaf
from ....storage import Storage
from ....machinery.torch_save.safe_pickle import DSZeroStage, TensorRef
from ....base.text import is_ascii_number
from ....machinery.torch_save import reading as ts
from .. import layout as L
from .. import reader as ds

NAME = "deepspeed-universal"
LATEST = "latest_universal"
ZERO = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
PARAM_KEY = "param"  # DeepSpeed's checkpoint.constants.PARAM
FP32 = "fp32"
# the per-parameter states DeepSpeed's universal load needs of every parameter it trains
REQUIRED_STATES = ("fp32", "exp_avg", "exp_avg_sq")
# entries of a parameter file's dict beside "param" that are facts of the layout (tensor-parallel
# merges), kept in the leaf's extra (DeepSpeed's checkpoint.constants)
LAYOUT_KEYS = ("cat_dim", "vocab_tensor", "param_n_sub_params", "ep_is_expert_param", "ep_num_experts")
STEP_NUMBER = re.compile(r"^global_step(\d+)(?:_universal)?$")
_MAX_STEP_DIRS = 256


# ---------------------------------------------------------------------------
# detection
# ---------------------------------------------------------------------------
def is_step_listing(dirs: list[str], files: list[str]) -> bool:
    """A `zero/` directory beside a model-states file (nothing read)."""
    return ZERO in dirs and any(ds.MODEL_FILE.match(f) for f in files)


def is_zero_listing(storage: Storage, dirs: list[str], files: list[str]) -> bool:
    """ds_to_universal's `zero/` folder opened on its own: optimizer_state.pt (or nothing) beside
    per-parameter folders holding fp32.pt (one folder listed). Its files are torch.save files, but
    they are one universal checkpoint's parts, never one checkpoint each: detected here, so that
    the torch.save reader does not read optimizer_state.pt alone, and refused by name (zero_folder_error)."""
    if not dirs or any(f != OPTIMIZER_STATE for f in files):
        return False
    try:
        return f"{FP32}.pt" in storage.child(sorted(dirs)[0]).listdir()[1]
    except CkptError:
        return False


def zero_folder_error(storage: Storage) -> UnknownFormatError:
    """What a command says of a `zero/` folder opened without its step directory."""
    parent = storage.url.rstrip("/").rsplit("/", 1)[0]
    return UnknownFormatError(
        f"the {ZERO}/ folder of a DeepSpeed universal checkpoint, not a checkpoint on its own "
        f"(its model-states file is in the step directory above it); open that: ckpt inspect {parent}", storage.url)


def detect(storage: Storage) -> bool:
    dirs, files = storage.listdir()
    if is_step_listing(dirs, files) or is_zero_listing(storage, dirs, files):
        return True
    if ds.LATEST in files:
        return False  # a ZeRO root (its universal step beside the ZeRO ones is read by its path)
    if LATEST in files:
        return True
    for d in sorted(dirs, key=_step_order)[-4:]:
        try:
            if is_step_listing(*storage.child(d).listdir()):
                return True
        except CkptError:
            continue
    return False


def _step_order(name: str) -> tuple[int, str]:
    m = STEP_NUMBER.match(name)
    return (int(m.group(1)), name) if m else (-1, name)


def read_latest(storage: Storage) -> tuple[str | None, str | None]:
    """(tag, None) or (None, what is wrong with `latest_universal`): the engine strips it, as `latest`."""
    return ds.read_tag(storage, LATEST, "ds_to_universal writes the step directory's name alone")


def list_steps(storage: Storage) -> tuple[list[StepInfo], str | None, str | None]:
    """A root's universal step directories, `latest_universal`'s tag and what is wrong with it."""
    dirs, files = storage.listdir()
    tag, problem = read_latest(storage) if LATEST in files else (None, None)
    steps = []
    for d in sorted(dirs, key=_step_order)[-_MAX_STEP_DIRS:]:
        try:
            listing = storage.child(d).listdir()
        except CkptError:
            continue
        complete = is_step_listing(*listing)
        if complete or d == tag:
            m = STEP_NUMBER.match(d)
            steps.append(StepInfo(d, int(m.group(1)) if m else None, complete,
                                  None if complete else "no zero/ directory and model-states file"))
    return steps, tag, problem


def pick_step(storage: Storage, step: str | int | None) -> tuple[str, list[StepInfo], str | None]:
    """(step directory, the root's steps, the tag) for --step (None / 'latest': latest_universal's)."""
    from ..reader import choose_step

    steps, tag, problem = list_steps(storage)
    name = choose_step(
        storage, step, steps, tag, problem, LATEST,
        lambda text: [f"global_step{text}_universal", f"global_step{text}"] if is_ascii_number(text) else [text],
        f"no universal step directory (zero/ beside a model-states file) and no {LATEST}", complete_only=True,
    )
    return name, steps, tag


# ---------------------------------------------------------------------------
# one step directory
# ---------------------------------------------------------------------------
@dataclass
class ParamFile:
    """One `zero/<name>/<key>.pt`: its archive, the tensor (or value) it holds and the dict's facts."""

    archive: ts.Archive
    value: Any  # the TensorRef (dict's "param", or the bare tensor), or a plain value
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass
class UStep:
    storage: Storage
    model_archives: dict[int, ts.Archive]  # stages 1/2: {0: mp_rank_00}; stage 3: per rank
    states: dict  # rank 0's model states
    optimizer: ts.Archive | None
    names: list[str]  # zero/<name> directories, in the model's order
    files: dict[str, dict[str, str]]  # name -> {key: relative path of zero/<name>/<key>.pt}
    shapes: dict[str, tuple[int, ...]]  # trained parameters (param_shapes), in order
    stage: int | None
    world: int | None
    problems: list[str] = field(default_factory=list)  # what is missing (validate's missing-file)
    other: list[str] = field(default_factory=list)


def _model_files(files: list[str]) -> dict[int, str]:
    out: dict[int, str] = {}
    for f in sorted(files):
        m = ds.MODEL_FILE.match(f)
        if m and int(m.group("mp")) == 0:
            out[int(m.group("dp")) if m.group("dp") is not None else -1] = f
    return out


def scan(storage: Storage) -> tuple[dict[int, str], bool, dict[str, dict[str, str]], list[str]]:
    """(model-states files by rank, zero/optimizer_state.pt there, zero/<name>/<key>.pt files, other files)."""
    dirs, files = storage.listdir()
    models = _model_files(files)
    refused = [f for f in files if ds.MODEL_FILE.match(f) and f not in models.values()]
    refused += [f for f in files if ds.PIPE_FILE.match(f) or ds.EXPERT_FILE.match(f)]
    if refused:
        raise CorruptMetadataError(f"model-states files of several model-parallel ranks, pipeline stages or experts "
                                   f"({', '.join(sorted(refused)[:3])}): ckpt reads universal checkpoints of one "
                                   "model-parallel rank without pipeline or expert files so far", storage.url)
    params: dict[str, dict[str, str]] = {}
    has_optimizer = False
    other = [f for f in files if f not in models.values()]
    prefix = ZERO + "/"
    for key in storage.list(ZERO) if ZERO in dirs else []:
        rest = key[len(prefix):]
        if rest == OPTIMIZER_STATE:
            has_optimizer = True
            continue
        parts = rest.split("/")
        if len(parts) == 2 and parts[1].endswith(".pt") and len(parts[1]) > 3:
            params.setdefault(parts[0], {})[parts[1][:-3]] = key
        else:
            other.append(key)
    return models, has_optimizer, params, other


def open_step(storage: Storage) -> UStep:
    """Open a universal step directory: every file's zip directory and pickle, no tensor data."""
    models, has_optimizer, params, other = scan(storage)
    if -1 in models:
        model_archives = {0: ts.Archive(storage, models[-1])}
    elif 0 in models:
        model_archives = {r: ts.Archive(storage, f) for r, f in sorted(models.items())}
    else:
        raise NotFoundError("no mp_rank_00_model_states.pt (or zero_pp_rank_0_mp_rank_00_model_states.pt): DeepSpeed's "
                            "universal load reads the module and the parameter shapes there", storage.url)
    first = model_archives[min(model_archives)]
    states = first.obj if isinstance(first.obj, dict) else None
    if states is None:
        raise CorruptMetadataError(f"the model-states object is {type(first.obj).__name__}, not a dict", first.where)
    shapes: dict[str, tuple[int, ...]] = {}
    for group in ds._param_shapes(states, first.where):
        for name, shape in group:
            shapes[name] = shape
    optimizer = ts.Archive(storage, f"{ZERO}/{OPTIMIZER_STATE}") if has_optimizer else None
    stage, world = _stage(optimizer, models)
    problems = []
    if optimizer is None:
        problems.append(f"{ZERO}/{OPTIMIZER_STATE}")
    stored_module = states.get("module")
    module = stored_module if isinstance(stored_module, dict) else {}
    order = list(shapes) + [n for n in module if n not in shapes] + sorted(n for n in params if n not in shapes
                                                                         and n not in module)
    names = [n for n in order if n in params]
    for name in shapes:
        have = params.get(name, {})
        for key in REQUIRED_STATES:
            if key not in have:
                problems.append(f"{ZERO}/{name}/{key}.pt")
    if stage == 3:
        missing = [ds._model_name(r) for r in range(world or 0) if r not in model_archives]
        problems.extend(missing)
    return UStep(storage, model_archives, states, optimizer, names, params, shapes, stage, world, problems, other)


def _stage(optimizer: ts.Archive | None, models: dict[int, str]) -> tuple[int | None, int | None]:
    """The ZeRO stage and DP degree the checkpoint came from: optimizer_state.pt's, else the files'."""
    obj = optimizer.obj if optimizer is not None else None
    stage = obj.get("zero_stage") if isinstance(obj, dict) else None
    count = obj.get("partition_count") if isinstance(obj, dict) else None
    world = count if type(count) is int else max(count) if isinstance(count, list) and count and all(
        type(c) is int for c in count) else None
    if stage is not None and type(stage) in (int, DSZeroStage) and 0 <= int(stage) <= 3:
        return int(stage), world
    return (3 if -1 not in models else None), world


def param_file(step: UStep, name: str, key: str) -> ParamFile:
    """`zero/<name>/<key>.pt` opened: its tensor (the dict's "param" or the object) and facts."""
    archive = ts.Archive(step.storage, step.files[name][key])
    obj = archive.obj
    if isinstance(obj, dict) and PARAM_KEY in obj:
        facts = {}
        for k, v in obj.items():
            if k == PARAM_KEY:
                continue
            if k not in LAYOUT_KEYS or not (v is None or type(v) in (bool, int, float)):
                raise CorruptMetadataError(f"entry {k!r} ({short_repr(v)}) beside the tensor: ckpt reads universal "
                                           f"parameter files holding {', '.join(LAYOUT_KEYS)} so far", archive.where)
            facts[str(k)] = v
        return ParamFile(archive, obj[PARAM_KEY], facts)
    return ParamFile(archive, obj)


def step_leaves(step: UStep) -> tuple[list[Leaf], list[str]]:
    notes: list[str] = []
    model: list[tuple[str, Leaf]] = []
    optim: list[Leaf] = []
    facts_seen: dict[str, int] = {}
    for name in step.names:
        keys = step.files[name]
        shape = step.shapes.get(name)
        order = ([FP32] if FP32 in keys else []) + sorted(k for k in keys if k != FP32)
        for key in order:
            pf = param_file(step, name, key)
            for k, v in pf.facts.items():
                facts_seen[f"{k}={v!r}"] = facts_seen.get(f"{k}={v!r}", 0) + 1
            lname = name if key == FP32 else f"{ds.OPTIMIZER_KEY}.state.{name}.{key}"
            lkeys: tuple[Key, ...] = () if key == FP32 else (ds.OPTIMIZER_KEY, "state", name, key)
            leaf = _leaf(pf, lkeys, lname, shape)
            if key == FP32:
                model.append((name, leaf))
            else:
                optim.append(leaf)
    if facts_seen:
        notes.append("parameter files also record " + ", ".join(f"{k} ({n})" for k, n in sorted(facts_seen.items())))
    names = [n for n, _ in model]
    split = ts.split_keys([(n,) for n in names] + [(ds.OPTIMIZER_KEY, "x"), (ds.ENGINE_KEY, "x")])
    leaves: list[Leaf] = []
    for (name, leaf), leaf_keys in zip(model, split[: len(model)] if split is not None else [(n,) for n in names]):
        leaf.keys = leaf_keys
        leaves.append(leaf)
    if split is None:
        notes.append("parameter names kept whole as keys (split at their dots they would collide)")
    if any(leaf.keys[0] in (ds.OPTIMIZER_KEY, ds.ENGINE_KEY) for leaf in leaves):
        raise CorruptMetadataError(f"a parameter named {ds.OPTIMIZER_KEY!r} or {ds.ENGINE_KEY!r} (ckpt keeps the "
                                   "optimizer state and the engine's state under those keys)", step.storage.url)
    leaves.extend(optim)
    if step.optimizer is not None:
        tree = ts.file_tree(step.optimizer)
        if any(p and p[0] == "state" for p in tree.paths):
            raise CorruptMetadataError(f"{OPTIMIZER_STATE} has a 'state' entry, where ckpt puts the parameters' "
                                       "optimizer state", step.optimizer.where)
        # DeepSpeed's ZeroStageEnum (an int enum) as its value: the stage number, a plain int
        tree.values = [int(v) if isinstance(v, DSZeroStage) else v for v in tree.values]
        leaves.extend(ts.leaves_of(tree, (ds.OPTIMIZER_KEY,)))
    leaves.extend(_engine_leaves(step))
    return leaves, notes


def _leaf(pf: ParamFile, keys: tuple[Key, ...], name: str, shape: tuple[int, ...] | None) -> Leaf:
    archive, value = pf.archive, pf.value
    extra: dict[str, Any] = {"file": archive.name, **pf.facts}
    if not isinstance(value, TensorRef):
        return ValueLeaf(keys=keys, name=name, value_type=ts.value_type(value), dtype=ts.SCALAR_DTYPES.get(type(value)),
                         loader=ts.value_loader(archive, value), extra=extra)
    if shape is not None and len(value.size) == 1 and tuple(value.size) != shape and math.prod(shape) == value.size[0] \
            and (value.stride == (1,) or value.size[0] <= 1):
        # a stage-3 file's flat tensor, given the parameter's shape (the same elements in C order)
        piece = L.Piece(0, 0, 0, value.size[0], 0)
        reader: Any = ds.FlatReader(name, shape, value.dtype, [ds.Source(archive, value, piece, archive.name)])
        extra["stored_shape"] = list(value.size)
        return ArrayLeaf(keys=keys, name=name, shape=shape, dtype=value.dtype, layout=RegularGrid(shape), reader=reader,
                         verifier=reader.verify, extra=extra, unreadable=archive.zip.claim_problem(value))
    leaf = ts.array_leaf(archive, value, keys, name, [])
    leaf.extra.update(pf.facts)
    return leaf


def _engine_leaves(step: UStep) -> list[Leaf]:
    rest = {k: v for k, v in step.states.items() if k not in ds.CONSUMED}
    pairs = [(path, v) for path, v in ts.walk(rest) if path]
    tree = ts.FileTree(step.model_archives[min(step.model_archives)], [p for p, _ in pairs], [v for _, v in pairs])
    return ts.leaves_of(tree, (ds.ENGINE_KEY,))


def read(storage: Storage, *, step: str | int | None = None) -> Checkpoint:
    """A universal step directory, or a root's (`--step`, or `latest_universal`'s); no tensor data read."""
    dirs, files = storage.listdir()
    if is_zero_listing(storage, dirs, files):
        raise zero_folder_error(storage)
    steps: list[StepInfo] = []
    tag_dir = None
    step_storage = storage
    if not is_step_listing(dirs, files):
        tag_dir, steps, _ = pick_step(storage, step)
        step_storage = storage.child(tag_dir)
    elif step not in (None, "latest"):
        raise UsageError(f"--step {step} given, but this is one step directory", storage.url)
    s = open_step(step_storage)
    leaves, notes = step_leaves(s)
    prefix = f"{tag_dir}/" if tag_dir else ""
    missing = [MissingData(prefix + p, "does not exist", [p.split("/")[1]] if p.count("/") == 2 else [])
               for p in s.problems]
    if s.other:
        notes.append(f"other files (not read): {', '.join(s.other[:6])}")
    tag = tag_dir or step_storage.url.rstrip("/").rsplit("/", 1)[-1]
    number = STEP_NUMBER.match(tag)
    return Checkpoint(
        path=storage.url, format=NAME,
        layout={"stage": s.stage, "dp": s.world, "tag": tag, "step_dir": tag_dir, "parameters": len(s.names),
                "files": sum(len(v) for v in s.files.values()) + len(s.model_archives) + (s.optimizer is not None)},
        leaves=leaves, committed=True, saved_at=None, steps=steps,
        step=int(number.group(1)) if number else None, notes=notes, missing=missing,
    )


def layout_text(ck: Checkpoint) -> str:
    """inspect's "format" row: "DeepSpeed universal (global_step2_universal, from ZeRO-3 on 2 data-parallel ranks)"."""
    lay = ck.layout
    origin = f"from ZeRO-{lay.get('stage')}" if lay.get("stage") is not None else "from ZeRO"
    if lay.get("dp"):
        origin += f" on {lay['dp']} data-parallel rank{'s' if lay['dp'] != 1 else ''}"
    return f"DeepSpeed universal ({lay.get('tag')}, {origin})"

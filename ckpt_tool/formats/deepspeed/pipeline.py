"""DeepSpeed pipeline-parallel checkpoints (PipelineModule + PipelineEngine, ZeRO stage 1).

What DeepSpeed 0.19 writes (runtime/pipe/module.py `save_state_dict`, `ckpt_layer_path`;
runtime/engine.py `_save_checkpoint`, `_get_ckpt_name`):

    layer_{i:02d}-model_states.pt        one per layer i of the PipelineModule that has a state_dict,
    layer_{i:02d}-model_{t:02d}-model_states.pt   (the second form with a `model` axis in the topology,
                                        PipeModelDataParallelTopology, as Megatron-DeepSpeed builds it)
                                        holding `layer.state_dict()`: the layer's OWN keys (`norm.weight`,
                                        a buffer `scale`), written by data-parallel rank 0 of its stage
    mp_rank_{s:02d}_model_states.pt     per stage s (DeepSpeed's "model-parallel rank" of a pipeline is
                                        its stage, with tensor parallelism 1): "module" None (the layer
                                        files hold it), buffer_names, param_shapes of the stage's
                                        trained parameters, lr_scheduler, client state...
    zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt
                                        per stage s and data-parallel rank d: ZeRO stage 1 over that
                                        stage's data-parallel group (the stage's parameters only)

Names: DeepSpeed's module (the PipelineModule) names a layer's parameters `<layer index>.<name>`
(it registers each built layer under str(index)) and a TiedLayerSpec's module once, as
`tied_modules.<key>.<name>`; param_shapes and buffer_names use those names, so the consolidated tree
uses them too: each layer file's keys prefixed with its index, as PipelineModule's own state_dict
gives them. A tied module is built on every stage that holds one of its layers and each stage
trains its copy (DeepSpeed all-reduces their gradients): its parameter is in several stages'
param_shapes; the first stage's copy is given (a note names the others). A tied layer's file
(layer_00 for a tied embedding) holds the tied module's weights under its own keys, not under a
name of the module; a layer whose forward_fn uses the tied module (an output projection) has no
state_dict and no file.

The tree: the buffers (from the layer files, floating ones as float32, as zero_to_fp32 casts
them), the trained parameters stage by stage as their fp32 master weights from that stage's
partitions, any other layer-file tensor under a module name (a parameter the optimizer does not
hold: frozen) as stored; the optimizer state per parameter, `optimizer/param_groups` with each
group's parameters from every stage, and stage 0's other records under `engine/`. zero_to_fp32
does not read these checkpoints (it expects one model-states file with a module).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from ...base import dtypes
from ...base.errors import CorruptMetadataError, NotFoundError, UsageError
from ...core.model import ArrayLeaf, Leaf, ValueLeaf
from ...storage import Storage
from ...machinery.torch_save.safe_pickle import TensorRef
from ...machinery.torch_save import reading as ts
from . import layout as L
from . import reader as ds

LAYER_NAME = re.compile(r"^(\d+)\.(.+)$")


@dataclasses.dataclass
class Stage:
    index: int
    step: Any  # reader.Step, or None when the stage has no optimizer-states file at all
    states: dict  # its model states
    missing: list[str]  # its files that do not exist


def _stage_files(files: ds.StepFiles, s: int) -> ds.StepFiles:
    model, optim = files.stages.get(s, ({}, {}))
    return dataclasses.replace(files, mp=s, model=model, optim=optim)


def _stage_count(files: ds.StepFiles, storage: Storage) -> int:
    """The pipeline degree: the stages with files, or more if stage 0's model states record it."""
    n = max(files.stages) + 1 if files.stages else 0
    model0 = files.stages.get(0, ({}, {}))[0]
    if -1 in model0:
        try:
            states = ts.Archive(storage, model0[-1]).obj
        except Exception:  # noqa: BLE001 - validate reports the file itself
            return n
        if isinstance(states, dict):
            dims = states.get("checkpoint_parallel_dimensions")
            pp = dims.get("pp_degree") if isinstance(dims, dict) else None
            if type(pp) is int and pp > 0:
                n = max(n, pp)
    return n


def open_stages(storage: Storage, files: ds.StepFiles) -> list[Stage]:
    """Every stage opened (its model states and optimizer files); a stage whose optimizer files
    are all missing is kept with its parameters (their files named missing)."""
    stages: list[Stage] = []
    world = None
    for s in range(_stage_count(files, storage)):
        sf = _stage_files(files, s)
        if -1 not in sf.model:
            raise NotFoundError(f"mp_rank_{s:02d}_model_states.pt does not exist (it keeps pipeline stage {s}'s "
                                "parameter shapes)", storage.url)
        if not sf.optim:
            stages.append(Stage(s, None, ds._dict(ts.Archive(storage, sf.model[-1]).obj, "the model-states object",
                                                   f"{storage.url}/{sf.model[-1]}"), []))
            continue
        step = ds.open_step(storage, files=sf)
        world = step.world if world is None else world
        if step.world != world:
            raise CorruptMetadataError(f"stage {s}'s partition_count is {step.world}, stage 0's {world}: the stages "
                                       "have one data-parallel degree", step.optims[min(step.optims)].archive.where)
        stages.append(Stage(s, step, step.states, list(step.missing_files)))
    if world is None:
        raise CorruptMetadataError("no *_optim_states.pt files: not a ZeRO checkpoint", storage.url)
    prefix = "bf16_" if files.bf16_prefix else ""
    for st in stages:
        if st.step is None:
            st.missing = [f"{prefix}zero_pp_rank_{r}_mp_rank_{st.index:02d}_optim_states.pt" for r in range(world)]
    return stages


def _stage_shapes(states: dict, where: str) -> list[tuple[str, tuple[int, ...]]]:
    return [p for group in ds._param_shapes(states, where) for p in group]


def _referenced_layers(stages: list[Stage]) -> dict[int, list[str]]:
    """Layer index -> the module names under it that the stages record (parameters and buffers)."""
    out: dict[int, list[str]] = {}
    for st in stages:
        names = [n for group in (st.states.get("param_shapes") or []) if isinstance(group, dict) for n in group]
        buffers = st.states.get("buffer_names")
        names += [b for b in buffers if isinstance(b, str)] if isinstance(buffers, list) else []
        for n in names:
            m = LAYER_NAME.match(str(n))
            if m:
                out.setdefault(int(m.group(1)), []).append(str(n))
    return out


def missing_layer_files(files: ds.StepFiles, stages: list[Stage]) -> list[str]:
    """Layer files that a recorded parameter or buffer name needs and that are not there (named as
    the files present are: with `-model_00` when they have it)."""
    tp = any("-model_" in f.removesuffix("-model_states.pt") for f in files.layers.values())
    return [f"layer_{i:02d}-{'model_00-' if tp else ''}model_states.pt"
            for i in sorted(_referenced_layers(stages)) if i not in files.layers]


def open_leaves(storage: Storage, files: ds.StepFiles, weights: str = "fp32") -> tuple[Any, list[Leaf], list[str]]:
    """(stage 0's Step standing for the whole, with every stage's missing files and problems; the
    consolidated tree; notes). `weights` "module" (--weights module): the model part is the layer
    files' tensors as stored, by the module's names (_module_model), instead of the fp32 master
    weights; the optimizer and engine parts are the same."""
    if weights not in ds.WEIGHTS:
        raise UsageError(f"--weights {weights}: fp32 or module")
    if files.experts:
        raise CorruptMetadataError("a pipeline-parallel checkpoint with MoE expert files: ckpt reads pipeline stages "
                                   f"and MoE experts apart so far ({next(iter(files.experts.values()))})", storage.url)
    stages = open_stages(storage, files)
    where0 = f"{storage.url}/{files.stages[0][0][-1]}"
    notes: list[str] = []
    layer_archives = {i: ts.Archive(storage, f) for i, f in sorted(files.layers.items())}
    missing_layers = missing_layer_files(files, stages)

    model: list[tuple[str, ArrayLeaf]] = []
    given: dict[str, int] = {}  # name -> the stage it was given from
    # buffers: each stage's buffer_names, read from the layer files
    for st in stages:
        buffers = st.states.get("buffer_names")
        for name in buffers if isinstance(buffers, list) else []:
            if not isinstance(name, str) or name in given:
                continue
            buffer = _layer_leaf(name, layer_archives, files, missing_layers, "buffer", cast=True)
            if buffer is not None:
                model.append((name, buffer))
                given[name] = st.index
    optimizer: dict[str, list[Leaf]] = {}
    groups: list[ValueLeaf] = []
    engine: list[Leaf] = []
    tied: dict[str, list[int]] = {}
    trained: list[str] = []
    for st in stages:
        if st.step is None:
            stage_leaves = _missing_stage_leaves(st, where0)
        else:
            stage_leaves, stage_notes = ds.step_leaves(st.step)
            notes.extend(f"stage {st.index}: {n}" for n in stage_notes if not n.startswith("in the module state"))
        for leaf in stage_leaves:
            head = leaf.keys[0] if leaf.keys else None
            if head == ds.OPTIMIZER_KEY:
                if leaf.keys[1:2] == ("param_groups",):
                    groups.append(leaf)  # type: ignore[arg-type]
                elif len(leaf.keys) == 2:  # the run-wide entries (loss_scaler, overflow, ...): stage 0's, as engine
                    if st.index == 0:
                        engine.append(leaf)
                else:
                    optimizer.setdefault(str(leaf.keys[2]), []).append(leaf)
            elif head == ds.ENGINE_KEY:
                if st.index == 0:
                    engine.append(leaf)
            elif isinstance(leaf, ArrayLeaf):
                if leaf.name in given:
                    tied.setdefault(leaf.name, [given[leaf.name]]).append(st.index)
                    _forget(leaf)
                    continue
                given[leaf.name] = st.index
                trained.append(leaf.name)
                model.append((leaf.name, leaf))
    # a stage without optimizer files: its parameters' per-element optimizer state (the keys the other
    # stages hold, e.g. exp_avg / exp_avg_sq) named too, unreadable like its weights
    per_element = _per_element_keys(optimizer, model)
    for st in stages:
        if st.step is None:
            for name, shape in _stage_shapes(st.states, where0):
                if name not in optimizer:
                    optimizer[name] = [_missing_leaf(st, (ds.OPTIMIZER_KEY, "state", name, key),
                                                     f"{ds.OPTIMIZER_KEY}.state.{name}.{key}", shape,
                                                     "optimizer state") for key in per_element]
    for name, where in tied.items():
        notes.append(f"tied: {name} is trained on stages {', '.join(map(str, where))} (each keeps a copy; "
                     f"stage {where[0]}'s is given)")
    # other tensors of the layer files under a module name: parameters the optimizer does not hold
    referenced = _referenced_layers(stages)
    for i, archive in layer_archives.items():
        obj = archive.obj if isinstance(archive.obj, dict) else {}
        if i not in referenced:
            held = [str(k) for k in obj][:4]
            notes.append(f"{files.layers[i]} holds {', '.join(held)}{' ...' if len(obj) > 4 else ''} under no "
                         "name the stages record: a TiedLayerSpec's module (its values are given as tied_modules.*)"
                         if obj else f"{files.layers[i]}: an empty state_dict")
            continue
        for key, ref in obj.items():
            name = f"{i}.{key}"
            if name in given or not isinstance(ref, TensorRef):
                continue
            frozen = _layer_leaf(name, layer_archives, files, missing_layers, "frozen", cast=False)
            if frozen is not None:
                model.append((name, frozen))
                given[name] = -1
                notes.append(f"{name}: in {files.layers[i]} but held by no optimizer (frozen): as stored")

    if weights == "module":
        for _, leaf in model:
            _forget(leaf)
        model, module_notes = _module_model(stages, files, layer_archives)
        notes = [n for n in notes if not n.startswith(("tied:", "layer_"))] + module_notes
    leaves: list[Leaf] = []
    names = [n for n, _ in model]
    split = ts.split_keys([(n,) for n in names] + [(ds.OPTIMIZER_KEY, "x"), (ds.ENGINE_KEY, "x")])
    for (name, leaf), keys in zip(model, split[: len(model)] if split is not None else [(n,) for n in names]):
        leaf.keys = keys
        leaves.append(leaf)
    if split is None:
        notes.append("parameter names kept whole as keys (split at their dots they would collide)")
    for name in trained:
        leaves.extend(_first_stage(optimizer, name))
    if groups:
        leaves.append(_merged_groups(groups))
    leaves.extend(engine)

    # stage 0's Step stands for the checkpoint: every stage's missing files and layout problems
    base = next(st.step for st in stages if st.step is not None)
    missing = [f for st in stages for f in st.missing] + missing_layers
    problems = [f"stage {st.index}: {p}" for st in stages if st.step is not None for p in st.step.mapping.problems]
    step = dataclasses.replace(base, missing_files=missing, mapping=dataclasses.replace(base.mapping, problems=problems))
    return step, leaves, notes


def _module_model(stages: list[Stage], files: ds.StepFiles,
                  archives: dict[int, ts.Archive]) -> tuple[list[tuple[str, ArrayLeaf]], list[str]]:
    """--weights module: every layer file's tensors as stored (the training dtype), named as
    PipelineModule.state_dict() names them: `<index>.<key>`, and a tied module's file (a layer index
    no recorded name is under) `tied_modules.<key>.<name>` for the tied key whose recorded
    parameters it holds, once (the first such file)."""
    recorded = _referenced_layers(stages)
    tied_params: dict[str, set[str]] = {}
    for st in stages:
        for name, _ in _stage_shapes(st.states, f"{files.stages[st.index][0].get(-1)}"):
            m = re.match(r"^tied_modules\.([^.]+)\.(.+)$", name)
            if m:
                tied_params.setdefault(m.group(1), set()).add(m.group(2))
    out: list[tuple[str, ArrayLeaf]] = []
    given: set[str] = set()
    notes = [f"weights: the module's, as the layer files hold them (--weights module), not the fp32 master weights"]
    for i, archive in archives.items():
        obj = archive.obj if isinstance(archive.obj, dict) else {}
        if i in recorded:
            prefix = f"{i}."
        else:
            keys = {str(k) for k in obj}
            match = [k for k, params in tied_params.items() if params and params <= keys]
            if len(match) != 1:
                notes.append(f"{files.layers[i]}: under no name the stages record, and not one tied module's "
                             "(left out)")
                continue
            prefix = f"tied_modules.{match[0]}."
        for key, ref in obj.items():
            name = f"{prefix}{key}"
            if name in given or not isinstance(ref, TensorRef):
                continue
            given.add(name)
            out.append((name, ds._array((), name, tuple(ref.size), ref.dtype, ts.TensorReader(archive, ref, name),
                                        {"file": archive.name, "kind": "module"}, archive.zip.claim_problem(ref))))
    return out, notes


def _first_stage(optimizer: dict[str, list[Leaf]], name: str) -> list[Leaf]:
    """A parameter's optimizer leaves from the first stage that has them (a tied parameter's
    other stages keep their own copies: as for the weights, the first is given)."""
    out: list[Leaf] = []
    seen: set[str] = set()
    for leaf in optimizer.get(name, []):
        if leaf.name not in seen:
            seen.add(leaf.name)
            out.append(leaf)
        else:
            _forget(leaf)
    return out


def _forget(leaf: Leaf) -> None:
    """A leaf not given (another stage's copy): its runs leave the CRC book's expectations."""
    reader = getattr(leaf, "reader", None)
    book = getattr(reader, "_book", None)
    if isinstance(reader, ds.FlatReader) and book is not None:
        for src in reader._sources:
            if src.archive is not None and src.ref is not None:
                book.forget(src.archive, src.ref, src.piece.start, src.piece.count)


def _merged_groups(groups: list[ValueLeaf]) -> ValueLeaf:
    """optimizer/param_groups: stage 0's groups, each group's `params` naming every stage's
    parameters of that group (the stages build their optimizers alike)."""

    def load() -> Any:
        merged: list[Any] = []
        for leaf in groups:
            for g, group in enumerate(leaf.load()):
                if g >= len(merged):
                    merged.append(group)
                elif isinstance(group, dict) and isinstance(merged[g], dict):
                    params = list(merged[g].get("params", []))
                    params += [p for p in group.get("params", []) if p not in params]
                    merged[g] = dict(merged[g], params=params)
        return merged

    first = groups[0]
    return ValueLeaf(keys=first.keys, name=first.name, value_type=first.value_type, loader=load,
                     extra=dict(first.extra, stages=len(groups)))


def _layer_leaf(name: str, archives: dict[int, ts.Archive], files: ds.StepFiles, missing: list[str], kind: str,
                *, cast: bool) -> ArrayLeaf | None:
    """A tensor of a layer file by its module name (`<index>.<key>`); floating buffers cast to
    float32 as zero_to_fp32 casts them."""
    m = LAYER_NAME.match(name)
    if m is None:
        return None  # a tied module's buffer: not in a layer file by this name
    i, key = int(m.group(1)), m.group(2)
    archive = archives.get(i)
    if archive is None:
        fname = next((f for f in missing if f.startswith(f"layer_{i:02d}-")), f"layer_{i:02d}-model_states.pt")
        return ds._array((), name, (), "float32", None, {"kind": kind, "files": [fname]},
                         f"its layer file {fname} does not exist")
    obj = archive.obj if isinstance(archive.obj, dict) else {}
    ref = obj.get(key)
    if not isinstance(ref, TensorRef):
        return ds._array((), name, (), "float32", None, {"kind": kind, "file": archive.name},
                         f"{archive.name} holds no tensor {key!r}")
    inner = ts.TensorReader(archive, ref, name)
    to = "float32" if cast and dtypes.get(ref.dtype).is_float and ref.dtype != "float32" else None
    reader = ds.CastReader(inner, to) if to else inner
    return ds._array((), name, tuple(ref.size), to or ref.dtype, reader, {"file": archive.name, "kind": kind},
                     archive.zip.claim_problem(ref))


def _missing_stage_leaves(st: Stage, where: str) -> list[Leaf]:
    """A stage whose optimizer files are all missing: its parameters, unreadable, naming them."""
    return [_missing_leaf(st, tuple(name.split(".")), name, shape, "parameter")
            for name, shape in _stage_shapes(st.states, where)]


def _missing_leaf(st: Stage, keys: tuple, name: str, shape: tuple[int, ...], kind: str) -> ArrayLeaf:
    numel = 1
    for d in shape:
        numel *= d
    reader = ds.FlatReader(name, shape, "float32", [ds.Source(None, None, L.Piece(0, 0, 0, numel, 0), st.missing[0])])
    return ds._array(keys, name, shape, "float32", reader, {"kind": kind, "files": list(st.missing)},
                     f"stored in {st.missing[0]}, which does not exist")


def _per_element_keys(optimizer: dict[str, list[Leaf]], model: list[tuple[str, ArrayLeaf]]) -> list[str]:
    """The optimizer-state keys the stages hold per element (of the parameter's shape)."""
    shapes = {n: leaf.shape for n, leaf in model}
    for name, leaves in optimizer.items():
        keys = [str(leaf.keys[-1]) for leaf in leaves if isinstance(leaf, ArrayLeaf) and leaf.shape == shapes.get(name)
                and not leaf.unreadable]
        if keys:
            return keys
    return []

"""A DeepSpeed step opened as a Checkpoint (the registry's read): a pipeline-parallel step (layer
files) stage by stage (pipeline.py), any other as one Step (reader.py), its MoE expert files
(moe.py) beside it. Above the modules it dispatches to: pipeline.py builds on reader.py's Step.
"""
from __future__ import annotations

from ...base.errors import UsageError
from ...core.model import ArrayLeaf, Checkpoint, Leaf, MissingData, StepInfo
from ...storage import Storage
from ...machinery.torch_save import reading as ts
from ...machinery.torch_save.safe_pickle import DSLossScaler, TensorRef
from . import moe, pipeline
from .reader import NAME, STEP_DIR, Step, is_step_listing, open_step, pick_step, scan_step, step_leaves


def open_leaves(storage: Storage, weights: str = "fp32") -> tuple[Step, list[Leaf], list[str]]:
    """A step directory opened and its tree (`weights` as step_leaves takes it): a pipeline-parallel
    one (layer files) stage by stage (pipeline.py), any other as one Step."""
    files = scan_step(storage)
    if files.layers:
        return pipeline.open_leaves(storage, files, weights)
    step = open_step(storage, files=files)
    leaves, notes = step_leaves(step, weights)
    # the expert files hold the experts' module weights (the fp32 master weights are in the
    # partitions): opened, so a damaged one is found; a missing one leaves the checkpoint incomplete
    # for DeepSpeed's load_checkpoint
    for name in step.files.experts.values():
        ts.Archive(storage, name)
    step.missing_files.extend(moe.missing_files(step))
    if weights == "module" and step.files.experts:
        notes.append("the experts' weights: from the expert files (layer_L_expert_E_...)")
    return step, leaves, notes


def read(storage: Storage, *, step: str | int | None = None, weights: str | None = None) -> Checkpoint:
    """A step directory, or a root's step (`--step N`, a tag, or `latest`'s); no tensor data is read.
    `weights` (--weights): "fp32" (default) the consolidated fp32 master weights, "module" the
    module's weights the model-states file holds (stages 1/2)."""
    _, files = storage.listdir()
    steps: list[StepInfo] = []
    tag_dir = None
    step_storage = storage
    if not is_step_listing(files):
        tag_dir, steps, _ = pick_step(storage, step)
        step_storage = storage.child(tag_dir)
    elif step not in (None, "latest"):
        raise UsageError(f"--step {step} given, but this is one step directory", storage.url)
    s, leaves, notes = open_leaves(step_storage, weights or "fp32")
    missing = []
    for name in s.missing_files:
        held = [leaf.name for leaf in leaves if isinstance(leaf, ArrayLeaf) and name in leaf.extra.get("files", [])]
        missing.append(MissingData(f"{tag_dir}/{name}" if tag_dir else name, "does not exist", held))
    if s.mapping.problems:
        notes.extend(f"partitions: {p}" for p in s.mapping.problems[:4])
    o0 = s.optims[min(s.optims)]
    if isinstance(o0.loss_scaler, DSLossScaler):
        notes.append(f"loss scale {o0.loss_scaler.cur_scale} ({'dynamic' if o0.loss_scaler.dynamic else 'static'})")
    if s.files.other:
        notes.append(f"other files (not read): {', '.join(s.files.other[:6])}")
    precision = "bf16" if s.files.bf16_prefix else _precision(s)
    number = STEP_DIR.match(tag_dir or step_storage.url.rstrip("/").rsplit("/", 1)[-1])
    return Checkpoint(
        path=storage.url, format=NAME,
        layout={"stage": s.stage, "dp": s.world, "mp": 1, "precision": precision,
                "pp": max(1, len(s.files.stages)) if s.files.layers else 1, "experts": moe.expert_count(s),
                "tag": tag_dir or step_storage.url.rstrip("/").rsplit("/", 1)[-1], "step_dir": tag_dir,
                "groups": len(s.shapes), "files": len(s.optims) + len(s.model_archives), "weights": weights or "fp32",
                "optimizer_files": sorted(o.archive.name for o in s.optims.values())},
        leaves=leaves, committed=True, saved_at=None, steps=steps,
        step=int(number.group(1)) if number else None, notes=notes, missing=missing,
    )


def _precision(step: Step) -> str:
    """The training dtype: the module's floating parameters' (stage 3 keeps empty placeholders of it)."""
    module = step.states.get("module")
    if isinstance(module, dict):
        for ref in module.values():
            if isinstance(ref, TensorRef) and ref.dtype in ("float16", "bfloat16", "float32"):
                return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[ref.dtype]
    config = step.states.get("ds_config")  # a pipeline's model states hold no module: its config says
    if isinstance(config, dict):
        for key, name in (("bf16", "bf16"), ("fp16", "fp16")):
            section = config.get(key)
            if isinstance(section, dict) and section.get("enabled") is True:
                return name
    return "fp32"

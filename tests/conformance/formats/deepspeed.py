"""DeepSpeed ZeRO and DeepSpeed universal: the catalogue rows (tests/conformance/rows.py) of
ckpt_tool/formats/deepspeed (both formats). DeepSpeed 0.19's own views, recorded beside each fixture
(gen_deepspeed.py, gen_deepspeed_pipe_moe.py: DeepSpeed is not in the test venv); a universal
checkpoint ckpt wrote is read with torch.load and stand-ins for DeepSpeed's classes."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from references import Recording, Ref, by_name, np_dtype, torch_to_numpy
from rows import Damage, Entry, FixtureSpec, Library


def _deepspeed_doc(path: Path) -> dict:
    """fixtures/deepspeed_*/_reference.json (gen_deepspeed.py), beside the root or its step directory."""
    path = Path(path)
    for where in (path, path.parent):
        if (where / "_reference.json").exists():
            return json.loads((where / "_reference.json").read_text())
    raise FileNotFoundError(f"no _reference.json at or above {path}")


def _deepspeed_flat(obj: Any, keys: tuple, out: dict) -> None:
    """A recorded engine-state value laid out as ckpt lays out a torch.save object (_torch_walk's
    rule: dicts by key, anything else one value), keyed by dotted name."""
    if isinstance(obj, dict) and obj and "data" not in obj:
        for k, v in obj.items():
            _deepspeed_flat(v, keys + (k,), out)
    else:
        out[by_name(".".join(map(str, keys)))] = obj


def _deepspeed_recorded(path: Path) -> dict:
    """{by_name: ("array", recorded tensor) | ("value", value)}: DeepSpeed 0.19's own views, recorded:
    get_fp32_state_dict_from_zero_checkpoint (the consolidated weights and buffers),
    safe_get_full_optimizer_state (exp_avg / exp_avg_sq per parameter) and the group's step,
    the base optimizer's param_groups, and torch.load's other model-states entries under engine."""
    doc = _deepspeed_doc(path)
    out: dict = {}
    for t in doc["zero_to_fp32"]:
        out[by_name(t["name"])] = ("array", t)
    for name, states in doc["optimizer"].items():
        for key, t in states.items():
            out[by_name(f"optimizer.state.{name}.{key}")] = ("array", t)
    out[by_name("optimizer.param_groups")] = ("value", doc["param_groups"])
    for key, value in doc.get("optimizer_globals", {}).items():  # the loss scaler (by class and __dict__), its flags
        out[by_name(f"optimizer.{key}")] = ("value", DSRecorded(value))
    values: dict = {}
    _deepspeed_flat(doc["state"], ("engine",), values)
    out.update({k: ("value", v) for k, v in values.items()})
    return out


def deepspeed_recorded(path: Path, step: str | None = None) -> dict:
    """fixtures/deepspeed_*/_reference.json: what DeepSpeed 0.19 gave for the checkpoint (see _deepspeed_recorded)."""
    return {k: Ref("array", tuple(t["shape"]), t["dtype"]) if kind == "array" else Ref("value")
            for k, (kind, t) in _deepspeed_recorded(path).items()}


def deepspeed_recorded_values(path: Path, step: str | None = None) -> dict:
    """_reference.json's tensors (bytes, base64) and values, as DeepSpeed gave them."""
    import base64

    import numpy as np

    out = {}
    for key, (kind, t) in _deepspeed_recorded(path).items():
        if kind == "array":
            raw = base64.b64decode(t["data"])
            out[key] = np.frombuffer(raw, dtype=np_dtype(t["dtype"])).reshape(t["shape"])
        else:
            out[key] = t
    return out


@dataclass(frozen=True)
class DSRecorded(Recording):
    """A value of a DeepSpeed file as JSON (gen_deepspeed.py's _object_json, or a live torch.load
    with stand-ins for DeepSpeed's classes): DeepSpeed's objects by class and `__dict__`
    ({"__object__": "deepspeed...LossScaler", "state": {...}}), enum members by class and value;
    the rest as JSON holds it (tuples as lists)."""

    doc: Any

    def matches(self, value: Any) -> bool:
        return _ds_matches(self.doc, value)


def _ds_matches(doc: Any, value: Any) -> bool:
    if isinstance(doc, DSRecorded):
        doc = doc.doc
    if isinstance(value, DSRecorded):
        value = value.doc
    if isinstance(doc, dict) and "__object__" in doc:
        cls = doc["__object__"].rsplit(".", 1)[-1]
        if isinstance(value, dict) and "__object__" in value:
            return value["__object__"] == doc["__object__"] and _ds_matches(doc["state"], value["state"])
        # ckpt's stand-in (a Record of the object's __dict__, named DS + the class's last word)
        if not type(value).__name__.startswith("DS") or not cls.endswith(type(value).__name__[2:]):
            return False
        return _ds_matches(doc["state"], {k: v for k, v in vars(value).items() if k != "unknown"})
    if type(doc).__module__ == "torch" and type(doc).__name__ == "dtype":  # a live torch.load's dtype (fp16's loss scaler)
        return type(value).__name__ == "TorchDType" and repr(value) == str(doc)
    if isinstance(doc, dict) and "__dtype__" in doc:  # the same, recorded (gen_deepspeed.py's _object_json)
        return type(value).__name__ == "TorchDType" and repr(value) == doc["__dtype__"]
    if isinstance(doc, dict) and "__enum__" in doc:
        if isinstance(value, dict) and "__enum__" in value:
            return value == doc
        return type(value) is int and value == doc["value"]  # ckpt gives an int enum as its value
    if isinstance(doc, dict):
        return isinstance(value, dict) and {str(k) for k in value} == set(doc) and \
            all(_ds_matches(doc[str(k)], v) for k, v in value.items())
    if isinstance(doc, (list, tuple)):
        return isinstance(value, (list, tuple)) and len(doc) == len(value) and \
            all(_ds_matches(d, v) for d, v in zip(doc, value))
    return type(doc) is type(value) and doc == value


def _deepspeed_universal_recorded(path: Path) -> dict:
    """{by_name: ("array", recorded tensor) | ("value", JSON)}: torch.load of every file
    ds_to_universal wrote (fixtures/gen_deepspeed.py: write_universal_reference)."""
    doc = _deepspeed_doc(path)
    out: dict = {by_name(t["name"]): ("array", t) for t in doc["tensors"]}
    out.update({by_name(k): ("value", v) for k, v in doc["values"].items()})
    values: dict = {}
    _deepspeed_flat(doc["state"], ("engine",), values)
    out.update({k: ("value", v) for k, v in values.items()})
    return out


def deepspeed_universal_recorded(path: Path, step: str | None = None) -> dict:
    """fixtures/deepspeed_universal_*/_reference.json: torch.load's view of ds_to_universal's output."""
    return {k: Ref("array", tuple(t["shape"]), t["dtype"]) if kind == "array" else Ref("value")
            for k, (kind, t) in _deepspeed_universal_recorded(path).items()}


def deepspeed_universal_recorded_values(path: Path, step: str | None = None) -> dict:
    import base64

    import numpy as np

    out = {}
    for key, (kind, t) in _deepspeed_universal_recorded(path).items():
        if kind == "array":
            raw = base64.b64decode(t["data"])
            out[key] = np.frombuffer(raw, dtype=np_dtype(t["dtype"])).reshape(t["shape"])
        elif key[1].startswith("engine."):
            out[key] = t
        else:
            out[key] = DSRecorded(t)
    return out


def _ds_pickle_module() -> Any:
    """A pickle module for torch.load whose unpickler stands in for DeepSpeed's classes (DeepSpeed is
    not installed here): an object made by NEWOBJ + BUILD keeps its class name and __dict__, an
    enum member its class and value."""
    import pickle
    import types

    class StandIn:
        CLASS = ""

    class EnumStandIn:
        def __init__(self, cls: str, value: Any) -> None:
            self.doc = {"__enum__": cls, "value": value}

    def enum(cls: str) -> Callable[[Any], Any]:
        return lambda value: EnumStandIn(cls, value)

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module.startswith("deepspeed."):
                if name.endswith("Enum"):
                    return enum(f"{module}.{name}")
                return type(name, (StandIn,), {"CLASS": f"{module}.{name}"})
            return super().find_class(module, name)

    mod = types.ModuleType("ds_stand_in_pickle")
    for k in dir(pickle):
        if not k.startswith("__"):
            setattr(mod, k, getattr(pickle, k))
    mod.Unpickler = Unpickler
    mod.StandIn = (StandIn, EnumStandIn)
    return mod


def _ds_json(value: Any, stand_in: tuple[type, type]) -> Any:
    """A torch.load'ed value with DeepSpeed's stand-ins as DSRecorded's JSON; tensors as numpy."""
    import torch

    if isinstance(value, torch.Tensor):
        return torch_to_numpy(value)
    objects, enums = stand_in
    if isinstance(value, enums):
        return value.doc
    if isinstance(value, objects):
        return {"__object__": type(value).CLASS, "state": {k: _ds_json(v, stand_in) for k, v in vars(value).items()}}
    if isinstance(value, dict):
        return {k: _ds_json(v, stand_in) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_ds_json(v, stand_in) for v in value)
    return value


def _ds_walk(obj: Any, keys: tuple) -> Any:
    """(key path, value) as ckpt walks a torch.save object (see gen_deepspeed.py's _walk)."""
    import torch

    def has_tensor(v: Any) -> bool:
        if isinstance(v, torch.Tensor):
            return True
        if isinstance(v, dict):
            return any(has_tensor(x) for x in v.values())
        return isinstance(v, (list, tuple)) and any(has_tensor(x) for x in v)

    if isinstance(obj, dict) and obj and all(type(k) in (str, int) for k in obj):
        for k, v in obj.items():
            yield from _ds_walk(v, keys + (k,))
    elif isinstance(obj, (list, tuple)) and obj and has_tensor(obj):
        for i, v in enumerate(obj):
            yield from _ds_walk(v, keys + (i,))
    else:
        yield keys, obj


def _deepspeed_universal_values(path: Path) -> dict:
    """torch.load of every file of a universal checkpoint (root or step), by the names ckpt gives
    (a stage-3 file's flat tensor reshaped to the recorded shape, as DeepSpeed's load views it)."""
    import math

    import torch

    path = Path(path)
    if (path / "latest_universal").exists() and not (path / "zero").is_dir():
        path = path / (path / "latest_universal").read_text().strip()
    pm = _ds_pickle_module()

    def load(p: Path) -> Any:
        return torch.load(p, map_location="cpu", weights_only=False, pickle_module=pm)

    model = sorted(p for p in path.glob("*_model_states.pt"))[0]
    states = load(model)
    shapes = {n: tuple(s) for group in states["param_shapes"] for n, s in group.items()}
    out: dict = {}
    for pdir in sorted(p for p in (path / "zero").iterdir() if p.is_dir()):
        for f in sorted(pdir.glob("*.pt")):
            key, obj = f.stem, load(f)
            lname = pdir.name if key == "fp32" else f"optimizer.state.{pdir.name}.{key}"
            value = obj["param"] if isinstance(obj, dict) and "param" in obj else obj
            if isinstance(value, torch.Tensor) and pdir.name in shapes and value.dim() == 1 \
                    and tuple(value.shape) != shapes[pdir.name] and value.numel() == math.prod(shapes[pdir.name]):
                value = value.reshape(shapes[pdir.name])
            out[by_name(lname)] = _ds_json(value, pm.StandIn) if isinstance(value, torch.Tensor) else \
                DSRecorded(_ds_json(value, pm.StandIn))
    for keys, value in _ds_walk(load(path / "zero" / "optimizer_state.pt"), ("optimizer",)):
        v = _ds_json(value, pm.StandIn)
        out[by_name(".".join(map(str, keys)))] = v if isinstance(value, torch.Tensor) else DSRecorded(v)
    consumed = {"module", "buffer_names", "param_shapes", "shared_params", "frozen_param_shapes",
                "frozen_param_fragments", "optimizer"}
    rest = {k: v for k, v in states.items() if k not in consumed}
    for keys, value in _ds_walk(rest, ("engine",)):
        out[by_name(".".join(map(str, keys)))] = DSRecorded(_ds_json(value, pm.StandIn))
    return out


# --------------------------------------------------------------------------
# DeepSpeed pipeline-parallel and MoE (fixtures/gen_deepspeed_pipe_moe.py): zero_to_fp32 reads
# neither (its error is recorded), so the reference is DeepSpeed's own per-parameter views
# gathered in the run (safe_get_full_fp32_param / safe_get_full_optimizer_state), the module's
# buffers, rank 0's param_groups (named) and torch.load of mp_rank_00's other entries
# --------------------------------------------------------------------------
def _deepspeed_pipe_moe_recorded(path: Path) -> dict:
    doc = _deepspeed_doc(path)
    out: dict = {by_name(t["name"]): ("array", t) for t in doc["consolidated"]}
    for name, states in doc["optimizer"].items():
        for key, t in states.items():
            out[by_name(f"optimizer.state.{name}.{key}")] = ("array", t)
    out[by_name("optimizer.param_groups")] = ("value", doc["param_groups"])
    for key, value in doc.get("optimizer_globals", {}).items():  # stage 0's loss scaler and its flags
        out[by_name(f"optimizer.{key}")] = ("value", DSRecorded(value))
    values: dict = {}
    _deepspeed_flat(doc["state"], ("engine",), values)
    out.update({k: ("value", v) for k, v in values.items()})
    return out


def deepspeed_pipe_moe_recorded(path: Path, step: str | None = None) -> dict:
    """fixtures/deepspeed_pp*/ and deepspeed_moe_*/_reference.json (see _deepspeed_pipe_moe_recorded)."""
    return {k: Ref("array", tuple(t["shape"]), t["dtype"]) if kind == "array" else Ref("value")
            for k, (kind, t) in _deepspeed_pipe_moe_recorded(path).items()}


def deepspeed_pipe_moe_recorded_values(path: Path, step: str | None = None) -> dict:
    import base64

    import numpy as np

    out = {}
    for key, (kind, t) in _deepspeed_pipe_moe_recorded(path).items():
        if kind == "array":
            out[key] = np.frombuffer(base64.b64decode(t["data"]), dtype=np_dtype(t["dtype"])).reshape(t["shape"])
        else:
            out[key] = t
    return out



ZERO = {"reference": deepspeed_recorded, "values": deepspeed_recorded_values}
UNIVERSAL = {"reference": deepspeed_universal_recorded, "values": deepspeed_universal_recorded_values}
PIPE_MOE = {"reference": deepspeed_pipe_moe_recorded, "values": deepspeed_pipe_moe_recorded_values}

ENTRIES: list[Entry] = [
    # DeepSpeed 0.19 ZeRO (gen_deepspeed.py: 2 gloo ranks on CPU): zero_to_fp32 and DeepSpeed's own
    # per-parameter optimizer state, recorded in _reference.json
    *[Entry(n, "deepspeed", **ZERO) for n in
      ("deepspeed_z1_fp32", "deepspeed_z1_bf16", "deepspeed_z2_fp32", "deepspeed_z2_bf16", "deepspeed_z3_fp32", "deepspeed_z3_bf16")],
    # the same on 4 gloo ranks, fp16 training (dynamic loss scaling), and a transformers Llama (tied embeddings,
    # config.json beside `latest`) trained under ZeRO-3
    *[Entry(n, "deepspeed", **ZERO) for n in
      ("deepspeed_z2_fp32_dp4", "deepspeed_z3_bf16_dp4", "deepspeed_z1_bf16_dp4", "deepspeed_z1_fp16", "deepspeed_z2_fp16",
       "deepspeed_z3_fp16", "deepspeed_z3_hf_llama")],
    # ZeRO-3 bf16 on 4 ranks of an attention model whose sizes 4 does not divide (qkv 63x21, proj 21x21,
    # a 3-element per-head scale), three optimizer groups cut into six sub-groups (sub_group_size)
    Entry("deepspeed_z3_bf16_uneven", "deepspeed", **ZERO),
    Entry("deepspeed_z3_bf16/global_step2", "deepspeed", **ZERO),  # a step directory, given as itself
    # DeepSpeed 0.19's ds_to_universal of each of those (gen_deepspeed.py): torch.load of every file, recorded
    *[Entry(f"deepspeed_universal_{n}", "deepspeed-universal", **UNIVERSAL)
      for n in ("z1_fp32", "z1_bf16", "z2_fp32", "z2_bf16", "z3_fp32", "z3_bf16", "z3_bf16_uneven")],
    Entry("deepspeed_universal_z3_bf16/global_step2_universal", "deepspeed-universal", **UNIVERSAL),  # a universal step directory, given as itself
    # DeepSpeed 0.19 pipeline parallel (2 stages; x2 DP) and MoE (4 experts, ep_size 1 and 2), gloo on CPU
    # (gen_deepspeed_pipe_moe.py): DeepSpeed's per-parameter fp32 weights and Adam state gathered in the run
    *[Entry(n, "deepspeed", **PIPE_MOE,
            refused_by=(("deepspeed-universal", "pipeline-parallel or MoE"),))
      for n in ("deepspeed_pp2_z1", "deepspeed_pp2_dp2_z1", "deepspeed_moe_ep1_z2", "deepspeed_moe_ep2_z2")],
]

DAMAGE: list[Damage] = [
    # deepspeed: a rank's optimizer states (stage 2) or model states (stage 3), `latest`, a model-states file
    Damage("deepspeed", "missing-file", "deepspeed_z2_fp32", "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt",
           "remove", "missing-file"),
    Damage("deepspeed", "missing-file", "deepspeed_z3_fp32", "global_step2/zero_pp_rank_1_mp_rank_00_model_states.pt",
           "remove", "missing-file"),
    Damage("deepspeed", "truncated-file", "deepspeed_z3_bf16",
           "global_step2/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "truncate", "truncated-file"),
    Damage("deepspeed", "wrong-size", "deepspeed_z2_bf16", "global_step2/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
           "empty", "empty-file"),
    Damage("deepspeed", "wrong-size", "deepspeed_z3_fp32", "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt",
           "flip-storage", "bad-chunk", deep=True),
    Damage("deepspeed", "garbage-metadata", "deepspeed_z1_fp32", "latest", "garbage", "bad-metadata"),
    # the 4-rank saves (a middle rank's file) and fp16 training's files (no prefix, the loss scaler's pickle)
    Damage("deepspeed", "missing-file", "deepspeed_z2_fp32_dp4", "global_step2/zero_pp_rank_2_mp_rank_00_optim_states.pt",
           "remove", "missing-file"),
    Damage("deepspeed", "missing-file", "deepspeed_z3_bf16_dp4",
           "global_step2/zero_pp_rank_3_mp_rank_00_model_states.pt", "remove", "missing-file"),
    Damage("deepspeed", "wrong-size", "deepspeed_z3_bf16_dp4",
           "global_step2/bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt", "flip-storage", "bad-chunk", deep=True),
    Damage("deepspeed", "truncated-file", "deepspeed_z2_fp16", "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt",
           "truncate", "truncated-file"),
    Damage("deepspeed", "garbage-metadata", "deepspeed_z3_fp16", "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt",
           "garbage", "bad-metadata"),
    Damage("deepspeed", "garbage-metadata", "deepspeed_z2_fp32", "global_step2/mp_rank_00_model_states.pt", "garbage",
           "bad-metadata"),
    Damage("deepspeed", "path-escape", "deepspeed_z2_fp32", "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt",
           "symlink-out", "path-escape"),
    # deepspeed-universal: a parameter's state file, the optimizer's global state, latest_universal
    Damage("deepspeed-universal", "missing-file", "deepspeed_universal_z2_bf16",
           "global_step2_universal/zero/layers.0.up.weight/exp_avg.pt", "remove", "missing-file"),
    Damage("deepspeed-universal", "missing-file", "deepspeed_universal_z3_fp32",
           "global_step2_universal/zero/optimizer_state.pt", "remove", "missing-file"),
    Damage("deepspeed-universal", "truncated-file", "deepspeed_universal_z1_fp32",
           "global_step2_universal/zero/embed.weight/fp32.pt", "truncate", "truncated-file"),
    Damage("deepspeed-universal", "wrong-size", "deepspeed_universal_z3_bf16",
           "global_step2_universal/zero/mix/exp_avg_sq.pt", "empty", "empty-file"),
    Damage("deepspeed-universal", "wrong-size", "deepspeed_universal_z2_fp32",
           "global_step2_universal/zero/layers.1.down.weight/fp32.pt", "flip-storage", "bad-chunk", deep=True),
    Damage("deepspeed-universal", "garbage-metadata", "deepspeed_universal_z1_bf16", "latest_universal", "garbage",
           "bad-metadata"),
    Damage("deepspeed-universal", "garbage-metadata", "deepspeed_universal_z3_fp32",
           "global_step2_universal/zero/optimizer_state.pt", "garbage", "bad-metadata"),
    Damage("deepspeed-universal", "path-escape", "deepspeed_universal_z2_fp32",
           "global_step2_universal/zero/layers.0.norm.bias/fp32.pt", "symlink-out", "path-escape"),
    # deepspeed pipeline parallel / MoE: a layer file, a stage's optimizer states, an expert file
    Damage("deepspeed", "missing-file", "deepspeed_pp2_z1", "global_step2/layer_02-model_states.pt", "remove",
           "missing-file"),
    Damage("deepspeed", "missing-file", "deepspeed_pp2_z1", "global_step2/zero_pp_rank_0_mp_rank_01_optim_states.pt",
           "remove", "missing-file"),
    Damage("deepspeed", "missing-file", "deepspeed_pp2_dp2_z1", "global_step2/mp_rank_01_model_states.pt", "remove",
           "missing-file"),
    Damage("deepspeed", "missing-file", "deepspeed_moe_ep2_z2", "global_step2/layer_0_expert_3_mp_rank_00_model_states.pt",
           "remove", "missing-file"),
    Damage("deepspeed", "truncated-file", "deepspeed_pp2_dp2_z1",
           "global_step2/zero_pp_rank_1_mp_rank_01_optim_states.pt", "truncate", "truncated-file"),
    Damage("deepspeed", "truncated-file", "deepspeed_moe_ep1_z2",
           "global_step2/layer_0_expert_1_mp_rank_00_model_states.pt", "truncate", "truncated-file"),
    Damage("deepspeed", "wrong-size", "deepspeed_pp2_z1", "global_step2/zero_pp_rank_0_mp_rank_01_optim_states.pt",
           "flip-storage", "bad-chunk", deep=True),
    Damage("deepspeed", "wrong-size", "deepspeed_moe_ep2_z2", "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt",
           "flip-storage", "bad-chunk", deep=True),
    Damage("deepspeed", "garbage-metadata", "deepspeed_pp2_z1", "global_step2/mp_rank_01_model_states.pt", "garbage",
           "bad-metadata"),
]

# torch.load of every file ds_to_universal's layout holds, keyed by the names ckpt gives
LIBRARY = {"deepspeed-universal": Library(_deepspeed_universal_values, named=True)}

FUZZ = [
    # DeepSpeed is not in the test venv: the contract alone (see megatron's rows)
    FixtureSpec("deepspeed_z3_fp32", "deepspeed", None),
    FixtureSpec("deepspeed_z2_bf16", "deepspeed", None),
    # the layouts issue 21 added: fp16 (a loss scaler in the optimizer state), pipeline stages with their
    # layer files and tied module, MoE experts over two expert-parallel ranks
    FixtureSpec("deepspeed_z2_fp16", "deepspeed", None),
    FixtureSpec("deepspeed_pp2_z1", "deepspeed", None),
    FixtureSpec("deepspeed_moe_ep2_z2", "deepspeed", None),
]
FUZZ_WEIGHT = {"deepspeed": 0.04}

# what DeepSpeed restored from the universal fixtures (gen_deepspeed_universal_load.py), the recordings
# themselves: tests/formats/deepspeed/test_deepspeed_universal.py compares ckpt's output with them
NOT_CHECKPOINTS = {"deepspeed_universal_load"}

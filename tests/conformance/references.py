"""What the WRITING library says a fixture holds, in one shape for every format.

A reference is ``{key: Ref}``: ``key`` is the key path ckpt reports (a tuple of
str / int) or, for formats keyed by flat names (safetensors), ``("name", NAME)``
matched against the leaf's ``name``; ``Ref`` says the leaf's kind ("array" or
"value") and, where the library records them, its shape and dtype.

Live loaders call the library itself (orbax-checkpoint 0.12, torch DCP,
safetensors: installed in the test venv); recorded loaders read what the
library of the time wrote beside the fixture (orbax 0.5/0.9/0.11
`_reference.json`, flax / orbax 0.4 / t5x `legacy_jax_reference/`; see
fixtures/README.md). The heavy libraries are imported inside the functions.

``values(fmt, path)`` is the other direction: a checkpoint ckpt WROTE, loaded
by the target format's own library (orbax restore, dcp_to_torch_save +
torch.load, safetensors' safe_open), as ``{key: value}`` for the round trip.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import library_reference as LR
from conftest import FIXTURES

LEGACY = FIXTURES / "legacy_jax_reference"


@dataclass(frozen=True)
class Ref:
    kind: str  # "array" | "value"
    shape: tuple | None = None
    dtype: str | None = None  # numpy / ml_dtypes name; None where the library does not say


def by_name(name: str) -> tuple:
    return ("name", name)


# --------------------------------------------------------------------------
# live: the library installed in the venv
# --------------------------------------------------------------------------


def _orbax_leaf(m: Any) -> Ref:
    import numpy as np
    from orbax.checkpoint import metadata as ocpmd

    if isinstance(m, ocpmd.StringMetadata):
        return Ref("value", (), "string")
    if isinstance(m, ocpmd.ScalarMetadata):
        return Ref("value", (), np.dtype(m.dtype).name)
    if isinstance(m, ocpmd.ArrayMetadata):
        return Ref("array", tuple(int(d) for d in (m.shape or ())), np.dtype(m.dtype).name)
    raise TypeError(f"unexpected orbax metadata leaf {type(m).__name__}")


def _orbax_item(item_dir: str) -> dict:
    return {k: _orbax_leaf(m) for k, m in LR._flatten(LR._pytree_metadata(item_dir)).items()}


def orbax_live(path: Path, step: str | None = None) -> dict:
    """orbax-checkpoint's own metadata API; a manager step: every item, JSON items as values."""
    path = Path(path) / step if step is not None else Path(path)
    p = os.path.abspath(path)
    if LR._is_pytree_item(p):
        return _orbax_item(p)
    out = {}
    for name, item_dir in (LR._composite_items(p) or {}).items():
        if LR._is_pytree_item(item_dir):
            out.update({(name,) + k: v for k, v in _orbax_item(item_dir).items()})
        else:
            out.update({(name,) + k: Ref("value") for k in LR._restore_json(item_dir)})
    return out


def dcp_live(path: Path, step: str | None = None) -> dict:
    """torch.distributed.checkpoint's metadata: tensors with shape and dtype, bytes items as values."""
    out = {}
    for k, sd in LR.dcp_reference(path).items():
        out[k] = Ref("value") if sd is None else Ref("array", sd[0], sd[1])
    return out


def _torch_dtype_name(t: Any) -> str:  # a tensor or a TensorProperties
    return str(t.dtype).removeprefix("torch.")


def _safetensors_files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(path.glob("*.safetensors"))


def safetensors_live(path: Path, step: str | None = None) -> dict:
    """safetensors' safe_open over the checkpoint's files (framework 'pt': numpy holds no bf16 there)."""
    from safetensors import safe_open

    out = {}
    for f in _safetensors_files(Path(path)):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                out[by_name(k)] = Ref("array", tuple(int(d) for d in sl.get_shape()), _st_dtype(sl.get_dtype()))
    return out


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
              "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
              "C64": "complex64", "F8_E8M0": "float8_e8m0fnu"}


def _st_dtype(code: str) -> str:
    return _ST_DTYPES.get(code, code.lower())


def safetensors_dcp_hf(path: Path, step: str | None = None) -> dict:
    """A DCP HuggingFaceStorageWriter save (per-rank shards): torch's own HF storage reader's metadata."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = HuggingFaceStorageReader(str(path)).read_metadata()
    out = {}
    for fqn, item in md.state_dict_metadata.items():
        assert isinstance(item, TensorStorageMetadata), fqn
        out[by_name(fqn)] = Ref("array", tuple(int(d) for d in item.size), _torch_dtype_name(item.properties))
    return out


def _torch_files(path: Path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    index = sorted(path.glob("*.bin.index.json"))
    if index:
        return sorted({path / f for f in json.loads(index[0].read_text())["weight_map"].values()})
    return sorted(p for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))


def _torch_walk(obj: Any, keys: tuple, out: dict) -> None:
    """torch.load's object as ckpt lays a torch.save file out: dicts by key, lists/tuples by index
    only where they hold a tensor (else one value, as DCP keeps such an item); keyed by dotted name."""
    import torch

    if isinstance(obj, dict) and obj and all(type(k) in (str, int) for k in obj):
        for k, v in obj.items():
            _torch_walk(v, keys + (k,), out)
    elif isinstance(obj, (list, tuple)) and obj and any(isinstance(v, torch.Tensor) for v in obj):
        for i, v in enumerate(obj):
            _torch_walk(v, keys + (i,), out)
    else:
        out[by_name(".".join(map(str, keys)))] = obj


def _torch_objects(path: Path) -> dict:
    """torch.load(weights_only=True) of the checkpoint's files (one file, a set or a lone file in a directory)."""
    import torch

    out: dict = {}
    for f in _torch_files(Path(path)):
        _torch_walk(torch.load(f, weights_only=True, map_location="cpu"), (), out)
    return out


def torch_live(path: Path, step: str | None = None) -> dict:
    """torch.load(weights_only=True): tensors with shape and dtype, everything else a value."""
    import torch

    return {k: Ref("array", tuple(v.shape), _torch_dtype_name(v)) if isinstance(v, torch.Tensor) else Ref("value")
            for k, v in _torch_objects(path).items()}


def torch_live_values(path: Path, step: str | None = None) -> dict:
    import torch

    return {k: _torch_to_numpy(v) if isinstance(v, torch.Tensor) else v for k, v in _torch_objects(path).items()}


@dataclass(frozen=True)
class Digest:
    """A tensor recorded by its sha256 (raw little-endian bytes, C order), shape and dtype: what
    fixtures/gen_megatron.py records of megatron's own load, where the values are not kept."""

    sha256: str
    shape: tuple
    dtype: str

    def matches(self, value: Any) -> bool:
        import hashlib

        import numpy as np

        if not isinstance(value, np.ndarray):
            return False
        raw = np.ascontiguousarray(value).tobytes()
        return (tuple(value.shape), str(value.dtype)) == (self.shape, self.dtype) and \
            hashlib.sha256(raw).hexdigest() == self.sha256


@dataclass(frozen=True)
class Recorded:
    """A value gen_megatron.py recorded as JSON: compared where JSON holds it exactly (None, bools,
    numbers, strings, containers of them); tensors inside by digest; what the recording only
    summarises (numpy arrays, tuples of dtypes as dict keys) by its kind."""

    doc: Any

    def matches(self, value: Any) -> bool:
        return _json_matches(self.doc, value)


def _json_matches(doc: Any, value: Any) -> bool:
    import numpy as np

    if isinstance(doc, dict) and "__tensor__" in doc:
        t = doc["__tensor__"]
        return Digest(t["sha256"], tuple(t["shape"]), t["dtype"]).matches(value)
    if isinstance(doc, dict) and ("__ndarray__" in doc or "__type__" in doc or "__object__" in doc
                                  or "__class__" in doc):
        return value is not None
    if isinstance(doc, dict):
        if not isinstance(value, dict) or len(doc) != len(value):
            return False
        keys = {str(k) if not isinstance(k, tuple) else f"({', '.join(map(str, k))})": k for k in value}
        return all(k in keys and _json_matches(v, value[keys[k]]) for k, v in doc.items())
    if isinstance(doc, list):
        return isinstance(value, (list, tuple)) and len(doc) == len(value) and \
            all(_json_matches(d, v) for d, v in zip(doc, value))
    if isinstance(value, np.ndarray):
        return False
    return doc == value and type(doc) is type(value) or (type(doc), type(value)) in ((int, float), (float, int)) \
        and doc == value


def _megatron_save(path: Path, step: str | None) -> dict:
    doc = json.loads((Path(path) / "_reference.json").read_text())
    saves = doc["saves"]
    if "." in saves:
        return saves["."]
    if "weights" in saves:  # a NeMo 2 checkpoint's weights/
        return saves["weights"]
    if step is None:
        step = f"iter_{int(doc['tracker']):07d}" if str(doc.get("tracker", "")).isdigit() else doc["tracker"]
    return saves[step if str(step).startswith("iter_") else f"iter_{int(step):07d}"]


def _megatron_common(doc: Any, keys: tuple, out: dict) -> None:
    """common.pt as ckpt lays a torch.save object out (dicts by key; lists by index only where they
    hold a tensor; anything else one value)."""
    special = isinstance(doc, dict) and any(k in doc for k in ("__tensor__", "__ndarray__", "__class__",
                                                                 "__object__", "__type__"))
    if isinstance(doc, dict) and doc and not special:
        for k, v in doc.items():
            _megatron_common(v, keys + (k,), out)
    elif isinstance(doc, list) and doc and "__tensor__" in json.dumps(doc):
        for i, v in enumerate(doc):
            _megatron_common(v, keys + (i,), out)
    elif keys or doc not in ({}, None):  # (an empty common.pt holds no leaf)
        out[by_name(".".join(map(str, keys)))] = doc


def megatron_recorded(path: Path, step: str | None = None) -> dict:
    """megatron-core's own load, recorded by gen_megatron.py: the logical tensors, each ShardedObject
    by its unique key, and common.pt's values."""
    save = _megatron_save(path, step)
    out = {by_name(".".join(r["keys"])): Ref("array", tuple(r["shape"]), r["dtype"]) for r in save["leaves"]}
    out.update({by_name(o["unique_key"]): Ref("value") for o in save["sharded_objects"]})
    common: dict = {}
    _megatron_common(save["common"], (), common)
    for k, doc in common.items():
        t = doc.get("__tensor__") if isinstance(doc, dict) else None
        out[k] = Ref("array", tuple(t["shape"]), t["dtype"]) if t else Ref("value")
    return out


def megatron_recorded_values(path: Path, step: str | None = None) -> dict:
    save = _megatron_save(path, step)
    out: dict = {by_name(".".join(r["keys"])): Digest(r["sha256"], tuple(r["shape"]), r["dtype"])
                 for r in save["leaves"]}
    out.update({by_name(o["unique_key"]): Recorded(o["value"]) for o in save["sharded_objects"]})
    common: dict = {}
    _megatron_common(save["common"], (), common)
    out.update({k: Recorded(doc) for k, doc in common.items()})
    return out


def _nemo_context(path: Path) -> dict:
    """{by_name: value} of context/model.yaml as PyYAML's safe_load gave it (recorded by gen_megatron.py):
    mappings by key under context.model, anything else one value."""
    doc = json.loads((Path(path) / "_reference.json").read_text())["context"]["model.yaml"]
    out: dict = {}

    def walk(v: Any, keys: tuple) -> None:
        if isinstance(v, dict) and v:
            for k, x in v.items():
                walk(x, keys + (k,))
        else:
            out[by_name(".".join(map(str, keys)))] = v

    walk(doc, ("context", "model"))
    return out


def megatron_nemo_recorded(path: Path, step: str | None = None) -> dict:
    """A NeMo 2 checkpoint: megatron's own load of weights/, and context/model.yaml's values."""
    return {**megatron_recorded(path, step), **{k: Ref("value") for k in _nemo_context(path)}}


def megatron_nemo_recorded_values(path: Path, step: str | None = None) -> dict:
    return {**megatron_recorded_values(path, step), **{k: Recorded(v) for k, v in _nemo_context(path).items()}}


def _megatron_legacy_saves(path: Path, step: str | None) -> dict:
    """{rank prefix: recorded torch.load of that file} for one step of a legacy (mp_rank_*) root:
    model_optim_rng.pt under its rank directory's name, distrib_optim.pt under `<rank>.distrib_optim`."""
    doc = json.loads((Path(path) / "_reference.json").read_text())
    if step is None:
        step = doc["tracker"]
    step_dir = str(step) if not str(step).isdigit() else f"iter_{int(step):07d}"
    out = {}
    for file, save in doc["saves"].items():
        where, rank, name = file.split("/")
        if where == step_dir:
            out[rank if name == "model_optim_rng.pt" else f"{rank}.distrib_optim"] = save
    return out


_ARRAYS = ("__tensor__", "__ndarray__")


def _legacy_walk(doc: Any, keys: tuple, out: dict) -> None:
    """A recorded torch.load object laid out as ckpt lays out a torch.save object: dicts by key,
    lists and tuples by index where they hold a tensor or numpy array, anything else one value."""
    if isinstance(doc, dict) and any(k in doc for k in _ARRAYS):
        out[keys] = doc
        return
    special = isinstance(doc, dict) and any(k in doc for k in ("__class__", "__object__", "__type__", "__bytesio__"))
    if isinstance(doc, dict) and doc and not special:
        for k, v in doc.items():
            _legacy_walk(v, keys + (k,), out)
    elif isinstance(doc, list) and doc and any(a in json.dumps(doc) for a in _ARRAYS):
        for i, v in enumerate(doc):
            _legacy_walk(v, keys + (i,), out)
    else:
        out[keys] = doc


def _megatron_legacy(path: Path, step: str | None) -> dict:
    """{by_name: recorded doc} of every leaf: the rank directory's name, then the file's key path;
    the model's tensors instead merged over the TP ranks under `model`, as megatron's own TP merge
    gave them (`tp_merged`: Megatron-LM's load at TP 2, dist_checkpointing save, load at TP 1)."""
    out: dict = {}
    for prefix, save in _megatron_legacy_saves(path, step).items():
        found: dict = {}
        _legacy_walk(save["summary"], (), found)
        out.update({by_name(".".join(map(str, (prefix,) + k))): doc for k, doc in found.items()
                    if not (k[:1] == ("model",) and isinstance(doc, dict) and "__tensor__" in doc)})
    merged = json.loads((Path(path) / "_reference.json").read_text()).get("tp_merged") or []
    out.update({by_name(".".join(("model", *r["keys"]))): {"__tensor__": r} for r in merged})
    return out


def megatron_legacy_recorded(path: Path, step: str | None = None) -> dict:
    """Megatron-LM's legacy save (--ckpt-format torch): each rank's file as torch.load(weights_only=True)
    gave it (megatron.core's safe globals registered), recorded by gen_megatron.py."""
    out = {}
    for key, doc in _megatron_legacy(path, step).items():
        arr = next((doc[a] for a in _ARRAYS if isinstance(doc, dict) and a in doc), None)
        out[key] = Ref("array", tuple(arr["shape"]), arr["dtype"]) if arr else Ref("value")
    return out


def megatron_legacy_recorded_values(path: Path, step: str | None = None) -> dict:
    """Tensors by their recorded sha256, numpy arrays by kind, values as recorded."""
    out = {}
    for key, doc in _megatron_legacy(path, step).items():
        t = doc.get("__tensor__") if isinstance(doc, dict) else None
        out[key] = Digest(t["sha256"], tuple(t["shape"]), t["dtype"]) if t else Recorded(doc)
    return out


# --------------------------------------------------------------------------
# recorded: what an older library wrote beside the fixture
# --------------------------------------------------------------------------


def _recorded_leaves(path: Path, step: str | None) -> list[dict]:
    """The leaves _reference.json records for one save (a root: its `step`, else its latest)."""
    path = Path(path)
    doc = json.loads((path.parent / "_reference.json").read_text())
    save = doc["saves"][path.name]
    return save["steps"][str(step or save["latest_step"])]["leaves"] if save["kind"] == "root" else save["leaves"]


def orbax_recorded(path: Path, step: str | None = None) -> dict:
    """fixtures/orbax_v0_X/_reference.json: that orbax version's own restore (of the latest step of a root)."""
    out = {}
    for leaf in _recorded_leaves(path, step):
        if leaf["data"] is None or leaf["type"] in ("int", "float"):
            out[tuple(leaf["keys"])] = Ref("value")
        else:
            out[tuple(leaf["keys"])] = Ref("array", tuple(leaf["shape"]), leaf["dtype"])
    return out


def legacy_recorded(name: str) -> Callable[[Path, str | None], dict]:
    """fixtures/legacy_jax_reference/<name>.json: flax 0.7.5 / orbax 0.4.1's restore (gen_legacy_jax.py).

    As tests/test_legacy_jax.py reads it: orbax 0.4 keeps Python step / lr as 0-d arrays in its
    target-less restore (ckpt gives the numbers saved), t5x keeps `version` beside the state, and
    flax's restore of an orbax save turns list indices into str keys.
    """

    def load(path: Path, step: str | None = None) -> dict:
        doc = json.loads((LEGACY / f"{name}.json").read_text())
        out = {}
        for leaf in doc["leaves"]:
            keys = tuple(leaf["keys"])
            if leaf["kind"] == "array":
                ref = Ref("array", tuple(leaf["shape"]), leaf["dtype"])
                if name.startswith("orbax_v0_4") and keys[-1] in ("step", "lr") and ref.shape == ():
                    ref = Ref("value")
                out[keys] = ref
            else:
                out[keys] = Ref("value")
        if name.startswith("t5x"):
            out[("version",)] = Ref("value")
        return out

    load.__name__ = f"legacy_recorded[{name}]"
    return load


STR_KEYS = {"flax_orbax.1", "flax_orbax.2"}  # compare key paths as strings (see legacy_recorded)


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


@dataclass(frozen=True)
class DSRecorded:
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
            out[key] = np.frombuffer(raw, dtype=_np_dtype(t["dtype"])).reshape(t["shape"])
        elif key[1].startswith("engine."):
            out[key] = t
        else:
            out[key] = DSRecorded(t)
    return out


# --------------------------------------------------------------------------
# values: what the writing library restores (live), or restored then (recorded)
# --------------------------------------------------------------------------


def orbax_live_values(path: Path, step: str | None = None) -> dict:
    """orbax's own restore (as host numpy arrays), JSON items flattened; a manager step's items."""
    return LR.orbax_values(Path(path) / step if step is not None else path)


def dcp_live_values(path: Path, step: str | None = None) -> dict:
    """torch's own load (dcp_to_torch_save + torch.load), conj / neg views resolved as torch does."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    keys = LR.dcp_keys(path)
    with tempfile.TemporaryDirectory(prefix="ckpt-conformance-") as tmp:
        dcp_to_torch_save(os.fspath(path), os.path.join(tmp, "full.pt"))
        sd = torch.load(os.path.join(tmp, "full.pt"), weights_only=False)
    out = {}
    for fqn, kp in keys.items():
        obj = sd[fqn] if kp == (fqn,) and fqn in sd else _walk(sd, kp)
        out[kp] = _torch_to_numpy(obj) if isinstance(obj, torch.Tensor) else obj
    return out


def _walk(obj: Any, keys: tuple) -> Any:
    for k in keys:
        obj = obj[k]
    return obj


def safetensors_live_values(path: Path, step: str | None = None) -> dict:
    return values("safetensors", path)


def safetensors_dcp_hf_values(path: Path, step: str | None = None) -> dict:
    """torch's HF storage reader: dcp.load of the per-rank shards into full tensors."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    shapes = safetensors_dcp_hf(path)
    sd = {k[1]: torch.zeros(ref.shape, dtype=getattr(torch, ref.dtype)) for k, ref in shapes.items()}
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(str(path)))
    return {by_name(k): _torch_to_numpy(v) for k, v in sd.items()}


def _np_dtype(name: str) -> Any:
    import ml_dtypes
    import numpy as np

    return np.dtype(getattr(ml_dtypes, name, None) or name)


def orbax_recorded_values(path: Path, step: str | None = None) -> dict:
    """_reference.json's bytes (base64) and Python values, as that orbax version restored them."""
    import base64

    import numpy as np

    out = {}
    for leaf in _recorded_leaves(path, step):
        if leaf["data"] is None or leaf["type"] in ("int", "float"):
            out[tuple(leaf["keys"])] = leaf["value"]
        else:
            raw = base64.b64decode(leaf["data"])
            out[tuple(leaf["keys"])] = np.frombuffer(raw, dtype=_np_dtype(leaf["dtype"])).reshape(leaf["shape"])
    return out


def deepspeed_recorded_values(path: Path, step: str | None = None) -> dict:
    """_reference.json's tensors (bytes, base64) and values, as DeepSpeed gave them."""
    import base64

    import numpy as np

    out = {}
    for key, (kind, t) in _deepspeed_recorded(path).items():
        if kind == "array":
            raw = base64.b64decode(t["data"])
            out[key] = np.frombuffer(raw, dtype=_np_dtype(t["dtype"])).reshape(t["shape"])
        else:
            out[key] = t
    return out


def legacy_recorded_values(name: str) -> Callable[[Path, str | None], dict]:
    """legacy_jax_reference/<name>.json + .npz, with legacy_recorded's adjustments."""

    def load(path: Path, step: str | None = None) -> dict:
        import numpy as np

        doc = json.loads((LEGACY / f"{name}.json").read_text())
        arrays = np.load(LEGACY / f"{name}.npz")
        out = {}
        for leaf in doc["leaves"]:
            keys = tuple(leaf["keys"])
            if leaf["kind"] == "array":
                raw = arrays[leaf["npz"]].tobytes()
                value = np.frombuffer(raw, dtype=_np_dtype(leaf["dtype"])).reshape(leaf["shape"])
                if name.startswith("orbax_v0_4") and keys[-1] in ("step", "lr") and value.shape == ():
                    value = value.item()
                out[keys] = value
            else:
                out[keys] = leaf["value"]
        if name.startswith("t5x"):
            out[("version",)] = 3
        return out

    load.__name__ = f"legacy_recorded_values[{name}]"
    return load


def equal(a: Any, b: Any) -> bool:
    """Arrays: dtype, shape and bytes; containers element-wise; anything else: same type and ==.
    A recorded reference (Digest, Recorded) says itself whether a value matches it."""
    import numpy as np

    if isinstance(b, (Digest, Recorded, DSRecorded)):
        return b.matches(a)
    if isinstance(a, (Digest, Recorded, DSRecorded)):  # a library's view given first
        return a.matches(b)

    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def empty_subtree(v: Any) -> bool:
    """None, [], {}, (): jax's tree flattening gives no leaf for them, so orbax restores none."""
    return v is None or (isinstance(v, (list, tuple, dict)) and not v)


# --------------------------------------------------------------------------
# a checkpoint ckpt wrote, through the target format's own library
# --------------------------------------------------------------------------


def _torch_to_numpy(t: Any) -> Any:
    return LR._tensor_to_numpy(t.resolve_conj().resolve_neg())


def _safetensors_values(path: Path) -> dict:
    from safetensors import safe_open

    out = {}
    for f in _safetensors_files(Path(path)):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[by_name(k)] = _torch_to_numpy(h.get_tensor(k))
    return out


# a writable format -> its library's loader (orbax restore; dcp_to_torch_save + torch.load; safe_open)
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
        return _torch_to_numpy(value)
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


LOADERS: dict[str, Callable[[Path], dict]] = {
    "orbax": LR.orbax_values,
    "dcp": LR.dcp_values,
    "safetensors": _safetensors_values,
    "deepspeed-universal": _deepspeed_universal_values,
}


def values(fmt: str, path: Path) -> dict:
    """{key: value} as the library of `fmt` loads `path` (keys as in `reference`)."""
    if fmt not in LOADERS:
        raise KeyError(f"no library loader for {fmt!r}")
    return LOADERS[fmt](path)


# formats whose library keys leaves by flat name
NAMED = {"safetensors", "torch", "deepspeed-universal"}


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
            out[key] = np.frombuffer(base64.b64decode(t["data"]), dtype=_np_dtype(t["dtype"])).reshape(t["shape"])
        else:
            out[key] = t
    return out

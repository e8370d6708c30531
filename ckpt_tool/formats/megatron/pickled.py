"""Stand-ins for the classes Megatron-Core and Megatron-LM pickle into their checkpoints: data only.

The allow-list unpickler (ckpt_tool/machinery/torch_save/safe_pickle.py) resolves exact (module, name)
pairs and nothing else; ALLOW below is what this format adds for its own files, passed to it
as `extra`. Nothing of Megatron (or argparse, signal, ...) is imported or run: each name maps to
a record of the data the pickle gives it.

What Megatron pickles, by file (fixtures/megatron_*, written by megatron-core 0.13/0.16 and
Megatron-LM core_v0.16.1):
  * `.metadata` (torch_dist): torch's DCP Metadata, plus `all_local_plans` (every rank's
    SavePlan of WriteItems, kept for megatron's cached-plan reuse; strategies/state_dict_saver.py)
    and in 0.13 `mcore_data` on MCoreSavePlan / the Metadata (`nd_reformulated_orig_global_shape`
    per key); 0.15 pickles the top object as MCoreMetadata.
  * `common.pt` and legacy `model_optim_rng.pt` (Megatron-LM): the `argparse.Namespace` of the
    run's arguments, holding megatron enums (ModelType, AttnBackend, ...) and `signal.Signals`;
    megatron.core's own SAFE_GLOBALS (safe_globals.py) name what it considers data there:
    SimpleNamespace, argparse.Namespace, its enums, OptimizerConfig, the rerun-state enums,
    io.BytesIO and signal.Signals.
`plain(value)` turns the stand-ins inside a loaded value into plain data (a namespace into a
dict, an enum into "Name(value)", a torch dtype into "torch.bfloat16") for inspect and convert.
"""
from __future__ import annotations

from typing import Any, ClassVar

from ...core import values
from ...machinery.torch_save.safe_pickle import Metadata, Record, TorchDType, _Fn, _Frozen

_DCP_PLANNER = "torch.distributed.checkpoint.planner"
_MCORE_TORCH = "megatron.core.dist_checkpointing.strategies.torch"


class SavePlan(Record):
    """torch.distributed.checkpoint.planner.SavePlan (a rank's plan, in Megatron's all_local_plans)."""

    FIELDS: ClassVar[tuple[str, ...]] = ("items", "storage_data", "planner_data", "usable")  # (extended below)


class MCoreSavePlan(SavePlan):
    """megatron-core 0.13's SavePlan with its reformulation data."""

    FIELDS = SavePlan.FIELDS + ("mcore_data",)


class MCoreMetadata(Metadata):
    """megatron-core 0.15's Metadata subclass (mcore_data beside torch's fields)."""

    FIELDS = Metadata.FIELDS + ("mcore_data",)


class WriteItem(Record):
    FIELDS = ("index", "type", "bytes_io_data", "tensor_data")


class TensorWriteData(Record):
    FIELDS = ("chunk", "properties", "size")


class BytesIOWriteData(Record):
    FIELDS = ("nbytes",)


class Namespace(_Frozen):
    """argparse.Namespace / types.SimpleNamespace / a dataclass config: its attributes, as data.

    argparse.Namespace pickles as NEWOBJ(cls) + BUILD(attribute dict), SimpleNamespace as
    REDUCE(cls, ()) + BUILD: either way the attributes are kept in `fields`, never set on the
    object, and only one BUILD is accepted. One subclass per pickled class (kind)."""

    __slots__ = ("fields",)
    kind = "namespace"

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and all(s is None or isinstance(s, dict) for s in state):
            merged: dict[Any, Any] = {}
            for part in state:  # (dict state, slot state)
                merged.update(part or {})
            state = merged
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise TypeError(f"{self.kind} state must be a dict of names")
        if getattr(self, "fields", None):
            raise TypeError(f"{self.kind} built twice")
        self.fields = dict(state)

    def __repr__(self) -> str:
        return f"{self.kind}({len(getattr(self, 'fields', {}))} fields)"


def _namespace_class(kind: str) -> type[Namespace]:
    return type(kind.rsplit(".", 1)[-1], (Namespace,), {"__slots__": (), "kind": kind})


class EnumValue(_Frozen):
    """A member of an enum Megatron pickles (REDUCE(EnumClass, (value,))): its class name and value."""

    __slots__ = ("kind", "value")

    def __init__(self, kind: str, value: Any) -> None:
        if type(value) not in (int, str):
            raise TypeError(f"{kind}({value!r}): an enum value is an int or a str")
        self.kind = kind
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EnumValue) and (other.kind, other.value) == (self.kind, self.value)

    def __hash__(self) -> int:
        return hash((self.kind, self.value))

    def __repr__(self) -> str:
        return f"{self.kind}({self.value!r})"


def _enum(kind: str) -> _Fn:
    def make(value: Any) -> EnumValue:
        return EnumValue(kind, value)

    make.__name__ = kind
    return _Fn(make)


def _bytes_io(value: Any = b"", *_: Any) -> bytes:
    """io.BytesIO(initial bytes): Transformer Engine's FP8 extra state; kept as the bytes."""
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError("io.BytesIO holds bytes")
    return bytes(value)


_ENUMS = {
    ("megatron.core.enums", "ModelType"),
    ("megatron.core.transformer.enums", "AttnBackend"),
    ("megatron.core.transformer.enums", "AttnMaskType"),
    ("megatron.core.transformer.enums", "CudaGraphScope"),
    ("megatron.core.transformer.enums", "LayerType"),
    ("megatron.core.rerun_state_machine", "RerunDiagnostic"),
    ("megatron.core.rerun_state_machine", "RerunMode"),
    ("megatron.core.rerun_state_machine", "RerunState"),
    ("signal", "Signals"),
}

ALLOW: dict[tuple[str, str], Any] = {
    (_DCP_PLANNER, "SavePlan"): SavePlan,
    (_DCP_PLANNER, "WriteItem"): WriteItem,
    (_DCP_PLANNER, "TensorWriteData"): TensorWriteData,
    (_DCP_PLANNER, "BytesIOWriteData"): BytesIOWriteData,
    (_DCP_PLANNER, "WriteItemType"): _enum("WriteItemType"),
    (_MCORE_TORCH, "MCoreSavePlan"): MCoreSavePlan,
    (_MCORE_TORCH, "MCoreMetadata"): MCoreMetadata,
    ("argparse", "Namespace"): _namespace_class("argparse.Namespace"),
    ("types", "SimpleNamespace"): _namespace_class("types.SimpleNamespace"),
    ("megatron.core.optimizer.optimizer_config", "OptimizerConfig"): _namespace_class("OptimizerConfig"),
    ("io", "BytesIO"): _Fn(_bytes_io),
    **{(module, name): _enum(name) for module, name in _ENUMS},
}


def plain(value: Any) -> Any:
    """A loaded value with the stand-ins turned into plain data (dicts, strings), for inspect and convert.

    Each object is turned once (values.transform): what the pickle shares stays shared and a
    value holding itself stays a cycle, at a cost of one step per object."""
    return values.transform(value, _plain_atom, key=_plain_key)


def _plain_atom(value: Any) -> Any:
    if isinstance(value, Namespace):
        return dict(value.fields)
    if isinstance(value, (EnumValue, TorchDType)):
        return repr(value)
    if isinstance(value, Record):
        return {f: getattr(value, f) for f in value.FIELDS}
    return value


def _plain_key(key: Any) -> Any:
    return key if isinstance(key, (str, int)) else _key_text(key)


def _key_text(key: Any) -> str:
    """A dict key that is not a str or an int, as Megatron spells it in its own key names: the
    distributed optimizer keys buffers by (param dtype, grad dtype), "(torch.bfloat16, torch.float32)"."""
    if isinstance(key, tuple):
        return "(" + ", ".join(_key_text(k) for k in key) + ")"
    if isinstance(key, (TorchDType, EnumValue)):
        return repr(key)
    return str(key)

"""The one allow-list unpickler for torch.distributed.checkpoint files.

DCP keeps its `.metadata` and every stored item as Python pickles. Loading a
pickle normally imports and calls whatever globals it names, so a hostile
checkpoint could run `os.system`. This unpickler instead resolves only exact
(module, name) pairs from an allow-list, and each resolves to a harmless
stand-in defined here: plain records for the DCP metadata classes, a
`TorchDType` for `torch.float32` and friends, a tuple subclass for
`torch.Size`, a `TensorRef` record for `torch._utils._rebuild_tensor_v2/v3`,
and so on. Nothing outside this module is ever imported or called, and any
other global raises UnsafePickleError before anything runs.

Two modes share the allow-list:
  * metadata mode (`load_metadata`): persistent ids are refused;
  * payload mode (`load_payload`): a torch.save `data.pkl`, whose persistent
    ids name the archive's storages (`('storage', StorageClass, key,
    location, numel)`); they become `StorageRef` records.
"""
from __future__ import annotations

import io
import ntpath
import pickle
import posixpath
import re
import threading
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal, Mapping
from types import MappingProxyType

from ...base import dtypes
from ...core import values
from ...base.errors import CkptError, CorruptMetadataError, UnsafePickleError, short_repr

if TYPE_CHECKING:
    import numpy as np
# (numpy imported only for a pickle that holds numpy values: a DCP .metadata holds none, and
# `ckpt inspect` of a DCP loads no numpy, issue 46)
from . import pickle_scan
from .pickle_budget import PICKLE_ALLOWANCE, memory_budget, memory_limit  # noqa: F401 (memory_budget: the API)

# A real .metadata for a model with tens of thousands of tensors and many
# ranks is tens of MB; torch.save's data.pkl for one tensor is ~200 bytes and
# for a non-tensor item as big as the item. Both caps are far above that and
# far below what would hurt a machine.
MAX_METADATA_BYTES = 1 << 31
MAX_PAYLOAD_PICKLE_BYTES = 256 << 20
# numpy arrays and bytes inside non-tensor items are rebuilt from bytes that
# are already in the pickle, so they cannot exceed its size; this cap is for
# shapes that claim more elements than the bytes given.
_MAX_ELEMENTS = 1 << 40

_STORAGE_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


# ---------------------------------------------------------------------------
# Stand-ins for torch objects
# ---------------------------------------------------------------------------
class _Frozen:
    """Refuses BUILD.

    The unpickler's BUILD opcode calls `__setstate__` when there is one and
    otherwise sets attributes directly. Every allow-listed object (and every
    record the reader later trusts) defines a refusing `__setstate__`, so a
    pickle cannot rename the shared `torch.float32` stand-in, swap a
    function's defaults or enlarge a TensorRef after it was validated.
    Classes are safe too: BUILD on a class finds the plain function and calls
    it with the wrong arguments.
    """

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise TypeError(f"{type(self).__name__} cannot be modified by a pickle")


class _Fn(_Frozen):
    """An allow-listed function, wrapped so BUILD cannot touch its attributes."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def __call__(self, *args: Any) -> Any:  # REDUCE passes positional args only
        return self._fn(*args)

    def __repr__(self) -> str:
        return f"<allow-listed {self._fn.__name__}>"


class TorchDType(_Frozen):
    """`torch.<name>` as a value: compared and hashed by name."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TorchDType) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("torch.dtype", self.name))

    def __repr__(self) -> str:
        return f"torch.{self.name}"


# Every dtype attribute torch has had; the ones ckpt cannot decode are still
# accepted here so that the reader can name them in a clear error instead of
# calling an ordinary torch dtype "unsafe".
_TORCH_DTYPE_NAMES = frozenset(dtypes.TORCH_DTYPE_NAMES) | {
    "complex32", "chalf", "cfloat", "cdouble", "qint8", "quint8", "qint32", "quint4x2", "quint2x4",
    "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16", "float8_e8m0fnu", "float4_e2m1fn_x2",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7", "bool", "float8_e4m3fnuz", "float8_e5m2fnuz",
}
_DTYPE_SINGLETONS = {name: TorchDType(name) for name in _TORCH_DTYPE_NAMES}


class Size(tuple):
    """`torch.Size`: a tuple. Its elements are checked to be ints where the
    reader uses it (dcp._int_tuple), not here."""

    __slots__ = ()

    def __new__(cls, items: Any = ()) -> Size:
        # a copy of its argument, which may be a memoized tuple (or string: a slot per character)
        # of millions: charged first
        if type(items) is not tuple or len(items) > 16:  # (a tensor's dimensions: the common case costs no call)
            try:
                charge(_SLOT * len(items))
            except TypeError:  # no length (an iterator: not something a pickle makes)
                pass
        return tuple.__new__(cls, items)

    def __repr__(self) -> str:
        return f"torch.Size({list(self)})"

    def __setstate__(self, state: Any) -> None:
        raise TypeError("torch.Size cannot be modified by a pickle")


class StorageClass(_Frozen):
    """A torch storage class (`torch.FloatStorage`, `torch.storage.UntypedStorage`)."""

    __slots__ = ("qualname", "dtype")

    def __init__(self, qualname: str, dtype: str | None) -> None:
        self.qualname = qualname
        self.dtype = dtype  # canonical dtype name; None for untyped (byte) storage

    def __repr__(self) -> str:
        return self.qualname


class StorageRef(_Frozen):
    """One storage of a torch.save archive, as named by its persistent id."""

    __slots__ = ("key", "dtype", "location", "numel")

    def __init__(self, key: str, dtype: str | None, location: str, numel: int) -> None:
        self.key = key
        self.dtype = dtype  # None: untyped storage, `numel` counts bytes
        self.location = location
        self.numel = numel

    @property
    def nbytes(self) -> int:
        itemsize = dtypes.get(self.dtype).itemsize if self.dtype else 1
        return self.numel * itemsize

    def __repr__(self) -> str:
        return f"StorageRef(key={self.key!r}, dtype={self.dtype}, numel={self.numel})"


# torch.serialization's deserializers, in the order default_restore_location tries them
# (register_package priorities 10-26): "cpu" exactly; cuda, privateuse1 (named "privateuseone"
# until a plugin renames it), hpu, xpu and mtia by `_deserialize`, which takes the name alone or
# any string re.match-ing `name(:|[0-9]+)` and then parses it as a torch.device (so "cuda:abc"
# and "cuda0" fail); mps: any string starting "mps"; "meta" exactly. Nothing else is restored.
_DESERIALIZERS = (("cpu", None), ("cuda", "CUDA"), ("mps", "an Apple MPS device"), ("meta", None),
                  ("privateuseone", "a privateuse1 backend plugin"), ("hpu", "HPU (Habana's torch plugin)"),
                  ("xpu", "XPU"), ("mtia", "MTIA"))
_DEVICE_INDEX = re.compile(r"(?::(0|[1-9][0-9]*))?")


def restore_location(location: str) -> tuple[str, str] | None:
    """What torch.load, without map_location, does with a storage saved at `location`.

    None: it restores it on any machine ("cpu"). Otherwise (kind, why): "device": only
    where that device is (map_location='cpu' loads it anywhere); "meta": it loads as meta
    tensors, without their values; "invalid": no deserializer torch registers restores it
    (only map_location loads the file).
    """
    for backend, device in _DESERIALIZERS:
        if backend == "cpu":
            if location == "cpu":
                return None
        elif backend == "mps":
            if location.startswith("mps"):  # (storage.mps(): the rest of the string is not read)
                return "device", "an Apple MPS device"
        elif backend == "meta":
            if location == "meta":
                return "meta", "meta tensors, without their values"
        elif location == backend or re.match(f"{backend}(:|[0-9]+)", location):
            index = _DEVICE_INDEX.fullmatch(location, len(backend))
            # the index as c10 parses it: an int (stoi), then an 8-bit DeviceIndex, where -1
            # means "the current device" and any other negative value is refused
            digits = index.group(1) if index else None
            if index is None or (digits is not None and (
                    len(digits) > 10 or int(digits) >= 1 << 31 or (int(digits) + 128) % 256 - 128 < -1)):
                return "invalid", "not a device string torch parses"
            return "device", str(device)
    return "invalid", "a location none of torch's deserializers (cpu, cuda, mps, meta, hpu, xpu, mtia) restores"


class UnsupportedTensorError(CkptError):
    """A tensor torch.save wrote in a form ckpt cannot reproduce (quantized,
    sparse, nested, a tensor subclass, an unknown view bit): refused by name
    rather than read as something it is not."""


class TensorRef(_Frozen):
    """A tensor in a torch.save pickle: a view of one storage (no data yet).

    `conj` / `neg` are torch's lazy view bits (x.conj(), x._neg_view()),
    recorded in the rebuild call's metadata dict: the stored bytes are the
    values BEFORE conjugation / negation, which the reader must apply.
    """

    __slots__ = ("storage", "dtype", "storage_offset", "size", "stride", "requires_grad", "conj", "neg",
                 "load_problem")

    def __init__(
        self,
        storage: StorageRef,
        dtype: str,
        storage_offset: int,
        size: tuple[int, ...],
        stride: tuple[int, ...],
        requires_grad: bool,
        conj: bool = False,
        neg: bool = False,
        load_problem: str | None = None,
    ) -> None:
        self.storage = storage
        self.dtype = dtype  # canonical dtype name
        self.storage_offset = storage_offset  # in elements
        self.size = size
        self.stride = stride  # in elements
        self.requires_grad = requires_grad
        self.conj = conj
        self.neg = neg
        # why torch.load would refuse the rebuild call itself (requires_grad, the attributes it sets),
        # said by the archive's claim_problem with the tensor's name; the pickle still loads, so
        # that validate names the tensor rather than failing the whole file
        self.load_problem = load_problem

    def with_problem(self, problem: str | None) -> TensorRef:
        """This tensor with `problem` (the first one found is kept); itself when there is none."""
        if problem is None or self.load_problem is not None:
            return self
        return TensorRef(self.storage, self.dtype, self.storage_offset, self.size, self.stride,
                         self.requires_grad, self.conj, self.neg, problem)

    def __repr__(self) -> str:
        bits = "".join(f", {b}=True" for b in ("conj", "neg") if getattr(self, b))
        return (
            f"TensorRef({self.dtype}{list(self.size)}, stride={self.stride}, "
            f"offset={self.storage_offset}, storage={self.storage.key!r}{bits})"
        )


def _int_tuple(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int for v in value):
        raise TypeError(f"{what} must be a tuple of ints, got {short_repr(value)}")
    if type(value) is not tuple:
        charge(_SLOT * len(value))  # tuple() copies a list or a Size
    return tuple(value)


# The keys torch._utils.get_tensor_metadata can return (C++ getTensorMetadata:
# the conjugate and negative view bits; torch 2.13 writes nothing else).
_VIEW_BITS = ("conj", "neg")


def _view_bits(metadata: Any) -> tuple[bool, bool]:
    """(conj, neg) from the rebuild call's metadata dict; anything else is refused by name."""
    if metadata is None:
        return False, False
    if not isinstance(metadata, dict):
        raise UnsupportedTensorError(f"tensor metadata {short_repr(metadata)} is not a dict")
    unknown = sorted(str(k) for k in metadata if k not in _VIEW_BITS)
    if unknown:
        raise UnsupportedTensorError(
            f"tensor metadata key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
            "(only torch's 'conj' and 'neg' view bits are understood)"
        )
    for key, value in metadata.items():
        if type(value) is not bool:
            raise UnsupportedTensorError(f"tensor metadata {key!r} is {short_repr(value)}, not a bool")
    return bool(metadata.get("conj", False)), bool(metadata.get("neg", False))


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any,
                    requires_grad: Any, dtype: Any, metadata: Any = None) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise TypeError(f"tensor storage must come from a persistent id, got {type(storage).__name__}")
    if type(storage_offset) is not int or storage_offset < 0:
        raise TypeError(f"invalid storage offset {storage_offset!r}")
    shape = _int_tuple(size, "tensor size")
    strides = _int_tuple(stride, "tensor stride")
    if len(shape) != len(strides):
        raise TypeError(f"size {shape} and stride {strides} differ in rank")
    if any(s < 0 for s in shape) or any(s < 0 for s in strides):
        raise TypeError(f"negative size or stride: {shape} / {strides}")
    conj, neg = _view_bits(metadata)
    if conj and not dtypes.get(dtype).name.startswith("complex"):
        raise UnsupportedTensorError(f"conjugate bit on a {dtype} tensor (torch sets it only on complex ones)")
    return TensorRef(storage, dtype, storage_offset, shape, strides, requires_grad is True, conj, neg,
                     _requires_grad_problem(requires_grad, dtype))


def _requires_grad_problem(value: Any, dtype: str) -> str | None:
    """What torch says setting `requires_grad = value` on a `dtype` tensor (None: it takes it).

    torch's setter takes only a bool (`requires_grad must be a bool`; Parameter's
    `_make_subclass` likewise), and only floating-point and complex tensors may require
    gradients: the same rule decides every way a pickle can set it (the rebuild call,
    Parameter, the attributes of `_rebuild_from_type_v2` / `_rebuild_parameter_with_state`).
    """
    if type(value) is not bool:
        return f"requires_grad is {short_repr(value)}, not a bool: torch.load fails"
    if value and not dtypes.get(dtype).is_float:  # (is_float: every floating and complex dtype)
        article = "an" if dtype[0] in "aeiou" else "a"
        return (f"requires_grad=True on {article} {dtype} tensor: torch.load fails (only floating-point and "
                "complex tensors can require gradients)")
    return None


# The attributes of torch.Tensor and torch.nn.Parameter (torch 2.13) that are data descriptors:
# assigning one runs torch's setter (or fails: a read-only property) instead of storing a plain
# attribute. `[n for n in dir(torch.nn.Parameter) if hasattr(type(inspect.getattr_static(
# torch.nn.Parameter, n)), "__set__")]`. Any other name is kept in the tensor's __dict__, whatever
# its value (Megatron's `tensor_model_parallel`, DeepSpeed's `ds_*`), and says nothing about the data.
_TENSOR_DESCRIPTORS = frozenset({
    "H", "T", "__class__", "__cuda_array_interface__", "__dict__", "__weakref__", "_backward_hooks", "_base",
    "_cdata", "_grad", "_grad_fn", "_has_symbolic_sizes_strides", "_post_accumulate_grad_hooks",
    "_python_dispatch", "_version", "data", "device", "dtype", "grad", "grad_dtype", "grad_fn", "imag", "is_cpu",
    "is_cuda", "is_ipu", "is_leaf", "is_maia", "is_meta", "is_mkldnn", "is_mps", "is_mtia", "is_nested",
    "is_quantized", "is_sparse", "is_sparse_csr", "is_vulkan", "is_xla", "is_xpu", "itemsize", "layout", "mH",
    "mT", "name", "nbytes", "ndim", "output_nr", "real", "requires_grad", "retains_grad", "shape", "volatile",
})


def _state_problem(tensor: TensorRef, state: Any) -> str | None:
    """What torch._utils._set_obj_state(tensor, state) refuses (None: it sets plain attributes only).

    torch takes a dict, or a 2-tuple (dict state, slots state), each falsy (skipped) or with
    `.items()`; any other tuple is "Invalid serialized state". Each item is setattr on the tensor.
    """
    if isinstance(state, tuple):
        if len(state) != 2:
            return f"its state is a tuple of {len(state)}, not (dict, slots): torch.load fails"
        parts: tuple[tuple[str, Any], ...] = (("state", state[0]), ("slots state", state[1]))
    else:
        parts = (("state", state),)
    for what, part in parts:
        # (`if dict_state:`: a tensor there is refused although torch would skip a one-element
        # zero; nothing writes one)
        if not isinstance(part, TensorRef) and _falsy(part):
            continue
        if not isinstance(part, dict):
            return f"its {what} is {_a_type(part)}, not a dict: torch.load fails"
        for key, value in part.items():
            if not isinstance(key, str):
                return f"its {what}'s attribute name {short_repr(key)} is not a string: torch.load fails"
            if key == "requires_grad":
                problem = _requires_grad_problem(value, tensor.dtype)
                if problem is not None:
                    return f"its {what}: {problem}"
            elif key in _TENSOR_DESCRIPTORS and not (key in ("grad", "_grad") and value is None):
                return (f"its {what} sets torch.Tensor's own attribute {key!r} (to {short_repr(value)}), which "
                        "torch.load either refuses or applies to the tensor; ckpt does not follow it")
    return None


def _falsy(value: Any) -> bool:
    try:
        return not value
    except Exception:  # noqa: BLE001 - a stand-in without a truth value: not skipped
        return False


def _a_type(value: Any) -> str:
    name = "tensor" if isinstance(value, TensorRef) else type(value).__name__
    return f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any,
                       requires_grad: Any = False, backward_hooks: Any = None,
                       metadata: Any = None) -> TensorRef:
    """torch._utils._rebuild_tensor_v2: the dtype is the typed storage's."""
    if not isinstance(storage, StorageRef) or storage.dtype is None:
        raise TypeError("_rebuild_tensor_v2 needs a typed storage")
    return _rebuild_tensor(storage, storage_offset, size, stride, requires_grad, storage.dtype, metadata)


def _rebuild_tensor_v3(storage: Any, storage_offset: Any, size: Any, stride: Any,
                       requires_grad: Any, backward_hooks: Any, dtype: Any,
                       metadata: Any = None) -> TensorRef:
    """torch._utils._rebuild_tensor_v3: untyped storage plus an explicit dtype."""
    if not isinstance(dtype, TorchDType):
        raise TypeError(f"_rebuild_tensor_v3 dtype must be a torch dtype, got {dtype!r}")
    return _rebuild_tensor(storage, storage_offset, size, stride, requires_grad,
                           dtypes.from_torch(dtype.name).name, metadata)


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> TensorRef:
    """torch._utils._rebuild_parameter: a Parameter is its tensor (requires_grad checked as torch does)."""
    if not isinstance(data, TensorRef):
        raise TypeError("a Parameter must wrap a tensor")
    # (torch: `Parameter(data, requires_grad)`, whose _make_subclass takes only a bool)
    return data.with_problem(_requires_grad_problem(requires_grad, data.dtype))


def _rebuild_parameter_with_state(data: Any, requires_grad: Any, backward_hooks: Any, state: Any) -> TensorRef:
    """torch._utils._rebuild_parameter_with_state: the Parameter, then its attributes set from `state`."""
    param = _rebuild_parameter(data, requires_grad, backward_hooks)
    return param.with_problem(_state_problem(param, state))


class _TorchTensorClass(_Frozen):
    """`torch.Tensor` as the type argument of `_rebuild_from_type_v2`; never instantiated."""

    __slots__ = ()


TORCH_TENSOR = _TorchTensorClass()


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """torch._tensor._rebuild_from_type_v2: a plain tensor carrying Python attributes.

    Only plain `torch.Tensor` rebuilt by an allow-listed tensor function is
    accepted; the attributes (`state`) are checked as torch sets them
    (_state_problem), then dropped: plain attributes say nothing about the data.
    Tensor subclasses would need their class imported, so they are refused.
    """
    if new_type is not TORCH_TENSOR:
        raise TypeError("only plain torch.Tensor can be rebuilt (tensor subclasses are refused)")
    if func not in (ALLOWED[("torch._utils", "_rebuild_tensor_v2")], ALLOWED[("torch._utils", "_rebuild_tensor_v3")]):
        raise TypeError("_rebuild_from_type_v2 must wrap an allow-listed tensor rebuild")
    if not isinstance(args, tuple):
        raise TypeError("_rebuild_from_type_v2 arguments must be a tuple")
    tensor = func(*args)
    return tensor.with_problem(_state_problem(tensor, state))


_LAYOUTS = frozenset({"torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch.sparse_csc",
                      "torch.sparse_bsr", "torch.sparse_bsc", "torch._mkldnn", "torch.jagged"})


def _get_layout(name: Any) -> str:
    """torch.serialization._get_layout('torch.strided') -> the layout's name."""
    if name not in _LAYOUTS:
        raise ValueError(f"unknown torch layout {name!r}")
    return str(name)


_MEMORY_FORMATS = {0: "contiguous_format", 1: "channels_last", 2: "preserve_format"}


def _mem_format_encoding(value: Any) -> str:
    """The _MEM_FORMAT_ENCODING enum (called with its value) -> the format's name."""
    if type(value) is not int or value not in _MEMORY_FORMATS:
        raise ValueError(f"unknown memory-format encoding {value!r}")
    return _MEMORY_FORMATS[value]


def _torch_device(spec: Any, index: Any = None) -> str:
    if not isinstance(spec, str) or (index is not None and type(index) is not int):
        raise TypeError(f"invalid torch.device({short_repr(spec)}, {short_repr(index)})")
    if index is not None:
        charge(_VALUE + _PER_BYTE * len(spec))  # a new string
    return spec if index is None else f"{spec}:{index}"


def _path_cost(parts: tuple[Any, ...]) -> None:
    """Check a path's parts and charge the string joined from them (each may be a memoized string)."""
    if not all(isinstance(p, str) for p in parts):
        raise TypeError("path parts must be strings")
    charge(_VALUE + _PER_BYTE * sum(len(p) + 1 for p in parts))


def _posix_path(*parts: Any) -> str:
    _path_cost(parts)
    return posixpath.join(*parts) if parts else "."


def _windows_path(*parts: Any) -> str:
    _path_cost(parts)
    return ntpath.join(*parts) if parts else "."


# ---------------------------------------------------------------------------
# Stand-ins for the DCP metadata classes
# ---------------------------------------------------------------------------
class Record:
    """A dataclass-like stand-in rebuilt by NEWOBJ + BUILD.

    Known fields become attributes; unknown ones (from a newer torch) are
    kept in `unknown` rather than set as attributes, so a pickle can never
    overwrite anything but plain data on these objects.
    """

    FIELDS: ClassVar[tuple[str, ...]] = ()
    DEFAULTS: ClassVar[dict[str, Any]] = {}
    _FIELD_SET: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._FIELD_SET = frozenset(cls.FIELDS)
        # a field the pickle left out (an older torch, or NEWOBJ without
        # BUILD) reads as its default from the class: an ordinary attribute
        # lookup, where __getattr__ would cost a Python call per access
        for name in cls.FIELDS:
            setattr(cls, name, cls.DEFAULTS.get(name))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(self.FIELDS):
            raise TypeError(f"{type(self).__name__} takes at most {len(self.FIELDS)} arguments")
        state = dict(zip(self.FIELDS, args))
        state.update(kwargs)
        self.__setstate__(state)

    def __setstate__(self, state: Any) -> None:
        # fast path, taken for every object of a real .metadata (thousands of
        # them): a plain dict whose keys are all known field names
        if type(state) is dict and self._FIELD_SET.issuperset(state):
            # adopt the state dict itself as the attribute dict: a copy would
            # double the memory of a large .metadata (the unpickler's memo
            # keeps the state dicts alive until the end). Fields it lacks read
            # as their defaults from the class (__init_subclass__). The pickle may still add
            # keys to that dict later (through the memo): they stay plain
            # instance data, which neither special-method lookup nor
            # `__class__` ever reads, and the reader checks every field it uses.
            self.__dict__ = state
            return
        # BUILD may pass (dict_state, slot_state) for classes with __slots__
        if isinstance(state, tuple) and len(state) == 2 and all(s is None or isinstance(s, dict) for s in state):
            merged: dict[Any, Any] = {}
            for part in state:
                charge(_DICT_ITEM * len(part or {}))
                merged.update(part or {})
            state = merged
        if not isinstance(state, dict):
            raise TypeError(f"{type(self).__name__} state must be a dict, got {type(state).__name__}")
        charge(_DICT_ITEM * (len(state) + len(self.FIELDS)))  # copied into the attributes (or `unknown`)
        d = self.__dict__
        for name in self.FIELDS:
            d.setdefault(name, self.DEFAULTS.get(name))
        unknown = d.setdefault("unknown", {})
        for key, value in state.items():
            if not isinstance(key, str):
                raise TypeError(f"{type(self).__name__} field name {key!r} is not a string")
            if key in self.FIELDS:
                d[key] = value
            else:
                unknown[key] = value

    # the fields a pickle did not know (none, unless set by the pickle): a read-only empty
    # mapping on the class, so that the class needs no __getattr__ (which would slow every
    # attribute read of the 10^5 records of a large .metadata: it defeats Python's attribute cache)
    unknown: Mapping[str, Any] = MappingProxyType({})

    if TYPE_CHECKING:
        # for the type checker only: a record's fields are its subclass's FIELDS, set per instance
        def __getattr__(self, name: str) -> Any: ...

    def __repr__(self) -> str:
        fields = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.FIELDS)
        return f"{type(self).__name__}({fields})"


class Metadata(Record):
    FIELDS: ClassVar[tuple[str, ...]] = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")


class TensorStorageMetadata(Record):
    FIELDS = ("properties", "size", "chunks")


class BytesStorageMetadata(Record):
    FIELDS = ()


class ChunkStorageMetadata(Record):
    FIELDS = ("offsets", "sizes")


class MetadataIndex(Record):
    """Hashed by identity: storage_data is read as a list of pairs, never looked up."""

    FIELDS = ("fqn", "offset", "index")


class StorageMeta(Record):
    FIELDS = ("checkpoint_id", "save_id", "load_id", "modules")


class StorageInfo(Record):
    """torch.distributed.checkpoint.filesystem._StorageInfo."""

    FIELDS = ("relative_path", "offset", "length", "transform_descriptors")


class TensorProperties(Record):
    """Pickled by torch as a 5-tuple state (its own __getstate__), older ones as a dict."""

    FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
    DEFAULTS = {"layout": "torch.strided", "requires_grad": False,
                "memory_format": "contiguous_format", "pin_memory": False}

    def __setstate__(self, state: Any) -> None:
        if type(state) is tuple and len(state) == 5:
            # the form torch writes, once per tensor: set the five fields directly
            self.__dict__.update(zip(self.FIELDS, state))
            return
        super().__setstate__(state)


# ---------------------------------------------------------------------------
# Stand-ins for the DeepSpeed classes its ZeRO checkpoints pickle (data only)
# ---------------------------------------------------------------------------
# DeepSpeed's engine.save_checkpoint pickles a few of its own objects into the
# optimizer-states files: the loss scaler, the ZeRO stage enum and, per
# parameter, where its slice of the flat partition lies. zero_to_fp32 needs
# `import deepspeed` only to unpickle them; here each is a record of its data,
# nothing of DeepSpeed is imported or run.
class DSLossScaler(Record):
    """deepspeed.runtime.fp16.loss_scaler.LossScaler / DynamicLossScaler (NEWOBJ + BUILD of __dict__)."""

    FIELDS = ("cur_scale", "dynamic", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window",
              "min_scale", "delayed_shift", "cur_hysteresis", "consecutive_hysteresis",
              "raise_error_at_min_scale", "dtype")

    # a value leaf (optimizer/loss_scaler): `diff --values` compares two by their data
    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]


class DSFragmentAddress(Record):
    """deepspeed.utils.tensor_fragment.fragment_address: a parameter's slice of its rank's flat partition."""

    FIELDS = ("numel", "start")


class DSZeroStage(int):
    """deepspeed.runtime.zero.config.ZeroStageEnum(n): an int enum, pickled as a call with its value."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise TypeError("ZeroStageEnum cannot be modified by a pickle")

    def __repr__(self) -> str:
        return f"ZeroStageEnum({int(self)})"


def _zero_stage(value: Any) -> DSZeroStage:
    if type(value) is not int or not 0 <= value <= 3:
        raise ValueError(f"ZeroStageEnum({value!r}) is not a ZeRO stage (0-3)")
    return DSZeroStage(value)


# ---------------------------------------------------------------------------
# Stand-ins for Python and numpy values inside non-tensor items
# ---------------------------------------------------------------------------
def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    """_codecs.encode as protocol 2 uses it for bytes: only latin-1 of a str.

    Other codecs (zlib, bz2, rot13, ...) are refused: a codec can decompress
    unboundedly, and no pickler emits them.
    """
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise TypeError(f"_codecs.encode only supports (str, 'latin1'), got encoding {short_repr(encoding)}")
    charge(_VALUE + len(text))
    return text.encode("latin-1")


def _bytes(value: Any = b"", encoding: Any = None) -> bytes:
    if isinstance(value, (bytes, bytearray)) and encoding is None:
        if type(value) is not bytes:
            charge(_VALUE + len(value))  # a copy (bytes() of bytes is the same object)
        return bytes(value)
    if isinstance(value, str) and encoding in ("latin1", "latin-1"):
        charge(_VALUE + len(value))
        return value.encode("latin-1")
    raise TypeError("bytes() only from bytes or a latin-1 string")  # never bytes(huge_int)


def _bytearray(value: Any = b"", encoding: Any = None) -> bytearray:
    data = _bytes(value, encoding)
    charge(_VALUE + len(data))
    return bytearray(data)


def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if not all(type(v) in (int, float) for v in (real, imag)):
        raise TypeError("complex() only from numbers")
    return complex(real, imag)


def _set(items: Any = ()) -> set:
    items = _plain_sequence(items)
    charge(_SET_ITEM * len(items))
    return set(items)


def _frozenset(items: Any = ()) -> frozenset:
    items = _plain_sequence(items)
    charge(_SET_ITEM * len(items))
    return frozenset(items)


def _plain_sequence(items: Any) -> list:
    if not isinstance(items, (list, tuple)):
        raise TypeError("set() only from a list or tuple")
    charge(_SLOT * len(items))  # a copy of what may be a memoized list of millions
    return list(items)


class _OrderedDict(dict):
    """An OrderedDict as a dict that takes one BUILD: torch's `Module.state_dict()` carries a
    `_metadata` attribute (each module's version), which pickle restores by BUILD after the items;
    torch.load sets it as an attribute. It says nothing about the data and is dropped (finalize
    turns this into a plain dict). Any other attribute is refused."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or any(k != "_metadata" for k in state):
            raise TypeError(f"OrderedDict state {short_repr(state)} (only a state dict's _metadata is understood)")


def _ordered_dict(items: Any = ()) -> dict:
    """collections.OrderedDict -> a dict (pickles fill it by SETITEMS; a state dict's BUILD is taken)."""
    out: dict = _OrderedDict()
    items = _plain_sequence(items)
    charge(_DICT_ITEM * len(items))
    for key, value in items:
        out[key] = value
    return out


# numpy: dtypes with a fixed size and no Python objects
_NUMPY_TYPE_CODE = re.compile(r"^(?:b1|\?|[iu][1248]|f[248]|c(?:8|16))$")


class NumpyDType:
    """numpy.dtype('f8', ...) followed by BUILD (version, byteorder, ...)."""

    def __init__(self, code: Any, align: Any = False, copy: Any = False) -> None:
        if not isinstance(code, str) or not _NUMPY_TYPE_CODE.match(code):
            raise TypeError(f"numpy dtype {code!r} is not a plain numeric type")
        self.code = code
        self.byteorder: Literal["<", ">", "=", "|"] = "="  # __setstate__ admits these only

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) < 2 or state[1] not in ("<", ">", "=", "|"):
            raise TypeError("unsupported numpy dtype state")
        if len(state) >= 5 and (state[2] is not None or state[3] is not None or state[4] is not None):
            raise TypeError("structured and sub-array numpy dtypes are not supported")
        self.byteorder = state[1]

    def resolve(self) -> np.dtype:
        import numpy as np

        dt = np.dtype(self.code)
        return dt.newbyteorder(self.byteorder) if self.byteorder in "<>" else dt


class _NumpyNdarrayClass(_Frozen):
    """`numpy.ndarray` as the first argument of `_reconstruct`; never instantiated."""

    __slots__ = ()


NUMPY_NDARRAY = _NumpyNdarrayClass()


class NumpyArray:
    """numpy.core.multiarray._reconstruct(ndarray, (0,), b'b') + BUILD state."""

    def __init__(self, cls: Any, shape: Any = (0,), typecode: Any = b"b") -> None:
        if cls is not NUMPY_NDARRAY:
            raise TypeError("_reconstruct only rebuilds numpy.ndarray")
        self.array: np.ndarray | None = None

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != 5:
            raise TypeError("unsupported numpy array state")
        _version, shape, dtype, fortran, raw = state
        shape = _int_tuple(shape, "numpy shape")
        if not isinstance(dtype, NumpyDType):
            raise TypeError("numpy array dtype must be a plain numeric dtype")
        if not isinstance(raw, (bytes, bytearray, str)):
            raise TypeError("numpy array data must be bytes (object arrays are refused)")
        dt = dtype.resolve()
        count = 1
        for n in shape:
            if n < 0:
                raise TypeError(f"negative numpy dimension in {short_repr(shape)}")
            count *= n
        if count > _MAX_ELEMENTS or count * dt.itemsize != len(raw):  # (a latin-1 str: a byte per character)
            raise ValueError(f"numpy array {short_repr(shape)} of {dt} does not match its {len(raw)} data bytes")
        # the bytes may be a memoized value rebuilt into many arrays: a str's encoding, a copy, the array
        charge(_VALUE + 3 * len(raw))
        if isinstance(raw, str):
            raw = raw.encode("latin-1")
        import numpy as np

        arr = np.frombuffer(bytes(raw), dtype=dt).reshape(shape, order="F" if fortran else "C")
        self.array = arr.copy(order="C")


def _numpy_scalar(dtype: Any, raw: Any = None) -> Any:
    if not isinstance(dtype, NumpyDType):
        raise TypeError("numpy scalar dtype must be a plain numeric dtype")
    dt = dtype.resolve()
    if not isinstance(raw, (bytes, bytearray, str)) or len(raw) != dt.itemsize:
        raise ValueError("numpy scalar data does not match its dtype")
    if isinstance(raw, str):
        raw = raw.encode("latin-1")
    import numpy as np

    return np.frombuffer(bytes(raw), dtype=dt)[0]


# ---------------------------------------------------------------------------
# The allow-list
# ---------------------------------------------------------------------------
_DCP_METADATA = {
    "Metadata": Metadata,
    "TensorStorageMetadata": TensorStorageMetadata,
    "BytesStorageMetadata": BytesStorageMetadata,
    "ChunkStorageMetadata": ChunkStorageMetadata,
    "TensorProperties": TensorProperties,
    "MetadataIndex": MetadataIndex,
    "StorageMeta": StorageMeta,
    "_MEM_FORMAT_ENCODING": _Fn(_mem_format_encoding),
}

ALLOWED: dict[tuple[str, str], Any] = {}
ALLOWED.update({("torch.distributed.checkpoint.metadata", k): v for k, v in _DCP_METADATA.items()})
ALLOWED.update({
    # torch < 2.2 kept TensorProperties with the sharded-tensor metadata
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"): TensorProperties,
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"): _Fn(_mem_format_encoding),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch", "Size"): Size,
    ("torch", "device"): _Fn(_torch_device),
    ("torch.serialization", "_get_layout"): _Fn(_get_layout),
    ("torch._utils", "_rebuild_tensor_v2"): _Fn(_rebuild_tensor_v2),
    ("torch._utils", "_rebuild_tensor_v3"): _Fn(_rebuild_tensor_v3),
    ("torch._utils", "_rebuild_parameter"): _Fn(_rebuild_parameter),
    ("torch._utils", "_rebuild_parameter_with_state"): _Fn(_rebuild_parameter_with_state),
    ("torch._tensor", "_rebuild_from_type_v2"): _Fn(_rebuild_from_type_v2),
    ("torch", "Tensor"): TORCH_TENSOR,
    ("torch._tensor", "Tensor"): TORCH_TENSOR,
    ("torch.storage", "UntypedStorage"): StorageClass("torch.storage.UntypedStorage", None),
    ("torch", "UntypedStorage"): StorageClass("torch.UntypedStorage", None),
    ("collections", "OrderedDict"): _Fn(_ordered_dict),
    ("builtins", "set"): _Fn(_set),
    ("builtins", "frozenset"): _Fn(_frozenset),
    ("builtins", "complex"): _Fn(_complex),
    ("builtins", "bytes"): _Fn(_bytes),
    ("builtins", "bytearray"): _Fn(_bytearray),
    ("_codecs", "encode"): _Fn(_codecs_encode),
})
ALLOWED.update({("torch", name): dt for name, dt in _DTYPE_SINGLETONS.items()})
ALLOWED.update({
    ("torch", name): StorageClass(f"torch.{name}", dtypes.from_torch_storage(name).name)
    for name in dtypes.TORCH_STORAGE_NAMES
})
# pathlib moved its classes to pathlib._local in Python 3.13
for _module in ("pathlib", "pathlib._local"):
    for _name in ("PosixPath", "PurePosixPath", "Path", "PurePath"):
        ALLOWED[(_module, _name)] = _Fn(_posix_path)
    for _name in ("WindowsPath", "PureWindowsPath"):
        ALLOWED[(_module, _name)] = _Fn(_windows_path)
for _module in ("numpy.core.multiarray", "numpy._core.multiarray"):
    ALLOWED[(_module, "scalar")] = _Fn(_numpy_scalar)
    ALLOWED[(_module, "_reconstruct")] = NumpyArray
ALLOWED[("numpy", "dtype")] = NumpyDType
ALLOWED[("numpy", "ndarray")] = NUMPY_NDARRAY
# DeepSpeed (ZeRO checkpoints): admitted by name as data, never imported
ALLOWED.update({
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): DSLossScaler,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): DSLossScaler,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): DSFragmentAddress,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _Fn(_zero_stage),
})

# torch.save's other tensor rebuilds: real torch output that ckpt cannot
# reproduce as a plain array. Named when met (before their arguments, which
# name further torch globals, are unpickled), never resolved.
_UNSUPPORTED_REBUILDS: dict[tuple[str, str], str] = {
    ("torch._utils", "_rebuild_qtensor"): "a quantized tensor",
    ("torch._utils", "_rebuild_sparse_tensor"): "a sparse tensor (COO/CSR/CSC/BSR/BSC layout)",
    ("torch._utils", "_rebuild_sparse_csr_tensor"): "a sparse CSR tensor",
    ("torch._utils", "_rebuild_nested_tensor"): "a nested tensor",
    ("torch._utils", "_rebuild_meta_tensor_no_storage"): "a meta-device tensor (it has no data)",
    ("torch._utils", "_rebuild_wrapper_subclass"): "a tensor subclass without storage (wrapper subclass)",
    ("torch._utils", "_rebuild_device_tensor_from_cpu_tensor"): "a tensor of a device backend (xla/maia/mtia)",
    ("torch._utils", "_rebuild_device_tensor_from_numpy"): "a tensor of a device backend, saved as numpy",
    ("torch._utils", "_rebuild_xla_tensor"): "an XLA device tensor",
    ("torch._utils", "_rebuild_mlc_tensor"): "an MLC device tensor",
    ("torch._utils", "_rebuild_mkldnn_tensor"): "an MKL-DNN tensor",
    ("torch._tensor", "_rebuild_from_type"): "a tensor subclass",
}

# ---------------------------------------------------------------------------
# Resource limits, checked on the opcodes before the unpickler runs
# ---------------------------------------------------------------------------
# The C unpickler allocates from what the opcodes say: a LONG_BINPUT of index
# 2**28 makes it grow its memo table to 2**29 slots (4 GB) for a 12-byte
# input, and BYTEARRAY8 allocates its claimed length before reading it. So
# one pass over the opcodes first checks what the run would build: memo
# indices (each at most the number of memo stores before it, which is how
# every pickler numbers them), every length field against the bytes actually
# there, the stack depth, the objects made and how deeply MARKs nest. The
# limits are far above what torch writes (its pickler batches dict and list
# items by 1,000, so a .metadata's stack stays ~1,000 deep and its MARKs ~10).
# Values nested without MARKs (TUPLE1 chains) are bounded by the object
# count, and `finalize` turns a RecursionError into a clear error.
MAX_MEMO_ENTRIES = 1 << 24
MAX_STACK_DEPTH = 1 << 20
MAX_OBJECTS = 1 << 25
MAX_NESTING = 200
# LONG4 integers: 1 KiB is ~2,500 decimal digits (Python refuses to print
# more than 4,300); nothing torch stores needs a tenth of that
MAX_LONG_BYTES = 1 << 10

# ---------------------------------------------------------------------------
# Memory: what unpickling will take, estimated from the opcodes before it runs
# ---------------------------------------------------------------------------
# The limits above bound counts, not bytes: within them a 2 MB run of one-byte
# EMPTY_SET opcodes builds 480 MB of sets, and a payload at its size cap could
# take tens of GB. So the walk also adds up a conservative byte cost of what
# the C unpickler will allocate for each opcode (CPython 3.11-3.13, 64-bit;
# sizes include the GC header and allocator rounding), and a pickle whose
# estimate exceeds the limit is refused before anything is built. What the
# allow-listed stand-ins build beyond one fixed-size object per call (a
# torch.Size copying a memoized tuple, a path joined from memoized strings, a
# numpy array copied from its bytes) is charged by the stand-in itself, at
# run time and before it allocates (`charge`), against what the estimate left.
#
# The limit is the run's memory budget (--memory, set by the core through
# pickle_budget.memory_budget; default 512 MiB) plus a fixed allowance
# (pickle_budget.PICKLE_ALLOWANCE).
_SLOT = 24  # a reference in a list, tuple or the stack: 8 bytes, x1.125 growth, x2 while reallocated
_MEMO = 24  # a memo entry: the memo array doubles (x2), and is copied when it does
_DICT_ITEM = 192  # a dict entry (24 B) at the lowest fill after a resize, its index, the old table while resizing
_SET_ITEM = 160  # a set entry (16 B): the table grows x4 at 60% fill, the old one kept while resizing
_VALUE = 96  # a str/bytes object's header, the read buffer's; plus _PER_BYTE for each byte of its argument
_PER_BYTE = 5  # a string's characters up to 4 bytes each (UCS-4), and the byte read
_CALL = 128  # the one object a REDUCE/NEWOBJ/OBJ/INST call returns (a record, a TensorRef: ~100 B)
# a container as the walks after the load keep it (object_tree.tensor_holders: its id and an entry of
# a dict, ~114 B measured with tracemalloc over 200,000 one-item lists, the dict's resize included):
# 2 million empty sets in a 4 MB torch.save peaked at 1.7 GB against an estimate of 0.7 GB
_TREE = 128


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB" if n < 10 << 30 else f"{n / (1 << 30):,.1f} GiB"


def _over_limit(limit: int) -> str:
    # (the walk stops counting once past the limit: "more than" is all it knows)
    budget = limit - PICKLE_ALLOWANCE
    return (f"unpickling it would take more than the {_mib(limit)} of memory allowed "
            f"(the {_mib(budget)} memory budget + {_mib(PICKLE_ALLOWANCE)} for pickles); "
            "a larger --memory admits it")


class PickleMemoryError(CorruptMetadataError):
    """A pickle that would take more memory to unpickle than the limit allows."""


class _Allowance:
    """What a stand-in may still allocate while one pickle loads (per thread: loads run in workers)."""

    local = threading.local()


def charge(nbytes: int) -> None:
    """Count `nbytes` a stand-in is about to allocate against the pickle being loaded.

    A no-op outside SafeUnpickler loads (a format's own unpickler that only
    ran check_limits). Raises PickleMemoryError, before the allocation, once
    the load's allowance is spent.
    """
    left = getattr(_Allowance.local, "left", None)
    if left is None:
        return
    left -= nbytes
    _Allowance.local.left = left
    if left < 0:
        limit = _Allowance.local.limit
        raise PickleMemoryError(_over_limit(limit))


def _cost_tables() -> tuple[list[int], list[int], list[int]]:
    """Per opcode byte: the fixed cost and the cost per element a MARK-popping opcode takes in (the
    walk's tables), and the most a byte can cost wherever it is in a pickle that pickle_scan proves
    within the limits (the fast bound's table)."""
    import pickletools

    fixed = [0] * 256
    per_element = [0] * 256
    fast = [_PER_BYTE] * 256  # an argument byte: at most a string's
    sizes = {
        "EMPTY_LIST": 64 + _TREE, "LIST": 64 + _TREE, "EMPTY_DICT": 224 + _TREE, "DICT": 224 + _TREE,  # (a dict with its first keys table)
        "EMPTY_SET": 224 + _TREE, "FROZENSET": 224 + _TREE, "TUPLE": 48 + _TREE, "TUPLE1": 48 + _SLOT + _TREE,
        "TUPLE2": 56 + 2 * _SLOT + _TREE, "TUPLE3": 64 + 3 * _SLOT + _TREE, "BININT": 32, "BININT2": 32, "BINFLOAT": 32, "INT": 32, "LONG": 32, "FLOAT": 32,
        "LONG1": 32, "LONG4": 32, "REDUCE": _CALL, "NEWOBJ": _CALL, "NEWOBJ_EX": _CALL, "OBJ": _CALL,
        "INST": _CALL, "BINPERSID": 2 * _CALL, "PERSID": 2 * _CALL,  # (a StorageRef and its entry by key)
        "MEMOIZE": _MEMO, "BINPUT": _MEMO, "LONG_BINPUT": _MEMO, "PUT": _MEMO, "MARK": 8,
        "APPEND": _SLOT, "SETITEM": _DICT_ITEM,
    }
    elements = {"LIST": _SLOT, "TUPLE": _SLOT, "APPENDS": _SLOT, "DICT": _DICT_ITEM // 2,
                "SETITEMS": _DICT_ITEM // 2, "FROZENSET": _SET_ITEM, "ADDITEMS": _SET_ITEM}
    # opcodes that make no new stack value; each value the others make may end up in a container, and the
    # fast bound charges it the dearest place: a list's slot or half a dict entry (pickle_scan proves no
    # pickle that fills a set by opcodes: ADDITEMS and FROZENSET are outside its pattern)
    not_new = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD", "MEMOIZE", "PUT", "BINPUT",
               "LONG_BINPUT", "POP", "POP_MARK", "MARK", "FRAME", "PROTO", "STOP"}
    dearest = max(_SLOT, _DICT_ITEM // 2)
    for op in pickletools.opcodes:
        b = op.code.encode("latin-1")[0]
        fixed[b] = sizes.get(op.name, 0)
        per_element[b] = elements.get(op.name, 0)
        has_value = op.arg is not None and op.arg.n < 0  # a length-prefixed value or a text line
        new_value = bool(op.stack_after) and op.name not in not_new
        fast[b] += fixed[b] + (_VALUE if has_value else 0) + (dearest if new_value else 0)
    return fixed, per_element, fast


_FIXED_COST, _ELEMENT_COST, _FAST_COST = _cost_tables()


def _cost_classes(costs: list[int]) -> tuple[bytes, list[int]]:
    """A translation table mapping each byte value to the index of its cost among the distinct
    costs (a few dozen), and those costs: fast_memory_bound counts classes, not 256 byte values."""
    distinct = sorted(set(costs))
    index = {c: i for i, c in enumerate(distinct)}
    return bytes(index[c] for c in costs), distinct


_FAST_CLASS_TABLE, _FAST_CLASS_COSTS = _cost_classes(_FAST_COST)
_COUNT_BLOCK = 1 << 22


def fast_memory_bound(data: bytes) -> int:
    """An upper bound on what unpickling `data` takes, from how often each byte value occurs (C speed).

    Valid for a pickle that pickle_scan proves within the limits (its memo
    indices, no set filled by opcodes): every byte is charged as the dearest
    thing it can be, an opcode (its object and its value's place in a
    container) or a byte of a string; the stack is at most MAX_STACK_DEPTH
    slots, a frame's read buffer and the input at most the data's size each.
    (~100 bytes a byte for a DCP .metadata, which takes ~12; walk_limits
    estimates ~30.)
    """
    # each byte mapped to its cost class (bytes.translate), then each class counted (bytes.count, a
    # C loop): ~5 ms a MB, without numpy, which a DCP inspect otherwise need not import (issue 46);
    # a block at a time, so that the translated copy stays small
    total = 0
    classes = range(1, len(_FAST_CLASS_COSTS))  # (class 0, the cheapest: what the others leave)
    view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data
    for start in range(0, len(view), _COUNT_BLOCK):
        block = bytes(view[start:start + _COUNT_BLOCK]).translate(_FAST_CLASS_TABLE)
        rest = len(block)
        for k in classes:
            n = block.count(k)
            total += n * _FAST_CLASS_COSTS[k]
            rest -= n
        total += rest * _FAST_CLASS_COSTS[0]
    return total + MAX_STACK_DEPTH * _SLOT + 2 * len(data)


def _tables() -> tuple[list[int], list[int], list[int]]:
    """Per opcode byte: argument kind, stack delta, and the MARK action.

    Argument kinds: N > 0 fixed bytes; -1/-4/-8 a length of that many bytes
    then the value; -10 one text line, -20 two. Unknown bytes get kind -99.
    MARK actions: 1 MARK, 2 pop to MARK and push one (TUPLE, LIST, DICT, ...),
    3 pop to MARK into the container below (APPENDS, ...) or drop (POP_MARK).
    """
    import pickletools

    arg = [-99] * 256
    delta = [0] * 256
    mark = [0] * 256
    argkind = {
        "uint1": 1, "uint2": 2, "int4": 4, "uint4": 4, "uint8": 8, "float8": 8,
        "long1": -1, "string1": -1, "bytes1": -1, "unicodestring1": -1,
        "long4": -4, "string4": -4, "bytes4": -4, "unicodestring4": -4,
        "bytes8": -8, "bytearray8": -8, "unicodestring8": -8,
        "decimalnl_short": -10, "decimalnl_long": -10, "floatnl": -10, "stringnl": -10,
        "unicodestringnl": -10, "stringnl_noescape": -10, "stringnl_noescape_pair": -20,
    }
    for op in pickletools.opcodes:
        b = op.code.encode("latin-1")[0]
        arg[b] = argkind[op.arg.name] if op.arg is not None else 0
        before = [s.name for s in op.stack_before]
        if op.name == "MARK":
            mark[b] = 1
        elif "mark" in before:
            mark[b] = 3 if op.name in ("APPENDS", "SETITEMS", "ADDITEMS", "POP_MARK") else 2
        else:
            delta[b] = len(op.stack_after) - len(before)
    return arg, delta, mark


_ARG, _DELTA, _MARK = _tables()
_LONG_BINPUT, _PUT, _BINPUT, _MEMOIZE, _LONG4, _BYTEARRAY8, _FRAME, _STOP = b"rpq\x94\x8b\x96\x95."


# Below this size the walk takes a few milliseconds, less than compiling
# pickle_scan's pattern (~15 ms, once per process).
FAST_SCAN_MIN_BYTES = 128 << 10


def check_limits(data: bytes, where: str, *, fast: bool | None = None, limit: int | None = None) -> int:
    """Refuse a pickle whose opcodes would take the unpickler past a limit; the memory it would take.

    A large pickle is first matched against pickle_scan's pattern, which
    proves in C that no count limit can be reached, and its memory bounded
    from its bytes' counts (fast_memory_bound); when either fails (or `fast`
    is False, or the pickle is small and `fast` is not True) walk_limits
    decides, with the walk's own errors and its closer estimate. `fast=True`
    skips the walk after a proof whatever the size (tests run both ways).
    `limit`: the memory allowed (default: memory_limit(), the budget in force).
    Returns the estimate (bytes) of what unpickling will take, the data included.
    """
    if limit is None:
        limit = memory_limit()
    if fast is None:
        fast = len(data) >= FAST_SCAN_MIN_BYTES
    if fast and pickle_scan.within_limits(data, MAX_STACK_DEPTH, MAX_OBJECTS):
        bound = fast_memory_bound(data)
        if bound <= limit:
            return bound
    return walk_limits(data, where, limit)


def walk_limits(data: bytes, where: str, limit: int | None = None) -> int:
    """Walk the opcodes, counting what the unpickler would build; refuse past a limit.

    Returns the estimated bytes unpickling takes (the data, the objects, the
    memo, the stack and a frame's read buffer: see "Memory" above) and
    refuses (PickleMemoryError) when it exceeds `limit` (default:
    memory_limit()). Malformed input (a truncated pickle, an unknown opcode,
    a stack underflow) ends the walk quietly: the unpickler then reports it,
    before reaching anything this walk did not check.
    """
    if limit is None:
        limit = memory_limit()
    n = len(data)
    # the input, and the unpickler's read buffer of the largest frame (at most the input again)
    base = 2 * n
    pos = depth = objects = stores = peak = 0
    cost = base
    marks: list[int] = []
    arg_of, delta_of, mark_of, fixed_of, element_of = _ARG, _DELTA, _MARK, _FIXED_COST, _ELEMENT_COST

    def refuse(what: str, at: int) -> None:
        raise CorruptMetadataError(f"pickle refused at byte {at}: {what}", where)

    def estimate() -> int:
        total = cost + peak * _SLOT
        if total > limit:
            raise PickleMemoryError(_over_limit(limit), where)
        return total

    while pos < n:
        b = data[pos]
        kind = arg_of[b]
        at = pos
        pos += 1
        cost += fixed_of[b]
        if kind > 0:
            if b == _LONG_BINPUT or b == _FRAME:
                value = int.from_bytes(data[pos:pos + kind], "little")
                if b == _FRAME:
                    if value > n - pos - kind:
                        raise CorruptMetadataError(f"truncated pickle: a frame at byte {at} runs past its end", where)
                elif value > stores or value >= MAX_MEMO_ENTRIES:
                    refuse(f"memo index {value} after {stores} memo stores", at)
            pos += kind
        elif kind < 0:
            if kind == -99:
                return estimate()  # not an opcode: the unpickler refuses it
            if kind >= -8:
                size = -kind
                length = int.from_bytes(data[pos:pos + size], "little")
                pos += size
                if length > n - pos:
                    # (BYTEARRAY8 would be allocated before finding its bytes missing)
                    raise CorruptMetadataError(
                        f"truncated pickle: a {length}-byte value at byte {at} with {max(0, n - pos)} bytes left",
                        where,
                    )
                if b == _LONG4 and length > MAX_LONG_BYTES:
                    refuse(f"a {length}-byte integer (limit {MAX_LONG_BYTES})", at)
                pos += length
                cost += _VALUE + _PER_BYTE * length
            else:
                for _ in range(kind // -10):
                    end = data.find(b"\n", pos)
                    if end < 0:
                        return estimate()
                    line, pos = data[pos:end], end + 1
                    if end - at > 8 * MAX_LONG_BYTES:
                        refuse("a text argument of more than 8,192 bytes", at)
                    cost += _VALUE + _PER_BYTE * len(line)
                if b == _PUT:
                    if not line.isdigit():
                        return estimate()
                    value = int(line)
                    if value > stores or value >= MAX_MEMO_ENTRIES:
                        refuse(f"memo index {value} after {stores} memo stores", at)
        if b == _BINPUT or b == _MEMOIZE or b == _PUT or b == _LONG_BINPUT:
            stores += 1
            continue
        action = mark_of[b]
        if action == 0:
            d = delta_of[b]
            depth += d
            if d > 0:
                objects += 1
                if depth > peak:
                    peak = depth
                if depth > MAX_STACK_DEPTH or objects > MAX_OBJECTS:
                    refuse(f"more than {MAX_STACK_DEPTH} stack entries or {MAX_OBJECTS} objects", at)
                if cost > limit:
                    return estimate()  # (refuses: no need to walk the rest)
            elif depth < 0:
                return estimate()
            elif b == _STOP:
                return estimate()
        elif action == 1:
            marks.append(depth)
            if len(marks) > MAX_NESTING:
                refuse(f"MARKs nested more than {MAX_NESTING} deep", at)
        else:
            if not marks:
                return estimate()
            mark = marks.pop()
            cost += (depth - mark) * element_of[b]
            depth = mark
            if action == 2:
                depth += 1
                objects += 1
                if depth > peak:
                    peak = depth
    return estimate()


# Protocol 0-2 pickles from Python 3 spell a few modules the Python 2 way.
_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}


class SafeUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves globals only through ALLOWED."""

    def __init__(self, data: bytes, where: str, *, payload: bool, extra: Mapping[tuple[str, str], Any] | None = None) -> None:
        super().__init__(io.BytesIO(data))
        self._where = where
        self._payload = payload
        self._extra = extra or {}
        self.storages: dict[str, StorageRef] = {}
        # whether a numpy stand-in may be in the value: only then does finalize copy it
        self.stand_ins = False

    def find_class(self, module: str, name: str) -> Any:
        key = (_PY2_MODULES.get(module, module), name)
        try:
            cls = ALLOWED[key]
        except (KeyError, TypeError):
            pass
        else:
            if cls is NumpyArray or cls is NumpyDType:
                self.stand_ins = True
            return cls
        try:  # a format's own stand-ins for the classes its writer pickles (formats/<format>/)
            return self._extra[key]
        except (KeyError, TypeError):
            pass
        what = _UNSUPPORTED_REBUILDS.get(key) if self._payload else None
        if what is not None:
            raise UnsupportedTensorError(
                f"holds {what} ({module}.{name}), which ckpt cannot read; load it with torch", self._where
            )
        raise UnsafePickleError(str(module), str(name), self._where) from None

    def persistent_load(self, pid: Any) -> Any:
        if not self._payload:
            raise CorruptMetadataError("unexpected persistent id in a metadata pickle", self._where)
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
            raise CorruptMetadataError(f"unsupported persistent id {short_repr(pid)}", self._where)
        _, storage_class, key, location, numel = pid
        if not isinstance(storage_class, StorageClass):
            raise CorruptMetadataError(f"persistent id names {short_repr(storage_class)}, not a storage class", self._where)
        if not isinstance(key, str) or not _STORAGE_KEY.match(key):
            raise CorruptMetadataError(f"invalid storage key {short_repr(key)}", self._where)
        if type(numel) is not int or numel < 0:
            raise CorruptMetadataError(f"invalid storage size {short_repr(numel)}", self._where)
        if isinstance(location, bytes) and location.isascii():
            location = location.decode("ascii")  # (torch's _maybe_decode_ascii: a Python 2 pickle's str)
        if not isinstance(location, str):
            raise CorruptMetadataError(f"invalid storage location {short_repr(location)}", self._where)
        ref = self.storages.get(key)
        if ref is None:
            ref = self.storages[key] = StorageRef(key, storage_class.dtype, location, numel)
        return ref


def _load(data: bytes, where: str, *, payload: bool, limit: int,
          extra: Mapping[tuple[str, str], Any] | None = None) -> tuple[Any, dict[str, StorageRef], bool]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptMetadataError("pickle data must be bytes", where)
    if len(data) > limit:
        raise CorruptMetadataError(f"pickle of {len(data)} bytes exceeds the {limit}-byte limit", where)
    if not data:
        raise CorruptMetadataError("empty pickle", where)
    data = bytes(data)
    memory = memory_limit()
    estimate = check_limits(data, where, limit=memory)  # before the unpickler allocates anything the opcodes ask for
    unpickler = SafeUnpickler(data, where, payload=payload, extra=extra)
    # what the stand-ins may build on top of the estimate (they charge it as they go)
    allowance = _Allowance.local
    outer = getattr(allowance, "left", None), getattr(allowance, "limit", None)
    allowance.left, allowance.limit = memory - estimate, memory
    try:
        obj = unpickler.load()
    except UnsupportedTensorError as exc:
        if exc.where is None:  # raised by a rebuild stand-in, which does not know where it is
            raise UnsupportedTensorError(exc.message, where) from None
        raise
    except PickleMemoryError as exc:
        if exc.where is None:  # raised by charge(), which does not know where it is
            raise PickleMemoryError(exc.message, where) from None
        raise
    except CkptError:
        raise
    except RecursionError:
        raise CorruptMetadataError("malformed pickle: nested too deeply", where) from None
    except MemoryError:
        raise CorruptMetadataError("malformed pickle: too large to decode", where) from None
    except EOFError:
        raise CorruptMetadataError("truncated pickle (ended before its STOP opcode)", where) from None
    except pickle.UnpicklingError as exc:
        if "truncated" in str(exc):
            raise CorruptMetadataError("truncated pickle (ended before its STOP opcode)", where) from None
        raise CorruptMetadataError(f"malformed pickle: {_first_line(exc)}", where) from None
    except Exception as exc:  # any failure here is the input's: nothing foreign ran
        raise CorruptMetadataError(f"malformed pickle: {type(exc).__name__}: {_first_line(exc)}", where) from None
    finally:
        allowance.left, allowance.limit = outer
    if unpickler.stand_ins and payload and 2 * estimate > memory:
        # finalize will copy every container of the value (values.transform) while the value
        # itself is alive: as much again as unpickling it took, and its memo
        raise PickleMemoryError(_over_limit(memory), where)
    return obj, unpickler.storages, unpickler.stand_ins


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else "no detail")[:200]


def load_metadata(data: bytes, where: str, extra: Mapping[tuple[str, str], Any] | None = None) -> Any:
    """Unpickle a DCP `.metadata` file through the allow-list (no persistent ids)."""
    obj, _, _ = _load(data, where, payload=False, limit=MAX_METADATA_BYTES, extra=extra)
    return obj


def load_payload(data: bytes, where: str,
                 extra: Mapping[tuple[str, str], Any] | None = None) -> tuple[Any, dict[str, StorageRef]]:
    """Unpickle a torch.save `data.pkl`: the object (TensorRefs for tensors) and its storages."""
    obj, storages, stand_ins = _load(data, where, payload=True, limit=MAX_PAYLOAD_PICKLE_BYTES, extra=extra)
    # without a numpy stand-in there is nothing to replace (TensorRefs stay): no copy of the value,
    # which for a pickle of millions of small containers doubled what unpickling took
    return (finalize(obj, where) if stand_ins else obj), storages


def finalize(obj: Any, where: str, resolve_tensor: Callable[[TensorRef], Any] | None = None,
             memo: dict[int, Any] | None = None) -> Any:
    """Replace numpy stand-ins (and, given a resolver, TensorRefs) inside a loaded value.

    Each object is converted once (values.transform): shared and self-referencing
    lists and dicts keep their identity, as torch.load gives them, and the cost is one
    step per stored object however often it is shared. `memo` may be kept between the
    values of one pickle (the objects must stay alive as long as it does).
    """

    def convert(value: Any) -> Any:
        if isinstance(value, NumpyArray):
            if value.array is None:
                raise CorruptMetadataError("numpy array without data", where)
            return value.array
        if isinstance(value, NumpyDType):
            return value.resolve()
        if isinstance(value, TensorRef) and resolve_tensor is not None:
            return resolve_tensor(value)
        return value

    try:
        return values.transform(obj, convert, where, memo)
    except TypeError as exc:  # e.g. an unhashable numpy array used as a dict key
        raise CorruptMetadataError(f"malformed value: {_first_line(exc)}", where) from None

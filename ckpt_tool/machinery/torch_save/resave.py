"""What `torch.save(torch.load(f))` writes, without torch: a torch.save pickle loaded as a graph
that keeps what torch.load's objects are (identity included), and emitted again as torch's
pickler would emit those objects.

Tools re-save what they load: DeepSpeed's ds_to_universal loads rank 0's optimizer-states file,
drops a few entries, adds one and torch.saves the dict (`zero/optimizer_state.pt`). Writing that
file exactly takes more than the values: the pickle differs from the input's (memo numbering,
storage keys renumbered in the order the pickler meets them, a tensor's backward-hooks
OrderedDict made afresh, an object's state as its `__dict__` with the keys load_build interned),
and the pickler memoizes by object identity, so two references to one loaded object are one
object and one BINGET, two equal strings that were two objects stay two. The graph is built by
CPython's own C unpickler (the one torch.load uses), so strings, tuples and containers have
exactly the identities torch.load's have; only the globals are resolved here, each to a
description of what torch's pickler writes for the object torch.load would have made:

  * tensors (`_rebuild_tensor_v2/v3`) -> `SavedTensor` (its storage, view, requires_grad);
    nn.Parameters (`_rebuild_parameter`) -> `SavedParameter`;
  * `collections.OrderedDict` -> an OrderedDict node (its items, a BUILD state);
  * `torch.Size` -> Size(tuple) again; torch dtypes -> the global itself;
  * objects made by NEWOBJ + BUILD (DeepSpeed's LossScaler, fragment_address) -> `SavedObject`
    (its class and the state, keys interned as load_build interns them);
  * enums made by a call (DeepSpeed's ZeroStageEnum) -> one node per value (enum members are
    singletons: a second reference is a BINGET).

Only the (module, name) pairs in `ALLOWED` resolve (anything else: UnsafePickleError, nothing
runs); the opcodes are checked against safe_pickle's limits first. `emit` turns a (possibly
edited) graph into the pickle and the list of storages in their new key order.
"""
from __future__ import annotations

import functools
import io
import pickle
import sys
from dataclasses import dataclass
from typing import Any, Callable

from ...base import dtypes
from ...base.errors import CkptError, CorruptMetadataError, UnsafePickleError
from . import safe_pickle
from .archive import storage_pid, tensor_reduce
from .pickle_writer import Global, Obj, PickleWriteError, Reduce, dumps

_ORDERED_DICT = Global("collections", "OrderedDict")
_REBUILD_PARAMETER = Global("torch._utils", "_rebuild_parameter")
_SIZE = Global("torch", "Size")


class ResaveError(CkptError):
    """A pickle holding something this module cannot write back as torch.save would."""


@dataclass(eq=False)
class SavedStorage:
    """A storage of the loaded archive (by its key there) and what its pid said."""

    key: str  # in the source archive
    dtype: str  # canonical dtype name (typed storage); the untyped storage's "uint8"
    numel: int  # elements (bytes for untyped storage)
    typed: bool

    @property
    def nbytes(self) -> int:
        return self.numel * (dtypes.get(self.dtype).itemsize if self.typed else 1)


@dataclass(eq=False)
class SavedTensor:
    """A tensor torch.load made: a view of a storage."""

    storage: SavedStorage
    dtype: str
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool
    attrs: dict | None = None  # Python attributes (`_rebuild_from_type_v2`'s state: DeepSpeed's ds_id)


@dataclass(eq=False)
class SavedParameter:
    """An nn.Parameter torch.load made (its data a SavedTensor)."""

    data: SavedTensor
    requires_grad: bool


class SavedOrderedDict(dict):
    """A collections.OrderedDict torch.load made; `attrs` what BUILD set on it (a state dict's _metadata)."""

    attrs: dict | None = None

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise TypeError("OrderedDict state must be a dict")
        self.attrs = {sys.intern(k) if isinstance(k, str) else k: v for k, v in state.items()}


class SavedObject:
    """An object made by NEWOBJ (cls.__new__) and BUILD: its class is a subclass naming the global."""

    GLOBAL: Global
    __slots__ = ("state",)

    def __init__(self) -> None:  # (never called by the unpickler: NEWOBJ uses __new__)
        self.state: dict | None = None

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise TypeError(f"{self.GLOBAL.module}.{self.GLOBAL.name}: BUILD state must be a dict")
        # load_build sets each item in the instance's __dict__ with its key interned
        self.state = {sys.intern(k) if isinstance(k, str) else k: v for k, v in state.items()}


def _object_class(module: str, name: str) -> type:
    cls = type(name, (SavedObject,), {"GLOBAL": Global(module, name), "__slots__": ()})
    return cls


@dataclass(eq=False)
class _Enum:
    """A member of an enum pickled as a call with its value (one node per value: a singleton)."""

    reduce: Reduce


# ---------------------------------------------------------------------------
# the allow-list: what each global becomes
# ---------------------------------------------------------------------------
def _rebuild_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                backward_hooks: Any = None, metadata: Any = None) -> SavedTensor:
    if not isinstance(storage, SavedStorage) or not storage.typed:
        raise TypeError("_rebuild_tensor_v2 needs a typed storage")
    return _tensor(storage, storage.dtype, storage_offset, size, stride, requires_grad, metadata)


def _rebuild_v3(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                backward_hooks: Any, dtype: Any, metadata: Any = None) -> SavedTensor:
    if not isinstance(dtype, Global) or dtype.module != "torch":
        raise TypeError("_rebuild_tensor_v3 dtype must be a torch dtype")
    return _tensor(storage, dtypes.from_torch(dtype.name).name, storage_offset, size, stride, requires_grad, metadata)


def _tensor(storage: Any, dtype: str, offset: Any, size: Any, stride: Any, requires_grad: Any,
            metadata: Any) -> SavedTensor:
    if not isinstance(storage, SavedStorage):
        raise TypeError("tensor storage must come from a persistent id")
    if metadata:
        raise safe_pickle.UnsupportedTensorError(f"tensor metadata {sorted(map(str, metadata))} (a conjugate or "
                                                 "negative view): not written back")
    shape = safe_pickle._int_tuple(size, "tensor size")
    strides = safe_pickle._int_tuple(stride, "tensor stride")
    if type(offset) is not int or offset < 0 or len(shape) != len(strides):
        raise TypeError("invalid tensor view")
    return SavedTensor(storage, dtype, offset, shape, strides, bool(requires_grad))


class _TensorType:
    """`torch.Tensor` as `_rebuild_from_type_v2`'s type argument (plain tensors only)."""


_TENSOR_TYPE = _TensorType()
_FROM_TYPE = Global("torch._tensor", "_rebuild_from_type_v2")
_TENSOR = Global("torch", "Tensor")


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> SavedTensor:
    """torch._tensor._rebuild_from_type_v2: a plain tensor carrying Python attributes, which
    `_set_obj_state` sets with setattr (so their names are interned)."""
    if new_type is not _TENSOR_TYPE or func not in (_rebuild_v2, _rebuild_v3) or not isinstance(args, tuple):
        raise TypeError("_rebuild_from_type_v2 of anything but a plain tensor")
    out = func(*args)
    if state:
        if not isinstance(state, dict):
            raise TypeError("a tensor's Python state must be a dict (no slots)")
        out.attrs = {sys.intern(k) if isinstance(k, str) else k: v for k, v in state.items()}
    return out


def _rebuild_parameter(data: Any, requires_grad: Any = False, backward_hooks: Any = None) -> SavedParameter:
    if not isinstance(data, SavedTensor):
        raise TypeError("a Parameter must wrap a tensor")
    return SavedParameter(data, bool(requires_grad))


def _ordered_dict(items: Any = ()) -> SavedOrderedDict:
    out = SavedOrderedDict()
    for key, value in safe_pickle._plain_sequence(items):
        out[key] = value
    return out


def _size(items: Any = ()) -> Reduce:
    # torch.Size pickles as Size(tuple(self)): a fresh tuple of ints
    return Reduce(_SIZE, (tuple(safe_pickle._int_tuple(items, "torch.Size")),))


class _StorageClass:
    __slots__ = ("dtype", "typed")

    def __init__(self, dtype: str, typed: bool) -> None:
        self.dtype, self.typed = dtype, typed


def _enum_factory(module: str, name: str, valid: Callable[[Any], bool]) -> Callable[[Any], _Enum]:
    members: dict[Any, _Enum] = {}

    def make(value: Any) -> _Enum:
        if not valid(value):
            raise ValueError(f"{module}.{name}({value!r}) is not one of its values")
        if value not in members:
            members[value] = _Enum(Reduce(Global(module, name), (value,)))
        return members[value]

    return make


def _allowed() -> dict[tuple[str, str], Callable[[], Any]]:
    """(module, name) -> a factory of what the global resolves to (fresh per load: enum members,
    classes), for the globals torch.save and DeepSpeed's optimizer states use."""
    table: dict[tuple[str, str], Callable[[], Any]] = {
        ("torch._utils", "_rebuild_tensor_v2"): lambda: _rebuild_v2,
        ("torch._utils", "_rebuild_tensor_v3"): lambda: _rebuild_v3,
        ("torch._utils", "_rebuild_parameter"): lambda: _rebuild_parameter,
        ("torch._tensor", "_rebuild_from_type_v2"): lambda: _rebuild_from_type,
        ("torch", "Tensor"): lambda: _TENSOR_TYPE,
        ("torch._tensor", "Tensor"): lambda: _TENSOR_TYPE,
        ("collections", "OrderedDict"): lambda: _ordered_dict,
        ("torch", "Size"): lambda: _size,
        ("deepspeed.runtime.zero.config", "ZeroStageEnum"): lambda: _enum_factory(
            "deepspeed.runtime.zero.config", "ZeroStageEnum", lambda v: type(v) is int and 0 <= v <= 3),
    }
    for module, name in (("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                         ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
                         ("deepspeed.utils.tensor_fragment", "fragment_address")):
        table[(module, name)] = functools.partial(_object_class, module, name)
    for name in dtypes.TORCH_DTYPE_NAMES:
        table[("torch", name)] = functools.partial(Global, "torch", name)
    for name in dtypes.TORCH_STORAGE_NAMES:
        dt = dtypes.from_torch_storage(name).name
        table[("torch", name)] = functools.partial(_StorageClass, dt, True)
    table[("torch.storage", "UntypedStorage")] = lambda: _StorageClass("uint8", False)
    table[("torch", "UntypedStorage")] = lambda: _StorageClass("uint8", False)
    return table


ALLOWED = _allowed()


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self._where = where
        self._resolved: dict[tuple[str, str], Any] = {}
        self.storages: dict[str, SavedStorage] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key not in self._resolved:
            make = ALLOWED.get(key)
            if make is None:
                raise UnsafePickleError(str(module), str(name), self._where)
            self._resolved[key] = make()
        return self._resolved[key]

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
            raise CorruptMetadataError("unsupported persistent id", self._where)
        _, cls, key, _location, numel = pid
        if not isinstance(cls, _StorageClass) or not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise CorruptMetadataError("invalid storage persistent id", self._where)
        found = self.storages.get(key)
        if found is None:
            found = self.storages[key] = SavedStorage(key, cls.dtype, numel, cls.typed)
        return found


def load(data: bytes, where: str) -> Any:
    """The graph torch.load would make of this data.pkl (see the module docstring)."""
    safe_pickle.check_limits(data, where)
    try:
        return _Unpickler(bytes(data), where).load()
    except CkptError:
        raise
    except RecursionError:
        raise CorruptMetadataError("malformed pickle: nested too deeply", where) from None
    except Exception as exc:  # the input's fault: nothing foreign ran
        raise CorruptMetadataError(f"malformed pickle: {type(exc).__name__}: {str(exc)[:200]}", where) from None


# ---------------------------------------------------------------------------
# emitting: what torch's pickler writes for the graph
# ---------------------------------------------------------------------------
class _Emitter:
    """Walks the graph in the pickler's order (so that storages get their keys in the order
    torch.save's persistent_id meets them) and builds pickle_writer's description."""

    def __init__(self) -> None:
        self.storages: list[SavedStorage] = []
        self._keys: dict[int, str] = {}  # id(SavedStorage) -> its new key (one str object per storage)
        self._done: dict[int, Any] = {}
        self._keep: list[Any] = []  # the graph's objects stay alive while their ids are keys

    def convert(self, value: Any) -> Any:
        t = type(value)
        if value is None or t in (bool, int, float, str, bytes, Global):
            return value
        seen = self._done.get(id(value))
        if seen is not None:
            return seen
        self._keep.append(value)
        if t is dict:
            out: Any = {}
            self._done[id(value)] = out
            for k, v in value.items():
                ck = self.convert(k)
                out[ck] = self.convert(v)
            return out
        if t is list:
            out = []
            self._done[id(value)] = out
            out.extend(self.convert(v) for v in value)
            return out
        if t is tuple:
            out = tuple(self.convert(v) for v in value)
        elif t is SavedTensor:
            out = self._tensor(value)
        elif t is SavedParameter:
            # Parameter.__reduce_ex__: (_rebuild_parameter, (self.data, requires_grad, OrderedDict())); .data is
            # a new tensor (requires_grad False) each time
            data = SavedTensor(value.data.storage, value.data.dtype, value.data.storage_offset, value.data.size,
                               value.data.stride, False)
            self._keep.append(data)
            out = Reduce(_REBUILD_PARAMETER, (self._tensor(data), value.requires_grad, Reduce(_ORDERED_DICT, ())))
        elif t is SavedOrderedDict:
            items = [(self.convert(k), self.convert(v)) for k, v in value.items()]
            attrs = self.convert(value.attrs) if value.attrs else None
            out = Reduce(_ORDERED_DICT, (), items=items, state=attrs)
        elif isinstance(value, SavedObject):
            out = Obj(type(value).GLOBAL)
            self._done[id(value)] = out
            # object.__reduce_ex__(2): NEWOBJ, then BUILD of __dict__ when it is not empty
            state = getattr(value, "state", None)
            out.state = self.convert(state) if state else None
            return out
        elif t is _Enum:
            out = value.reduce
        elif t is Reduce and value.func == _SIZE:
            out = Reduce(_SIZE, (tuple(value.args[0]),))
        else:
            raise ResaveError(f"cannot write back a {t.__name__} value as torch.save would")
        self._done[id(value)] = out
        return out

    def _tensor(self, t: SavedTensor) -> Reduce:
        key = self._keys.get(id(t.storage))
        if key is None:
            key = self._keys[id(t.storage)] = str(len(self.storages))
            self.storages.append(t.storage)
        dt = dtypes.get(t.dtype)
        numel = t.storage.numel if t.storage.typed else t.storage.numel // max(1, dt.itemsize)
        plain = tensor_reduce(dt, tuple(t.size), key, stride=tuple(t.stride), storage_offset=t.storage_offset,
                              storage_numel=numel, requires_grad=t.requires_grad,
                              storage_id=storage_pid(dt, key, numel))
        if not t.attrs:
            return plain
        # Tensor.__reduce_ex__ with Python state: (_rebuild_from_type_v2, (func, Tensor, args, __dict__))
        return Reduce(_FROM_TYPE, (plain.func, _TENSOR, plain.args, self.convert(t.attrs)))


def emit(graph: Any) -> tuple[bytes, list[SavedStorage]]:
    """(data.pkl, the storages in their new key order "0", "1", ...) that torch.save writes for the graph."""
    e = _Emitter()
    described = e.convert(graph)
    try:
        return dumps(described, 2), e.storages
    except PickleWriteError as exc:
        raise ResaveError(exc.message) from None

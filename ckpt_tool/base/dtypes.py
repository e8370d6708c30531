"""The one dtype table every format uses.

Canonical names are numpy / ml_dtypes names ("float32", "bfloat16",
"float8_e4m3fn", "bool"). Each format keeps its own spelling here and nowhere
else: zarr v2 `dtype` strings, zarr v3 `data_type` names, torch dtype
attribute names (`torch.float32`) and the legacy storage classes torch.save
writes (`torch.FloatStorage`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import CorruptMetadataError

if TYPE_CHECKING:
    import numpy as np
# (numpy and ml_dtypes are imported when a numpy dtype is first asked for: reading metadata needs
# the table only, and `ckpt inspect` of a DCP loads neither, issue 46)


@dataclass(frozen=True)
class DType:
    """One element type and its names in numpy, zarr v2 and v3, and torch."""

    name: str  # canonical numpy / ml_dtypes name
    itemsize: int
    zarr2: str | None  # zarr v2 dtype string as tensorstore writes it
    zarr3: str | None  # zarr v3 data_type
    torch: str | None  # attribute of the torch module: torch.<name>
    # legacy storage class in torch.save pickles (_rebuild_tensor_v2); dtypes
    # without one (float8, uint16+) are saved as UntypedStorage plus the dtype
    # (_rebuild_tensor_v3)
    torch_storage: str | None
    # safetensors header `dtype` (F32, BF16, F8_E4M3, ...); None: no safetensors spelling
    safetensors: str | None = None

    @property
    def numpy(self) -> np.dtype:
        return numpy_dtype(self.name)

    @property
    def is_float(self) -> bool:
        return self.name.startswith(("float", "bfloat", "complex"))


_TABLE = [
    DType("bool", 1, "|b1", "bool", "bool", "BoolStorage", "BOOL"),
    DType("int8", 1, "|i1", "int8", "int8", "CharStorage", "I8"),
    DType("uint8", 1, "|u1", "uint8", "uint8", "ByteStorage", "U8"),
    DType("int16", 2, "<i2", "int16", "int16", "ShortStorage", "I16"),
    DType("uint16", 2, "<u2", "uint16", "uint16", None, "U16"),
    DType("int32", 4, "<i4", "int32", "int32", "IntStorage", "I32"),
    DType("uint32", 4, "<u4", "uint32", "uint32", None, "U32"),
    DType("int64", 8, "<i8", "int64", "int64", "LongStorage", "I64"),
    DType("uint64", 8, "<u8", "uint64", "uint64", None, "U64"),
    DType("float16", 2, "<f2", "float16", "float16", "HalfStorage", "F16"),
    DType("bfloat16", 2, "bfloat16", "bfloat16", "bfloat16", "BFloat16Storage", "BF16"),
    DType("float32", 4, "<f4", "float32", "float32", "FloatStorage", "F32"),
    DType("float64", 8, "<f8", "float64", "float64", "DoubleStorage", "F64"),
    DType("complex64", 8, "<c8", "complex64", "complex64", "ComplexFloatStorage", "C64"),
    DType("complex128", 16, "<c16", "complex128", "complex128", "ComplexDoubleStorage", None),
    DType("float8_e4m3fn", 1, "float8_e4m3fn", "float8_e4m3fn", "float8_e4m3fn", None, "F8_E4M3"),
    DType("float8_e5m2", 1, "float8_e5m2", "float8_e5m2", "float8_e5m2", None, "F8_E5M2"),
    DType("float8_e4m3fnuz", 1, "float8_e4m3fnuz", "float8_e4m3fnuz", "float8_e4m3fnuz", None, "F8_E4M3FNUZ"),
    DType("float8_e5m2fnuz", 1, "float8_e5m2fnuz", "float8_e5m2fnuz", "float8_e5m2fnuz", None, "F8_E5M2FNUZ"),
    DType("float8_e4m3b11fnuz", 1, "float8_e4m3b11fnuz", "float8_e4m3b11fnuz", None, None, None),
    DType("float8_e8m0fnu", 1, None, None, "float8_e8m0fnu", None, "F8_E8M0"),
]

BY_NAME = {d.name: d for d in _TABLE}
_BY_ZARR2 = {d.zarr2: d for d in _TABLE if d.zarr2}
# zarr v2 also allows big-endian and '=' / '|' byte-order marks for 1-byte types
_BY_ZARR2.update({"<b1": BY_NAME["bool"], "<i1": BY_NAME["int8"], "<u1": BY_NAME["uint8"]})
_BY_ZARR3 = {d.zarr3: d for d in _TABLE if d.zarr3}
_BY_TORCH = {d.torch: d for d in _TABLE if d.torch}
_BY_TORCH_STORAGE = {d.torch_storage: d for d in _TABLE if d.torch_storage}
# torch also spells some dtypes by alias (torch.half is torch.float16, ...)
_BY_TORCH.update({
    "half": BY_NAME["float16"], "float": BY_NAME["float32"], "double": BY_NAME["float64"],
    "long": BY_NAME["int64"], "int": BY_NAME["int32"], "short": BY_NAME["int16"],
    "cfloat": BY_NAME["complex64"], "cdouble": BY_NAME["complex128"],
})

_BY_SAFETENSORS = {d.safetensors: d for d in _TABLE if d.safetensors}
TORCH_DTYPE_NAMES = frozenset(_BY_TORCH)
TORCH_STORAGE_NAMES = frozenset(_BY_TORCH_STORAGE)


@functools.lru_cache(maxsize=None)  # asked once per leaf by the readers: np.dtype objects are immutable
def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a canonical name (ml_dtypes supplies bfloat16 and float8)."""
    import ml_dtypes
    import numpy as np

    if hasattr(ml_dtypes, name):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def get(name: str) -> DType:
    try:
        return BY_NAME[name]
    except KeyError:
        raise CorruptMetadataError(f"unknown dtype {name!r}") from None


def from_zarr2(spec: object) -> DType:
    if isinstance(spec, str) and spec in _BY_ZARR2:
        return _BY_ZARR2[spec]
    raise CorruptMetadataError(f"unsupported zarr v2 dtype {spec!r}")


def from_zarr3(spec: object) -> DType:
    if isinstance(spec, str) and spec in _BY_ZARR3:
        return _BY_ZARR3[spec]
    raise CorruptMetadataError(f"unsupported zarr v3 data_type {spec!r}")


def from_torch(name: str) -> DType:
    """From a torch dtype attribute name such as 'float32' (no torch import)."""
    try:
        return _BY_TORCH[name]
    except KeyError:
        raise CorruptMetadataError(f"unsupported torch dtype torch.{name}") from None


def from_torch_storage(name: str) -> DType:
    try:
        return _BY_TORCH_STORAGE[name]
    except KeyError:
        raise CorruptMetadataError(f"unsupported torch storage class torch.{name}") from None


def from_safetensors(name: object) -> DType:
    """From a safetensors header dtype such as 'BF16'."""
    if isinstance(name, str) and name in _BY_SAFETENSORS:
        return _BY_SAFETENSORS[name]
    raise CorruptMetadataError(f"unknown safetensors dtype {name!r}")


def from_numpy(dtype: np.dtype) -> DType:
    import ml_dtypes  # noqa: F401 - (registers bfloat16 and the float8 types with numpy)
    import numpy as np

    dtype = np.dtype(dtype)
    for d in _TABLE:
        if d.name == dtype.name:
            return d
    raise CorruptMetadataError(f"unsupported dtype {dtype}")


def torch_name_of(arr: np.ndarray) -> str | None:
    """The canonical name of an array's dtype when torch has it (a tensor torch can hold), else None."""
    try:
        dt = from_numpy(arr.dtype)
    except CorruptMetadataError:
        return None
    return dt.name if dt.torch is not None else None

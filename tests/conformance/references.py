"""What the WRITING library says a fixture holds, in one shape for every format: the shapes and
helpers every format's catalogue file (tests/conformance/formats/) builds its loaders from.

A reference is ``{key: Ref}``: ``key`` is the key path ckpt reports (a tuple of
str / int) or, for formats keyed by flat names (safetensors), ``("name", NAME)``
matched against the leaf's ``name``; ``Ref`` says the leaf's kind ("array" or
"value") and, where the library records them, its shape and dtype.

Live loaders call the library itself (orbax-checkpoint 0.12, torch DCP,
safetensors: installed in the test venv); recorded loaders read what the
library of the time wrote beside the fixture (see fixtures/README.md). The
heavy libraries are imported inside the functions. Each format's loaders live
in its catalogue file; this module names no format.

A format with a writer also gives its library's loader of a checkpoint ckpt
WROTE (its catalogue file's LIBRARY: catalogue.library(fmt)), as
``{key: value}`` for the round trip.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import library_reference as LR


@dataclass(frozen=True)
class Ref:
    kind: str  # "array" | "value"
    shape: tuple | None = None
    dtype: str | None = None  # numpy / ml_dtypes name; None where the library does not say


def by_name(name: str) -> tuple:
    return ("name", name)


def torch_dtype_name(t: Any) -> str:  # a tensor or a TensorProperties
    return str(t.dtype).removeprefix("torch.")


class Recording:
    """A library's view kept as a recording (not the value itself): it says whether a value
    ckpt read matches it. A format's catalogue file may add its own kinds."""

    def matches(self, value: Any) -> bool:
        raise NotImplementedError


@dataclass(frozen=True)
class Digest(Recording):
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
class Recorded(Recording):
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


def np_dtype(name: str) -> Any:
    import ml_dtypes
    import numpy as np

    return np.dtype(getattr(ml_dtypes, name, None) or name)


def equal(a: Any, b: Any) -> bool:
    """Arrays: dtype, shape and bytes; containers element-wise; anything else: same type and ==.
    A recorded reference (a Recording: Digest, Recorded, ...) says itself whether a value matches it."""
    import numpy as np

    if isinstance(b, Recording):
        return b.matches(a)
    if isinstance(a, Recording):  # a library's view given first
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


def torch_to_numpy(t: Any) -> Any:
    return LR._tensor_to_numpy(t.resolve_conj().resolve_neg())

"""The fuzzing oracle: a long-lived worker that loads a checkpoint with the REAL
library and with ckpt's Python API, and says whether they agree.

Run as a process (`python tests/fuzz_oracle.py`); it reads one JSON request per
line on stdin ({"format": "dcp"|"orbax"|"safetensors"|"msgpack"|"torch", "path": ...,
"ckpt_format": the registry's name of the format}) and writes one JSON answer per line on stdout:

    {"library_ok": bool, "library_error": str|None,
     "ckpt_ok": bool, "ckpt_error": str|None,
     "mismatch": str|None, "seconds": float,
     "unchecked": [global, ...] (torch.save: not loaded), "refused_globals": [global, ...]}

torch and jax are imported once per worker (that is the point of the worker:
a whole-process import per mutant would cost seconds). The worker runs jax on
8 CPU devices, as the tests do, so that orbax's restore without a target can
rebuild every recorded sharding.

A DCP `.metadata` is given to torch (whose reader is plain `pickle.load`) only
after a scan of its opcodes finds no global outside the set a real `.metadata`
uses: a hostile pickle that ckpt let through is reported, never run.

A torch.save file is loaded with `torch.load(weights_only=True, map_location="cpu")`
per file (a directory: the files its `*.bin.index.json` names, else its .bin/.pt/.pth
files) and walked as ckpt lays it out (dicts by key, lists and tuples by index where
they hold a tensor; a leaf's name is its dotted key path), values compared bytewise.
It is loaded the way megatron-core and DeepSpeed load their checkpoints: the globals
the file names that torch's weights_only defaults lack but ckpt's allow-list admits as
data (safe_pickle.ALLOWED plus the format's own table, FORMAT_ALLOW) are passed to
`torch.serialization.safe_globals` as the REAL classes and functions, imported here.
When one of them cannot be imported here (deepspeed, megatron), the answer is
`unchecked` (no load, no comparison: no verdict). When weights_only still refuses a
global, the answer names it (`refused_globals`: ones neither torch nor ckpt admits).
When it refuses only an opcode its unpickler lacks (protocol 3+ pickles:
SHORT_BINUNICODE, BINBYTES, ...), and every global is one weights_only allows (or was
given) and no opcode can change an object already built (BUILD, NEWOBJ), the file is
loaded again with weights_only=False: torch.save itself writes such files.
"""
from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import os
import pickletools
import re
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

# (module, name) pairs a genuine torch 2.13 .metadata refers to; anything else
# is not given to torch's plain pickle.load
DCP_GLOBALS_OK = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
              "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint._extension", "ZStandard"),
} | {("torch", n) for n in (
    "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "uint16",
    "uint32", "uint64", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "strided",
    "sparse_coo", "qint8", "quint8", "qint32", "float8_e4m3fnuz", "float8_e5m2fnuz", "complex32",
)}


def foreign_globals(data: bytes) -> list[tuple[str, str]]:
    """The (module, name) globals a pickle names outside DCP_GLOBALS_OK.

    STACK_GLOBAL takes its names from the two preceding string pushes (or memo
    gets of them, tracked through the memo); anything unresolvable counts as
    foreign."""
    out: list[tuple[str, str]] = []
    strings: list[Any] = []
    memo: dict[int, Any] = {}
    try:
        for op, arg, _pos in pickletools.genops(data):
            name = op.name
            if name == "GLOBAL":
                mod, _, attr = arg.partition(" ")
                if (mod, attr) not in DCP_GLOBALS_OK:
                    out.append((mod, attr))
                strings.append(None)
            elif name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
                strings.append(arg)
            elif name == "MEMOIZE":
                memo[len(memo)] = strings[-1] if strings else None
            elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[int(arg)] = strings[-1] if strings else None
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                strings.append(memo.get(int(arg)))
            elif name == "STACK_GLOBAL":
                pair = tuple(strings[-2:]) if len(strings) >= 2 else (None, None)
                if pair not in DCP_GLOBALS_OK:
                    out.append((str(pair[0]), str(pair[1])))
                strings.append(None)
            else:
                strings.append(None)
    except Exception as exc:  # noqa: BLE001 - a pickle pickletools cannot walk
        out.append(("<unparseable>", f"{type(exc).__name__}: {exc}"))
    return out


# --------------------------------------------------------------------------
# comparisons
# --------------------------------------------------------------------------


def _same(a: Any, b: Any, _pairs: dict | None = None) -> bool:
    """Structural equality of two values; object graphs (shared and self-referencing
    containers, as torch.load gives them) are compared once per pair of objects, and a pair
    met again while it is being compared counts as equal (both unfold the same way)."""
    import numpy as np

    pairs = {} if _pairs is None else _pairs
    if isinstance(a, (list, tuple, dict)) and isinstance(b, (list, tuple, dict)):
        key = (id(a), id(b))
        if key in pairs:
            return pairs[key]
        pairs[key] = True  # (in progress: a cycle back to this pair)
        if isinstance(a, dict) or isinstance(b, dict):
            ok = isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() \
                and all(_same(a[k], b[k], pairs) for k in a)
        else:
            ok = len(a) == len(b) and all(_same(x, y, pairs) for x, y in zip(a, b))
        pairs[key] = ok
        return ok
    if isinstance(a, Sampled) or isinstance(b, Sampled):
        return isinstance(a, Sampled) and isinstance(b, Sampled) and a.shape == b.shape \
            and a.dtype == b.dtype and _same(a.samples, b.samples, pairs)
    if isinstance(a, (str, bytes)) or isinstance(b, (str, bytes)):
        return type(a) is type(b) and a == b
    try:
        x, y = np.asarray(a), np.asarray(b)
    except Exception:  # noqa: BLE001
        return a == b
    if x.shape != y.shape:
        return False
    if x.dtype.kind in "OUS" or y.dtype.kind in "OUS":
        return bool(np.all(x == y))
    if x.dtype.itemsize == y.dtype.itemsize and x.dtype.kind == y.dtype.kind:
        if x.dtype.byteorder != y.dtype.byteorder:
            # the same values in another byte order (numpy's own unpickling of a '>i4' array
            # gives native int32): compared in native order
            x, y = (a.astype(a.dtype.newbyteorder("=")) for a in (x, y))
        return x.tobytes() == y.tobytes()  # bit-exact, NaN-safe
    try:
        return bool(np.array_equal(x.astype("float64"), y.astype("float64"), equal_nan=True))
    except Exception:  # noqa: BLE001
        return False


# a tensor whose logical size passes this (a stride-0 or overlapping view of a few stored
# bytes can be terabytes logically) is compared by shape, dtype and a few regions
SAMPLE_ABOVE_BYTES = 64 << 20


@dataclasses.dataclass
class Sampled:
    """A large tensor as its shape, dtype and the values of a few small regions."""

    shape: tuple
    dtype: str
    samples: list


def sample_regions(shape: tuple) -> list[tuple[slice, ...]]:
    """The first and last few elements along every axis, and a middle block."""
    regions = []
    for pick in ("first", "last", "middle"):
        region = []
        for n in shape:
            k = min(n, 4)
            start = 0 if pick == "first" else n - k if pick == "last" else max(0, n // 2 - k // 2)
            region.append(slice(start, start + k))
        regions.append(tuple(region))
    return regions


def _describe(v: Any) -> str:
    shape = getattr(v, "shape", None)
    dtype = getattr(v, "dtype", None)
    if shape is not None:
        return f"{dtype}{list(shape)}"
    r = repr(v)
    return r if len(r) < 80 else r[:77] + "..."


def compare(lib: dict, ours: dict) -> str | None:
    """None when the library's {keypath: value} equals ckpt's; else why not."""
    if set(lib) != set(ours):
        only_lib = sorted(map(str, set(lib) - set(ours)))[:3]
        only_ours = sorted(map(str, set(ours) - set(lib)))[:3]
        return f"key sets differ: library only {only_lib}, ckpt only {only_ours}"
    for k in lib:
        if not _same(lib[k], ours[k]):
            return f"{k}: library {_describe(lib[k])} != ckpt {_describe(ours[k])}"
    return None


def ckpt_values(path: str) -> dict:
    import ckpt_tool

    out = {}
    for leaf in ckpt_tool.open(path).leaves:
        out[tuple(leaf.keys)] = leaf.read() if leaf.kind == "array" else leaf.load()
    return out


# --------------------------------------------------------------------------
# the libraries
# --------------------------------------------------------------------------


def dcp_library_values(path: str, mode: str = "") -> dict:
    from library_reference import dcp_values

    with open(os.path.join(path, ".metadata"), "rb") as f:
        data = f.read()
    bad = foreign_globals(data)
    if bad:
        raise RuntimeError(f"not given to torch: .metadata names foreign globals {bad[:3]}")
    return dcp_values(path)


def _recorded_devices_here(path: str) -> bool:
    """Whether every device id `_sharding` records is one of this process's jax devices."""
    import jax

    here = {d.id for d in jax.devices()}
    try:
        with open(os.path.join(path, "_sharding")) as f:
            entries = json.load(f)
        ids: set = set()

        def collect(node) -> None:  # noqa: ANN001
            if isinstance(node, dict):
                if "id" in node and isinstance(node["id"], int):
                    ids.add(node["id"])
                for v in node.values():
                    collect(v)
            elif isinstance(node, list):
                for v in node:
                    collect(v)

        for text in entries.values():
            collect(json.loads(text).get("device_mesh"))
    except (OSError, ValueError, AttributeError, TypeError, RecursionError):
        return True  # no readable record: let orbax's restore decide
    return ids <= here


def orbax_library_values(path: str, mode: str = "restore") -> dict:
    """orbax's own restore with no target (what `restore(path)` gives a user):
    jax arrays on the shardings `_sharding` records, then to numpy. mode
    "numpy" restores as host numpy arrays instead (library_reference's
    orbax_values): for saves of several processes, whose device ids one
    process does not have."""
    import numpy as np
    import orbax.checkpoint as ocp
    from library_reference import _flatten, orbax_values

    if mode == "numpy" or not _recorded_devices_here(path):
        # a mesh on device ids this process does not have is valid, but
        # restores without target shardings only on that topology
        return orbax_values(path)

    with ocp.PyTreeCheckpointer() as ckptr:
        tree = ckptr.restore(os.path.abspath(path))
    out = {}
    for k, v in _flatten(tree).items():
        if hasattr(v, "addressable_shards") or isinstance(v, np.ndarray):
            v = np.asarray(v)
        elif isinstance(v, np.generic):
            v = v.item()
        out[k] = v
    return out


def safetensors_library_values(path: str, mode: str = "") -> dict:
    import glob

    from library_reference import _tensor_to_numpy
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    out = {}
    if os.path.isdir(path) and os.path.isfile(index):
        # a sharded set loads as transformers loads it: the tensors the
        # index's weight_map names, each from the file it names
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        by_file: dict[str, list[str]] = {}
        for name, fn in weight_map.items():
            by_file.setdefault(fn, []).append(name)
        for fn, names in by_file.items():
            with safe_open(os.path.join(path, fn), framework="pt") as f:
                for name in names:
                    out[tuple(name.split("."))] = _tensor_to_numpy(f.get_tensor(name))
        return out
    files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
    for fn in files:
        # torch, not numpy: numpy has no float8
        with safe_open(fn, framework="pt") as f:
            for name in f.keys():
                out[tuple(name.split("."))] = _tensor_to_numpy(f.get_tensor(name))
    return out


def _natural_key(name: str) -> list:
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def msgpack_library_values(path: str, mode: str = "") -> dict:
    """A Flax msgpack checkpoint as the libraries load it (flax is not installed here):
    the step flax.training.checkpoints.latest_checkpoint picks (the last `checkpoint_*`
    file by natural sort, `checkpoint_tmp` excluded), decoded by orbax's
    msgpack_utils.msgpack_restore, which is flax.serialization.msgpack_restore (msgpack's
    unpackb with strict_map_key, flax's ext hook, chunked arrays joined) plus orbax's tuple
    ext, and refuses an unknown ext type where flax would return a raw msgpack.ExtType."""
    import numpy as np
    from orbax.checkpoint import msgpack_utils

    if os.path.isdir(path):
        names = [n for n in os.listdir(path) if n.startswith("checkpoint_") and n != "checkpoint_tmp"
                 and os.path.isfile(os.path.join(path, n))]
        if not names:
            raise FileNotFoundError(f"no checkpoint_* file in {path}")
        path = os.path.join(path, sorted(names, key=_natural_key)[-1])
    with open(path, "rb") as f:
        tree = msgpack_utils.msgpack_restore(f.read())
    out: dict = {}

    def walk(node: Any, keys: tuple) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                # msgpack allows bytes keys; ckpt names them by their text
                walk(v, keys + (k.decode("utf-8", "surrogateescape") if isinstance(k, bytes) else k,))
        elif isinstance(node, (list, tuple)) and node:
            for i, v in enumerate(node):
                walk(v, keys + (i,))
        else:
            out[keys] = np.asarray(node) if isinstance(node, np.generic) else node

    walk(tree, ())
    return out


# --------------------------------------------------------------------------
# torch.save files: torch.load(weights_only=True), laid out as ckpt lays them out
# --------------------------------------------------------------------------

_SHARD_FILE = re.compile(r"^.+-\d{5}-of-\d{5}\.bin$")  # transformers' -0000K-of-0000N.bin shards
_TORCH_SUFFIXES = (".bin", ".pt", ".pth")


def torch_files(path: str) -> list[tuple[str, str | None]]:
    """(file, subtree key) of what a loader reads: one file; a directory's files the
    `*.bin.index.json` names (transformers' sharded load); else its .bin/.pt/.pth files, one
    whole tree when they are one (sharded) set or a lone file, else a subtree per file stem."""
    if os.path.isfile(path):
        return [(path, None)]
    names = sorted(os.listdir(path))
    index = [n for n in names if n.endswith(".bin.index.json")]
    if index:
        with open(os.path.join(path, index[0])) as f:
            weight_map = json.load(f)["weight_map"]
        return [(os.path.join(path, n), None) for n in sorted(set(weight_map.values()))]
    files = [n for n in names if n.endswith(_TORCH_SUFFIXES) and os.path.isfile(os.path.join(path, n))]
    if len(files) <= 1 or all(_SHARD_FILE.match(n) for n in files):
        return [(os.path.join(path, n), None) for n in files]
    stems = [n.rsplit(".", 1)[0] for n in files]
    return [(os.path.join(path, n), s if stems.count(s) == 1 else n) for n, s in zip(files, stems)]


class WeightsOnlyRefusal(Exception):
    """torch.load(weights_only=True) refused globals of a data.pkl (`refused`) that ckpt's
    allow-list does not admit either (those it admits were given to torch)."""

    def __init__(self, refused: list[str], detail: str) -> None:
        super().__init__(f"weights_only refuses global(s) {refused[:3]} ({detail})")
        self.refused = refused


class UncheckedGlobals(Exception):
    """A data.pkl names globals ckpt admits as data whose real class or function cannot be
    imported here (deepspeed, megatron): torch cannot be given them, so no verdict."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(f"not loaded: ckpt admits {names[:3]}, which cannot be imported here")
        self.names = names


# a format's own table of globals it admits beyond safe_pickle.ALLOWED (the `extra` its
# reader passes to the allow-list unpickler), by the registry's name of the format
FORMAT_ALLOW = {"megatron": ("ckpt_tool.formats.megatron.pickled", "ALLOW")}


def ckpt_allow(ckpt_format: str = "torch") -> set[tuple[str, str]]:
    """The (module, name) globals ckpt's unpickler admits for a file of `ckpt_format`."""
    from ckpt_tool.machinery.torch_save import safe_pickle

    keys = set(safe_pickle.ALLOWED)
    if ckpt_format in FORMAT_ALLOW:
        module, attr = FORMAT_ALLOW[ckpt_format]
        keys |= set(getattr(importlib.import_module(module), attr))
    return keys


_REAL: dict[tuple[str, str], Any] = {}


def real_global(module: str, name: str) -> Any | None:
    """The real object `module.name` (imported: only ever a name on ckpt's allow-list),
    None when it cannot be imported in this worker."""
    key = (module, name)
    if key not in _REAL:
        try:
            _REAL[key] = getattr(importlib.import_module(module), name)
        except Exception:  # noqa: BLE001 - ImportError, or a module without it: unavailable here
            _REAL[key] = None
    return _REAL[key]


def _numpy_dtype_classes() -> list[tuple[Any, str]]:
    """numpy's per-dtype classes (np.dtypes.Float64DType, ...) of the plain numeric dtypes
    ckpt admits: a pickled numpy.dtype is built by REDUCE and then BUILD on an instance of
    one, which weights_only allows only for an allow-listed type (megatron-core's
    SAFE_GLOBALS lists np.dtypes.UInt32DType beside numpy.dtype for that reason)."""
    import numpy as np

    codes = ("?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16")
    return [(type(np.dtype(c)), f"numpy.dtypes.{type(np.dtype(c)).__name__}") for c in codes]


def _torch_name(module: str, name: str) -> str:
    """The name torch's weights_only unpickler looks a GLOBAL up by (Python 2 names mapped
    as its _read_global_instruction maps them)."""
    from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING

    if (module, name) in NAME_MAPPING:
        module, name = NAME_MAPPING[(module, name)]
    elif module in IMPORT_MAPPING:
        module = IMPORT_MAPPING[module]
    return f"{module}.{name}"


def safe_globals_for(found: list[tuple[str, str]], ckpt_format: str = "torch") -> list[tuple[Any, str]]:
    """The (real object, name) pairs to give torch.serialization.safe_globals for a pickle
    naming `found`: each global weights_only refuses by default that ckpt admits. Raises
    UncheckedGlobals when one of those cannot be imported here."""
    from torch import _weights_only_unpickler as wo

    from ckpt_tool.machinery.torch_save.safe_pickle import _PY2_MODULES

    defaults = wo._get_allowed_globals()
    allow = ckpt_allow(ckpt_format)
    out: list[tuple[Any, str]] = []
    missing: list[str] = []
    for module, name in sorted(set(found)):
        tname = _torch_name(module, name)
        key = (_PY2_MODULES.get(module, module), name)
        if tname in defaults or key not in allow:
            continue  # allowed already, or admitted by neither (torch's refusal stands)
        obj = real_global(*key)
        if obj is None:
            missing.append(f"{module}.{name}")
            continue
        out.append((obj, tname))
        if key == ("numpy", "dtype"):
            out.extend(_numpy_dtype_classes())
    if missing:
        raise UncheckedGlobals(missing)
    return out


# opcodes torch's weights_only unpickler does not implement that change no object already
# built: a pickle refused only for these (torch.save(pickle_protocol=4) writes some) is loaded
# again with weights_only=False once every global it names is one weights_only allows
_BENIGN_OPCODES = {
    "SHORT_BINUNICODE", "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "BYTEARRAY8", "MEMOIZE",
    "FRAME", "STACK_GLOBAL", "PUT", "GET", "INT", "LONG", "LONG4", "FLOAT", "STRING", "BINSTRING", "UNICODE",
    "ADDITEMS", "FROZENSET", "POP", "POP_MARK", "DUP", "LIST", "DICT", "EMPTY_SET", "PERSID",
}


def _pickle_of(file: str) -> bytes | None:
    import zipfile

    try:
        with zipfile.ZipFile(file) as zf:
            name = next(n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
            return zf.read(name)
    except Exception:  # noqa: BLE001 - torch's own error stands
        return None


def _pickle_globals(data: bytes) -> tuple[list[tuple[str, str]], set[str]]:
    """The (module, name) globals a pickle names (STACK_GLOBAL's from the strings before it,
    through the memo; unresolvable ones as ('?', '?')), and the opcode names it uses."""
    out: list[tuple[str, str]] = []
    names: set[str] = set()
    strings: list[Any] = []
    memo: dict[int, Any] = {}
    for op, arg, _pos in pickletools.genops(data):
        names.add(op.name)
        if op.name == "GLOBAL":
            mod, _, attr = arg.partition(" ")
            out.append((mod, attr))
            strings.append(None)
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            strings.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = strings[-1] if strings else None
        elif op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[int(arg)] = strings[-1] if strings else None
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            strings.append(memo.get(int(arg)))
        elif op.name == "STACK_GLOBAL":
            pair = tuple(strings[-2:]) if len(strings) >= 2 else (None, None)
            out.append(pair if all(isinstance(p, str) for p in pair) else ("?", "?"))
            strings.append(None)
        else:
            strings.append(None)
    return out, names


def _torch_load(file: str, ckpt_format: str = "torch") -> tuple[Any, str | None]:
    """torch.load(file, weights_only=True, map_location="cpu") with the globals ckpt admits
    given as safe globals (safe_globals_for); (object, note of a fallback)."""
    import torch
    from torch import _weights_only_unpickler as wo

    data = _pickle_of(file)
    found = opcodes = None
    if data is not None:
        try:
            found, opcodes = _pickle_globals(data)
        except Exception:  # noqa: BLE001 - not a pickle pickletools can walk: torch's error stands
            found = None
    if found is None or ("?", "?") in found:
        # no data.pkl, or a STACK_GLOBAL whose names this scan cannot follow: torch's own answer
        return torch.load(file, weights_only=True, map_location="cpu"), None
    given = safe_globals_for(found, ckpt_format)
    with torch.serialization.safe_globals(given):
        try:
            return torch.load(file, weights_only=True, map_location="cpu"), None
        except Exception as exc:  # noqa: BLE001
            first = exc
        allowed = set(wo._get_allowed_globals()) | {n for _, n in given}
        refused = sorted({_torch_name(m, n) for m, n in found} - allowed)
        if refused:
            raise WeightsOnlyRefusal(refused, _one_line(first))
        unsupported = opcodes - {
            "PROTO", "STOP", "GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "APPEND", "APPENDS", "SETITEM", "SETITEMS",
            "MARK", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWFALSE", "NEWTRUE", "EMPTY_TUPLE",
            "EMPTY_LIST", "EMPTY_DICT", "BININT", "BININT1", "BININT2", "BINFLOAT", "BINUNICODE",
            "SHORT_BINSTRING", "BINPERSID", "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT", "LONG1"}
        risky = opcodes & {"BUILD", "NEWOBJ", "NEWOBJ_EX", "INST", "OBJ", "EXT1", "EXT2", "EXT4"}
        if "Unsupported operand" in str(first) and unsupported and unsupported <= _BENIGN_OPCODES and not risky:
            # every global is one weights_only allows or was given: nothing foreign runs
            return torch.load(file, weights_only=False, map_location="cpu"), f"weights_only: {sorted(unsupported)}"
        raise first


_WALK_MAX_DEPTH = 100  # ckpt_tool.machinery.torch_save.object_tree.MAX_DEPTH


def _torch_holders(obj: Any) -> set[int]:
    """The ids of the containers (dicts by value, lists and tuples) from which a tensor can be
    reached, each object visited once (torch.load's result is a graph: shared, cyclic)."""
    import numpy as np
    import torch

    parents: dict[int, list[int]] = {}
    holding: list[int] = []
    seen = {id(obj)}
    stack = [obj]
    while stack:
        node = stack.pop()
        inner = node.values() if isinstance(node, dict) else node if isinstance(node, (list, tuple)) else ()
        for child in inner:
            if isinstance(child, (torch.Tensor, np.ndarray)):
                holding.append(id(node))
            elif isinstance(child, (dict, list, tuple)):
                parents.setdefault(id(child), []).append(id(node))
                if id(child) not in seen:
                    seen.add(id(child))
                    stack.append(child)
    found: set[int] = set()
    while holding:
        nid = holding.pop()
        if nid not in found:
            found.add(nid)
            holding.extend(parents.get(nid, ()))
    return found


@dataclasses.dataclass(frozen=True)
class _Same:
    """A later path to a container shown at `first` (torch.load gives one object at both)."""

    first: tuple


def _torch_walk(obj: Any, keys: tuple, out: list) -> None:
    """ckpt's tree of a torch.save object (machinery/torch_save/object_tree.walk): dicts with str/int
    keys by key, lists and tuples holding a tensor by index, a container met again a
    reference to its first path, anything else (or deeper than 100 levels) one leaf."""
    holders = _torch_holders(obj)
    first: dict[int, tuple] = {}
    stack = [(keys, obj)]
    while stack:
        path, value = stack.pop()
        sub = (isinstance(value, dict) and bool(value) and all(type(k) in (str, int) for k in value)) or \
            (isinstance(value, (list, tuple)) and bool(value) and id(value) in holders)
        if not (sub and len(path) - len(keys) <= _WALK_MAX_DEPTH):
            out.append((path, value))
            continue
        if id(value) in first:
            out.append((path, _Same(first[id(value)])))
            continue
        first[id(value)] = path
        items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
        stack.extend((path + (k,), v) for k, v in reversed(items))


def _graph_plain(value: Any, atom: Callable[[Any], Any], node: Callable[[Any], Any]) -> Any:
    """A copy of a value graph with containers kept (sharing and cycles as they were: each
    object converted once) and everything else given to `atom`; `node` may first turn an
    object into a container (a dataclass into a dict of its fields)."""
    memo: dict[int, Any] = {}
    keep: list[Any] = []  # (the objects `node` made live as long as their ids are memo keys)

    def conv(v: Any, depth: int) -> Any:
        if depth > 1000:
            raise RecursionError("value nested too deeply")
        if id(v) in memo:
            return memo[id(v)]
        src = v
        v = node(v)
        if v is not src:
            keep.append(v)
        out: Any
        if isinstance(v, dict):
            out = memo[id(src)] = {}
            for k, x in v.items():
                out[conv(k, depth + 1)] = conv(x, depth + 1)
            return out
        if type(v) is list:
            out = memo[id(src)] = []
            out.extend(conv(x, depth + 1) for x in v)
            return out
        if isinstance(v, (list, tuple)):
            out = tuple(conv(x, depth + 1) for x in v) if type(v) is not list else [conv(x, depth + 1) for x in v]
        elif isinstance(v, (set, frozenset)):
            out = type(v)(conv(x, depth + 1) for x in v)
        else:
            out = atom(v)
        memo[id(src)] = out
        return out

    return conv(value, 0)


def _torch_plain(value: Any) -> Any:
    """A value torch.load gave, in the terms ckpt's load() gives it: tensors as numpy arrays
    (conj / neg views resolved; a large view sampled), dtypes and layouts as 'torch.<name>',
    Size as a tuple, devices and paths as str, a memory format by its name, dataclasses (DCP's
    metadata) as a dict of their fields, namespaces as a dict; shared objects stay shared."""
    import argparse
    import pathlib
    import types

    import torch

    from library_reference import _tensor_to_numpy

    def tensor(t: Any) -> Any:
        t = t.resolve_conj().resolve_neg()
        if t.numel() * t.element_size() <= SAMPLE_ABOVE_BYTES:
            return _tensor_to_numpy(t)
        samples = [_tensor_to_numpy(t[r].contiguous()) for r in sample_regions(tuple(t.shape))]
        return Sampled(tuple(t.shape), str(samples[0].dtype), samples)

    def node(v: Any) -> Any:
        if isinstance(v, _Same):
            return {"same object as": ".".join(map(str, v.first))}
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
        if isinstance(v, (argparse.Namespace, types.SimpleNamespace)):
            return dict(vars(v))
        if isinstance(v, (list, tuple)) and type(v) not in (list, tuple) and not isinstance(v, torch.Size):
            return tuple(v)
        return v

    def atom(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return tensor(v)
        if isinstance(v, torch.Size):
            return tuple(v)
        if isinstance(v, (torch.dtype, torch.device, torch.layout)):
            return str(v)
        if isinstance(v, torch.memory_format):
            return str(v).removeprefix("torch.")
        if isinstance(v, pathlib.PurePath):
            return str(v)
        if isinstance(v, enum.Enum) and type(v).__name__ == "_MEM_FORMAT_ENCODING":
            return v.name.removeprefix("TORCH_").lower()  # ckpt names the memory format
        return v

    return _graph_plain(value, atom, node)


def _ckpt_plain(value: Any) -> Any:
    """A value ckpt's load() gave, in the same terms: a torch dtype by torch's name for it
    (`torch.float` is torch.float32), a stand-in record (DCP's metadata classes) as a dict of
    its fields, a later path to a shared container as the path it names."""
    import torch

    from ckpt_tool.machinery.torch_save.safe_pickle import Record, TorchDType
    from ckpt_tool.core.values import SameObject

    def node(v: Any) -> Any:
        if isinstance(v, SameObject):
            return {"same object as": v.name}
        if isinstance(v, Record):
            fields = {f: getattr(v, f) for f in v.FIELDS}
            fields.update(v.__dict__.get("unknown", {}))
            return fields
        if isinstance(v, (list, tuple)) and type(v) not in (list, tuple):
            return tuple(v)
        return v

    def atom(v: Any) -> Any:
        if isinstance(v, TorchDType):
            real = getattr(torch, v.name, None)
            return str(real) if isinstance(real, torch.dtype) else repr(v)
        return v

    return _graph_plain(value, atom, node)


def _by_name(pairs: list[tuple[str, Any]]) -> dict:
    """{name: value}; a name met again is keyed (name, n) (two leaves may share a dotted name)."""
    out: dict = {}
    seen: dict[str, int] = {}
    for name, v in pairs:
        n = seen.get(name, 0)
        seen[name] = n + 1
        out[name if n == 0 else (name, n)] = v
    return out


def torch_library_values(path: str, mode: str = "", ckpt_format: str = "torch") -> dict:
    """{dotted name: value} of torch.load(weights_only=True) of each file (torch_files), with
    the globals ckpt admits for `ckpt_format` given as safe globals (_torch_load)."""
    pairs: list[tuple[str, Any]] = []
    files = torch_files(path)
    for file, _key in files:
        # every file's globals first: one torch cannot be given leaves the whole load unchecked
        data = _pickle_of(file)
        if data is not None:
            try:
                found, _ = _pickle_globals(data)
            except Exception:  # noqa: BLE001 - _torch_load lets torch answer
                continue
            safe_globals_for(found, ckpt_format)
    for file, key in files:
        obj, _note = _torch_load(file, ckpt_format)
        leaves: list = []
        _torch_walk(obj, (key,) if key is not None else (), leaves)
        pairs.extend((".".join(map(str, keys)), _torch_plain(v)) for keys, v in leaves)
    return _by_name(pairs)


def torch_ckpt_values(path: str) -> dict:
    """{dotted name: value} as ckpt's Python API reads the checkpoint (leaf.name is the dotted path)."""
    import ckpt_tool

    pairs = []
    for leaf in ckpt_tool.open(path).leaves:
        pairs.append((leaf.name, _ckpt_array(leaf) if leaf.kind == "array" else _ckpt_plain(leaf.load())))
    return _by_name(pairs)


def _ckpt_array(leaf: Any) -> Any:
    """A leaf's values; past SAMPLE_ABOVE_BYTES, its sampled regions (as _torch_plain samples)."""
    shape = tuple(leaf.shape)
    if leaf.nbytes <= SAMPLE_ABOVE_BYTES:
        return leaf.read()
    samples = [leaf.read(r) for r in sample_regions(shape)]
    return Sampled(shape, str(samples[0].dtype), samples)


LIBRARIES = {"dcp": dcp_library_values, "orbax": orbax_library_values, "safetensors": safetensors_library_values,
             "msgpack": msgpack_library_values, "torch": torch_library_values}
CKPT_VALUES = {"torch": torch_ckpt_values}


def _one_line(exc: BaseException) -> str:
    # torch wraps a rank's failure in a CheckpointException whose text is the
    # inner traceback: its last line is the error itself
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    s = f"{type(exc).__name__}: {last}" if len(lines) > 1 else f"{type(exc).__name__}: {exc}"
    return s if len(s) < 400 else s[:397] + "..."


def check(fmt: str, path: str, mode: str = "", ckpt_format: str = "") -> dict:
    """The library's values against ckpt's; `ckpt_format` (the registry's name) picks the
    allow-list a torch.save file is loaded with."""
    t0 = time.monotonic()
    res: dict[str, Any] = {"library_ok": False, "library_error": None, "ckpt_ok": False,
                           "ckpt_error": None, "mismatch": None}
    lib = ours = None
    try:
        if fmt == "torch":
            lib = torch_library_values(path, mode, ckpt_format or "torch")
        else:
            lib = LIBRARIES[fmt](path, mode)
        res["library_ok"] = True
    except UncheckedGlobals as exc:
        res["library_error"] = _one_line(exc)
        res["unchecked"] = exc.names
    except WeightsOnlyRefusal as exc:
        res["library_error"] = _one_line(exc)
        res["refused_globals"] = exc.refused
    except BaseException as exc:  # noqa: BLE001 - the library's rejection is the answer
        res["library_error"] = _one_line(exc)
    try:
        ours = CKPT_VALUES.get(fmt, ckpt_values)(path)
        res["ckpt_ok"] = True
    except BaseException as exc:  # noqa: BLE001
        res["ckpt_error"] = _one_line(exc)
    if lib is not None and ours is not None:
        if fmt == "safetensors":
            # ckpt keys safetensors leaves by the dotted name split on '.'; compare by the keys as
            # text (a tuple, never '/'-joined: the tensors `a.b` and `a/b` are two keys, not one)
            lib = {tuple(map(str, k)): v for k, v in lib.items()}
            ours = {tuple(map(str, k)): v for k, v in ours.items()}
        try:
            res["mismatch"] = compare(lib, ours)
        except Exception as exc:  # noqa: BLE001
            res["mismatch"] = "comparison failed: " + _one_line(exc)
    res["seconds"] = round(time.monotonic() - t0, 3)
    return res


def main() -> None:
    # warm up: import the libraries once, before the first request's clock
    fmts = [a for a in sys.argv[1:] if a in LIBRARIES] or list(LIBRARIES)
    if "dcp" in fmts or "torch" in fmts:
        import torch  # noqa: F401
        import torch.distributed.checkpoint  # noqa: F401
    if "orbax" in fmts or "msgpack" in fmts:
        import jax
        import orbax.checkpoint  # noqa: F401
        import orbax.checkpoint.msgpack_utils  # noqa: F401

        # int64 leaves restore as int64 (as orbax's users with x64 get them)
        jax.config.update("jax_enable_x64", True)
    import ckpt_tool.formats  # noqa: F401

    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter must not corrupt the protocol
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            res = check(req["format"], req["path"], req.get("mode", ""), req.get("ckpt_format", ""))
        except BaseException:  # noqa: BLE001
            res = {"worker_error": traceback.format_exc(limit=3)}
        out.write(json.dumps(res, default=str) + "\n")
        out.flush()


if __name__ == "__main__":
    main()

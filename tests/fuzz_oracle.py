"""The fuzzing oracle: a long-lived worker that loads a checkpoint with the REAL
library and with ckpt's Python API, and says whether they agree.

Run as a process (`python tests/fuzz_oracle.py`); it reads one JSON request per
line on stdin ({"format": "dcp"|"orbax"|"safetensors"|"msgpack", "path": ...}) and writes
one JSON answer per line on stdout:

    {"library_ok": bool, "library_error": str|None,
     "ckpt_ok": bool, "ckpt_error": str|None,
     "mismatch": str|None, "seconds": float}

torch and jax are imported once per worker (that is the point of the worker:
a whole-process import per mutant would cost seconds). The worker runs jax on
8 CPU devices, as the tests do, so that orbax's restore without a target can
rebuild every recorded sharding.

A DCP `.metadata` is given to torch (whose reader is plain `pickle.load`) only
after a scan of its opcodes finds no global outside the set a real `.metadata`
uses: a hostile pickle that ckpt let through is reported, never run.
"""
from __future__ import annotations

import json
import os
import pickletools
import sys
import tempfile
import time
import traceback
from typing import Any

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


def _same(a: Any, b: Any) -> bool:
    import numpy as np

    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
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
        return x.tobytes() == y.tobytes()  # bit-exact, NaN-safe
    try:
        return bool(np.array_equal(x.astype("float64"), y.astype("float64"), equal_nan=True))
    except Exception:  # noqa: BLE001
        return False


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


LIBRARIES = {"dcp": dcp_library_values, "orbax": orbax_library_values, "safetensors": safetensors_library_values,
             "msgpack": msgpack_library_values}


def _one_line(exc: BaseException) -> str:
    # torch wraps a rank's failure in a CheckpointException whose text is the
    # inner traceback: its last line is the error itself
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    s = f"{type(exc).__name__}: {last}" if len(lines) > 1 else f"{type(exc).__name__}: {exc}"
    return s if len(s) < 400 else s[:397] + "..."


def check(fmt: str, path: str, mode: str = "") -> dict:
    t0 = time.monotonic()
    res: dict[str, Any] = {"library_ok": False, "library_error": None, "ckpt_ok": False,
                           "ckpt_error": None, "mismatch": None}
    lib = ours = None
    try:
        lib = LIBRARIES[fmt](path, mode)
        res["library_ok"] = True
    except BaseException as exc:  # noqa: BLE001 - the library's rejection is the answer
        res["library_error"] = _one_line(exc)
    try:
        ours = ckpt_values(path)
        res["ckpt_ok"] = True
    except BaseException as exc:  # noqa: BLE001
        res["ckpt_error"] = _one_line(exc)
    if lib is not None and ours is not None:
        if fmt == "safetensors":
            # ckpt keys safetensors leaves by the dotted name split on '.'; compare by path
            lib = {"/".join(map(str, k)): v for k, v in lib.items()}
            ours = {"/".join(map(str, k)): v for k, v in ours.items()}
        try:
            res["mismatch"] = compare(lib, ours)
        except Exception as exc:  # noqa: BLE001
            res["mismatch"] = "comparison failed: " + _one_line(exc)
    res["seconds"] = round(time.monotonic() - t0, 3)
    return res


def main() -> None:
    # warm up: import the libraries once, before the first request's clock
    fmts = [a for a in sys.argv[1:] if a in LIBRARIES] or list(LIBRARIES)
    if "dcp" in fmts:
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
            res = check(req["format"], req["path"], req.get("mode", ""))
        except BaseException:  # noqa: BLE001
            res = {"worker_error": traceback.format_exc(limit=3)}
        out.write(json.dumps(res, default=str) + "\n")
        out.flush()


if __name__ == "__main__":
    main()

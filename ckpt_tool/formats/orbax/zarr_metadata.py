"""The zarr metadata (`.zarray` / `zarr.json`) tensorstore writes for the Orbax output's arrays,
byte for byte, without tensorstore for orbax's own specs, else at the cost of a few opens.

The specs the Orbax writer builds (write.py's _memory_spec: zarr v2 with orbax's zstd compressor,
zarr3 with orbax's one-chunk shards) are written here as tensorstore's zarr drivers write them
(generate(): keys sorted, compact, the defaults tensorstore adds spelled as it spells them): on a
TPU host importing tensorstore cost ~80 ms and its opens more, and a local Orbax -> Orbax write
needs it for nothing else. tests/formats/orbax/test_orbax_zarr_metadata.py compares the two for
every dtype and odd shapes. A spec of any other form (another key, dtype, codec or level) goes
the way below, as does every spec with CKPT_ZARR_METADATA=tensorstore (the switch back, for A/B).

The Orbax writer puts on disk exactly the metadata tensorstore's zarr driver writes for orbax's
spec (direct.py). Asking tensorstore once per array (an in-memory open) cost 0.5 s for the 632
leaves of a full Adam state on a TPU host, twice over (the plan asks each array's encoding, the
writer its metadata): a quarter of a reshard's whole time there. Yet the arrays of a checkpoint
differ mostly in shape and chunk shape: tensorstore is asked for one array of each kind (the
spec with the shapes left out, and the rank), the shapes are then put into its answer, and the
answer is checked twice before it is trusted: the first array's metadata must be what its
parsed JSON dumps back to, and a second array's derived metadata must be what tensorstore
itself writes for it. A kind that fails either check is asked of tensorstore array by array,
as before.
"""
from __future__ import annotations

import json
import operator
import os
import threading
from typing import Any

from ...base.errors import CkptError
from ...storage import ts_error_text

# where the shapes sit in orbax's spec["metadata"] and in what tensorstore writes (the same paths)
_SHAPE_PATHS = {
    False: (("shape",), ("chunks",)),
    True: (("shape",), ("chunk_grid", "configuration", "chunk_shape"), ("codecs", 0, "configuration", "chunk_shape")),
}


def metadata_key(zarr3: bool) -> str:
    return "zarr.json" if zarr3 else ".zarray"


def generated_here() -> bool:
    """Whether orbax's specs get their metadata from generate() (CKPT_ZARR_METADATA=tensorstore:
    every array's from tensorstore, as before; for comparing the two)."""
    return os.environ.get("CKPT_ZARR_METADATA", "ckpt") != "tensorstore"


# dtype -> how tensorstore's zarr driver spells it in `.zarray` (zarr v2: numpy's typestr, little
# endian, "|" for one byte; the ml_dtypes by name). Those left out (int4, float4, the newer float8
# kinds) go to tensorstore: its support of them changes between versions.
_ZARR2_DTYPES = {
    "bool": "|b1", "int8": "|i1", "uint8": "|u1",
    **{f"{k}int{b}": f"<{k[:1] or 'i'}{b // 8}" for k in ("", "u") for b in (16, 32, 64)},
    **{f"float{b}": f"<f{b // 8}" for b in (16, 32, 64)},
    "complex64": "<c8", "complex128": "<c16",
    **{n: n for n in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                      "float8_e4m3b11fnuz")},
}
# zarr3: dtype -> (its item size, the fill_value tensorstore writes when the spec sets none)
_ZARR3_DTYPES = {
    "bool": (1, "false"),
    **{f"{k}int{b}": (b // 8, "0") for k in ("", "u") for b in (8, 16, 32, 64)},
    **{f"float{b}": (b // 8, "0.0") for b in (16, 32, 64)},
    "bfloat16": (2, "0.0"),
    **{n: (1, "0.0") for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                               "float8_e4m3b11fnuz")},
    "complex64": (8, "[0.0,0.0]"), "complex128": (16, "[0.0,0.0]"),
}
# orbax's compression (the only ones generated), as orbax_metadata puts it in the writer's specs
_ZARR2_COMPRESSOR = {"id": "zstd", "level": 1}
_ZARR3_BYTES = {"name": "bytes", "configuration": {"endian": "little"}}
_ZARR3_ZSTD = {"name": "zstd", "configuration": {"level": 3}}


def _dims(value: Any) -> list[int] | None:
    """A shape as tensorstore takes it (a list of non-negative ints), else None."""
    if not isinstance(value, list):
        return None
    try:
        dims = [operator.index(d) for d in value if not isinstance(d, bool)]
    except TypeError:
        return None
    return dims if len(dims) == len(value) and all(d >= 0 for d in dims) else None


def orbax_metadata(shape: list[int], chunks: list[int], zarr3: bool) -> dict[str, Any]:
    """The zarr metadata orbax passes to tensorstore for an array (tensorstore_utils._build_zarr{2,3}_metadata):
    the Orbax writer's specs are built with it, and generate() knows exactly this form."""
    if not zarr3:
        return {"shape": shape, "chunks": chunks, "compressor": dict(_ZARR2_COMPRESSOR)}
    return {
        "shape": shape,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
        "codecs": [{
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": chunks,
                "codecs": [dict(_ZARR3_BYTES), dict(_ZARR3_ZSTD)],
                "index_codecs": [dict(_ZARR3_BYTES), {"name": "crc32c"}],
                "index_location": "end",
            },
        }],
    }


def generate(spec: dict[str, Any], zarr3: bool) -> bytes | None:
    """The metadata tensorstore's zarr (zarr3) driver writes when it creates `spec`, an array spec
    of exactly the form the Orbax writer builds; None for any other spec (asked of tensorstore).

    tensorstore writes its JSON through nlohmann's (keys sorted, no spaces) and fills in what the
    spec leaves out: zarr v2 its dimension_separator ".", fill_value null (no fill value), no
    filters, order "C"; zarr3 the default chunk_key_encoding, the fill value of the dtype's zero,
    and drops what is its default (index_location "end"), while the bytes codec of a one-byte
    type loses its endian and zstd gains its checksum flag."""
    try:
        if set(spec) - {"driver", "dtype", "metadata", "store_data_equal_to_fill_value"}:
            return None
        if spec.get("driver") != ("zarr3" if zarr3 else "zarr") or \
                spec.get("store_data_equal_to_fill_value", True) not in (True, False):
            return None
        meta, dtype = spec["metadata"], spec["dtype"]
        if not isinstance(meta, dict) or not isinstance(dtype, str):
            return None
        shape = _dims(meta.get("shape"))
        if zarr3:
            grid = meta.get("chunk_grid")
            chunks = _dims(grid.get("configuration", {}).get("chunk_shape")) if isinstance(grid, dict) else None
            if shape is None or chunks is None or len(chunks) != len(shape) or 0 in chunks \
                    or dtype not in _ZARR3_DTYPES or meta != orbax_metadata(shape, chunks, True):
                return None
            size, fill = _ZARR3_DTYPES[dtype]
            inner = '{"name":"bytes"}' if size == 1 else '{"configuration":{"endian":"little"},"name":"bytes"}'
            c, s = _compact(chunks), _compact(shape)
            return (
                f'{{"chunk_grid":{{"configuration":{{"chunk_shape":{c}}},"name":"regular"}},'
                f'"chunk_key_encoding":{{"name":"default"}},'
                f'"codecs":[{{"configuration":{{"chunk_shape":{c},"codecs":[{inner},'
                f'{{"configuration":{{"checksum":false,"level":3}},"name":"zstd"}}],'
                f'"index_codecs":[{{"configuration":{{"endian":"little"}},"name":"bytes"}},{{"name":"crc32c"}}]}},'
                f'"name":"sharding_indexed"}}],'
                f'"data_type":"{dtype}","fill_value":{fill},"node_type":"array","shape":{s},"zarr_format":3}}'
            ).encode()
        chunks = _dims(meta.get("chunks"))
        if shape is None or chunks is None or len(chunks) != len(shape) or 0 in chunks \
                or dtype not in _ZARR2_DTYPES or meta != orbax_metadata(shape, chunks, False):
            return None
        return (
            f'{{"chunks":{_compact(chunks)},"compressor":{{"id":"zstd","level":1}},"dimension_separator":".",'
            f'"dtype":"{_ZARR2_DTYPES[dtype]}","fill_value":null,"filters":null,"order":"C",'
            f'"shape":{_compact(shape)},"zarr_format":2}}'
        ).encode()
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def _compact(dims: list[int]) -> str:
    return "[" + ",".join(map(str, dims)) + "]"


def from_tensorstore(specs: dict[str, dict[str, Any]], zarr3: bool) -> dict[str, bytes]:
    """name -> the metadata tensorstore writes for each spec (a zarr spec without kvstore), every
    array created at once in memory."""
    import tensorstore as ts  # (only for a spec generate() does not know)

    context = ts.Context()
    futures = {}
    try:
        for name, spec in specs.items():
            futures[name] = ts.open({**spec, "kvstore": {"driver": "memory", "path": name + "/"}},
                                    create=True, context=context)
        for fut in futures.values():
            fut.result()
        kv = ts.KvStore.open({"driver": "memory"}, context=context).result()
        key = metadata_key(zarr3)
        reads = {name: kv.read(f"{name}/{key}".encode()) for name in specs}
        got = {name: fut.result() for name, fut in reads.items()}
    except Exception as exc:  # noqa: BLE001 - tensorstore refused orbax's own metadata
        raise CkptError(f"cannot create the output array's metadata: {ts_error_text(exc)}",
                        next(iter(specs), "")) from exc
    out = {}
    for name, res in got.items():
        if res.state != "value":
            raise CkptError("tensorstore wrote no metadata for the array", name)
        out[name] = bytes(res.value)
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        doc = doc[step]
    return doc


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    _get(doc, path[:-1])[path[-1]] = value


def _replaced(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    """`doc` with the value at `path` replaced: the containers on the path copied, nothing else."""
    if not path:
        return value
    head = path[0]
    copy: Any = list(doc) if isinstance(doc, list) else dict(doc)
    copy[head] = _replaced(doc[head], path[1:], value)
    return copy


def _dump(doc: Any) -> bytes:
    # tensorstore's (nlohmann's) compact form; the keys keep the order they were parsed in
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _kind(spec: dict[str, Any], zarr3: bool) -> str | None:
    """The spec with its shapes left out (their rank kept): arrays of one kind get metadata that
    differs only in the shapes. None when the spec lacks a shape path (asked of tensorstore)."""
    try:
        meta = spec["metadata"]
        for path in _SHAPE_PATHS[zarr3]:
            meta = _replaced(meta, path, len(_get(meta, path)))
        return json.dumps({**spec, "metadata": meta}, sort_keys=True)
    except (KeyError, IndexError, TypeError, ValueError):
        return None


class _Template:
    """tensorstore's metadata of one array of a kind, as text with a hole for each shape."""

    def __init__(self, doc: dict[str, Any], zarr3: bool) -> None:
        self.zarr3 = zarr3
        doc = json.loads(json.dumps(doc))
        holes = []
        for i, path in enumerate(_SHAPE_PATHS[zarr3]):
            _get(doc, path)  # tensorstore wrote it there (else KeyError: the kind is not derivable)
            hole = f"\u0000ckpt-shape-{i}\u0000"
            _set(doc, path, hole)
            holes.append(json.dumps(hole))
        text = _dump(doc).decode("utf-8")
        # the text between the holes, in the order they appear
        order = sorted(range(len(holes)), key=lambda i: text.index(holes[i]))
        self.order = order
        self.pieces = []
        rest = text
        for i in order:
            before, _, rest = rest.partition(holes[i])
            self.pieces.append(before)
        self.pieces.append(rest)

    def fill(self, spec: dict[str, Any]) -> bytes:
        meta = spec["metadata"]
        paths = _SHAPE_PATHS[self.zarr3]
        out = [self.pieces[0]]
        for n, i in enumerate(self.order):
            out.append(json.dumps([int(d) for d in _get(meta, paths[i])], separators=(",", ":")))
            out.append(self.pieces[n + 1])
        return "".join(out).encode("utf-8")


class _Kinds:
    """kind -> its template (None: not derivable)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.templates: dict[str, _Template | None] = {}


_KINDS = _Kinds()


def _derive(template: _Template, spec: dict[str, Any]) -> bytes | None:
    try:
        return template.fill(spec)
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def _template(doc: dict[str, Any], zarr3: bool) -> _Template | None:
    try:
        return _Template(doc, zarr3)
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def _learn(kind: str, members: list[tuple[str, dict[str, Any]]], zarr3: bool) -> dict[str, bytes]:
    """Ask tensorstore for one member (two where there are two), keep the kind's template when
    the checks hold; the members asked, name -> metadata."""
    asked = members[:2]
    probe = None
    if len(asked) == 1:
        # one array of its kind here (the planner asks array by array): a second one of the same
        # kind, each shape one larger, checks the derivation on other shapes than the first's
        probe = asked[0][0] + ".probe"  # (the only other name in this call)
        spec = asked[0][1]
        for path in _SHAPE_PATHS[zarr3]:
            spec = {**spec, "metadata": _replaced(spec["metadata"], path,
                                                  [int(d) + 1 for d in _get(spec["metadata"], path)])}
        asked = [asked[0], (probe, spec)]
    got = from_tensorstore(dict(asked), zarr3)
    first_name, first_spec = asked[0]
    doc = json.loads(got[first_name])
    template = _template(doc, zarr3) if _dump(doc) == got[first_name] else None
    if template is not None and _derive(template, first_spec) != got[first_name]:
        template = None
    if template is not None and len(asked) == 2:
        second_name, second_spec = asked[1]
        if _derive(template, second_spec) != got[second_name]:
            template = None
    with _KINDS.lock:
        _KINDS.templates[kind] = template
    if probe is not None:
        del got[probe]
    return got


def metadata(specs: dict[str, dict[str, Any]], zarr3: bool) -> dict[str, bytes]:
    """name -> the `.zarray` / `zarr.json` tensorstore writes for each array spec (zarr or zarr3
    driver, dtype and metadata as the Orbax writer opens it, without kvstore), byte for byte."""
    out: dict[str, bytes] = {}
    if generated_here():
        for name, spec in specs.items():
            made = generate(spec, zarr3)
            if made is not None:
                out[name] = made
    by_kind: dict[str | None, list[tuple[str, dict[str, Any]]]] = {}
    for name, spec in specs.items():
        if name not in out:
            by_kind.setdefault(_kind(spec, zarr3), []).append((name, spec))
    unknown: dict[str, dict[str, Any]] = dict(by_kind.pop(None, []))
    for kind, members in by_kind.items():
        assert kind is not None
        with _KINDS.lock:
            learnt = kind in _KINDS.templates
            template = _KINDS.templates.get(kind)
        if not learnt:
            out.update(_learn(kind, members, zarr3))
            with _KINDS.lock:
                learnt = kind in _KINDS.templates
                template = _KINDS.templates.get(kind)
            members = [(n, s) for n, s in members if n not in out]
        for name, spec in members:
            derived = _derive(template, spec) if template is not None else None
            if derived is None:
                unknown[name] = spec
            else:
                out[name] = derived
    if unknown:
        out.update(from_tensorstore(unknown, zarr3))
    return out

"""safetensors: the catalogue rows (tests/conformance/rows.py) of ckpt_tool/formats/safetensors
and the library's view of its fixtures (safe_open; torch's HF storage reader for DCP's per-rank shards)."""
from __future__ import annotations

import struct
from pathlib import Path

from references import Ref, by_name, torch_dtype_name, torch_to_numpy
from rows import Damage, Entry, FixtureSpec, Inside, Library


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
        out[by_name(fqn)] = Ref("array", tuple(int(d) for d in item.size), torch_dtype_name(item.properties))
    return out


def safetensors_live_values(path: Path, step: str | None = None) -> dict:
    return _safetensors_values(path)


def safetensors_dcp_hf_values(path: Path, step: str | None = None) -> dict:
    """torch's HF storage reader: dcp.load of the per-rank shards into full tensors."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    shapes = safetensors_dcp_hf(path)
    sd = {k[1]: torch.zeros(ref.shape, dtype=getattr(torch, ref.dtype)) for k, ref in shapes.items()}
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(str(path)))
    return {by_name(k): torch_to_numpy(v) for k, v in sd.items()}


def _safetensors_values(path: Path) -> dict:
    from safetensors import safe_open

    out = {}
    for f in _safetensors_files(Path(path)):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[by_name(k)] = torch_to_numpy(h.get_tensor(k))
    return out



def _header_length(p: Path, work: Path) -> None:
    """safetensors: the 8-byte header length off by 8."""
    data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    p.write_bytes(struct.pack("<Q", n + 8) + data[8:])


HOW = {"header-length": _header_length}

LIVE = {"reference": safetensors_live, "values": safetensors_live_values}
DCP_HF = {"reference": safetensors_dcp_hf, "values": safetensors_dcp_hf_values}

ENTRIES: list[Entry] = [
    # safetensors (transformers, safetensors.numpy, DCP's HF writer): safe_open / torch's HF reader
    Entry("safetensors_llama_sharded", "safetensors", **LIVE),
    Entry("safetensors_llama_bf16", "safetensors", **LIVE),
    Entry("safetensors_numpy", "safetensors", **LIVE),
    Entry("safetensors_dcp_rank0", "safetensors", **LIVE),
    Entry("safetensors_dcp_consolidated", "safetensors", **LIVE),
    Entry("safetensors_dcp_distributed", "safetensors", **DCP_HF),
]

DAMAGE: list[Damage] = [
    # safetensors: a shard, its header, the index
    Damage("safetensors", "missing-file", "safetensors_llama_sharded", "model-00002-of-00004.safetensors",
           "remove", "missing-file"),
    Damage("safetensors", "truncated-file", "safetensors_llama_sharded", "model-00002-of-00004.safetensors",
           "truncate", "truncated-file"),
    Damage("safetensors", "wrong-size", "safetensors_llama_sharded", "model-00002-of-00004.safetensors",
           "header-length", "bad-metadata"),
    Damage("safetensors", "wrong-size", "safetensors_numpy", "model.safetensors", "grow", "bad-metadata"),
    Damage("safetensors", "garbage-metadata", "safetensors_llama_sharded", "model.safetensors.index.json",
           "garbage", "bad-metadata"),
    Damage("safetensors", "path-escape", "safetensors_llama_sharded", "model-00002-of-00004.safetensors",
           "symlink-out", "path-escape"),
]

LIBRARY = {"safetensors": Library(_safetensors_values, named=True)}  # safe_open, keyed by tensor name

INSIDE = [Inside("safetensors_llama_sharded/model.safetensors.index.json", "safetensors_llama_sharded", "safetensors")]

FUZZ = [
    FixtureSpec("safetensors_numpy", "safetensors", "safetensors"),
    FixtureSpec("safetensors_llama_sharded", "safetensors", "safetensors"),
]
FUZZ_WEIGHT = {"safetensors": 0.06}

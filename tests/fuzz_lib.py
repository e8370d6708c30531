"""The fuzzing suite's machinery: mutants of the committed fixtures, the
contract every `ckpt` run must keep on them, and the library oracle.

Used by tests/fuzz/test_fuzz.py (a seeded, fast subset in `make test`) and by
fuzz/run_fuzz.py (the long run behind `make fuzz`).

A *mutant* is a copy of one committed fixture (never the fixture itself) with
one file damaged by one mutation operator: byte-level (flips, truncation,
insertion, deletion), structure-aware (JSON fields of every Orbax metadata
kind, pickle opcodes of a DCP `.metadata`, the fields of torch's Metadata
object re-pickled, zip records of a `.distcp` archive, a safetensors header,
a msgpack tree's structure and ext types, a torch.save archive's data.pkl,
zip structure and storages, rewritten consistently where the damage should
reach past the CRC check) or removal of the file. Every operator takes a `random.Random`, so a mutant is
reproducible from (seed, index) and hypothesis can drive the choices.

The contract, for `ckpt inspect --json`, `ckpt validate` and
`ckpt validate --deep` on every mutant, as whole processes:
  * no Python traceback and no `internal error` on stderr;
  * exit code 0 or 1, no signal;
  * under 20 s wall time; peak RSS under 1 GB;
  * on failure, stderr is (at most) one line; inspect's stdout on success is JSON;
and the oracle: where validate exits 0 (--deep; or shallow, for a mutant of a
metadata file, which shallow validate claims to check), the real library
(torch's dcp_to_torch_save, orbax's restore with no target, safetensors'
safe_open, orbax's msgpack_restore for Flax msgpack, torch.load(weights_only=True)
for torch.save files) loads it, and with the values ckpt's Python API reads. A
torch.save file is loaded as megatron-core and DeepSpeed load theirs: the globals
ckpt's allow-list admits as data beyond weights_only's defaults are given to
torch.serialization.safe_globals as the real classes; a mutant naming one that
cannot be imported in the oracle worker (deepspeed, megatron) is unchecked (no
verdict, said in its run record).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import pickle
import pickletools
import random
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from rows import FixtureSpec

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
CORPUS = ROOT / "tests" / "fuzz_corpus"
ORACLE_SCRIPT = ROOT / "tests" / "fuzz_oracle.py"

TIME_LIMIT_S = 20.0
RSS_LIMIT_KB = 1024 * 1024  # 1 GB
# a run is killed here (a little past the limit, to tell slow from hung)
KILL_AFTER_S = 30.0
# the zygote stops a child whose RSS passes this (the limit is 1 GB; the
# machine is shared)
RSS_GUARD_KB = 3 * 1024 * 1024

COMMANDS = {
    "inspect": ["inspect", "--json"],
    "validate": ["validate"],
    "deep": ["validate", "--deep"],
}


CONFORMANCE = ROOT / "tests" / "conformance"


def _catalogue() -> Any:
    """The conformance catalogue (tests/conformance/catalogue.py): each format's file there lists
    the fixtures fuzzed (FUZZ) and its share of a long run (FUZZ_WEIGHT); nothing here names one.
    Imported on first use, so that the zygote (this file run as a script) never loads it."""
    if str(CONFORMANCE) not in sys.path:
        sys.path.insert(0, str(CONFORMANCE))
    import catalogue

    return catalogue


def fixture_specs() -> list[FixtureSpec]:
    """Every fixture the fuzzing suite mutates (the catalogue files' FUZZ rows)."""
    return _catalogue().CATALOGUE.fuzz


def format_weights() -> dict[str, float]:
    """{format: share of mutants in a long run}, in the order lists shown to people name the formats
    (rng.choices draws by position: the order is part of what a seed reproduces)."""
    from ckpt_tool import formats

    weights = _catalogue().CATALOGUE.fuzz_weights
    return {f.name: weights[f.name] for f in formats.shown() if f.name in weights}


def spec_of(fixture: str) -> FixtureSpec:
    """The FUZZ row of a fixture; for another catalogued fixture, one without an oracle."""
    found = next((s for s in fixture_specs() if s.name == fixture), None)
    if found is not None:
        return found
    cat = _catalogue()
    return cat.FixtureSpec(fixture, next(e.format for e in cat.ENTRIES if e.path == fixture), None)


def __getattr__(name: str) -> Any:
    # FIXTURE_SPECS, SPECS (by fixture name) and FORMAT_WEIGHTS, read from the catalogue on first use
    if name == "FIXTURE_SPECS":
        return fixture_specs()
    if name == "SPECS":
        return {s.name: s for s in fixture_specs()}
    if name == "FORMAT_WEIGHTS":
        return format_weights()
    if name == "FixtureSpec":
        return _catalogue().FixtureSpec
    raise AttributeError(name)


# kinds whose damage shallow validate claims to catch (metadata); damage to
# the others (array data) is --deep's job
METADATA_KINDS = {
    "checkpoint_metadata", "metadata", "sharding", "array_metadatas", "zarr_meta", "strings_json",
    "commit_marker", "ocdbt_manifest", "dcp_metadata", "safetensors_index", "safetensors_header",
    # torch.save: the pickle, the zip structure and records, a .bin set's index (a storage's
    # bytes, its local header and data descriptor are read with its data: torch_storage, --deep)
    "torch_pickle", "torch_zip", "torch_index",
}


# --------------------------------------------------------------------------
# targets: which file of a fixture is which kind
# --------------------------------------------------------------------------

TORCH_SUFFIXES = (".bin", ".pt", ".pth")
# the mutation kinds of one torch.save archive (mutate_torch_pickle / _zip / _storage)
TORCH_KINDS = ("torch_pickle", "torch_zip", "torch_storage")


def target_kind(rel: str) -> str | None:
    name = rel.rsplit("/", 1)[-1]
    parts = rel.split("/")
    if name == "_CHECKPOINT_METADATA":
        return "checkpoint_metadata"
    if name == "_METADATA":
        return "metadata"
    if name == "_sharding":
        return "sharding"
    if len(parts) >= 2 and parts[-2] == "array_metadatas":
        return "array_metadatas"
    if name in (".zarray", "zarr.json", ".zattrs"):
        return "zarr_meta"
    if name == "_strings.json":
        return "strings_json"
    if name == "commit_success.txt":
        return "commit_marker"
    if name == "manifest.ocdbt":
        return "ocdbt_manifest"
    if len(parts) >= 2 and parts[-2] == "d":
        return "ocdbt_data"
    if name == ".metadata":
        return "dcp_metadata"
    if name.endswith(".distcp"):
        return "distcp"
    if name.endswith(".safetensors"):
        return "safetensors"
    if name == "model.safetensors.index.json":
        return "safetensors_index"
    if name.endswith(TORCH_SUFFIXES):
        # at any depth: DeepSpeed's global_stepN/*.pt, Megatron's iter_N/common.pt and
        # mp_rank_XX/model_optim_rng.pt are torch.save archives too
        return "torch_save"  # expanded into TORCH_KINDS by fixture_targets
    if len(parts) == 1 and name.endswith(".bin.index.json"):
        return "torch_index"
    if name.startswith("checkpoint"):
        return "msgpack"
    if name.endswith(".json"):
        return None  # config.json etc.: not part of the checkpoint
    if len(parts) >= 2:
        return "zarr_chunk"  # plain zarr chunk files (0.1, 3, c/0/1)
    return None


def fixture_targets(root: Path) -> dict[str, list[str]]:
    """{kind: [relative paths]} of a fixture's files."""
    out: dict[str, list[str]] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            rel = p.relative_to(root).as_posix()
            kind = target_kind(rel)
            # a torch.save archive is three targets: its pickle, its zip structure, its storages
            for k in TORCH_KINDS if kind == "torch_save" else (kind,) if kind else ():
                out.setdefault(k, []).append(rel)
                if k in KEY_SPACE_KINDS:  # (the same file's key-space mutants: KEY_SPACE_KINDS, below)
                    out.setdefault(KEY_SPACE_KINDS[k], []).append(rel)
    return out


# --------------------------------------------------------------------------
# byte-level operators
# --------------------------------------------------------------------------

INTERESTING_INTS = [0, 1, -1, 2, 7, 8, 255, 256, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40,
                    2**53, 2**62, 2**63 - 1, 2**63, 2**64, -(2**31), -(2**63)]


def _pos(rng: random.Random, n: int) -> int:
    return rng.randrange(n) if n else 0


def bytes_mutation(rng: random.Random, data: bytes) -> tuple[bytes | None, str]:
    """One byte-level mutation; None means delete the file."""
    n = len(data)
    op = rng.choice(["flip", "flip", "set", "insert", "delete", "truncate", "truncate0", "extend",
                     "zero_range", "dup_range", "remove", "head_flip"])
    b = bytearray(data)
    if op in ("flip", "head_flip") and n:
        i = _pos(rng, min(n, 64)) if op == "head_flip" else _pos(rng, n)
        bit = rng.randrange(8)
        b[i] ^= 1 << bit
        return bytes(b), f"{op} bit {bit} of byte {i}"
    if op == "set" and n:
        i = _pos(rng, n)
        v = rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])
        b[i] = v
        return bytes(b), f"set byte {i} to {v:#x}"
    if op == "insert":
        i = _pos(rng, n + 1)
        chunk = bytes(rng.randrange(256) for _ in range(rng.choice([1, 1, 4, 64])))
        return data[:i] + chunk + data[i:], f"insert {len(chunk)} bytes at {i}"
    if op == "delete" and n:
        i = _pos(rng, n)
        k = min(n - i, rng.choice([1, 1, 4, 64]))
        return data[:i] + data[i + k:], f"delete {k} bytes at {i}"
    if op == "truncate" and n:
        i = _pos(rng, n)
        return data[:i], f"truncate to {i} of {n} bytes"
    if op == "truncate0":
        return b"", "truncate to 0 bytes"
    if op == "extend":
        k = rng.choice([1, 8, 4096])
        return data + bytes(k), f"append {k} zero bytes"
    if op == "zero_range" and n:
        i = _pos(rng, n)
        k = min(n - i, rng.choice([4, 16, 256]))
        return data[:i] + bytes(k) + data[i + k:], f"zero {k} bytes at {i}"
    if op == "dup_range" and n:
        i = _pos(rng, n)
        k = min(n - i, rng.choice([4, 16, 256]))
        return data[:i + k] + data[i:i + k] + data[i + k:], f"duplicate {k} bytes at {i}"
    if op == "remove":
        return None, "remove the file"
    return data + b"\0", "append one zero byte"


# --------------------------------------------------------------------------
# JSON operators (every Orbax metadata kind; safetensors headers and index)
# --------------------------------------------------------------------------


class _Nested:
    """A JSON string whose content is itself JSON (`_sharding` values)."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _decode_nested(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _decode_nested(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_nested(v) for v in obj]
    if isinstance(obj, str) and obj[:1] in "{[":
        try:
            return _Nested(_decode_nested(json.loads(obj)))
        except ValueError:
            return obj
    return obj


def _encode_nested(obj: Any) -> Any:
    if isinstance(obj, _Nested):
        return json.dumps(_encode_nested(obj.value))
    if isinstance(obj, dict):
        return {k: _encode_nested(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_encode_nested(v) for v in obj]
    return obj


def _json_slots(obj: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    """Every (path, value) in the tree, containers included."""
    out = [(path, obj)]
    inner = obj.value if isinstance(obj, _Nested) else obj
    if isinstance(inner, dict):
        for k, v in inner.items():
            out.extend(_json_slots(v, path + (k,)))
    elif isinstance(inner, list):
        for i, v in enumerate(inner):
            out.extend(_json_slots(v, path + (i,)))
    return out


def _container(root: Any, path: tuple) -> Any:
    node = root
    for k in path:
        node = node.value if isinstance(node, _Nested) else node
        node = node[k]
    return node.value if isinstance(node, _Nested) else node


def _typo(rng: random.Random, s: str) -> str:
    if not s:
        return "x"
    i = rng.randrange(len(s))
    op = rng.choice(["dup", "drop", "swap", "case", "char"])
    if op == "dup":
        return s[:i] + s[i] + s[i:]
    if op == "drop":
        return s[:i] + s[i + 1:]
    if op == "swap" and len(s) > 1:
        i = min(i, len(s) - 2)
        return s[:i] + s[i + 1] + s[i] + s[i + 2:]
    if op == "case":
        return s[:i] + s[i].swapcase() + s[i + 1:]
    return s[:i] + rng.choice("xZ_0.-/ ") + s[i + 1:]


def _replacement(rng: random.Random, value: Any) -> tuple[Any, str]:
    if isinstance(value, bool):
        return rng.choice([not value, 0, 1, "true", None]), "bool"
    if isinstance(value, int):
        choice = rng.choice([value + 1, value - 1, 0, -1, value * 2, rng.choice(INTERESTING_INTS),
                             str(value), float(value) + 0.5, None, [value]])
        return choice, "int"
    if isinstance(value, float):
        return rng.choice([0.0, -1.0, 1e308, float(2**63), str(value), None, int(value)]), "float"
    if isinstance(value, str):
        return rng.choice([_typo(rng, value), "", value + "x", "unknown", None, 0, [value],
                           {"v": value}, value.upper(), "\udcff" if False else "\u00e9"]), "str"
    if value is None:
        return rng.choice([0, "", [], {}, "null", -1]), "null"
    if isinstance(value, list):
        if value and rng.random() < 0.5:
            return rng.choice([value[:-1], value + value[-1:], [], value[::-1], [None] * len(value),
                               [-1] + value[1:], [2**62] * len(value), [0] * len(value),
                               [str(v) for v in value]]), "list"
        return rng.choice([{}, None, "[]", 0, [value]]), "list"
    if isinstance(value, dict):
        return rng.choice([[], None, {}, "{}", 0, [value]]), "dict"
    return None, "other"


def json_mutation(rng: random.Random, obj: Any) -> tuple[Any, str]:
    """Mutate a decoded JSON tree (a `_Nested` may appear inside) in place or
    by replacement; returns (new tree, description)."""
    slots = _json_slots(obj)
    path, value = rng.choice(slots)
    op = rng.choice(["replace", "replace", "replace", "delete_key", "rename_key", "add_key",
                     "deep_nest", "nested_to_plain"])
    if not path:
        op = "replace_root"
    parent = _container(obj, path[:-1]) if path else None
    key = path[-1] if path else None
    where = "/".join(map(str, path)) or "<root>"
    if op == "replace_root":
        new = rng.choice([None, [], {}, 0, "x", [obj]])
        return new, f"root replaced by {json.dumps(new)[:40]}"
    if op == "delete_key" and isinstance(parent, dict):
        del parent[key]
        return obj, f"delete key {where}"
    if op == "rename_key" and isinstance(parent, dict):
        v = parent.pop(key)
        new_key = _typo(rng, str(key))
        parent[new_key] = v
        return obj, f"rename key {where} -> {new_key!r}"
    if op == "add_key" and isinstance(parent, dict):
        parent[rng.choice(["extra", "zz_unknown", "_"])] = rng.choice([1, None, "x", []])
        return obj, f"add a key beside {where}"
    if op == "deep_nest":
        # a placeholder, expanded in the text (json.dumps itself would recurse)
        depth = rng.choice([100, 5000, 100_000])
        parent[key] = f"{DEEP}{depth}"
        return obj, f"{where} replaced by {depth}-deep nested lists"
    if op == "nested_to_plain" and isinstance(value, _Nested):
        parent[key] = value.value
        return obj, f"{where}: nested JSON string stored as an object"
    new, _ = _replacement(rng, value.value if isinstance(value, _Nested) else value)
    parent[key] = new
    try:
        shown = json.dumps(_encode_nested(new))[:60]
    except (TypeError, ValueError):
        shown = repr(new)[:60]
    return obj, f"{where} = {shown}"


def json_text_mutation(rng: random.Random, text: bytes) -> tuple[bytes, str]:
    """Syntax-level damage of a JSON file."""
    op = rng.choice(["truncate", "nan", "huge_number", "not_utf8", "bom", "duplicate_key", "trailing",
                     "deep_open"])
    if op == "truncate" and text:
        i = rng.randrange(len(text))
        return text[:i], f"JSON truncated at {i}"
    if op == "nan":
        return text.replace(b"1", b"NaN", 1) if b"1" in text else text + b"NaN", "a NaN literal"
    if op == "huge_number":
        return text.replace(b"2", b"1e400", 1) if b"2" in text else text, "a number 1e400"
    if op == "not_utf8":
        i = rng.randrange(max(1, len(text)))
        return text[:i] + b"\xff\xfe" + text[i:], f"invalid UTF-8 at {i}"
    if op == "bom":
        return b"\xef\xbb\xbf" + text, "a UTF-8 BOM"
    if op == "duplicate_key" and text.startswith(b"{"):
        return b'{"a": 1, "a": 2, ' + text[1:] if len(text) > 2 else text, "duplicate keys"
    if op == "trailing":
        return text + b" x", "trailing garbage"
    return b"[" * 200_000 + b"]" * 200_000, "200000-deep nested lists"


def mutate_json_file(rng: random.Random, data: bytes) -> tuple[bytes | None, str]:
    r = rng.random()
    if r < 0.12:
        return json_text_mutation(rng, data)
    if r < 0.18:
        return bytes_mutation(rng, data)
    try:
        obj = _decode_nested(json.loads(data))
    except ValueError:
        return bytes_mutation(rng, data)
    obj, desc = json_mutation(rng, obj)
    return dump_json(obj), desc


def mutate_key_types(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """An Orbax `_METADATA` with the key types of its tree changed (issue 18).

    "mix": one entry's key at one level turns from a sequence index into a dict
    key (or back), so that the level mixes both (orbax's restore fails sorting
    the key paths); "flip_level": every key of one level changes type together
    (a list saved as a dict of "0", "1", ...: orbax restores that); "value": a
    key_type that is not orbax's KeyType.
    """
    meta = json.loads(data)
    tree = meta["tree_metadata"]
    slots = [(flat, i) for flat, e in tree.items() for i in range(len(e["key_metadata"]))]
    op = rng.choice(["mix", "mix", "flip_level", "value"])
    if op == "value":
        flat, i = rng.choice(slots)
        new = rng.choice([0, 3, -1, "1", None, 1.5, True])
        tree[flat]["key_metadata"][i]["key_type"] = new
        return dump_json(meta), f"value: key_type of {flat}[{i}] = {json.dumps(new)}"
    # sequence indices first: flipping one of them keeps the key parseable
    seq = [(f, i) for f, i in slots if tree[f]["key_metadata"][i]["key_type"] == 1]
    flat, i = rng.choice(seq or slots)

    def flip(kt: Any) -> int:
        return 2 if kt == 1 else 1

    if op == "mix":
        km = tree[flat]["key_metadata"][i]
        km["key_type"] = flip(km["key_type"])
        return dump_json(meta), f"mix: key_type of {flat}[{i}] = {km['key_type']}"
    prefix = [k["key"] for k in tree[flat]["key_metadata"][:i]]
    n = 0
    for e in tree.values():
        kms = e["key_metadata"]
        if len(kms) > i and [k["key"] for k in kms[:i]] == prefix:
            kms[i]["key_type"] = flip(kms[i]["key_type"])
            n += 1
    return dump_json(meta), f"flip_level: {n} key types under {prefix} at level {i}"


def mutate_tree_metadata(rng: random.Random, data: bytes) -> tuple[bytes | None, str]:
    """`_METADATA`: a key-type mutation (mutate_key_types) or any JSON one."""
    if rng.random() < 0.3:
        try:
            return mutate_key_types(rng, data)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            pass  # not a tree this operator knows: the generic operators below
    return mutate_json_file(rng, data)


DEEP = "__fuzz_deep_nesting__:"


def dump_json(obj: Any) -> bytes:
    """json.dumps of a mutated tree, deep-nesting placeholders expanded."""
    text = json.dumps(_encode_nested(obj))
    for quote in ('\\"', '"'):
        while True:
            i = text.find(quote + DEEP)
            if i < 0:
                break
            j = text.find(quote, i + len(quote) + len(DEEP))
            depth = int(text[i + len(quote) + len(DEEP):j])
            text = text[:i] + "[" * depth + "0" + "]" * depth + text[j + len(quote):]
    return text.encode()


# --------------------------------------------------------------------------
# pickle operators (DCP .metadata)
# --------------------------------------------------------------------------


def _ops(data: bytes) -> list[tuple[Any, Any, int, int]]:
    """(opcode, arg, start, end) of each opcode."""
    ops = list(pickletools.genops(data))
    out = []
    for i, (op, arg, pos) in enumerate(ops):
        end = ops[i + 1][2] if i + 1 < len(ops) else len(data)
        out.append((op, arg, pos, end))
    return out


def _encode_int_op(name: str, value: int) -> bytes | None:
    try:
        if name == "BININT1":
            return b"K" + struct.pack("<B", value)
        if name == "BININT2":
            return b"M" + struct.pack("<H", value)
        if name == "BININT":
            return b"J" + struct.pack("<i", value)
    except struct.error:
        pass
    if name in ("BININT1", "BININT2", "BININT", "LONG1"):
        raw = value.to_bytes((value.bit_length() + 8) // 8 or 1, "little", signed=True)
        return b"\x8a" + bytes([len(raw)]) + raw
    return None


def pickle_opcode_mutation(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    ops = _ops(data)
    op_kind = rng.choice(["int_arg", "int_arg", "string_arg", "delete_op", "dup_op", "memo_index",
                          "truncate_op", "global_swap", "big_memo"])
    if op_kind == "int_arg":
        cands = [o for o in ops if o[0].name in ("BININT1", "BININT2", "BININT", "LONG1")]
        if cands:
            op, arg, s, e = rng.choice(cands)
            new = rng.choice([arg + 1, arg - 1, 0, -1, arg * 2, rng.choice(INTERESTING_INTS)])
            enc = _encode_int_op(op.name, new)
            if enc:
                return data[:s] + enc + data[e:], f"pickle int at {s}: {arg} -> {new}"
    if op_kind == "string_arg":
        cands = [o for o in ops if o[0].name in ("SHORT_BINUNICODE", "BINUNICODE")]
        if cands:
            op, arg, s, e = rng.choice(cands)
            new = rng.choice([_typo(rng, arg), "", "../" + arg, "/etc/passwd", arg + "x", "posix", "system"])
            raw = new.encode("utf-8", "surrogatepass")
            enc = (b"\x8c" + bytes([len(raw)]) if len(raw) < 256 else b"X" + struct.pack("<I", len(raw))) + raw
            return data[:s] + enc + data[e:], f"pickle string at {s}: {arg!r} -> {new!r}"
    if op_kind == "delete_op" and len(ops) > 2:
        op, arg, s, e = rng.choice(ops[1:-1])
        return data[:s] + data[e:], f"pickle opcode {op.name} at {s} deleted"
    if op_kind == "dup_op" and len(ops) > 2:
        op, arg, s, e = rng.choice(ops[1:-1])
        return data[:e] + data[s:e] + data[e:], f"pickle opcode {op.name} at {s} duplicated"
    if op_kind == "memo_index":
        cands = [o for o in ops if o[0].name in ("BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT")]
        if cands:
            op, arg, s, e = rng.choice(cands)
            new = rng.choice([arg + 1, max(0, arg - 1), 0, 255, rng.randrange(1, 2**20)])
            code = {"BINGET": b"j", "LONG_BINGET": b"j", "BINPUT": b"r", "LONG_BINPUT": b"r"}[op.name]
            return data[:s] + code + struct.pack("<I", new) + data[e:], f"pickle memo {op.name} {arg} -> {new}"
    if op_kind == "truncate_op" and len(ops) > 1:
        op, arg, s, e = rng.choice(ops[1:])
        return data[:s], f"pickle truncated before {op.name} at {s}"
    if op_kind == "global_swap":
        cands = [o for o in ops if o[0].name in ("SHORT_BINUNICODE", "BINUNICODE") and "." in str(o[1])]
        if cands:
            op, arg, s, e = rng.choice(cands)
            new = rng.choice(["torch.distributed.checkpoint.filesystem", "torch.distributed.checkpoint.metadata",
                              "builtins", "torch", "torch.serialization", "pathlib"])
            raw = new.encode()
            return data[:s] + b"\x8c" + bytes([len(raw)]) + raw + data[e:], f"pickle module {arg!r} -> {new!r}"
    if op_kind == "big_memo" and len(ops) > 2:
        op, arg, s, e = rng.choice(ops[1:-1])
        idx = rng.choice([2**20, 2**28, 2**31 - 1])
        return data[:s] + b"r" + struct.pack("<I", idx) + data[s:], f"pickle LONG_BINPUT {idx} inserted at {s}"
    return bytes_mutation(rng, data)[0] or b"", "pickle byte mutation"


def _torch():
    import torch  # noqa: F401 - the structured DCP operators need torch's classes
    import torch.distributed.checkpoint.filesystem  # noqa: F401
    import torch.distributed.checkpoint.metadata as m

    return m


def _dim_value(rng: random.Random, d: int) -> int:
    return rng.choice([d + 1, d - 1, 0, -1, d * 2, 2**62, 2**31, 2**41, 1])


def _size(values: list[int]) -> Any:
    import torch

    try:
        return torch.Size(values)
    except Exception:  # noqa: BLE001 - out of int64
        return tuple(values)


def metadata_object_mutation(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """Unpickle a (trusted: our own fixture's) .metadata with torch's classes,
    change one field of the Metadata object, pickle it again."""
    import torch

    m = _torch()
    md = pickle.loads(data)
    tensors = [k for k, v in md.state_dict_metadata.items() if isinstance(v, m.TensorStorageMetadata)]
    items = list(md.state_dict_metadata)
    storage = list(md.storage_data)
    op = rng.choice(["size", "size", "chunk_offsets", "chunk_sizes", "chunk_drop", "chunk_dup", "dtype",
                     "properties_none", "to_bytes", "drop_item", "storage_offset", "storage_length",
                     "storage_length", "relative_path", "drop_storage", "storage_none", "index_fqn",
                     "planner", "storage_meta", "version", "root", "size_rank", "chunks_none"])
    desc = op
    if op in ("size", "size_rank", "chunk_offsets", "chunk_sizes", "chunk_drop", "chunk_dup", "dtype",
              "properties_none", "chunks_none") and tensors:
        fqn = rng.choice(tensors)
        t = md.state_dict_metadata[fqn]
        if op == "size":
            dims = list(t.size)
            if dims:
                i = rng.randrange(len(dims))
                dims[i] = _dim_value(rng, dims[i])
            t.size = _size(dims)
            desc = f"{fqn}: size -> {list(t.size)}"
        elif op == "size_rank":
            dims = list(t.size)
            dims = dims[:-1] if dims and rng.random() < 0.5 else dims + [rng.choice([1, 2, 2**62])]
            t.size = _size(dims)
            desc = f"{fqn}: size -> {dims}"
        elif op in ("chunk_offsets", "chunk_sizes") and t.chunks:
            c = rng.choice(t.chunks)
            name = "offsets" if op == "chunk_offsets" else "sizes"
            vals = list(getattr(c, name))
            if vals:
                i = rng.randrange(len(vals))
                vals[i] = _dim_value(rng, vals[i])
            setattr(c, name, _size(vals))
            desc = f"{fqn}: chunk {name} -> {vals}"
        elif op == "chunk_drop" and t.chunks:
            t.chunks.pop(rng.randrange(len(t.chunks)))
            desc = f"{fqn}: a chunk dropped"
        elif op == "chunk_dup" and t.chunks:
            t.chunks.append(dataclasses.replace(rng.choice(t.chunks)))
            desc = f"{fqn}: a chunk duplicated"
        elif op == "dtype":
            new = rng.choice([torch.float64, torch.int64, torch.bfloat16, torch.float16, torch.uint8,
                              torch.bool, torch.int8, torch.complex64, torch.float8_e4m3fn, torch.qint8])
            t.properties.dtype = new
            desc = f"{fqn}: dtype -> {new}"
        elif op == "properties_none":
            t.properties = None
            desc = f"{fqn}: properties None"
        elif op == "chunks_none":
            t.chunks = rng.choice([None, []])
            desc = f"{fqn}: chunks {t.chunks!r}"
    elif op == "to_bytes" and tensors:
        fqn = rng.choice(tensors)
        md.state_dict_metadata[fqn] = m.BytesStorageMetadata()
        desc = f"{fqn}: tensor entry replaced by BytesStorageMetadata"
    elif op == "drop_item" and items:
        fqn = rng.choice(items)
        del md.state_dict_metadata[fqn]
        desc = f"{fqn}: dropped from state_dict_metadata"
    elif op in ("storage_offset", "storage_length", "relative_path", "storage_none") and storage:
        idx = rng.choice(storage)
        info = md.storage_data[idx]
        if op == "storage_offset":
            info.offset = rng.choice([info.offset + 1, info.offset - 1, 0, -1, 2**62, info.offset + info.length])
            desc = f"{idx.fqn}: storage offset -> {info.offset}"
        elif op == "storage_length":
            info.length = rng.choice([info.length + 1, info.length - 1, 0, -1, 2**62, 1, 2**43])
            desc = f"{idx.fqn}: storage length -> {info.length}"
        elif op == "relative_path":
            info.relative_path = rng.choice(["../" + info.relative_path, "/etc/passwd", "", "nope.distcp",
                                             "__9_0.distcp", ".metadata", "./" + info.relative_path, "."])
            desc = f"{idx.fqn}: relative_path -> {info.relative_path!r}"
        else:
            md.storage_data[idx] = None
            desc = f"{idx.fqn}: storage info None"
    elif op == "drop_storage" and storage:
        idx = rng.choice(storage)
        del md.storage_data[idx]
        desc = f"{idx.fqn}: storage entry dropped"
    elif op == "index_fqn" and storage:
        idx = rng.choice(storage)
        info = md.storage_data.pop(idx)
        new = dataclasses.replace(idx, fqn=_typo(rng, idx.fqn))
        md.storage_data[new] = info
        desc = f"storage key {idx.fqn!r} -> {new.fqn!r}"
    elif op == "planner":
        if md.planner_data and rng.random() < 0.5:
            k = rng.choice(list(md.planner_data))
            md.planner_data[k] = rng.choice([None, (), ("x",), 5, (k, k)])
            desc = f"planner_data[{k!r}] -> {md.planner_data[k]!r}"
        else:
            md.planner_data = rng.choice([None, {}, []])
            desc = f"planner_data -> {md.planner_data!r}"
    elif op == "storage_meta":
        md.storage_meta = None
        desc = "storage_meta None"
    elif op == "version":
        md.version = rng.choice([None, "2.0.0", "", 5, "0.0.1"])
        desc = f"version -> {md.version!r}"
    elif op == "root":
        new = rng.choice([None, 0, [], {}, md.state_dict_metadata, "metadata", (md,)])
        desc = f".metadata pickles {type(new).__name__}"
        md = new
    return pickle.dumps(md, protocol=rng.choice([2, 4, 5])), desc


def edit_storage_entry(data: bytes, fqn: str, change: Callable[[Any], None], nth: int = 0) -> tuple[bytes, Any]:
    """What the storage_offset / storage_length operators above do, at a chosen entry.

    Unpickles a (trusted: our own fixture's) .metadata with torch's classes,
    applies `change` to the `nth` storage_data entry of item `fqn` (a torch
    _StorageInfo: .offset, .length, .relative_path), pickles it again.
    Returns the new bytes and the changed entry.
    """
    _torch()
    md = pickle.loads(data)
    info = [v for k, v in md.storage_data.items() if k.fqn == fqn][nth]
    change(info)
    return pickle.dumps(md, protocol=4), info


def mutate_dcp_metadata(rng: random.Random, data: bytes) -> tuple[bytes | None, str]:
    r = rng.random()
    if r < 0.45:
        return metadata_object_mutation(rng, data)
    if r < 0.8:
        return pickle_opcode_mutation(rng, data)
    return bytes_mutation(rng, data)


# --------------------------------------------------------------------------
# zip operators (.distcp archives: one torch.save zip per item)
# --------------------------------------------------------------------------

ZIP_SIGS = {b"PK\x03\x04": ("local", 30, [(14, 4), (18, 4), (22, 4), (26, 2), (28, 2), (8, 2), (6, 2)]),
            b"PK\x01\x02": ("central", 46, [(16, 4), (20, 4), (24, 4), (28, 2), (30, 2), (42, 4), (10, 2)]),
            b"PK\x05\x06": ("eocd", 22, [(8, 2), (10, 2), (12, 4), (16, 4), (20, 2)]),
            b"PK\x06\x06": ("eocd64", 56, [(24, 8), (32, 8), (40, 8), (48, 8)]),
            b"PK\x06\x07": ("locator64", 20, [(8, 8), (16, 4)])}


def zip_records(data: bytes) -> list[tuple[int, str, int, list]]:
    out = []
    for sig, (name, size, fields) in ZIP_SIGS.items():
        i = data.find(sig)
        while i >= 0:
            out.append((i, name, size, fields))
            i = data.find(sig, i + 1)
    return sorted(out)


def mutate_distcp(rng: random.Random, data: bytes) -> tuple[bytes | None, str]:
    recs = zip_records(data)
    op = rng.choice(["field", "field", "header_flip", "name", "data_flip", "data_flip", "bytes", "truncate_at_record"])
    b = bytearray(data)
    if op == "field" and recs:
        pos, name, _size, fields = rng.choice(recs)
        off, width = rng.choice(fields)
        if pos + off + width <= len(b):
            v = rng.choice([0, 1, 2**(8 * width) - 1, rng.randrange(2**(8 * width)),
                            int.from_bytes(b[pos + off:pos + off + width], "little") + rng.choice([-1, 1, 64])])
            v %= 2**(8 * width)
            b[pos + off:pos + off + width] = v.to_bytes(width, "little")
            return bytes(b), f"zip {name} record at {pos}: field +{off} ({width} bytes) -> {v}"
    if op == "header_flip" and recs:
        pos, name, size, _ = rng.choice(recs)
        i = min(len(b) - 1, pos + rng.randrange(size))
        bit = rng.randrange(8)
        b[i] ^= 1 << bit
        return bytes(b), f"zip {name} record at {pos}: bit {bit} of byte {i - pos} flipped"
    if op == "name" and recs:
        cands = [r for r in recs if r[1] in ("local", "central")]
        if cands:
            pos, name, size, _ = rng.choice(cands)
            nlen_off = 26 if name == "local" else 28
            nlen = int.from_bytes(b[pos + nlen_off:pos + nlen_off + 2], "little")
            if nlen and pos + size + nlen <= len(b):
                i = pos + size + rng.randrange(nlen)
                old = b[i]
                b[i] = ord(rng.choice("xZ/._0"))
                return bytes(b), (f"zip {name} record at {pos}: file name byte {i - pos - size} "
                                  f"{chr(old)!r} -> {chr(b[i])!r}")
    if op == "data_flip" and data:
        # a byte outside every zip record header: storage bytes or a pickle
        spans = [(p, p + s) for p, _, s, _ in recs]
        for _ in range(20):
            i = rng.randrange(len(b))
            if not any(s <= i < e for s, e in spans):
                bit = rng.randrange(8)
                b[i] ^= 1 << bit
                return bytes(b), f"data byte {i}: bit {bit} flipped"
    if op == "truncate_at_record" and recs:
        pos = rng.choice(recs)[0]
        return data[:pos], f"truncated at the zip record at {pos}"
    return bytes_mutation(rng, data)


# --------------------------------------------------------------------------
# safetensors operators
# --------------------------------------------------------------------------


def mutate_safetensors(rng: random.Random, data: bytes) -> tuple[bytes | None, str]:
    if len(data) < 8:
        return bytes_mutation(rng, data)
    hlen = struct.unpack("<Q", data[:8])[0]
    header, body = data[8:8 + hlen], data[8 + hlen:]
    r = rng.random()
    if r < 0.5:
        try:
            obj = json.loads(header)
        except ValueError:
            return bytes_mutation(rng, data)
        obj, desc = json_mutation(rng, obj)
        new = dump_json(obj)
        if rng.random() < 0.8:
            new = new + b" " * ((8 - len(new) % 8) % 8)
            return struct.pack("<Q", len(new)) + new + body, "header: " + desc
        return data[:8] + new + body, "header (length not updated): " + desc
    if r < 0.65:
        v = rng.choice([0, 1, hlen + 1, hlen - 1, 2**62, 100_000_001, len(data)])
        return struct.pack("<Q", v) + data[8:], f"header length {hlen} -> {v}"
    if r < 0.8 and body:
        i = 8 + hlen + rng.randrange(len(body))
        b = bytearray(data)
        b[i] ^= 1 << rng.randrange(8)
        return bytes(b), f"data byte {i} flipped"
    return bytes_mutation(rng, data)


# --------------------------------------------------------------------------
# msgpack trees (Flax msgpack, orbax <= 0.4 / T5X `checkpoint` files)
# --------------------------------------------------------------------------

# ext codes no flax or orbax writer uses (1 ndarray, 2 complex, 3 numpy scalar, 4 orbax tuple)
UNKNOWN_EXT_CODES = [0, 5, 42, 127]  # (msgpack.ExtType packs 0..127 only)


def _msgpack_slots(node: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    """(path, value) of every map value and list element of a decoded tree (the root excluded)."""
    out: list[tuple[tuple, Any]] = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        out.append((path + (k,), v))
        out.extend(_msgpack_slots(v, path + (k,)))
    return out


def _msgpack_set(root: Any, path: tuple, value: Any) -> None:
    node = root
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


def mutate_msgpack(rng: random.Random, data: bytes) -> tuple[bytes | None, str]:
    """A structure-aware change to a msgpack tree, re-encoded with the msgpack package: the
    root not a map, a map key that is not a string, deep nesting, an unknown ext type
    (the classes where flax's / orbax's msgpack_restore and a lenient reader disagree);
    else (and when the file does not decode) a byte-level mutation."""
    import msgpack

    op = rng.choice(["root", "key", "key", "nest", "ext", "ext", "bytes"])
    try:
        tree = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=msgpack.ExtType)
    except Exception:  # noqa: BLE001 - already damaged: bytes only
        op = "bytes"

    def pack(obj: Any) -> bytes:
        return msgpack.packb(obj, use_bin_type=True)

    slots = _msgpack_slots(tree) if op != "bytes" else []
    if op == "root":
        new = rng.choice([7, -1, 2.5, None, True, "checkpoint", b"\x80", [], list(tree.values())[:3]
                          if isinstance(tree, dict) else [tree]])
        return pack(new), f"msgpack root replaced by {type(new).__name__} {str(new)[:40]}"
    maps = [(p, v) for p, v in slots if isinstance(v, dict) and v] + ([((), tree)] if isinstance(tree, dict) and tree else [])
    if op == "key" and maps:
        path, node = rng.choice(maps)
        keys = list(node)
        i = rng.randrange(len(keys))
        new_key = rng.choice([116, 0, -3, 2**40, 1.5, None, True])
        items = [(new_key if j == i else k, v) for j, (k, v) in enumerate(node.items())]
        rebuilt = dict(items)
        if path:
            _msgpack_set(tree, path, rebuilt)
        else:
            tree = rebuilt
        return pack(tree), f"msgpack key {keys[i]!r} at {list(path)} -> {new_key!r}"
    if op == "nest" and slots:
        path, value = rng.choice(slots)
        depth = rng.choice([64, 127, 128, 129, 200, 1000, 5000])
        sentinel = msgpack.ExtType(99, b"ckpt-fuzz-nest")
        _msgpack_set(tree, path, sentinel)
        raw = pack(tree)
        marker = pack(sentinel)
        wrap = rng.choice([b"\x91", b"\x81\xa1k"])  # a 1-list or a {'k': ...} map per level
        nested = wrap * depth + pack(value)
        return raw.replace(marker, nested, 1), f"msgpack value at {list(path)} nested {depth} levels deep"
    if op == "ext" and slots:
        exts = [(p, v) for p, v in slots if isinstance(v, msgpack.ExtType)]
        code = rng.choice(UNKNOWN_EXT_CODES)
        if exts and rng.random() < 0.7:
            path, value = rng.choice(exts)
            _msgpack_set(tree, path, msgpack.ExtType(code, value.data))
            return pack(tree), f"msgpack ext {value.code} at {list(path)} -> ext {code}"
        path, value = rng.choice(slots)
        try:
            payload = pack(value)
        except Exception:  # noqa: BLE001
            payload = b"\xc0"
        _msgpack_set(tree, path, msgpack.ExtType(code, payload))
        return pack(tree), f"msgpack value at {list(path)} wrapped in ext {code}"
    return bytes_mutation(rng, data)


# --------------------------------------------------------------------------
# torch.save archives (.pt / .pth / .bin): data.pkl, zip records, storages
# --------------------------------------------------------------------------
#
# torch.save (miniz) writes `<stem>/data.pkl`, the small records (`.format_version`,
# `.storage_alignment`, `byteorder`, `version`, `.data/serialization_id`) and one
# `<stem>/data/<key>` member per storage: STORED, flag bit 3 (sizes and CRC-32 in a data
# descriptor after the data, zeros in the local header), the local header's extra field an
# "FB" padding record that puts the data at a multiple of 64, then the central directory,
# zip64 end records and the end record. TorchZip parses that and writes it back with
# members changed, sizes, offsets, padding and (when asked) CRC-32s made consistent, so
# that a mutation reaches the part of the reader it is aimed at, not only the CRC check.

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_ALIGN = 64  # torch's kFieldAlignment


@dataclass
class ZipMember:
    name: bytes
    local: bytearray  # the 30-byte local header
    local_extra: bytes
    data: bytes
    descriptor: bytes  # "PK\x07\x08" + CRC + sizes after the data (flag bit 3), or b""
    central: bytearray  # the 46-byte central-directory header
    central_extra: bytes
    comment: bytes
    crc: int  # written to the descriptor / headers by TorchZip.write
    inflated: int | None = None  # the size a deflated member inflates to (None: STORED)
    local_at: int = 0  # where the member's records are in the parsed bytes
    central_at: int = 0
    data_at: int = 0


@dataclass
class TorchZip:
    members: list[ZipMember]
    eocd64: bytearray | None  # the zip64 end record and its locator, when present
    locator: bytearray | None
    eocd: bytearray  # the 22-byte end record
    eocd_comment: bytes
    eocd_at: int = 0
    eocd64_at: int = -1
    locator_at: int = -1

    @property
    def prefix(self) -> bytes:
        first = self.members[0].name
        return first[: first.index(b"/") + 1] if b"/" in first else b""

    def member(self, suffix: str) -> ZipMember | None:
        want = self.prefix + suffix.encode()
        return next((m for m in self.members if m.name == want), None)

    def storages(self) -> list[ZipMember]:
        p = self.prefix + b"data/"
        return [m for m in self.members if m.name.startswith(p) and b"/" not in m.name[len(p):]]

    def records(self) -> list[ZipMember]:
        """The members that are not storages (data.pkl and the small records)."""
        keep = {id(m) for m in self.storages()}
        return [m for m in self.members if id(m) not in keep]

    def write(self) -> bytes:
        """The archive with every offset, size and padding recomputed from the members."""
        out = bytearray()
        central = bytearray()
        for m in self.members:
            at = len(out)
            local = bytearray(m.local)
            extra = m.local_extra
            if extra[:2] == b"FB":  # torch's padding record: data at a multiple of 64 again
                pad = -(at + _LOCAL.size + len(m.name) + 4) % _ALIGN
                extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
            struct.pack_into("<H", local, 26, len(m.name))
            struct.pack_into("<H", local, 28, len(extra))
            if not struct.unpack_from("<H", local, 6)[0] & 0x8:  # sizes in the local header
                struct.pack_into("<III", local, 14, m.crc, len(m.data), len(m.data))
            out += local + m.name + extra + m.data
            if m.descriptor:
                out += m.descriptor[:4] + struct.pack("<III", m.crc, len(m.data), len(m.data)) + m.descriptor[16:]
            cen = bytearray(m.central)
            usize = len(m.data) if m.inflated is None else m.inflated
            struct.pack_into("<III", cen, 16, m.crc, len(m.data), usize)
            struct.pack_into("<HHH", cen, 28, len(m.name), len(m.central_extra), len(m.comment))
            struct.pack_into("<I", cen, 42, at)
            central += cen + m.name + m.central_extra + m.comment
        cd_at, n = len(out), len(self.members)
        out += central
        if self.eocd64 is not None and self.locator is not None:
            z64_at = len(out)
            rec = bytearray(self.eocd64)
            struct.pack_into("<QQQQ", rec, 24, n, n, len(central), cd_at)
            loc = bytearray(self.locator)
            struct.pack_into("<Q", loc, 8, z64_at)
            out += rec + loc
        end = bytearray(self.eocd)
        struct.pack_into("<HHII", end, 8, min(n, 0xFFFF), min(n, 0xFFFF), len(central), cd_at)
        struct.pack_into("<H", end, 20, len(self.eocd_comment))
        out += end + self.eocd_comment
        return bytes(out)


def parse_torch_zip(data: bytes) -> TorchZip | None:
    """The members of a torch.save archive as torch writes it; None when it is not one
    (already damaged, or another zip layout: the operators then fall back to bytes)."""
    try:
        at = data.rfind(b"PK\x05\x06", max(0, len(data) - 22 - 0xFFFF))
        if at < 0:
            return None
        eocd = bytearray(data[at:at + 22])
        _, _, _, _, n, cd_size, cd_at, comment_len = struct.unpack("<IHHHHIIH", eocd)
        eocd64 = locator = None
        z64_at = loc_at = -1
        if at >= 20 and data[at - 20:at - 16] == b"PK\x06\x07":
            loc_at = at - 20
            locator = bytearray(data[loc_at:at])
            z64_at = struct.unpack_from("<Q", locator, 8)[0]
            eocd64 = bytearray(data[z64_at:z64_at + 56])
            if eocd64[:4] != b"PK\x06\x06":
                return None
            n, cd_size, cd_at = struct.unpack_from("<QQQ", eocd64, 32)
        members = []
        p = cd_at
        for _ in range(n):
            cen = bytearray(data[p:p + 46])
            f = _CENTRAL.unpack(cen)
            if f[0] != 0x02014B50:
                return None
            name_len, extra_len, com_len, offset = f[10], f[11], f[12], f[16]
            name = data[p + 46:p + 46 + name_len]
            cextra = data[p + 46 + name_len:p + 46 + name_len + extra_len]
            comment = data[p + 46 + name_len + extra_len:p + 46 + name_len + extra_len + com_len]
            loc = bytearray(data[offset:offset + 30])
            lf = _LOCAL.unpack(loc)
            if lf[0] != 0x04034B50 or f[9] != f[8] or f[5] != 0:
                return None
            lextra = data[offset + 30 + lf[9]:offset + 30 + lf[9] + lf[10]]
            start = offset + 30 + lf[9] + lf[10]
            body = data[start:start + f[8]]
            desc = b""
            if lf[2] & 0x8 and data[start + f[8]:start + f[8] + 4] == b"PK\x07\x08":
                desc = data[start + f[8]:start + f[8] + 16]
            members.append(ZipMember(name, loc, lextra, body, desc, cen, cextra, comment, f[7], None, offset, p, start))
            p += 46 + name_len + extra_len + com_len
        if not members or b"/" not in members[0].name:
            return None
        return TorchZip(members, eocd64, locator, eocd, data[at + 22:at + 22 + comment_len], at, z64_at, loc_at)
    except (struct.error, IndexError, ValueError):
        return None


def _crc(data: bytes) -> int:
    import zlib

    return zlib.crc32(data) & 0xFFFFFFFF


def _is_int_op(o: tuple) -> bool:
    return o[0].name in ("BININT1", "BININT2", "BININT", "LONG1")


def tensor_sites(ops: list[tuple[Any, Any, int, int]]) -> list[dict[str, Any]]:
    """The tensors of a torch.save data.pkl, located by their persistent ids: for each
    BINPERSID, its storage key op, numel op, and the storage_offset / size / stride int ops of
    the `_rebuild_tensor_v2(storage, offset, size, stride, ...)` call after it."""
    puts = ("BINPUT", "LONG_BINPUT", "MEMOIZE")
    sites = []
    for i, (op, _arg, _s, _e) in enumerate(ops):
        if op.name != "BINPERSID":
            continue
        # the pid tuple ('storage', class, key, location, numel) between MARK and TUPLE
        j = i - 1
        while j >= 0 and ops[j][0].name in puts:
            j -= 1
        if j < 1 or ops[j][0].name != "TUPLE":
            continue
        j -= 1
        elems = []
        while j >= 0 and ops[j][0].name != "MARK":
            if ops[j][0].name not in puts:
                elems.append(ops[j])
            j -= 1
        elems.reverse()
        site: dict[str, Any] = {"at": i, "roles": []}
        if len(elems) == 5:
            site["key"] = elems[2]
            if _is_int_op(elems[4]):
                site["roles"].append(("numel", elems[4]))
        j = i + 1
        if j < len(ops) and ops[j][0].name in puts:
            j += 1
        if j < len(ops) and _is_int_op(ops[j]):
            site["roles"].append(("storage_offset", ops[j]))
            j += 1
        for role in ("size", "stride"):
            if j >= len(ops):
                break
            if ops[j][0].name == "EMPTY_TUPLE":
                j += 1
            else:
                if ops[j][0].name == "MARK":
                    j += 1
                dims = []
                while j < len(ops) and _is_int_op(ops[j]):
                    dims.append(ops[j])
                    j += 1
                for d, o in enumerate(dims):
                    site["roles"].append((f"{role}[{d}]", o))
                if j < len(ops) and ops[j][0].name in ("TUPLE1", "TUPLE2", "TUPLE3", "TUPLE"):
                    j += 1
            if j < len(ops) and ops[j][0].name in puts:
                j += 1
        sites.append(site)
    return sites


def _replace_ops(data: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    for s, e, new in sorted(edits, reverse=True):
        data = data[:s] + new + data[e:]
    return data


def _unicode_op(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE: what torch's protocol-2 pickler writes


def tensor_view_mutation(rng: random.Random, pkl: bytes) -> tuple[bytes, str]:
    """One tensor's storage_offset, a size or a stride, or its storage's numel changed in the
    pickle's int opcodes: most make a view reach past its storage, some a valid smaller view."""
    ops = _ops(pkl)
    sites = [s for s in tensor_sites(ops) if s["roles"]]
    if not sites:
        return pickle_opcode_mutation(rng, pkl)
    site = rng.choice(sites)
    role, (op, arg, s, e) = rng.choice(site["roles"])
    numel = next((o[1] for r, o in site["roles"] if r == "numel"), 1)
    new = rng.choice([arg + 1, arg - 1, 0, 1, arg * 2, numel, numel + 1, numel - 1, 2**31, 2**62, 2**63, -1,
                      rng.choice(INTERESTING_INTS)])
    enc = _encode_int_op(op.name, new)
    assert enc is not None
    return pkl[:s] + enc + pkl[e:], f"tensor at pickle op {site['at']}: {role} {arg} -> {new}"


def storage_key_mutation(rng: random.Random, pkl: bytes) -> tuple[bytes, str]:
    """Storage keys in the persistent ids: two storages swapped, or one renamed."""
    ops = _ops(pkl)
    keys = [s["key"] for s in tensor_sites(ops) if "key" in s and s["key"][0].name == "BINUNICODE"]
    if not keys:
        return pickle_opcode_mutation(rng, pkl)
    if len(keys) >= 2 and rng.random() < 0.6:
        a, b = rng.sample(keys, 2)
        if a[1] != b[1]:
            return (_replace_ops(pkl, [(a[2], a[3], _unicode_op(b[1])), (b[2], b[3], _unicode_op(a[1]))]),
                    f"storage keys {a[1]!r} and {b[1]!r} swapped")
    op, arg, s, e = rng.choice(keys)
    new = rng.choice([keys[0][1], str(len(keys) + 7), arg + "0", "", "../" + arg, "data.pkl", "a/b", "x" * 65])
    return pkl[:s] + _unicode_op(new) + pkl[e:], f"storage key {arg!r} -> {new!r}"


def _long_binput(i: int) -> bytes:
    return b"r" + struct.pack("<I", i)


def _long_binget(i: int) -> bytes:
    return b"j" + struct.pack("<I", i)


def _next_memo(pkl: bytes) -> int:
    """The memo index a pickler would store next: torch's numbers its memo stores from 0 in
    order, so the graph operators continue from there (the original's references unchanged)."""
    top = -1
    for op, arg, _s, _e in _ops(pkl):
        if op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
            top = max(top, int(arg))
        elif op.name == "MEMOIZE":
            top += 1
    return top + 1
# one-byte opcodes that each build a new object: an empty list, dict, set, or one memoised
_CHEAP_OPS = {"empty_list": b"]", "empty_dict": b"}", "empty_set": b"\x8f", "none": b"N",
              "memoised_dict": b"}r"}  # + a new LONG_BINPUT index each time (torch's unpickler has no MEMOIZE)


GRAPH_VARIANTS = ("shared", "self", "cheap")
VIEW_VARIANTS = ("stride0", "overlap")


def graph_mutation(rng: random.Random, pkl: bytes, variant: str | None = None) -> tuple[bytes, str]:
    """The pickle's object graph changed as genuine files change it, the original object kept
    (the new top is the tuple (original, extra)), so a reader that walks the graph as a tree, or
    believes the opcodes' cost is small, is caught:
      * shared: `x = [x, x]` nested DEPTH levels over a leaf (an int, or the original object
        itself, so its tensors are reachable 2**DEPTH ways); torch.load builds it in DEPTH steps;
      * self: a dict (or list) that contains itself, which torch.load loads;
      * cheap: the extra object is a list of N objects of one byte each (an empty list, dict,
        set, or a memoised dict): N bytes of input, tens to hundreds of bytes each unpickled.
    """
    if not pkl.endswith(b"."):
        return pickle_opcode_mutation(rng, pkl)
    body = pkl[:-1]  # the original object ends up on the stack
    memo = _next_memo(pkl)
    kind = variant or rng.choice(["shared", "shared", "self", "cheap"])
    if kind == "shared":
        # (asked for by name, as the tests do, always deep enough that a tree walk never ends)
        depth = rng.choice([40, 64, 100] if variant else [8, 24, 40, 64, 100])
        on_original = rng.random() < 0.5
        m = memo
        # (torch's unpickler has no POP: every level stays on the stack, and the extra object
        # is the tuple of all levels, the deepest last)
        if on_original:
            out = body + _long_binput(m) + b"("  # the original, still on the stack, memoised
        else:
            out = body + b"(K\x07" + _long_binput(m)
        for level in range(1, depth + 1):
            out += b"](" + _long_binget(m + level - 1) + _long_binget(m + level - 1) + b"e" + _long_binput(m + level)
        out += b"t\x86."
        leaf = "the original object" if on_original else "an int"
        return out, f"graph: (original, levels) with x = [x, x] nested {depth} levels over {leaf}"
    if kind == "self":
        m = memo
        if rng.random() < 0.5:
            extra = b"}" + _long_binput(m) + _unicode_op("self") + _long_binget(m) + b"s"
            what = "a dict holding itself under 'self'"
        else:
            extra = b"]" + _long_binput(m) + _long_binget(m) + b"a"
            what = "a list holding itself"
        return body + extra + b"\x86.", f"graph: (original, {what})"
    name = rng.choice(sorted(_CHEAP_OPS))
    op = _CHEAP_OPS[name]
    if name == "memoised_dict":
        n = rng.choice([1 << 16, 1 << 19, 1 << 21]) // 6
        extra = b"](" + b"".join(op + struct.pack("<I", memo + i) for i in range(n)) + b"e"
    else:
        n = rng.choice([1 << 16, 1 << 19, 1 << 21]) // len(op)
        extra = b"](" + op * n + b"e"
    return body + extra + b"\x86.", f"graph: (original, a list of {n} one-opcode objects: {name})"


def view_geometry_mutation(rng: random.Random, pkl: bytes, variant: str | None = None) -> tuple[bytes, str]:
    """One tensor made a view torch.load accepts but whose logical size is far above its stored
    bytes: every stride 0 (an `expand`, each size raised up to 2**20), or strides smaller than
    the contiguous ones so elements overlap (sizes kept inside the storage)."""
    ops = _ops(pkl)
    sites = [s for s in tensor_sites(ops) if any(r.startswith("stride[") for r, _ in s["roles"])]
    if not sites:
        return tensor_view_mutation(rng, pkl)
    site = rng.choice(sites)
    roles = dict(site["roles"])
    sizes = sorted((r, o) for r, o in site["roles"] if r.startswith("size["))
    strides = sorted((r, o) for r, o in site["roles"] if r.startswith("stride["))
    edits = []
    if variant == "stride0" or (variant is None and rng.random() < 0.6):
        big = rng.choice([2**10, 2**16, 2**20])
        for _r, (op, _arg, s, e) in strides:
            edits.append((s, e, _encode_int_op(op.name, 0)))
        for _r, (op, _arg, s, e) in sizes:
            edits.append((s, e, _encode_int_op(op.name, big)))
        desc = f"every stride 0 and every size {big} (an expand)"
    else:
        # stride 1 in every dimension: element (i, j, ...) at i + j + ...; the sizes shrink
        # until the last element is inside the storage
        numel = roles["numel"][1] if "numel" in roles else 1
        off = roles["storage_offset"][1] if "storage_offset" in roles else 0
        dims = [o[1] for _r, o in sizes]
        while dims and off + sum(d - 1 for d in dims) >= numel and max(dims) > 1:
            i = dims.index(max(dims))
            dims[i] = max(1, dims[i] // 2)
        for (_r, (op, _arg, s, e)), d in zip(sizes, dims):
            edits.append((s, e, _encode_int_op(op.name, d)))
        for _r, (op, _arg, s, e) in strides:
            edits.append((s, e, _encode_int_op(op.name, 1)))
        desc = f"every stride 1, sizes {dims} (overlapping elements)"
    if any(new is None for _s, _e, new in edits):
        return tensor_view_mutation(rng, pkl)
    return _replace_ops(pkl, edits), f"tensor at pickle op {site['at']}: {desc}"


# globals to swap in: torch's (other storage types change a tensor's dtype), ones ckpt's
# allow-list admits and torch.load(weights_only=True) refuses, and hostile ones
TORCH_GLOBALS = [
    ("torch", "HalfStorage"), ("torch", "BFloat16Storage"), ("torch", "DoubleStorage"), ("torch", "IntStorage"),
    ("torch", "LongStorage"), ("torch", "ByteStorage"), ("torch", "BoolStorage"), ("torch", "ComplexFloatStorage"),
    ("torch", "FloatStorage"), ("torch", "QInt8Storage"), ("torch.storage", "UntypedStorage"),
    ("torch._utils", "_rebuild_parameter"), ("torch._utils", "_rebuild_tensor_v3"), ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_qtensor"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._tensor", "_rebuild_from_type_v2"),
    ("collections", "OrderedDict"), ("collections", "Counter"), ("builtins", "set"), ("builtins", "frozenset"),
    ("builtins", "bytes"), ("builtins", "complex"), ("pathlib", "PosixPath"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy", "dtype"), ("torch.distributed.checkpoint.metadata", "Metadata"), ("torch", "device"), ("torch", "Size"),
    ("torch", "float"), ("torch", "float32"), ("torch.serialization", "_get_layout"),
    ("os", "system"), ("builtins", "eval"), ("builtins", "getattr"), ("torch", "load"), ("torch.nn.parameter", "Parameter"),
]


def torch_global_mutation(rng: random.Random, pkl: bytes) -> tuple[bytes, str]:
    """One GLOBAL opcode (torch's protocol 2 names every global that way) names another."""
    ops = _ops(pkl)
    cands = [o for o in ops if o[0].name == "GLOBAL"]
    if not cands:
        return pickle_opcode_mutation(rng, pkl)
    op, arg, s, e = rng.choice(cands)
    mod, name = rng.choice(TORCH_GLOBALS)
    if rng.random() < 0.15:
        mod, name = arg.split(" ", 1)[0], _typo(rng, arg.split(" ", 1)[-1])
    return pkl[:s] + b"c" + mod.encode() + b"\n" + name.encode() + b"\n" + pkl[e:], f"global {arg!r} -> {mod}.{name}"


def _with_pickle(tz: TorchZip, pkl: bytes, fix_crc: bool) -> bytes:
    member = tz.member("data.pkl")
    assert member is not None
    member.data = pkl
    if fix_crc:
        member.crc = _crc(pkl)
    return tz.write()


def mutate_torch_pickle(rng: random.Random, data: bytes) -> tuple[bytes | None, str]:
    """data.pkl of a torch.save archive: its opcodes (pickle_opcode_mutation), a tensor's view
    (storage_offset / size / stride / numel; stride-0 and overlapping views), its object graph
    (shared references, self-reference, opcode-cheap memory), storage keys, globals; the member then rewritten
    with a correct CRC-32 half the time (the damage reaches the unpickler and the tree), else
    with sizes and offsets right but the old CRC-32 (only the CRC check stands in the way)."""
    tz = parse_torch_zip(data)
    member = tz.member("data.pkl") if tz else None
    if tz is None or member is None:
        return bytes_mutation(rng, data)
    pkl = member.data
    r = rng.random()
    if r < 0.3:
        new, desc = pickle_opcode_mutation(rng, pkl)
    elif r < 0.55:
        new, desc = tensor_view_mutation(rng, pkl)
    elif r < 0.65:
        new, desc = view_geometry_mutation(rng, pkl)
    elif r < 0.77:
        new, desc = graph_mutation(rng, pkl)
    elif r < 0.87:
        new, desc = storage_key_mutation(rng, pkl)
    else:
        new, desc = torch_global_mutation(rng, pkl)
    fix = rng.random() < 0.5
    return _with_pickle(tz, new, fix), f"data.pkl: {desc} ({'CRC-32 rewritten' if fix else 'old CRC-32'})"


# central-directory fields (offset, width): version needed, flags, method, CRC-32, sizes, name /
# extra / comment lengths, disk number, external attributes, local header offset
_CD_FIELDS = [(6, 2), (8, 2), (10, 2), (16, 4), (20, 4), (24, 4), (28, 2), (30, 2), (32, 2), (34, 2), (38, 4), (42, 4)]
_LOCAL_FIELDS = [(0, 1), (4, 2), (6, 2), (8, 2), (14, 4), (18, 4), (22, 4), (26, 2), (28, 2)]


def _field_value(rng: random.Random, old: int, width: int) -> int:
    top = 2 ** (8 * width)
    v = rng.choice([0, 1, top - 1, rng.randrange(top), old + 1, old - 1, old + 64, old ^ 0x1, old ^ 0x8,
                    old ^ 0x800, old * 2])
    return v % top


def _patch(data: bytes, at: int, width: int, value: int) -> bytes:
    return data[:at] + value.to_bytes(width, "little") + data[at + width:]


def mutate_torch_zip(rng: random.Random, data: bytes) -> tuple[bytes | None, str]:
    """The zip structure of a torch.save archive (what shallow validate checks): a field of a
    central-directory entry (the CRC-32 of a storage excepted: --deep's), of the end records,
    or of a record's local header; member names, flags and compression method; a member dropped,
    duplicated or moved; a storage member resized (the zip consistent, its claim not);
    the small records' contents (byteorder, version, storage alignment) with correct CRC-32s."""
    tz = parse_torch_zip(data)
    if tz is None:
        return bytes_mutation(rng, data)
    op = rng.choice(["cd_field", "cd_field", "cd_field", "end_field", "local_field", "name", "name",
                     "method", "flags", "drop", "dup", "move", "resize", "resize", "swap_names",
                     "record", "record", "comment"])
    storages = tz.storages()
    records = tz.records()
    if op == "cd_field":
        m = rng.choice(tz.members)
        # (a storage's CRC-32, and the offset of its local header, are checked when it is read:
        # torch_storage's, --deep's)
        fields = [f for f in _CD_FIELDS if not (f[0] in (16, 42) and m in storages)]
        off, width = rng.choice(fields)
        old = int.from_bytes(data[m.central_at + off:m.central_at + off + width], "little")
        v = _field_value(rng, old, width)
        return (_patch(data, m.central_at + off, width, v),
                f"central entry of {m.name.decode('latin-1')}: field +{off} {old} -> {v}")
    if op == "end_field":
        recs = [("eocd", tz.eocd_at, [(4, 2), (6, 2), (8, 2), (10, 2), (12, 4), (16, 4), (20, 2)])]
        if tz.eocd64_at >= 0:
            recs.append(("zip64 end", tz.eocd64_at, [(4, 8), (12, 2), (16, 4), (20, 4), (24, 8), (32, 8), (40, 8), (48, 8)]))
            recs.append(("zip64 locator", tz.locator_at, [(4, 4), (8, 8), (16, 4)]))
        name, at, fields = rng.choice(recs)
        off, width = rng.choice(fields)
        old = int.from_bytes(data[at + off:at + off + width], "little")
        v = _field_value(rng, old, width)
        return _patch(data, at + off, width, v), f"{name} record: field +{off} {old} -> {v}"
    if op == "local_field":
        m = rng.choice(records)  # a storage's local header is read with its data: torch_storage's
        off, width = rng.choice(_LOCAL_FIELDS)
        old = int.from_bytes(data[m.local_at + off:m.local_at + off + width], "little")
        v = _field_value(rng, old, width)
        return (_patch(data, m.local_at + off, width, v),
                f"local header of {m.name.decode('latin-1')}: field +{off} {old} -> {v}")
    if op == "name":
        m = rng.choice(tz.members)
        old = m.name.decode("latin-1")
        stem, _, rest = old.partition("/")
        new = rng.choice([_typo(rng, old), stem + "/" + _typo(rng, rest), "other/" + rest, rest, old + "/",
                          stem + "/../" + rest, stem + "/data/" + rest.rsplit("/", 1)[-1] + "0", "/" + old,
                          stem + "\\" + rest, old.upper(), stem + "/data.pkl"])
        where = rng.choice(["both", "both", "central", "local"])
        raw = new.encode("utf-8", "surrogateescape")
        if where == "both":
            m.name = raw
            return tz.write(), f"member {old!r} renamed {new!r}"
        # one of the two names only, kept at its length (the other records stay where they are)
        raw = (raw + b"_" * len(m.name))[:len(m.name)]
        at = (m.central_at + 46) if where == "central" else (m.local_at + 30)
        return data[:at] + raw + data[at + len(raw):], f"{where} name of {old!r} -> {raw!r}"
    if op == "method":
        m = rng.choice(tz.members)
        if rng.random() < 0.5 and m.data:
            import zlib

            c = zlib.compressobj(6, zlib.DEFLATED, -15)
            packed = c.compress(m.data) + c.flush()
            m.inflated = len(m.data)
            m.crc = _crc(m.data)
            m.data = packed
            struct.pack_into("<H", m.central, 10, 8)
            struct.pack_into("<H", m.local, 8, 8)
            return tz.write(), f"member {m.name.decode('latin-1')} deflated (a consistent zip)"
        v = rng.choice([8, 12, 14, 93, 99, 1])
        return _patch(data, m.central_at + 10, 2, v), f"member {m.name.decode('latin-1')}: method -> {v}"
    if op == "flags":
        m = rng.choice(tz.members)
        old = struct.unpack_from("<H", m.central, 8)[0]
        v = old ^ rng.choice([0x1, 0x8, 0x20, 0x40, 0x800, 0x2000, 0x4])
        # (a storage's local header is read with its data: torch_storage's)
        target = rng.choice(["central", "local", "both"]) if m not in storages else "central"
        out = data
        if target in ("central", "both"):
            out = _patch(out, m.central_at + 8, 2, v)
        if target in ("local", "both"):
            out = _patch(out, m.local_at + 6, 2, v)
        return out, f"member {m.name.decode('latin-1')}: flags {old:#x} -> {v:#x} ({target})"
    if op == "drop":
        m = rng.choice(tz.members)
        tz.members.remove(m)
        return tz.write(), f"member {m.name.decode('latin-1')} dropped"
    if op == "dup":
        m = rng.choice(tz.members)
        tz.members.insert(rng.randrange(len(tz.members) + 1), dataclasses.replace(m))
        return tz.write(), f"member {m.name.decode('latin-1')} listed twice"
    if op == "move":
        m = rng.choice(tz.members)
        tz.members.remove(m)
        tz.members.insert(rng.randrange(len(tz.members) + 1), m)
        return tz.write(), f"member {m.name.decode('latin-1')} moved (a valid zip)"
    if op == "resize" and storages:
        m = rng.choice(storages)
        k = rng.choice([-1, 1, -4, 4, 64, -len(m.data), len(m.data)])
        m.data = m.data[:k] if k < 0 else m.data + bytes(k)
        m.crc = _crc(m.data)
        return tz.write(), f"storage member {m.name.decode('latin-1')} resized by {k} bytes (CRC-32 rewritten)"
    if op == "swap_names" and len(storages) >= 2:
        a, b = rng.sample(storages, 2)
        a.name, b.name = b.name, a.name
        return tz.write(), f"storage members {a.name.decode()} and {b.name.decode()} swapped (a valid zip)"
    if op == "record":
        choices = {"byteorder": [b"big", b"little", b"Little", b"", b"little\n", b"middle"],
                   "version": [b"1", b"2", b"10", b"11", b"0", b"3\n", b"x", b"-3", b"99999999999999999999"],
                   ".format_version": [b"1", b"2", b"0", b"x"],
                   ".storage_alignment": [b"0", b"1", b"128", b"x", b"-64", b""],
                   ".data/serialization_id": [b"", b"0" * 40, b"x"]}
        present = [(k, v) for k, v in choices.items() if tz.member(k) is not None]
        key, values = rng.choice(present)
        m = tz.member(key)
        assert m is not None
        m.data = rng.choice(values)
        m.crc = _crc(m.data)
        return tz.write(), f"record {key} = {m.data!r} (CRC-32 rewritten)"
    if op == "comment":
        tz.eocd_comment = rng.choice([b"x", b"PK\x05\x06" + bytes(18), b"c" * 300])
        return tz.write(), f"archive comment of {len(tz.eocd_comment)} bytes"
    return bytes_mutation(rng, data)


def mutate_torch_storage(rng: random.Random, data: bytes) -> tuple[bytes | None, str]:
    """A torch.save archive's storage data (what only --deep catches: a storage's local header
    and CRC-32 are checked when it is read): bits flipped or a range zeroed inside a storage
    member; a storage's local header, data descriptor, or the CRC-32 and local header offset
    its central-directory entry gives; the file cut inside a storage; a consistent change (new
    values, CRC-32 rewritten) that torch and ckpt must both read; or any byte-level mutation."""
    tz = parse_torch_zip(data)
    storages = [m for m in tz.storages() if m.data] if tz else []
    op = rng.choice(["flip", "flip", "zero", "rewrite", "local_header", "local_header", "descriptor", "cd_field",
                     "cut", "bytes"])
    if tz is None or not storages or op == "bytes":
        return bytes_mutation(rng, data)
    m = rng.choice(storages)
    label = m.name.decode("latin-1")
    if op == "flip":
        i = m.data_at + rng.randrange(len(m.data))
        bit = rng.randrange(8)
        b = bytearray(data)
        b[i] ^= 1 << bit
        return bytes(b), f"storage {label}: bit {bit} of data byte {i - m.data_at} flipped"
    if op == "zero":
        i = rng.randrange(len(m.data))
        k = min(len(m.data) - i, rng.choice([1, 4, 64]))
        at = m.data_at + i
        return data[:at] + bytes(k) + data[at + k:], f"storage {label}: {k} bytes zeroed at {i}"
    if op == "rewrite":
        b = bytearray(m.data)
        i = rng.randrange(len(b))
        b[i] = rng.choice([0, 0xFF, 0x7F, 0x80, b[i] ^ 1])
        m.data = bytes(b)
        m.crc = _crc(m.data)
        return tz.write(), f"storage {label}: byte {i} changed, CRC-32 rewritten (valid, new values)"
    if op == "local_header":
        off, width = rng.choice(_LOCAL_FIELDS)
        old = int.from_bytes(data[m.local_at + off:m.local_at + off + width], "little")
        v = _field_value(rng, old, width)
        return _patch(data, m.local_at + off, width, v), f"local header of {label}: field +{off} {old} -> {v}"
    if op == "cd_field":
        off = rng.choice([16, 42])  # the CRC-32 and local header offset the central directory gives it
        old = int.from_bytes(data[m.central_at + off:m.central_at + off + 4], "little")
        v = _field_value(rng, old, 4)
        return _patch(data, m.central_at + off, 4, v), f"central entry of {label}: field +{off} {old} -> {v}"
    if op == "descriptor" and m.descriptor:
        at = m.data_at + len(m.data) + rng.choice([0, 4, 8, 12])
        v = rng.randrange(2**32)
        return _patch(data, at, 4, v), f"data descriptor of {label}: a field at +{at - m.data_at - len(m.data)} -> {v}"
    cut = m.data_at + rng.randrange(len(m.data))
    return data[:cut], f"file cut inside storage {label} (at {cut} of {len(data)} bytes)"


def torch_pickle_bytes(data: bytes) -> bytes | None:
    """data.pkl of a torch.save archive (None when the archive does not parse)."""
    tz = parse_torch_zip(data)
    m = tz.member("data.pkl") if tz else None
    return m.data if m else None


def with_torch_pickle(data: bytes, pkl: bytes) -> bytes:
    """A torch.save archive with data.pkl replaced (CRC-32, sizes and offsets made right)."""
    tz = parse_torch_zip(data)
    assert tz is not None, "not a torch.save archive"
    return _with_pickle(tz, pkl, True)


# --------------------------------------------------------------------------
# mutants
# --------------------------------------------------------------------------

MUTATORS: dict[str, Callable[[random.Random, bytes], tuple[bytes | None, str]]] = {
    "checkpoint_metadata": mutate_json_file,
    "metadata": mutate_tree_metadata,  # JSON operators and Orbax key types
    "sharding": mutate_json_file,
    "array_metadatas": mutate_json_file,
    "zarr_meta": mutate_json_file,
    "strings_json": mutate_json_file,
    "safetensors_index": mutate_json_file,
    "commit_marker": bytes_mutation,
    "ocdbt_manifest": bytes_mutation,
    "ocdbt_data": bytes_mutation,
    "zarr_chunk": bytes_mutation,
    "dcp_metadata": mutate_dcp_metadata,
    "distcp": mutate_distcp,
    "safetensors": mutate_safetensors,
    "msgpack": mutate_msgpack,
    "torch_pickle": mutate_torch_pickle,
    "torch_zip": mutate_torch_zip,
    "torch_storage": mutate_torch_storage,
    "torch_index": mutate_json_file,
}


# --------------------------------------------------------------------------
# the key space: separator characters in names, dotted versus nested keys, names
# that collide once joined or escaped (issue 44 #1)
# --------------------------------------------------------------------------
# A key-space mutant renames one leaf of a fixture as its own library would have written it under
# another name: a `/` or `%2F` in a key, a dotted name beside the nested one, a name whose naive
# join or unescape is another's, a name twice. The file stays well formed (a new header length,
# a re-encoded map, a re-pickled Metadata, a string op of data.pkl with its CRC made right), so
# the damage reaches the key handling, where two leaves must never share one key path. The
# contract and the oracle (the library's {keys: value} against ckpt's) hold as for every mutant.

# file kind -> the key-space kind of the same file
KEY_SPACE_KINDS = {
    "safetensors": "safetensors_keys", "msgpack": "msgpack_keys", "dcp_metadata": "dcp_keys",
    "torch_pickle": "torch_keys", "metadata": "orbax_keys",
}
KEY_SPACE_OPS = ("slash", "escaped", "percent", "empty-part", "slash-of-other", "escaped-of-other",
                 "child-of-other", "parent-of-other", "same-as-other")


def key_space_name(rng: random.Random, name: str, others: list[str], *, dup_ok: bool = True,
                   sep: str = ".") -> tuple[str, str]:
    """A new name for the leaf `name` among `others` (its siblings' names, `sep` the format's own
    separator of flat names): (new name, what was done)."""
    op = rng.choice([o for o in KEY_SPACE_OPS if dup_ok or o != "same-as-other"])
    other = rng.choice(others) if others else name
    dots = [i for i, c in enumerate(other if op.endswith("-of-other") else name) if c == sep]

    def at_dot(text: str, repl: str) -> str:
        ds = [i for i, c in enumerate(text) if c == sep]
        if not ds:
            mid = len(text) // 2
            return text[:mid] + repl + text[mid:]
        i = rng.choice(ds)
        return text[:i] + repl + text[i + 1:]

    if op == "slash":
        new = at_dot(name, "/")
    elif op == "escaped":
        new = at_dot(name, rng.choice(["%2F", "%2f", "%252F"]))
    elif op == "percent":
        i = rng.randrange(len(name) + 1)
        new = name[:i] + rng.choice(["%", "%25", "%2", "%%"]) + name[i:]
    elif op == "empty-part":
        new = rng.choice([at_dot(name, sep + sep), sep + name, name + sep, at_dot(name, "/" + sep)])
    elif op == "slash-of-other":
        new = at_dot(other, "/")
    elif op == "escaped-of-other":
        new = at_dot(other, "%2F")
    elif op == "child-of-other":
        new = other + sep + rng.choice(["x", "0", "weight"])
    elif op == "parent-of-other":
        new = other.rsplit(sep, 1)[0] if dots else other + "/"
    else:
        new = other
    if new == name or (not dup_ok and new in others):
        new, op = name + "/" + sep, op + " (fallback)"
    return new, f"{op}: {name!r} -> {new!r}"


def mutate_safetensors_keys(rng: random.Random, data: bytes) -> tuple[bytes | None, str]:
    """One tensor of a safetensors file renamed (key_space_name); the header keeps its order,
    its new length and the 8-byte padding safetensors writes."""
    if len(data) < 8:
        return bytes_mutation(rng, data)
    hlen = struct.unpack("<Q", data[:8])[0]
    header, body = data[8:8 + hlen], data[8 + hlen:]
    try:
        obj = json.loads(header)
    except ValueError:
        return bytes_mutation(rng, data)
    names = [k for k in obj if k != "__metadata__"] if isinstance(obj, dict) else []
    if not names:
        return bytes_mutation(rng, data)
    name = rng.choice(names)
    new, desc = key_space_name(rng, name, [n for n in names if n != name])
    # (as text: a name twice is a JSON object with a key twice, which a dict cannot hold)
    text = json.dumps(obj, separators=(",", ":"))
    old_key = json.dumps(name) + ":{"
    assert text.count(old_key) == 1
    raw = text.replace(old_key, json.dumps(new) + ":{").encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw + body, "tensor name " + desc


def mutate_msgpack_keys(rng: random.Random, data: bytes) -> tuple[bytes | None, str]:
    """One map key of a msgpack tree renamed (key_space_name), or a dotted or slashed key put beside
    the nested one it spells (flax restores both), holding another leaf's value."""
    import msgpack

    try:
        tree = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=msgpack.ExtType)
    except Exception:  # noqa: BLE001 - already damaged: bytes only
        return bytes_mutation(rng, data)
    slots = _msgpack_slots(tree)
    maps = [(p, v) for p, v in slots if isinstance(v, dict) and v and all(isinstance(k, str) for k in v)]
    if isinstance(tree, dict) and tree and all(isinstance(k, str) for k in tree):
        maps.append(((), tree))
    if not maps:
        return bytes_mutation(rng, data)
    path, node = rng.choice(maps)
    keys = list(node)
    leaves = [v for _, v in slots if not isinstance(v, (dict, list))]
    nested = [k for k in keys if isinstance(node[k], dict) and node[k] and all(isinstance(c, str) for c in node[k])]
    sentinel = msgpack.ExtType(98, b"ckpt-fuzz-keys")

    def packed(pairs: list[tuple[str, Any]]) -> bytes:
        # the map as msgpack.Packer writes pairs in order: a key may repeat here, unlike in a dict
        p = msgpack.Packer(use_bin_type=True)
        body = p.pack_map_header(len(pairs)) + b"".join(p.pack(k) + p.pack(v) for k, v in pairs)
        if path:
            _msgpack_set(tree, path, sentinel)
            return p.pack(tree).replace(p.pack(sentinel), body, 1)
        return body

    if nested and rng.random() < 0.4:
        # dotted versus nested: {"a": {"b": x}} gains "a.b" (or "a/b") beside it
        k = rng.choice(nested)
        child = rng.choice(list(node[k]))
        joined = k + rng.choice([".", "/", "%2F"]) + child
        value = rng.choice(leaves) if leaves else node[k][child]
        pairs = list(node.items()) + [(joined, value)]
        return packed(pairs), f"msgpack key {joined!r} beside {k!r}/{child!r} at {list(path)}"
    i = rng.randrange(len(keys))
    new, desc = key_space_name(rng, keys[i], keys[:i] + keys[i + 1:])
    pairs = [(new if j == i else k, v) for j, (k, v) in enumerate(node.items())]
    return packed(pairs), f"msgpack key at {list(path)}: {desc}"


def mutate_dcp_keys(rng: random.Random, data: bytes) -> tuple[bytes | None, str]:
    """One fqn of a DCP .metadata renamed where torch keys it (state_dict_metadata, storage_data's
    MetadataIndex, planner_data), as dcp.save names a state dict whose key path is the new one."""
    _torch()  # (torch's classes, for the unpickling)
    try:
        md = pickle.loads(data)
    except Exception:  # noqa: BLE001 - already damaged
        return bytes_mutation(rng, data)
    fqns = list(md.state_dict_metadata)
    if not fqns:
        return bytes_mutation(rng, data)
    fqn = rng.choice(fqns)
    planner = dict(md.planner_data or {})
    old_path = tuple(planner.get(fqn) or (fqn,))
    # the whole key path renamed; its fqn is its keys joined by '.', as torch flattens a state dict
    new_fqn, desc = key_space_name(rng, fqn, [f for f in fqns if f != fqn], dup_ok=False)
    if new_fqn in md.state_dict_metadata:
        return bytes_mutation(rng, data)
    parts = new_fqn.split(".") if len(old_path) > 1 else [new_fqn]
    # (a list index stays an int where the renamed path keeps it)
    new_path = tuple(old_path[i] if i < len(old_path) and isinstance(old_path[i], int) and str(old_path[i]) == p
                     else p for i, p in enumerate(parts))
    md.state_dict_metadata = {(new_fqn if k == fqn else k): v for k, v in md.state_dict_metadata.items()}
    md.storage_data = {(dataclasses.replace(k, fqn=new_fqn) if k.fqn == fqn else k): v
                       for k, v in md.storage_data.items()}
    if md.planner_data is not None:
        md.planner_data = {(new_fqn if k == fqn else k): (new_path if k == fqn else v) for k, v in planner.items()}
    return pickle.dumps(md), f"fqn {desc} (keys {list(new_path)})"


# strings of a torch.save pickle that are no key of the saved tree
_TORCH_NON_KEYS = {"storage", "cpu", "little", "big"}


def mutate_torch_keys(rng: random.Random, data: bytes) -> tuple[bytes | None, str]:
    """One str key of a torch.save pickle (a state dict's name) renamed (key_space_name), the
    archive's data.pkl CRC-32 made right."""
    pkl = torch_pickle_bytes(data)
    if pkl is None:
        return bytes_mutation(rng, data)
    ops = _ops(pkl)
    strings = [(a, s, e) for op, a, s, e in ops if op.name in ("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8")
               and isinstance(a, str) and a and a not in _TORCH_NON_KEYS and not a.isdigit()]
    if not strings:
        return bytes_mutation(rng, data)
    text, s, e = rng.choice(strings)
    others = sorted({a for a, _, _ in strings if a != text})
    new, desc = key_space_name(rng, text, others)
    return with_torch_pickle(data, _replace_ops(pkl, [(s, e, _unicode_op(new))])), "data.pkl key " + desc


def mutate_orbax_keys(rng: random.Random, data: bytes) -> tuple[bytes | None, str]:
    """One key of an Orbax `_METADATA` tree renamed (key_space_name) in every entry below it, its
    entries' tuple keys rebuilt: the stored arrays keep their old parameter names, so orbax's
    restore finds none under the new ones (a tree that no longer matches its data)."""
    try:
        meta = json.loads(data)
        tree = meta["tree_metadata"]
        entries = [(flat, [k["key"] for k in e["key_metadata"]]) for flat, e in tree.items()]
    except (ValueError, KeyError, TypeError):
        return mutate_json_file(rng, data)
    named = [(flat, keys, i) for flat, keys in entries for i in range(len(keys)) if isinstance(keys[i], str)]
    if not named:
        return mutate_json_file(rng, data)
    flat, keys, i = rng.choice(named)
    prefix = keys[:i]
    siblings = sorted({str(ks[i]) for _, ks in entries if len(ks) > i and ks[:i] == prefix and ks[i] != keys[i]})
    new, desc = key_space_name(rng, keys[i], siblings, dup_ok=False)
    rebuilt: dict[str, Any] = {}
    moved = 0
    for f, e in tree.items():
        kms = e["key_metadata"]
        if len(kms) > i and [k["key"] for k in kms[:i + 1]] == keys[:i + 1]:
            kms[i]["key"] = new
            f = str(tuple(k["key"] for k in kms))
            moved += 1
        rebuilt[f] = e
    meta["tree_metadata"] = rebuilt
    return dump_json(meta), f"tree key at {prefix}: {desc} ({moved} entries)"


MUTATORS.update({
    "safetensors_keys": mutate_safetensors_keys, "msgpack_keys": mutate_msgpack_keys,
    "dcp_keys": mutate_dcp_keys, "torch_keys": mutate_torch_keys, "orbax_keys": mutate_orbax_keys,
})
# every key-space mutant is a metadata edit: shallow validate's OK must hold against the library
METADATA_KINDS.update(KEY_SPACE_KINDS.values())


def pick_key_space_mutant(rng: random.Random, workdir: Path, formats: list[str] | None = None) -> Mutant:
    """A key-space mutant (KEY_SPACE_KINDS) of a fixture that has a file of its kind (run_fuzz.py --key-space)."""
    specs = [(s, k) for s in fixture_specs() if formats is None or s.format in formats
             for k in sorted(fixture_targets(FIXTURES / s.name)) if k in KEY_SPACE_KINDS.values()]
    spec, kind = rng.choice(specs)
    return make_mutant(rng, spec, workdir, kind=kind)


@dataclass
class Mutant:
    dir: Path  # the checkpoint path given to ckpt
    fixture: str
    format: str
    kind: str  # target kind, or "explicit"
    target: str  # relative path of the damaged file
    description: str
    oracle: str | None
    mode: str = ""
    # explicit cases: {command: required exit code}
    expect: dict[str, int] = field(default_factory=dict)
    canary: Path | None = None  # must not exist after the runs (code execution)
    check_oracle: bool = True
    entry: str = ""  # the file inside dir given to ckpt ("": dir itself)

    @property
    def path(self) -> Path:
        """What ckpt and the oracle are given: the checkpoint directory, or one file in it."""
        return self.dir / self.entry if self.entry else self.dir

    def label(self) -> str:
        return f"{self.fixture}:{self.target} [{self.kind}] {self.description}"


def copy_fixture(name: str, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(FIXTURES / name, dst, symlinks=True)
    return dst


def make_mutant(rng: random.Random, spec: FixtureSpec, workdir: Path, kind: str | None = None) -> Mutant:
    """Copy `spec`'s fixture under workdir and damage one file of it."""
    dst = copy_fixture(spec.name, workdir / spec.name)
    targets = fixture_targets(dst)
    kinds = sorted(targets)
    kind = kind if kind in targets else rng.choice(kinds)
    rel = rng.choice(targets[kind])
    path = dst / rel
    data = path.read_bytes()
    try:
        new, desc = MUTATORS[kind](rng, data)
    except Exception as exc:  # noqa: BLE001 - an operator that does not apply: fall back to bytes
        new, desc = bytes_mutation(rng, data)
        desc += f" (structured operator failed: {type(exc).__name__})"
    if new is None:
        path.unlink()
    else:
        path.write_bytes(new)
    return Mutant(dst, spec.name, spec.format, kind, rel, desc, spec.oracle, spec.mode, entry=spec.entry)


def structured_torch_mutant(rng: random.Random, spec: FixtureSpec, target: str, family: str, variant: str,
                            workdir: Path) -> Mutant:
    """Copy `spec`'s fixture under workdir and give its torch.save file `target` one of the
    graph ("shared", "self", "cheap") or view ("stride0", "overlap") changes, CRC-32 made right."""
    dst = copy_fixture(spec.name, workdir / spec.name)
    path = dst / target
    data = path.read_bytes()
    pkl = torch_pickle_bytes(data)
    assert pkl is not None, f"{target} is not a torch.save archive"
    op = graph_mutation if family == "graph" else view_geometry_mutation
    new, desc = op(rng, pkl, variant)
    path.write_bytes(with_torch_pickle(data, new))
    return Mutant(dst, spec.name, spec.format, "torch_pickle", target, f"data.pkl: {desc}", spec.oracle, spec.mode,
                  entry=spec.entry)


def pick_spec(rng: random.Random, formats: list[str] | None = None) -> FixtureSpec:
    weights = {f: w for f, w in format_weights().items() if formats is None or f in formats}
    fmt = rng.choices(list(weights), weights=list(weights.values()))[0]
    return rng.choice([s for s in fixture_specs() if s.format == fmt])


# --------------------------------------------------------------------------
# running ckpt
# --------------------------------------------------------------------------


@dataclass
class RunResult:
    command: str
    exit_code: int | None
    signal: int | None
    seconds: float
    rss_kb: int | None
    stdout: str
    stderr: str
    timed_out: bool = False

    def brief(self) -> dict[str, Any]:
        return {"command": self.command, "exit": self.exit_code, "signal": self.signal,
                "seconds": round(self.seconds, 3), "rss_mb": None if self.rss_kb is None else round(self.rss_kb / 1024, 1),
                "stderr": self.stderr[-600:]}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CKPT_DEBUG", None)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def run_process(command: str, path: Path, *, kill_after: float = KILL_AFTER_S, tmp: Path | None = None) -> RunResult:
    """`python -m ckpt_tool <command> PATH` as a whole process: exit code,
    signal, wall time and this child's own peak RSS (wait4)."""
    tmp = tmp or path.parent
    out_f, err_f, rss_f = tmp / f".{command}.out", tmp / f".{command}.err", tmp / f".{command}.rss"
    # through a small launcher: a child started from this (large) process, by vfork or fork,
    # reports this process's peak RSS as its own (Linux keeps the old memory's high-water mark
    # across exec), so the launcher's own fork + exec gives the ckpt process a clean record
    argv = [sys.executable, "-c", _LAUNCHER, str(rss_f), sys.executable, "-m", "ckpt_tool", *COMMANDS[command], str(path)]
    with open(out_f, "wb") as out, open(err_f, "wb") as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=ROOT, env=_env(),
                                start_new_session=True)
        timed_out = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - t0 > kill_after:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.005)
        seconds = time.monotonic() - t0
        proc.returncode = -1  # reaped by wait4 above; keep Popen from waiting again
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    stdout = out_f.read_bytes().decode("utf-8", "replace")
    stderr = err_f.read_bytes().decode("utf-8", "replace")
    out_f.unlink()
    err_f.unlink()
    try:
        rss_kb: int | None = int(rss_f.read_text())
        rss_f.unlink()
    except (OSError, ValueError):  # killed before the launcher could say: its own, an upper bound
        rss_kb = usage.ru_maxrss
    if timed_out:
        sig = None  # our own kill, reported as a hang
    return RunResult(command, code, sig, seconds, rss_kb, stdout, stderr, timed_out)


# argv: RSS_FILE PROGRAM ARGS...: runs PROGRAM, writes its peak RSS (KiB) to RSS_FILE, and ends
# as it ended (the same exit code, or the same signal)
_LAUNCHER = """
import os, signal, sys
pid = os.fork()
if pid == 0:
    try:
        os.execv(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
if os.WIFSIGNALED(status):
    signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
os._exit(os.WEXITSTATUS(status))
"""


def run_inprocess(command: str, path: Path, *, kill_after: float = KILL_AFTER_S) -> RunResult:
    """The same command through ckpt_tool.cli.main._run in this process, with
    a watchdog (a hung call is reported, its thread abandoned). No RSS or
    signal figures: those need run_process."""
    from ckpt_tool.cli.main import _run

    argv = [*COMMANDS[command], str(path)]
    out, err = io.StringIO(), io.StringIO()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                box["code"] = _run(argv)
        except BaseException as exc:  # noqa: BLE001 - escaped _run: a traceback for a user
            import traceback

            box["code"] = None
            box["exc"] = "Traceback (escaped _run):\n" + "".join(traceback.format_exception(exc))

    t0 = time.monotonic()
    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(kill_after)
    seconds = time.monotonic() - t0
    if th.is_alive():
        return RunResult(command, None, None, seconds, None, out.getvalue(), err.getvalue(), timed_out=True)
    stderr = err.getvalue() + box.get("exc", "")
    return RunResult(command, box.get("code"), None, seconds, None, out.getvalue(), stderr)


# --------------------------------------------------------------------------
# the contract
# --------------------------------------------------------------------------

# violation classes, worst first (the long run's summary uses these names)
CLASSES = [
    "code-execution", "oracle-deep", "oracle-shallow", "oracle-mismatch", "accepted-bad-input",
    "signal", "hang", "slow", "rss", "internal-error", "bad-exit", "stderr-lines", "inspect-json",
    "ckpt-read-fails", "oracle-worker",
]


@dataclass
class Violation:
    cls: str
    command: str
    detail: str


def check_run(r: RunResult) -> list[Violation]:
    v: list[Violation] = []
    if r.timed_out:
        v.append(Violation("hang", r.command, f"no exit after {r.seconds:.1f} s (killed)"))
        if r.rss_kb is not None and r.rss_kb > RSS_LIMIT_KB:
            v.append(Violation("rss", r.command, f"peak RSS {r.rss_kb / 1024:.0f} MB before it was killed"))
        return v
    if r.signal is not None:
        v.append(Violation("signal", r.command, f"killed by signal {r.signal} ({signal.Signals(r.signal).name})"))
    if r.seconds > TIME_LIMIT_S:
        v.append(Violation("slow", r.command, f"{r.seconds:.1f} s"))
    if r.rss_kb is not None and r.rss_kb > RSS_LIMIT_KB:
        v.append(Violation("rss", r.command, f"peak RSS {r.rss_kb / 1024:.0f} MB"))
    if "Traceback" in r.stderr or "internal error" in r.stderr:
        line = next((ln for ln in r.stderr.splitlines() if "internal error" in ln), None)
        v.append(Violation("internal-error", r.command, line or r.stderr.strip().splitlines()[-1][:300]))
    if r.signal is None and r.exit_code not in (0, 1):
        v.append(Violation("bad-exit", r.command, f"exit code {r.exit_code}: {r.stderr.strip()[-200:]}"))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    if len(lines) > 1 and not any(x.cls == "internal-error" for x in v):
        v.append(Violation("stderr-lines", r.command, f"{len(lines)} stderr lines: " + " | ".join(lines[:3])[:300]))
    if r.command == "inspect" and r.exit_code == 0:
        try:
            json.loads(r.stdout)
        except ValueError:
            v.append(Violation("inspect-json", r.command, "exit 0 but stdout is not JSON"))
    return v


def check_oracle(m: Mutant, runs: dict[str, RunResult], oracle: "Oracle | None") -> tuple[list[Violation], dict | None]:
    """Where validate passed, the library must load the mutant with ckpt's values."""
    shallow_ok = runs["validate"].exit_code == 0
    deep_ok = runs["deep"].exit_code == 0
    # shallow validate reads no array data: data damage is --deep's business
    relevant = deep_ok or (shallow_ok and m.kind in METADATA_KINDS)
    if not relevant or not m.check_oracle:
        return [], None
    if m.format == "dcp" and (m.dir / ".metadata").is_file():
        from fuzz_oracle import foreign_globals

        bad = foreign_globals((m.dir / ".metadata").read_bytes())
        if bad:
            return [Violation("accepted-bad-input", "validate",
                              f"validate passed a .metadata naming globals {bad[:3]}")], None
    if oracle is None or m.oracle is None:
        return [], None
    res = oracle.check(m.oracle, m.path, m.mode, ckpt_format=m.format)
    which = "deep" if deep_ok else "validate"
    if "worker_error" in res or "oracle_timeout" in res:
        return [Violation("oracle-worker", which, str(res)[:400])], res
    if not res["library_ok"] and res.get("unchecked"):
        # a torch.save pickle names globals ckpt admits as data whose real classes cannot be
        # imported in the oracle worker (deepspeed, megatron): torch cannot be given them, so
        # there is no verdict; the answer (in the run record) says which
        return [], res
    if not res["library_ok"] and res.get("refused_globals"):
        # torch.load(weights_only=True), given every global ckpt admits, refused globals that
        # ckpt's allow-list does not admit either: validate passing such a pickle is a hole
        return [Violation("accepted-bad-input", which, f"validate{' --deep' if deep_ok else ''} exit 0 on a pickle "
                                                       f"naming {res['refused_globals'][:3]}, which neither "
                                                       "torch.load(weights_only=True) nor ckpt's allow-list "
                                                       "admits")], res
    if not res["library_ok"]:
        cls = "oracle-deep" if deep_ok else "oracle-shallow"
        return [Violation(cls, which, f"validate{' --deep' if deep_ok else ''} exit 0, library: "
                                      f"{res['library_error']}")], res
    if not res["ckpt_ok"]:
        if deep_ok:
            return [Violation("ckpt-read-fails", "deep", f"validate --deep exit 0, library loads it, ckpt's "
                                                         f"read fails: {res['ckpt_error']}")], res
        return [], res
    if res["mismatch"]:
        return [Violation("oracle-mismatch", which, res["mismatch"])], res
    return [], res


def check_expectations(m: Mutant, runs: dict[str, RunResult]) -> list[Violation]:
    v = []
    for cmd, want in m.expect.items():
        r = runs.get(cmd)
        if r is not None and not r.timed_out and r.exit_code is not None and r.exit_code != want:
            v.append(Violation("accepted-bad-input", cmd, f"exit {r.exit_code}, expected {want}: "
                                                          f"{(r.stderr or r.stdout).strip()[:200]}"))
    if m.canary is not None and m.canary.exists():
        v.append(Violation("code-execution", "any", f"the pickle ran code: {m.canary} was created"))
    return v


@dataclass
class Outcome:
    mutant: Mutant
    runs: dict[str, RunResult]
    violations: list[Violation]
    oracle: dict | None = None

    def classes(self) -> list[str]:
        return sorted({v.cls for v in self.violations}, key=CLASSES.index)

    def to_json(self) -> dict[str, Any]:
        m = self.mutant
        return {"fixture": m.fixture, "format": m.format, "kind": m.kind, "target": m.target,
                "mutation": m.description, "classes": self.classes(),
                "violations": [dataclasses.asdict(v) for v in self.violations],
                "runs": {k: r.brief() for k, r in self.runs.items()}, "oracle": self.oracle}


def evaluate(m: Mutant, *, runner: str = "process", oracle: "Oracle | None" = None,
             commands: tuple[str, ...] = ("inspect", "validate", "deep")) -> Outcome:
    # (the output files go beside the checkpoint directory, never into it)
    run = (lambda c, p: run_process(c, p, tmp=m.dir.parent)) if runner == "process" else run_inprocess
    runs = {c: run(c, m.path) for c in commands}
    violations = [v for r in runs.values() for v in check_run(r)]
    violations += check_expectations(m, runs)
    ores = None
    if "validate" in runs and "deep" in runs:
        ov, ores = check_oracle(m, runs, oracle)
        violations += ov
    return Outcome(m, runs, violations, ores)


# --------------------------------------------------------------------------
# the oracle worker
# --------------------------------------------------------------------------


class Oracle:
    """A client of one long-lived tests/fuzz_oracle.py worker (restarted when it
    dies or hangs)."""

    def __init__(self, formats: tuple[str, ...] | None = None, timeout: float = 120.0) -> None:
        # default: every oracle a catalogue FUZZ row names
        self.formats = formats if formats is not None else tuple(dict.fromkeys(s.oracle for s in fixture_specs()
                                                                                if s.oracle))
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.calls = 0

    def _start(self) -> None:
        env = _env()
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        env["JAX_PLATFORMS"] = "cpu"
        env["PYTHONWARNINGS"] = "ignore"
        self.proc = subprocess.Popen([sys.executable, str(ORACLE_SCRIPT), *self.formats], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT, env=env,
                                     text=True, start_new_session=True)
        ready = self._readline(300.0)
        if not ready or "ready" not in ready:
            self.close()
            raise RuntimeError("the oracle worker did not start")

    # the library under test may believe a bomb's claimed sizes: a worker
    # past this is killed (the answer is then a worker error, not a verdict)
    MAX_WORKER_RSS = 6 * 1024**3

    def _readline(self, timeout: float) -> str | None:
        assert self.proc is not None and self.proc.stdout is not None
        box: list[str] = []
        th = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        th.start()
        deadline = time.monotonic() + timeout
        while th.is_alive() and time.monotonic() < deadline:
            th.join(0.2)
            try:
                import psutil

                if psutil.Process(self.proc.pid).memory_info().rss > self.MAX_WORKER_RSS:
                    self.close()
                    return None
            except Exception:  # noqa: BLE001 - gone already
                pass
        return box[0] if box else None

    def check(self, fmt: str, path: Path, mode: str = "", ckpt_format: str = "") -> dict:
        """The worker's answer for one checkpoint; `ckpt_format` (the registry's name, default
        `fmt`) picks the allow-list a torch.save file is loaded with."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        self.calls += 1
        req = {"format": fmt, "path": str(path), "mode": mode, "ckpt_format": ckpt_format or fmt}
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.close()
            return {"worker_error": "the oracle worker died"}
        line = self._readline(self.timeout)
        if not line:
            died = self.proc.poll()
            self.close()
            return {"oracle_timeout": self.timeout} if died is None else {"worker_error": f"worker died ({died})"}
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(Exception):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.proc.wait(10)
            self.proc = None

    def __enter__(self) -> "Oracle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------
# the explicit cases: hostile pickles, path tricks, FIFOs, memory bombs
# --------------------------------------------------------------------------


def _pickle_global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _hostile_pickles(canary: Path) -> dict[str, bytes]:
    cmd = f"touch {canary}".encode()
    reduce_call = lambda mod, name, arg: (  # noqa: E731
        b"\x80\x04" + _pickle_global(mod, name) + b"\x8c" + bytes([len(arg)]) + arg + b"\x85R.")
    deep = b"\x80\x04" + b"]" * 0 + b"(" * 100_000 + b"." * 1
    nested_lists = b"\x80\x04" + b"]" * 200_000 + b"." 
    return {
        "os_system": reduce_call("os", "system", cmd),
        "posix_system": reduce_call("posix", "system", cmd),
        "builtins_eval": reduce_call("builtins", "eval", b"__import__('os').system('" + cmd + b"')"),
        "builtins_exec": reduce_call("builtins", "exec", b"open('" + str(canary).encode() + b"','w')"),
        "subprocess_popen": reduce_call("subprocess", "getoutput", cmd),
        "stack_global_os": (b"\x80\x04\x8c\x02os\x94\x8c\x06system\x94\x93\x8c" + bytes([len(cmd)]) + cmd
                            + b"\x85R."),
        "getattr_chain": (b"\x80\x04" + _pickle_global("builtins", "getattr") + _pickle_global("builtins", "__import__")
                          + b"\x8c\x02os\x85R\x8c\x06system\x86R\x8c" + bytes([len(cmd)]) + cmd + b"\x85R."),
        "importlib": reduce_call("importlib", "import_module", b"os"),
        "torch_load": reduce_call("torch", "load", b"/etc/passwd"),
        "allowed_class_bad_reduce": (b"\x80\x04" + _pickle_global("pathlib", "PosixPath")
                                     + b"\x8c\x05/etc/\x85R."),
        "memo_get_2_28": b"\x80\x04j\x00\x00\x00\x10.",  # LONG_BINGET 2**28
        "memo_put_2_28": b"\x80\x04N" + b"r\x00\x00\x00\x10" + b".",  # LONG_BINPUT 2**28
        "memo_put_2_31": b"\x80\x04N" + b"r\xff\xff\xff\x7f" + b".",
        "deep_marks": deep,
        "deep_lists": nested_lists,
        "deep_tuples": b"\x80\x04" + b")" + b"\x85" * 200_000 + b".",
        "binbytes_claim_4gb": b"\x80\x04B\xff\xff\xff\xff" + b"x" * 16 + b".",
        "binbytes8_claim": b"\x80\x04\x8e" + struct.pack("<Q", 2**62) + b"x" * 16 + b".",
        "none": pickle.dumps(None),
        "int": pickle.dumps(7),
        "list": pickle.dumps([1, 2]),
        "dict": pickle.dumps({"state_dict_metadata": {}}),
        "empty": b"",
        "stop_only": b".",
        "proto_99": b"\x80\x63N.",
    }


def _bomb_metadata(data: bytes, how: str) -> bytes:
    m = _torch()
    md = pickle.loads(data)
    fqn, t = next((k, v) for k, v in md.state_dict_metadata.items() if isinstance(v, m.TensorStorageMetadata))
    if how == "size_2_62":
        t.size = _size([2**62] * len(t.size))
        for c in t.chunks:
            c.sizes = _size([2**62] * len(c.sizes))
            c.offsets = _size([0] * len(c.offsets))
        t.chunks = t.chunks[:1]
    elif how == "tb_8":
        # 2**41 float32 elements = 8 TB, one chunk claiming it all
        t.size = _size([2**21, 2**20] + [1] * (len(t.size) - 2) if len(t.size) >= 2 else [2**41])
        t.chunks = [m.ChunkStorageMetadata(offsets=_size([0] * len(t.size)), sizes=t.size)]
        for idx, info in list(md.storage_data.items()):
            if idx.fqn == fqn:
                del md.storage_data[idx]
        first = next(iter(md.storage_data.values()))
        md.storage_data[m.MetadataIndex(fqn, list(t.chunks[0].offsets), 0)] = dataclasses.replace(first)
    elif how == "length_8tb":
        info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
        info.length = 2**43
    elif how == "many_chunks":
        n = 50_000
        t.chunks = [m.ChunkStorageMetadata(offsets=_size([0] * len(t.size)), sizes=_size([1] * len(t.size)))
                    for _ in range(n)]
    return pickle.dumps(md, protocol=4)


def _edit_json(path: Path, fn: Callable[[Any], Any]) -> None:
    obj = json.loads(path.read_text())
    obj = fn(obj) or obj
    path.write_text(json.dumps(obj))


def explicit_cases() -> dict[str, Callable[[Path], Mutant]]:
    """name -> builder(workdir) of each explicit case. Every one must be
    refused (validate and validate --deep exit 1), quickly and in bounded
    memory; the pickle cases by inspect too, and none may run code."""
    cases: dict[str, Callable[[Path], Mutant]] = {}
    reject_all = {"inspect": 1, "validate": 1, "deep": 1}
    reject_validate = {"validate": 1, "deep": 1}

    def mk(fixture: str, kind: str, target: str, desc: str, expect: dict, dst: Path, canary: Path | None = None):
        spec = spec_of(fixture)
        return Mutant(dst, fixture, spec.format, kind, target, desc, spec.oracle, spec.mode, expect, canary,
                      check_oracle=False)

    # hostile and malformed .metadata pickles
    for name in _hostile_pickles(Path("/x")):
        def build(work: Path, name: str = name) -> Mutant:
            dst = copy_fixture("dcp_single", work / "dcp_single")
            canary = work / "CANARY"
            (dst / ".metadata").write_bytes(_hostile_pickles(canary)[name])
            return mk("dcp_single", "hostile-pickle", ".metadata", f"hostile .metadata: {name}", reject_all, dst,
                      canary)
        cases[f"pickle_{name}"] = build

    # hostile payload pickle inside the .distcp (a bytes item's torch.save archive)
    def build_payload(work: Path) -> Mutant:
        dst = copy_fixture("dcp_single", work / "dcp_single")
        canary = work / "CANARY"
        data = bytearray((dst / "__0_0.distcp").read_bytes())
        evil = b"\x80\x02" + _pickle_global("os", "system") + b"X" + struct.pack("<I", len(f"touch {canary}")) \
            + f"touch {canary}".encode() + b"\x85R."
        i = data.find(b"data.pkl")
        j = data.find(b"\x80\x02", i)
        if j > 0:
            k = data.find(b".", j)
            if k > j:
                data[j:j + len(evil)] = evil[: max(0, min(len(evil), len(data) - j))]
        (dst / "__0_0.distcp").write_bytes(bytes(data))
        return mk("dcp_single", "hostile-pickle", "__0_0.distcp", "os.system in an item's data.pkl",
                  {"deep": 1}, dst, canary)
    cases["payload_os_system"] = build_payload

    # DCP relative_path tricks
    def dcp_path(how: str) -> Callable[[Path], Mutant]:
        def build(work: Path) -> Mutant:
            dst = copy_fixture("dcp_single", work / "dcp_single")
            outside = work / "outside.distcp"
            shutil.copy(dst / "__0_0.distcp", outside)
            m = _torch()
            md = pickle.loads((dst / ".metadata").read_bytes())
            for info in md.storage_data.values():
                info.relative_path = {"dotdot": "../outside.distcp", "absolute": str(outside),
                                      "dot_metadata": ".metadata"}[how]
            (dst / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
            assert m
            return mk("dcp_single", "path", ".metadata", f"relative_path {how}", reject_validate, dst)
        return build
    for how in ("dotdot", "absolute", "dot_metadata"):
        cases[f"dcp_relative_path_{how}"] = dcp_path(how)

    def link_case(fixture: str, rel: str, how: str) -> Callable[[Path], Mutant]:
        def build(work: Path) -> Mutant:
            dst = copy_fixture(fixture, work / fixture)
            p = dst / rel
            outside = work / ("outside_" + p.name)
            if p.is_dir():
                shutil.copytree(p, outside)
                shutil.rmtree(p)
            else:
                shutil.copy(p, outside)
                p.unlink()
            if how == "symlink_out":
                p.symlink_to(outside)
            elif how == "dev_zero":
                p.symlink_to("/dev/zero")
            elif how == "fifo":
                os.mkfifo(p)
            elif how == "loop":
                p.symlink_to(p.name)
            elif how == "dotdot":
                p.symlink_to(os.path.relpath(outside, p.parent))
            return mk(fixture, "path", rel, f"{rel} is {how}", reject_validate, dst)
        return build

    for fixture, rel in [("orbax_plain_zarr2", "layers.1.w/0.0"), ("orbax_ocdbt_zarr2", "manifest.ocdbt"),
                         ("orbax_ocdbt_zarr2", "ocdbt.process_0"), ("dcp_single", "__0_0.distcp"),
                         ("orbax_plain_zarr2", "layers.1.w/.zarray"), ("orbax_ocdbt_zarr2", "array_metadatas/process_0")]:
        for how in ("symlink_out", "dotdot", "loop"):
            cases[f"{fixture}_{rel.replace('/', '_')}_{how}"] = link_case(fixture, rel, how)
    for fixture, rel in [("orbax_plain_zarr2", "layers.1.w/0.0"), ("orbax_ocdbt_zarr2", "manifest.ocdbt"),
                         ("orbax_ocdbt_zarr2", "ocdbt.process_0/manifest.ocdbt"), ("orbax_ocdbt_zarr2", "_METADATA"),
                         ("orbax_ocdbt_zarr2", "array_metadatas/process_0"), ("orbax_plain_zarr2", "layers.1.w/.zarray"),
                         ("dcp_single", "__0_0.distcp"), ("dcp_single", ".metadata"),
                         ("safetensors_numpy", "model.safetensors")]:
        cases[f"{fixture}_{rel.replace('/', '_')}_fifo"] = link_case(fixture, rel, "fifo")
    for fixture, rel in [("orbax_plain_zarr2", "layers.1.w/0.0"), ("dcp_single", "__0_0.distcp"),
                         ("orbax_ocdbt_zarr2", "manifest.ocdbt")]:
        cases[f"{fixture}_{rel.replace('/', '_')}_dev_zero"] = link_case(fixture, rel, "dev_zero")

    def ocdbt_data_fifo(work: Path) -> Mutant:
        dst = copy_fixture("orbax_ocdbt_zarr2", work / "orbax_ocdbt_zarr2")
        d = next((dst / "ocdbt.process_0" / "d").iterdir())
        d.unlink()
        os.mkfifo(d)
        return mk("orbax_ocdbt_zarr2", "path", str(d.relative_to(dst)), "a d/ data file is a FIFO",
                  reject_validate, dst)
    cases["orbax_ocdbt_zarr2_process_d_fifo"] = ocdbt_data_fifo

    # memory bombs: shapes and lengths claiming far more than is stored
    for how in ("size_2_62", "tb_8", "length_8tb", "many_chunks"):
        def build_bomb(work: Path, how: str = how) -> Mutant:
            dst = copy_fixture("dcp_single", work / "dcp_single")
            (dst / ".metadata").write_bytes(_bomb_metadata((dst / ".metadata").read_bytes(), how))
            return mk("dcp_single", "bomb", ".metadata", f"DCP {how}", reject_validate, dst)
        cases[f"bomb_dcp_{how}"] = build_bomb

    def zarr_bomb(how: str) -> Callable[[Path], Mutant]:
        def build(work: Path) -> Mutant:
            dst = copy_fixture("orbax_plain_zarr2", work / "orbax_plain_zarr2")
            za = dst / "layers.1.w" / ".zarray"
            if how == "shape_2_62":
                _edit_json(za, lambda o: o.update(shape=[2**62, 2**62]))
            elif how == "chunk_2_62":
                _edit_json(za, lambda o: o.update(shape=[2**62, 8], chunks=[2**62, 8]))
            elif how == "tb_8":
                _edit_json(za, lambda o: o.update(shape=[2**21, 2**20]))
            return mk("orbax_plain_zarr2", "bomb", "layers.1.w/.zarray", f"zarr {how}", reject_validate, dst)
        return build
    for how in ("shape_2_62", "chunk_2_62", "tb_8"):
        cases[f"bomb_zarr_{how}"] = zarr_bomb(how)

    def zarr3_bomb(work: Path) -> Mutant:
        # OCDBT zarr3: the shape claim is in _METADATA/array_metadatas (zarr.json is inside the database)
        dst = copy_fixture("orbax_ocdbt_zarr3", work / "orbax_ocdbt_zarr3")

        def edit(o: Any) -> None:
            for a in o["array_metadatas"]:
                a["array_metadata"]["write_shape"] = [2**62] * len(a["array_metadata"]["write_shape"])
                a["array_metadata"]["chunk_shape"] = [2**62] * len(a["array_metadata"]["chunk_shape"])
        _edit_json(dst / "array_metadatas" / "process_0", edit)
        return mk("orbax_ocdbt_zarr3", "bomb", "array_metadatas/process_0", "write/chunk shapes 2^62",
                  reject_validate, dst)
    cases["bomb_orbax_array_metadatas_2_62"] = zarr3_bomb

    def safetensors_bomb(work: Path) -> Mutant:
        dst = copy_fixture("safetensors_numpy", work / "safetensors_numpy")
        f = dst / "model.safetensors"
        data = f.read_bytes()
        hlen = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + hlen])
        name = next(k for k in header if k != "__metadata__")
        header[name]["shape"] = [2**31, 2**31]
        new = json.dumps(header).encode()
        f.write_bytes(struct.pack("<Q", len(new)) + new + data[8 + hlen:])
        return mk("safetensors_numpy", "bomb", "model.safetensors", "a shape of 2^62 elements", reject_validate, dst)
    cases["bomb_safetensors_shape"] = safetensors_bomb

    # torch.save: a hostile data.pkl in an otherwise intact archive (its CRC-32 right), so that
    # the unpickler itself must refuse it (the ones that are valid objects in a .pt are left out:
    # a torch.save file may hold None, 7 or 200,000 stacked lists' last one)
    for name in ("os_system", "posix_system", "builtins_eval", "builtins_exec", "stack_global_os", "getattr_chain",
                 "importlib", "torch_load", "memo_get_2_28", "memo_put_2_31", "deep_marks", "binbytes8_claim",
                 "empty", "stop_only", "proto_99"):
        def build_torch_pickle(work: Path, name: str = name) -> Mutant:
            dst = copy_fixture("torch_state", work / "torch_state")
            canary = work / "CANARY"
            f = dst / "state.pt"
            f.write_bytes(with_torch_pickle(f.read_bytes(), _hostile_pickles(canary)[name]))
            return mk("torch_state", "hostile-pickle", "state.pt", f"hostile data.pkl: {name}", reject_all, dst, canary)
        cases[f"torch_pickle_{name}"] = build_torch_pickle

    def torch_bomb(how: str) -> Callable[[Path], Mutant]:
        def build(work: Path) -> Mutant:
            dst = copy_fixture("torch_hf_bin_single", work / "torch_hf_bin_single")
            f = dst / "pytorch_model.bin"
            data = f.read_bytes()
            if how == "member_4gb":
                # the central directory says the first storage member is 4 GB
                tz = parse_torch_zip(data)
                assert tz is not None
                m = tz.storages()[0]
                f.write_bytes(_patch(_patch(data, m.central_at + 20, 4, 0xFFFFFFFE), m.central_at + 24, 4, 0xFFFFFFFE))
                return mk("torch_hf_bin_single", "bomb", "pytorch_model.bin", "a storage member of 4 GB",
                          reject_validate, dst)
            pkl = torch_pickle_bytes(data)
            assert pkl is not None
            site = tensor_sites(_ops(pkl))[0]
            edits = []
            for role, (op, _arg, s, e) in site["roles"]:
                if how == "size_2_62" and role.startswith(("size", "stride")):
                    edits.append((s, e, _encode_int_op(op.name, 2**31 if role.startswith("size") else 0)))
                if how == "numel_2_40" and role == "numel":
                    edits.append((s, e, _encode_int_op(op.name, 2**40)))
            f.write_bytes(with_torch_pickle(data, _replace_ops(pkl, edits)))
            return mk("torch_hf_bin_single", "bomb", "pytorch_model.bin", f"torch.save tensor {how}", reject_validate,
                      dst)
        return build
    for how in ("size_2_62", "numel_2_40", "member_4gb"):
        cases[f"bomb_torch_{how}"] = torch_bomb(how)
    for fixture, rel, hows in [("torch_hf_bin_sharded", "pytorch_model-00002-of-00003.bin", ("symlink_out", "dotdot", "loop")),
                               ("torch_hf_bin_sharded", "pytorch_model.bin.index.json", ("fifo",)),
                               ("torch_state", "state.pt", ("fifo", "dev_zero", "loop"))]:
        for how in hows:
            cases[f"{fixture}_{rel.replace('/', '_')}_{how}"] = link_case(fixture, rel, how)

    # a damaged integrity manifest (issue 22): validate reports it (bad-metadata, path-escape,
    # size-mismatch; a wrong digest only with --deep), never an internal error or a hang
    def manifest_case(how: str) -> Callable[[Path], Mutant]:
        def build(work: Path) -> Mutant:
            dst = copy_fixture("orbax_plain_zarr2", work / "orbax_plain_zarr2")
            files = {p.relative_to(dst).as_posix(): p for p in sorted(dst.rglob("*")) if p.is_file()}
            doc: Any = {"algorithm": "sha256",
                        "files": {n: hashlib.sha256(p.read_bytes()).hexdigest() for n, p in files.items()},
                        "ckpt": {"version": 1, "scope": "tree", "sizes": {n: p.stat().st_size for n, p in files.items()}}}
            target, expect = dst / "integrity.json", reject_validate
            raw = None
            if how == "invalid_json":
                raw = json.dumps(doc).encode()[:-7]
            elif how == "deep_nesting":
                raw = b"[" * 200_000 + b"]" * 200_000
            elif how == "not_object":
                raw = b'"sha256"'
            elif how == "md5":
                doc["algorithm"] = "md5"
            elif how == "dotdot":
                doc["files"]["../../../etc/passwd"] = "0" * 64
            elif how == "absolute":
                doc["files"]["/etc/passwd"] = "0" * 64
            elif how == "size_2_63":
                doc["ckpt"]["sizes"]["_METADATA"] = 2**63
            elif how == "sizes_not_ints":
                doc["ckpt"]["sizes"]["_METADATA"] = [1, 2]
            elif how == "digest_flipped":
                name = "params.dense.kernel/0.0"
                doc["files"][name] = doc["files"][name][:-1] + ("0" if doc["files"][name][-1] != "0" else "1")
                expect = {"deep": 1}
            elif how == "tensors_bad":
                doc["ckpt"]["tensors"] = {"params/dense/kernel": {"sha256": "z", "dtype": 4, "shape": [-1]}}
            if how == "symlink_out":
                outside = work / "outside.json"
                outside.write_text(json.dumps(doc))
                target.symlink_to(outside)
            elif how == "fifo":
                os.mkfifo(target)
            else:
                target.write_bytes(raw if raw is not None else json.dumps(doc).encode())
            return mk("orbax_plain_zarr2", "manifest", "integrity.json", f"integrity.json: {how}", expect, dst)
        return build

    for how in ("invalid_json", "deep_nesting", "not_object", "md5", "dotdot", "absolute", "size_2_63",
                "sizes_not_ints", "digest_flipped", "tensors_bad", "symlink_out", "fifo"):
        cases[f"manifest_{how}"] = manifest_case(how)
    cases.update(uncontrolled_document_cases())
    return cases


# which explicit cases must run as whole processes in `make test` (they can
# take the process down or its memory up); the others run in-process there
PROCESS_ONLY_PREFIXES = ("bomb_", "pickle_memo", "pickle_deep", "pickle_binbytes", "deep_")
PROCESS_ONLY_SUBSTR = ("_fifo", "dev_zero", "pickle_os_system")


def needs_process(case: str) -> bool:
    return case.startswith(PROCESS_ONLY_PREFIXES) or any(s in case for s in PROCESS_ONLY_SUBSTR)


# --------------------------------------------------------------------------
# files and environment variables the user does not control (issue 44 #9): a config.json, a
# trainer_state.json or a model.yaml nested past Python's recursion limit; TPU_*, launcher and
# CKPT_* variables holding zeros, huge numbers, host lists that multiply out, non-ASCII digits
# --------------------------------------------------------------------------

# (fixture, file in it, how the file is rewritten): each parser of such a file in some format
DEEP_DOCUMENTS = [
    ("megatron_torch_dist_tp2", "metadata.json", "json"),
    ("runs_hf_trainer", "checkpoint-4/trainer_state.json", "json"),
    ("megatron_nemo2", "context/model.yaml", "yaml"),
    ("orbax_ocdbt_zarr2", "_METADATA", "json"),
    ("orbax_ocdbt_zarr2", "_sharding", "json"),
    ("orbax_plain_zarr2", "_CHECKPOINT_METADATA", "json"),
    ("safetensors_llama_sharded", "model.safetensors.index.json", "json"),
    ("torch_hf_bin_sharded", "pytorch_model.bin.index.json", "json"),
    ("flax_orbax", "_METADATA", "json"),
]


def deep_document(kind: str, depth: int = 200_000) -> bytes:
    """A document nested `depth` levels: 400 KB of brackets, far past the recursion limit."""
    body = b"[" * depth + b"]" * depth
    return b"a: " + body + b"\n" if kind == "yaml" else body


def uncontrolled_document_cases() -> dict[str, Callable[[Path], Mutant]]:
    """Explicit cases: each DEEP_DOCUMENTS file nested too deeply. The contract (no internal error,
    one line, bounded time and memory) is what is checked; which exit code depends on whether the
    command reads that file."""
    cases: dict[str, Callable[[Path], Mutant]] = {}
    for fixture, rel, kind in DEEP_DOCUMENTS:
        if not (FIXTURES / fixture / rel).is_file():
            continue

        def build(work: Path, fixture: str = fixture, rel: str = rel, kind: str = kind) -> Mutant:
            dst = copy_fixture(fixture, work / fixture)
            target = dst / rel
            target.unlink()  # (a fixture file may be a hard link into the tree)
            target.write_bytes(deep_document(kind))
            try:
                spec = spec_of(fixture)
                fmt, oracle, mode = spec.format, spec.oracle, spec.mode
            except StopIteration:  # a run root (runs_hf_trainer): no format of its own in the catalogue
                fmt, oracle, mode = "run-root", None, ""
            return Mutant(dst, fixture, fmt, "bomb", rel, f"{rel}: nested past the recursion limit",
                          oracle, mode, {}, None, check_oracle=False)

        cases[f"deep_{fixture}_{rel.replace('/', '_')}"] = build
    return cases


# the variables each parser reads (ops/topology.py, base/distributed.py, storage/remote.py)
ENV_VARIABLES = {
    "tpu": ("TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY", "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_HOST_BOUNDS",
            "TPU_WORKER_ID", "TPU_VISIBLE_CHIPS", "JAX_PLATFORMS"),
    "gpu": ("CUDA_VISIBLE_DEVICES", "JAX_PLATFORMS"),
    "launcher": ("CKPT_DISTRIBUTED", "CKPT_JOIN_TIMEOUT", "CKPT_BARRIER_TIMEOUT", "JAX_COORDINATOR_ADDRESS",
                 "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "SLURM_STEP_ID", "SLURM_PROCID",
                 "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_JOB_ID", "SLURM_NODELIST", "SLURM_STEP_NODELIST"),
    "remote": ("CKPT_IO_TIMEOUT", "CKPT_IO_RETRIES", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION"),
}
HOSTILE_ENV_VALUES = [
    "", " ", "0", "1", "2", "8", "-1", "-0", "0,0,1", "0,0,0", "1,0,1", "2,2,1", "4,4,1", "2,4,1", "0,1", "1,2",
    ",", "1,,2", "99999999999999999999", "9" * 5000, "1e9", "1e400", "nan", "inf", "-inf", "0x10", "1_000",
    "\u0663", "\u0663,\u0663,1", "\x00", "a" * 5000, ",".join(["1"] * 20000), ",".join(map(str, range(20000))),
    "v5litepod-8", "v5litepod-256", "v6e-4", "v5e:2x4", "v5litepod-0", "v5litepod-99999999999", "2x4", "0x0",
    "tpu", "cuda,gpu", "cpu", "auto", "off", "torch", "jax", "zz", "True", "host:0", "host:99999999",
    "n[0-999999][0-999999]", "n[0-999999]", "n[5-1]", "n[[1]]", "n[1", "n]1[", "n[01-03,07],g[1-2]-x[3,5]",
    "::::", "HTTP://h:1", "ftp://h", "http://[::1", "http://h:99999999", "https://", "http://h/\udcff",
]


def environment_mutant(rng: random.Random) -> dict[str, str]:
    """An environment for one parser group: some of its variables hostile, the others coherent
    (a v5e host, a torchrun or Slurm step), so that the parsing goes past its first check."""
    group = rng.choice(sorted(ENV_VARIABLES))
    base = {
        "tpu": {"TPU_ACCELERATOR_TYPE": "v5litepod-8", "TPU_VISIBLE_CHIPS": "0,1,2,3,4,5,6,7",
                "TPU_CHIPS_PER_HOST_BOUNDS": "2,4,1", "TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_ID": "0"},
        "gpu": {"CUDA_VISIBLE_DEVICES": "0,1"},
        "launcher": rng.choice([{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234"},
                                {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7",
                                 "SLURM_NODELIST": "n[1-2]"}, {}]),
        "remote": {},
    }[group]
    env = dict(base) if rng.random() < 0.8 else {}
    for name in rng.sample(ENV_VARIABLES[group], k=min(len(ENV_VARIABLES[group]), rng.randint(1, 4))):
        env[name] = rng.choice(HOSTILE_ENV_VALUES)
    return env


def check_environment(env: dict[str, str], time_limit: float = 2.0) -> list[Violation]:
    """Every environment parser given `env`, in this process: each may refuse (a CkptError, whose
    message is one line), never raise anything else, and each answers within `time_limit`."""
    from ckpt_tool.base import distributed
    from ckpt_tool.ops import reshard, topology
    from ckpt_tool.base.errors import CkptError
    from ckpt_tool.storage import remote

    def topology_and_mesh() -> None:
        topo = topology.host_topology(env)
        if topo is not None:
            topo.describe()
            for size in {topo.size, 3}:
                with contextlib.suppress(CkptError):
                    reshard.mesh_for_topology([("data", size)], topo)

    def launcher() -> None:
        distributed.process_spec(None, None, None, env)
        distributed._timeout(env, distributed.JOIN_TIMEOUT_VARIABLE, 1.0)
        distributed._timeout(env, distributed.BARRIER_TIMEOUT_VARIABLE, 1.0)

    def remote_numbers() -> None:
        # (keys in the environment: tensorstore then probes no ~/.aws files, which it logs at length)
        keys = {"AWS_ACCESS_KEY_ID": "fuzz", "AWS_SECRET_ACCESS_KEY": "fuzz"}
        saved = {n: os.environ.get(n) for n in (*ENV_VARIABLES["remote"], *keys)}
        try:
            os.environ.update(keys)
            for n in ENV_VARIABLES["remote"]:
                os.environ.pop(n, None)
                if n in env and "\x00" not in env[n]:
                    os.environ[n] = env[n]
            remote._env_number("CKPT_IO_TIMEOUT", 30.0, minimum=0.001)
            remote._env_number("CKPT_IO_RETRIES", 4, minimum=1, integer=True)
            spec, _ = remote._kvstore_spec("s3://bucket/ckpt")
            import tensorstore as ts  # (what the storage layer opens it with; nothing is read)

            ts.KvStore.open(spec).result()
        finally:
            for n, v in saved.items():
                if v is None:
                    os.environ.pop(n, None)
                else:
                    os.environ[n] = v

    out: list[Violation] = []
    shown = json.dumps({k: v[:40] + ("..." if len(v) > 40 else "") for k, v in env.items()})
    for name, parse in (("topology", topology_and_mesh), ("launcher", launcher), ("remote", remote_numbers)):
        t0 = time.monotonic()
        try:
            parse()
        except CkptError as exc:
            if "\n" in exc.message.strip():
                out.append(Violation("stderr-lines", f"env:{name}", f"a message of several lines with {shown}"))
        except Exception as exc:  # noqa: BLE001 - exactly what is looked for
            out.append(Violation("internal-error", f"env:{name}", f"{type(exc).__name__}: {str(exc)[:200]} with {shown}"))
        seconds = time.monotonic() - t0
        if seconds > time_limit:
            out.append(Violation("slow", f"env:{name}", f"{seconds:.1f} s with {shown}"))
    return out


def environment_fuzz(seed: int, rounds: int) -> list[tuple[dict[str, str], list[Violation]]]:
    """`rounds` environments (mutant i of seed S is the same on every run); the failing ones."""
    failing = []
    for i in range(rounds):
        env = environment_mutant(random.Random(f"{seed}:env:{i}"))
        violations = check_environment(env)
        if violations:
            failing.append((env, violations))
    return failing


# --------------------------------------------------------------------------
# the regression corpus: a mutant stored as the files that differ from its fixture
# --------------------------------------------------------------------------


def save_corpus_case(m: Mutant, name: str, note: str, dest: Path = CORPUS) -> Path:
    """Store a mutant as tests/fuzz_corpus/<name>/: case.json + the files that
    differ from the fixture (deletions listed)."""
    out = dest / name
    if out.exists():
        shutil.rmtree(out)
    (out / "files").mkdir(parents=True)
    fixture = FIXTURES / m.fixture
    changed, deleted = [], []
    for p in sorted(fixture.rglob("*")):
        rel = p.relative_to(fixture).as_posix()
        q = m.dir / rel
        if p.is_file() and not (q.exists() or q.is_symlink()):
            deleted.append(rel)
    for q in sorted(m.dir.rglob("*")):
        rel = q.relative_to(m.dir).as_posix()
        p = fixture / rel
        if q.is_symlink() or not q.is_file():
            continue
        if not p.is_file() or p.read_bytes() != q.read_bytes():
            changed.append(rel)
            (out / "files" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(q, out / "files" / rel)
    (out / "case.json").write_text(json.dumps({
        "fixture": m.fixture, "kind": m.kind, "target": m.target, "mutation": m.description,
        "note": note, "changed": changed, "deleted": deleted, "expect": m.expect}, indent=1) + "\n")
    return out


def load_corpus_case(case_dir: Path, workdir: Path) -> Mutant:
    info = json.loads((case_dir / "case.json").read_text())
    spec = spec_of(info["fixture"])
    dst = copy_fixture(spec.name, workdir / spec.name)
    for rel in info["deleted"]:
        (dst / rel).unlink()
    for rel in info["changed"]:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(case_dir / "files" / rel, dst / rel)
    return Mutant(dst, spec.name, spec.format, info["kind"], info["target"], info["mutation"], spec.oracle,
                  spec.mode, info.get("expect") or {}, entry=spec.entry)


# --------------------------------------------------------------------------
# the zygote: whole processes without paying the interpreter start per run
# --------------------------------------------------------------------------
#
# A fresh `python -m ckpt_tool` costs ~0.7 s here, nearly all of it imports;
# the command itself takes 10-100 ms on a fixture. The zygote is a process
# that has imported ckpt's modules (never jax or torch) and forks one child
# per run: the child is a whole process of its own (own exit code, signals,
# memory, file descriptors) running ckpt's real entry point. Every violation
# a forked run shows is re-run as a fresh `python -m ckpt_tool` process before
# it is reported, so that nothing fork-specific is ever blamed on ckpt.


def zygote_main() -> None:
    import traceback

    for mod in ("ckpt_tool.cli.main", "ckpt_tool.cli.inspect_cmd", "ckpt_tool.cli.validate_cmd",
                "ckpt_tool.formats", "ckpt_tool.ops.validate.deep", "ckpt_tool.ops.inspect"):
        __import__(mod)
    import ckpt_tool.formats as formats_pkg

    for info in formats_pkg.registered():  # every format's package, loaded once here, not per child
        with contextlib.suppress(Exception):
            __import__(info.package)
    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the child: one ckpt process
            code = 1
            try:
                os.setsid()
                fd_in = os.open(os.devnull, os.O_RDONLY)
                fd_out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                fd_err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd_in, 0)
                os.dup2(fd_out, 1)
                os.dup2(fd_err, 2)
                sys.argv = ["ckpt", *req["argv"]]
                from ckpt_tool.cli.main import main

                main(req["argv"])
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # noqa: BLE001 - what an uncaught exception does to a process
                traceback.print_exc()
                code = 1
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                with contextlib.suppress(Exception):
                    sys.stderr.flush()
                os._exit(code)
        timed_out = False
        peak_kb = 0
        while True:
            got, status, usage = os.wait4(pid, os.WNOHANG)
            if got:
                break
            # a guard for the shared machine: a child far past the limit is
            # stopped (and reported as over the limit, not as a signal)
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{pid}/statm") as f:
                    peak_kb = max(peak_kb, int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024))
            if peak_kb > RSS_GUARD_KB:
                timed_out = "rss"
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                got, status, usage = os.wait4(pid, 0)
                break
            if time.monotonic() - t0 > req["kill_after"]:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                got, status, usage = os.wait4(pid, 0)
                break
            time.sleep(0.002)
        out.write(json.dumps({"status": status, "seconds": time.monotonic() - t0,
                              "rss_kb": max(usage.ru_maxrss, peak_kb), "timed_out": timed_out}) + "\n")
        out.flush()


class Zygote:
    """Client of one zygote process (started lazily, restarted if it dies)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--zygote"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=_env(), text=True)
        assert self.proc.stdout is not None
        if "ready" not in self.proc.stdout.readline():
            raise RuntimeError("the zygote did not start")

    def run(self, command: str, path: Path, *, kill_after: float = KILL_AFTER_S, tmp: Path | None = None) -> RunResult:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        tmp = tmp or path.parent
        out_f, err_f = tmp / f".{command}.out", tmp / f".{command}.err"
        req = {"argv": [*COMMANDS[command], str(path)], "stdout": str(out_f), "stderr": str(err_f),
               "kill_after": kill_after}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        res = json.loads(self.proc.stdout.readline())
        status = res["status"]
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) and not res["timed_out"] else None
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        if res["timed_out"] == "rss":  # stopped by the guard: an RSS violation, not a hang
            res["timed_out"] = False
        stdout = out_f.read_bytes().decode("utf-8", "replace") if out_f.exists() else ""
        stderr = err_f.read_bytes().decode("utf-8", "replace") if err_f.exists() else ""
        with contextlib.suppress(FileNotFoundError):
            out_f.unlink()
        with contextlib.suppress(FileNotFoundError):
            err_f.unlink()
        return RunResult(command, code, sig, res["seconds"], res["rss_kb"], stdout, stderr, res["timed_out"])

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(Exception):
                self.proc.stdin.close()
                self.proc.wait(10)
            with contextlib.suppress(Exception):
                self.proc.kill()
            self.proc = None


# classes a fresh process must confirm before a forked run's violation counts
PROCESS_CLASSES = {"signal", "hang", "slow", "rss", "internal-error", "bad-exit", "stderr-lines", "inspect-json"}


def evaluate_forked(m: Mutant, zygote: Zygote, oracle: "Oracle | None" = None, *,
                    kill_after: float = KILL_AFTER_S, confirm: bool = True) -> tuple[Outcome, list[str]]:
    """evaluate() through the zygote; each run with a process-level violation
    is re-run as a fresh process, whose result replaces it. Returns the
    outcome and the commands whose forked violation a fresh process did not
    reproduce."""
    runs = {c: zygote.run(c, m.path, kill_after=kill_after, tmp=m.dir.parent) for c in ("inspect", "validate", "deep")}
    unconfirmed = []
    for c, r in list(runs.items()):
        found = {v.cls for v in check_run(r)} & PROCESS_CLASSES
        # (a forked run that hung or blew up its memory is believed as it is
        # when confirm is off: the fast subset cannot wait twice)
        if found and (confirm or not found & {"hang", "slow", "rss"}):
            fresh = run_process(c, m.path, kill_after=kill_after, tmp=m.dir.parent)
            if not check_run(fresh):
                unconfirmed.append(c)
            runs[c] = fresh
    violations = [v for r in runs.values() for v in check_run(r)]
    violations += check_expectations(m, runs)
    ov, ores = check_oracle(m, runs, oracle)
    return Outcome(m, runs, violations + ov, ores), unconfirmed


# --------------------------------------------------------------------------
# run roots: pointer and tracker files, step-named entries beside a checkpoint
# --------------------------------------------------------------------------
# A run-root mutant is a copy of a run root written by the real libraries (fixtures/gen_runs.py,
# the Megatron, DeepSpeed and Flax/T5X generators) with its pointer file rewritten, or an entry named
# like some framework's step put beside its steps. The contract on it: the usual one (no traceback,
# exit 0 or 1, one stderr line on failure, bounded time and memory) for inspect, validate, validate
# --deep, ls and latest of the root, and: the step `latest` prints passes validate by its path;
# `latest --json` names the framework's own pick beside it; where the mutated pointer names no step
# the framework can open, validate of the root exits 1.

COMMANDS.update({"ls": ["ls", "--json"], "latest": ["latest", "--json"]})
RUN_ROOT_COMMANDS = ("inspect", "validate", "deep", "ls", "latest")

# fixture (its root inside, for NeMo) -> the pointer file its framework reads, or None
RUN_ROOT_FIXTURES: dict[str, str | None] = {
    "runs_orbax": None, "runs_torchtitan": None, "runs_hf_trainer": None, "runs_nemo2/checkpoints": None,
    "flax_msgpack": None, "t5x": None,
    "megatron_run": "latest_checkpointed_iteration.txt", "megatron_legacy": "latest_checkpointed_iteration.txt",
    "deepspeed_z1_fp32": "latest", "runs_verl": "latest_checkpointed_iteration.txt",
}

# names some framework gives a step, its pointer or its temporary save ({n}: a step number)
STEP_NAME_TEMPLATES = (
    "step-{n}", "checkpoint-{n}", "tmp-checkpoint-{n}", "checkpoint_{n}", "checkpoint_{n}.tmp-1700000000",
    "checkpoint_tmp", "global_step{n}", "global_step_{n}", "iter_{n:07d}", "release", "{n}",
    "{n}.orbax-checkpoint-tmp", "{n}.orbax-checkpoint-tmp-1700000000", "x-step={n}", "x-step={n}-last",
    "step-{n}.bak", "old-step-{n}", "checkpoint-{n}.bak",
    "x-step={n}-unfinished", "latest", "latest_checkpointed_iteration.txt", "latest_universal",
)
STEP_ENTRY_KINDS = ("empty-dir", "empty-file", "garbage-file", "dir-of-garbage", "torn-copy", "copy", "symlink")


def pointer_mutation(rng: random.Random, data: bytes, steps: list[str]) -> tuple[bytes | None, str]:
    """A pointer or tracker file's new text: what a killed or foreign writer leaves there."""
    real = data.decode("utf-8", "replace").strip()
    others = [s for s in steps if s != real] or steps or ["x"]
    options: list[tuple[bytes | None, str]] = [
        (b"", "empty"), (b"\n", "a newline"), (b" \t ", "whitespace"), (b"-1", "-1"), (b"0", "0"),
        (str(2**70).encode(), "2**70"), ("\u0663".encode(), "an Arabic-Indic digit"), (b"release", "release"),
        (b"007", "007"), (f" {real} \n".encode(), "padded"), (real.encode() + b"\x00", "a NUL after it"),
        (real.encode()[:-1], "its last character cut"), (b"99999", "a step that is not there"),
        (rng.choice(others).encode(), "another entry's name"), (f"../{real}".encode(), "../ before it"),
        (b"/etc/passwd", "an absolute path"), (bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))), "random bytes"),
        (b"9" * 5000, "5000 nines"), (f"{real}\n{rng.choice(others)}".encode(), "two lines"),
        (b"\xff\xfe", "not UTF-8"), (None, "deleted"),
    ]
    new, desc = options[rng.randrange(len(options))]
    if rng.random() < 0.15:
        new, desc = bytes_mutation(rng, data)
    return new, desc


def step_entry_mutation(rng: random.Random, root: Path) -> tuple[str, str]:
    """Put an entry named like a step (of any framework) beside the root's steps; (name, what)."""
    steps = sorted(p for p in root.iterdir() if not p.name.startswith("_"))
    name = rng.choice(STEP_NAME_TEMPLATES).format(n=rng.choice([0, 1, 3, 5, 7, 25, 99, 10**12]))
    kind = rng.choice(STEP_ENTRY_KINDS)
    path = root / name
    if path.exists() or path.is_symlink():
        # an existing entry of that name: replaced by the mutant's (a torn or foreign copy of it)
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    source = rng.choice([p for p in steps if p.is_dir()] or steps)
    if kind == "empty-dir":
        path.mkdir()
    elif kind == "empty-file":
        path.write_bytes(b"")
    elif kind == "garbage-file":
        path.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))))
    elif kind == "dir-of-garbage":
        path.mkdir()
        (path / rng.choice(["metadata.json", ".metadata", "trainer_state.json", "checkpoint", "x.pt",
                            "_CHECKPOINT_METADATA", "model.safetensors"])).write_bytes(b"\x00garbage")
    elif kind in ("torn-copy", "copy"):
        if source.is_dir():
            shutil.copytree(source, path, symlinks=True)
            files = sorted(p for p in path.rglob("*") if p.is_file())
            if kind == "torn-copy" and files:
                victim = rng.choice(files)
                if rng.random() < 0.5:
                    victim.unlink()
                else:
                    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        else:
            shutil.copy(source, path)
    else:
        path.symlink_to(source.name if rng.random() < 0.7 else "/etc")
    return name, f"{kind} {name!r}" + (f" (from {source.name})" if kind in ("torn-copy", "copy", "symlink") else "")


def _pointer_target(pointer: str, raw: bytes, *, verl: bool) -> str | None:
    """The entry the framework's own reading of a pointer file opens (None: its read fails):
    DeepSpeed strips the tag; Megatron and verl take int() of the stripped text (Megatron also
    'release')."""
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    if pointer == "latest":
        return text or None
    try:
        n = int(text)
    except ValueError:
        return "release" if text == "release" and not verl else None
    return f"global_step_{n}" if verl else f"iter_{n:07d}"


def _is_dir(path: Path) -> bool:
    """Path.is_dir, False for a name the file system refuses (a pointer of 5000 nines: ENAMETOOLONG,
    which Path.is_dir raises rather than answers)."""
    try:
        return path.is_dir()
    except OSError:
        return False


def make_run_root_mutant(rng: random.Random, workdir: Path, fixture: str | None = None) -> Mutant:
    """A copy of one run root with its pointer file rewritten or a step-named entry put beside its steps."""
    fixture = fixture or rng.choice(sorted(RUN_ROOT_FIXTURES))
    top, _, inner = fixture.partition("/")
    dst = copy_fixture(top, workdir / top)
    root = dst / inner if inner else dst
    pointer = RUN_ROOT_FIXTURES[fixture]
    expect: dict[str, int] = {}
    if pointer is not None and rng.random() < 0.5:
        path = root / pointer
        steps = sorted(p.name for p in root.iterdir() if p.is_dir())
        new, desc = pointer_mutation(rng, path.read_bytes(), steps)
        if new is None:
            path.unlink()
        else:
            path.write_bytes(new)
            named = _pointer_target(pointer, new, verl=fixture == "runs_verl")
            if named is None or not _is_dir(root / named):
                # the framework opens no step by this pointer (its load fails): neither may validate pass
                expect = {"validate": 1, "deep": 1}
        kind, target = "pointer", pointer
    else:
        target, desc = step_entry_mutation(rng, root)
        kind = "step-entry"
    return Mutant(root, fixture, "run-root", kind, target, desc, None, expect=expect, check_oracle=False)


def check_run_root(m: Mutant, runs: dict[str, RunResult], run: Callable[[str, Path], RunResult]) -> list[Violation]:
    """The run-root contract beyond check_run's: latest's step validates by its path, and
    latest --json names the framework's pick beside the step it prints."""
    v: list[Violation] = []
    r = runs.get("latest")
    if r is None or r.exit_code != 0:
        return v
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        return [Violation("inspect-json", "latest", "exit 0 but stdout is not JSON")]
    if "framework" not in doc or "differs" not in doc:
        v.append(Violation("accepted-bad-input", "latest", "latest --json without the framework's pick"))
    if doc.get("path"):
        # the step printed, by its own path as a launcher opens it (a verl step's checkpoint is its
        # actor/ directory: the layout's payload)
        from ckpt_tool.formats.roots import layout_named

        payload = layout_named(doc["layout"]).payload
        step = run("validate", Path(doc["path"]) / payload if payload else Path(doc["path"]))
        v += check_run(step)
        if step.exit_code != 0:
            v.append(Violation("accepted-bad-input", "latest",
                               f"latest printed {doc['name']}, which validate fails: {step.stdout.strip()[-200:]}"))
    return v


def evaluate_run_root(m: Mutant, *, runner: str = "process") -> Outcome:
    """evaluate() of a run-root mutant: RUN_ROOT_COMMANDS, the contract and check_run_root."""
    run = (lambda c, p: run_process(c, p, tmp=m.dir.parent)) if runner == "process" else run_inprocess
    runs = {c: run(c, m.path) for c in RUN_ROOT_COMMANDS}
    violations = [v for r in runs.values() for v in check_run(r)]
    violations += check_expectations(m, runs)
    violations += check_run_root(m, runs, run)
    return Outcome(m, runs, violations, None)



if __name__ == "__main__" and "--zygote" in sys.argv:
    sys.path.insert(0, str(ROOT))
    zygote_main()

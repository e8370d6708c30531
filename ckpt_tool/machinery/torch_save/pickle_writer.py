"""A small pickle opcode emitter for writing torch's pickles without torch.

`pickle.Pickler` cannot write a reference to `torch.Size` or to DCP's
`Metadata` class unless it can import them (it checks that every global it
names resolves to the object being saved). ckpt must write those pickles in
processes that have no torch, so this module emits the opcodes itself from
plain descriptions of the objects:

  * `Global(module, name)`: a class, function or singleton named by module
    and attribute (`torch.float32`, `torch.Size`);
  * `Reduce(func, args)`: `func(*args)` at load time (how torch pickles
    `torch.Size`, layouts, enums and tensors);
  * `Obj(cls, state)`: `cls.__new__(cls)` followed by BUILD with `state`, the
    form the default `__reduce_ex__` gives dataclasses (state None: no BUILD);
  * `PersistentId(value)`: a torch.save storage reference (BINPERSID).

Everything else is a plain value (None, bool, int, float, str, bytes, tuple,
list, dict). The opcode choices, memoisation (by object identity, as the
stdlib pickler does) and protocol-4 framing follow CPython's pickler, so the
output is what `pickle.dumps(obj, protocol)` would give for the real objects.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from ...base.errors import CkptError

# opcodes (pickletools names)
_PROTO = b"\x80"
_FRAME = b"\x95"
_STOP = b"."
_NONE = b"N"
_NEWTRUE = b"\x88"
_NEWFALSE = b"\x89"
_BININT = b"J"
_BININT1 = b"K"
_BININT2 = b"M"
_LONG1 = b"\x8a"
_LONG4 = b"\x8b"
_BINFLOAT = b"G"
_SHORT_BINUNICODE = b"\x8c"
_BINUNICODE = b"X"
_BINUNICODE8 = b"\x8d"
_SHORT_BINBYTES = b"C"
_BINBYTES = b"B"
_BINBYTES8 = b"\x8e"
_EMPTY_TUPLE = b")"
_TUPLE1 = b"\x85"
_TUPLE2 = b"\x86"
_TUPLE3 = b"\x87"
_MARK = b"("
_TUPLE = b"t"
_EMPTY_LIST = b"]"
_APPEND = b"a"
_APPENDS = b"e"
_EMPTY_DICT = b"}"
_SETITEM = b"s"
_SETITEMS = b"u"
_GLOBAL = b"c"
_STACK_GLOBAL = b"\x93"
_REDUCE = b"R"
_NEWOBJ = b"\x81"
_BUILD = b"b"
_BINPERSID = b"Q"
_MEMOIZE = b"\x94"
_BINPUT = b"q"
_LONG_BINPUT = b"r"
_BINGET = b"h"
_LONG_BINGET = b"j"

_FRAME_SIZE_TARGET = 64 * 1024  # CPython's: frames are committed once this full
_FRAME_SIZE_MIN = 4  # a smaller last frame is written without a FRAME header
_BATCHSIZE = 1000  # APPENDS / SETITEMS batch size, as CPython


class PickleWriteError(CkptError):
    """A value the emitter cannot write (an unsupported type or a cycle)."""


@dataclass(frozen=True)
class Global:
    """A global named by module and attribute, e.g. Global("torch", "float32")."""

    module: str
    name: str


@dataclass(eq=False)
class Reduce:
    """`func(*args)` at load time; then, as `__reduce__`'s 5-tuple has them, `items` set on the
    result (an OrderedDict's key-value pairs) and BUILD with `state` (None: none)."""

    func: Global
    args: tuple[Any, ...]
    items: list[tuple[Any, Any]] | None = None
    state: Any = None


@dataclass(eq=False)
class Obj:
    """`cls.__new__(cls)` then `__setstate__(state)` / `__dict__.update(state)`; state None skips BUILD."""

    cls: Global
    state: Any = None


@dataclass(eq=False)
class PersistentId:
    """A persistent id (torch.save names storages this way)."""

    value: Any


class _Emitter:
    def __init__(self, protocol: int) -> None:
        if protocol not in (2, 4):
            raise ValueError(f"unsupported pickle protocol {protocol}")
        self.proto = protocol
        self.framing = protocol >= 4
        self.out = bytearray()  # committed output (PROTO and finished frames)
        self.buf = bytearray()  # the current frame (or all output without framing)
        # id(obj) -> (memo index, obj); the object is kept alive so that its
        # id cannot be reused by a temporary while we pickle (as CPython does)
        self.memo: dict[int, tuple[int, Any]] = {}
        # Globals are frozen values, not objects with identity: memo by value
        self.global_memo: dict[Global, int] = {}
        self.memo_size = 0

    # -- framing and memo ----------------------------------------------------
    def commit_frame(self, force: bool = False) -> None:
        if not self.framing:
            return
        if len(self.buf) >= _FRAME_SIZE_TARGET or (force and self.buf):
            if len(self.buf) >= _FRAME_SIZE_MIN:
                self.out += _FRAME + struct.pack("<Q", len(self.buf))
            self.out += self.buf
            self.buf = bytearray()

    def memoize(self, obj: Any) -> None:
        idx = self.memo_size
        self.memo_size += 1
        self.memo[id(obj)] = (idx, obj)
        self._put(idx)

    def memoize_global(self, g: Global) -> None:
        idx = self.memo_size
        self.memo_size += 1
        self.global_memo[g] = idx
        self._put(idx)

    def _put(self, idx: int) -> None:
        if self.proto >= 4:
            self.buf += _MEMOIZE
        elif idx < 256:
            self.buf += _BINPUT + bytes((idx,))
        else:
            self.buf += _LONG_BINPUT + struct.pack("<I", idx)

    def _get(self, idx: int) -> None:
        if idx < 256:
            self.buf += _BINGET + bytes((idx,))
        else:
            self.buf += _LONG_BINGET + struct.pack("<I", idx)

    # -- dispatch ------------------------------------------------------------
    def save(self, obj: Any) -> None:
        t = type(obj)
        # the most frequent types first: a big .metadata is ~10^6 calls
        if t is int:
            self._save_int(obj)
        elif obj is None:
            self.buf += _NONE
        elif t is bool:
            self.buf += _NEWTRUE if obj else _NEWFALSE
        elif t is float:
            self.buf += _BINFLOAT + struct.pack(">d", obj)
        elif t is Global:
            idx = self.global_memo.get(obj)
            if idx is not None:
                self._get(idx)
            else:
                self._save_global(obj)
        else:
            seen = self.memo.get(id(obj))
            if seen is not None:
                self._get(seen[0])
                return
            if t is str:
                self._save_str(obj)
            elif t is tuple:
                self._save_tuple(obj)
            elif t is dict:
                self.buf += _EMPTY_DICT
                self.memoize(obj)
                self._save_dict_items(obj)
            elif t is Reduce:
                self.save(obj.func)
                self.save(obj.args if type(obj.args) is tuple else tuple(obj.args))
                self.buf += _REDUCE
                self.memoize(obj)
                if obj.items:
                    self._save_dict_iter(obj.items)
                if obj.state is not None:
                    self.save(obj.state)
                    self.buf += _BUILD
            elif t is Obj:
                self.save(obj.cls)
                self.buf += _EMPTY_TUPLE + _NEWOBJ
                self.memoize(obj)
                if obj.state is not None:
                    self.save(obj.state)
                    self.buf += _BUILD
            elif t is list:
                self.buf += _EMPTY_LIST
                self.memoize(obj)
                self._save_list_items(obj)
            elif t is bytes:
                self._save_bytes(obj)
            elif t is PersistentId:
                self.save(obj.value)
                self.buf += _BINPERSID
            else:
                raise PickleWriteError(f"cannot pickle a {t.__name__} value")
        # CPython commits a full frame at the end of each save()
        if self.framing and len(self.buf) >= _FRAME_SIZE_TARGET:
            self.commit_frame()

    def _save_int(self, value: int) -> None:
        if 0 <= value <= 0xFF:
            self.buf += _BININT1 + bytes((value,))
        elif 0 <= value <= 0xFFFF:
            self.buf += _BININT2 + struct.pack("<H", value)
        elif -0x80000000 <= value <= 0x7FFFFFFF:
            self.buf += _BININT + struct.pack("<i", value)
        else:
            data = _encode_long(value)
            if len(data) < 256:
                self.buf += _LONG1 + bytes((len(data),)) + data
            else:
                self.buf += _LONG4 + struct.pack("<i", len(data)) + data

    def _save_str(self, value: str) -> None:
        data = value.encode("utf-8", "surrogatepass")
        n = len(data)
        if n <= 0xFF and self.proto >= 4:
            self._write_payload(_SHORT_BINUNICODE + bytes((n,)), data)
        elif n > 0xFFFFFFFF and self.proto >= 4:
            self._write_payload(_BINUNICODE8 + struct.pack("<Q", n), data)
        else:
            self._write_payload(_BINUNICODE + struct.pack("<I", n), data)
        self.memoize(value)

    def _save_bytes(self, value: bytes) -> None:
        if self.proto < 3:
            # protocol 2 has no bytes opcodes: CPython writes _codecs.encode(latin-1 text)
            if not value:
                self._save_reduce_of(value, Global("__builtin__", "bytes"), ())
            else:
                self._save_reduce_of(value, Global("_codecs", "encode"), (value.decode("latin-1"), "latin1"))
            return
        n = len(value)
        if n <= 0xFF:
            self._write_payload(_SHORT_BINBYTES + bytes((n,)), value)
        elif n > 0xFFFFFFFF:
            self._write_payload(_BINBYTES8 + struct.pack("<Q", n), value)
        else:
            self._write_payload(_BINBYTES + struct.pack("<I", n), value)
        self.memoize(value)

    def _write_payload(self, header: bytes, data: bytes) -> None:
        if self.framing and len(data) >= _FRAME_SIZE_TARGET:
            # a payload this big is written outside any frame
            self.commit_frame(force=True)
            self.out += header
            self.out += data
        else:
            self.buf += header
            self.buf += data

    def _save_reduce_of(self, obj: Any, func: Global, args: tuple[Any, ...]) -> None:
        self.save(func)
        self.save(args)
        self.buf += _REDUCE
        self.memoize(obj)

    def _save_global(self, g: Global) -> None:
        if self.proto >= 4:
            self.save(g.module)
            self.save(g.name)
            self.buf += _STACK_GLOBAL
        else:
            self.buf += _GLOBAL + g.module.encode("utf-8") + b"\n" + g.name.encode("utf-8") + b"\n"
        self.memoize_global(g)

    def _save_tuple(self, value: tuple[Any, ...]) -> None:
        n = len(value)
        if n == 0:
            self.buf += _EMPTY_TUPLE  # the empty tuple is not memoised
            return
        if n <= 3:
            for item in value:
                self.save(item)
            self.buf += (_TUPLE1, _TUPLE2, _TUPLE3)[n - 1]
        else:
            self.buf += _MARK
            for item in value:
                self.save(item)
            self.buf += _TUPLE
        self.memoize(value)

    # CPython's C pickler (which torch uses) batches a little differently from
    # pickle.py: one-item containers use APPEND/SETITEM, everything else goes
    # in MARK ... APPENDS/SETITEMS batches, and a dict whose last batch was
    # full gets one more, empty, batch.
    def _save_list_items(self, items: list[Any]) -> None:
        if len(items) == 1:
            self.save(items[0])
            self.buf += _APPEND
            return
        for start in range(0, len(items), _BATCHSIZE):
            self.buf += _MARK
            for item in items[start : start + _BATCHSIZE]:
                self.save(item)
            self.buf += _APPENDS

    def _save_dict_items(self, d: dict[Any, Any]) -> None:
        if not d:
            return
        items = list(d.items())
        if len(items) == 1:
            self.save(items[0][0])
            self.save(items[0][1])
            self.buf += _SETITEM
            return
        start = 0
        while True:
            batch = items[start : start + _BATCHSIZE]
            self.buf += _MARK
            for key, value in batch:
                self.save(key)
                self.save(value)
            self.buf += _SETITEMS
            start += _BATCHSIZE
            if len(batch) < _BATCHSIZE:
                break

    def _save_dict_iter(self, items: list[tuple[Any, Any]]) -> None:
        """Key-value pairs from an iterator (`__reduce__`'s dictitems, an OrderedDict's): the C
        pickler's batch_dict, which writes a batch's lone item with SETITEM and no empty batch."""
        for start in range(0, len(items), _BATCHSIZE):
            batch = items[start : start + _BATCHSIZE]
            if len(batch) == 1:
                self.save(batch[0][0])
                self.save(batch[0][1])
                self.buf += _SETITEM
                break
            self.buf += _MARK
            for key, value in batch:
                self.save(key)
                self.save(value)
            self.buf += _SETITEMS


def _encode_long(value: int) -> bytes:
    """Two's-complement little-endian, as pickle.encode_long."""
    if value == 0:
        return b""
    nbytes = (value.bit_length() >> 3) + 1
    data = value.to_bytes(nbytes, byteorder="little", signed=True)
    if value < 0 and nbytes > 1 and data[-1] == 0xFF and (data[-2] & 0x80) != 0:
        data = data[:-1]
    return data


def dumps(obj: Any, protocol: int) -> bytes:
    """The pickle of `obj` (plain values plus Global/Reduce/Obj/PersistentId) at `protocol` (2 or 4)."""
    em = _Emitter(protocol)
    em.out += _PROTO + bytes((protocol,))
    try:
        em.save(obj)
    except RecursionError:
        raise PickleWriteError("value nested too deeply to pickle") from None
    em.buf += _STOP
    if em.framing:
        em.commit_frame(force=True)
    else:
        em.out += em.buf
    return bytes(em.out)

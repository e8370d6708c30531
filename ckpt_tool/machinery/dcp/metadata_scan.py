"""A DCP `.metadata` read without the C unpickler, for the pickles torch writes (issue 46).

The allow-list unpickler (torch_save/safe_pickle.py) reads any `.metadata` safely, but a large
one pays three times for each of its 10^4-10^5 tensors: pickle_scan's proof and the memory bound
over every byte, the C unpickler calling a Python stand-in (`Record.__setstate__`,
`Size.__new__`) for each object, and the reader's parse of those records. Here one pass does the
three for the pickles torch's DCP writes: the records that repeat once per tensor (a
state_dict_metadata entry, of one chunk or of a sharded save's several; a storage_data entry;
a planner_data path; their strings references or, as each rank's plan writes them, new) are
each matched whole by one regular expression, in C (a tensor entry whose bytes after its key
are a matched one's again: compared with them), and turned straight into the values the
reader keeps; every other opcode is run by a small interpreter of the opcodes torch's pickler
writes, through the same allow-list and stand-ins (safe_pickle.ALLOWED) as the unpickler.
Where the interpreter has built _GIVE_UP_AFTER more records of a kind than the patterns
matched, the layout is not one they know: the unpickler reads it sooner.

It is an accelerator, never a second opinion: `scan` returns None for anything outside what it
knows (another opcode, a global the allow-list refuses, a record shape it does not match, a
reference to something it did not keep, a problem of any kind), and the reader then takes the
unpickler's path as before, which gives the result or the error it always gave. What it
returns is what that path would have built, record for record, except that the per-tensor
records are _ScannedTensor, _ScannedShards and _ScannedIndex values the reader's fast parse takes as it takes
the records they stand for (tests/machinery/dcp/test_metadata_scan.py checks both paths
agree, on every DCP fixture and on damaged copies).

Why it is safe and bounded:
  * nothing is resolved but through safe_pickle.ALLOWED (and a format's `extra`), as the
    unpickler's find_class does; nothing is called but what those resolve to, as the
    unpickler would call it (REDUCE, NEWOBJ, BUILD);
  * it allocates for what the bytes hold, never for what they claim: no memo index is
    written (BINPUT, LONG_BINPUT, PUT are outside its opcodes), a length is read only over
    bytes that are there, and every byte it reads is charged against the memory limit of
    the pickle budget (memory_limit()) as it goes: an opcode at safe_pickle's dearest cost for
    it (_FAST_COST, pickle_scan's bound), a matched record's constant parts at 64 bytes a
    byte where first seen (what they build: about 10), each matched record what it makes
    (_RECORD_BASE, its key's text, a slot a memo entry), the stand-ins' own charges against
    the same limit; past it, None (and the unpickler's path refuses it as before);
  * the stack, the MARK nesting and the opcodes it interprets one by one are bounded
    (safe_pickle's limits, and an opcode count past which the C path is cheaper anyway).
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from ..torch_save import safe_pickle
from ..torch_save.safe_pickle import (
    ALLOWED,
    ChunkStorageMetadata,
    MetadataIndex,
    Size,
    StorageInfo,
    TensorProperties,
    TensorStorageMetadata,
    TorchDType,
    memory_limit,
)


class _ScannedTensor(tuple):
    """A TensorStorageMetadata of one chunk at offset 0 holding the whole tensor, as matched:
    (torch dtype name, shape, offsets, sizes, requires_grad, layout, memory format). Its fields
    are checked by the reader's fast parse as the record's are."""

    __slots__ = ()


class _ScannedShards(tuple):
    """A TensorStorageMetadata of several chunks (a sharded save's: one a shard), as matched:
    (torch dtype name, shape, ((offsets, sizes), ...) in the list's order, requires_grad, layout,
    memory format). Its fields are checked by the reader's fast parse as the record's are."""

    __slots__ = ()


class _ScannedIndex(tuple):
    """A storage_data key (MetadataIndex) as matched: (fqn, offset, index hint). Hashed and
    compared by identity, as MetadataIndex is (two equal keys stay two dict entries)."""

    __slots__ = ()
    __hash__ = object.__hash__
    __eq__ = object.__eq__  # type: ignore[assignment]
    __ne__ = object.__ne__  # type: ignore[assignment]


class _ScannedInfo(tuple):
    """A storage_data value (_StorageInfo without transforms) as matched: (relative_path, offset, length)."""

    __slots__ = ()


class _Gone:
    """A memo entry not kept (inside a matched record: torch never refers back to one)."""

    __slots__ = ()


_GONE = _Gone()
_GONES = [(_GONE,) * n for n in range(32)]

# what the look-up of a matched record's constant parts may cost, per byte of them (it builds
# ~10: tuples, a record; and keeps the bytes as the key of what they say), once for records alike
_RECORD_COST = 64
# what each matched record costs beyond: its key or fqn on the stack, the values it becomes
# (a _ScannedIndex and _ScannedInfo, their ints), the dict entry they make; its key's text at
# safe_pickle's _PER_BYTE, and each memo entry it makes a slot
_RECORD_BASE = 512
_SLOT = 8
# records of a kind (a tensor entry, a storage entry) the interpreter may build beyond those the
# patterns matched, before it hands the pickle to the unpickler: torch's own pickles need a few
# (the first of each dtype or data file, one a frame splits every 64 KiB); a layout the patterns
# do not know needs as many as it has records, which the C unpickler reads faster
_GIVE_UP_AFTER = 32
# opcodes run one by one, beyond which the C unpickler is the cheaper way (a pickle whose records
# the patterns do not match): a little more than the unmatched records of a torch .metadata need
_INTERPRETED_BASE = 20_000
_INTERPRETED_PER_BYTE = 1 / 64

# tensor entries compared with those matched before, before the pattern runs: the first this many
# distinct ones (a model's tensors take a few: a kind of layer's weights, biases, norms)
_KNOWN_BODIES = 16

_REF = rb"(?:h.|j....)"
_INT = rb"(?:K.|M..|J....)"
_LONG = rb"(?:K.|M..|J....|\x8a(?:\x00|\x01.|\x02..|\x03...|\x04....|\x05.{5}|\x06.{6}|\x07.{7}|\x08.{8}))"
# a tuple of ints: (), 1-3 of them (TUPLE1-3: as many as it takes) or more after a MARK (TUPLE); all but () memoized
_INTS = (rb"(?:\)|(?:" + _INT + rb"\x85|" + _INT + rb"{2}\x86|" + _INT + rb"{3}\x87)\x94|\(" + _INT
         + rb"{4,64}t\x94)")

# a state_dict_metadata entry: key, TensorStorageMetadata(properties=TensorProperties(...),
# size=Size(...), chunks=[ChunkStorageMetadata(offsets=Size(...), sizes=Size(...)), ...])
_HEAD = (_REF + rb"\)\x81\x94\}\x94\(" + _REF + _REF + rb"\)\x81\x94\(" + _REF + _REF + rb"[\x88\x89]" + _REF
         + rb"[\x88\x89]t\x94b" + _REF + _REF)  # class, 'properties', properties, 'size', Size
# one ChunkStorageMetadata: class, its state {'offsets': Size(...), 'sizes': Size(...)}
_CHUNK = (_REF + rb"\)\x81\x94\}\x94\(" + _REF + _REF + _INTS + rb"\x85\x94R\x94" + _REF + _REF + _INTS
          + rb"\x85\x94R\x94ub")
# the most chunks a tensor's list is matched with: pickle writes a list in batches of 1000 (one
# MARK ... APPENDS each), and torch one chunk a shard (a longer list is the interpreter's)
_MAX_CHUNKS = 1000


def _tensor_parts(capture: bytes) -> bytes:
    """A tensor entry after its key, up to its state's SETITEMS: its parts as groups (`capture`
    b"("), or as one span (b"(?:"): the head, the size, 'chunks', and its list: one chunk then
    APPEND, or 2-1000 of them between MARK and APPENDS."""
    o = capture
    return (
        o + _HEAD + rb")"
        + o + _INTS + rb")"  # size
        + rb"\x85\x94R\x94" + o + _REF + rb")\]\x94"  # 'chunks', the list
        + rb"(?:" + o + _CHUNK + rb")a|\(" + o + rb"(?:" + _CHUNK + rb"){2," + str(_MAX_CHUNKS).encode() + rb"})e)"
    )


_TENSOR = re.compile(
    # 1, 2: the key's length; 3: its bytes, checked against the length (bounded: a failed match
    # would otherwise try every \x94 to the end of the data); 4: the rest, as one span (tensors
    # alike in dtype, geometry and sharding have the same bytes there: one look-up says what they hold)
    rb"(?:\x8c(.)|X(....))(.{1,4096}?)\x94(" + _tensor_parts(b"(?:") + rb")ub",
    re.DOTALL,
)
# the same span with its parts picked out
_TENSOR_BODY = re.compile(_tensor_parts(b"("), re.DOTALL)
# the constant part of a tensor entry (its first part), its references picked out
_TENSOR_HEAD = re.compile(
    rb"(" + _REF + rb")\)\x81\x94\}\x94\((" + _REF + rb")(" + _REF + rb")\)\x81\x94\((" + _REF + rb")("
    + _REF + rb")([\x88\x89])(" + _REF + rb")[\x88\x89]t\x94b(" + _REF + rb")(" + _REF + rb")",
    re.DOTALL,
)
# one chunk, its parts picked out
_CHUNK_PARTS = re.compile(
    rb"(" + _REF + rb")\)\x81\x94\}\x94\((" + _REF + rb")(" + _REF + rb")(" + _INTS + rb")\x85\x94R\x94("
    + _REF + rb")(" + _REF + rb")(" + _INTS + rb")\x85\x94R\x94ub",
    re.DOTALL,
)

# a storage_data entry: MetadataIndex(fqn=..., index=..., offset=Size(...)): _StorageInfo(relative_path=...,
# offset=..., length=...)
def _stored_parts(capture: bool) -> bytes:
    """A storage entry between its fqn and its offset: its parts as groups (`capture`), or as one span."""
    o = b"(" if capture else b"(?:"
    return (
        o + _REF + rb")" + o + _INT + rb"|N)"  # 'index', the index hint
        + o + _REF + _REF + rb")"  # 'offset', Size
        + o + _INTS + rb")"  # offset
        + o + rb"\x85\x94R\x94ub" + _REF + rb"\)\x81\x94\}\x94\(" + _REF + _REF + _REF + rb")"  # _StorageInfo, path, 'offset'
    )


_STORED = re.compile(
    rb"(" + _REF + rb"\)\x81\x94\}\x94\(" + _REF + rb")"  # 1: MetadataIndex, 'fqn'
    # 2: the fqn, a reference (to the state_dict_metadata key: one rank's save); or 3, 4: a new
    # string's length and 5: its bytes (a save of several ranks: each rank's plan has its own
    # strings), checked against the length, as a tensor entry's key is
    rb"(?:(" + _REF + rb")|(?:\x8c(.)|X(....))(.{0,4096}?)\x94)"
    rb"(" + _stored_parts(False) + rb")"  # 6: the index hint, the offset, the data file (one span: one look-up)
    rb"(" + _LONG + rb")"  # 7: offset
    rb"(" + _REF + rb")"  # 8: 'length'
    rb"(" + _LONG + rb")"  # 9: length
    rb"ub",
    re.DOTALL,
)
_STORED_MID = re.compile(_stored_parts(True), re.DOTALL)
_STORED_HEAD = re.compile(rb"(" + _REF + rb")\)\x81\x94\}\x94\((" + _REF + rb")", re.DOTALL)
_STORED_INFO = re.compile(
    rb"\x85\x94R\x94ub(" + _REF + rb")\)\x81\x94\}\x94\((" + _REF + rb")(" + _REF + rb")(" + _REF + rb")",
    re.DOTALL,
)

# a planner_data entry: fqn -> a tuple of keys, each a memoized string or a new one (its bytes
# without \x94: the length byte is checked, and the pattern never splits a string it admits), or
# an int (a list's index, or an int key of the state dict: an optimizer's state by param id)
_FQN = rb"(?:h.|j....|\x8c.[^\x94]*\x94)"  # (a new one: a save of several ranks, as a storage entry's)
_KEY = rb"(?:h.|j....|\x8c.[^\x94]*\x94|K.|M..|J....)"
_PATH = re.compile(
    rb"(" + _FQN + rb")(?:(" + _KEY + rb"{1,3})([\x85\x86\x87])|\((" + _KEY + rb"{4,64})t)\x94", re.DOTALL)
_PATH_TOKEN = re.compile(rb"h.|j....|\x8c.[^\x94]*\x94|K.|M..|J....", re.DOTALL)

_MARK = object()


def _ref(ref: bytes, memo: list[Any]) -> Any:
    """The memo entry a BINGET/LONG_BINGET names (IndexError past the memo's end)."""
    return memo[ref[1] if len(ref) == 2 else int.from_bytes(ref[1:], "little")]


def _int(arg: bytes) -> int:
    op = arg[0]
    if op == 0x4B:  # BININT1
        return arg[1]
    if op == 0x4D:  # BININT2
        return int.from_bytes(arg[1:3], "little")
    if op == 0x4A:  # BININT
        return int.from_bytes(arg[1:5], "little", signed=True)
    return int.from_bytes(arg[2:], "little", signed=True)  # LONG1


def _ints(span: bytes) -> tuple[tuple[int, ...], tuple[_Gone, ...]] | None:
    """A matched tuple of ints, and the memo entries a storage entry makes around it (6, and one
    more where the tuple is memoized: all but ()); None where one is negative (a BININT can be:
    the record is the interpreter's, and the reader's parse refuses it there)."""
    if span == b")":
        return (), _GONES[6]
    body = span[1:-2] if span[0] == 0x28 else span[:-2]
    values = []
    i = 0
    while i < len(body):
        width = {0x4B: 2, 0x4D: 3, 0x4A: 5}[body[i]]
        values.append(_int(body[i:i + width]))
        i += width
    if min(values) < 0:
        return None
    return tuple(values), _GONES[7]


def _int_tuple(span: bytes) -> tuple[int, ...] | None:
    """A matched tuple of ints (None where one is negative)."""
    got = _ints(span)
    return None if got is None else got[0]


def scan(data: bytes, extra: Mapping[tuple[str, str], Any] | None = None) -> Any:
    """The object safe_pickle.load_metadata(data) would return, its per-tensor records as
    _ScannedTensor / _ScannedIndex; None when anything is outside what this reads (the caller
    then takes load_metadata's path). Never raises for the data's sake."""
    allowance = safe_pickle._Allowance.local
    outer = getattr(allowance, "left", None), getattr(allowance, "limit", None)
    try:
        return _scan(data, extra or {}, memory_limit())
    except Exception:  # noqa: BLE001 - whatever the data makes trip here, the unpickler's path says
        return None
    finally:
        allowance.left, allowance.limit = outer


def _scan(data: bytes, extra: Mapping[tuple[str, str], Any], limit: int) -> Any:  # noqa: C901 - one loop, on purpose
    n = len(data)
    cost = 2 * n  # the data, and what the reader keeps of it while this runs
    if cost > limit or n < 2 or data[0] != 0x80 or not 2 <= data[1] <= 5:
        return None
    allowance = safe_pickle._Allowance.local
    allowance.limit = limit
    fast_cost = safe_pickle._FAST_COST
    per_byte = safe_pickle._PER_BYTE
    max_depth, max_nesting = safe_pickle.MAX_STACK_DEPTH, safe_pickle.MAX_NESTING
    interpreted_left = _INTERPRETED_BASE + int(n * _INTERPRETED_PER_BYTE)
    tensor_match, stored_match, path_match = _TENSOR.match, _STORED.match, _PATH.match
    stack: list[Any] = []
    marks: list[int] = []
    memo: list[Any] = []
    # the constant parts of a record -> what they say (None: not what torch writes)
    bodies: dict[bytes, Any] = {}  # a tensor entry after its key -> (its _ScannedTensor, its memo entries)
    # the first _KNOWN_BODIES of them the patterns matched and that name what torch writes, with
    # what they say: the entries of tensors alike after the first are these bytes again
    known_bodies: list[tuple[bytes, int, Any]] = []
    stored_sigs: dict[tuple[bytes, ...], Any] = {}
    path_tokens = _PATH_TOKEN.findall
    token_values: dict[bytes, Any] = {}  # a planner path's reference or int -> its value
    # records of each kind matched, and built by the interpreter (the give-up rule: _GIVE_UP_AFTER)
    matched_tensors = matched_stored = built_tensors = built_stored = 0
    pos = 2
    # where the current frame ends: the C unpickler reads a frame into a buffer, and a read that
    # runs past its end takes its bytes from after the frame, leaving the frame's last ones unread
    # (torch never writes one): a read across it is left to the unpickler
    frame_end = 0
    while True:
        if cost > limit or len(stack) > max_depth:
            return None
        op = data[pos]
        # -- the records that repeat once per tensor, each matched whole ---------------------
        planner = False
        if op == 0x8C or op == 0x58:  # SHORT_BINUNICODE / BINUNICODE: maybe a tensor entry's key, or a planner path
            planner = True  # (unless a tensor entry is read here)
            while True:
                if op == 0x8C and known_bodies:
                    # a tensor entry like one matched before: its key by its length byte, then the
                    # same bytes as a known entry's rest and SETITEMS BUILD (a comparison each, no
                    # pattern run and no groups made). The opcodes from the key on are those the
                    # pattern matched there: the entry is what it was there
                    key_size = data[pos + 1]
                    body_at = pos + 3 + key_size
                    end = 0
                    if key_size and body_at < n and data[body_at - 1] == 0x94:
                        for body, size, known in known_bodies:
                            if data.startswith(body, body_at) and data[body_at + size:body_at + size + 2] == b"ub":
                                end = body_at + size + 2
                                break
                    if end and not pos < frame_end < end:
                        tensor_key = data[pos + 2:body_at - 1].decode("utf-8", "surrogatepass")
                        cost += _RECORD_BASE + per_byte * key_size + _SLOT * len(known[1])
                        matched_tensors += 1
                        stack.append(tensor_key)
                        stack.append(known[0])
                        memo.append(tensor_key)
                        memo += known[1]
                        planner = False
                        pos = end
                        op = data[pos]
                        continue
                if op != 0x8C and op != 0x58:
                    break
                m = tensor_match(data, pos)
                if m is None:
                    break
                planner = False
                short, long, key_bytes, body = m.groups()
                if len(key_bytes) != (short[0] if short is not None else int.from_bytes(long, "little")):
                    break
                known = bodies.get(body, False)
                if known is False:
                    known = bodies[body] = _tensor_body(body, memo)
                    cost += _RECORD_COST * len(body)
                    if known is not None and len(known_bodies) < _KNOWN_BODIES:
                        known_bodies.append((body, len(body), known))
                if known is None:
                    break
                end = m.end()
                if pos < frame_end < end:
                    break
                key = key_bytes.decode("utf-8", "surrogatepass")
                cost += _RECORD_BASE + per_byte * len(key_bytes) + _SLOT * len(known[1])
                matched_tensors += 1
                stack.append(key)
                stack.append(known[0])  # (one object for tensors alike: nothing refers back into it)
                memo.append(key)
                memo += known[1]
                pos = end
                op = data[pos]
        elif op == 0x68 or op == 0x6A:  # BINGET / LONG_BINGET: maybe a storage_data entry or a planner path
            m = stored_match(data, pos)
            planner = m is None
            while m is not None:
                head, fqn_ref, short, long, fqn_bytes, mid, start, length_key, length = m.groups()
                # a new fqn string of another length: the match ran past it into the next records
                # (checked first: the look-up below must see this record's bytes only)
                if fqn_ref is None and len(fqn_bytes) != (short[0] if short is not None
                                                          else int.from_bytes(long, "little")):
                    break
                known = stored_sigs.get((head, mid, length_key), False)
                if known is False:
                    known = stored_sigs[(head, mid, length_key)] = _stored_sig(head, mid, length_key, memo)
                    cost += _RECORD_COST * (len(head) + len(mid) + len(length_key))
                if known is None:
                    break
                end = m.end()
                if pos < frame_end < end:
                    break
                if fqn_ref is not None:
                    fqn = memo[fqn_ref[1] if len(fqn_ref) == 2 else int.from_bytes(fqn_ref[1:], "little")]
                    if type(fqn) is not str:
                        break
                    memo += known[3]
                else:
                    fqn = fqn_bytes.decode("utf-8", "surrogatepass")
                    # (memoized after the MetadataIndex and its state dict: the entry's memo in its order)
                    memo += known[3][:2]
                    memo.append(fqn)
                    memo += known[3][2:]
                    cost += per_byte * len(fqn_bytes)
                cost += _RECORD_BASE + _SLOT * len(known[3])
                matched_stored += 1
                stack.append(_ScannedIndex((fqn, known[1], known[2])))
                # (BININT1 and BININT2 read here: the offsets and lengths of a data file of < 64 KiB entries)
                stack.append(_ScannedInfo((
                    known[0],
                    start[1] if len(start) == 2 else start[1] | start[2] << 8 if start[0] == 0x4D else _int(start),
                    length[1] if len(length) == 2 else length[1] | length[2] << 8 if length[0] == 0x4D else _int(length),
                )))
                pos = end
                m = stored_match(data, pos)
        if planner:
            m = path_match(data, pos)
            while m is not None:
                end = m.end()
                if pos < frame_end < end:
                    break
                fqn_part, short, arity, long = m.groups()
                kept = len(memo)
                keys = []  # the fqn, then the path's keys
                for token in path_tokens(fqn_part + (short if short is not None else long)):
                    # a reference to an entry from before this record, or an int: what it stands for
                    # never changes (the paths of a model's tensors name its few keys again and again)
                    value = token_values.get(token, _MARK)
                    if value is _MARK:
                        first = token[0]
                        if first == 0x8C:  # a new string, memoized
                            if len(token) != token[1] + 3:
                                break
                            value = token[2:-1].decode("utf-8", "surrogatepass")
                            memo.append(value)
                            keys.append(value)
                            continue
                        if first == 0x68 or first == 0x6A:
                            at = token[1] if first == 0x68 else int.from_bytes(token[1:], "little")
                            value = memo[at]
                            if type(value) is _Gone:
                                return None
                            if at < kept:  # (one made in this record goes if the record is given up)
                                token_values[token] = value
                        else:
                            value = token_values[token] = _int(token)  # (an int is not memoized)
                    keys.append(value)
                else:
                    if short is None or len(keys) == arity[0] - 0x83:
                        fqn = keys[0]
                        path_keys = tuple(keys[1:])
                        memo.append(path_keys)
                        cost += _RECORD_COST * (end - pos)
                        stack.append(fqn)
                        stack.append(path_keys)
                        pos = end
                        m = path_match(data, pos)
                        continue
                del memo[kept:]  # (the entry is left to the interpreter, as if never matched)
                break
        op = data[pos]
        # -- one opcode, as the C unpickler runs it (or None where it would fail, or might) ------
        interpreted_left -= 1
        if interpreted_left < 0:
            return None
        cost += fast_cost[op]
        pos += 1
        # what an opcode may pop: the values above the innermost MARK (the C unpickler's fence)
        above = len(stack) - (marks[-1] if marks else 0)
        if op == 0x94:  # MEMOIZE
            if above < 1:
                return None
            memo.append(stack[-1])
        elif op == 0x68 or op == 0x6A:  # BINGET / LONG_BINGET
            width = 1 if op == 0x68 else 4
            if pos + width > n or pos < frame_end < pos + width:
                return None
            value = memo[int.from_bytes(data[pos:pos + width], "little")]
            if type(value) is _Gone:
                return None
            stack.append(value)
            pos += width
        elif op == 0x8C or op == 0x58:  # SHORT_BINUNICODE / BINUNICODE
            width = 1 if op == 0x8C else 4
            length = int.from_bytes(data[pos:pos + width], "little")
            if pos < frame_end < pos + width:
                return None
            pos += width
            if pos + length > n or pos < frame_end < pos + length:
                return None
            stack.append(data[pos:pos + length].decode("utf-8", "surrogatepass"))
            cost += per_byte * length
            pos += length
        elif op == 0x28:  # MARK
            marks.append(len(stack))
            if len(marks) > max_nesting:
                return None
        elif op == 0x4B:  # BININT1
            stack.append(data[pos])
            pos += 1
        elif (op == 0x4D or op == 0x4A) and pos < frame_end < pos + (2 if op == 0x4D else 4):
            return None
        elif op == 0x4D:  # BININT2
            stack.append(int.from_bytes(data[pos:pos + 2], "little"))
            pos += 2
        elif op == 0x4A:  # BININT
            stack.append(int.from_bytes(data[pos:pos + 4], "little", signed=True))
            pos += 4
        elif op == 0x8A:  # LONG1
            length = data[pos]
            if length > 8 or pos + 1 < frame_end < pos + 1 + length:
                return None
            stack.append(int.from_bytes(data[pos + 1:pos + 1 + length], "little", signed=True))
            pos += 1 + length
        elif op == 0x29:  # EMPTY_TUPLE
            stack.append(())
        elif 0x85 <= op <= 0x87:  # TUPLE1-3
            size = op - 0x84
            if above < size:
                return None
            stack[-size:] = [tuple(stack[-size:])]
        elif op == 0x74:  # TUPLE
            mark = marks.pop()
            stack[mark:] = [tuple(stack[mark:])]
        elif op == 0x7D:  # EMPTY_DICT
            stack.append({})
        elif op == 0x5D:  # EMPTY_LIST
            stack.append([])
        elif op == 0x75 or op == 0x65:  # SETITEMS / APPENDS
            mark = marks.pop()
            items = stack[mark:]
            del stack[mark:]
            if mark - 1 < (marks[-1] if marks else 0):
                return None
            target = stack[-1]
            if op == 0x65:
                if type(target) is not list:
                    return None
                target.extend(items)
            else:
                if type(target) is not dict or len(items) % 2:
                    return None
                # in order, as the unpickler sets them (a batch of 1,000 entries in C, not a loop here)
                target.update(zip(items[::2], items[1::2]))
        elif op == 0x73:  # SETITEM
            if above < 3 or type(stack[-3]) is not dict:
                return None
            value = stack.pop()
            key = stack.pop()
            stack[-1][key] = value
        elif op == 0x61:  # APPEND
            if above < 2 or type(stack[-2]) is not list:
                return None
            value = stack.pop()
            stack[-1].append(value)
        elif op == 0x89:  # NEWFALSE
            stack.append(False)
        elif op == 0x88:  # NEWTRUE
            stack.append(True)
        elif op == 0x4E:  # NONE
            stack.append(None)
        elif op == 0x93:  # STACK_GLOBAL
            if above < 2:
                return None
            name = stack.pop()
            module = stack.pop()
            if type(module) is not str or type(name) is not str:
                return None
            key = (safe_pickle._PY2_MODULES.get(module, module), name)
            found = ALLOWED.get(key)
            if found is None:
                found = extra.get(key)
                if found is None:
                    return None
            stack.append(found)
        elif op == 0x81 or op == 0x52 or op == 0x62:  # NEWOBJ / REDUCE / BUILD: the stand-ins run
            if above < 2:
                return None
            allowance.left = limit - cost  # (they charge what they allocate beyond one object)
            if op == 0x62:  # BUILD
                state = stack.pop()
                setstate = getattr(stack[-1], "__setstate__", None)
                if setstate is None:
                    return None
                setstate(state)
            else:
                args = stack.pop()
                callable_ = stack[-1]
                if not isinstance(args, tuple):
                    return None
                if op == 0x81:
                    if not isinstance(callable_, type):
                        return None
                    if callable_ is TensorStorageMetadata:
                        built_tensors += 1
                        if built_tensors > _GIVE_UP_AFTER + matched_tensors:
                            return None
                    elif callable_ is MetadataIndex:
                        built_stored += 1
                        if built_stored > _GIVE_UP_AFTER + matched_stored:
                            return None
                    stack[-1] = callable_.__new__(callable_, *args)
                else:
                    stack[-1] = callable_(*args)
            cost = limit - allowance.left
        elif op == 0x95:  # FRAME: outside any other, the bytes it announces there
            if pos - 1 < frame_end:
                return None
            frame_end = pos + 8 + int.from_bytes(data[pos:pos + 8], "little")
            if frame_end > n:
                return None
            pos += 8
        elif op == 0x2E:  # STOP
            return stack.pop() if len(stack) == 1 and not marks else None
        else:
            return None


def _tensor_body(body: bytes, memo: list[Any]) -> tuple[Any, tuple[_Gone, ...]] | None:
    """What a tensor entry's bytes after its key hold, when they name what torch writes: the
    tensor (a _ScannedTensor where it has one chunk, else a _ScannedShards), and the memo entries
    they make; else None."""
    m = _TENSOR_BODY.fullmatch(body)
    if m is None:
        return None
    head, size, chunks_key, one, many = m.groups()
    said = _tensor_head(head, memo)
    shape = _int_tuple(size)
    if said is None or shape is None or not _is_str(chunks_key, "chunks", memo):
        return None
    # memo entries: 4 in the head, 2 after the size (its args, the Size), 1 the list; 6 a chunk;
    # and each tuple of ints but ()
    memoized = 7 + (size != b")")
    chunks = []
    span = one if one is not None else many
    at = 0
    while at < len(span):
        c = _CHUNK_PARTS.match(span, at)
        if c is None:
            return None
        cls, offsets_key, offsets_cls, offsets, sizes_key, sizes_cls, sizes = c.groups()
        try:
            parts = [_ref(r, memo) for r in (cls, offsets_key, offsets_cls, sizes_key, sizes_cls)]
        except IndexError:
            return None
        if (parts[0] is not ChunkStorageMetadata or type(parts[1]) is not str or parts[1] != "offsets"
                or parts[2] is not Size or type(parts[3]) is not str or parts[3] != "sizes" or parts[4] is not Size):
            return None
        offset_ints, size_ints = _int_tuple(offsets), _int_tuple(sizes)
        if offset_ints is None or size_ints is None:
            return None
        chunks.append((offset_ints, size_ints))
        memoized += 6 + (offsets != b")") + (sizes != b")")
        at = c.end()
    gones = (_GONE,) * memoized
    if one is not None:
        offsets_, sizes_ = chunks[0]
        return _ScannedTensor((said[0], shape, offsets_, sizes_, said[1], said[2], said[3])), gones
    return _ScannedShards((said[0], shape, tuple(chunks), said[1], said[2], said[3])), gones


def _is_str(ref: bytes, text: str, memo: list[Any]) -> bool:
    """Whether the memo entry `ref` names is the str `text`."""
    try:
        value = _ref(ref, memo)
    except IndexError:
        return False
    return type(value) is str and value == text


def _stored_sig(head: bytes, mid: bytes, length_key: bytes, memo: list[Any]) -> tuple[Any, ...] | None:
    """(data file, offset, index hint, the memo entries the entry makes) when a storage entry's
    parts but its fqn, offset and length name what torch writes, else None."""
    m = _STORED_MID.fullmatch(mid)
    if m is None:
        return None
    index_key, hint, offset_key, offset, info = m.groups()
    try:
        length = _ref(length_key, memo)
    except IndexError:
        return None
    if not (_stored_head(head, memo) and _stored_keys(index_key, offset_key, memo)) or type(length) is not str \
            or length != "length":
        return None
    path = _stored_info(info, memo)
    offset_ints = _ints(offset)
    if path is None or offset_ints is None:
        return None
    return path, offset_ints[0], None if hint == b"N" else _int(hint), offset_ints[1]


def _tensor_head(head: bytes, memo: list[Any]) -> tuple[str, bool, str, str] | None:
    """(torch dtype name, requires_grad, layout, memory format) when a tensor entry's constant part names what
    torch writes: TensorStorageMetadata, 'properties', TensorProperties with a torch dtype, a layout,
    a memory format (its 5-tuple state), 'size' and torch.Size; else None."""
    m = _TENSOR_HEAD.fullmatch(head)
    if m is None:
        return None
    cls, properties, props_cls, dtype, layout, grad, memory_format, size_key, size_cls = m.groups()
    try:
        values = [_ref(r, memo) for r in (cls, properties, props_cls, dtype, layout, memory_format, size_key, size_cls)]
    except IndexError:
        return None
    if (values[0] is not TensorStorageMetadata or values[1] != "properties" or values[2] is not TensorProperties
            or type(values[3]) is not TorchDType or type(values[4]) is not str or type(values[5]) is not str
            or values[6] != "size" or values[7] is not Size or type(values[1]) is not str or type(values[6]) is not str):
        return None
    return values[3].name, grad == b"\x88", values[4], values[5]


def _stored_head(head: bytes, memo: list[Any]) -> bool:
    m = _STORED_HEAD.fullmatch(head)
    if m is None:
        return False
    try:
        cls, fqn = (_ref(r, memo) for r in m.groups())
    except IndexError:
        return False
    return cls is MetadataIndex and type(fqn) is str and fqn == "fqn"


def _stored_keys(index_key: bytes, offset_key: bytes, memo: list[Any]) -> bool:
    first = 2 if offset_key[0] == 0x68 else 5  # ('offset' then torch.Size: two references)
    try:
        index = _ref(index_key, memo)
        offset, size_cls = _ref(offset_key[:first], memo), _ref(offset_key[first:], memo)
    except IndexError:
        return False
    return (type(index) is str and index == "index" and type(offset) is str and offset == "offset"
            and size_cls is Size)


def _stored_info(info: bytes, memo: list[Any]) -> str | None:
    """The data file a storage entry's constant part names (_StorageInfo, 'relative_path', the path,
    'offset'), else None."""
    m = _STORED_INFO.fullmatch(info)
    if m is None:
        return None
    try:
        cls, path_key, path, offset = (_ref(r, memo) for r in m.groups())
    except IndexError:
        return None
    if (cls is not StorageInfo or type(path_key) is not str or path_key != "relative_path"
            or type(path) is not str or not path or type(offset) is not str or offset != "offset"):
        return None
    return path

"""A C-speed proof that a pickle stays within safe_pickle's resource limits.

safe_pickle.check_limits walks a pickle's opcodes in Python before the C
unpickler runs (the unpickler allocates what the opcodes claim: a memo index,
a bytearray length). That walk costs ~0.1 us per byte: 0.5 s for the 6 MB
`.metadata` of 30,000 tensors, more than the unpickling itself. This module
decides the same question with one regular-expression match, which runs in
C: the pattern spells out a subset of the pickle language in which no limit
can be exceeded, and `within_limits` is True only when the whole stream up to
STOP is in that subset. When it is not (a protocol-0/2 pickle, a long string,
deep nesting, anything hostile) it says False and check_limits walks the
opcodes as before, so every verdict and every error is the walk's own.

Why a match proves each limit (safe_pickle's "Resource limits" section):
  * memo indices: LONG_BINPUT and PUT are not in the subset (torch's protocol-4
    pickles memoize with MEMOIZE, which takes no index; BINPUT's one-byte
    index is not a limit);
  * lengths: only opcodes with fixed-size arguments, strings whose one-byte
    length is at most 127 (the 128 alternatives below check that the bytes are
    there) and GLOBAL lines of at most 1,000 bytes; LONG4, BYTEARRAY8 and
    every other 4- or 8-byte length are not in the subset;
  * MARK nesting: the pattern nests at most MAX_LEVELS - 1 MARKs (a level per
    copy of the pattern), below safe_pickle.MAX_NESTING, and every MARK is
    closed by an opcode that pops to it;
  * stack depth: the pattern reads each MARK level as at most
    max_stack_depth / (MAX_LEVELS * _RUN) units, a unit being a run of at most
    _RUN one-byte opcodes, one opcode with an argument, or a MARK with its
    inner level and the opcode that pops to it; no opcode pushes more than one
    value and a closed MARK leaves at most one, so a level adds at most
    max_stack_depth / MAX_LEVELS values and the stack never holds more than
    max_stack_depth (a torch .metadata has about 6,000 units in its largest
    level: a SETITEMS batch of 1,000 entries);
  * objects: every opcode is at least one byte, so a pickle of at most
    MAX_OBJECTS bytes cannot make more (larger ones are walked);
  * FRAME: the frames are found by following their lengths from the start (the
    way the pickler lays them out), each checked to end inside the data, and
    their opcode byte is replaced by an invalid one (0xF1) in a copy that the
    pattern matches; a FRAME anywhere else keeps its byte, which the pattern
    does not admit. The replaced byte can only change how the copy splits into
    opcodes where it is the length of a short string, and 0xF1 (241) is longer
    than the pattern admits, so the copy splits exactly as the data does. A
    0xF1 that was in the data already is no opcode: the walk stops there and
    the unpickler refuses it, so admitting it proves no less.
  * memory: safe_pickle.fast_memory_bound prices each byte of such a stream
    at the dearest thing it can be; sets filled by opcodes (ADDITEMS,
    FROZENSET) cost more than it allows for, and are not in the subset.
A stream that ends at its STOP with anything after it is judged up to the
STOP, as the walk (and the unpickler) do.
"""
from __future__ import annotations

import pickletools
import re
import sys

# MARK levels the pattern spells out (the top level counts as one): torch's
# .metadata nests 4 MARKs deep, Megatron-Core's 7. Each level is one more
# copy of the pattern to compile (~1.5 ms each).
MAX_LEVELS = 10
_RUN = 4  # one-byte opcodes per unit
_FRAME_STAND_IN = 0xF1  # not an opcode (pickletools knows none above 0x98)
_MAX_SHORT = 127  # longest one-byte-length string the pattern admits
_MAX_LINE = 1000  # longest GLOBAL line the pattern admits

_PATTERNS: dict[int, re.Pattern[bytes]] = {}  # by the stack-depth limit it proves


def _opcode_classes() -> dict[str, bytes]:
    """Opcode bytes by what they do to the stack and what argument they take."""
    out: dict[str, bytearray] = {k: bytearray() for k in (
        "np", "push", "np1", "push1", "push2", "push4", "push8", "short", "popmark")}
    fixed = {"uint1": 1, "uint2": 2, "int4": 4, "uint4": 4, "float8": 8}
    for op in pickletools.opcodes:
        code = op.code.encode("latin-1")[0]
        before = [s.name for s in op.stack_before]
        if op.name in ("MARK", "STOP", "FRAME"):
            continue
        if "mark" in before:
            # TUPLE, LIST, DICT, APPENDS, SETITEMS, ... (INST has lines: left out; ADDITEMS and FROZENSET
            # too, which torch never writes: safe_pickle.fast_memory_bound prices a value's place in a
            # container at most a dict entry's, and a set's costs more)
            if op.arg is None and op.name not in ("ADDITEMS", "FROZENSET"):
                out["popmark"].append(code)
            continue
        # LONG_BINPUT and PUT name a memo index the unpickler sizes its memo by: never in the subset
        if op.name in ("LONG_BINPUT", "PUT"):
            continue
        delta = len(op.stack_after) - len(before)
        assert delta <= 1, op.name  # the depth bound counts one value per pushing opcode
        grows = delta > 0
        if op.arg is None:
            out["push" if grows else "np"].append(code)
        elif op.arg.name in fixed:
            size = fixed[op.arg.name]
            if grows:
                out[f"push{size}"].append(code)
            elif size == 1:  # BINPUT, PROTO
                out["np1"].append(code)
        elif op.arg.name in ("long1", "string1", "bytes1", "unicodestring1") and grows:
            out["short"].append(code)
        # everything else (4/8-byte lengths, text lines but GLOBAL's) is walked in Python
    return {k: bytes(v) for k, v in out.items()}


def _set(codes: bytes) -> bytes:
    return b"[" + b"".join(re.escape(bytes([c])) for c in codes) + b"]"


def _compile(max_stack_depth: int) -> re.Pattern[bytes]:
    c = _opcode_classes()
    pushes = max_stack_depth // (MAX_LEVELS * _RUN)  # units per level: see the module docstring
    short = b"(?:" + b"|".join(
        re.escape(bytes([k])) + (b".{%d}" % k if k else b"") for k in range(_MAX_SHORT + 1)) + b")"
    # one unit: a run of at most _RUN one-byte opcodes, or one opcode with an argument (at most one push)
    unit = (b"(?:" + _set(c["np"] + c["push"]) + b"{1,%d}+" % _RUN
            + b"|" + _set(c["push1"] + c["np1"]) + b"."
            + b"|" + _set(c["push4"]) + b".{4}"
            + b"|" + _set(c["short"]) + short
            + b"|" + _set(c["push2"]) + b".."
            + b"|" + _set(c["push8"] + bytes([_FRAME_STAND_IN])) + b".{8}"
            + b"|c[^\\n]{0,%d}\\n[^\\n]{0,%d}\\n" % (_MAX_LINE, _MAX_LINE))
    level = unit + b"){0,%d}+" % pushes
    for _ in range(MAX_LEVELS - 1):
        # a MARK, the next level, and the opcode that pops to the MARK: one unit (it leaves at most one value)
        level = unit + b"|\\(" + level + _set(c["popmark"]) + b"){0,%d}+" % pushes
    return re.compile(level + b"\\.", re.DOTALL)


def within_limits(data: bytes, max_stack_depth: int, max_objects: int) -> bool:
    """True when the pickle provably stays within the limits; False when undecided (walk it)."""
    n = len(data)
    if n > max_objects or sys.version_info < (3, 11):  # possessive quantifiers came in Python 3.11
        return False
    # the frames, followed from the start as the pickler lays them out
    pos = 2 if n >= 2 and data[0] == 0x80 else 0
    frames = []
    while pos < n and data[pos] == 0x95:
        end = pos + 9 + int.from_bytes(data[pos + 1:pos + 9], "little")
        if end > n:
            return False  # the walk names it
        frames.append(pos)
        pos = end
    scanned: bytes | bytearray = data
    if frames:
        copy = bytearray(data)
        for pos in frames:
            copy[pos] = _FRAME_STAND_IN
        scanned = copy
    pattern = _PATTERNS.get(max_stack_depth)
    if pattern is None:
        pattern = _PATTERNS[max_stack_depth] = _compile(max_stack_depth)
    return pattern.match(scanned) is not None

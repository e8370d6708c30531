"""Sizes given on the command line: --memory, --max-shard-size.

One reading for every option: KB/MB/GB/TB are decimal (10^3...), as
huggingface_hub reads a max shard size; KiB/MiB/GiB/TiB and the bare K/M/G/T
are binary (2^10...); a plain number is bytes.
"""
from __future__ import annotations

import re

from .errors import UsageError

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def parse_size(text: str | int, option: str, *, minimum: int = 1, examples: str = "512MiB, 2GiB, 5GB") -> int:
    """Bytes of a size written like '5GB', '512MiB', '2G' or '1000000'; `option` names it in errors."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise UsageError(f"{option}: {text!r} is not a size (e.g. {examples}, or a number of bytes)")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value < minimum:
        floor = f"{minimum // 2**20} MiB" if minimum >= 2**20 else f"{minimum} bytes"
        raise UsageError(f"{option} must be at least {floor}, got {text!r}")
    return value

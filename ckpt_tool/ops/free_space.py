"""Free space: an output larger than its local file system is refused before anything is
written, and one that filled it up while written is named in one line (what it needs, what is free).
"""
from __future__ import annotations

import math
import os

from ..base import dtypes
from .. import formats
from ..base.errors import NoSpaceError
from ..core.write_plan import WritePlan


def output_bytes(plan: WritePlan) -> int:
    """The bytes of the plan's arrays as stored uncompressed: what a writer that does not
    compress puts on disk, headers aside (a lower bound), and at most what one that does."""
    return sum(math.prod(t.shape) * dtypes.get(t.dtype).itemsize for t in plan.arrays())


def free_bytes(destination: str) -> int | None:
    """Bytes free for this process on the file system a local `destination` would be created on
    (that of its nearest existing ancestor); None for a remote one."""
    from ..storage import local_path

    path = local_path(destination)
    if path is None:
        return None
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize  # (as df's Avail: the blocks kept back for root not counted)


def check_free_space(destination: str, plan: WritePlan, fmt: str) -> None:
    """Refuse, before anything is written, an output larger than the free space of its local file
    system (a 1.5 KB torch.save of an expanded tensor is a TiB of output). A compressing writer's
    output may be smaller than its arrays: the write itself finds out."""
    info = formats.REGISTRY.get(fmt)
    if info is None or info.compresses:
        return
    need, free = output_bytes(plan), free_bytes(destination)
    if free is not None and need > free:
        raise NoSpaceError(f"not enough space: the output needs {size_text(need)}, {size_text(free)} free "
                           "(nothing was written)", destination)


def no_space_error(destination: str, plan: WritePlan, fmt: str) -> NoSpaceError:
    """The one line for a destination that filled up while written (the temporary output removed)."""
    info = formats.REGISTRY.get(fmt)
    compresses = info is not None and info.compresses
    data, free = output_bytes(plan), free_bytes(destination)
    need = f"up to {size_text(data)} (before compression)" if compresses else size_text(data)
    if free is None:
        return NoSpaceError(f"no space left on device: the output needs {need}", destination)
    if data <= free:  # what filled it was more than the arrays (a file per item, headers, metadata)
        return NoSpaceError(f"no space left on device: the output needs more than the {size_text(free)} free "
                            f"({size_text(data)} of array data{' before compression' if compresses else ''}, "
                            "and its files' headers and metadata)", destination)
    return NoSpaceError(f"no space left on device: the output needs {need}, {size_text(free)} free", destination)


def size_text(n: int) -> str:
    """1.2 GiB, 512.0 KiB, 100 bytes."""
    size = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n:,} bytes" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n:,} bytes"


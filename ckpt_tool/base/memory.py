"""The `--memory` budget: its default on this machine, and the size a user writes.

Apart from the scheduler (scheduler/admission.py enforces the budget) so that the command line's
option and the pickle budget read it without importing the scheduler, whose execution needs numpy:
`ckpt validate` of a checkpoint's metadata imports neither (issue 46).
"""
from __future__ import annotations

import os

from .parallel import copy_workers
from .sizes import parse_size

MiB = 2**20
DEFAULT_MEMORY = 512 * MiB
# the smallest budget accepted: below it the bands and windows alone would not fit
MIN_MEMORY = 4 * MiB
# the command line's default on many-core hosts: this much per copy worker, up to this (default_memory)
MEMORY_PER_WORKER = 128 * MiB
MAX_DEFAULT_MEMORY = 2048 * MiB


def default_memory(workers: int | None = None, machine: int | None = None) -> int:
    """--memory's default: 128 MiB per copy worker (parallel.copy_workers), at least 512 MiB (so 512
    MiB up to 4 workers, as on 2 cores), at most 2 GiB and an eighth of the machine's memory.

    The budget bounds the chunks in flight, never the checkpoint: a chunk of 64 MiB decoded whole
    counts 128 MiB (decoded_cost), so 512 MiB keeps about 4 of them in flight. On a 13-core TPU VM
    that left 5 to 8 of its 13 copy threads busy on a checkpoint of 44 MiB chunks; at 2 GiB all 13
    were, and an Orbax -> DCP convert took 3.74 s against 4.16 s (medians of 3, interleaved).
    `machine`: its memory in bytes (default: the cgroup's limit where lower than the RAM)."""
    if workers is None:
        workers = copy_workers()
    if machine is None:
        machine = machine_memory()
    wanted = min(MAX_DEFAULT_MEMORY, MEMORY_PER_WORKER * max(1, workers))
    if machine > 0:
        wanted = min(wanted, machine // 8)
    return max(DEFAULT_MEMORY, wanted)


def machine_memory() -> int:
    """The memory this process may use, in bytes: the RAM, or the cgroup's limit where lower;
    0 where neither can be read."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 0
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # v2, v1
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) > 0:
            return min(physical, int(text)) if physical > 0 else int(text)
    return physical


def parse_memory(text: str | int) -> int:
    """--memory: '512MiB', '2GiB', '512MB' (10^6), '1G' (2^30) or plain bytes."""
    return parse_size(text, "--memory", minimum=MIN_MEMORY, examples="512MiB, 2GiB, 512MB")

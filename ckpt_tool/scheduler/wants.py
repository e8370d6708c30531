"""What the scheduler's callers hand in (`Want`) and what a run reports (`ReadStats`).

These are the scheduler's interface with convert/reshard, `validate --deep`
and `diff --values`; planning, admission and execution all read them, so
they sit apart from each of the three.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..core.model import ArrayLeaf, Region
from .regions import _nbytes


@dataclass
class Want:
    """Regions a consumer needs, handed to `deliver` together once all are read.

    parts: (leaf, region) pairs (one for a writer or a check; two for a diff).
    deliver(arrays) returns a byte count (summed by run()). `keeps`: deliver
    keeps the arrays (a writer that holds chunks until committed): it is
    given arrays of its own, never views into a larger decoded chunk.
    order: units run in the order of the smallest order among the wants
    they feed (default: the wants' positions).
    """

    parts: list[tuple[ArrayLeaf, Region]]
    deliver: Callable[[list[np.ndarray]], int]
    keeps: bool = False
    order: int | None = None
    # bytes deliver holds beside the arrays while it runs (a diff's read of the other side)
    extra: int = 0

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(leaf, region) for leaf, region in self.parts)


@dataclass
class ReadStats:
    """What a run read: decodes per stored chunk (path, chunk index), and the budget's high mark."""

    decodes: Counter = field(default_factory=Counter)
    streamed: set = field(default_factory=set)
    passes: int = 0
    peak_bytes: int = 0
    budget: int = 0

    @property
    def chunks(self) -> int:
        return len(self.decodes)

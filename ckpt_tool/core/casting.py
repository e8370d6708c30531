"""What `convert --dtype` casts, and what it keeps as it is.

A cast is for the numbers a model computes with: floating weights, buffers and the optimizer's
floating state (Adam's exp_avg / exp_avg_sq, momentum buffers, fp32 master weights). It never
touches a leaf that counts or indexes:

- step counters: torch's optimizers keep each parameter's `step` as a float32 0-d tensor (Adam,
  AdamW, Adagrad, RMSprop, NAdam, RAdam, Adamax, ASGD, Adafactor), and DeepSpeed's and Megatron's
  optimizer states carry torch's; bfloat16 holds 8 significant bits, so step 10000 would read back
  as 9984 and Adam's bias correction would be wrong from then on. A leaf is a counter when its own
  key (the last one, or the last dotted part of it: a flat DCP key) is in COUNTER_KEYS and it holds
  one element, whatever its dtype; a 0-d weight under another name (CLIP's `logit_scale`) is cast;
- every leaf that is not floating (integer, bool: token ids, `num_batches_tracked`, RNG states);
- a complex leaf when the target is real, or a real one when it is complex (a cast across the
  two would drop the imaginary part, or invent one);
- a leaf already in the target dtype (nothing to do).

The decision reads only the leaf's keys, element count and dtype: it is the same for every
format's reader, and no format is named here.

A cast can overflow: a float32 weight of 1e5 is inf in float16, and NaN in float8_e4m3fn, which has
no inf. numpy says so with a RuntimeWarning pointing into ckpt (ml_dtypes' float8 and bfloat16 say
nothing at all); an inf or NaN weight is a broken model. cast_array counts the finite values that
did not stay finite, Overflow gathers them per leaf, and convert refuses the output unless
--allow-overflow is given.
"""
from __future__ import annotations

import threading
from typing import Iterable

import numpy as np

from ..base import dtypes
from ..base.errors import CkptError
from .model import Key

# the key under which an optimizer keeps its step count: torch.optim's per-parameter state and
# param groups (DeepSpeed and Megatron save torch's); optax names its counters `count`, but keeps
# them as int32, which no cast touches
COUNTER_KEYS = frozenset({"step"})

# why a leaf was not cast (the JSON summary's `kept[].reason`)
COUNTER = "step-counter"
NOT_FLOATING = "not-floating"
OTHER_KIND = "other-kind"  # complex to a real target, or real to a complex one
SAME_DTYPE = "same-dtype"
REASONS = (COUNTER, NOT_FLOATING, OTHER_KIND, SAME_DTYPE)


def is_counter(keys: tuple[Key, ...], size: int) -> bool:
    """A step counter: one element under a counter's key."""
    if size != 1 or not keys or not isinstance(keys[-1], str):
        return False
    return keys[-1].rsplit(".", 1)[-1] in COUNTER_KEYS


def kept_reason(keys: tuple[Key, ...], size: int, dtype: str, target: str) -> str | None:
    """Why `--dtype target` keeps this leaf as it is (one of REASONS), or None: it is cast."""
    if is_counter(keys, size):
        return COUNTER
    have = dtypes.get(dtype)
    if not have.is_float:
        return NOT_FLOATING
    if have.name.startswith("complex") != target.startswith("complex"):
        return OTHER_KIND
    if have.name == target:
        return SAME_DTYPE
    return None


def kept_phrase(reasons: Iterable[str], target: str) -> str:
    """'2 step counters, 3 non-floating leaves and 1 bfloat16 leaf' (empty when nothing was kept).

    Counts are by reason, in REASONS' order; the nouns agree with the counts."""
    counts = {reason: 0 for reason in REASONS}
    for reason in reasons:
        counts[reason] += 1
    other = "real" if target.startswith("complex") else "complex"
    nouns = {
        COUNTER: ("step counter", "step counters"),
        NOT_FLOATING: ("non-floating leaf", "non-floating leaves"),
        OTHER_KIND: (f"{other} leaf", f"{other} leaves"),
        SAME_DTYPE: (f"{target} leaf", f"{target} leaves"),
    }
    parts = [f"{counts[r]:,} {nouns[r][0] if counts[r] == 1 else nouns[r][1]}" for r in REASONS if counts[r]]
    if len(parts) > 1:
        return ", ".join(parts[:-1]) + " and " + parts[-1]
    return parts[0] if parts else ""


def cast_array(data: np.ndarray, target: str) -> tuple[np.ndarray, int]:
    """`data` cast to `target`, and how many of its finite values are inf or NaN there (overflow).

    numpy's own overflow warning is silenced: the count is the report."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = data.astype(dtypes.numpy_dtype(target))
    bad = ~np.isfinite(out)
    if not bad.any():  # (the common case: one pass over the output, no second mask)
        return out, 0
    return out, int(np.count_nonzero(bad & np.isfinite(data)))


class CastOverflowError(CkptError):
    """A --dtype cast turned finite values into inf or NaN; nothing written (--allow-overflow writes it)."""

    code = "cast-overflow"


class Overflow:
    """The values each leaf lost to overflow in a --dtype cast (from the copy threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_leaf: dict[str, int] = {}

    def add(self, leaf: str, values: int) -> None:
        if values:
            with self._lock:
                self.by_leaf[leaf] = self.by_leaf.get(leaf, 0) + values

    def __bool__(self) -> bool:
        return bool(self.by_leaf)

    def phrase(self, target: str, shown: int = 3) -> str:
        """'2 leaves overflowed in the cast to float16 (1,234 finite values became inf or NaN):
        a.w (1,000), b.w (234)'; at most `shown` leaves named, the largest first."""
        leaves = sorted(self.by_leaf.items(), key=lambda kv: (-kv[1], kv[0]))
        total = sum(self.by_leaf.values())
        became = "inf" if _has_inf(target) else "NaN"  # (float8_e4m3fn has no inf)
        names = ", ".join(f"{leaf} ({n:,})" for leaf, n in leaves[:shown])
        more = f" and {len(leaves) - shown} more" if len(leaves) > shown else ""
        noun = "leaf" if len(leaves) == 1 else "leaves"
        return (f"{len(leaves):,} {noun} overflowed in the cast to {target} ({total:,} finite "
                f"value{'s' * (total != 1)} became {became}): {names}{more}")


def _has_inf(target: str) -> bool:
    """Whether the dtype can hold inf (float8_e4m3fn and the fnuz types cannot: overflow is NaN)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isinf(np.array([np.inf], dtype=np.float32).astype(dtypes.numpy_dtype(target)).astype(np.float32))[0])

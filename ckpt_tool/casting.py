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
"""
from __future__ import annotations

from typing import Iterable

from . import dtypes
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

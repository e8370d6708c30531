"""The memory one pickle may take to unpickle: the run's budget plus a fixed allowance.

Set by the core around a command's work (`memory_budget(--memory)`), read by
safe_pickle before it unpickles anything (its "Memory" section says how the
cost is estimated). Kept apart from safe_pickle so that setting it imports
nothing: most checkpoints hold no pickle.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Iterator

from ...base.memory import DEFAULT_MEMORY

# the budget where no command set one: --memory's floor
DEFAULT_BUDGET = DEFAULT_MEMORY
# on top of the budget: a large real DCP .metadata (~12 bytes of objects a byte, estimated at ~30)
# reads under the default budget up to ~34 MB (~140,000 tensors of one rank)
PICKLE_ALLOWANCE = 512 << 20

_UNSET = -1
_BUDGET: contextvars.ContextVar[int | None] = contextvars.ContextVar("pickle_memory_budget", default=_UNSET)
# the budget of the command running in this process, for its worker threads: a thread pool's
# thread starts with an empty context, so the ContextVar alone would give them the default
_process_budget: list[int | None] = [_UNSET]
_process_lock = threading.Lock()


@contextlib.contextmanager
def memory_budget(nbytes: int | None) -> Iterator[None]:
    """Within it, a pickle may take `nbytes` (--memory; None: the default) plus PICKLE_ALLOWANCE to
    unpickle: in this context, and in threads that have none of their own (the command's workers)."""
    token = _BUDGET.set(nbytes)
    with _process_lock:
        outer = _process_budget[0]
        _process_budget[0] = nbytes
    try:
        yield
    finally:
        _BUDGET.reset(token)
        with _process_lock:
            _process_budget[0] = outer


def memory_limit() -> int:
    """The bytes one pickle may take to unpickle in this context: the budget plus the fixed allowance."""
    budget = _BUDGET.get()
    if budget == _UNSET:
        budget = _process_budget[0]
    return (DEFAULT_BUDGET if budget is None or budget == _UNSET else budget) + PICKLE_ALLOWANCE

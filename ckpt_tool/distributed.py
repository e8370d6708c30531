"""Several hosts running the same command: jax.distributed barriers.

Imported only when a multi-process run is asked for (flags or the JAX
environment variables), so single-host commands never load jax. Every
process calls the same barriers in the same order; none is guarded by a
process-index check (seed 000: such a guard around a collective hung a pod).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from .errors import CkptError


@dataclass
class ProcessSpec:
    coordinator: str | None
    num_processes: int | None
    process_id: int | None

    @property
    def requested(self) -> bool:
        return bool(self.coordinator or (self.num_processes and self.num_processes > 1))


def process_spec(coordinator: str | None, num_processes: int | None, process_id: int | None) -> ProcessSpec:
    """Flags first, then the variables jax.distributed.initialize reads."""
    env = os.environ
    coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = int(env["JAX_PROCESS_ID"])
    return ProcessSpec(coordinator, num_processes, process_id)


def _keep_stdout_for_output() -> None:
    """Point fd 1 at stderr for the rest of the process; sys.stdout keeps the real stdout.

    gloo and XLA print connection lines on fd 1 from C++ (some only when
    their buffers flush at exit); the command's own output (--json) must
    stay parseable.
    """
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(real_stdout, "w", buffering=1)


class JaxCoordinator:
    """Barriers over jax.distributed (gloo collectives on CPU hosts)."""

    def __init__(self, spec: ProcessSpec) -> None:
        try:
            import jax
        except ImportError:
            raise CkptError("multi-host runs need jax: pip install jax") from None
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        _keep_stdout_for_output()
        try:
            jax.distributed.initialize(
                coordinator_address=spec.coordinator,
                num_processes=spec.num_processes,
                process_id=spec.process_id,
            )
        except Exception as exc:  # noqa: BLE001 - jax raises RuntimeError/ValueError variants
            raise CkptError(f"jax.distributed.initialize failed: {exc}") from exc
        self._jax = jax
        self.process_index = jax.process_index()
        self.process_count = jax.process_count()

    def barrier(self, name: str) -> None:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)

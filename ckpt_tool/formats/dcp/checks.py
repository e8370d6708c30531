"""validate's shallow and deep checks of a DCP checkpoint: the shared DCP machinery's
(ckpt_tool/machinery/dcp/checks.py), which checks Megatron's torch_dist saves too."""
from __future__ import annotations

from typing import Any

from ...base.findings import Findings
from ...machinery.dcp.checks import check_deep, check_path
from ...storage import Storage

__all__ = ["check_deep", "check_opened", "check_path"]


def check_opened(storage: Storage, findings: Findings, parsed: dict[str, Any], *, step: str | int | None = None,
                 only: str | None = None) -> None:
    """check_path of a checkpoint the reader opened in this run: its parse of `.metadata`, in `parsed`
    (Checkpoint.parsed), is taken instead of reading the file again."""
    check_path(storage, findings, step=step, only=only, parsed=parsed)

"""validate's shallow and deep checks of a DCP checkpoint: the shared DCP machinery's
(ckpt_tool/machinery/dcp/checks.py), which checks Megatron's torch_dist saves too."""
from ...machinery.dcp.checks import check_deep, check_path

__all__ = ["check_deep", "check_path"]

"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3; fp32 and bf16 training), read without DeepSpeed or torch.

A step directory (`global_stepN/`: `mp_rank_00_model_states.pt` or stage 3's
`zero_pp_rank_{r}_mp_rank_00_model_states.pt`, and `[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`
per data-parallel rank) or a root holding `latest` and such directories (`--step N` or a tag).

reader.py builds the consolidated tree zero_to_fp32 gives (each parameter whole, its fp32
master weights assembled from every rank's flat partition by byte range), the optimizer state
per parameter and the engine's other recorded state; layout.py is where each parameter's
elements lie in the partitions; checks.py is validate's shallow checks and --deep's CRC-32s;
pipeline.py reads pipeline-parallel steps stage by stage (layer files), moe.py lays out MoE expert
groups (experts renumbered globally) and checks the expert files; opening.py opens a step with
whichever applies (read).
ckpt does not write ZeRO checkpoints; universal/ (a registry entry of its own) reads DeepSpeed
universal checkpoints and writes them from ZeRO ones. The package's interface is the registry's:
NAME, detect, read, layout_text.
"""
from .opening import read
from .reader import NAME, detect, layout_text

__all__ = ["NAME", "detect", "layout_text", "read"]


from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:  # the type checker holds the package, its checks.py and write.py to the format contract (core/contract.py)
    from ...core import contract as _contract
    from . import checks as _checks
    from .. import deepspeed as _package

    _conforms: _contract.FormatModule = _package
    _checks_conform: _contract.FormatChecksModule = _checks

"""DeepSpeed (ZeRO and universal)'s entry in the format registry: ckpt_tool.formats reads this file on its own (this
package is not imported for it), so it imports nothing but the registry's names."""
from __future__ import annotations

from .. import HF_MODEL_FILES, VALUE_KINDS, FormatInfo

PACKAGE = __name__.rsplit(".", 1)[0]  # this package (FormatInfo.package: imported when asked something)

FORMATS = [
    # before deepspeed and torch: a universal step directory holds model-states .pt files beside zero/
    FormatInfo(
        "deepspeed-universal", "DeepSpeed universal", f"{PACKAGE}.universal", can_write=True,
        value_kinds=VALUE_KINDS, claims=("latest_universal", "zero"),
        reads="DeepSpeed universal checkpoints (ds_to_universal's zero/<param>/*.pt, a root with latest_universal)",
        listed=7, writes_from=("deepspeed",), detection=60,
        # (not DeepSpeed's `latest`: it names a ZeRO tag, and neither ds_to_universal nor ckpt writes it here)
        parts=("*_model_states.pt", "zero_to_*.py"),
        part_checkpoints=("*",),  # its tag directory (`global_step2_universal/`: any name)
    ),
    # before torch: a global_stepN directory holds .pt files, which are one ZeRO checkpoint, not loose torch.save files
    FormatInfo(
        "deepspeed", "DeepSpeed ZeRO", PACKAGE, can_write=False, value_kinds=VALUE_KINDS,
        claims=("*_model_states.pt", "*_optim_states.pt"), short="DeepSpeed",
        reads="DeepSpeed ZeRO checkpoints (stages 1-3: a global_stepN directory, or a root with latest)", listed=6,
        read_options=("weights",), detection=70,
        # pipeline stages' layer_NN-model_states.pt, the root's tag pointer, the scripts DeepSpeed copies
        # there (zero_to_fp32.py, zero_to_torch.py), an HF Trainer's model files beside them
        parts=("*-model_states.pt", "latest", "zero_to_*.py", *HF_MODEL_FILES),
        part_checkpoints=("*",),  # tag directories (`global_step2/`: any name `latest` may hold)
        run_roots=("deepspeed",),  # global_stepN/ and the `latest` tag, as the reader reads them (run_roots.py)
    ),
]

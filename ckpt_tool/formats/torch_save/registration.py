"""torch.save's entry in the format registry: ckpt_tool.formats reads this file on its own (this
package is not imported for it), so it imports nothing but the registry's names."""
from __future__ import annotations

from .. import HF_MODEL_FILES, HF_TRAINER_FILES, VALUE_KINDS, FormatInfo

PACKAGE = __name__.rsplit(".", 1)[0]  # this package (FormatInfo.package: imported when asked something)

FORMATS = [
    # last: a Hugging Face directory holding both model.safetensors and pytorch_model.bin reads as safetensors
    FormatInfo(
        "torch", "torch.save", PACKAGE, can_write=False, value_kinds=VALUE_KINDS,
        claims=("*.bin.index.json", "*.bin", "*.pt", "*.pth"), short="torch.save",
        reads="torch.save files (.pt / .bin, a Hugging Face sharded pytorch_model.bin set)",
        claims_mark_checkpoint=False, single_file="unclaimed", file_suffixes=(".pt", ".pth", ".bin"), listed=4,
        claims_flat=True, model_marks=("*.bin.index.json", "config.json"), detection=80,
        # a verl actor's FSDP config and Hugging Face export beside its rank files
        parts=(*HF_MODEL_FILES, *HF_TRAINER_FILES, "fsdp_config.json", "huggingface"),
    ),
]

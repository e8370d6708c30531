"""torch.distributed.checkpoint (DCP) directories: `.metadata` and `__<rank>_<n>.distcp` files.

reader.py reads them without torch (the allow-list unpickler of ckpt_tool.torchsave
for `.metadata`, byte-range reads of each chunk's torch.save archive);
transforms.py decodes entries saved through `_extensions` (zstd);
write.py writes them (convert); checks.py is validate's shallow and deep
checks. The package's interface is the registry's: NAME, detect, read.
"""
from .reader import NAME, detect, read

__all__ = ["NAME", "detect", "read"]

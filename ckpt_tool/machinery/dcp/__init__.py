"""torch.distributed.checkpoint (DCP) files, read and checked without torch: `.metadata` (through
the allow-list unpickler of ckpt_tool.machinery.torch_save) and the `__<rank>_<n>.distcp` torch.save archives
(byte-range reads of each chunk).

Shared machinery: the DCP format (formats/dcp/) and Megatron-Core's torch_dist saves (a DCP
checkpoint with Megatron's metadata, formats/megatron/) read and validate their files here.
reader.py reads them; transforms.py decodes entries saved through `_extensions` (zstd);
checks.py is validate's shallow and deep checks. Nothing here imports a format package.
"""

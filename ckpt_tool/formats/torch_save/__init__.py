"""torch.save archives: one `.pt` / `.pth` / `.bin` file, a directory of them, a Hugging Face
sharded `.bin` set (`pytorch_model-0000K-of-0000N.bin` + `pytorch_model.bin.index.json`).

reader.py builds the tree from each archive's pickle (through the allow-list
unpickler in ckpt_tool/torchsave/, nothing executed) and reads tensors by byte
range of their storages; checks.py is validate's shallow checks and --deep's
CRC-32 of every storage. ckpt does not write torch.save files (convert to
safetensors, DCP or Orbax instead). The package's interface is the registry's:
NAME, detect, read, and for one file given by its path split_file and read_file.
"""
from .reader import NAME, detect, layout_text, read, read_file
from .reader import split_local_file as split_file

__all__ = ["NAME", "detect", "layout_text", "read", "read_file", "split_file"]

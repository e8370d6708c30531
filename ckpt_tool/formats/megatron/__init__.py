"""Megatron-Core `dist_checkpointing` saves (torch_dist) and Megatron-LM run roots (iter_N/ + tracker).

reader.py reads a save through the DCP and torch.save packages (torch_dist's `.metadata` and
items, `common.pt`) with Megatron's pickled classes admitted by name as data (pickled.py), the
distributed optimizer's flattened ranges shown as their logical tensors (reformulated.py);
checks.py is validate's. ckpt does not write Megatron checkpoints. The package's interface is
the registry's: NAME, detect, read, layout_text.
"""
from .reader import NAME, detect, layout_text, read

__all__ = ["NAME", "detect", "layout_text", "read"]

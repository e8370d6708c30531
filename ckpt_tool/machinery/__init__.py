"""Machinery several format packages share, below them and naming none: zarr / TensorStore arrays
(arrays/), DCP's files (dcp/), torch.save archives and the allow-list unpickler (torch_save/),
integrity manifests (integrity/), Hugging Face's shard index (hf_index.py).
"""

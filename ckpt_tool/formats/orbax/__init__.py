"""Orbax / JAX checkpoints (OCDBT or per-array, zarr v2 or v3, CheckpointManager roots).

reader.py reads them from metadata alone (no jax); schema.py checks the JSON
files orbax writes against its own dataclasses; write.py writes them (convert,
reshard); checks.py is validate's shallow checks. The package's interface is
the registry's: NAME, detect, read.
"""
from .reader import NAME, detect, read

__all__ = ["NAME", "detect", "read"]

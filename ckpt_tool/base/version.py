"""ckpt's version, in the base layer: the manifest records which ckpt wrote it."""

__version__ = "0.1.0"

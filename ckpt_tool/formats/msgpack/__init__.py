"""Checkpoints whose tree is a msgpack document: Flax legacy, orbax <= 0.4, T5X.

reader.py reads the three families; scan.py walks a msgpack document without
loading array data; checks.py is validate's shallow checks. The package's
interface is the registry's: NAME, detect, read, and for one file given by its
path split_file and read_file.
"""
from .reader import NAME, detect, read, read_file
from .reader import split_local_file as split_file

__all__ = ["NAME", "detect", "read", "read_file", "split_file"]

"""The base layer: errors, text, sizes, dtypes, findings, names, checksums, buffers, page cache,
parallelism, the reader options' context. Imports nothing of ckpt_tool above it.
"""

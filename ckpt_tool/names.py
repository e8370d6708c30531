"""Names ckpt gives its own files, which every layer must tell from a checkpoint's."""

# temporary output directories of convert/reshard carry this in their name
TMP_MARKER = ".ckpt-tmp"

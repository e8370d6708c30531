"""Hugging Face safetensors: one file, or a sharded save with its index.

reader.py reads headers and tensors without torch or the safetensors package;
write.py writes them (convert); checks.py is validate's shallow checks. The
package's interface is the registry's: NAME, detect, read, and for one file
given by its path split_file and read_file.
"""
from .reader import NAME, detect, read, read_file
from .reader import split_file_url as split_file

__all__ = ["NAME", "detect", "read", "read_file", "split_file"]


from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:  # the type checker holds the package, its checks.py and write.py to the format contract (core/contract.py)
    from ...core import contract as _contract
    from . import checks as _checks
    from . import write as _write
    from .. import safetensors as _package

    _conforms: _contract.FormatModule = _package
    _checks_conform: _contract.FormatChecksModule = _checks
    _write_conforms: _contract.FormatWriteModule = _write

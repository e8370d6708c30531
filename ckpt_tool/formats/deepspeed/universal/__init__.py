"""DeepSpeed universal checkpoints (`ds_to_universal`'s output), read without DeepSpeed or torch,
and written from a ZeRO checkpoint directly (`convert --to deepspeed-universal`), streamed.

reader.py reads a universal step directory (or a root with `latest_universal`) as the ZeRO
reader's tree; checks.py is validate's; write.py writes what ds_to_universal writes, file for
file and byte for byte, without its temporary directory of fragments. The package's interface
is the registry's: NAME, detect, read, layout_text.
"""
from .reader import NAME, detect, layout_text, read

__all__ = ["NAME", "detect", "layout_text", "read"]


from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:  # the type checker holds the package, its checks.py and write.py to the format contract (core/contract.py)
    from ....core import contract as _contract
    from . import checks as _checks
    from . import write as _write
    from .. import universal as _package

    _conforms: _contract.FormatModule = _package
    _checks_conform: _contract.FormatChecksModule = _checks
    _write_conforms: _contract.FormatWriteModule = _write

"""`integrity.json`: the sha256 manifest megatron-core >= 0.18 writes in a save, checked by the
shared manifest core (ckpt_tool/machinery/integrity/), which reads it as Megatron's verifier does.

`dist_checkpointing.save(..., verify_integrity=True)` (Megatron-LM `--verify-integrity`) hashes,
after metadata.json is written, every FILE directly in the save directory except the manifest
itself, and writes (megatron/core/dist_checkpointing/validation.py, save_integrity_manifest;
core_v0.18.0) `{"algorithm": "sha256", "files": {"<name>": "<hex digest>", ...}}`. No sizes:
without reading the files only their presence can be checked.

What is Megatron's here: which unnamed files are worth a warning (the files a save writes, not
those Megatron-Bridge / NeMo put beside it afterwards), and where the manifests are: the core
checks the one of the path validate is given; these functions check those of the saves inside
it (a run root's step, NeMo 2's weights/), called from checks.py.
"""
from __future__ import annotations

from typing import Any

from ...machinery.integrity import files as core
from ...base.errors import CkptError, PathEscapeError
from ...storage import Storage

FILE = core.FILE
# files Megatron-Bridge / NeMo put beside a save after it: not in the manifest by design
_WRITTEN_LATER = ("run_config.yaml", "train_state.pt")


def covers(name: str) -> bool:
    """A top-level file a Megatron manifest names when it was written with the save: one
    dist_checkpointing.save writes (an unnamed one is `unlisted-file`)."""
    if name in _WRITTEN_LATER:
        return False
    return name in ("metadata.json", "common.pt", ".metadata") or name.endswith((".distcp", ".pt"))


def note(storage: Storage) -> str:
    """inspect's line about the manifest (never an error: inspect reads no data)."""
    try:
        manifest = core.read(core.at(storage))
    except PathEscapeError:
        raise
    except CkptError as exc:
        return f"{FILE} unreadable ({exc.message}): validate reports it"
    who = "ckpt manifest write" if manifest.ours else "megatron-core >= 0.18"
    return f"{FILE}: sha256 of {len(manifest.files)} files ({who}; validate --deep verifies them)"


def check(storage: Storage, findings: Any) -> None:
    """Shallow: the manifest readable, every file it names present, save files it does not name."""
    core.check_shallow(core.at(storage), findings, covers=covers)


def check_deep(storage: Storage, findings: Any) -> None:
    """--deep: every named file's sha256 against the manifest, streamed."""
    core.check_digests(core.at(storage), findings)

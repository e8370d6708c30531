"""torch.distributed.checkpoint (DCP): the catalogue rows (tests/conformance/rows.py) of
ckpt_tool/formats/dcp and torch's own view of its fixtures (its metadata, dcp_to_torch_save + torch.load)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import library_reference as LR
from references import Ref, torch_to_numpy
from rows import Damage, Entry, FixtureSpec, Inside, Library


def dcp_live(path: Path, step: str | None = None) -> dict:
    """torch.distributed.checkpoint's metadata: tensors with shape and dtype, bytes items as values."""
    out = {}
    for k, sd in LR.dcp_reference(path).items():
        out[k] = Ref("value") if sd is None else Ref("array", sd[0], sd[1])
    return out


def dcp_live_values(path: Path, step: str | None = None) -> dict:
    """torch's own load (dcp_to_torch_save + torch.load), conj / neg views resolved as torch does."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    keys = LR.dcp_keys(path)
    with tempfile.TemporaryDirectory(prefix="ckpt-conformance-") as tmp:
        dcp_to_torch_save(os.fspath(path), os.path.join(tmp, "full.pt"))
        sd = torch.load(os.path.join(tmp, "full.pt"), weights_only=False)
    out = {}
    for fqn, kp in keys.items():
        obj = sd[fqn] if kp == (fqn,) and fqn in sd else _walk(sd, kp)
        out[kp] = torch_to_numpy(obj) if isinstance(obj, torch.Tensor) else obj
    return out


def _walk(obj: Any, keys: tuple) -> Any:
    for k in keys:
        obj = obj[k]
    return obj



def _storage_path_escape(p: Path, work: Path) -> None:
    """DCP: a storage entry's relative_path climbs out ('../x.distcp', a real file there)."""
    import fuzz_lib

    data = p.read_bytes()
    (p.parent.parent / "x.distcp").write_bytes((p.parent / "__1_0.distcp").read_bytes())
    new, _ = fuzz_lib.edit_storage_entry(data, "model.w", lambda info: setattr(info, "relative_path", "../x.distcp"))
    p.write_bytes(new)


HOW = {"storage-path": _storage_path_escape}

LIVE = {"reference": dcp_live, "values": dcp_live_values}

ENTRIES: list[Entry] = [
    # torch 2.13 DCP: read live with torch
    # fixtures/generate.py's (Entry.facts: in the sample the CLI-wide tests run over)
    Entry("dcp_single", "dcp", **LIVE, facts={
        "writer": "torch.distributed.checkpoint.save(state_dict, checkpoint_id=path) (no process group)",
        "processes": 1, "files": ["__0_0.distcp"]}),
    Entry("dcp_multirank", "dcp", **LIVE, facts={
        "writer": "2 ranks (gloo, tcp://127.0.0.1), DTensor on DeviceMesh; "
                  "torch.distributed.checkpoint.save(state_dict, checkpoint_id=path) on both",
        "processes": 2, "files": ["__0_0.distcp", "__1_0.distcp"]}),
    Entry("dcp_fsdp2_adam", "dcp", **LIVE),
    Entry("dcp_conj", "dcp", **LIVE, refused_by=(("safetensors", "complex128 has no safetensors equivalent"),)),
    *[Entry(n, "dcp", **LIVE) for n in
      ("dcp_zstd", "dcp_dups", "dcp_dups_replicated", "dcp_dups_zstd", "dcp_threads")],
]

DAMAGE: list[Damage] = [
    # dcp: a rank's .distcp, .metadata
    Damage("dcp", "missing-file", "dcp_multirank", "__1_0.distcp", "remove", "missing-file"),
    Damage("dcp", "truncated-file", "dcp_multirank", "__1_0.distcp", "truncate", "truncated-file"),
    Damage("dcp", "wrong-size", "dcp_multirank", "__1_0.distcp", "empty", "empty-file"),
    Damage("dcp", "garbage-metadata", "dcp_multirank", ".metadata", "garbage", "bad-metadata"),
    Damage("dcp", "path-escape", "dcp_multirank", "__1_0.distcp", "symlink-out", "path-escape"),
    Damage("dcp", "path-escape", "dcp_multirank", ".metadata", "storage-path", "path-escape"),
]

LIBRARY = {"dcp": Library(LR.dcp_values)}  # dcp_to_torch_save + torch.load

INSIDE = [
    Inside("dcp_multirank/.metadata", "dcp_multirank", "dcp"),
    Inside("dcp_multirank/__0_0.distcp", "dcp_multirank", "dcp"),
]

FUZZ = [
    FixtureSpec("dcp_single", "dcp", "dcp"),
    FixtureSpec("dcp_multirank", "dcp", "dcp"),
    FixtureSpec("dcp_fsdp2_adam", "dcp", "dcp"),
    FixtureSpec("dcp_zstd", "dcp", "dcp"),
]
FUZZ_WEIGHT = {"dcp": 0.36}

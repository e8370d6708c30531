"""torch.save: the catalogue rows (tests/conformance/rows.py) of ckpt_tool/formats/torch_save and
torch.load(weights_only=True)'s view of its fixtures (gen_torch_save.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from references import Ref, by_name, torch_dtype_name, torch_to_numpy
from rows import Damage, Entry, FixtureSpec


def _torch_files(path: Path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    index = sorted(path.glob("*.bin.index.json"))
    if index:
        return sorted({path / f for f in json.loads(index[0].read_text())["weight_map"].values()})
    return sorted(p for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))


def _torch_walk(obj: Any, keys: tuple, out: dict) -> None:
    """torch.load's object as ckpt lays a torch.save file out: dicts by key, lists/tuples by index
    only where they hold a tensor (else one value, as DCP keeps such an item); keyed by dotted name."""
    import torch

    if isinstance(obj, dict) and obj and all(type(k) in (str, int) for k in obj):
        for k, v in obj.items():
            _torch_walk(v, keys + (k,), out)
    elif isinstance(obj, (list, tuple)) and obj and any(isinstance(v, torch.Tensor) for v in obj):
        for i, v in enumerate(obj):
            _torch_walk(v, keys + (i,), out)
    else:
        out[by_name(".".join(map(str, keys)))] = obj


def _torch_objects(path: Path) -> dict:
    """torch.load(weights_only=True) of the checkpoint's files (one file, a set or a lone file in a directory)."""
    import torch

    out: dict = {}
    for f in _torch_files(Path(path)):
        _torch_walk(torch.load(f, weights_only=True, map_location="cpu"), (), out)
    return out


def torch_live(path: Path, step: str | None = None) -> dict:
    """torch.load(weights_only=True): tensors with shape and dtype, everything else a value."""
    import torch

    return {k: Ref("array", tuple(v.shape), torch_dtype_name(v)) if isinstance(v, torch.Tensor) else Ref("value")
            for k, v in _torch_objects(path).items()}


def torch_live_values(path: Path, step: str | None = None) -> dict:
    import torch

    return {k: torch_to_numpy(v) if isinstance(v, torch.Tensor) else v for k, v in _torch_objects(path).items()}



LIVE = {"reference": torch_live, "values": torch_live_values}

ENTRIES: list[Entry] = [
    # torch.save (gen_torch_save.py: transformers 4.57 .bin sets, torch 2.13): torch.load(weights_only=True)
    Entry("torch_hf_bin_sharded", "torch", **LIVE),
    Entry("torch_hf_bin_single", "torch", **LIVE),
    Entry("torch_hf_bin_single/pytorch_model.bin", "torch", **LIVE),  # one file, by its path
    Entry("torch_state/state.pt", "torch", **LIVE),
    Entry("torch_dcp_to_torch_save/full.pt", "torch", **LIVE),
]

DAMAGE: list[Damage] = [
    # torch: a shard of a .bin set, its index, a lone file
    Damage("torch", "missing-file", "torch_hf_bin_sharded", "pytorch_model-00002-of-00003.bin", "remove", "missing-file"),
    Damage("torch", "truncated-file", "torch_hf_bin_sharded", "pytorch_model-00002-of-00003.bin", "truncate",
           "truncated-file"),
    Damage("torch", "wrong-size", "torch_hf_bin_sharded", "pytorch_model-00002-of-00003.bin", "empty", "empty-file"),
    Damage("torch", "wrong-size", "torch_hf_bin_single", "pytorch_model.bin", "flip-storage", "bad-chunk", deep=True),
    Damage("torch", "garbage-metadata", "torch_hf_bin_sharded", "pytorch_model.bin.index.json", "garbage",
           "bad-metadata"),
    Damage("torch", "garbage-metadata", "torch_hf_bin_single", "pytorch_model.bin", "garbage", "bad-metadata"),
    Damage("torch", "path-escape", "torch_hf_bin_sharded", "pytorch_model-00002-of-00003.bin", "symlink-out",
           "path-escape"),
]

NOT_CHECKPOINTS = {"torch_legacy"}  # refused by name, tests/formats/torch_save/test_torch_save.py

FUZZ = [
    # torch.save: torch.load(weights_only=True) of each file is the oracle (fuzz_oracle.py)
    FixtureSpec("torch_hf_bin_sharded", "torch", "torch"),
    FixtureSpec("torch_hf_bin_single", "torch", "torch"),
    FixtureSpec("torch_state", "torch", "torch"),
    FixtureSpec("torch_dcp_to_torch_save", "torch", "torch", entry="full.pt"),  # one file, by its path
]
FUZZ_WEIGHT = {"torch": 0.10}

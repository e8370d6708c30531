"""The throwaway format both throwaway-format tests use: safetensors' modules copied as formats/toyst
(its files are `*.toyst`), and the suite's properties it must pass like every real format.

test_conformance_catalogue.py registers it by hand and checks the contract's write side;
test_new_format.py builds it from a new format's three places and their discovery.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import catalogue as C

TOY = "toyst"


def safetensors_as_toy(where: Path) -> Path:
    """ckpt_tool/formats/safetensors's modules copied to `where`/toyst, renamed to read and write
    `*.toyst` files; it implements the format contract (ckpt_tool/core/contract.py) as safetensors does."""
    src = Path(importlib.import_module("ckpt_tool.formats.safetensors").__file__).parent
    dst = where / TOY
    dst.mkdir(parents=True)
    for f in src.glob("*.py"):
        text = f.read_text()
        text = re.sub(r'^NAME = "safetensors"', f'NAME = "{TOY}"', text, flags=re.M)
        text = text.replace('SUFFIX = ".safetensors"', f'SUFFIX = ".{TOY}"')
        text = text.replace('SINGLE_FILE = "model.safetensors"', f'SINGLE_FILE = "model.{TOY}"')
        text = text.replace('INDEX_FILE = "model.safetensors.index.json"', f'INDEX_FILE = "model.{TOY}.index.json"')
        # the shards' names (the reader's patterns, the writer's names)
        text = text.replace(r'\.safetensors$")', rf'\.{TOY}$")').replace('-of-{count:05d}.safetensors"', f'-of-{{count:05d}}.{TOY}"')
        (dst / f.name).write_text(text)
    return dst


def passes_the_suite(entry: Any, root: Path, work: Path, damage: list, entries: list) -> Any:
    """The conformance suite's properties for the toy's catalogue `entry` (fixtures under `root`):
    read, validate, values, conversion to every writable format, every damage row, fuzzing.
    Returns the suite's Conversions (under `work`) for further conversions."""
    import test_conformance_convert as CONV
    import test_conformance_damage as DMG
    import test_conformance_fuzz as FZ
    import test_conformance_read as READ

    import ckpt_tool

    assert C.detected(entry.full(root)) == TOY
    assert ckpt_tool.open(str(entry.full(root))).format == TOY
    READ.inspect_agrees(entry, root)
    READ.validate_passes(entry, False, root)
    READ.validate_passes(entry, True, root)
    READ.values_agree(entry, root)
    conversions = CONV.Conversions(_mk(work / "convert"))
    for to in C.writable():
        if to in C.refusals(entry):  # a writer that takes other formats only (DeepSpeed universal)
            continue
        summary, dst = conversions.get(entry, to, root)
        CONV.diff_says_same(entry.full(root), dst, summary, entry)
        assert CONV.library_reads_what_ckpt_reads(to, dst) > 0
    for i, d in enumerate(damage):
        DMG.damage_is_reported(d, _mk(work / f"damage{i}"), root)
    assert not FZ.smoke(TOY, _mk(work / "fuzz"), 20, entries, root)
    return conversions


def _mk(p: Path) -> Path:
    p.mkdir(parents=True)
    return p

"""Orbax: the catalogue rows (tests/conformance/rows.py) of ckpt_tool/formats/orbax and the
writing library's view of its fixtures: orbax-checkpoint 0.12 live (its metadata API and restore),
older versions' restores recorded beside their fixtures (fixtures/gen_orbax_versions.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import library_reference as LR
from references import Ref, np_dtype
from rows import Damage, Entry, FixtureSpec, Inside, Library


def _orbax_leaf(m: Any) -> Ref:
    import numpy as np
    from orbax.checkpoint import metadata as ocpmd

    if isinstance(m, ocpmd.StringMetadata):
        return Ref("value", (), "string")
    if isinstance(m, ocpmd.ScalarMetadata):
        return Ref("value", (), np.dtype(m.dtype).name)
    if isinstance(m, ocpmd.ArrayMetadata):
        return Ref("array", tuple(int(d) for d in (m.shape or ())), np.dtype(m.dtype).name)
    raise TypeError(f"unexpected orbax metadata leaf {type(m).__name__}")


def _orbax_item(item_dir: str) -> dict:
    return {k: _orbax_leaf(m) for k, m in LR._flatten(LR._pytree_metadata(item_dir)).items()}


def orbax_live(path: Path, step: str | None = None) -> dict:
    """orbax-checkpoint's own metadata API; a manager step: every item, JSON items as values."""
    path = Path(path) / step if step is not None else Path(path)
    p = os.path.abspath(path)
    if LR._is_pytree_item(p):
        return _orbax_item(p)
    out = {}
    for name, item_dir in (LR._composite_items(p) or {}).items():
        if LR._is_pytree_item(item_dir):
            out.update({(name,) + k: v for k, v in _orbax_item(item_dir).items()})
        else:
            out.update({(name,) + k: Ref("value") for k in LR._restore_json(item_dir)})
    return out


def orbax_live_values(path: Path, step: str | None = None) -> dict:
    """orbax's own restore (as host numpy arrays), JSON items flattened; a manager step's items."""
    return LR.orbax_values(Path(path) / step if step is not None else path)


def _recorded_leaves(path: Path, step: str | None) -> list[dict]:
    """The leaves _reference.json records for one save (a root: its `step`, else its latest)."""
    path = Path(path)
    doc = json.loads((path.parent / "_reference.json").read_text())
    save = doc["saves"][path.name]
    return save["steps"][str(step or save["latest_step"])]["leaves"] if save["kind"] == "root" else save["leaves"]


def orbax_recorded(path: Path, step: str | None = None) -> dict:
    """fixtures/orbax_v0_X/_reference.json: that orbax version's own restore (of the latest step of a root)."""
    out = {}
    for leaf in _recorded_leaves(path, step):
        if leaf["data"] is None or leaf["type"] in ("int", "float"):
            out[tuple(leaf["keys"])] = Ref("value")
        else:
            out[tuple(leaf["keys"])] = Ref("array", tuple(leaf["shape"]), leaf["dtype"])
    return out


def orbax_recorded_values(path: Path, step: str | None = None) -> dict:
    """_reference.json's bytes (base64) and Python values, as that orbax version restored them."""
    import base64

    import numpy as np

    out = {}
    for leaf in _recorded_leaves(path, step):
        if leaf["data"] is None or leaf["type"] in ("int", "float"):
            out[tuple(leaf["keys"])] = leaf["value"]
        else:
            raw = base64.b64decode(leaf["data"])
            out[tuple(leaf["keys"])] = np.frombuffer(raw, dtype=np_dtype(leaf["dtype"])).reshape(leaf["shape"])
    return out


LIVE = {"reference": orbax_live, "values": orbax_live_values, "drops_empty": True}
RECORDED = {"reference": orbax_recorded, "values": orbax_recorded_values}

# what fixtures/generate.py's orbax saves hold (Entry.facts): the sample the CLI-wide tests run over
MANAGER = {
    "kind": "manager",
    "writer": "ocp.CheckpointManager(root, item_names=('state','config'), metadata=...).save(step, "
              "args=ocp.args.Composite(state=ocp.args.StandardSave(...), config=ocp.args.JsonSave(...)))",
    "layout": "ocdbt", "zarr": 2, "processes": 1, "strings": False,
    "steps": [1, 2], "incomplete_steps": [3], "incomplete_dirs": ["3.orbax-checkpoint-tmp"],
    "items": {"state": "pytree", "config": "json"}, "item_dirs": ["1/state", "2/state"],
}

ENTRIES: list[Entry] = [
    # orbax-checkpoint 0.12.8 (fixtures/generate.py): read live with the installed orbax
    Entry("orbax_ocdbt_zarr2", "orbax", **LIVE, facts={
        "writer": "ocp.StandardCheckpointer().save(path, tree)",
        "layout": "ocdbt", "zarr": 2, "processes": 1, "strings": False}),
    Entry("orbax_ocdbt_zarr3", "orbax", **LIVE, facts={
        "writer": "ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True))"
                  ".save(path, args=ocp.args.PyTreeSave(tree))",
        "layout": "ocdbt", "zarr": 3, "processes": 1, "strings": True}),
    Entry("orbax_plain_zarr2", "orbax", **LIVE, facts={
        "writer": "ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))"
                  ".save(path, args=ocp.args.PyTreeSave(tree))",
        "layout": "plain", "zarr": 2, "processes": 1, "strings": True}),
    Entry("orbax_two_process", "orbax", **LIVE, facts={
        "writer": "2 processes (jax.distributed, gloo), global 2x4 mesh; "
                  "ocp.StandardCheckpointer().save(path, tree) on both",
        "layout": "ocdbt", "zarr": 2, "processes": 2, "strings": False}),
    Entry("orbax_manager", "orbax", **LIVE, step="1", facts=MANAGER),
    Entry("orbax_manager", "orbax", **LIVE, step="2", facts=MANAGER),
    # orbax 0.5 / 0.9 / 0.11 (gen_orbax_versions.py): their own restore, recorded
    *[Entry(f"{fam}/{save}", "orbax", **RECORDED)
      for fam in ("orbax_v0_5", "orbax_v0_9", "orbax_v0_11")
      for save in ("standard", "plain", "manager", "manager_plain")],
]

DAMAGE: list[Damage] = [
    # orbax: an OCDBT data file under d/, _METADATA, a plain zarr chunk
    Damage("orbax", "missing-file", "orbax_ocdbt_zarr2", "d/*", "remove", "lost-process-data"),
    Damage("orbax", "missing-file", "orbax_plain_zarr2", "params.dense.kernel/1.1", "remove", "missing-chunk"),
    Damage("orbax", "truncated-file", "orbax_ocdbt_zarr2", "d/*", "truncate", "lost-process-data"),
    Damage("orbax", "truncated-file", "orbax_plain_zarr2", "params.dense.kernel/1.1", "truncate", "bad-chunk",
           deep=True),
    Damage("orbax", "wrong-size", "orbax_plain_zarr2", "params.dense.kernel/1.1", "grow", "bad-chunk", deep=True),
    Damage("orbax", "garbage-metadata", "orbax_ocdbt_zarr2", "_METADATA", "garbage", "bad-metadata"),
    Damage("orbax", "garbage-metadata", "orbax_plain_zarr2", "params.dense.kernel/.zarray", "garbage",
           "bad-array-metadata"),
    Damage("orbax", "path-escape", "orbax_ocdbt_zarr2", "d/*", "symlink-out", "path-escape"),
]

# orbax restore (as host numpy arrays), JSON items flattened; jax's tree flattening has no leaf for
# None, [], {}, (): orbax restores none
LIBRARY = {"orbax": Library(LR.orbax_values, drops_empty=True)}

INSIDE = [
    Inside("orbax_ocdbt_zarr2/_CHECKPOINT_METADATA", "orbax_ocdbt_zarr2", "orbax"),
    Inside("orbax_ocdbt_zarr2/_METADATA", "orbax_ocdbt_zarr2", "orbax"),
    Inside("orbax_ocdbt_zarr2/ocdbt.process_0/manifest.ocdbt", "orbax_ocdbt_zarr2", "orbax"),
    Inside("orbax_manager/1/_CHECKPOINT_METADATA", "orbax_manager/1", "orbax"),
]

FUZZ = [
    FixtureSpec("orbax_plain_zarr2", "orbax", "orbax"),
    FixtureSpec("orbax_ocdbt_zarr2", "orbax", "orbax"),
    FixtureSpec("orbax_ocdbt_zarr3", "orbax", "orbax"),
    # device ids 0-3 and 2048-2051 (two processes): one process restores it only as numpy
    FixtureSpec("orbax_two_process", "orbax", "orbax", "numpy"),
]
FUZZ_WEIGHT = {"orbax": 0.36}  # with DCP, the formats most checkpoints are in

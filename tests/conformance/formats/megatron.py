"""Megatron-Core / NeMo 2 / Megatron-LM: the catalogue rows (tests/conformance/rows.py) of
ckpt_tool/formats/megatron: megatron's own load, recorded beside each fixture by gen_megatron.py
(megatron is not in the test venv)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from references import Digest, Recorded, Ref, by_name
from rows import Damage, Entry, FixtureSpec


def _megatron_save(path: Path, step: str | None) -> dict:
    doc = json.loads((Path(path) / "_reference.json").read_text())
    saves = doc["saves"]
    if "." in saves:
        return saves["."]
    if "weights" in saves:  # a NeMo 2 checkpoint's weights/
        return saves["weights"]
    if step is None:
        step = f"iter_{int(doc['tracker']):07d}" if str(doc.get("tracker", "")).isdigit() else doc["tracker"]
    return saves[step if str(step).startswith("iter_") else f"iter_{int(step):07d}"]


def _megatron_common(doc: Any, keys: tuple, out: dict) -> None:
    """common.pt as ckpt lays a torch.save object out (dicts by key; lists by index only where they
    hold a tensor; anything else one value)."""
    special = isinstance(doc, dict) and any(k in doc for k in ("__tensor__", "__ndarray__", "__class__",
                                                                 "__object__", "__type__"))
    if isinstance(doc, dict) and doc and not special:
        for k, v in doc.items():
            _megatron_common(v, keys + (k,), out)
    elif isinstance(doc, list) and doc and "__tensor__" in json.dumps(doc):
        for i, v in enumerate(doc):
            _megatron_common(v, keys + (i,), out)
    elif keys or doc not in ({}, None):  # (an empty common.pt holds no leaf)
        out[by_name(".".join(map(str, keys)))] = doc


def megatron_recorded(path: Path, step: str | None = None) -> dict:
    """megatron-core's own load, recorded by gen_megatron.py: the logical tensors, each ShardedObject
    by its unique key, and common.pt's values."""
    save = _megatron_save(path, step)
    out = {by_name(".".join(r["keys"])): Ref("array", tuple(r["shape"]), r["dtype"]) for r in save["leaves"]}
    out.update({by_name(o["unique_key"]): Ref("value") for o in save["sharded_objects"]})
    common: dict = {}
    _megatron_common(save["common"], (), common)
    for k, doc in common.items():
        t = doc.get("__tensor__") if isinstance(doc, dict) else None
        out[k] = Ref("array", tuple(t["shape"]), t["dtype"]) if t else Ref("value")
    return out


def megatron_recorded_values(path: Path, step: str | None = None) -> dict:
    save = _megatron_save(path, step)
    out: dict = {by_name(".".join(r["keys"])): Digest(r["sha256"], tuple(r["shape"]), r["dtype"])
                 for r in save["leaves"]}
    out.update({by_name(o["unique_key"]): Recorded(o["value"]) for o in save["sharded_objects"]})
    common: dict = {}
    _megatron_common(save["common"], (), common)
    out.update({k: Recorded(doc) for k, doc in common.items()})
    return out


def _nemo_context(path: Path) -> dict:
    """{by_name: value} of context/model.yaml as PyYAML's safe_load gave it (recorded by gen_megatron.py):
    mappings by key under context.model, anything else one value."""
    doc = json.loads((Path(path) / "_reference.json").read_text())["context"]["model.yaml"]
    out: dict = {}

    def walk(v: Any, keys: tuple) -> None:
        if isinstance(v, dict) and v:
            for k, x in v.items():
                walk(x, keys + (k,))
        else:
            out[by_name(".".join(map(str, keys)))] = v

    walk(doc, ("context", "model"))
    return out


def megatron_nemo_recorded(path: Path, step: str | None = None) -> dict:
    """A NeMo 2 checkpoint: megatron's own load of weights/, and context/model.yaml's values."""
    return {**megatron_recorded(path, step), **{k: Ref("value") for k in _nemo_context(path)}}


def megatron_nemo_recorded_values(path: Path, step: str | None = None) -> dict:
    return {**megatron_recorded_values(path, step), **{k: Recorded(v) for k, v in _nemo_context(path).items()}}


def _megatron_legacy_saves(path: Path, step: str | None) -> dict:
    """{rank prefix: recorded torch.load of that file} for one step of a legacy (mp_rank_*) root:
    model_optim_rng.pt under its rank directory's name, distrib_optim.pt under `<rank>.distrib_optim`."""
    doc = json.loads((Path(path) / "_reference.json").read_text())
    if step is None:
        step = doc["tracker"]
    step_dir = str(step) if not str(step).isdigit() else f"iter_{int(step):07d}"
    out = {}
    for file, save in doc["saves"].items():
        where, rank, name = file.split("/")
        if where == step_dir:
            out[rank if name == "model_optim_rng.pt" else f"{rank}.distrib_optim"] = save
    return out


_ARRAYS = ("__tensor__", "__ndarray__")


def _legacy_walk(doc: Any, keys: tuple, out: dict) -> None:
    """A recorded torch.load object laid out as ckpt lays out a torch.save object: dicts by key,
    lists and tuples by index where they hold a tensor or numpy array, anything else one value."""
    if isinstance(doc, dict) and any(k in doc for k in _ARRAYS):
        out[keys] = doc
        return
    special = isinstance(doc, dict) and any(k in doc for k in ("__class__", "__object__", "__type__", "__bytesio__"))
    if isinstance(doc, dict) and doc and not special:
        for k, v in doc.items():
            _legacy_walk(v, keys + (k,), out)
    elif isinstance(doc, list) and doc and any(a in json.dumps(doc) for a in _ARRAYS):
        for i, v in enumerate(doc):
            _legacy_walk(v, keys + (i,), out)
    else:
        out[keys] = doc


def _megatron_legacy(path: Path, step: str | None) -> dict:
    """{by_name: recorded doc} of every leaf: the rank directory's name, then the file's key path;
    the model's tensors instead merged over the TP ranks under `model`, as megatron's own TP merge
    gave them (`tp_merged`: Megatron-LM's load at TP 2, dist_checkpointing save, load at TP 1)."""
    out: dict = {}
    for prefix, save in _megatron_legacy_saves(path, step).items():
        found: dict = {}
        _legacy_walk(save["summary"], (), found)
        out.update({by_name(".".join(map(str, (prefix,) + k))): doc for k, doc in found.items()
                    if not (k[:1] == ("model",) and isinstance(doc, dict) and "__tensor__" in doc)})
    merged = json.loads((Path(path) / "_reference.json").read_text()).get("tp_merged") or []
    out.update({by_name(".".join(("model", *r["keys"]))): {"__tensor__": r} for r in merged})
    return out


def megatron_legacy_recorded(path: Path, step: str | None = None) -> dict:
    """Megatron-LM's legacy save (--ckpt-format torch): each rank's file as torch.load(weights_only=True)
    gave it (megatron.core's safe globals registered), recorded by gen_megatron.py."""
    out = {}
    for key, doc in _megatron_legacy(path, step).items():
        arr = next((doc[a] for a in _ARRAYS if isinstance(doc, dict) and a in doc), None)
        out[key] = Ref("array", tuple(arr["shape"]), arr["dtype"]) if arr else Ref("value")
    return out


def megatron_legacy_recorded_values(path: Path, step: str | None = None) -> dict:
    """Tensors by their recorded sha256, numpy arrays by kind, values as recorded."""
    out = {}
    for key, doc in _megatron_legacy(path, step).items():
        t = doc.get("__tensor__") if isinstance(doc, dict) else None
        out[key] = Digest(t["sha256"], tuple(t["shape"]), t["dtype"]) if t else Recorded(doc)
    return out



RECORDED = {"reference": megatron_recorded, "values": megatron_recorded_values}
LEGACY = {"reference": megatron_legacy_recorded, "values": megatron_legacy_recorded_values}
NEMO = {"reference": megatron_nemo_recorded, "values": megatron_nemo_recorded_values}

ENTRIES: list[Entry] = [
    # megatron-core 0.16 / 0.13 and Megatron-LM core_v0.16.1 (gen_megatron.py): megatron's own load, recorded
    Entry("megatron_torch_dist_tp2", "megatron", **RECORDED),
    Entry("megatron_torch_dist_tp2_dp2", "megatron", **RECORDED),
    Entry("megatron_torch_dist_fully_sharded", "megatron", **RECORDED),
    # 0.13 distributed optimizer, DP 4 / TP 2 x DP 2 / MoE, several buckets, SwiGLU, GQA (gen_megatron_distopt.py)
    Entry("megatron_distopt_dp4", "megatron", **RECORDED),
    Entry("megatron_distopt_tp2_dp2", "megatron", **RECORDED),
    Entry("megatron_distopt_moe", "megatron", **RECORDED),  # EP 2, chained dense + expert optimizers
    Entry("megatron_distopt_pp2_dp2", "megatron", **RECORDED),  # PP 2, tied embeddings across stages
    Entry("megatron_distopt_vpp", "megatron", **RECORDED),  # PP 2 x VPP 2 (interleaved), RMSNorm
    Entry("megatron_distopt_instances", "megatron", **RECORDED),  # 2 distributed-optimizer instances
    Entry("megatron_distopt_fp16_tp2_pp2", "megatron", **RECORDED),  # fp16, TP 2 x PP 2
    Entry("megatron_distopt_moe_etp2", "megatron", **RECORDED),  # experts EP 2 x ETP 2, dense TP 1
    Entry("megatron_run", "megatron", **RECORDED),  # the tracker's step
    Entry("megatron_run", "megatron", **RECORDED, step="10"),
    Entry("megatron_zarr_tp2", "megatron", **RECORDED),  # 0.13's zarr backend (bfloat16 .zarray patch)
    # Megatron-LM --ckpt-format torch (mp_rank_0X/model_optim_rng.pt): torch.load(weights_only=True), recorded
    Entry("megatron_legacy", "megatron", **LEGACY),
    # the same with --swiglu (gated linear_fc1), GQA, an untied output layer: megatron's own TP merge, recorded
    Entry("megatron_legacy_swiglu", "megatron", **LEGACY),
    # NeMo 2 (IMITATED layout around megatron_torch_dist_tp2's save: weights/ + context/): megatron's load, safe_load
    Entry("megatron_nemo2", "megatron", **NEMO),
]

DAMAGE: list[Damage] = [
    # megatron: a rank's .distcp, metadata.json, common.pt, the run root's tracker
    Damage("megatron", "missing-file", "megatron_torch_dist_tp2", "__1_0.distcp", "remove", "missing-file"),
    Damage("megatron", "missing-file", "megatron_torch_dist_tp2", "common.pt", "remove", "missing-file"),
    Damage("megatron", "missing-file", "megatron_torch_dist_tp2", "metadata.json", "remove", "uncommitted-save"),
    Damage("megatron", "truncated-file", "megatron_torch_dist_tp2", "__1_0.distcp", "truncate", "truncated-file"),
    Damage("megatron", "truncated-file", "megatron_torch_dist_tp2", "common.pt", "truncate", "truncated-file"),
    Damage("megatron", "wrong-size", "megatron_torch_dist_tp2", "__1_0.distcp", "empty", "empty-file"),
    Damage("megatron", "garbage-metadata", "megatron_torch_dist_tp2", "metadata.json", "garbage", "bad-metadata"),
    Damage("megatron", "garbage-metadata", "megatron_torch_dist_tp2", ".metadata", "garbage", "bad-metadata"),
    Damage("megatron", "garbage-metadata", "megatron_run", "latest_checkpointed_iteration.txt", "garbage",
           "bad-metadata"),
    Damage("megatron", "path-escape", "megatron_torch_dist_tp2", "__1_0.distcp", "symlink-out", "path-escape"),
    # megatron zarr backend: a chunk file, a .zarray, a ShardedObject's shard_*.pt
    Damage("megatron", "missing-file", "megatron_zarr_tp2", "decoder.layers.mlp.linear_fc1.weight/1.0.0", "remove",
           "missing-chunk"),
    Damage("megatron", "truncated-file", "megatron_zarr_tp2", "decoder.layers.mlp.linear_fc1.weight/1.0.0",
           "truncate", "bad-chunk"),
    Damage("megatron", "truncated-file", "megatron_zarr_tp2", "decoder.layers.mlp.linear_fc1._extra_state/shard_1_2.pt",
           "truncate", "truncated-file"),
    Damage("megatron", "wrong-size", "megatron_zarr_tp2", "embedding.word_embeddings.weight/1.0", "grow", "bad-chunk"),
    Damage("megatron", "garbage-metadata", "megatron_zarr_tp2", "output_layer.weight/.zarray", "garbage",
           "bad-array-metadata"),
    Damage("megatron", "path-escape", "megatron_zarr_tp2", "output_layer.weight/0.0", "symlink-out", "path-escape"),
    # NeMo 2: a rank's .distcp under weights/, the context's io.json and model.yaml
    Damage("megatron", "missing-file", "megatron_nemo2", "weights/__1_0.distcp", "remove", "missing-file"),
    Damage("megatron", "missing-file", "megatron_nemo2", "context/io.json", "remove", "missing-file"),
    Damage("megatron", "truncated-file", "megatron_nemo2", "weights/common.pt", "truncate", "truncated-file"),
    Damage("megatron", "garbage-metadata", "megatron_nemo2", "context/model.yaml", "garbage", "bad-metadata"),
    Damage("megatron", "garbage-metadata", "megatron_nemo2", "context/io.json", "garbage", "bad-metadata"),
    Damage("megatron", "path-escape", "megatron_nemo2", "weights/__0_0.distcp", "symlink-out", "path-escape"),
    # legacy mp_rank_* saves: a rank's file, its directory
    Damage("megatron", "missing-file", "megatron_legacy", "iter_0000005/mp_rank_01/model_optim_rng.pt", "remove",
           "missing-file"),
    Damage("megatron", "truncated-file", "megatron_legacy", "iter_0000005/mp_rank_01/model_optim_rng.pt", "truncate",
           "truncated-file"),
    Damage("megatron", "wrong-size", "megatron_legacy", "iter_0000005/mp_rank_00/model_optim_rng.pt", "flip-storage",
           "bad-chunk", deep=True),
    Damage("megatron", "garbage-metadata", "megatron_legacy", "iter_0000005/mp_rank_00/model_optim_rng.pt", "garbage",
           "bad-metadata"),
    Damage("megatron", "path-escape", "megatron_legacy", "iter_0000005/mp_rank_01/model_optim_rng.pt", "symlink-out",
           "path-escape"),
]

FUZZ = [
    # megatron is not in the test venv (the catalogue compares with its recorded loads): the contract
    # alone, no internal error, hang, signal or unbounded memory. Its files take the other formats'
    # kinds by name (.metadata, .distcp, .pt), a step directory's files byte-level damage
    FixtureSpec("megatron_torch_dist_tp2", "megatron", None),
    FixtureSpec("megatron_torch_dist_fully_sharded", "megatron", None),
    FixtureSpec("megatron_run", "megatron", None),
    FixtureSpec("megatron_legacy", "megatron", None),
]
FUZZ_WEIGHT = {"megatron": 0.05}

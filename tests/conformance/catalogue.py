"""The conformance suite's catalogue: every committed real-writer fixture, its format, and how to
ask the writing library what it holds; per format, how each damage class is made.

The suite (tests/conformance/test_conformance_*.py) is parameterised over `cases()`: every
format the registry (`ckpt_tool.formats.registered()`) lists, times every ENTRY of that format.
`test_conformance_catalogue.py` fails when a registered format has no entry, or when a directory
under fixtures/ is in no entry (nor in NOT_CHECKPOINTS): a format or fixture dropped in is picked
up, or flagged. Adding a format = its package + registry line (ckpt_tool/formats), its fixtures
(fixtures/), and here: its ENTRIES, its DAMAGE rows, and (if it writes) its library loader in
references.values.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import references as R
from conftest import FIXTURES

# --------------------------------------------------------------------------
# the registry (ckpt_tool.formats): the suite asks it which formats there are
# --------------------------------------------------------------------------


def registered() -> list:
    """The registry's FormatInfo list, in detection order."""
    from ckpt_tool import formats

    return list(formats.registered())


def writable() -> list[str]:
    """Names of the formats with a writer (`convert --to`)."""
    from ckpt_tool import formats

    return list(formats.writable())


def detected(path: Path) -> str:
    """The registered format whose package reads `path` (as ckpt_tool.open picks it)."""
    from ckpt_tool import formats
    from ckpt_tool.storage import Storage

    single = formats.split_file(str(path))
    if single is not None:
        return single[0].name
    module = formats.detect(Storage.open(str(path)))
    return next(f.name for f in registered() if module.__name__ == f.package or module.__name__.startswith(f.package + "."))


# --------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    path: str  # under fixtures/ (a directory, a step of a root, or one file)
    format: str  # the registry name of the format that reads it
    reference: Callable[[Path, str | None], dict]  # the writing library's view (references.py)
    values: Callable[[Path, str | None], dict] | None = None  # ... and its values; None: as `reference`'s kind
    step: str | None = None  # --step, for a root with several steps
    str_keys: bool = False  # compare key paths as strings (flax's restore of an orbax save)
    # targets that must refuse it (an array dtype the target has no equivalent for): {target: message part}
    refused_by: tuple[tuple[str, str], ...] = ()

    @property
    def id(self) -> str:
        return f"{self.path}@{self.step}" if self.step else self.path

    @property
    def top(self) -> str:
        """The directory directly under fixtures/ it belongs to."""
        return self.path.split("/")[0]

    def library_values(self) -> Callable[[Path, str | None], dict] | None:
        return self.values or VALUES.get(self.reference)

    def full(self, root: Path = FIXTURES) -> Path:
        return root / self.path


def _LEGACY(name: str) -> dict:  # noqa: N802 - reads as the loader it gives
    return {"reference": R.legacy_recorded(name), "values": R.legacy_recorded_values(name)}


# reference loader -> the same library's values
VALUES = {R.orbax_live: R.orbax_live_values, R.dcp_live: R.dcp_live_values, R.orbax_recorded: R.orbax_recorded_values,
          R.safetensors_live: R.safetensors_live_values, R.safetensors_dcp_hf: R.safetensors_dcp_hf_values,
          R.torch_live: R.torch_live_values, R.megatron_recorded: R.megatron_recorded_values}
ENTRIES: list[Entry] = [
    # orbax-checkpoint 0.12.8 (fixtures/generate.py): read live with the installed orbax
    Entry("orbax_ocdbt_zarr2", "orbax", R.orbax_live),
    Entry("orbax_ocdbt_zarr3", "orbax", R.orbax_live),
    Entry("orbax_plain_zarr2", "orbax", R.orbax_live),
    Entry("orbax_two_process", "orbax", R.orbax_live),
    Entry("orbax_manager", "orbax", R.orbax_live, step="1"),
    Entry("orbax_manager", "orbax", R.orbax_live, step="2"),
    # orbax 0.5 / 0.9 / 0.11 (gen_orbax_versions.py): their own restore, recorded
    *[Entry(f"{fam}/{save}", "orbax", R.orbax_recorded)
      for fam in ("orbax_v0_5", "orbax_v0_9", "orbax_v0_11")
      for save in ("standard", "plain", "manager", "manager_plain")],
    # torch 2.13 DCP: read live with torch
    Entry("dcp_single", "dcp", R.dcp_live),
    Entry("dcp_multirank", "dcp", R.dcp_live),
    Entry("dcp_fsdp2_adam", "dcp", R.dcp_live),
    Entry("dcp_conj", "dcp", R.dcp_live, refused_by=(("safetensors", "complex128 has no safetensors equivalent"),)),
    *[Entry(n, "dcp", R.dcp_live) for n in
      ("dcp_zstd", "dcp_dups", "dcp_dups_replicated", "dcp_dups_zstd", "dcp_threads")],
    # safetensors (transformers, safetensors.numpy, DCP's HF writer): safe_open / torch's HF reader
    Entry("safetensors_llama_sharded", "safetensors", R.safetensors_live),
    Entry("safetensors_llama_bf16", "safetensors", R.safetensors_live),
    Entry("safetensors_numpy", "safetensors", R.safetensors_live),
    Entry("safetensors_dcp_rank0", "safetensors", R.safetensors_live),
    Entry("safetensors_dcp_consolidated", "safetensors", R.safetensors_live),
    Entry("safetensors_dcp_distributed", "safetensors", R.safetensors_dcp_hf),
    # flax 0.7.5 / orbax 0.4.1 / t5x's calls (gen_legacy_jax.py): recorded restores
    Entry("orbax_v0_4_ocdbt", "msgpack", **_LEGACY("orbax_v0_4_ocdbt")),
    Entry("orbax_v0_4_plain", "msgpack", **_LEGACY("orbax_v0_4_plain")),
    Entry("orbax_v0_4_manager", "msgpack", **_LEGACY("orbax_v0_4_manager.1"), step="1"),
    Entry("orbax_v0_4_manager", "msgpack", **_LEGACY("orbax_v0_4_manager.2"), step="2"),
    Entry("flax_orbax", "msgpack", **_LEGACY("flax_orbax.1"), step="1", str_keys=True),
    Entry("flax_orbax", "msgpack", **_LEGACY("flax_orbax.2"), step="2", str_keys=True),
    Entry("flax_msgpack", "msgpack", **_LEGACY("flax_msgpack.1"), step="1"),
    Entry("flax_msgpack", "msgpack", **_LEGACY("flax_msgpack.2"), step="2"),
    Entry("flax_msgpack/checkpoint_1", "msgpack", **_LEGACY("flax_msgpack.1")),  # one file, by its path
    Entry("flax_to_bytes/state.msgpack", "msgpack", **_LEGACY("flax_to_bytes")),
    Entry("flax_chunked", "msgpack", **_LEGACY("flax_chunked")),
    Entry("t5x", "msgpack", **_LEGACY("t5x.1")),
    # torch.save (gen_torch_save.py: transformers 4.57 .bin sets, torch 2.13): torch.load(weights_only=True)
    Entry("torch_hf_bin_sharded", "torch", R.torch_live),
    Entry("torch_hf_bin_single", "torch", R.torch_live),
    Entry("torch_hf_bin_single/pytorch_model.bin", "torch", R.torch_live),  # one file, by its path
    Entry("torch_state/state.pt", "torch", R.torch_live),
    Entry("torch_dcp_to_torch_save/full.pt", "torch", R.torch_live),
    # megatron-core 0.16 / 0.13 and Megatron-LM core_v0.16.1 (gen_megatron.py): megatron's own load, recorded
    Entry("megatron_torch_dist_tp2", "megatron", R.megatron_recorded),
    Entry("megatron_torch_dist_tp2_dp2", "megatron", R.megatron_recorded),
    Entry("megatron_torch_dist_fully_sharded", "megatron", R.megatron_recorded),
    # 0.13 distributed optimizer, DP 4 / TP 2 x DP 2 / MoE, several buckets, SwiGLU, GQA (gen_megatron_distopt.py)
    Entry("megatron_distopt_dp4", "megatron", R.megatron_recorded),
    Entry("megatron_distopt_tp2_dp2", "megatron", R.megatron_recorded),
    Entry("megatron_distopt_moe", "megatron", R.megatron_recorded),  # EP 2, chained dense + expert optimizers
    Entry("megatron_distopt_pp2_dp2", "megatron", R.megatron_recorded),  # PP 2, tied embeddings across stages
    Entry("megatron_distopt_vpp", "megatron", R.megatron_recorded),  # PP 2 x VPP 2 (interleaved), RMSNorm
    Entry("megatron_distopt_instances", "megatron", R.megatron_recorded),  # 2 distributed-optimizer instances
    Entry("megatron_distopt_fp16_tp2_pp2", "megatron", R.megatron_recorded),  # fp16, TP 2 x PP 2
    Entry("megatron_distopt_moe_etp2", "megatron", R.megatron_recorded),  # experts EP 2 x ETP 2, dense TP 1
    Entry("megatron_run", "megatron", R.megatron_recorded),  # the tracker's step
    Entry("megatron_run", "megatron", R.megatron_recorded, step="10"),
    Entry("megatron_zarr_tp2", "megatron", R.megatron_recorded),  # 0.13's zarr backend (bfloat16 .zarray patch)
    # Megatron-LM --ckpt-format torch (mp_rank_0X/model_optim_rng.pt): torch.load(weights_only=True), recorded
    Entry("megatron_legacy", "megatron", R.megatron_legacy_recorded, values=R.megatron_legacy_recorded_values),
    # the same with --swiglu (gated linear_fc1), GQA, an untied output layer: megatron's own TP merge, recorded
    Entry("megatron_legacy_swiglu", "megatron", R.megatron_legacy_recorded, values=R.megatron_legacy_recorded_values),
    # NeMo 2 (IMITATED layout around megatron_torch_dist_tp2's save: weights/ + context/): megatron's load, safe_load
    Entry("megatron_nemo2", "megatron", R.megatron_nemo_recorded, values=R.megatron_nemo_recorded_values),
    # DeepSpeed 0.19 ZeRO (gen_deepspeed.py: 2 gloo ranks on CPU): zero_to_fp32 and DeepSpeed's own
    # per-parameter optimizer state, recorded in _reference.json
    *[Entry(n, "deepspeed", R.deepspeed_recorded, values=R.deepspeed_recorded_values) for n in
      ("deepspeed_z1_fp32", "deepspeed_z1_bf16", "deepspeed_z2_fp32", "deepspeed_z2_bf16", "deepspeed_z3_fp32", "deepspeed_z3_bf16")],
    # the same on 4 gloo ranks, fp16 training (dynamic loss scaling), and a transformers Llama (tied embeddings,
    # config.json beside `latest`) trained under ZeRO-3
    *[Entry(n, "deepspeed", R.deepspeed_recorded, values=R.deepspeed_recorded_values) for n in
      ("deepspeed_z2_fp32_dp4", "deepspeed_z3_bf16_dp4", "deepspeed_z1_bf16_dp4", "deepspeed_z1_fp16", "deepspeed_z2_fp16",
       "deepspeed_z3_fp16", "deepspeed_z3_hf_llama")],
    # ZeRO-3 bf16 on 4 ranks of an attention model whose sizes 4 does not divide (qkv 63x21, proj 21x21,
    # a 3-element per-head scale), three optimizer groups cut into six sub-groups (sub_group_size)
    Entry("deepspeed_z3_bf16_uneven", "deepspeed", R.deepspeed_recorded, values=R.deepspeed_recorded_values),
    Entry("deepspeed_z3_bf16/global_step2", "deepspeed", R.deepspeed_recorded,
          values=R.deepspeed_recorded_values),  # a step directory, given as itself
    # DeepSpeed 0.19's ds_to_universal of each of those (gen_deepspeed.py): torch.load of every file, recorded
    *[Entry(f"deepspeed_universal_{n}", "deepspeed-universal", R.deepspeed_universal_recorded,
            values=R.deepspeed_universal_recorded_values)
      for n in ("z1_fp32", "z1_bf16", "z2_fp32", "z2_bf16", "z3_fp32", "z3_bf16", "z3_bf16_uneven")],
    Entry("deepspeed_universal_z3_bf16/global_step2_universal", "deepspeed-universal", R.deepspeed_universal_recorded,
          values=R.deepspeed_universal_recorded_values),  # a universal step directory, given as itself
    # DeepSpeed 0.19 pipeline parallel (2 stages; x2 DP) and MoE (4 experts, ep_size 1 and 2), gloo on CPU
    # (gen_deepspeed_pipe_moe.py): DeepSpeed's per-parameter fp32 weights and Adam state gathered in the run
    *[Entry(n, "deepspeed", R.deepspeed_pipe_moe_recorded, values=R.deepspeed_pipe_moe_recorded_values,
            refused_by=(("deepspeed-universal", "pipeline-parallel or MoE"),))
      for n in ("deepspeed_pp2_z1", "deepspeed_pp2_dp2_z1", "deepspeed_moe_ep1_z2", "deepspeed_moe_ep2_z2")],
]

# directories under fixtures/ that are not checkpoints (the legacy references themselves)
NOT_CHECKPOINTS = {"legacy_jax_reference", "torch_legacy"}  # (torch_legacy: refused by name, tests/test_torch_save.py)
# run roots of several steps (fixtures/gen_runs.py), torn newest steps included: tests/test_runs.py checks
# ls / latest / diff --step-a on each against the writing framework's own step rules; their steps are
# checkpoints of formats the entries above cover
RUN_ROOTS = {"runs_hf_trainer", "runs_nemo2", "runs_orbax", "runs_torchtitan", "runs_verl"}
NOT_CHECKPOINTS |= RUN_ROOTS


def fixture_dirs(root: Path = FIXTURES) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def uncatalogued(entries: Iterable[Entry] = (), root: Path = FIXTURES,
                 not_checkpoints: Iterable[str] = NOT_CHECKPOINTS) -> list[str]:
    """Fixture directories no entry covers (a new fixture nobody wired in); in a family directory
    that is no checkpoint itself (orbax_v0_5/: one save per sub-directory), each member too."""
    entries = list(entries or ENTRIES)
    out = []
    for d in fixture_dirs(root):
        if d in set(not_checkpoints):
            continue
        paths = [e.path for e in entries if e.top == d]
        if not paths:
            out.append(d)
        elif d not in paths:  # a family: every member (not _reference.json and the like) is an entry
            for child in sorted((root / d).iterdir()):
                rel = f"{d}/{child.name}"
                if not child.name.startswith(("_", ".")) and not any(p == rel or p.startswith(rel + "/")
                                                                      for p in paths):
                    out.append(rel)
    return out


def formats_without_fixtures(infos: Iterable = (), entries: Iterable[Entry] = ()) -> list[str]:
    """Registered formats no entry exercises (a new format without fixtures)."""
    have = {e.format for e in (entries or ENTRIES)}
    return [f.name for f in (infos or registered()) if f.name not in have]


def unregistered_entries(infos: Iterable = (), entries: Iterable[Entry] = ()) -> list[str]:
    """Entries whose format the registry does not know (a format renamed or dropped)."""
    names = {f.name for f in (infos or registered())}
    return [e.id for e in (entries or ENTRIES) if e.format not in names]


def cases(infos: Iterable = (), entries: Iterable[Entry] = ()) -> list[Entry]:
    """Every (registered format x its entries): what the properties are parameterised over."""
    names = [f.name for f in (infos or registered())]
    return [e for n in names for e in (entries or ENTRIES) if e.format == n]


def takes(target: str, source_format: str) -> bool:
    """Whether `target`'s writer takes a checkpoint of `source_format` (the registry's writes_from)."""
    from ckpt_tool import formats

    allowed = formats.get(target).writes_from
    return not allowed or source_format in allowed


def refusals(e: Entry) -> dict[str, str]:
    """{target: a part of its one-line refusal} for the targets that must refuse entry e: its own
    refused_by, and the writers that take checkpoints of other formats only."""
    out = dict(e.refused_by)
    for to in writable():
        if not takes(to, e.format):
            out.setdefault(to, "checkpoints only")
    return out


def converts_exactly(e: Entry, to: str) -> bool:
    """Whether converting e to `to` keeps its tree and values (so `diff` says same). A writer that
    takes certain formats only writes their checkpoints as that format's own tool does:
    DeepSpeed's ds_to_universal changes what it writes (a tied name's 16-bit module weights,
    buffers cast to float32), which its own tests check file for file (tests/test_deepspeed_universal.py)."""
    from ckpt_tool import formats

    return not formats.get(to).writes_from


# --------------------------------------------------------------------------
# damage: per format, the file each damage class hits, and the finding code it must give
# --------------------------------------------------------------------------

DAMAGE_CLASSES = ("missing-file", "truncated-file", "wrong-size", "garbage-metadata", "path-escape")


@dataclass(frozen=True)
class Damage:
    format: str
    cls: str  # one of DAMAGE_CLASSES
    fixture: str  # an entry path
    target: str  # glob (under the fixture) of the file damaged
    how: str  # a key of HOW
    code: str  # the finding code validate must report
    deep: bool = False  # only --deep reads the damaged bytes
    step: str | None = None

    @property
    def id(self) -> str:
        return f"{self.format}-{self.cls}-{self.fixture}:{self.how}"


def _truncate(p: Path, work: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _empty(p: Path, work: Path) -> None:
    p.write_bytes(b"")


def _grow(p: Path, work: Path) -> None:
    with open(p, "ab") as f:
        f.write(b"\0" * 64)


def _garbage(p: Path, work: Path) -> None:
    p.write_bytes(b"\x00garbage{not metadata")


def _symlink_out(p: Path, work: Path) -> None:
    """The file becomes a link to a same-content copy OUTSIDE the checkpoint."""
    outside = work / f"outside-{p.name}"
    shutil.copyfile(p, outside)
    p.unlink()
    p.symlink_to(outside)


def _header_length(p: Path, work: Path) -> None:
    """safetensors: the 8-byte header length off by 8."""
    data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    p.write_bytes(struct.pack("<Q", n + 8) + data[8:])


def _storage_path_escape(p: Path, work: Path) -> None:
    """DCP: a storage entry's relative_path climbs out ('../x.distcp', a real file there)."""
    import fuzz_lib

    data = p.read_bytes()
    (p.parent.parent / "x.distcp").write_bytes((p.parent / "__1_0.distcp").read_bytes())
    new, _ = fuzz_lib.edit_storage_entry(data, "model.w", lambda info: setattr(info, "relative_path", "../x.distcp"))
    p.write_bytes(new)


def _flip_storage(p: Path, work: Path) -> None:
    """torch.save: one bit flipped inside the last storage member's data (its CRC-32 no longer matches)."""
    import zipfile

    with zipfile.ZipFile(p) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename and i.file_size), key=lambda i: i.header_offset)
    data = bytearray(p.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    data[info.header_offset + 30 + name_len + extra_len] ^= 0x01
    p.write_bytes(bytes(data))


HOW: dict[str, Callable[[Path, Path], None]] = {
    "flip-storage": _flip_storage,
    "remove": lambda p, work: p.unlink(),
    "truncate": _truncate,
    "empty": _empty,
    "grow": _grow,
    "garbage": _garbage,
    "symlink-out": _symlink_out,
    "header-length": _header_length,
    "storage-path": _storage_path_escape,
}

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
    # dcp: a rank's .distcp, .metadata
    Damage("dcp", "missing-file", "dcp_multirank", "__1_0.distcp", "remove", "missing-file"),
    Damage("dcp", "truncated-file", "dcp_multirank", "__1_0.distcp", "truncate", "truncated-file"),
    Damage("dcp", "wrong-size", "dcp_multirank", "__1_0.distcp", "empty", "empty-file"),
    Damage("dcp", "garbage-metadata", "dcp_multirank", ".metadata", "garbage", "bad-metadata"),
    Damage("dcp", "path-escape", "dcp_multirank", "__1_0.distcp", "symlink-out", "path-escape"),
    Damage("dcp", "path-escape", "dcp_multirank", ".metadata", "storage-path", "path-escape"),
    # safetensors: a shard, its header, the index
    Damage("safetensors", "missing-file", "safetensors_llama_sharded", "model-00002-of-00004.safetensors",
           "remove", "missing-file"),
    Damage("safetensors", "truncated-file", "safetensors_llama_sharded", "model-00002-of-00004.safetensors",
           "truncate", "truncated-file"),
    Damage("safetensors", "wrong-size", "safetensors_llama_sharded", "model-00002-of-00004.safetensors",
           "header-length", "bad-metadata"),
    Damage("safetensors", "wrong-size", "safetensors_numpy", "model.safetensors", "grow", "bad-metadata"),
    Damage("safetensors", "garbage-metadata", "safetensors_llama_sharded", "model.safetensors.index.json",
           "garbage", "bad-metadata"),
    Damage("safetensors", "path-escape", "safetensors_llama_sharded", "model-00002-of-00004.safetensors",
           "symlink-out", "path-escape"),
    # msgpack: a Flax msgpack file, a T5X array chunk
    Damage("msgpack", "missing-file", "t5x", "checkpoint_1/target.encoder.token_embedder.embedding/0.0",
           "remove", "missing-chunk"),
    Damage("msgpack", "truncated-file", "flax_msgpack", "checkpoint_2", "truncate", "truncated-file"),
    Damage("msgpack", "truncated-file", "t5x", "checkpoint_1/target.encoder.token_embedder.embedding/0.0",
           "truncate", "bad-chunk", deep=True),
    Damage("msgpack", "wrong-size", "flax_msgpack", "checkpoint_2", "grow", "bad-metadata"),
    Damage("msgpack", "garbage-metadata", "flax_msgpack", "checkpoint_2", "garbage", "bad-metadata"),
    Damage("msgpack", "path-escape", "t5x", "checkpoint_1/target.encoder.token_embedder.embedding/0.0",
           "symlink-out", "path-escape"),
    Damage("msgpack", "path-escape", "flax_msgpack", "checkpoint_2", "symlink-out", "path-escape"),
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
    # deepspeed: a rank's optimizer states (stage 2) or model states (stage 3), `latest`, a model-states file
    Damage("deepspeed", "missing-file", "deepspeed_z2_fp32", "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt",
           "remove", "missing-file"),
    Damage("deepspeed", "missing-file", "deepspeed_z3_fp32", "global_step2/zero_pp_rank_1_mp_rank_00_model_states.pt",
           "remove", "missing-file"),
    Damage("deepspeed", "truncated-file", "deepspeed_z3_bf16",
           "global_step2/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "truncate", "truncated-file"),
    Damage("deepspeed", "wrong-size", "deepspeed_z2_bf16", "global_step2/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
           "empty", "empty-file"),
    Damage("deepspeed", "wrong-size", "deepspeed_z3_fp32", "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt",
           "flip-storage", "bad-chunk", deep=True),
    Damage("deepspeed", "garbage-metadata", "deepspeed_z1_fp32", "latest", "garbage", "bad-metadata"),
    # the 4-rank saves (a middle rank's file) and fp16 training's files (no prefix, the loss scaler's pickle)
    Damage("deepspeed", "missing-file", "deepspeed_z2_fp32_dp4", "global_step2/zero_pp_rank_2_mp_rank_00_optim_states.pt",
           "remove", "missing-file"),
    Damage("deepspeed", "missing-file", "deepspeed_z3_bf16_dp4",
           "global_step2/zero_pp_rank_3_mp_rank_00_model_states.pt", "remove", "missing-file"),
    Damage("deepspeed", "wrong-size", "deepspeed_z3_bf16_dp4",
           "global_step2/bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt", "flip-storage", "bad-chunk", deep=True),
    Damage("deepspeed", "truncated-file", "deepspeed_z2_fp16", "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt",
           "truncate", "truncated-file"),
    Damage("deepspeed", "garbage-metadata", "deepspeed_z3_fp16", "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt",
           "garbage", "bad-metadata"),
    Damage("deepspeed", "garbage-metadata", "deepspeed_z2_fp32", "global_step2/mp_rank_00_model_states.pt", "garbage",
           "bad-metadata"),
    Damage("deepspeed", "path-escape", "deepspeed_z2_fp32", "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt",
           "symlink-out", "path-escape"),
    # deepspeed-universal: a parameter's state file, the optimizer's global state, latest_universal
    Damage("deepspeed-universal", "missing-file", "deepspeed_universal_z2_bf16",
           "global_step2_universal/zero/layers.0.up.weight/exp_avg.pt", "remove", "missing-file"),
    Damage("deepspeed-universal", "missing-file", "deepspeed_universal_z3_fp32",
           "global_step2_universal/zero/optimizer_state.pt", "remove", "missing-file"),
    Damage("deepspeed-universal", "truncated-file", "deepspeed_universal_z1_fp32",
           "global_step2_universal/zero/embed.weight/fp32.pt", "truncate", "truncated-file"),
    Damage("deepspeed-universal", "wrong-size", "deepspeed_universal_z3_bf16",
           "global_step2_universal/zero/mix/exp_avg_sq.pt", "empty", "empty-file"),
    Damage("deepspeed-universal", "wrong-size", "deepspeed_universal_z2_fp32",
           "global_step2_universal/zero/layers.1.down.weight/fp32.pt", "flip-storage", "bad-chunk", deep=True),
    Damage("deepspeed-universal", "garbage-metadata", "deepspeed_universal_z1_bf16", "latest_universal", "garbage",
           "bad-metadata"),
    Damage("deepspeed-universal", "garbage-metadata", "deepspeed_universal_z3_fp32",
           "global_step2_universal/zero/optimizer_state.pt", "garbage", "bad-metadata"),
    Damage("deepspeed-universal", "path-escape", "deepspeed_universal_z2_fp32",
           "global_step2_universal/zero/layers.0.norm.bias/fp32.pt", "symlink-out", "path-escape"),
    # deepspeed pipeline parallel / MoE: a layer file, a stage's optimizer states, an expert file
    Damage("deepspeed", "missing-file", "deepspeed_pp2_z1", "global_step2/layer_02-model_states.pt", "remove",
           "missing-file"),
    Damage("deepspeed", "missing-file", "deepspeed_pp2_z1", "global_step2/zero_pp_rank_0_mp_rank_01_optim_states.pt",
           "remove", "missing-file"),
    Damage("deepspeed", "missing-file", "deepspeed_pp2_dp2_z1", "global_step2/mp_rank_01_model_states.pt", "remove",
           "missing-file"),
    Damage("deepspeed", "missing-file", "deepspeed_moe_ep2_z2", "global_step2/layer_0_expert_3_mp_rank_00_model_states.pt",
           "remove", "missing-file"),
    Damage("deepspeed", "truncated-file", "deepspeed_pp2_dp2_z1",
           "global_step2/zero_pp_rank_1_mp_rank_01_optim_states.pt", "truncate", "truncated-file"),
    Damage("deepspeed", "truncated-file", "deepspeed_moe_ep1_z2",
           "global_step2/layer_0_expert_1_mp_rank_00_model_states.pt", "truncate", "truncated-file"),
    Damage("deepspeed", "wrong-size", "deepspeed_pp2_z1", "global_step2/zero_pp_rank_0_mp_rank_01_optim_states.pt",
           "flip-storage", "bad-chunk", deep=True),
    Damage("deepspeed", "wrong-size", "deepspeed_moe_ep2_z2", "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt",
           "flip-storage", "bad-chunk", deep=True),
    Damage("deepspeed", "garbage-metadata", "deepspeed_pp2_z1", "global_step2/mp_rank_01_model_states.pt", "garbage",
           "bad-metadata"),
]


# {format: {damage class: why it cannot happen}} for classes a format cannot suffer
NOT_APPLICABLE: dict[str, dict[str, str]] = {}


def damage_cases(infos: Iterable = (), damage: Iterable[Damage] = ()) -> list[Damage]:
    names = [f.name for f in (infos or registered())]
    return [d for n in names for d in (damage or DAMAGE) if d.format == n]


def damaged_copy(d: Damage, work: Path, root: Path = FIXTURES) -> tuple[Path, str]:
    """A copy of d's fixture under work/ with d applied; (checkpoint path, damaged file's relative path)."""
    src = root / d.fixture
    dst = work / "ckpt" / Path(d.fixture).name
    shutil.copytree(src, dst, symlinks=True)
    [target] = sorted(glob.glob(os.path.join(dst, d.target)))[:1]
    HOW[d.how](Path(target), work)
    return dst, os.path.relpath(target, dst)


def with_entries(entries: list[Entry], **changes) -> list[Entry]:  # noqa: ANN003
    return [dataclasses.replace(e, **changes) for e in entries]

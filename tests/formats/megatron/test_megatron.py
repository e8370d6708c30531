"""Megatron specifics the conformance suite does not cover (it checks every fixture against megatron's
recorded load, validate --strict, convert, and one damage per class): which step a run root opens and
what an interrupted one looks like, tracker errors, the zarr backend's bfloat16 arrays against their
raw chunk bytes, legacy mp_rank_* trees per rank (the master params' partition_dim, a missing rank, a
distrib_optim.pt), integrity.json, a NeMo 2 checkpoint's context values and hostile YAML, `convert
--unstack` against megatron's own per-layer tensors, and that inspect/validate import no torch or
megatron."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, ROOT

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

RUN = FIXTURES / "megatron_run"
TP2 = FIXTURES / "megatron_torch_dist_tp2"
ZARR = FIXTURES / "megatron_zarr_tp2"
LEGACY = FIXTURES / "megatron_legacy"
NEMO = FIXTURES / "megatron_nemo2"


def _copy(src: Path, tmp_path: Path, name: str | None = None) -> Path:
    dst = tmp_path / (name or src.name)
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _validate(ckpt, *args) -> dict:  # noqa: ANN001
    r = ckpt("validate", "--json", *map(str, args))
    doc = json.loads(r.stdout)
    doc["returncode"] = r.returncode
    return doc


def _codes(doc: dict, severity: str = "error") -> list[tuple[str, str | None]]:
    return [(f["code"], f["file"]) for f in doc["findings"] if f["severity"] == severity]


def _one_line_error(r) -> str:  # noqa: ANN001
    assert r.returncode == 1, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    return lines[0]


# --------------------------------------------------------------------------------------------
# run roots: which step, interrupted steps, the tracker
# --------------------------------------------------------------------------------------------

def test_run_root_opens_the_trackers_step_and_others_by_step():
    import ckpt_tool

    latest = ckpt_tool.open(str(RUN))
    assert latest.step == 20 and [s.name for s in latest.steps] == ["iter_0000010", "iter_0000020"]
    for step in ("10", "iter_0000010", 10):
        ck = ckpt_tool.open(str(RUN), step=step)
        iteration = next(leaf for leaf in ck.leaves if leaf.keys == ("iteration",))
        assert ck.step == 10 and iteration.load() == 10


def test_a_step_newer_than_the_tracker_is_not_chosen_and_shown_uncommitted(tmp_path, ckpt):
    import ckpt_tool

    root = _copy(RUN, tmp_path)
    (root / "latest_checkpointed_iteration.txt").write_text("10")
    ck = ckpt_tool.open(str(root))
    assert ck.step == 10
    newer = next(s for s in ck.steps if s.name == "iter_0000020")
    assert not newer.committed and "newer than latest_checkpointed_iteration.txt" in newer.reason
    asked = ckpt_tool.open(str(root), step=20)  # asked for by name: read, but not called committed
    assert asked.committed is False and "save may not have finished" in asked.notes[0]


def test_an_interrupted_step_without_metadata_json(tmp_path, ckpt):
    import ckpt_tool

    root = _copy(RUN, tmp_path)
    (root / "iter_0000020" / "metadata.json").unlink()  # rank 0 writes it last: the save did not finish
    (root / "latest_checkpointed_iteration.txt").unlink()
    ck = ckpt_tool.open(str(root))  # no tracker: the newest complete step
    assert ck.step == 10
    assert [(s.name, s.committed) for s in ck.steps] == [("iter_0000010", True), ("iter_0000020", False)]
    doc = _validate(ckpt, root)
    assert ("uncommitted-save", "iter_0000020") in _codes(doc, "warning") and doc["returncode"] == 0
    line = _one_line_error(ckpt("inspect", root, "--step", "20"))
    assert "no metadata.json: an interrupted Megatron save" in line
    doc = _validate(ckpt, root, "--step", "20")
    assert ("uncommitted-save", "iter_0000020/metadata.json") in _codes(doc)


@pytest.mark.parametrize("text, inspect_says, code", [
    ("twenty", "'twenty' is not an iteration number (or 'release')", "bad-metadata"),
    ("30", "latest_checkpointed_iteration.txt names iter_0000030, which does not exist", "missing-file"),
    ("release", "latest_checkpointed_iteration.txt names release, which does not exist", "missing-file"),
])
def test_tracker_errors(tmp_path, ckpt, text, inspect_says, code):
    root = _copy(RUN, tmp_path)
    (root / "latest_checkpointed_iteration.txt").write_text(text)
    assert inspect_says in _one_line_error(ckpt("inspect", root))
    doc = _validate(ckpt, root)
    assert doc["returncode"] == 1 and (code, "latest_checkpointed_iteration.txt") in _codes(doc)


def test_step_given_to_a_single_save_is_refused(ckpt):
    r = ckpt("inspect", TP2, "--step", "3")
    assert r.returncode == 2 and "--step 3 given, but this is one Megatron save" in r.stderr  # a usage error


# --------------------------------------------------------------------------------------------
# zarr backend
# --------------------------------------------------------------------------------------------

def test_zarr_bfloat16_arrays_are_their_raw_chunks():
    """Every array of the 0.13 zarr save: `.zarray` says "bfloat16" (megatron's patch of zarr's "<V2"),
    and ckpt's read (through tensorstore) is the chunk files' little-endian bf16 bytes placed on the
    chunk grid, assembled here by hand; and its sha256 is what megatron's own load recorded."""
    import ml_dtypes

    import ckpt_tool

    ref = {r["keys"][0]: r for r in json.loads((ZARR / "_reference.json").read_text())["saves"]["."]["leaves"]}
    ck = ckpt_tool.open(str(ZARR))
    arrays = [leaf for leaf in ck.leaves if leaf.kind == "array"]
    assert len(arrays) == len(ref) == 17
    for leaf in arrays:
        zmeta = json.loads((ZARR / leaf.name / ".zarray").read_text())
        assert zmeta["dtype"] == "bfloat16" and zmeta["compressor"] is None
        shape, chunks = zmeta["shape"], zmeta["chunks"]
        want = np.empty(shape, dtype=ml_dtypes.bfloat16)
        for idx in np.ndindex(*[-(-s // c) for s, c in zip(shape, chunks)]):
            raw = (ZARR / leaf.name / ".".join(map(str, idx))).read_bytes()
            block = np.frombuffer(raw, dtype="<u2").view(ml_dtypes.bfloat16).reshape(chunks)
            want[tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, chunks))] = block
        got = leaf.read()
        assert got.dtype == ml_dtypes.bfloat16 and got.tobytes() == want.tobytes(), leaf.name
        assert hashlib.sha256(got.tobytes()).hexdigest() == ref[leaf.name]["sha256"], leaf.name
        assert [float(x) for x in got.reshape(-1)[:4].astype(np.float32)] == ref[leaf.name]["first4"]


def test_zarr_sharded_objects_are_the_bare_objects():
    import ckpt_tool

    ck = ckpt_tool.open(str(ZARR))
    objects = {leaf.name: leaf for leaf in ck.leaves if leaf.kind == "value"}
    assert sorted(objects) == sorted(
        f"decoder.layers.{m}._extra_state/shard_{i}_2" for m in
        ("mlp.linear_fc1", "mlp.linear_fc2", "self_attention.linear_proj", "self_attention.linear_qkv") for i in (0, 1))
    leaf = objects["decoder.layers.mlp.linear_fc1._extra_state/shard_1_2"]
    assert leaf.keys == ("decoder", "layers", "mlp", "linear_fc1", "_extra_state", "shard_1_2")
    assert leaf.load() is None  # torch.save(None): not a one-element list as in torch_dist's bytes items


def test_a_zarr_chunk_file_is_never_read_as_msgpack(ckpt):
    """The chunk `1.0.0` ends in digits like a Flax step file: given by its path it is refused as a file
    inside the Megatron save, and the save itself is Megatron's (detection runs Megatron first)."""
    chunk = ZARR / "decoder.layers.mlp.linear_fc1.weight" / "1.0.0"
    line = _one_line_error(ckpt("inspect", chunk))
    assert "is a file inside a Megatron-Core checkpoint" in line and "msgpack" not in line.lower()
    r = ckpt("inspect", "--json", ZARR)
    assert r.returncode == 0 and json.loads(r.stdout)["format"] == "megatron"


def test_zarr_damage_beyond_the_catalogue(tmp_path, ckpt):
    save = _copy(ZARR, tmp_path)
    (save / "output_layer.weight" / ".zarray").unlink()  # chunks left without their metadata
    doc = _validate(ckpt, save)
    assert ("missing-metadata", "output_layer.weight/.zarray") in _codes(doc)
    (save / "stray").mkdir()
    (save / "stray" / "notes.txt").write_text("x")
    assert ("stray-file", "stray/") in _codes(_validate(ckpt, save), "warning")


# --------------------------------------------------------------------------------------------
# legacy mp_rank_* saves
# --------------------------------------------------------------------------------------------

def test_legacy_ranks_are_separate_subtrees_of_their_own_slices():
    """Each rank's state under its directory; the model's tensors merged over the TP ranks under model/
    (tests/formats/megatron/test_megatron_legacy_tp.py: equal to Megatron's own merge), each rank's slice a chunk of it."""
    import ckpt_tool

    ck = ckpt_tool.open(str(LEGACY))
    assert ck.step == 5 and ck.layout["ranks"] == 2
    by_rank: dict[str, dict] = {}
    for leaf in ck.leaves:
        by_rank.setdefault(leaf.keys[0], {})[leaf.keys[1:]] = leaf
    assert sorted(by_rank) == ["model", "mp_rank_00", "mp_rank_01"]
    assert by_rank["mp_rank_00"].keys() == by_rank["mp_rank_01"].keys()
    merged = by_rank["model"][("embedding", "word_embeddings", "weight")].read()
    r0, r1 = merged[:32], merged[32:]
    assert merged.shape == (64, 16) and r0.tobytes() != r1.tobytes()  # each rank's half of 64 rows
    rec = json.loads((LEGACY / "_reference.json").read_text())["saves"]
    for rank, got in (("mp_rank_00", r0), ("mp_rank_01", r1)):
        leaves = rec[f"iter_0000005/{rank}/model_optim_rng.pt"]["leaves"]
        want = next(x for x in leaves if x["keys"] == ["model", "embedding.word_embeddings.weight"])
        assert hashlib.sha256(got.tobytes()).hexdigest() == want["sha256"]
    args = by_rank["mp_rank_01"][("args",)].load()
    assert args["tensor_model_parallel_size"] == 2 and args["model_type"] == "ModelType(1)"


def test_legacy_master_params_keep_their_partition_dim():
    """Megatron pickles the fp32 master params with its tensor-parallel attributes: column-parallel
    weights and biases are split on axis 0, row-parallel weights (linear_proj, linear_fc2) on axis 1,
    layer norms and row-parallel biases are not tensor-parallel."""
    import ckpt_tool

    ck = ckpt_tool.open(str(LEGACY))
    masters = [leaf for leaf in ck.leaves if leaf.keys[:3] == ("mp_rank_00", "optimizer", "fp32_from_fp16_params")]
    assert len(masters) == 28 and all("tensor_parallel" in leaf.extra for leaf in masters)
    split = {}
    for leaf in masters:
        tp = leaf.extra["tensor_parallel"]
        split.setdefault(tp["partition_dim"] if tp["tensor_model_parallel"] else None, []).append(tuple(leaf.shape))
    assert sorted(set(split[1])) == [(16, 8), (16, 32)]  # linear_proj, linear_fc2 weights (TP-local)
    assert sorted(set(split[0])) == [(24,), (24, 16), (32,), (32, 16)]  # qkv, fc1, word embeddings
    assert set(split[None]) == {(16,), (32, 16)}  # layer norms, row-parallel biases; position embeddings
    model = [leaf for leaf in ck.leaves if leaf.keys[0] == "model" and leaf.kind == "array"]
    assert model and not any("tensor_parallel" in leaf.extra for leaf in model)
    assert any("carry Megatron's tensor-parallel attributes" in n for n in ck.notes)


def test_legacy_missing_rank_directory(tmp_path, ckpt):
    root = _copy(LEGACY, tmp_path)
    shutil.rmtree(root / "iter_0000005" / "mp_rank_01")
    doc = _validate(ckpt, root)
    assert doc["returncode"] == 1
    assert ("missing-file", "iter_0000005/mp_rank_01/model_optim_rng.pt") in _codes(doc)
    assert "rank directories missing: mp_rank_01" in _one_line_error(ckpt("inspect", root))
    r = ckpt("convert", root, tmp_path / "out", "--to", "safetensors", "--skip-unsupported")
    _one_line_error(r)
    assert not (tmp_path / "out").exists()


def test_legacy_rank_beyond_the_runs_sizes(tmp_path, ckpt):
    root = _copy(LEGACY, tmp_path)
    shutil.copytree(root / "iter_0000005" / "mp_rank_01", root / "iter_0000005" / "mp_rank_02")
    doc = _validate(ckpt, root)
    assert doc["returncode"] == 0
    assert ("stray-file", "iter_0000005/mp_rank_02/") in _codes(doc, "warning")


def test_legacy_distrib_optim_is_read_under_its_rank(tmp_path):
    """distrib_optim.pt (Megatron's get_parameter_state_dp_zero: per buffer index, per (param dtype,
    grad dtype) key, the flat fp32 param / exp_avg / exp_avg_sq; imitated here with torch.save of that
    structure): its tuple-of-dtypes key kept whole, as Megatron spells it."""
    import torch

    import ckpt_tool

    root = _copy(LEGACY, tmp_path)
    flat = torch.arange(12, dtype=torch.float32)
    state = {"buckets_coalesced": True,
             0: {(torch.bfloat16, torch.float32): {"param": flat, "exp_avg": flat * 2, "exp_avg_sq": flat * 3,
                                                   "numel_unpadded": 12}}}
    for rank in ("mp_rank_00", "mp_rank_01"):
        torch.save(state, root / "iter_0000005" / rank / "distrib_optim.pt")
    ck = ckpt_tool.open(str(root))
    leaf = next(x for x in ck.leaves if x.keys[:2] == ("mp_rank_01", "distrib_optim") and x.keys[-1] == "exp_avg")
    assert leaf.keys == ("mp_rank_01", "distrib_optim", 0, "(torch.bfloat16, torch.float32)", "exp_avg")
    assert leaf.read().tolist() == (flat * 2).tolist()
    assert ck.layout["rank_files"] == 4


def test_legacy_distrib_optim_required_by_the_runs_args(tmp_path, ckpt):
    """The run's args say --use-distributed-optimizer: a rank without distrib_optim.pt is missing a file."""
    import re
    import zipfile

    root = _copy(LEGACY, tmp_path)
    # the args' flag flipped in rank 0's pickle (torch cannot load the file without megatron's classes to
    # re-save it): the key's string, its LONG_BINPUT memo, then NEWFALSE (0x89) becomes NEWTRUE (0x88)
    path = root / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt"
    with zipfile.ZipFile(path) as zf:
        members = {i.filename: zf.read(i.filename) for i in zf.infolist()}
    pkl = next(n for n in members if n.endswith("/data.pkl"))
    flag = re.compile(rb"(X\x19\x00\x00\x00use_distributed_optimizer(?:q.|r....))\x89", re.DOTALL)
    assert len(flag.findall(members[pkl])) == 1
    members[pkl] = flag.sub(lambda m: m.group(1) + b"\x88", members[pkl])
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    import ckpt_tool

    args = next(x for x in ckpt_tool.open(str(root)).leaves if x.keys == ("mp_rank_00", "args")).load()
    assert args["use_distributed_optimizer"] is True
    doc = _validate(ckpt, root)
    assert ("missing-file", "iter_0000005/mp_rank_00/distrib_optim.pt") in _codes(doc)
    assert ("missing-file", "iter_0000005/mp_rank_01/distrib_optim.pt") in _codes(doc)


# --------------------------------------------------------------------------------------------
# integrity.json
# --------------------------------------------------------------------------------------------

def _write_manifest(save: Path) -> dict:
    """integrity.json exactly as megatron-core's save_integrity_manifest writes it (validation.py):
    every file directly in the save but the manifest, sorted, sha256 hexdigests, json.dump indent=2."""
    manifest = {e.name: hashlib.sha256(e.read_bytes()).hexdigest()
                for e in sorted(save.iterdir()) if e.is_file() and e.name != "integrity.json"}
    (save / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": manifest}, indent=2))
    return manifest


@pytest.fixture
def with_manifest(tmp_path):
    save = _copy(TP2, tmp_path)
    (save / "_reference.json").unlink()
    _write_manifest(save)
    return save


def test_integrity_manifest_of_a_good_save(with_manifest, ckpt):
    assert _validate(ckpt, "--strict", with_manifest)["returncode"] == 0
    doc = _validate(ckpt, "--strict", "--deep", with_manifest)
    assert doc["returncode"] == 0 and doc["checked"]["sha256_verified"] == 7
    r = ckpt("inspect", with_manifest)
    assert "integrity.json: sha256 of 7 files" in r.stdout


def test_integrity_a_changed_byte_is_found_by_deep_only(with_manifest, ckpt):
    path = with_manifest / "metadata.json"
    text = path.read_text()
    path.write_text(text.replace('"common_backend_version": 1', '"common_backend_version":1 '))  # same JSON meaning
    assert _validate(ckpt, "--strict", with_manifest)["returncode"] == 0  # no size or hash is read shallow
    doc = _validate(ckpt, "--deep", with_manifest)
    assert doc["returncode"] == 1 and _codes(doc) == [("digest-mismatch", "metadata.json")]
    assert "differs from integrity.json" in doc["findings"][0]["message"]


def test_integrity_a_named_file_missing(with_manifest, ckpt):
    (with_manifest / "__1_1.distcp").unlink()
    doc = _validate(ckpt, with_manifest)
    assert any(c == ("missing-file", "__1_1.distcp") and "integrity.json" in f["message"]
               for c, f in zip(_codes(doc), [f for f in doc["findings"] if f["severity"] == "error"]))


@pytest.mark.parametrize("edit, says", [
    (lambda d: {**d, "algorithm": "md5"}, "algorithm 'md5'"),
    (lambda d: {"algorithm": "sha256"}, "no 'files' mapping"),
    (lambda d: {**d, "files": {**d["files"], "common.pt": d["files"]["common.pt"].upper()}}, "64 lowercase hex"),
    (lambda d: [d], "not a JSON object"),
])
def test_integrity_manifest_errors(with_manifest, ckpt, edit, says):
    doc = json.loads((with_manifest / "integrity.json").read_text())
    (with_manifest / "integrity.json").write_text(json.dumps(edit(doc)))
    found = _validate(ckpt, with_manifest)
    assert found["returncode"] == 1
    assert any(f["code"] == "bad-metadata" and f["file"] == "integrity.json" and says in f["message"]
               for f in found["findings"]), found["findings"]
    assert ckpt("inspect", with_manifest).returncode == 0  # inspect notes it, reads no data


def test_integrity_manifest_without_algorithm_defaults_to_sha256(with_manifest, ckpt):
    doc = json.loads((with_manifest / "integrity.json").read_text())
    del doc["algorithm"]  # Megatron's verifier: manifest_data.get('algorithm', 'sha256')
    (with_manifest / "integrity.json").write_text(json.dumps(doc))
    assert _validate(ckpt, "--strict", "--deep", with_manifest)["returncode"] == 0


def test_integrity_unnamed_save_file_and_a_name_escaping(with_manifest, ckpt):
    shutil.copy(with_manifest / "__1_1.distcp", with_manifest / "__1_2.distcp")  # written after the manifest
    doc = json.loads((with_manifest / "integrity.json").read_text())
    doc["files"]["../outside.txt"] = "0" * 64
    (with_manifest / "integrity.json").write_text(json.dumps(doc))
    found = _validate(ckpt, with_manifest)
    assert ("unlisted-file", "__1_2.distcp") in _codes(found, "warning")
    assert any(code == "path-escape" for code, _ in _codes(found))


def test_integrity_in_a_run_roots_step(tmp_path, ckpt):
    root = _copy(RUN, tmp_path)
    _write_manifest(root / "iter_0000020")
    assert _validate(ckpt, "--strict", "--deep", root)["returncode"] == 0
    path = root / "iter_0000020" / "metadata.json"
    path.write_text(path.read_text() + "\n")  # the same JSON, not the same bytes
    doc = _validate(ckpt, "--deep", root)
    assert _codes(doc) == [("digest-mismatch", "iter_0000020/metadata.json")]


# --------------------------------------------------------------------------------------------
# NeMo 2
# --------------------------------------------------------------------------------------------

def test_nemo_weights_and_context_values():
    import ckpt_tool

    ck = ckpt_tool.open(str(NEMO))
    values = {leaf.keys: leaf.load() for leaf in ck.leaves if leaf.keys[0] == "context"}
    assert values[("context", "model", "_target_")] == "nemo.collections.llm.gpt.model.base.GPTModel"
    assert values[("context", "model", "config", "num_layers")] == 2
    assert values[("context", "model", "config", "hidden_size")] == 16
    assert values[("context", "model", "config", "params_dtype", "_target_")] == "torch.float32"
    assert values[("context", "model", "config", "layernorm_epsilon")] == 1e-05
    assert values[("context", "model", "model_transform")] is None
    # the weights are the TP2 save's logical tensors, by megatron's recorded digests
    ref = {r["keys"][0]: r["sha256"] for r in json.loads((NEMO / "_reference.json").read_text())["saves"]["weights"]["leaves"]}
    for leaf in ck.leaves:
        if leaf.kind == "array":
            assert hashlib.sha256(leaf.read().tobytes()).hexdigest() == ref[leaf.name]
    assert any("io.json" in n and "never does" in n for n in ck.notes)
    assert not any(leaf.keys[:2] == ("context", "io") for leaf in ck.leaves)


@pytest.mark.slow
@pytest.mark.parametrize("yaml_text, says", [
    ("!!python/object/apply:os.system ['touch {canary}']\n", "safe_load"),
    ("a: &a [1, 2]\n" + "".join(f"l{i}: &l{i} [*{'a' if i == 0 else f'l{i - 1}'}, *{'a' if i == 0 else f'l{i - 1}'}]\n"
                                 for i in range(30)), "unfolds to more than"),
    ("&a {x: *a}\n", "refers to itself"),
])
def test_nemo_hostile_model_yaml(tmp_path, ckpt, yaml_text, says):
    ck = _copy(NEMO, tmp_path)
    canary = tmp_path / "canary"
    (ck / "context" / "model.yaml").write_text(yaml_text.replace("{canary}", str(canary)))
    assert says in _one_line_error(ckpt("inspect", ck))
    doc = _validate(ckpt, ck)
    assert doc["returncode"] == 1 and ("bad-metadata", "context/model.yaml") in _codes(doc)
    assert not canary.exists()


def test_nemo_io_json_is_never_executed(tmp_path, ckpt):
    """io.json naming a hostile callable (a fiddle pyref to os.system) is listed, never imported or run."""
    ck = _copy(NEMO, tmp_path)
    canary = tmp_path / "canary"
    doc = json.loads((ck / "context" / "io.json").read_text())
    doc["objects"]["trainer_context_1"]["items"].append(
        ["Attr(name='hook')", {"type": "pyref", "module": "os", "name": "system"}, f"touch {canary}"])
    (ck / "context" / "io.json").write_text(json.dumps(doc))
    assert ckpt("inspect", ck).returncode == 0
    assert _validate(ckpt, "--strict", "--deep", ck)["returncode"] == 0
    assert not canary.exists()


def test_nemo_weights_given_directly_is_a_plain_save(ckpt):
    r = ckpt("inspect", "--json", NEMO / "weights")
    assert r.returncode == 0
    assert not any(leaf["keys"][0] == "context" for leaf in json.loads(r.stdout)["leaves"])


# --------------------------------------------------------------------------------------------
# convert --unstack against megatron's own per-layer tensors
# --------------------------------------------------------------------------------------------

def test_unstack_gives_megatrons_per_layer_tensors(tmp_path, ckpt):
    """megatron_torch_dist_tp2 stores decoder.layers.* stacked; gen_megatron.py recorded megatron's own
    per-layer tensors (a TP 1 model loading the save, its sharded state dict with per-layer keys
    `decoder.layers.<i>.…`). `convert --unstack` must give exactly those, byte for byte."""
    from safetensors.numpy import load_file

    out = tmp_path / "unstacked"
    r = ckpt("convert", TP2, out, "--to", "safetensors", "--unstack", "decoder/layers/{i}/**", "--skip-unsupported")
    assert r.returncode == 0, r.stderr
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(str(f)))
    per_layer = json.loads((TP2 / "_reference.json").read_text())["per_layer"]
    assert len(per_layer) == 24
    layers = {k: v for k, v in got.items() if k.startswith("decoder.layers.")}
    assert sorted(layers) == sorted(r["keys"][0] for r in per_layer)
    for rec in per_layer:
        arr = layers[rec["keys"][0]]
        assert (list(arr.shape), str(arr.dtype)) == (rec["shape"], rec["dtype"]), rec["keys"]
        assert hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest() == rec["sha256"], rec["keys"]
    # the stacked keys are gone; the rest is as stored
    assert not any(k.startswith("decoder.layers.") and not k.split(".")[2].isdigit() for k in got)
    assert "embedding.word_embeddings.weight" in got


# --------------------------------------------------------------------------------------------
# no torch, no megatron
# --------------------------------------------------------------------------------------------

def test_inspect_and_validate_import_neither_torch_nor_megatron():
    code = (
        "import sys\nfrom ckpt_tool.cli.main import main\n"
        "for path in sys.argv[1:]:\n"
        "    for args in (['inspect', path], ['validate', '--deep', '--strict', path]):\n"
        "        try:\n            main(args)\n        except SystemExit as e:\n            assert e.code == 0, (args, e.code)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'nemo', 'jax', 'zarr')]\n"
        "assert not bad, bad\n"
    )
    paths = [RUN, ZARR, LEGACY, NEMO, FIXTURES / "megatron_torch_dist_fully_sharded"]
    r = subprocess.run([sys.executable, "-c", code, *map(str, paths)], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]

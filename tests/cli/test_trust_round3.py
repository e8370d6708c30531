"""Trust, third round (issue 44, items 2-4): no "same" for a broken side, no damage recorded as
the reference, no user's entry deleted by --overwrite.

Measured on 497d606 before the fixes:
- item 2: with one DCP rank file deleted, `ckpt diff A B` printed `same: ... match` and exited
  0; a partial Hugging Face download (a shard missing) showed only "only in A" lines. diff now
  runs convert's completeness check (engine.check_source_complete) on both sides and exits 1
  naming the incomplete side.
- item 3: after one flipped byte, `ckpt manifest write` silently replaced integrity.json, and
  `verify` then passed the damaged file. It now compares the hashes it computes with the old
  manifest's and refuses on a difference (one line per file), unless --rebaseline.
- item 4: `--overwrite` deleted a user's `release/notes.txt`, `step-1/`, `global_step_3/`,
  a text file `latest` or `checkpoint_5` inside a DCP checkpoint used as DST, because another
  framework's run root names them so. What belongs to DST is what the format that recognised it
  writes (its registry entry: claims, parts, part_dirs, part_checkpoints), nothing else.

Inputs: the committed fixtures (written by torch, safetensors, transformers, orbax, flax,
Megatron-Core and DeepSpeed), copied and damaged the way a lost rank, a partial download or a
flipped bit damages them.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tool import formats
from conftest import FIXTURES, run_ckpt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "conformance"))  # each format's rows: the catalogue
import catalogue as C  # noqa: E402


def _copy(tmp_path: Path, fixture: str, name: str = "b") -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / fixture, dst, symlinks=True)
    return dst


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    return lines[0]


# -- item 2: diff checks both sides' completeness ------------------------------------------------

# (fixture, the file lost, what the refusal names): a rank's file, a shard of a download, a chunk
INCOMPLETE = [
    ("dcp_multirank", "__1_0.distcp", "missing-file: __1_0.distcp"),
    ("safetensors_llama_sharded", "model-00002-of-00004.safetensors", "missing-file: model-00002-of-00004.safetensors"),
    ("torch_hf_bin_sharded", "pytorch_model-00002-of-00003.bin", "missing-file: pytorch_model-00002-of-00003.bin"),
    ("orbax_plain_zarr2", "layers.0.w/0.0", "missing-chunk: layers.0.w/0.0"),
    ("orbax_manager", "2/state/ocdbt.process_0/d/4866bb9851d8ed5fd544d8255bc24bfb", "lost-process-data"),
    ("t5x", "checkpoint_1/target.encoder.layers_0.attention.out.kernel/0.0",  # msgpack's T5X arrays
     "missing-chunk: checkpoint_1/target.encoder.layers_0.attention.out.kernel/0.0"),
    ("megatron_torch_dist_tp2", "__1_1.distcp", "missing-file: __1_1.distcp"),
    ("megatron_distopt_dp4", "__2_1.distcp", "missing-file: __2_1.distcp"),
    ("deepspeed_z2_fp32_dp4", "global_step2/zero_pp_rank_2_mp_rank_00_optim_states.pt", "rank file missing"),
    ("deepspeed_universal_z1_fp32", "global_step2_universal/zero/embed.weight/exp_avg.pt",
     "missing-file: global_step2_universal/zero/embed.weight/exp_avg.pt"),
]


@pytest.mark.slow
@pytest.mark.parametrize("fixture, lost, named", INCOMPLETE, ids=[row[0] for row in INCOMPLETE])
def test_diff_refuses_an_incomplete_side_and_names_it(tmp_path, fixture, lost, named):
    broken = _copy(tmp_path, fixture)
    (broken / lost).unlink()
    whole = str(FIXTURES / fixture)
    line = _one_error_line(run_ckpt("diff", whole, str(broken)))
    assert line.startswith(f"ckpt: error: {broken}: B is incomplete: "), line
    assert named in line and f"ckpt validate {broken}" in line, line
    # either side: A named when A is the broken one; --json says so too, with no "same"
    r = run_ckpt("diff", str(broken), whole, "--json")
    assert r.returncode == 1, r.stderr
    error = json.loads(r.stdout)["error"]
    assert error["code"] == "incomplete" and error["message"].startswith(f"{broken}: A is incomplete: "), error


@pytest.mark.slow
def test_a_cut_flax_msgpack_file_is_one_line_naming_it(tmp_path):
    """A Flax msgpack checkpoint is one file: cut short, it cannot be opened at all (one line, exit 1;
    this held before, and still does with the check in front)."""
    broken = _copy(tmp_path, "flax_msgpack")
    with open(broken / "checkpoint_2", "r+b") as f:
        f.truncate(300)
    line = _one_error_line(run_ckpt("diff", str(FIXTURES / "flax_msgpack"), str(broken)))
    assert line.startswith(f"ckpt: error: {broken}/checkpoint_2: ") and "longer than the file" in line, line


@pytest.mark.slow
def test_a_partial_download_is_not_a_list_of_only_in_lines(tmp_path):
    """The new-user trial's case: an HF download that stopped after some shards. Before: one
    "only in A" line per lost tensor and "different", with no word that B is incomplete."""
    broken = _copy(tmp_path, "safetensors_llama_sharded")
    for shard in ("model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors"):
        (broken / shard).unlink()
    r = run_ckpt("diff", str(FIXTURES / "safetensors_llama_sharded"), str(broken), "--values")
    line = _one_error_line(r)
    assert "B is incomplete: missing-file: model-00003-of-00004.safetensors" in line and "(and 1 more)" in line, line
    assert "only in" not in r.stdout and "only_a" not in r.stdout, r.stdout


@pytest.mark.slow
def test_diff_of_two_steps_of_a_root_names_the_torn_one(tmp_path):
    """--step-a/--step-b of one run root: the side whose step lost a file is named, with its --step."""
    root = _copy(tmp_path, "orbax_manager", "root")
    for f in (root / "2" / "state" / "ocdbt.process_0" / "d").iterdir():
        f.unlink()
    line = _one_error_line(run_ckpt("diff", str(root), "--step-a", "1", "--step-b", "2"))
    assert ": B is incomplete: lost-process-data: " in line and f"ckpt validate {root} --step 2" in line, line


@pytest.mark.slow
def test_diff_of_complete_sides_still_compares(tmp_path):
    """The check refuses only what validate finds: a whole copy is compared as before."""
    copy = _copy(tmp_path, "dcp_multirank")
    r = run_ckpt("diff", str(FIXTURES / "dcp_multirank"), str(copy))
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1].startswith("same: "), (r.stdout, r.stderr)


def test_the_library_diff_refuses_an_incomplete_side_too(tmp_path):
    import ckpt_tool
    from ckpt_tool.ops.diff import diff_checkpoints
    from ckpt_tool.base.errors import IncompleteCheckpointError

    broken = _copy(tmp_path, "dcp_multirank")
    (broken / "__0_0.distcp").unlink()
    a, b = ckpt_tool.open(str(FIXTURES / "dcp_multirank")), ckpt_tool.open(str(broken))
    with pytest.raises(IncompleteCheckpointError, match="B is incomplete: missing-file: __0_0.distcp"):
        diff_checkpoints(a, b)


# -- item 3: `manifest write` never records damage as the reference -------------------------------


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


# (fixture, the file a bit flips in): safetensors and Orbax zarr carry no checksum of their own,
# so only the manifest can tell; DCP's .metadata none either
FLIPPED = [
    ("safetensors_llama_sharded", "model-00004-of-00004.safetensors"),
    ("orbax_plain_zarr2", "layers.0.w/0.0"),
    ("dcp_single", ".metadata"),
]


@pytest.mark.slow
@pytest.mark.parametrize("fixture, name", FLIPPED, ids=[row[0] for row in FLIPPED])
def test_manifest_write_refuses_to_record_a_flipped_byte(tmp_path, fixture, name):
    ckpt = _copy(tmp_path, fixture, "m")
    (ckpt / "_reference.json").unlink(missing_ok=True)
    assert run_ckpt("manifest", "write", str(ckpt)).returncode == 0
    manifest = (ckpt / "integrity.json").read_bytes()
    _flip(ckpt / name, (ckpt / name).stat().st_size - 10)
    r = run_ckpt("manifest", "write", str(ckpt))
    line = _one_error_line(r)
    assert line.startswith(f"ckpt: error: {ckpt}/integrity.json: 1 file differs from the sha256 integrity.json "
                           f"records (changed: {name}: sha256 "), line
    assert "--rebaseline" in line, line
    assert r.stdout.strip() == f"changed: {name}: sha256 " + line.split(f"changed: {name}: sha256 ")[1].split(")")[0]
    # the reference is untouched: verify and validate --deep still find the damage
    assert (ckpt / "integrity.json").read_bytes() == manifest
    verify = run_ckpt("manifest", "verify", str(ckpt), "--json")
    assert verify.returncode == 1 and ("digest-mismatch", name) in [
        (f["code"], f["file"]) for f in json.loads(verify.stdout)["findings"]]
    assert run_ckpt("validate", str(ckpt), "--deep").returncode == 1
    # --rebaseline: the files as they are now are the reference, and it says what it accepted
    r = run_ckpt("manifest", "write", str(ckpt), "--rebaseline", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["replaced"] == "ckpt's manifest" and [d.split(": ")[:2] for d in doc["rebaselined"]] == [["changed", name]]
    assert run_ckpt("manifest", "verify", str(ckpt)).returncode == 0


@pytest.mark.slow
def test_manifest_write_names_each_cause_on_its_own_line(tmp_path):
    """A file gone, a file changed (and its size), a file added: one line per file that differs,
    on stdout before the error line (under error.details with --json); an added file is none."""
    ckpt = _copy(tmp_path, "safetensors_llama_sharded", "m")
    assert run_ckpt("manifest", "write", str(ckpt)).returncode == 0
    (ckpt / "model-00001-of-00004.safetensors").unlink()
    with open(ckpt / "model-00003-of-00004.safetensors", "ab") as f:
        f.write(b"\0" * 8)
    (ckpt / "notes.txt").write_text("added later\n")
    r = run_ckpt("manifest", "write", str(ckpt))
    line = _one_error_line(r)
    assert "2 files differ from the sha256 integrity.json records (listed above)" in line, line
    lines = r.stdout.rstrip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == "  missing: model-00001-of-00004.safetensors: named by integrity.json, which records its sha256"
    assert lines[1].startswith("  changed: model-00003-of-00004.safetensors: sha256 ") and \
        "(8,680 bytes where it records 8,672)" in lines[1], lines[1]
    r = run_ckpt("manifest", "write", str(ckpt), "--json")
    error = json.loads(r.stdout)["error"]
    assert r.returncode == 1 and error["code"] == "manifest-mismatch" and len(error["details"]) == 2, error
    r = run_ckpt("manifest", "write", str(ckpt), "--rebaseline")
    assert r.returncode == 0 and "(replaced ckpt's manifest; 1 file added since)" in r.stdout, r.stdout
    assert r.stdout.count("  rebaselined ") == 2, r.stdout


@pytest.mark.slow
def test_an_unchanged_checkpoint_is_written_again_without_a_word(tmp_path):
    ckpt = _copy(tmp_path, "dcp_single", "m")
    assert run_ckpt("manifest", "write", str(ckpt)).returncode == 0
    r = run_ckpt("manifest", "write", str(ckpt), "--tensors")  # (per-tensor digests added: no difference)
    assert r.returncode == 0 and r.stdout.startswith(f"wrote {ckpt}/integrity.json: ") and \
        r.stdout.rstrip().endswith("(replaced ckpt's manifest)"), r.stdout


@pytest.mark.slow
def test_megatrons_manifest_is_a_reference_too(tmp_path):
    """--overwrite keeps its meaning (replace a manifest ckpt did not write); a file that differs
    from what Megatron's own manifest records still takes --rebaseline."""
    import hashlib

    save = _copy(tmp_path, "megatron_torch_dist_tp2", "save")
    (save / "_reference.json").unlink()
    files = {e.name: hashlib.sha256(e.read_bytes()).hexdigest() for e in sorted(save.iterdir()) if e.is_file()}
    (save / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": files}, indent=2))
    _flip(save / "common.pt", 100)
    line = _one_error_line(run_ckpt("manifest", "write", str(save), "--overwrite"))
    assert "1 file differs from the sha256 integrity.json records (changed: common.pt: " in line, line
    assert "ckpt" not in json.loads((save / "integrity.json").read_text())  # still Megatron's
    r = run_ckpt("manifest", "write", str(save), "--overwrite", "--rebaseline", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["replaced"] == "another writer's manifest", r.stderr


# -- item 4: --overwrite deletes only what the format that recognised DST writes -----------------


def _snapshot(path: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(path.rglob("*"))}


# a user's entries named as another framework names its steps or pointer (Megatron's release/,
# torchtitan's step-N/, verl's global_step_N/, NeMo's ...-step=N/, DeepSpeed's `latest`, Flax's
# checkpoint_N): each alone beside a checkpoint, where the run-root rules used to claim it
USERS_ENTRIES = {
    "release/notes.txt": "a release candidate, keep\n",
    "step-1/notes.txt": "my own folder\n",
    "global_step_3/notes.txt": "eval results\n",
    "x-step=5/context/notes.txt": "a sweep's notes\n",  # (a `context/` inside: NeMo's step marker)
    "latest": "latest experiment: lr 3e-4\n",
    "checkpoint_5": "see checkpoint 5 in the wandb run\n",
}

def _dst_fixture(fmt: str) -> str:
    """A checkpoint of `fmt` written by its library: the first catalogue row of it that is one whole
    directory (not a step of a root, nothing beside it but the generator's _reference.json)."""
    from ckpt_tool.formats import contents
    from ckpt_tool.storage import Storage

    for e in C.ENTRIES:
        if e.format != fmt or e.step is not None or "/" in e.path or e.path in C.NOT_CHECKPOINTS:
            continue
        if (FIXTURES / e.path).is_dir():
            found = contents(Storage.open(str(FIXTURES / e.path)))
            if found.format.name == fmt and not found.steps and set(found.others) <= {"_reference.json"}:
                return e.path
    raise AssertionError(f"no whole {fmt} checkpoint among the fixtures")


def _source_for(fmt: str) -> str:
    """A fixture that `convert --to fmt` takes whole (its writes_from; leaves it holds): one of its
    own format where there is one."""
    rows = [e for e in C.ENTRIES if e.step is None and C.takes(fmt, e.format) and fmt not in C.refusals(e)]
    return next((e.path for e in rows if e.format == fmt), rows[0].path)


def _dst_with(tmp_path: Path, fixture: str, entry: str) -> Path:
    dst = _copy(tmp_path, fixture, "dst")
    (dst / "_reference.json").unlink(missing_ok=True)  # the generators' answers, not the checkpoint's
    (dst / entry).parent.mkdir(parents=True, exist_ok=True)
    (dst / entry).write_text(USERS_ENTRIES.get(entry, "mine\n"))
    return dst


@pytest.mark.parametrize("fmt", formats.writable())
@pytest.mark.parametrize("entry", sorted(USERS_ENTRIES))
def test_overwrite_keeps_a_users_entry_named_like_a_frameworks_step(tmp_path, fmt, entry):
    from ckpt_tool.ops.engine import ConvertOptions, convert
    from ckpt_tool.base.errors import DestinationExistsError

    dst = _dst_with(tmp_path, _dst_fixture(fmt), entry)
    source = _source_for(fmt)
    before = _snapshot(dst)
    top = entry.split("/")[0] + ("/" if "/" in entry else "")
    with pytest.raises(DestinationExistsError) as info:
        convert(str(FIXTURES / source), str(dst), ConvertOptions(to=fmt, overwrite=True))
    message = info.value.message
    # (a DeepSpeed pointer `latest` that names no tag makes the folder no checkpoint at all: refused too)
    assert (f"a checkpoint ({fmt}) beside 1 " in message and f"({top}) that is not part of it" in message) or (
        entry == "latest" and "that are not a checkpoint" in message and "latest," in message), message
    assert "refusing to replace it" in message, message
    assert _snapshot(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # no temporary left


@pytest.mark.slow
def test_overwrite_refusal_is_one_line_and_the_checkpoint_alone_is_replaced(tmp_path):
    """The CLI says it in one line; without the user's entry the same DST is replaced."""
    dst = _dst_with(tmp_path, "dcp_single", "release/notes.txt")
    line = _one_error_line(run_ckpt("convert", str(FIXTURES / "safetensors_numpy"), str(dst), "--to", "dcp",
                                    "--overwrite"))
    assert line == (f"ckpt: error: {dst}: destination is a checkpoint (dcp) beside 1 directory (release/) that is "
                    "not part of it; refusing to replace it: ckpt deletes only a checkpoint's own files; move the "
                    "others out, or choose another destination"), line
    shutil.rmtree(dst / "release")
    r = run_ckpt("convert", str(FIXTURES / "safetensors_numpy"), str(dst), "--to", "dcp", "--overwrite", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["cleanup"] == [
        f"replaced a checkpoint (dcp) at {dst}: 2 entries (.metadata, __0_0.distcp)"], (r.stdout, r.stderr)


@pytest.mark.parametrize("fixture, entry", [
    ("megatron_torch_dist_tp2", "iter_0000005/notes.txt"),  # Megatron-LM's step name, not a Megatron save
    ("megatron_torch_dist_tp2", "release/notes.txt"),
    ("megatron_legacy", "release/notes.txt"),  # beside a Megatron-LM run's iter_0000005/
])
def test_a_step_name_is_part_of_a_checkpoint_only_when_it_is_one(tmp_path, fixture, entry):
    """A format whose checkpoints do hold such entries (Megatron-LM's iter_N/ and release/) owns
    them only when they are checkpoints of that format."""
    from ckpt_tool.ops.engine import ConvertOptions, convert
    from ckpt_tool.base.errors import DestinationExistsError

    dst = _dst_with(tmp_path, fixture, entry)
    before = _snapshot(dst)
    with pytest.raises(DestinationExistsError, match=r"beside 1 directory \(" + entry.split("/")[0] + r"/\)"):
        convert(str(FIXTURES / "safetensors_numpy"), str(dst), ConvertOptions(to="dcp", overwrite=True))
    assert _snapshot(dst) == before


@pytest.mark.slow
@pytest.mark.parametrize("key", ["release/notes.txt", "latest"])
def test_the_same_rule_on_s3(key):
    """An object-store prefix is judged by the same rule (formats.contents over its listing)."""
    from conftest import moto_s3_serving, s3_client

    bucket = "ckpt-trust-round3"
    with moto_s3_serving(bucket, ["dcp_single"]) as env:
        s3 = s3_client(env["AWS_ENDPOINT_URL"])
        s3.put_object(Bucket=bucket, Key=f"run/dcp_single/{key}", Body=b"mine\n")
        url = f"s3://{bucket}/run/dcp_single"
        line = _one_error_line(run_ckpt("convert", str(FIXTURES / "safetensors_numpy"), url, "--to", "dcp",
                                        "--overwrite", env=env))
        top = key.split("/")[0] + ("/" if "/" in key else "")
        assert f"a checkpoint (dcp) beside 1 " in line and f"({top}) that is not part of it" in line, line
        keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="run/")["Contents"])
        assert f"run/dcp_single/{key}" in keys and "run/dcp_single/.metadata" in keys, keys

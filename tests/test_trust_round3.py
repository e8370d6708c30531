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
  writes (its registry entry: claims, parts, part_dirs, `nests`), nothing else.

Inputs: the committed fixtures (written by torch, safetensors, transformers, orbax, flax,
Megatron-Core and DeepSpeed), copied and damaged the way a lost rank, a partial download or a
flipped bit damages them.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import FIXTURES, run_ckpt


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
    ("megatron_torch_dist_tp2", "__1_1.distcp", "missing-file: __1_1.distcp"),
    ("megatron_distopt_dp4", "__2_1.distcp", "missing-file: __2_1.distcp"),
    ("deepspeed_z2_fp32_dp4", "global_step2/zero_pp_rank_2_mp_rank_00_optim_states.pt", "rank file missing"),
    ("deepspeed_universal_z1_fp32", "global_step2_universal/zero/embed.weight/exp_avg.pt",
     "missing-file: global_step2_universal/zero/embed.weight/exp_avg.pt"),
]


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


def test_diff_of_two_steps_of_a_root_names_the_torn_one(tmp_path):
    """--step-a/--step-b of one run root: the side whose step lost a file is named, with its --step."""
    root = _copy(tmp_path, "orbax_manager", "root")
    for f in (root / "2" / "state" / "ocdbt.process_0" / "d").iterdir():
        f.unlink()
    line = _one_error_line(run_ckpt("diff", str(root), "--step-a", "1", "--step-b", "2"))
    assert ": B is incomplete: lost-process-data: " in line and f"ckpt validate {root} --step 2" in line, line


def test_diff_of_complete_sides_still_compares(tmp_path):
    """The check refuses only what validate finds: a whole copy is compared as before."""
    copy = _copy(tmp_path, "dcp_multirank")
    r = run_ckpt("diff", str(FIXTURES / "dcp_multirank"), str(copy))
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1].startswith("same: "), (r.stdout, r.stderr)


def test_the_library_diff_refuses_an_incomplete_side_too(tmp_path):
    import ckpt_tool
    from ckpt_tool.diff import diff_checkpoints
    from ckpt_tool.errors import IncompleteCheckpointError

    broken = _copy(tmp_path, "dcp_multirank")
    (broken / "__0_0.distcp").unlink()
    a, b = ckpt_tool.open(str(FIXTURES / "dcp_multirank")), ckpt_tool.open(str(broken))
    with pytest.raises(IncompleteCheckpointError, match="B is incomplete: missing-file: __0_0.distcp"):
        diff_checkpoints(a, b)

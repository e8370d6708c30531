"""`ckpt ls` and `ckpt latest` as commands (issue 22): what a launcher script sees (stdout holds only
the path, exit codes, one line on failure, --json), locally and on a real S3-compatible server."""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import fixture_path, moto_s3_serving, run_ckpt

TITAN = str(fixture_path("runs_torchtitan"))
BUCKET = "ckpt-runs"


def test_ls_table():
    r = run_ckpt("ls", TITAN)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"{TITAN}  (torchtitan (DCP), 4 steps)"
    assert lines[1].split() == ["step", "name", "format", "status", "size", "files", "modified", "pointer"]
    assert [line.split()[:4] for line in lines[2:6]] == [
        ["10", "step-10", "dcp", "committed"], ["20", "step-20", "dcp", "committed"],
        ["30", "step-30", "dcp", "committed"], ["40", "step-40", "dcp", "incomplete"]]
    assert lines[6].startswith("  step-40: no .metadata")


def test_ls_json_and_pointer(ckpt):
    r = ckpt("ls", fixture_path("megatron_run"), "--json")
    assert r.returncode == 0
    doc = json.loads(r.stdout)
    assert doc["layout"] == "megatron" and doc["pointer"] == {
        "file": "latest_checkpointed_iteration.txt", "names": "iter_0000020", "problem": None}
    assert set(doc["steps"][0]) == {"step", "name", "format", "status", "reason", "size", "files", "mtime",
                                    "pointer", "pointer_agrees", "path", "check", "fails"}
    assert [(s["step"], s["pointer"], s["pointer_agrees"]) for s in doc["steps"]] == [(10, False, None), (20, True, True)]
    r = ckpt("ls", fixture_path("megatron_run"))
    assert "<- pointer" in r.stdout.splitlines()[3] and r.stdout.splitlines()[-1] == (
        "latest_checkpointed_iteration.txt: names iter_0000020")


def test_ls_check_exit_codes(ckpt, copy_fixture):
    r = ckpt("ls", TITAN, "--check")
    assert r.returncode == 0, r.stdout  # only the torn step fails, and it is not a committed one
    assert "FAILED: missing-metadata" in r.stdout
    root = copy_fixture("runs_torchtitan")
    (root / "step-20" / "__0_0.distcp").write_bytes(b"")
    r = ckpt("ls", root, "--check", "--json")
    assert r.returncode == 1
    assert [s["check"]["ok"] for s in json.loads(r.stdout)["steps"]] == [True, False, True, False]
    r = ckpt("ls", TITAN, "--deep")
    assert r.returncode == 2 and "--deep applies to --check" in r.stderr


def test_latest_prints_only_the_path():
    r = run_ckpt("latest", TITAN)
    assert r.returncode == 0 and r.stdout == f"{TITAN}/step-30\n"
    assert r.stderr.splitlines() == [
        "ckpt: latest: skipped step-40: incomplete: no .metadata: DCP writes it last, once every rank's .distcp is written"]


def test_latest_json(ckpt):
    r = ckpt("latest", fixture_path("runs_verl"), "--json")
    assert r.returncode == 0 and r.stderr == ""
    doc = json.loads(r.stdout)
    assert (doc["ok"], doc["step"], doc["name"], doc["layout"]) == (True, 4, "global_step_4", "verl")
    assert doc["path"] == f"{fixture_path('runs_verl')}/global_step_4"
    assert doc["pointer"]["names"] == "global_step_4"
    assert [s["name"] for s in doc["skipped"]] == ["global_step_6"]


def test_latest_none_is_exit_1_one_line(ckpt, copy_fixture):
    root = copy_fixture("runs_torchtitan")
    for step in ("step-10", "step-20", "step-30"):
        (root / step / ".metadata").unlink()
    r = ckpt("latest", root)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"ckpt: error: {root}: no step that is complete and passes validate (4 passed over; newest: "
        "step-40: incomplete: no .metadata: DCP writes it last, once every rank's .distcp is written)"]
    r = ckpt("latest", root, "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["ok"] is False and json.loads(r.stdout)["path"] is None


def test_pointer_target_failing_is_named_on_stderr(ckpt, copy_fixture):
    root = copy_fixture("megatron_run")
    (root / "iter_0000020" / "common.pt").unlink()
    r = ckpt("latest", root)
    assert r.returncode == 0 and r.stdout == f"{root}/iter_0000010\n"
    assert r.stderr.startswith(
        "ckpt: latest: skipped iter_0000020 (named by latest_checkpointed_iteration.txt): fails validate: ")


def test_not_a_run_root_one_line(ckpt):
    r = ckpt("ls", fixture_path("dcp_single"))
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1 and "not a run root" in r.stderr
    r = ckpt("latest", fixture_path("dcp_single"), "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "not-found"


@pytest.mark.slow
def test_launcher_script(tmp_path):
    """docs/commands/latest.md's shell recipe: resume from what `ckpt latest` prints, start fresh when it exits 1."""
    import subprocess
    import sys

    script = tmp_path / "launch.sh"
    script.write_text(
        '#!/bin/sh\n'
        f'if RESUME=$("{sys.executable}" -m ckpt_tool latest "$1" 2>/dev/null); then\n'
        '  echo "resume $RESUME"\n'
        'else\n'
        '  echo "fresh start"\n'
        'fi\n')
    out = subprocess.run(["sh", str(script), TITAN], capture_output=True, text=True, timeout=60).stdout
    assert out == f"resume {TITAN}/step-30\n"
    empty = tmp_path / "empty"
    shutil.copytree(fixture_path("runs_torchtitan") / "step-40", empty / "step-40")
    out = subprocess.run(["sh", str(script), str(empty)], capture_output=True, text=True, timeout=60).stdout
    assert out == "fresh start\n"


# -- on S3 -------------------------------------------------------------------------------------------------

S3_ROOTS = ["runs_torchtitan", "runs_orbax", "runs_verl", "megatron_run"]


@pytest.fixture(scope="module")
def s3_env():
    with moto_s3_serving(BUCKET, S3_ROOTS) as env:
        yield env


@pytest.mark.slow
@pytest.mark.parametrize("name", S3_ROOTS)
def test_ls_and_latest_on_s3_equal_local(s3_env, name):
    url = f"s3://{BUCKET}/run/{name}"
    remote = run_ckpt("ls", url, "--json", env=s3_env)
    assert remote.returncode == 0 and remote.stderr == "", remote.stderr
    local = json.loads(run_ckpt("ls", str(fixture_path(name)), "--json").stdout)
    doc = json.loads(remote.stdout)
    keep = ("step", "name", "format", "status", "reason", "files", "pointer", "pointer_agrees")
    assert [{k: s[k] for k in keep} for s in doc["steps"]] == [{k: s[k] for k in keep} for s in local["steps"]]
    assert all(s["size"] is None and s["mtime"] is None for s in doc["steps"])  # a LIST only
    sized = json.loads(run_ckpt("ls", url, "--json", "--sizes", env=s3_env).stdout)
    assert [s["size"] for s in sized["steps"]] == [s["size"] for s in local["steps"]]
    r = run_ckpt("latest", url, env=s3_env)
    want = run_ckpt("latest", str(fixture_path(name))).stdout.rsplit("/", 1)[-1]
    assert r.returncode == 0 and r.stdout == f"{url}/{want}", r.stderr


@pytest.mark.slow
def test_diff_across_steps_on_s3(s3_env):
    url = f"s3://{BUCKET}/run/runs_torchtitan"
    r = run_ckpt("diff", url, "--step-a", "30", "--step-b", "latest", "--values", env=s3_env)
    assert r.returncode == 0 and r.stdout.startswith("same:"), r.stdout + r.stderr


# -- on GCS: orbax's commit rule there (commit_success.txt, else the commit timestamp) ----------------

from test_orbax_versions import gcs  # noqa: E402,F401 - the GCS emulator fixture (module scope)


@pytest.mark.slow
def test_orbax_root_on_gcs_follows_the_gs_commit_rule(gcs):  # noqa: F811
    env, upload = gcs
    src = fixture_path("orbax_v0_9") / "manager_plain"  # orbax 0.9: commit timestamps, no commit_success.txt
    url = upload(src)  # copied to gs:// from a disk: committed by its timestamp (orbax needs the marker there)
    r = run_ckpt("ls", url, "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert [(s["name"], s["status"]) for s in json.loads(r.stdout)["steps"]] == [("1", "committed"), ("2", "committed")]
    url = upload(src, drop_timestamp=True)  # neither record: those saves never finished
    doc = json.loads(run_ckpt("ls", url, "--json", env=env).stdout)
    assert [s["status"] for s in doc["steps"]] == ["incomplete", "incomplete"]
    assert "no commit_timestamp_nsecs and there is no commit_success.txt on gs://" in doc["steps"][0]["reason"]
    r = run_ckpt("latest", url, env=env)
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1 and r.stdout == ""

"""Errors name the right thing (issue 18, item 12).

One finding per unreadable data file with the OS's reason; a file inside a
checkpoint names the directory to open; a file of another format says what
it is by its bytes; URLs are shown whole; a truncated OCDBT data file is
worded as `ckpt validate` words it, never as tensorstore's OUT_OF_RANGE text.
Every case runs the CLI as a whole process on real files.
"""
from __future__ import annotations

import gzip
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import ckpt_tool
from ckpt_tool import formats
from conftest import FIXTURES, unreadable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "conformance"))  # each format's rows: the catalogue
import catalogue as C  # noqa: E402

# the ckpt_tool this test imports is the one the CLI runs (python -m from its own tree)
CODE_ROOT = Path(ckpt_tool.__file__).resolve().parent.parent
# every format's title, in the registry's order for people: "Orbax, ..., safetensors, ... and DeepSpeed universal"
TITLES = [f.title for f in formats.shown()]


def _titles(conjunction: str) -> str:
    return ", ".join(TITLES[:-1]) + f" {conjunction} " + TITLES[-1]


def _a(text: str) -> str:
    """The text with its article ("an Orbax", "a safetensors")."""
    return f"{'an' if text[0] in 'AEIOU' else 'a'} {text}"


READS = f"{_titles('and')} checkpoints"


def ckpt(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CKPT_DEBUG"}
    return subprocess.run([*prefix, sys.executable, "-m", "ckpt_tool", *args], capture_output=True, text=True,
                          env=env, cwd=CODE_ROOT, timeout=120)


def one_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


# -- a data file the OS will not let us read ---------------------------------------------


@pytest.mark.parametrize("deep", [False, True], ids=["shallow", "deep"])
def test_unreadable_distcp_is_one_finding_with_the_os_reason(tmp_path, deep):
    ckpt_dir = tmp_path / "dcp"
    shutil.copytree(FIXTURES / "dcp_multirank", ckpt_dir)
    with unreadable(ckpt_dir / "__0_0.distcp") as prefix:
        r = ckpt("validate", str(ckpt_dir), "--json", *(["--deep"] if deep else []), prefix=prefix)
    assert r.returncode == 1, r.stderr
    findings = json.loads(r.stdout)["findings"]
    about_it = [f for f in findings if f["file"] == "__0_0.distcp"]
    assert [f["code"] for f in findings if f["code"] == "bad-metadata"] == []  # .metadata is not to blame
    assert about_it[0]["code"] == "unreadable-file"  # (not missing: it is there)
    assert about_it[0]["message"].startswith("data file cannot be read (Permission denied); .metadata places 7 items")
    if not deep:
        assert len(findings) == 1, findings


def test_unreadable_distcp_only_that_file(tmp_path):
    """The readable rank's file is not reported; shallow validate names the one file."""
    ckpt_dir = tmp_path / "dcp"
    shutil.copytree(FIXTURES / "dcp_multirank", ckpt_dir)
    with unreadable(ckpt_dir / "__1_0.distcp") as prefix:
        r = ckpt("validate", str(ckpt_dir), prefix=prefix)
    assert r.returncode == 1
    errors = [line.strip() for line in r.stdout.splitlines() if line.strip().startswith("error ")]
    assert len(errors) == 1 and errors[0].endswith("__1_0.distcp"), r.stdout
    assert "error unreadable-file: data file cannot be read (Permission denied)" in errors[0]


# -- a file inside a checkpoint --------------------------------------------------------

# each format's files inside its fixtures (its catalogue file's INSIDE rows)
INSIDE = [(i.path, _a(formats.get(i.format).title), i.directory) for i in C.CATALOGUE.inside]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["inspect", "validate"])
@pytest.mark.parametrize("rel, kind, directory", INSIDE, ids=[i[0] for i in INSIDE])
def test_file_inside_a_checkpoint_names_its_directory(command, rel, kind, directory):
    path = FIXTURES / rel
    r = ckpt(command, str(path))
    assert one_line(r) == (
        f"ckpt: error: {path}: is a file inside {kind} checkpoint; open its directory: "
        f"ckpt {command} {FIXTURES / directory}"
    )
    # and what it suggests works
    assert ckpt(command, str(FIXTURES / directory)).returncode == 0


@pytest.mark.slow
def test_file_inside_a_checkpoint_relative_path():
    r = ckpt("inspect", "fixtures/dcp_multirank/.metadata")
    assert one_line(r) == (
        "ckpt: error: fixtures/dcp_multirank/.metadata: is a file inside a torch.distributed.checkpoint (DCP) "
        "checkpoint; open its directory: ckpt inspect fixtures/dcp_multirank"
    )


# -- files of other formats, told by their bytes -----------------------------------------


def _write_files(d: Path) -> dict[str, str]:
    """Real files of formats ckpt does not read, named so that no extension gives them away."""
    import torch

    torch.save({"w": torch.ones(2)}, d / "torch_zip")
    torch.save({"w": torch.ones(2)}, d / "torch_legacy", _use_new_zipfile_serialization=False)
    np.save(d / "array", np.ones(3))
    os.rename(d / "array.npy", d / "array")
    np.savez(d / "arrays", x=np.ones(3))
    os.rename(d / "arrays.npz", d / "arrays")
    (d / "compressed").write_bytes(gzip.compress(b"hello"))
    with zipfile.ZipFile(d / "archive", "w") as zf:
        zf.writestr("x.txt", "hi")
    (d / "pickled").write_bytes(pickle.dumps({"a": 1}))
    return {
        "torch_zip": "a torch.save archive (.pt / .bin: a zip holding data.pkl)",
        "torch_legacy": "a legacy torch.save file (pickle format, before torch 1.6)",
        "array": "a numpy .npy array",
        "arrays": "a numpy .npz archive",
        "compressed": "a gzip-compressed file",
        "archive": "a zip archive",
        "pickled": "a Python pickle",
    }


@pytest.fixture(scope="module")
def other_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("other")
    return d, _write_files(d)


# (torch.save files, zip or legacy, are the torch.save format's: tests/formats/torch_save/test_torch_save.py)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["array", "arrays", "compressed", "archive", "pickled"])
@pytest.mark.parametrize("command", ["inspect", "validate"])
def test_other_format_file_says_what_it_is(other_files, name, command):
    d, kinds = other_files
    line = one_line(ckpt(command, str(d / name)))
    hint = "; decompress it first (a .tar.gz holds a directory: extract it and open that)" if name == "compressed" else ""
    assert line == f"ckpt: error: {d / name}: is {kinds[name]}: not a format ckpt reads (it reads {READS}){hint}"


def test_directory_of_other_format_files_says_what_they_are(other_files):
    d, _ = other_files
    line = one_line(ckpt("inspect", str(d)))
    assert line.startswith(
        f"ckpt: error: {d}: not a checkpoint format ckpt reads: found gzip files, numpy files, pickle files, "
        "torch.save files and zip archives ("
    ), line


def test_plain_file_is_still_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    assert one_line(ckpt("inspect", str(tmp_path / "notes.txt"))) == (
        f"ckpt: error: {tmp_path / 'notes.txt'}: is a file, not a checkpoint directory"
    )


def test_unknown_directory_lists_every_format_read(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    assert one_line(ckpt("inspect", str(tmp_path))) == (
        f"ckpt: error: {tmp_path}: not {_a(_titles('or'))} checkpoint (found readme.txt)"
    )


# -- URLs, whole ------------------------------------------------------------------------

URL = "https://example.com/models/run1/model.safetensors"
UNSUPPORTED = f"ckpt: error: {URL}: https:// URLs are not supported (ckpt opens a path, file://, gs://, s3:// or memory://)"


@pytest.mark.parametrize("args", [
    ["inspect", URL], ["validate", URL], ["diff", str(FIXTURES / "safetensors_numpy"), URL],
    ["convert", URL, "OUT", "--to", "dcp"],
], ids=["inspect", "validate", "diff", "convert"])
def test_https_url_is_shown_whole(tmp_path, args):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    assert one_line(ckpt(*args)) == UNSUPPORTED
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_https_url_of_a_bucket_suggests_its_scheme():
    url = "https://storage.googleapis.com/my-bucket/runs/7/model.safetensors"
    assert one_line(ckpt("inspect", url)).endswith("; for this bucket use gs://my-bucket/runs/7/model.safetensors")
    url = "https://my-bucket.s3.us-west-2.amazonaws.com/runs/7/"
    assert one_line(ckpt("validate", url)).endswith("; for this bucket use s3://my-bucket/runs/7/")


def test_other_scheme_is_shown_whole():
    url = "ftp://host/a/b/model.safetensors"
    assert one_line(ckpt("inspect", url)) == (
        f"ckpt: error: {url}: unsupported storage URL scheme 'ftp' (use a path, file://, gs://, s3:// or memory://)"
    )


# -- a truncated OCDBT data file --------------------------------------------------------


@pytest.fixture
def truncated_ocdbt(tmp_path):
    root = tmp_path / "orbax"
    shutil.copytree(FIXTURES / "orbax_ocdbt_zarr2", root)
    data = next((root / "d").iterdir())  # the merged database's one data file
    need = data.stat().st_size
    with open(data, "r+b") as fh:
        fh.truncate(100)
    return root, data, need


@pytest.mark.slow
def test_truncated_ocdbt_data_file_is_worded_as_validate_words_it(truncated_ocdbt):
    root, data, need = truncated_ocdbt
    wording = f"OCDBT data file has 100 bytes but the database needs {need}"
    r = ckpt("validate", str(root), "--json")
    lost = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "lost-process-data"]
    assert [(f["message"].split(" (")[0], f["file"]) for f in lost] == [(wording, f"d/{data.name}")]
    # the file held the merged index: its one finding names every array it takes (issue 45)
    assert lost[0]["count"] == 19 and lost[0]["message"].endswith(" and 16 more)")
    # inspect reads the array metadata through the database: the same words, naming the file
    line = one_line(ckpt("inspect", str(root)))
    assert line == f"ckpt: error: {data}: {wording}"


@pytest.mark.parametrize("args", [["inspect", "--values"], ["convert", "OUT", "--to", "dcp"], ["diff", "OTHER", "--values"]],
                         ids=["inspect-values", "convert", "diff-values"])
def test_truncated_ocdbt_never_shows_tensorstore_text(truncated_ocdbt, tmp_path, args):
    root, _, need = truncated_ocdbt
    args = [str(tmp_path / "out") if a == "OUT" else str(FIXTURES / "orbax_ocdbt_zarr2") if a == "OTHER" else a
            for a in args]
    r = ckpt(args[0], str(root), *args[1:])
    line = one_line(r)
    assert "OUT_OF_RANGE" not in line and "not valid for value of size" not in line, line
    assert f"OCDBT data file has 100 bytes but the database needs {need}" in line, line
